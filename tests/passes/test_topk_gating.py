"""Rule topk_gating on megatron-core's own router function (0.16.1 ``topk_routing_with_score_function``, 0.12.1
``topk_softmax_with_capacity``; make test-mcore012 runs this file on 0.12.1): the score function before the top-k
(sigmoid with or without the expert bias, --moe-router-pre-softmax), with or without group-limited routing and the
top-k scaling factor, fused and equal to eager bitwise (routing probabilities and the logits' gradient); the forms
it cannot take declined with their reason. The op: its reference against megatron-core's in float64 with the
gradient, gradcheck, opcheck, bad input; npu-sim runs npu_moe_gating_top_k as eager and declines what the device
op does not compute (torch_npu/_op_plugin_docs.py, npu_moe_gating_top_k). The MoE layer: tests/megatron_glue/
test_moe_fusions.py."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from npu_compile.debug.report import collect

RULES = ["topk_gating"]


def _router(logits, k, **kw):
    """megatron-core's routing probabilities [tokens, experts] (zeros off the chosen experts)."""
    from megatron.core.transformer.moe import moe_utils

    if hasattr(moe_utils, "topk_routing_with_score_function"):
        return moe_utils.topk_routing_with_score_function(logits, k, **kw)[0]
    return moe_utils.topk_softmax_with_capacity(logits, k, **kw)[0]


def _form(function: str, bias: bool, groups: int, group_topk: int, scale: float | None, experts: int):
    kw = {"use_pre_softmax": True} if function == "softmax" else {"score_function": "sigmoid"}
    if bias:
        kw["expert_bias"] = torch.randn(experts, generator=torch.Generator().manual_seed(7)) / 4
    if groups:
        kw.update(num_groups=groups, group_topk=group_topk)
    if scale:
        kw["scaling_factor"] = scale
    return kw


@settings(max_examples=25)  # each example compiles
@given(function=st.sampled_from(["sigmoid", "softmax"]), bias=st.booleans(), groups=st.sampled_from([0, 2, 4]),
       group_topk=st.integers(1, 4), per_group=st.integers(3, 6), k=st.integers(1, 6), tokens=st.integers(1, 12),
       scale=st.sampled_from([None, 2.5]), seed=st.integers(0, 2**16))
def test_megatron_router_fused_equals_eager(against_eager, function, bias, groups, group_topk, per_group, k, tokens,
                                            scale, seed):
    bias = bias and function == "sigmoid"  # megatron-core adds the expert bias to sigmoid scores only
    experts = max(groups, 1) * per_group
    group_topk = min(group_topk, groups) if groups else 0
    k = min(k, group_topk * per_group) if groups else min(k, experts)
    if groups and k < group_topk:  # megatron-core scores a group by its topk // group_topk best
        k = group_topk
    kw = _form(function, bias, groups, group_topk, scale, experts)
    logits = torch.randn(tokens, experts, generator=torch.Generator().manual_seed(seed), requires_grad=True)
    result = against_eager(lambda x: _router(x, k, **kw), logits, rules=RULES)
    assert result.fusions.get("topk_gating") == 1, result.report.unfused
    assert result.report.unfused == []
    assert result.errors == {"out": 0.0, "grad 0": 0.0}  # the same float32 ops: bitwise


def _declined(compare_with_eager, fn, logits):
    result = compare_with_eager(fn, logits, rules=RULES)
    assert not result.fusions.get("topk_gating")
    return sorted({u["reason"].split(": ", 1)[1] for u in result.report.unfused if u.get("rule") == "topk_gating"})


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_logits_are_declined(dtype, against_eager):
    logits = torch.randn(10, 8, generator=torch.Generator().manual_seed(3)).to(dtype).requires_grad_()
    bias = torch.randn(8)
    assert _declined(against_eager, lambda x: _router(x, 2, score_function="sigmoid", expert_bias=bias), logits) == [
        f"{dtype} logits: megatron-core rounds its float32 scores to the logits' dtype before the top-k (type_as); "
        "npu_moe_gating_top_k chooses on float32 scores"]


