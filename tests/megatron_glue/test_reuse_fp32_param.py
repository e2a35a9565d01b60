"""MindSpeed's `--reuse-fp32-param` (megatron_glue/training/reuse_fp32_param.py): the split of fp32 master weights
into bf16 weights + residuals and back, bit for bit, in place and out of place; the flag's checks; and (marked
`training`) the job with it against the job without it: the same losses, grad norms, model weights, fp32 master
weights and Adam moments bit for bit, the parameter bytes it saves, and a resume from its own checkpoint."""

from __future__ import annotations

import re

import pytest
import torch

from megatron_glue.training.arguments import ArgumentError, parse_args
from megatron_glue.training.reuse_fp32_param import MasterWeightRegion
from pretrain_runs import TINY, pretrain

FLAGS = ["--bf16", "--use-distributed-optimizer", "--reuse-fp32-param"]


def _masters(n: int) -> torch.Tensor:
    """n fp32 values of every kind the split meets: random bit patterns (no NaN), exact ties either way, exact
    bf16 values, signed zeros, denormals, the largest finite values (rounding to inf) and infinities."""
    g = torch.Generator().manual_seed(0)
    bits = torch.randint(-2 ** 31, 2 ** 31, (n,), dtype=torch.int64, generator=g).to(torch.int32)
    x = bits.view(torch.float32)
    x[x.isnan()] = 1.5
    bits = x.view(torch.int32)
    ties = torch.arange(0, n, 7)
    bits[ties] = (bits[ties] & ~0xFFFF) | 0x8000  # exact ties: half round down (even), half up (odd)
    bits[1::11] &= ~0xFFFF  # exact bf16 values
    special = torch.tensor([0.0, -0.0, 1e-45, -1e-45, 3.4028235e38, -3.4028235e38, float("inf"), float("-inf")])
    x[3:3 + special.numel()] = special
    return x


@pytest.mark.parametrize("own", [0, 1])
def test_split_and_join_in_place_are_exact(own):
    """The slots (2n bf16) hold the rank's own bf16 weights in half `own`; the master weights are rebuilt over the
    slots and split again: the weights are torch's round-to-nearest-even (megatron-core's copy), the masters come
    back bit for bit, ties rounded down included."""
    n = 3000
    master = _masters(n)
    slots = torch.zeros(2 * n, dtype=torch.bfloat16)
    region = MasterWeightRegion(slots, own)
    region.fp32_view().copy_(master)
    region.to_bf16_in_place()
    assert torch.equal(region.weights.view(torch.int16), master.to(torch.bfloat16).view(torch.int16))
    tied_down = (master.view(torch.int32) & 0x1FFFF) == 0x8000  # an exact tie on an even bf16: rounded down
    assert region.ties.tolist() == tied_down.nonzero().view(-1).tolist() and region.ties.numel() > 100
    region.slots[(1 - own) * n:(2 - own) * n] = 7.0  # the neighbour's slot: refilled by the all-gather
    region.to_fp32_in_place()
    assert torch.equal(region.fp32_view().view(torch.int32), master.view(torch.int32))


def test_split_and_join_out_of_place_are_exact():
    n = 1000
    master = _masters(n)
    region = MasterWeightRegion(torch.zeros(2 * n, dtype=torch.bfloat16), own=1)
    region.from_fp32(master)
    before = region.slots.clone()
    assert torch.equal(region.to_fp32().view(torch.int32), master.view(torch.int32))
    assert torch.equal(region.slots.view(torch.int16), before.view(torch.int16))  # the weights stay as they are


def test_dp1_region_splits_into_the_bucket_itself():
    """At DP 1 the rank's slot is the whole bucket: the master weights live out of place only."""
    master = _masters(500)
    bucket = torch.zeros(500, dtype=torch.bfloat16)
    region = MasterWeightRegion(None, weights=bucket)
    region.from_fp32(master)
    assert torch.equal(bucket.view(torch.int16), master.to(torch.bfloat16).view(torch.int16))
    assert torch.equal(region.to_fp32().view(torch.int32), master.view(torch.int32))


def test_fresh_region_holds_exact_bf16_masters():
    """megatron-core starts the master weights as the bf16 weights in fp32: residual zero."""
    weights = torch.randn(64).to(torch.bfloat16)
    region = MasterWeightRegion(torch.cat([weights, torch.zeros(64, dtype=torch.bfloat16)]), own=0)
    assert torch.equal(region.to_fp32(), weights.float())


# -- the flag's checks ------------------------------------------------------------------------------------------------

def _error(*flags, world_size=2) -> str:
    with pytest.raises(ArgumentError) as info:
        parse_args([*TINY, "--train-iters", "3", *flags], world_size=world_size)
    return info.value.message


def test_needs_bf16_and_the_distributed_optimizer():
    assert _error("--use-distributed-optimizer", "--reuse-fp32-param") == (
        "pretrain_gpt: error: --reuse-fp32-param keeps each fp32 master weight as its bf16 weight plus a residual: it "
        "needs --bf16")
    assert _error("--bf16", "--reuse-fp32-param") == (
        "pretrain_gpt: error: --reuse-fp32-param is implemented here on megatron-core's distributed optimizer: add "
        "--use-distributed-optimizer")
    assert parse_args([*TINY, "--train-iters", "3", *FLAGS], world_size=2).reuse_fp32_param


