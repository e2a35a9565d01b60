"""Fusion rules, cross-entropy family: the output projection and the loss after it →
``npu_compile::linear_cross_entropy``, whose backward recomputes the logits chunk by chunk instead of keeping
the [tokens, vocab] fp32 log-softmax that autograd saves (and its gradient, as large).

It lowers to npu_cross_entropy_loss (and its backward) per chunk, with the matmuls around it. In training the
rule matches the joint graph, so autograd's backward of the matched ops is replaced by the fused op's.

The forms it takes (as models trace under Dynamo + aot_autograd, no decompositions):

- ``F.cross_entropy(F.linear(h, w).float(), target, ignore_index=..., reduction=...)`` on 2-D hidden states
  (``torch.matmul(h, w.t())`` and ``h @ w.T`` trace alike), in fp32 (``.float()`` is no op there) and in
  bf16/fp16, with every reduction;
- the same on [s, b, H] hidden states with the logits flattened for the loss,
  ``F.cross_entropy(logits.float().view(-1, V), target.view(-1))``, the usual spelling of a language-model loss;
- each with ``label_smoothing=ε > 0``: F.cross_entropy then traces to log_softmax → nll_loss plus the smoothing
  term ``−Σ log p`` (masked where ignored, reduced alike), combined as ``nll·(1 − ε) + smooth·(ε/V)``; ε itself
  is not in the graph, only 1 − ε and ε/V, so the pattern is F.cross_entropy's composite written out with those
  two as its scalars (tests/passes/test_cross_entropy.py checks that it traces to the graph F.cross_entropy
  gives), and the check requires that they come from one ε.

The weight's gradient may be missing (a frozen output layer). The matched logits must feed nothing else (the
matcher needs that: the fused op never makes them), so a model that also returns its logits keeps the unfused
loss, reported in ``unfused``.

Not matched here: Megatron's ``vocab_parallel_cross_entropy`` (an autograd.Function with its own backward and
all-reduces over the TP group, compiled in a graph apart from the output layer's today) and class weights.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

import npu_compile.ops  # noqa: F401  (registers torch.ops.npu_compile)
from npu_compile.passes.engine import Rule, register_rule

aten = torch.ops.aten
fused = torch.ops.npu_compile

F32, BF16 = torch.float32, torch.bfloat16
# The scalars the patterns are traced with, so the model's are read from the match: an ignore_index no model
# uses, and a 1 − ε and ε/V unlike any other constant of the graph (exact in binary).
IGNORE_INDEX = -987_654
KEEP = 0.8828125
SPREAD = 3 * 2.0**-13
REDUCTIONS = ("mean", "sum", "none")


# ==== the loss as F.cross_entropy traces ====================================================================


def cross_entropy_smoothed(logits, target, ignore_index, reduction, keep, spread):
    """F.cross_entropy(logits, target, ignore_index=..., label_smoothing=ε, reduction=...) for 2-D logits and
    ε > 0, op for op as torch's composite computes it, with keep = 1 − ε and spread = ε / V."""
    log_p = torch.log_softmax(logits, 1)
    nll = F.nll_loss(log_p, target, ignore_index=ignore_index, reduction=reduction)
    ignored = target == ignore_index
    smooth = (-log_p.sum(1)).masked_fill(ignored, 0.0)
    if reduction == "mean":
        smooth = smooth.sum() / (~ignored).sum()
    elif reduction == "sum":
        smooth = smooth.sum()
    # the composite scales by C++ doubles: mul.Scalar (a Python `tensor * float` would record mul.Tensor)
    return aten.add.Tensor(aten.mul.Scalar(nll, keep), aten.mul.Scalar(smooth, spread))


def _flat(h, w, t):
    """[s, b, H] hidden states and [s, b] targets as the loss reads them: [s·b, V] logits and [s·b] targets."""
    return F.linear(h, w).float().view(-1, w.shape[0]), t.view(-1)


def _plain(h, w, t):
    return F.linear(h, w).float(), t


def pattern_for(logits_of, reduction: str, smoothed: bool):
    if smoothed:
        def pattern(hidden, weight, target, ignore_index, keep, spread):
            logits, t = logits_of(hidden, weight, target)
            return cross_entropy_smoothed(logits, t, int(ignore_index), reduction, keep, spread)
    else:
        def pattern(hidden, weight, target, ignore_index):
            logits, t = logits_of(hidden, weight, target)
            return F.cross_entropy(logits, t, ignore_index=int(ignore_index), reduction=reduction)
    pattern.__name__ = f"cross_entropy_{reduction}{'_smoothed' if smoothed else ''}_{logits_of.__name__[1:]}"
    return pattern