def test_softmax_after_a_group_limited_top_k_is_declined(against_eager):
    """torch_npu has no op for it: npu_moe_gating_top_k takes renorm 0 only, npu_moe_gating_top_k_softmax(_v2)
    no groups (torch_npu/_op_plugin_docs.py)."""
    logits = torch.randn(12, 8, generator=torch.Generator().manual_seed(4), requires_grad=True)
    assert _declined(against_eager, lambda x: _router(x, 2, num_groups=4, group_topk=2), logits) == [
        "group-limited routing with the softmax after the top-k: npu_moe_gating_top_k normalizes before the top-k "
        "only (renorm 0, torch_npu/_op_plugin_docs.py)"]


@pytest.mark.parametrize("kw", [{"use_pre_softmax": True, "num_groups": 4, "group_topk": 2},
                                {"score_function": "sigmoid", "num_groups": 2, "group_topk": 1},
                                {"score_function": "sigmoid"}])
def test_no_top_k_is_kept_for_the_backward(against_eager, kw):
    """The backward reads the group mask (masked_fill's gradient) and, for sigmoid without a bias, the top-k values:
    rewired to the op's outputs, so the compiled graphs hold no aten.topk and no group choice."""
    logits = torch.randn(12, 8, generator=torch.Generator().manual_seed(4), requires_grad=True)
    result = against_eager(lambda x: _router(x, 2, **kw), logits, rules=RULES)
    assert result.fusions == {"topk_gating": 1}
    assert not {op for op in result.report.lowered_ops if op in ("aten.topk", "aten.masked_fill", "aten.sigmoid",
                                                                  "aten._softmax")}, result.report.lowered_ops


def test_the_default_router_is_left_to_topk_softmax(against_eager):
    logits = torch.randn(12, 8, generator=torch.Generator().manual_seed(4), requires_grad=True)
    result = against_eager(lambda x: _router(x, 2), logits, rules=["topk_gating", "topk_softmax"])
    assert result.fusions == {"topk_gating": 0, "topk_softmax": 1}


def _op(logits, k, bias=None, function="sigmoid", groups=0, group_topk=0, group_values=0):
    return torch.ops.npu_compile.topk_gating(logits, k, bias, function, groups, group_topk, group_values)


@pytest.mark.parametrize("function,bias,groups", [("sigmoid", True, 4), ("sigmoid", False, 0), ("softmax", False, 2),
                                                  ("sigmoid", False, 4)])
def test_topk_gating_op_matches_megatron_core_and_its_gradient(function, bias, groups):
    """float64 logits: the op scores in float64 (megatron-core's float32 round trip is the rule's to decline), so
    its gradient is checked against megatron-core's and by finite differences."""
    logits = torch.randn(9, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(8), requires_grad=True)
    b = torch.randn(16, dtype=torch.float64) if bias else None
    kw = _form(function, False, groups, 2, None, 16)
    if bias:
        kw["expert_bias"] = b
    probs, indices, scores = _op(logits, 4, b, function, groups, 2 if groups else 0, 2 if groups else 0)
    got = torch.zeros_like(logits).scatter(1, indices, probs)
    want = _router(logits.detach().float(), 4, **{n: v.float() if torch.is_tensor(v) else v for n, v in kw.items()})
    torch.testing.assert_close(got.float(), want)
    assert indices.dtype == torch.int64
    seed = torch.randn(9, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(9))
    (grad,) = torch.autograd.grad((got * seed).sum(), logits)
    (expected,) = torch.autograd.grad((_router(logits, 4, **kw) * seed).sum(), logits)
    torch.testing.assert_close(grad, expected)
    torch.autograd.gradcheck(lambda x: _op(x, 4, b, function, groups, 2, 2)[0::2], (logits,))
    torch.library.opcheck(torch.ops.npu_compile.topk_gating.default,
                          (torch.randn(5, 16, requires_grad=True), 4, b.float() if bias else None, function, groups,
                           2, 2))


