"""The linear_cross_entropy rule fires on F.cross_entropy after the output projection as models write it (2-D
and flattened [s, b, H] hidden states, fp32 and bf16, every reduction, ignore_index, label smoothing, a frozen
weight), training and inference, and the compiled result equals eager; a loss whose logits are used elsewhere is
reported unfused."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import npu_compile  # noqa: F401
from npu_compile.passes.cross_entropy import cross_entropy_smoothed
from npu_compile.passes.engine import trace_inference, trace_training

RULES = ("linear_cross_entropy",)


def loss_fn(flat, ignore_index, label_smoothing, reduction, spelling="linear"):
    def logits_of(h, w):
        return F.linear(h, w) if spelling == "linear" else torch.matmul(h, w.t())

    if flat:
        def fn(h, w, t):
            logits = logits_of(h, w).float()
            return F.cross_entropy(logits.view(-1, logits.size(-1)), t.view(-1), ignore_index=ignore_index,
                                   label_smoothing=label_smoothing, reduction=reduction)
    else:
        def fn(h, w, t):
            return F.cross_entropy(logits_of(h, w).float(), t, ignore_index=ignore_index,
                                   label_smoothing=label_smoothing, reduction=reduction)
    return fn


def inputs(lead, hidden, vocab, dtype, ignore_index, weight_grad, seed):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(*lead, hidden, generator=gen).to(dtype).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=gen) / hidden**0.5).to(dtype).requires_grad_(weight_grad)
    t = torch.randint(0, vocab, lead, generator=gen)
    t.view(-1)[::3] = ignore_index
    t.view(-1)[1] = 1  # one token is never ignored
    return h, w, t


@settings(max_examples=8, deadline=None)
@given(flat=st.booleans(), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       reduction=st.sampled_from(["mean", "sum", "none"]), label_smoothing=st.sampled_from([0.0, 0.1]),
       ignore_index=st.sampled_from([-100, 0]), weight_grad=st.booleans(), spelling=st.sampled_from(["linear", "matmul"]),
       seed=st.integers(0, 2**31 - 1))
def test_fused_and_equal_to_eager(against_eager, flat, dtype, reduction, label_smoothing, ignore_index, weight_grad, spelling, seed):
    lead = (3, 2) if flat else (6,)
    h, w, t = inputs(lead, 8, 24, dtype, ignore_index, weight_grad, seed)
    run = against_eager(loss_fn(flat, ignore_index, label_smoothing, reduction, spelling), h, w, t, rules=RULES)
    assert run.fusions["linear_cross_entropy"] == 1
    assert run.report.unfused == []
    ops = run.report.lowered_ops
    assert ops["npu_compile.linear_cross_entropy"] == 1 and ops["npu_compile.linear_cross_entropy_backward"] == 1
    assert "aten._log_softmax" not in ops and "aten.nll_loss_forward" not in ops


def test_inference_fused(against_eager):
    h, w, t = inputs((6,), 8, 24, torch.float32, -100, False, 0)
    run = against_eager(loss_fn(False, -100, 0.2, "mean"), h.detach(), w, t, rules=RULES, no_grad=True)
    assert run.fusions["linear_cross_entropy"] == 1


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_smoothed_pattern_traces_as_f_cross_entropy(reduction):
    """The written-out label-smoothing composite is the graph F.cross_entropy gives, forward and backward."""
    logits = torch.empty(4, 16, requires_grad=True)
    t = torch.zeros(4, dtype=torch.long)
    want = trace_training(lambda x, t: F.cross_entropy(x, t, ignore_index=-7, label_smoothing=0.125,
                                                       reduction=reduction), [logits, t])
    got = trace_training(lambda x, t: cross_entropy_smoothed(x, t, -7, reduction, 0.875, 0.125 / 16), [logits, t])

    def ops(gm):
        return sorted(str(n.target) for n in gm.graph.nodes if n.op == "call_function")

    assert ops(got) == ops(want)
    want = trace_inference(lambda x, t: F.cross_entropy(x, t, label_smoothing=0.125, reduction=reduction), [logits, t])
    got = trace_inference(lambda x, t: cross_entropy_smoothed(x, t, -100, reduction, 0.875, 0.125 / 16), [logits, t])
    assert ops(got) == ops(want)


def test_logits_used_elsewhere_reported_unfused(against_eager):
    h, w, t = inputs((6,), 8, 24, torch.float32, -100, True, 0)

    def fn(h, w, t):
        logits = F.linear(h, w).float()
        return F.cross_entropy(logits, t) + logits.square().mean()  # a z-loss-like term also reads the logits

    run = against_eager(fn, h, w, t, rules=RULES)
    assert run.fusions["linear_cross_entropy"] == 0
    assert [u["rule"] for u in run.report.unfused] == ["linear_cross_entropy"]
    assert run.report.unfused[0]["reason"] == "no linear_cross_entropy pattern matched the ops around it"


def test_loss_of_logits_from_elsewhere_is_no_site(against_eager):
    logits = torch.randn(6, 24, requires_grad=True)
    t = torch.randint(0, 24, (6,))
    run = against_eager(lambda x, t: F.cross_entropy(x, t), logits, t, rules=RULES)
    assert run.fusions["linear_cross_entropy"] == 0 and run.report.unfused == []


def test_switched_off(against_eager):
    h, w, t = inputs((6,), 8, 24, torch.float32, -100, True, 0)
    run = against_eager(loss_fn(False, -100, 0.0, "mean"), h, w, t, rules=())
    assert run.report.unfused[0]["reason"] == "rule 'linear_cross_entropy' is switched off by options['fusions']"
