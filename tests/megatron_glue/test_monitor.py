"""Device monitoring on the CPU: the memory and utilization fields in the log, the metrics JSONL and the plot."""

from __future__ import annotations

import re
import time

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
