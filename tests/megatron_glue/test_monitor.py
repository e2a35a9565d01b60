"""Device monitoring on the CPU: the memory and utilization fields in the log, the metrics JSONL and the plot."""

from __future__ import annotations

import re
import time
import types

import pytest
import torch

from megatron_glue.training import monitor
from pretrain_runs import pretrain


@pytest.mark.any_megatron_line
def test_cpu_utilization_is_sampled_in_the_background():
    sampler = monitor.Utilization(torch.device("cpu"), interval_s=0.05)
    wall, cpu = time.perf_counter(), time.process_time()
    try:
        end = wall + 1.0
        while time.perf_counter() < end:  # one core busy (as much as the machine lets it)
            pass
        busy = sampler.mean()
        reference = 100 * (time.process_time() - cpu) / (time.perf_counter() - wall)
        time.sleep(0.5)
        idle = sampler.mean()
    finally:
        sampler.close()
    assert abs(busy["cpu utilization (%)"] - reference) < 15, (busy, reference)
    # idle: the process sleeps, but its other threads (a test worker's, torch's) still use some CPU: measured
    # 13.5 % in a clean-clone make test; far below the busy phase
    assert idle["cpu utilization (%)"] < min(25, busy["cpu utilization (%)"] / 3), (idle, busy)
    assert sampler.mean() == {}  # read, then empty


@pytest.mark.any_megatron_line
def test_cpu_memory_is_labelled_as_the_process():
    figures = monitor.memory_mb(torch.device("cpu"))
    assert set(figures) == {"cpu rss (MB)", "cpu max rss (MB)"}
    assert 0 < figures["cpu rss (MB)"] <= figures["cpu max rss (MB)"] * 1.01
    assert re.fullmatch(r"\[Rank 3\] \(after 2 iterations\) memory \(MB\) \| cpu rss: \d+\.\d\d \| cpu max rss: "
                        r"\d+\.\d\d", monitor.report_memory_line("(after 2 iterations)", torch.device("cpu"), 3))


@pytest.mark.training
def test_job_logs_memory_and_utilization(tmp_path):
    run = pretrain(tmp_path, "--train-iters", "3", "--eval-iters", "0").check()
    # Megatron-LM's report_memory: after the first logged iteration and the one after it
    lines = re.findall(r"^\[Rank 0\] \(after (\d) iterations\) memory \(MB\) \| cpu rss: [\d.]+ \| cpu max rss: "
                       r"[\d.]+$", run.output, re.M)
    assert lines == ["1", "2"], run.output[-3000:]
    train = run.rows("train")
    assert all(r["cpu rss (MB)"] > 0 and r["cpu max rss (MB)"] > 0 for r in train)
    # the first iteration compiles for seconds: the sampler has values for it
    assert 0 < train[0]["cpu utilization (%)"] <= 100 * torch.get_num_threads() + 50
    assert (tmp_path / "memory.png").stat().st_size > 0


class _FakeNpu:
    """torch.npu as the job calls it on an NPU: `memory_stats` and `utilization`, with the keys its allocator uses."""

    def __init__(self):
        self.calls = []

    def memory_stats(self, device):
        self.calls.append(("memory_stats", device))
        return {"allocated_bytes.all.current": 3 * monitor.MB, "allocated_bytes.all.peak": 5 * monitor.MB,
                "reserved_bytes.all.current": 8 * monitor.MB, "reserved_bytes.all.peak": 9 * monitor.MB,
                "allocation.all.current": 7}

    def utilization(self, device):
        self.calls.append(("utilization", device))
        return 42


@pytest.mark.any_megatron_line
def test_npu_path_reads_the_allocator_and_its_names_are_torch_npus(monkeypatch):
    """The NPU path is not run here (no NPU): run against a stand-in for torch.npu, and the names it calls read from
    the torch-npu 2.13.0 wheel (torch_npu/npu/memory.py and torch_npu/npu/__init__.py), with the statistics keys
    torch_npu's own accessors read."""
    import ast
    import zipfile

    from lowering.wheel import wheel_path

    from megatron_glue.training import log

    fake = _FakeNpu()
    monkeypatch.setattr(torch, "npu", fake, raising=False)
    npu = types.SimpleNamespace(type="npu", index=0)  # torch.device("npu") needs torch_npu's backend registered
    assert monitor.memory_mb(npu) == {"memory allocated (MB)": 3.0, "memory max allocated (MB)": 5.0,
                                      "memory reserved (MB)": 8.0, "memory max reserved (MB)": 9.0}
    assert log.peak_memory_mb(npu) == 5.0
    assert log.memory_figures(npu) == {"mem-reserved-bytes": 8 * monitor.MB, "mem-allocated-bytes": 3 * monitor.MB,
                                       "mem-max-allocated-bytes": 5 * monitor.MB, "mem-allocated-count": 7}
    assert monitor.report_memory_line("(after 1 iterations)", npu, 0) == (
        "[Rank 0] (after 1 iterations) memory (MB) | allocated: 3.00 | max allocated: 5.00 | reserved: 8.00 | "
        "max reserved: 9.00")
    sampler = monitor.Utilization(npu, interval_s=0.01)
    try:
        deadline = time.perf_counter() + 5
        while ("utilization", npu) not in fake.calls and time.perf_counter() < deadline:
            time.sleep(0.01)
    finally:
        sampler.close()
    assert sampler.name == "npu utilization (%)" and ("utilization", npu) in fake.calls

    with zipfile.ZipFile(wheel_path()) as whl:
        memory_py = whl.read("torch_npu/npu/memory.py").decode()
        init_py = whl.read("torch_npu/npu/__init__.py").decode()

    def defs(source):
        return {n.name for n in ast.parse(source).body if isinstance(n, ast.FunctionDef)}

    assert "memory_stats" in defs(memory_py) and "utilization" in defs(init_py)
    called = {name for name, _ in fake.calls}
    assert called == {"memory_stats", "utilization"}
    for key in ("allocated_bytes.all.current", "allocated_bytes.all.peak", "reserved_bytes.all.current",
                "reserved_bytes.all.peak"):  # what torch_npu's memory_allocated / max_memory_... read
        assert f'memory_stats(device=device).get("{key}", 0)' in memory_py, key