# -- the job ----------------------------------------------------------------------------------------------------------

def _tensors(x, prefix=""):
    if torch.is_tensor(x):
        yield prefix, x
    elif isinstance(x, dict):
        for k, v in x.items():
            yield from _tensors(v, f"{prefix}/{k}")
    elif isinstance(x, (list, tuple)):
        for i, v in enumerate(x):
            yield from _tensors(v, f"{prefix}/{i}")


def _saved(folder) -> dict[str, torch.Tensor]:
    out = {}
    for name in ("model_optim_rng.pt", "distrib_optim.pt"):
        out.update({name + k: t for k, t in _tensors(torch.load(folder / "mp_rank_00" / name, weights_only=False))})
    return out


def _rows(run):
    return [(r["iteration"], r["lm loss"], r["grad_norm"]) for r in run.rows("train")]


@pytest.mark.training
def test_job_is_bitwise_the_job_without_it(tmp_path):
    """Eager (the optimizer is the same under compiled layers: checked by hand, bit for bit too), 2 processes (DP
    2), bf16 with the distributed optimizer and the overlaps of MindSpeed-LLM's scripts, 4 iterations, saved in
    the torch format: losses and grad norms equal, and the saved model weights (the save finishes the deferred
    parameter all-gather first), fp32 master weights and Adam moments equal bit for bit; the rank holds 2 bytes
    less per master weight of its shard (its fp32 copies freed, residuals added)."""
    common = ["--bf16", "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather",
              "--train-iters", "4", "--save-interval", "4", "--ckpt-format", "torch", "--no-npu-compile"]
    plain = pretrain(tmp_path / "plain", *common, "--save", str(tmp_path / "plain" / "ckpt"), nproc=2).check()
    reused = pretrain(tmp_path / "reused", *common, "--reuse-fp32-param", "--save", str(tmp_path / "reused" / "ckpt"),
                      nproc=2).check()
    assert _rows(reused) == _rows(plain) and len(_rows(plain)) == 4
    a, b = (_saved(tmp_path / name / "ckpt" / "iter_0000004") for name in ("plain", "reused"))
    assert a.keys() == b.keys() and any(k.endswith("/param") for k in a)
    for key in a:
        assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key
    master = next(t for k, t in a.items() if k.endswith("/param"))  # the fp32 masters of both DP ranks
    before, after = map(int, re.search(r"optimizer bytes on rank 0 (\d+) -> (\d+)", reused.output).groups())
    assert before - after == 2 * master.numel() // 2  # 2 bytes per master weight of rank 0's half


@pytest.mark.training
def test_job_at_dp1_is_bitwise_the_job_without_it(tmp_path):
    """One process (DP 1: the step runs on a temporary fp32 copy, as MindSpeed's DP-1 path), eager: the same
    numbers and saved tensors; 2 bytes per master weight saved, less the one fp32 element the placeholders share."""
    common = ["--bf16", "--use-distributed-optimizer", "--train-iters", "3", "--save-interval", "3",
              "--ckpt-format", "torch", "--no-npu-compile"]
    plain = pretrain(tmp_path / "plain", *common, "--save", str(tmp_path / "plain" / "ckpt")).check()
    reused = pretrain(tmp_path / "reused", *common, "--reuse-fp32-param", "--save", str(tmp_path / "reused" / "ckpt")
                      ).check()
    assert _rows(reused) == _rows(plain) and len(_rows(plain)) == 3
    a, b = (_saved(tmp_path / name / "ckpt" / "iter_0000003") for name in ("plain", "reused"))
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key
    master = next(t for k, t in a.items() if k.endswith("/param"))
    before, after = map(int, re.search(r"optimizer bytes on rank 0 (\d+) -> (\d+)", reused.output).groups())
    assert before - after == 2 * master.numel() - 4


@pytest.mark.training
@pytest.mark.megatron_lines
def test_resume_from_its_own_checkpoint_is_bitwise(tmp_path):
    """4 iterations in one go == 2, saved (torch_dist), loaded, 2 more, all with --reuse-fp32-param and the overlaps
    of MindSpeed-LLM's scripts (the parameter all-gather deferred into the next forward): the master weights go
    through the save and load split as weights + residuals and come back exact."""
    ckpt = tmp_path / "parts" / "ckpt"
    common = [*FLAGS, "--overlap-grad-reduce", "--overlap-param-gather", "--train-iters", "4", "--save-interval",
              "2", "--no-npu-compile"]
    whole = pretrain(tmp_path / "whole", *common, nproc=2).check()
    pretrain(tmp_path / "parts", *common, "--save", str(ckpt), "--exit-interval", "2", nproc=2).check()
    second = pretrain(tmp_path / "parts", *common, "--save", str(ckpt), "--load", str(ckpt), nproc=2).check()
    assert "at iteration 2" in second.output
    assert _rows(second) == _rows(whole) and len(_rows(whole)) == 4
