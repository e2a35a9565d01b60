"""NUMA binding against a fake sysfs tree: two NUMA nodes, eight Ascend NPUs (four per node), a Huawei NIC beside
them; and the binding applied to this process and inherited by a data-loader worker."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from megatron_glue.training import affinity

pytestmark = pytest.mark.any_megatron_line

NODE_CPUS = {0: "0-15,64-79", 1: "16-31,80-95"}  # two sockets, SMT siblings numbered after the cores


def fake_sysfs(root: Path, visible_numa=True) -> Path:
    for node, cpus in NODE_CPUS.items():
        d = root / f"sys/devices/system/node/node{node}"
        d.mkdir(parents=True)
        (d / "cpulist").write_text(cpus + "\n")
    pci = root / "sys/bus/pci/devices"
    # eight NPUs: four behind each socket's root ports, listed out of address order on purpose
    addresses = ["0000:c1:00.0", "0000:01:00.0", "0000:81:00.0", "0000:41:00.0",
                 "0000:c2:00.0", "0000:02:00.0", "0000:82:00.0", "0000:42:00.0"]
    for address in addresses:
        d = pci / address
        d.mkdir(parents=True)
        (d / "vendor").write_text("0x19e5\n")
        (d / "device").write_text("0xd802\n")
        (d / "class").write_text("0x120000\n")
        bus = int(address.split(":")[1], 16)
        (d / "numa_node").write_text(f"{(0 if bus < 0x80 else 1) if visible_numa else -1}\n")
    nic = pci / "0000:3d:00.0"  # Huawei's vendor id, network class: not an NPU
    nic.mkdir(parents=True)
    (nic / "vendor").write_text("0x19e5\n")
    (nic / "device").write_text("0x0222\n")
    (nic / "class").write_text("0x020000\n")
    (nic / "numa_node").write_text("0\n")
    return root


ALL = set(range(0, 32)) | set(range(64, 96))


def test_eight_npus_two_nodes_ranks_to_cores(tmp_path):
    root = str(fake_sysfs(tmp_path))
    devices = affinity.ascend_devices(root)
    assert [d.address for d in devices] == ["0000:01:00.0", "0000:02:00.0", "0000:41:00.0", "0000:42:00.0",
                                           "0000:81:00.0", "0000:82:00.0", "0000:c1:00.0", "0000:c2:00.0"]
    plans = [affinity.plan(r, 8, "npu", root=root, environ={}, allowed=ALL) for r in range(8)]
    cores = [affinity.format_cpulist(p.cores) for p in plans]
    assert cores == ["0-7", "8-15", "64-71", "72-79", "16-23", "24-31", "80-87", "88-95"]
    assert plans[5].why == "npu:5 (PCI 0000:82:00.0) on NUMA node 1, 1 of 4 local ranks sharing its 32 cores"
    flat = [c for p in plans for c in p.cores]
    assert len(flat) == len(set(flat)) == 64  # disjoint, and every core used


def test_visible_devices_and_fewer_ranks(tmp_path):
    root = str(fake_sysfs(tmp_path))
    # ranks 0, 1 on devices 6 and 7 (node 1), rank 2 on device 0 (node 0)
    env = {"ASCEND_RT_VISIBLE_DEVICES": "6,7,0"}
    plans = [affinity.plan(r, 3, "npu", root=root, environ=env, allowed=ALL) for r in range(3)]
    assert [affinity.format_cpulist(p.cores) for p in plans] == ["16-31", "80-95", "0-15,64-79"]


def test_unreadable_topology_leaves_affinity_alone(tmp_path):
    root = str(fake_sysfs(tmp_path, visible_numa=False))
    p = affinity.plan(0, 8, "npu", root=root, environ={}, allowed=ALL)
    assert (p.cores, p.why) == (None, "npu:0 (PCI 0000:01:00.0) has no NUMA node in sysfs; affinity left as it was")
    p = affinity.plan(0, 2, "npu", root=str(tmp_path / "nothing"), environ={}, allowed=ALL)
    assert p.cores is None and p.why.startswith("0 Ascend NPUs found under")


def test_cpu_job_disjoint_sets_per_local_rank():
    plans = [affinity.plan(r, 3, "cpu", allowed={0, 1, 2, 3, 4, 5, 6}) for r in range(3)]
    assert [p.cores for p in plans] == [[0, 1, 2], [3, 4], [5, 6]]
    assert affinity.plan(0, 3, "cpu", allowed={0, 1}).why == ("no accelerator: 2 usable cores for 3 local ranks; "
                                                             "affinity left as it was")


def test_the_user_binder_and_the_opt_out_win():
    env = {"RANK": "3", "CPU_AFFINITY_CONF": "1,npu_affine:1"}
    assert affinity.bind(3, 8, "npu", environ=env) == (" rank 3: CPU affinity by torch_npu (CPU_AFFINITY_CONF="
                                                       "1,npu_affine:1, set by the user); the job binds nothing")
    assert affinity.bind(0, 2, "cpu", enabled=False, environ={}) == (" rank 0: CPU affinity left as it was "
                                                                     "(--no-bind-cores)")


def test_binding_applied_and_inherited_by_loader_workers():
    before = os.sched_getaffinity(0)
    allowed = sorted(before)
    try:
        line = affinity.bind(1, 2, "cpu", environ={"RANK": "1"})
        want = affinity.plan(1, 2, "cpu", allowed=set(allowed)).cores
        if want is None:
            pytest.skip("one core: nothing to split")
        assert os.sched_getaffinity(0) == set(want)
        assert line == f" rank 1: bound to cores {affinity.format_cpulist(want)} (no accelerator, 1 of 2 local ranks " \
                       f"sharing its {len(allowed)} cores)"
        loader = torch.utils.data.DataLoader(_Affinity(), num_workers=1, batch_size=None)
        assert set(next(iter(loader)).tolist()) == set(want)
    finally:
        os.sched_setaffinity(0, before)


class _Affinity(torch.utils.data.Dataset):
    def __len__(self):
        return 1

    def __getitem__(self, i):
        return torch.tensor(sorted(os.sched_getaffinity(0)))
