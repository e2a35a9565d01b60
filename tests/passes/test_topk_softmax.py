"""Rule topk_softmax on megatron-core's own router function (0.16.1 ``topk_routing_with_score_function``, 0.12.1
``topk_softmax_with_capacity``; make test-mcore012 runs this file on 0.12.1): the softmax-after-top-k router fused
and equal to eager (routing probabilities and the logits' gradient), the other router forms declined with their
reason. The op itself: its reference against megatron-core's, gradcheck, opcheck; the MoE layer's count:
tests/megatron_glue/test_moe_fusions.py."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from npu_compile.debug.report import collect

RULES = ["topk_softmax"]


def _router(logits, k, **kw):
    """megatron-core's routing probabilities [tokens, experts] (zeros off the top k)."""
    from megatron.core.transformer.moe import moe_utils

    if hasattr(moe_utils, "topk_routing_with_score_function"):
        return moe_utils.topk_routing_with_score_function(logits, k, **kw)[0]
    return moe_utils.topk_softmax_with_capacity(logits, k, **kw)[0]


@settings(max_examples=25)  # each example compiles
@given(tokens=st.integers(1, 24), experts=st.integers(2, 16), k=st.integers(1, 8), seed=st.integers(0, 2**16))
def test_megatron_router_fused_equals_eager(against_eager, tokens, experts, k, seed):
    k = min(k, experts)
    logits = torch.randn(tokens, experts, generator=torch.Generator().manual_seed(seed), requires_grad=True)
    result = against_eager(lambda x: _router(x, k), logits, rules=RULES)
    assert result.fusions.get("topk_softmax") == 1, result.report.unfused
    assert result.report.unfused == []


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_logits_fused_in_inference_declined_in_training(dtype, against_eager):
    logits = torch.randn(10, 8, generator=torch.Generator().manual_seed(3)).to(dtype)
    result = against_eager(lambda x: _router(x, 2), logits, rules=RULES, no_grad=True)
    assert result.fusions.get("topk_softmax") == 1
    result = against_eager(lambda x: _router(x, 2), logits.requires_grad_(), rules=RULES)
    assert not result.fusions.get("topk_softmax")
    (declined,) = [u for u in result.report.unfused if u.get("rule") == "topk_softmax"]
    assert declined["reason"] == (
        f"not megatron-core's softmax-after-top-k router: {dtype} logits whose float32 softmax is read beside its "
        "cast back (the backward): the fused op's probs are rounded to the logits' dtype")


def _declined(compare_with_eager, fn, logits):
    result = compare_with_eager(fn, logits, rules=RULES)
    assert not result.fusions.get("topk_softmax")
    return sorted({u["reason"].split(": ", 1)[1] for u in result.report.unfused if u.get("rule") == "topk_softmax"})


def test_other_router_forms_are_declined_with_their_reason(against_eager):
    logits = torch.randn(12, 8, generator=torch.Generator().manual_seed(4), requires_grad=True)
    assert _declined(against_eager, lambda x: _router(x, 2, use_pre_softmax=True), logits) == [
        "softmax before the top-k (--moe-router-pre-softmax, or the aux loss's scores)"]
    assert _declined(against_eager, lambda x: _router(x, 2, score_function="sigmoid"), logits) == [
        "the sigmoid score function (npu_moe_gating_top_k_softmax takes softmax scores)"]
    reasons = _declined(against_eager, lambda x: _router(x, 2, num_groups=4, group_topk=2), logits)
    assert reasons == ["group-limited routing (a top-k over the experts of the selected groups)",
                       "only the top-k's indices are read (the aux loss's routing map, or the top-k values are not "
                       "softmaxed alone along the experts)"]  # the groups' own top-k
    assert _declined(against_eager, lambda x: torch.topk(x, 2, dim=0)[0].softmax(-1), logits) == [
        "a top-k along dim 0 (largest=True), not each token's largest experts"]
    torch._dynamo.reset()
    with collect() as reports:
        torch.compile(lambda x: _router(x, 2), backend="ascend", options={"fusions": RULES})(logits.double())
    torch._dynamo.reset()
    assert [u["reason"] for u in reports[0].unfused if u.get("rule") == "topk_softmax"] == [
        "not megatron-core's softmax-after-top-k router: float64 logits (megatron-core's softmax is float32 there; "
        "the fused op's is float64)"]


def test_topk_softmax_op_matches_megatron_core_and_its_gradient():
    logits = torch.randn(9, 6, dtype=torch.float64, requires_grad=True)
    probs, indices = torch.ops.npu_compile.topk_softmax(logits.float(), 3)
    want = _router(logits.detach().float(), 3)
    torch.testing.assert_close(torch.zeros_like(want).scatter(1, indices, probs), want)
    assert indices.dtype == torch.int64 and torch.equal(indices, logits.float().topk(3, dim=-1).indices)
    torch.autograd.gradcheck(lambda x: torch.ops.npu_compile.topk_softmax(x, 3)[0], (logits,))
    torch.library.opcheck(torch.ops.npu_compile.topk_softmax.default, (torch.randn(5, 4, requires_grad=True), 2))
    with pytest.raises(ValueError, match=r"topk_softmax: k must be in 1..experts \(4\), got 5"):
        torch.ops.npu_compile.topk_softmax(torch.randn(3, 4), 5)
    with pytest.raises(ValueError, match=r"topk_softmax: logits must be a 2-D float tensor \[tokens, experts\], "
                                         r"got \(3,\) torch.float32"):
        torch.ops.npu_compile.topk_softmax(torch.randn(3), 1)


def test_npu_sim_runs_the_torch_npu_op_as_eager():
    logits = torch.randn(16, 8, generator=torch.Generator().manual_seed(5), requires_grad=True)
    want = _router(logits, 2)
    torch._dynamo.reset()
    with collect() as reports:
        got = torch.compile(lambda x: _router(x, 2), backend="ascend",
                            options={"target": "npu-sim", "fusions": RULES, "cache": False})(logits)
    torch._dynamo.reset()
    torch.testing.assert_close(got, want)
    (report,) = reports
    assert report.lowered_ops["npu.npu_moe_gating_top_k_softmax_v2"] == 1
    assert "npu_compile.topk_softmax" not in report.lowered_ops


def test_npu_sim_kernel_of_npu_moe_gating_top_k_softmax_v2():
    """DOCS (torch_npu/_op_plugin_docs.py, npu_moe_gating_top_k_softmax_v2): renorm 1 top-k then softmax, renorm 0
    softmax then top-k; expert_idx int32; the softmax as third output with renorm 0 and output_softmax (the wheel's
    meta function), else [0]."""
    from npu_compile.lowering.npu_sim import register

    register()
    npu = torch.ops.npu
    x = torch.randn(5, 7, generator=torch.Generator().manual_seed(6))
    y, idx, third = npu.npu_moe_gating_top_k_softmax_v2(x, k=3, renorm=1)
    values, want_idx = x.topk(3, dim=-1)
    torch.testing.assert_close(y, values.softmax(-1))
    assert idx.dtype == torch.int32 and torch.equal(idx.long(), want_idx) and third.shape == (0,)
    y, idx, third = npu.npu_moe_gating_top_k_softmax_v2(x, k=2, renorm=0, output_softmax=True)
    soft = x.softmax(-1)
    torch.testing.assert_close(y, soft.topk(2, dim=-1).values)
    torch.testing.assert_close(third, soft)
    with pytest.raises(NotImplementedError, match="npu_moe_gating_top_k_softmax_v2 with finished"):
        npu.npu_moe_gating_top_k_softmax_v2(x, k=2, finished=torch.zeros(5, dtype=torch.bool))
