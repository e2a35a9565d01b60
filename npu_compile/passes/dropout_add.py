"""Fusion rules, dropout_add family: ``residual + dropout(x + bias, p)`` → ``npu_compile::bias_dropout_add``.

Megatron's ``bias_dropout_add_unfused`` / ``_bias_dropout_add_func`` (fused_bias_dropout.py) in training, with
the bias (GPT) or without it (Llama, add_bias_linear=False), the residual first as Megatron writes it or last.
In the joint graph the dropout is ``native_dropout`` and its backward ``native_dropout_backward(grad, mask)``:
a bool keep mask saved per element. The fused op saves a seed instead and regenerates the mask in its backward;
the replacement draws the seed in the graph (``torch.randint``), and the engine marks that draw MUST_SAVE
(``save_random_values``) so the partitioner never recomputes it (a recomputed draw is a new seed: wrong
gradients).

Which sites:
- p > 0 only. With p = 0 (Megatron's hidden_dropout=0.0) dropout traces to a clone that graph normalization
  removes, leaving plain adds: the residual add then belongs to add_rms_norm / add_layer_norm (which run first),
  and a bias add has nothing to fuse with.
- With p > 0 this rule takes the whole ``residual + dropout(x + bias)``, also where the sum feeds a norm: the add
  rules decline a residual add that follows a dropout, so the norm after it fuses alone (see norms.py for why).
- In inference graphs dropout is off (``training=False`` traces to nothing), so only graphs run without grad in
  train mode have sites; the rule takes those too.

A match must be what the op computes: x and residual of one shape, a bias of x's dtype that broadcasts to x
(``x + bias`` does not promote), contiguous outputs. A bias the op cannot take stays an add in front, and the
bias-less form takes the dropout and residual add of the sum.
"""

from __future__ import annotations

import operator

import torch
import torch.nn.functional as F

import npu_compile.ops  # noqa: F401  (registers torch.ops.npu_compile)
from npu_compile.passes.engine import Rule, bias_problem, contiguous_outputs, register_rule

aten = torch.ops.aten
fused = torch.ops.npu_compile

P = 0.113377  # the p the patterns are traced with, so the model's p is read from the match (no other constant)
SEED_RANGE = 2**62  # seeds are drawn from [0, 2**62): non-negative int64, far from overflow when offset


def bias_dropout_add(x, bias, residual, p):
    """Megatron's, with a bias (GPT)."""
    return residual + F.dropout(x + bias, p, training=True)


def dropout_add(x, residual, p):
    """Megatron's without a bias (add_bias_linear=False)."""
    return residual + F.dropout(x, p, training=True)


def bias_dropout_add_residual_last(x, bias, residual, p):
    return F.dropout(x + bias, p, training=True) + residual


def dropout_add_residual_last(x, residual, p):
    return F.dropout(x, p, training=True) + residual


def fused_bias_dropout_add(x, bias, residual, p):
    seed = torch.randint(0, SEED_RANGE, (), dtype=torch.int64, device=x.device)
    return fused.bias_dropout_add(x, bias, residual, p, seed)


def fused_dropout_add(x, residual, p):
    return fused_bias_dropout_add(x, None, residual, p)


# One trace per joint-graph shape. The dropout graph is the same for every dtype and rank (sizes are re-checked
# per match); a bias [h] with or without grad differs by the bias gradient (a sum over the leading dims).


def _bias_examples():
    for bias_grad in (True, False):
        yield [torch.empty(2, 8, requires_grad=True), torch.empty(8, requires_grad=bias_grad),
               torch.empty(2, 8, requires_grad=True)]


def _examples():
    yield [torch.empty(2, 8, requires_grad=True), torch.empty(2, 8, requires_grad=True)]


def _check(match):
    x, residual = match.kwargs["x"].meta["val"], match.kwargs["residual"].meta["val"]
    if x.shape != residual.shape:
        return f"x {tuple(x.shape)} and residual {tuple(residual.shape)} differ in shape (the residual add broadcasts)"
    bias = match.kwargs.get("bias")
    if bias is not None and (why := bias_problem(x, bias.meta["val"], "x")):
        return why
    return contiguous_outputs(match)


def _is_site(node: torch.fx.Node) -> bool:
    """A dropout whose output goes only into an add with a tensor of its shape: a residual add. (The embedding
    dropout also feeds the first norm; attention dropout feeds a matmul: neither is a site.)"""
    outs = [u for u in node.users if u.target is operator.getitem and u.args[1] == 0]
    if len(outs) != 1 or len(outs[0].users) != 1:
        return False
    (add,) = outs[0].users
    if add.target != aten.add.Tensor or len(add.args) != 2:
        return False
    shapes = [a.meta["val"].shape for a in add.args if isinstance(a, torch.fx.Node) and "val" in a.meta]
    return len(shapes) == 2 and shapes[0] == shapes[1]


def _has_dropout(graph: torch.fx.Graph) -> bool:
    return bool(graph.find_nodes(op="call_function", target=aten.native_dropout.default))


for _pattern, _replacement, _examples_of in (
    (bias_dropout_add, fused_bias_dropout_add, _bias_examples),
    (dropout_add, fused_dropout_add, _examples),
    (bias_dropout_add_residual_last, fused_bias_dropout_add, _bias_examples),
    (dropout_add_residual_last, fused_dropout_add, _examples),
):
    register_rule(Rule(
        name="bias_dropout_add",
        pattern=_pattern,
        replacement=_replacement,
        example_inputs=_examples_of,
        scalars={"p": P},
        extra_check=_check,
        anchors=(aten.native_dropout.default,),
        site=_is_site,
        wanted=_has_dropout,
    ))
