"""npu_compile::attention_with_lse and its backward against ring attention's written-out step
(megatron_glue.capture.context_parallel.attention_with_statistics): out, lse, and the gradients of q, k and v under
a loss of both outputs (the ring's merge differentiates through lse)."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.library import opcheck

from megatron_glue.capture.context_parallel import attention_with_statistics
from npu_compile.ops import attention

from .helpers import assert_matches, leaf
from .test_attention import fast_path, query_tile, ref_from_bnsd, ref_to_bnsd

attention_with_lse = torch.ops.npu_compile.attention_with_lse
attention_with_lse_backward = torch.ops.npu_compile.attention_with_lse_backward
LAYOUTS = ("sbnd", "bsnd", "bnsd")


@st.composite
def cases(draw):
    n, g = draw(st.sampled_from([(1, 1), (2, 2), (4, 2), (4, 1)]))
    sq = draw(st.integers(1, 40))
    return dict(b=draw(st.integers(1, 2)), n=n, g=g, sq=sq, sk=draw(st.integers(1, 40)),
                d=draw(st.sampled_from([4, 8])),
                layout=draw(st.sampled_from(LAYOUTS)), dtype=draw(st.sampled_from([torch.float64, torch.float32])),
                mask=draw(st.sampled_from(["none", "causal", "documents", "documents+causal"])),
                empty_rows=draw(st.booleans()), scale=draw(st.sampled_from([None, 0.3])),
                tile=draw(st.sampled_from([4, 16, 256])), fast=draw(st.booleans()), seed=draw(st.integers(0, 2**16)))


def _reference(q, k, v, mask, causal, scale):
    """The written-out step in [s, b, n, d]: (out, lse with 0 where a row sees no key, which rows see none)."""
    out, row_max, row_sum = attention_with_statistics(q, k, v, scale, causal, hidden=mask)
    empty = row_sum == 0
    return out, torch.where(empty, 0.0, row_max) + torch.where(empty, 1.0, row_sum).log(), empty


def check_against_written_out(case):
    gen = torch.Generator().manual_seed(case["seed"])
    b, n, g, sq, sk, d, layout, dtype = (case[k] for k in ("b", "n", "g", "sq", "sk", "d", "layout", "dtype"))
    causal = "causal" in case["mask"]
    if causal:
        sk = sq
    q, k, v = (torch.randn(s, b, h, d, generator=gen, dtype=torch.float64) for s, h in ((sq, n), (sk, g), (sk, g)))
    mask = None
    if "documents" in case["mask"]:  # packed documents' blocks: a query sees some keys, or none at all
        mask = torch.rand(b, 1, sq, sk, generator=gen) < 0.5
        if case["empty_rows"]:
            mask[..., sq // 2, :] = True
    w_out = torch.randn(sq, b, n, d, generator=gen, dtype=torch.float64)
    w_lse = torch.randn(b, n, sq, generator=gen, dtype=torch.float64)
    scale = 1 / math.sqrt(d) if case["scale"] is None else case["scale"]

    ref_in = [leaf(t) for t in (q, k, v)]
    ref_out, ref_lse, empty = _reference(*ref_in, mask, causal, scale)
    ref_grads = torch.autograd.grad((ref_out * w_out).sum() + (ref_lse * w_lse).sum(), ref_in)

    with query_tile(case["tile"]), fast_path(case["fast"]):
        ins = [leaf(ref_from_bnsd(t.permute(1, 2, 0, 3), layout), dtype) for t in (q, k, v)]
        out, lse = attention_with_lse(*ins, mask, layout=layout, scale=case["scale"], causal=causal)
        assert out.dtype == dtype and lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
        assert torch.equal(torch.isinf(lse), empty) and bool((lse[empty] < 0).all())
        loss = (ref_to_bnsd(out, layout).permute(2, 0, 1, 3) * w_out.to(dtype)).sum() \
            + (torch.where(empty, 0.0, lse) * w_lse.to(lse.dtype)).sum()
        grads = torch.autograd.grad(loss, ins)
    assert out.is_contiguous()
    assert_matches(ref_to_bnsd(out, layout).permute(2, 0, 1, 3), ref_out, dtype, "out")
    assert_matches(torch.where(empty, 0.0, lse), ref_lse, dtype, "lse")
    for name, got, want in zip("qkv", grads, ref_grads):
        assert_matches(ref_to_bnsd(got, layout).permute(2, 0, 1, 3), want, dtype, f"d{name}")


@settings(max_examples=120)
@given(cases())
def test_matches_the_written_out_step(case):
    check_against_written_out(case)


def test_the_lse_gradient_is_taken():
    """A loss of lse alone: d lse_i / d s_ij = P_ij, so q and k get gradients and v none (a backward that drops
    the lse term gives zeros everywhere)."""
    q, k, v = (torch.randn(6, 1, 2, 4, dtype=torch.float64, requires_grad=True) for _ in range(3))
    _, lse = attention_with_lse(q, k, v, causal=True)
    _, ref_lse, _ = _reference(q, k, v, None, True, 0.5)
    dq, dk, dv = torch.autograd.grad(lse.sum(), (q, k, v))
    rq, rk = torch.autograd.grad(ref_lse.sum(), (q, k))
    assert dq.abs().max() > 0.1
    torch.testing.assert_close(dq, rq, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(dk, rk, rtol=1e-10, atol=1e-10)
    assert torch.equal(dv, torch.zeros_like(dv))


def test_opcheck():
    q, k, v = (torch.randn(5, 2, h, 4, requires_grad=True) for h in (4, 2, 2))
    mask = torch.rand(2, 1, 5, 5) < 0.3
    opcheck(attention_with_lse, (q, k, v, mask), {"layout": "sbnd", "scale": 0.4, "causal": True})
    q, k, v = (t.detach() for t in (q, k, v))  # the backward op has no backward of its own
    out, lse = attention_with_lse(q, k, v, mask, scale=0.4, causal=True)
    opcheck(attention_with_lse_backward, (torch.randn_like(out), torch.randn_like(lse), q, k, v, out, lse, mask),
            {"layout": "sbnd", "scale": 0.4, "causal": True})


def test_bad_input_says_what_is_wrong():
    q, k, v = (torch.randn(5, 2, h, 4) for h in (4, 2, 2))
    out, lse = attention_with_lse(q, k, v)
    with pytest.raises(ValueError, match=r"lse must be \[b, nq, sq\] = \[2, 4, 5\], got \[2, 4, 4\]"):
        attention_with_lse_backward(out, lse, q, k, v, out, lse[..., :4])
    with pytest.raises(ValueError, match=r"grad_out \[5, 2, 4, 3\] and out \[5, 2, 4, 4\] must have the same shape"):
        attention_with_lse_backward(out[..., :3], lse, q, k, v, out, lse)
    with pytest.raises(ValueError, match="query heads .3. must be a multiple of key/value heads .2."):
        attention_with_lse(q[:, :, :3], k, v)
    with pytest.raises(ValueError, match="layout must be one of"):
        attention_with_lse(q, k, v, layout="sbh")


def test_the_backward_holds_no_score_block():
    """The backward's working set is a tile of QUERY_TILE query rows: at 64 × 64 with tiles of 16 rows no
    allocation reaches a [b, n, sq, sk] block."""
    from torch.profiler import ProfilerActivity, profile

    b, n, s, d = 1, 2, 64, 4
    q, k, v = (torch.randn(s, b, n, d, requires_grad=True) for _ in range(3))
    block = b * n * s * s * 4
    with query_tile(16), fast_path(False):
        out, lse = attention_with_lse(q, k, v, causal=True)
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            torch.autograd.grad((out.sum() + lse.sum()), (q, k, v))
    largest = max(e.cpu_memory_usage for e in prof.events())
    assert 0 < largest < block / 2, (largest, block)