def replacement_for(flat: bool, reduction: str, smoothed: bool):
    def fused_loss(hidden, weight, target, ignore_index, keep=1.0, spread=0.0):
        if flat:
            hidden, target = hidden.reshape(-1, hidden.shape[-1]), target.reshape(-1)
        loss, _lse = fused.linear_cross_entropy(hidden, weight, target, int(ignore_index), 1.0 - keep, reduction)
        return loss

    if smoothed:
        def replacement(hidden, weight, target, ignore_index, keep, spread):
            return fused_loss(hidden, weight, target, ignore_index, keep, spread)
    else:
        def replacement(hidden, weight, target, ignore_index):
            return fused_loss(hidden, weight, target, ignore_index)
    return replacement


# ==== example inputs, checks, sites =========================================================================


def _examples(rank: int):
    def examples():
        for dtype in (F32, BF16):
            lead = (4,) if rank == 2 else (2, 2)
            yield [torch.empty(*lead, 8, dtype=dtype, requires_grad=True),
                   torch.empty(16, 8, dtype=dtype, requires_grad=True), torch.zeros(lead, dtype=torch.long)]

    return examples


def _val(match, name):
    node = match.kwargs.get(name)
    return node.meta["val"] if isinstance(node, torch.fx.Node) else node


def _check(match) -> bool | str:
    hidden, weight, target = _val(match, "hidden"), _val(match, "weight"), _val(match, "target")
    if weight.dtype != hidden.dtype or weight.dim() != 2:
        return f"weight {tuple(weight.shape)} {weight.dtype} on hidden {hidden.dtype}: the fused op takes one dtype"
    if target.dtype != torch.int64:
        return f"target is {target.dtype}; the fused op takes int64 class indices"
    if "keep" in match.kwargs:
        keep, spread = match.kwargs["keep"], match.kwargs["spread"]
        if not (isinstance(keep, float) and isinstance(spread, float)):
            return "the smoothing factors are not constants"
        eps, vocab = 1.0 - keep, weight.shape[0]
        if not (0.0 < eps <= 1.0 and math.isclose(spread * vocab, eps, rel_tol=1e-9)):
            return (f"nll·{keep} + smooth·{spread} is not one label smoothing ε (1 − ε and ε/V with V = {vocab}): "
                    "not F.cross_entropy's")
    return True


_VIEWS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten._to_copy.default)


def _loss_of_matmul(node) -> bool:
    """An nll_loss of a log_softmax of a matmul's output (through casts and views): this rule's site. A loss of
    logits from anywhere else is none."""
    src = node.args[0]
    if not (isinstance(src, torch.fx.Node) and src.target == aten._log_softmax.default):
        return False
    src = src.args[0]
    while isinstance(src, torch.fx.Node) and src.target in _VIEWS:
        src = src.args[0]
    return isinstance(src, torch.fx.Node) and src.target in (aten.mm.default, aten.bmm.default, aten.addmm.default)


def _has_nll_loss(graph) -> bool:
    return bool(graph.find_nodes(op="call_function", target=aten.nll_loss_forward.default))


def _smoothed(graph) -> bool:
    """The graph's loss may be smoothed: a masked sum of log-probabilities next to its nll_loss."""
    return _has_nll_loss(graph) and bool(graph.find_nodes(op="call_function", target=aten.masked_fill.Scalar))


# ==== the rules =============================================================================================

for _smooth in (False, True):
    for _logits_of, _rank in ((_plain, 2), (_flat, 3)):
        for _reduction in REDUCTIONS:
            register_rule(Rule(
                name="linear_cross_entropy",
                pattern=pattern_for(_logits_of, _reduction, _smooth),
                replacement=replacement_for(_rank == 3, _reduction, _smooth),
                example_inputs=_examples(_rank),
                scalars={"ignore_index": IGNORE_INDEX, **({"keep": KEEP, "spread": SPREAD} if _smooth else {})},
                extra_check=_check,
                anchors=(aten.nll_loss_forward.default,),
                site=_loss_of_matmul,
                wanted=_smoothed if _smooth else _has_nll_loss,
                grad_optional=("weight",),
            ))
