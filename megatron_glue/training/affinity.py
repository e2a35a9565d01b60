"""Each rank's process bound to the CPU cores of the NUMA node nearest its device (`--no-bind-cores`: off).

Read from sysfs (the root is injectable, so a fake tree tests it):
- NUMA nodes and their cores: `/sys/devices/system/node/node<N>/cpulist` (the kernel's cpulist format, "0-23,96-119");
- Ascend NPUs: the PCI functions under `/sys/bus/pci/devices/` of vendor 0x19e5 (Huawei's PCI vendor id, as the
  Linux kernel names it: `PCI_VENDOR_ID_HUAWEI`, drivers/net/ethernet/huawei/hinic3/hw/hinic3_pci_id_tbl.h) whose
  class is a processing accelerator (PCI base class 0x12; Huawei's NICs share the vendor id and are class 0x02),
  in PCI address order, each with its `numa_node`. Device index i is the i-th of them, or the i-th id of
  `ASCEND_RT_VISIBLE_DEVICES` when that is set. torch_npu exposes no PCI address of a device, so the address order
  is an assumption, logged with the address it picked.

The rule: the cores of the device's NUMA node (those this process may use), split evenly and disjointly among the
local ranks whose devices sit on that node, in local-rank order, so two ranks never share a core. On a machine
without devices (the CPU job), the allowed cores split the same way among all local ranks. The process is bound
before any data-loader worker or torch_npu thread exists, so the workers (forked from it) inherit the binding.

torch_npu has a binder of its own, `CPU_AFFINITY_CONF` (Ascend/pytorch at 9e73e70,
torch_npu/csrc/core/npu/NPUAffinityController.cpp; MindSpeed-LLM's scripts set `CPU_AFFINITY_CONF=1`). When a user
sets it, torch_npu binds and this module leaves the process alone (and says so): the two binders would meet in
torch_npu's conflict check, which skips its binding when the thread's mask lacks a core it expects
(`checkThreadAffinityConflict`, NPUAffinityController.cpp:322-342). The job does not set it itself: its mode 1
without `npu_affine:1` splits the cores by device index, not by NUMA node (`getNPUDefaultCores`, :97-106).
A topology that cannot be read (no sysfs, a device without a NUMA node, fewer cores than ranks) leaves the affinity
as it was and says why.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

HUAWEI_VENDOR = 0x19E5
PCI_CLASS_PROCESSING_ACCELERATOR = 0x12


@dataclass(frozen=True)
class PciDevice:
    address: str      # "0000:c1:00.0"
    device_id: int    # the PCI device id (0xd802 ...)
    numa_node: int    # -1: the kernel does not know


def parse_cpulist(text: str) -> list[int]:
    """The kernel's cpulist format: "0-3,8,10-11" -> [0, 1, 2, 3, 8, 10, 11]."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.extend(range(int(lo), int(hi or lo) + 1))
    return cpus


def format_cpulist(cpus) -> str:
    """[0, 1, 2, 3, 8] -> "0-3,8"."""
    out, cpus = [], sorted(cpus)
    i = 0
    while i < len(cpus):
        j = i
        while j + 1 < len(cpus) and cpus[j + 1] == cpus[j] + 1:
            j += 1
        out.append(str(cpus[i]) if i == j else f"{cpus[i]}-{cpus[j]}")
        i = j + 1
    return ",".join(out)


def numa_nodes(root: str = "/") -> dict[int, list[int]]:
    """{node: cores} from sysfs; {} when the tree has no NUMA nodes."""
    base = Path(root, "sys/devices/system/node")
    nodes = {}
    for entry in sorted(base.glob("node[0-9]*")):
        try:
            nodes[int(entry.name[4:])] = parse_cpulist((entry / "cpulist").read_text())
        except (OSError, ValueError):
            continue
    return nodes


def _read_hex(path: Path) -> int | None:
    try:
        return int(path.read_text().strip(), 16)
    except (OSError, ValueError):
        return None


