"""MindSpeed-LLM's O2 (megatron_glue/training/o2.py): Adam's moments in bf16 (`--o2-optimizer`) against torch's Adam
with its moments rounded to bf16 after every step, bit for bit; the gradients' dtype as Megatron-LM sets it under
--bf16 and with `--o2-gradient`; and (marked `training`) the job with the flags of MindSpeed-LLM's O2 script."""

from __future__ import annotations

import re

import pytest
import torch

from megatron_glue.training import o2
from pretrain_runs import parse_error as _error, parse_tiny as _args, pretrain


def _params(seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(37, 5, generator=g)), torch.nn.Parameter(torch.randn(11, generator=g))]


@pytest.mark.any_megatron_line
@pytest.mark.parametrize("cls", [torch.optim.AdamW, torch.optim.Adam])
def test_bf16_moments_are_torch_adam_with_moments_rounded_each_step(cls):
    """Three steps on the same gradients: the weights equal, bit for bit, those of torch's optimizer whose moments
    are rounded to bf16 after each of its steps; the moments are stored in bf16; and they are not torch's own
    (fp32) moments, so the test sees the rounding."""
    ours_params, ref_params, plain_params = _params(0), _params(0), _params(0)
    kw = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    ours = cls(ours_params, **kw)
    o2.enable(ours)
    ref, plain = cls(ref_params, **kw), cls(plain_params, **kw)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        grads = [torch.randn(p.shape, generator=g) for p in ours_params]
        for params in (ours_params, ref_params, plain_params):
            for p, grad in zip(params, grads):
                p.grad = grad.clone()
        ours.step(), ref.step(), plain.step()
        for state in ref.state.values():
            for name in o2.MOMENTS:
                state[name].copy_(state[name].to(torch.bfloat16))
    for a, b, c in zip(ours_params, ref_params, plain_params):
        assert torch.equal(a, b)
        assert not torch.equal(a, c)
    for p, r in zip(ours_params, ref_params):
        for name in o2.MOMENTS:
            assert ours.state[p][name].dtype == torch.bfloat16
            assert torch.equal(ours.state[p][name].float(), ref.state[r][name])


@pytest.mark.any_megatron_line
def test_fp32_moments_loaded_are_narrowed_at_the_next_step():
    """A checkpoint load (or megatron-core's init_state_fn) leaves fp32 moments: the next step stores bf16 again."""
    params = _params(0)
    opt = torch.optim.AdamW(params, lr=1e-2)
    o2.enable(opt)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    saved = opt.state_dict()
    fresh = torch.optim.AdamW(params, lr=1e-2)
    o2.enable(fresh)
    fresh.load_state_dict(saved)  # torch casts floating state to the parameter's dtype (fp32)
    assert fresh.state[params[0]]["exp_avg"].dtype == torch.float32
    fresh.step()
    assert fresh.state[params[0]]["exp_avg"].dtype == torch.bfloat16


@pytest.mark.any_megatron_line
def test_enable_refuses_what_it_does_not_change():
    with pytest.raises(TypeError, match=r"--o2-optimizer works on torch's Adam/AdamW, which megatron-core builds "
                                        r"without apex or Transformer Engine; this optimizer is torch.optim.sgd.SGD"):
        o2.enable(torch.optim.SGD(_params(0), lr=0.1))


def test_gradient_dtype_as_megatron_lm_sets_it():
    """Under --bf16 gradients accumulate and reduce in fp32 unless --grad-reduce-in-bf16 (or MindSpeed-LLM's
    --o2-gradient); fp16 and fp32 keep what is given."""
    assert _args("--bf16").accumulate_allreduce_grads_in_fp32 is True
    assert _args("--bf16", "--grad-reduce-in-bf16").accumulate_allreduce_grads_in_fp32 is False
    o2_args = _args("--bf16", "--o2-gradient")
    assert o2_args.accumulate_allreduce_grads_in_fp32 is False and o2_args.grad_reduce_in_bf16
    assert _args("--fp16").accumulate_allreduce_grads_in_fp32 is False
    assert _args("--fp16", "--accumulate-allreduce-grads-in-fp32").accumulate_allreduce_grads_in_fp32 is True


def test_o2_flags_checked_at_the_door():
    assert _error("--o2-optimizer") == "pretrain_gpt: error: --o2-optimizer keeps bf16 Adam moments: it needs --bf16"
    assert _error("--o2-gradient") == "pretrain_gpt: error: --o2-gradient keeps bf16 gradients: it needs --bf16"
    assert _error("--bf16", "--o2-optimizer", "--optimizer", "sgd") == (
        "pretrain_gpt: error: --o2-optimizer keeps Adam's moments in bf16; --optimizer sgd has none: use --optimizer "
        "adam or drop --o2-optimizer")
    assert _error("--bf16", "--o2-gradient", "--accumulate-allreduce-grads-in-fp32") == (
        "pretrain_gpt: error: --o2-gradient and --accumulate-allreduce-grads-in-fp32 ask for bf16 and fp32 "
        "gradients; pick one")


def _saved_moments(folder):
    state = torch.load(folder / "iter_0000003" / "mp_rank_00" / "distrib_optim.pt", weights_only=False)
    found = []

    def walk(x):
        if isinstance(x, dict):
            for k, v in x.items():
                if k in o2.MOMENTS and torch.is_tensor(v):
                    found.append(v)
                else:
                    walk(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)
    walk(state)
    return found


@pytest.mark.training
def test_job_with_the_o2_scripts_flags(tmp_path):
    """MindSpeed-LLM's O2 script's memory flags (--o2-optimizer --o2-gradient --reuse-fp32-param, the distributed
    optimizer, DP 2), eager, 3 iterations: the saved Adam moments are bf16 values (and not all zero), the moments
    take half the bytes, and --o2-gradient is --grad-reduce-in-bf16 bit for bit."""
    common = ["--bf16", "--use-distributed-optimizer", "--reuse-fp32-param", "--o2-optimizer", "--train-iters", "3",
              "--save-interval", "3", "--ckpt-format", "torch", "--no-npu-compile"]
    runs = {name: pretrain(tmp_path / name, *common, flag, "--save", str(tmp_path / name / "ckpt"), nproc=2).check()
            for name, flag in (("o2", "--o2-gradient"), ("bf16grads", "--grad-reduce-in-bf16"))}
    rows = {k: [(r["lm loss"], r["grad_norm"]) for r in run.rows("train")] for k, run in runs.items()}
    assert rows["o2"] == rows["bf16grads"] and len(rows["o2"]) == 3
    moments = _saved_moments(tmp_path / "o2" / "ckpt")
    assert moments and all(torch.equal(m, m.to(torch.bfloat16).float()) for m in moments)
    assert any(m.abs().sum() > 0 for m in moments)
    before, after = map(int, re.search(r"--o2-optimizer: Adam moment bytes on rank 0 (\d+) -> (\d+)",
                                       runs["o2"].output).groups())
    assert before == 2 * after > 0
