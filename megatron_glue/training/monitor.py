"""What the device is doing while the job trains: its memory, and its utilization sampled in the background.

On an accelerator, the allocator's figures, the four Megatron-LM's `report_memory` prints (allocated, max
allocated, reserved, max reserved; megatron/training/utils/common_utils.py `report_memory`) and the count
Megatron-LM's TensorBoard adds, all from one reader of the allocator's statistics: on an NPU torch_npu's
`torch.npu.memory_stats` (torch_npu 2.13.0 wheel, torch_npu/npu/memory.py:276; its memory_allocated and
max_memory_... at :451-526 read the same keys) and utilization through
`torch.npu.utilization(device)` (torch_npu/npu/__init__.py:626, the device's comprehensive utilization rate, %).
On a CPU there is no device allocator: the process's resident set (now and at its peak) and the process's CPU
utilization (CPU time over wall time, % of one core), labelled "cpu" so they are never read as a device's.

The NPU calls are bound to those names and not run here (no NPU); the CPU path is what the tests run.
"""

from __future__ import annotations

import os
import resource
import threading
import time

import torch

MB = 2 ** 20


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def memory_bytes(device: torch.device) -> dict[str, int]:
    """This process's memory, the one reader behind the log line, the metrics JSONL and TensorBoard.

    On an accelerator, its allocator's statistics (`memory_stats`; torch_npu 2.13.0 wheel, torch_npu/npu/memory.py:276,
    the keys torch.cuda's allocator uses): allocated, max_allocated, reserved, max_reserved, allocation_count. On a
    CPU, which has no caching allocator: rss and max_rss, the process's resident set now and at its peak."""
    if device.type in ("npu", "cuda"):
        stats = getattr(torch, device.type).memory_stats(device)
        return {"allocated": stats.get("allocated_bytes.all.current", 0),
                "max_allocated": stats.get("allocated_bytes.all.peak", 0),
                "reserved": stats.get("reserved_bytes.all.current", 0),
                "max_reserved": stats.get("reserved_bytes.all.peak", 0),
                "allocation_count": stats.get("allocation.all.current", 0)}
    return {"rss": _rss_bytes(),
            "max_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}  # Linux: KiB


def peak_bytes(figures: dict[str, int]) -> int:
    """The peak of `memory_bytes`' figures: the allocator's peak allocation, or the CPU's peak resident set."""
    return figures["max_allocated"] if "max_allocated" in figures else figures["max_rss"]


def memory_mb(device: torch.device) -> dict[str, float]:
    """This process's memory figures in MB, named as the log and the metrics JSONL show them."""
    figures = memory_bytes(device)
    if device.type in ("npu", "cuda"):
        return {f"memory {key.replace('_', ' ')} (MB)": figures[key] / MB
                for key in ("allocated", "max_allocated", "reserved", "max_reserved")}
    return {"cpu rss (MB)": figures["rss"] / MB, "cpu max rss (MB)": figures["max_rss"] / MB}


def report_memory_line(name: str, device: torch.device, rank: int) -> str:
    """Megatron-LM's report_memory line; on a CPU the process's resident set, said so."""
    figures = memory_mb(device)
    if device.type in ("npu", "cuda"):
        keys = ("allocated", "max allocated", "reserved", "max reserved")
        body = "".join(f" | {k}: {figures[f'memory {k} (MB)']:.2f}" for k in keys)
    else:
        body = f" | cpu rss: {figures['cpu rss (MB)']:.2f} | cpu max rss: {figures['cpu max rss (MB)']:.2f}"
    return f"[Rank {rank}] {name} memory (MB){body}"


class Utilization:
    """Samples utilization every `interval_s` seconds in a daemon thread; `mean()` is the mean of the samples since
    the previous call (None when there were none), named by what was sampled."""

    def __init__(self, device: torch.device, interval_s: float = 0.5):
        self.device = device
        self.name = "npu utilization (%)" if device.type == "npu" else "cpu utilization (%)"
        self.interval_s = interval_s
        self._samples: list[float] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._last = (time.perf_counter(), time.process_time())
        self._thread = None
        if device.type in ("npu", "cpu"):
            self._thread = threading.Thread(target=self._run, name="npu_compile-utilization", daemon=True)
            self._thread.start()

    def _sample(self) -> float:
        if self.device.type == "npu":
            return float(torch.npu.utilization(self.device))
        wall, cpu = time.perf_counter(), time.process_time()
        last_wall, last_cpu = self._last
        self._last = (wall, cpu)
        return 100.0 * (cpu - last_cpu) / max(wall - last_wall, 1e-9)

    def _run(self):
        while not self._stop.wait(self.interval_s):
            try:
                value = self._sample()
            except Exception:  # a device query that fails stops the sampling, never the job
                return
            with self._lock:
                self._samples.append(value)

    def mean(self) -> dict[str, float]:
        with self._lock:
            samples, self._samples = self._samples, []
        return {self.name: sum(samples) / len(samples)} if samples else {}

    def close(self):
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