def test_topk_gating_op_refuses_bad_input():
    x = torch.randn(3, 12)
    with pytest.raises(ValueError, match=r"topk_gating: k must be in 1..experts \(12\), got 13"):
        _op(x, 13)
    with pytest.raises(ValueError, match=r"topk_gating: score_function must be one of \('sigmoid', 'softmax'\), "
                                         r"got 'sqrtsoftplus'"):
        _op(x, 2, None, "sqrtsoftplus")
    with pytest.raises(ValueError, match=r"topk_gating: expert_bias must be a float tensor \[12\], got \(4,\)"):
        _op(x, 2, torch.randn(4))
    with pytest.raises(ValueError, match="topk_gating: expert_bias is megatron-core's for the sigmoid score "
                                         "function only"):
        _op(x, 2, torch.randn(12), "softmax")
    with pytest.raises(ValueError, match=r"topk_gating: num_groups must divide the experts \(12\) and group_topk be "
                                         r"in 1..num_groups, got num_groups=5, group_topk=1"):
        _op(x, 2, None, "sigmoid", 5, 1, 1)
    with pytest.raises(ValueError, match=r"topk_gating: group_values must be in 1..experts per group \(3\), got 4"):
        _op(x, 2, None, "sigmoid", 4, 2, 4)


def _sim(fn, logits):
    torch._dynamo.reset()
    with collect() as reports:
        got = torch.compile(fn, backend="ascend",
                            options={"target": "npu-sim", "fusions": RULES, "cache": False})(logits)
    torch._dynamo.reset()
    (report,) = reports
    return got, report


def test_npu_sim_runs_the_torch_npu_op_as_eager():
    """DeepSeek-V3's router scaled down (sigmoid, expert bias, 8 groups of which 4 by their top-2 sums, k 8,
    scaling 2.5): one npu_moe_gating_top_k, output and gradient equal to megatron-core's eager."""
    logits = torch.randn(16, 32, generator=torch.Generator().manual_seed(5), requires_grad=True)
    bias = torch.randn(32, generator=torch.Generator().manual_seed(6)) / 4

    def router(x):
        return _router(x, 8, score_function="sigmoid", expert_bias=bias, num_groups=8, group_topk=4,
                       scaling_factor=2.5)

    seed = torch.randn(16, 32, generator=torch.Generator().manual_seed(7))
    want = router(logits)
    (want_grad,) = torch.autograd.grad((want * seed).sum(), logits)
    got, report = _sim(router, logits)
    (got_grad,) = torch.autograd.grad((got * seed).sum(), logits)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got_grad, want_grad)
    assert report.lowered_ops["npu.npu_moe_gating_top_k"] == 1
    assert "npu_compile.topk_gating" not in report.lowered_ops
    assert report.lowered_ops.get("aten.topk", 0) == 0


@pytest.mark.parametrize("k,kw,reason", [
    (3, {"score_function": "sigmoid", "num_groups": 2, "group_topk": 1},  # each group scored by its top 3
     "npu_moe_gating_top_k scores a group by its best expert or the sum of its best 2 (group_select_mode 0 / 1); "
     "megatron-core sums its topk // group_topk = 3 best"),
    (3, {"score_function": "sigmoid", "num_groups": 4, "group_topk": 3},  # 2 experts per group
     "npu_moe_gating_top_k needs experts / group_count > 2 and that quotient, rounded up to 32, times group_count "
     "<= 2048: 8 experts in 4 groups"),
    (1, {"score_function": "sigmoid", "expert_bias": torch.randn(8)},
     "npu_moe_gating_top_k divides the chosen sigmoid scores by their sum + eps for every k (norm_type 1); "
     "megatron-core leaves a single expert's score as it is (k = 1)"),
])
def test_npu_sim_declines_what_the_device_op_does_not_compute(k, kw, reason):
    logits = torch.randn(6, 8, generator=torch.Generator().manual_seed(5), requires_grad=True)
    got, report = _sim(lambda x: _router(x, k, **kw), logits)
    torch.testing.assert_close(got, _router(logits, k, **kw))
    assert report.lowered_ops["npu_compile.topk_gating"] == 1
    assert [u["reason"] for u in report.unfused] == [f"npu: {reason}"]


