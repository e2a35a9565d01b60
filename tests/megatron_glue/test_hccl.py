"""The HCCL variables the job sets from its flags, the user's own kept; and the binding in a 2-process job."""

from __future__ import annotations

import os
import re

import pytest

from megatron_glue.training import hccl
from megatron_glue.training.arguments import parse_args
from pretrain_runs import TINY, pretrain


def _args(*flags):
    return parse_args([*TINY, "--train-iters", "1", *flags])


@pytest.mark.any_megatron_line
def test_timeouts_from_the_job_flags():
    assert hccl.job_settings(_args()) == {"HCCL_CONNECT_TIMEOUT": "600", "HCCL_EXEC_TIMEOUT": "600"}
    # clamped to the ranges CANN documents: connect [120, 7200], exec (0, 17340]
    assert hccl.job_settings(_args("--distributed-timeout-minutes", "1")) == {
        "HCCL_CONNECT_TIMEOUT": "120", "HCCL_EXEC_TIMEOUT": "60"}
    assert hccl.job_settings(_args("--distributed-timeout-minutes", "600")) == {
        "HCCL_CONNECT_TIMEOUT": "7200", "HCCL_EXEC_TIMEOUT": "17340"}


@pytest.mark.any_megatron_line
def test_buffsize_by_cann_rule_only_where_it_helps():
    # TP=2, micro-batch 4 x seq 8192 x hidden 8192 x bf16 = 512 MiB > 200: set; TP=1 or a smaller batch: HCCL's 200
    big = ["--micro-batch-size", "4", "--global-batch-size", "16", "--seq-length", "8192",
           "--max-position-embeddings", "8192", "--hidden-size", "8192", "--num-attention-heads", "64", "--bf16",
           "--tensor-model-parallel-size", "2"]
    args = parse_args([*TINY, "--train-iters", "1", *big], world_size=2)
    assert hccl.buffsize_mb(args) == 512
    assert hccl.job_settings(args)["HCCL_BUFFSIZE"] == "512"
    args.tensor_model_parallel_size = 1
    assert hccl.buffsize_mb(args) is None
    args.tensor_model_parallel_size, args.micro_batch_size = 2, 1  # 128 MiB
    assert hccl.buffsize_mb(args) is None


@pytest.mark.any_megatron_line
def test_the_users_setting_wins_and_is_logged():
    environ = {"HCCL_CONNECT_TIMEOUT": "3600", "HCCL_IF_BASE_PORT": "25809"}
    lines = hccl.apply(_args(), environ)
    assert environ == {"HCCL_CONNECT_TIMEOUT": "3600", "HCCL_EXEC_TIMEOUT": "600", "HCCL_IF_BASE_PORT": "25809"}
    assert lines == [" HCCL_CONNECT_TIMEOUT=3600: the user's, kept (the job would set 600)",
                     " HCCL_EXEC_TIMEOUT=600: set by the job (in-collective wait, s; default 1836, (0, 17340] on "
                     "Atlas training series)",
                     " HCCL_IF_BASE_PORT=25809: the user's"]


@pytest.mark.training
@pytest.mark.gloo
def test_two_rank_job_binds_disjoint_cores(tmp_path):
    run = pretrain(tmp_path, "--train-iters", "1", "--eval-iters", "0", "--no-npu-compile", nproc=2).check()
    bound = dict(re.findall(r"^ rank (\d): bound to cores (\S+) \(no accelerator, 1 of 2 local ranks", run.output,
                            re.M))
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one core: nothing to split")
    from megatron_glue.training.affinity import parse_cpulist

    assert sorted(bound) == ["0", "1"], run.output[-3000:]
    cores = [set(parse_cpulist(bound[r])) for r in ("0", "1")]
    assert cores[0] and cores[1] and not cores[0] & cores[1]
    assert cores[0] | cores[1] <= os.sched_getaffinity(0)


@pytest.mark.any_megatron_line
def test_the_job_sets_them_on_hccl_only(monkeypatch):
    import datetime
    import types

    import torch

    from megatron_glue.training.device import Placement, prepare_process

    for name in ("HCCL_CONNECT_TIMEOUT", "HCCL_EXEC_TIMEOUT", "HCCL_BUFFSIZE", *hccl.REPORTED):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HCCL_EXEC_TIMEOUT", "7200")
    monkeypatch.setenv("RANK", "0")
    args = _args("--distributed-timeout-minutes", "30")
    where = Placement("gloo", torch.device("cpu"), 0, 1, 0, datetime.timedelta(minutes=30))
    lines = prepare_process(args, where)
    assert "HCCL_CONNECT_TIMEOUT" not in os.environ and len(lines) == 1 and lines[0].startswith(" rank 0: ")
    # an NPU placement on a machine without NPUs: the variables set, the affinity left alone with the reason
    # torch.device("npu") needs torch_npu; the placement's device is read for its type only
    where = Placement("hccl", types.SimpleNamespace(type="npu", index=0), 0, 1, 0, datetime.timedelta(minutes=30))
    lines = prepare_process(args, where)
    assert (os.environ["HCCL_CONNECT_TIMEOUT"], os.environ["HCCL_EXEC_TIMEOUT"]) == ("1800", "7200")
    assert lines[:2] == [" HCCL_CONNECT_TIMEOUT=1800: set by the job (link set-up timeout, s; [120, 7200], default 120)",
                         " HCCL_EXEC_TIMEOUT=7200: the user's, kept (the job would set 1800)"]
    assert lines[2].startswith(" rank 0: CPU affinity not set: 0 Ascend NPUs found under ")