def ascend_devices(root: str = "/") -> list[PciDevice]:
    """Ascend NPUs on the PCI bus, in address order."""
    found = []
    for entry in sorted(Path(root, "sys/bus/pci/devices").glob("*")):
        if _read_hex(entry / "vendor") != HUAWEI_VENDOR:
            continue
        klass = _read_hex(entry / "class")
        if klass is None or klass >> 16 != PCI_CLASS_PROCESSING_ACCELERATOR:
            continue
        try:
            node = int((entry / "numa_node").read_text().strip())
        except (OSError, ValueError):
            node = -1
        found.append(PciDevice(entry.name, _read_hex(entry / "device") or 0, node))
    return found


def _visible(devices: list[PciDevice], environ) -> list[PciDevice]:
    visible = environ.get("ASCEND_RT_VISIBLE_DEVICES")
    if not visible:
        return devices
    ids = [int(x) for x in visible.split(",") if x.strip().isdigit()]
    return [devices[i] for i in ids if i < len(devices)]


@dataclass(frozen=True)
class Plan:
    cores: list[int] | None   # None: leave the affinity alone
    why: str                  # the log line's reason


def plan(local_rank: int, local_world_size: int, device_type: str, *, root: str = "/", environ=None,
         allowed: set[int] | None = None) -> Plan:
    """Which cores this local rank gets (see the module docstring), and why."""
    environ = os.environ if environ is None else environ
    allowed = set(os.sched_getaffinity(0)) if allowed is None else set(allowed)
    if device_type == "npu":
        devices = _visible(ascend_devices(root), environ)
        if local_world_size > len(devices):
            return Plan(None, f"{len(devices)} Ascend NPUs found under {root.rstrip('/')}/sys/bus/pci/devices for "
                              f"{local_world_size} local ranks; affinity left as it was")
        mine = devices[local_rank]
        if mine.numa_node < 0:
            return Plan(None, f"npu:{local_rank} (PCI {mine.address}) has no NUMA node in sysfs; affinity left as "
                              "it was")
        nodes = numa_nodes(root)
        if mine.numa_node not in nodes:
            return Plan(None, f"NUMA node {mine.numa_node} of npu:{local_rank} has no cpulist in sysfs; affinity "
                              "left as it was")
        sharing = [r for r in range(local_world_size) if devices[r].numa_node == mine.numa_node]
        pool = [c for c in nodes[mine.numa_node] if c in allowed]
        where = f"npu:{local_rank} (PCI {mine.address}) on NUMA node {mine.numa_node}"
    elif device_type == "cpu":
        sharing = list(range(local_world_size))
        pool = sorted(allowed)
        where = "no accelerator"
    else:
        return Plan(None, f"device type {device_type!r}: not bound here (on CUDA, torchrun --numa-binding=node "
                          "binds by the GPU's NUMA node)")
    share, extra = divmod(len(pool), len(sharing))
    if share == 0:
        return Plan(None, f"{where}: {len(pool)} usable cores for {len(sharing)} local ranks; affinity left as it was")
    k = sharing.index(local_rank)
    start = k * share + min(k, extra)
    cores = pool[start:start + share + (1 if k < extra else 0)]
    return Plan(cores, f"{where}, 1 of {len(sharing)} local ranks sharing its {len(pool)} cores")


def bind(local_rank: int, local_world_size: int, device_type: str, *, enabled: bool = True, root: str = "/",
         environ=None) -> str:
    """Bind this process as `plan` says; returns the log line (every rank logs its own)."""
    environ = os.environ if environ is None else environ
    rank = environ.get("RANK", "0")
    if not enabled:
        return f" rank {rank}: CPU affinity left as it was (--no-bind-cores)"
    if device_type == "npu" and environ.get("CPU_AFFINITY_CONF"):
        return (f" rank {rank}: CPU affinity by torch_npu (CPU_AFFINITY_CONF={environ['CPU_AFFINITY_CONF']}, "
                "set by the user); the job binds nothing")
    chosen = plan(local_rank, local_world_size, device_type, root=root, environ=environ)
    if chosen.cores is None:
        return f" rank {rank}: CPU affinity not set: {chosen.why}"
    os.sched_setaffinity(0, chosen.cores)
    # read back: what the kernel applied
    return f" rank {rank}: bound to cores {format_cpulist(os.sched_getaffinity(0))} ({chosen.why})"