def test_npu_sim_kernel_of_npu_moe_gating_top_k():
    """The documented equivalent computation (Ascend/op-plugin docs/context/torch_npu-npu_moe_gating_top_k.md):
    sigmoid (norm_type 1) + bias for the choice, groups by their max (mode 0) or top-2 sum (mode 1), y the chosen
    norms over their sum + eps times routed_scaling_factor; softmax (norm_type 0) not renormalized."""
    from npu_compile.lowering.npu_sim import register

    register()
    npu = torch.ops.npu
    x = torch.randn(5, 12, generator=torch.Generator().manual_seed(6))
    bias = torch.randn(12, generator=torch.Generator().manual_seed(7))
    y, idx, norm = npu.npu_moe_gating_top_k(x, 2, bias=bias, k_group=1, group_count=3, group_select_mode=0,
                                            norm_type=1, out_flag=True, routed_scaling_factor=3.0)
    s = x.sigmoid()
    best_group = (s + bias).view(5, 3, 4).amax(-1).argmax(-1)
    for row in range(5):
        choice = torch.full((12,), float("-inf"))
        group = slice(4 * best_group[row], 4 * best_group[row] + 4)
        choice[group] = (s + bias)[row, group]
        assert torch.equal(idx[row].long(), choice.topk(2).indices)
    chosen = s.gather(1, idx.long())
    torch.testing.assert_close(y, chosen / (chosen.sum(-1, keepdim=True) + 1e-20) * 3.0)
    assert idx.dtype == torch.int32 and norm.dtype == torch.float32
    torch.testing.assert_close(norm, s)
    y, idx, norm = npu.npu_moe_gating_top_k(x, 3, norm_type=0, out_flag=True)
    soft = x.softmax(-1)
    torch.testing.assert_close(y, soft.topk(3).values)
    assert torch.equal(idx.long(), soft.topk(3).indices)
    with pytest.raises(NotImplementedError, match="npu_moe_gating_top_k hash routing"):
        npu.npu_moe_gating_top_k(x, 2, input_ids=torch.zeros(5, dtype=torch.int64),
                                 tid2eid=torch.zeros(4, 2, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"group_count must divide the experts \(12\) into groups of more than 2"):
        npu.npu_moe_gating_top_k(x, 2, group_count=6, k_group=1)


def test_one_group_kept_of_one_is_the_ungrouped_router():
    """MindSpeed-LLM's --moe-router-num-groups 1 --moe-router-group-topk 1 (several of its sigmoid scripts): the group
    mask keeps every expert, so the site is the ungrouped router and lowers (megatron-core's group score would sum
    the top 8, which npu_moe_gating_top_k's group_select_mode cannot)."""
    logits = torch.randn(6, 16, generator=torch.Generator().manual_seed(5), requires_grad=True)
    bias = torch.randn(16, generator=torch.Generator().manual_seed(6)) / 4

    def router(x):
        return _router(x, 8, score_function="sigmoid", expert_bias=bias, num_groups=1, group_topk=1)

    got, report = _sim(router, logits)
    torch.testing.assert_close(got, router(logits))
    assert report.fusions == {"topk_gating": 1}
    assert report.lowered_ops["npu.npu_moe_gating_top_k"] == 1
    assert not {"aten.topk", "aten.masked_fill"} & set(report.lowered_ops), report.lowered_ops
