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

Rule ``vocab_parallel_cross_entropy``: Megatron's loss after its output layer, ``vocab_parallel_cross_entropy(
output_layer(h)[0].float(), labels, α)`` (megatron-core 0.16.1, ColumnParallelLinear without bias and
gather_output, at any TP size) → ``npu_compile::vocab_parallel_linear_cross_entropy``, which does the loss's
three all-reduces over the TP group itself. Both are autograd.Functions with hand-written backwards; Dynamo
traces their forwards and backwards into the joint graph, and the pattern is a copy of the two, op for op
(in-place ops included, functionalized alike), with the TP collectives as Dynamo writes them (functional
all_reduce, wait, copy back). The graph holds Megatron's scalars: the shard's vocab range [start, end) and, when
smoothed, s = α·Vp/(Vp − 1), 1 − s and s/Vp, read from the match (the check requires they come from one s).
The group name is a string, which the matcher compares as a literal: the pattern is traced with the group name
of the graph's first loss (one TP group per process). The dgrad all-reduce of the output layer's backward
stays in the graph.

With sequence parallelism the output layer all-gathers its input over the TP group before the matmul, and
again in the backward for the weight's gradient: a variant takes both gathers, checks they gather the same
tensor, and the fused op's backward uses the first (the second is left dead).

Megatron's other loss, ``fused_vocab_parallel_cross_entropy(output_layer(h)[0], labels, tp_group)``
(megatron.core.fusions.fused_cross_entropy: what GPTModel.compute_language_model_loss calls with
cross_entropy_loss_fusion and cross_entropy_fusion_impl "native"), is the same rule's too, with and without
sequence parallelism, its pattern again a copy of its autograd.Function: the ops of the first loss, through
jit_fuser helpers (torch.compile on torch ≥ 2.2, which Dynamo inlines), with no ``.float()`` in front (its
forward casts the logits itself), the target's logit and the sum of exponentials concatenated into one sum
all-reduce and split after it, no label smoothing, and a backward that returns the logits' gradient in bf16
(autograd casts it back to an fp32 model's fp32): the fused op reproduces that rounding (logits_grad_dtype
bf16), so an fp32 model's gradients equal eager's, bf16 rounding included. These variants come first and are
wanted only by a graph holding a sum all-reduce of a concatenation: a graph of the first loss never traces
them, and one of this loss stops once they have matched.

Not matched yet: a graph with symbolic sizes (torch.compile's dynamic shapes; reported unfused by design).
Not matched here: class weights, an output layer with bias or gather_output, gradient_accumulation_fusion (a
wgrad kernel outside the graph), and the fused loss in an fp16 model (its gradient cast bf16 → fp16: traced in
fp32 and bf16 only).
"""

from __future__ import annotations

import itertools
import math
import operator

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


# ==== Megatron's vocab-parallel cross-entropy (rule vocab_parallel_cross_entropy) ============================

# The scalars the pattern is traced with: a vocab range and s, 1 − s, s/Vp no graph holds otherwise.
VOCAB_START, VOCAB_END = 7_654_321, 7_654_987
SMOOTHING, SMOOTH_KEEP, SMOOTH_SPREAD = 5 * 2.0**-7, 0.9609375 - 2.0**-12, 2.0**-11
_group = {"name": "npu_compile_tp_group"}  # the graph's TP group name, set by _wants_megatron


def _functional_all_reduce_(t, op: str) -> None:
    """torch.distributed.all_reduce(t, op, group) as Dynamo captures it: functional all_reduce, wait, copy back."""
    t.copy_(torch.ops._c10d_functional.wait_tensor(torch.ops._c10d_functional.all_reduce(t, op, _group["name"])))


class _MegatronLinear(torch.autograd.Function):
    """megatron-core's LinearWithGradAccumulationAndAsyncCommunication without bias, sequence parallelism or
    gradient_accumulation_fusion, its dgrad all-reduce left out (it follows the pattern in the graph)."""

    @staticmethod
    def forward(ctx, input, weight):
        ctx.save_for_backward(input, weight)
        return torch.matmul(input, weight.t())

    @staticmethod
    def backward(ctx, grad_output):
        input, weight = ctx.saved_tensors
        grad_input = grad_output.matmul(weight)
        grad_output, total_input = grad_output.contiguous(), input.contiguous()
        if grad_output.dim() == 3:
            grad_output = grad_output.view(grad_output.shape[0] * grad_output.shape[1], grad_output.shape[2])
            total_input = total_input.view(total_input.shape[0] * total_input.shape[1], total_input.shape[2])
        return grad_input, grad_output.t().matmul(total_input)


class _MegatronLinearGathered(torch.autograd.Function):
    """The same with sequence parallelism: the input all-gathered over the TP group, once for the forward and
    again in the backward for the weight's gradient (``gathered``, another node of the same value; its
    reduce-scatter of the input's gradient follows the pattern in the graph)."""

    @staticmethod
    def forward(ctx, input, gathered, weight):
        ctx.save_for_backward(gathered, weight)
        return torch.matmul(input, weight.t())

    @staticmethod
    def backward(ctx, grad_output):
        total_input, weight = ctx.saved_tensors
        grad_input = grad_output.matmul(weight)
        grad_output, total_input = grad_output.contiguous(), total_input.contiguous()
        if grad_output.dim() == 3:
            grad_output = grad_output.view(grad_output.shape[0] * grad_output.shape[1], grad_output.shape[2])
            total_input = total_input.view(total_input.shape[0] * total_input.shape[1], total_input.shape[2])
        return grad_input, None, grad_output.t().matmul(total_input)


def _megatron_softmax_parts(logits, target, start, end):
    """The forward both of Megatron's losses share, up to their all-reduces of the target's logit and the sum of
    exponentials (VocabParallelCrossEntropy.calculate_logits_max, the max all-reduce, calculate_predicted_logits):
    (target_mask, masked_target_1d, predicted, sum_exp, exp_logits)."""
    logits = logits.float()
    logits_max = torch.max(logits, dim=-1)[0]
    _functional_all_reduce_(logits_max, "max")
    logits -= logits_max.unsqueeze(dim=-1)
    target_mask = (target < start) | (target >= end)
    masked_target = target.clone() - start
    masked_target[target_mask] = torch.full((), 0, dtype=target.dtype)  # engine.scalar_constants_as_full
    vocab = logits.size()[-1]
    logits_2d = logits.view(-1, vocab)
    masked_target_1d = masked_target.view(-1)
    arange_1d = torch.arange(start=0, end=logits_2d.size()[0], device=logits_2d.device)
    predicted_1d = logits_2d[arange_1d, masked_target_1d].clone().contiguous()
    predicted = predicted_1d.view_as(target)
    predicted[target_mask] = torch.full((), 0.0, dtype=torch.float32)
    exp_logits = logits
    torch.exp(logits, out=exp_logits)
    sum_exp = exp_logits.sum(dim=-1)
    return target_mask, masked_target_1d, predicted, sum_exp, exp_logits


def _megatron_logits_grad(softmax, target_mask, masked_target_1d, grad_output, factors=None):
    """The backward both of Megatron's losses share (prepare_gradient_calculation_operands, calculate_gradients),
    with the smoothing factors (keep, spread) of _VocabParallelCrossEntropy's or None: the logits' gradient, in
    place of the saved softmax."""
    grad_2d = softmax.view(-1, softmax.size()[-1])
    arange_1d = torch.arange(start=0, end=grad_2d.size()[0], device=grad_2d.device)
    softmax_update = 1.0 - target_mask.view(-1).float()
    if factors is not None:
        keep, spread = factors
        grad_2d[arange_1d, masked_target_1d] -= keep * softmax_update
        grad_2d[arange_1d, :] -= spread
    else:
        grad_2d[arange_1d, masked_target_1d] -= softmax_update
    softmax.mul_(grad_output.unsqueeze(dim=-1))
    return softmax


class _MegatronCrossEntropy(torch.autograd.Function):
    """megatron-core 0.16.1's _VocabParallelCrossEntropy (tensor_parallel/cross_entropy.py), op for op, with the
    vocab range and the smoothing factors as arguments (smoothing None: unsmoothed)."""

    @staticmethod
    def forward(ctx, logits, target, start, end, smoothing, keep, spread):
        start, end = int(start), int(end)  # traced as floats (engine._ints_as_floats); Megatron's are ints
        target_mask, masked_target_1d, predicted, sum_exp, exp_logits = _megatron_softmax_parts(
            logits, target, start, end)
        _functional_all_reduce_(predicted, "sum")
        _functional_all_reduce_(sum_exp, "sum")
        loss = torch.log(sum_exp) - predicted
        exp_logits.div_(sum_exp.unsqueeze(dim=-1))
        if smoothing is not None:
            mean_log_probs = torch.log(exp_logits).mean(dim=-1)
            loss = keep * loss - smoothing * mean_log_probs
        ctx.factors = (keep, spread) if smoothing is not None else None
        ctx.save_for_backward(exp_logits, target_mask, masked_target_1d)
        return loss

    @staticmethod
    def backward(ctx, grad_output):
        return _megatron_logits_grad(*ctx.saved_tensors, grad_output, ctx.factors), None, None, None, None, None, None


class _MegatronFusedCrossEntropy(torch.autograd.Function):
    """megatron-core 0.16.1's fusions/fused_cross_entropy.py _VocabParallelCrossEntropy (what
    fused_vocab_parallel_cross_entropy applies), op for op, its jit_fuser helpers inlined as Dynamo inlines
    them: the target's logit and the sum of exponentials concatenated into one all-reduce, no smoothing, and
    the logits' gradient returned in bf16 (autograd casts it to the logits' dtype)."""

    @staticmethod
    def forward(ctx, logits, target, start, end):
        start, end = int(start), int(end)  # traced as floats (engine._ints_as_floats); Megatron's are ints
        target_mask, masked_target_1d, predicted, sum_exp, exp_logits = _megatron_softmax_parts(
            logits, target, start, end)
        predicted_sum_exp = torch.cat((predicted, sum_exp))
        _functional_all_reduce_(predicted_sum_exp, "sum")
        predicted, sum_exp = torch.split(predicted_sum_exp, predicted_sum_exp.size()[0] // 2)
        loss = torch.log(sum_exp) - predicted
        exp_logits.div_(sum_exp.unsqueeze(dim=-1))
        ctx.save_for_backward(exp_logits, target_mask, masked_target_1d)
        return loss

    @staticmethod
    def backward(ctx, grad_output):
        return _megatron_logits_grad(*ctx.saved_tensors, grad_output).to(torch.bfloat16), None, None, None


def megatron_loss_pattern(smoothed: bool, sequence_parallel: bool, native_fusion: bool = False,
                          cast_outside: bool = False):
    """Megatron's loss after its output layer: tensor_parallel.vocab_parallel_cross_entropy of the logits as the
    output layer gives them (GPTModel.compute_language_model_loss: the Function casts bf16 / fp16 logits to fp32
    inside, so autograd casts their gradient back), with cast_outside of their ``.float()`` (a caller's own cast,
    differentiated as an op); or with native_fusion fusions.fused_vocab_parallel_cross_entropy of the logits
    (GPTModel with cross_entropy_loss_fusion, impl "native"). In fp32 the two casts trace alike."""
    assert not (smoothed and native_fusion), "fused_vocab_parallel_cross_entropy takes no label smoothing"

    def loss(hidden, gathered, weight, target, start, end, smoothing=None, keep=None, spread=None):
        if sequence_parallel:
            logits = _MegatronLinearGathered.apply(hidden, gathered, weight)
        else:
            logits = _MegatronLinear.apply(hidden, weight)
        if native_fusion:
            return _MegatronFusedCrossEntropy.apply(logits, target, start, end)
        logits = logits.float() if cast_outside else logits
        return _MegatronCrossEntropy.apply(logits, target, start, end, smoothing, keep, spread)

    if smoothed and sequence_parallel:
        def pattern(hidden, gathered, weight, target, start, end, smoothing, keep, spread):
            return loss(hidden, gathered, weight, target, start, end, smoothing, keep, spread)
    elif smoothed:
        def pattern(hidden, weight, target, start, end, smoothing, keep, spread):
            return loss(hidden, None, weight, target, start, end, smoothing, keep, spread)
    elif sequence_parallel:
        def pattern(hidden, gathered, weight, target, start, end):
            return loss(hidden, gathered, weight, target, start, end)
    else:
        def pattern(hidden, weight, target, start, end):
            return loss(hidden, None, weight, target, start, end)
    pattern.__name__ = (f"megatron_{'fused_' if native_fusion else ''}vocab_parallel_cross_entropy"
                        f"{'_smoothed' if smoothed else ''}{'_sequence_parallel' if sequence_parallel else ''}"
                        f"{'_of_float' if cast_outside else ''}")
    return pattern


def megatron_loss_replacement(smoothed: bool, sequence_parallel: bool, native_fusion: bool = False):
    # the fused form rounds the logits' gradient to bf16 (calculate_gradients), so the fused op does too
    logits_grad_dtype = BF16 if native_fusion else None

    def fused_loss(hidden, weight, target, start, smoothing):
        loss, _lse = fused.vocab_parallel_linear_cross_entropy(hidden, weight, target, int(start), smoothing,
                                                               _group["name"], 0, logits_grad_dtype)
        return loss

    # the backward's second gather is left without users: the fused op's backward takes the forward's
    if smoothed and sequence_parallel:
        def replacement(hidden, gathered, weight, target, start, end, smoothing, keep, spread):
            return fused_loss(hidden, weight, target, start, smoothing)
    elif smoothed:
        def replacement(hidden, weight, target, start, end, smoothing, keep, spread):
            return fused_loss(hidden, weight, target, start, smoothing)
    elif sequence_parallel:
        def replacement(hidden, gathered, weight, target, start, end):
            return fused_loss(hidden, weight, target, start, 0.0)
    else:
        def replacement(hidden, weight, target, start, end):
            return fused_loss(hidden, weight, target, start, 0.0)
    return replacement


def _megatron_examples(sequence_parallel: bool):
    def examples():
        for dtype in (F32, BF16):
            hidden = torch.empty(4, 2, 8, dtype=dtype, requires_grad=True)
            gathered = [torch.empty(4, 2, 8, dtype=dtype)] if sequence_parallel else []
            yield [hidden, *gathered, torch.empty(16, 8, dtype=dtype, requires_grad=True),
                   torch.zeros(4, 2, dtype=torch.long)]

    return examples


def _all_gathered(node):
    """(input, group size, group) of ``wait_tensor(all_gather_into_tensor(input, n, group))``, Megatron's
    all-gather into a buffer as Dynamo captures it (its copy into the fresh buffer normalized away), or None."""
    wait = node.args[1] if isinstance(node, torch.fx.Node) and node.target == aten.copy.default else node
    if not (isinstance(wait, torch.fx.Node) and wait.target == torch.ops._c10d_functional.wait_tensor.default):
        return None
    gather = wait.args[0]
    if not (isinstance(gather, torch.fx.Node)
            and gather.target == torch.ops._c10d_functional.all_gather_into_tensor.default):
        return None
    return tuple(gather.args)


def _megatron_check(match) -> bool | str:
    hidden, weight, target = _val(match, "hidden"), _val(match, "weight"), _val(match, "target")
    if weight.dtype != hidden.dtype or weight.dim() != 2:
        return f"weight {tuple(weight.shape)} {weight.dtype} on hidden {hidden.dtype}: the fused op takes one dtype"
    if target.dtype != torch.int64:
        return f"target is {target.dtype}; the fused op takes int64 class indices"
    if "gathered" in match.kwargs:
        once, again = _all_gathered(match.kwargs["hidden"]), _all_gathered(match.kwargs["gathered"])
        if once is None or once != again:
            return ("the weight's gradient takes another input than the forward's matmul, not the same "
                    "all-gather of it (sequence parallelism)")
    start, end, vocab = match.kwargs["start"], match.kwargs["end"], weight.shape[0]
    if not (isinstance(start, (int, float)) and isinstance(end, (int, float)) and end - start == vocab):
        return f"vocab range [{start}, {end}) is not the output layer's {vocab} rows"
    if "smoothing" in match.kwargs:
        s, keep, spread = match.kwargs["smoothing"], match.kwargs["keep"], match.kwargs["spread"]
        if not all(isinstance(x, float) for x in (s, keep, spread)):
            return "the smoothing factors are not constants"
        if not (0.0 < s < 1.0 and keep == 1.0 - s and math.isclose(spread * vocab, s, rel_tol=1e-9)):
            return (f"loss·{keep} − mean log p·{s}, softmax − {spread} are not Megatron's smoothing "
                    f"(1 − s, s and s/Vp with Vp = {vocab})")
    return True


def _group_name(graph) -> str | None:
    for node in graph.find_nodes(op="call_function", target=torch.ops._c10d_functional.all_reduce.default):
        if node.args[1] == "max" and isinstance(node.args[0], torch.fx.Node) \
                and node.args[0].target is operator.getitem:
            return node.args[2]
    return None


def _wants_megatron(graph) -> bool:
    """A max all-reduce of a row max: Megatron's loss may be here; its group is the one the pattern is traced with."""
    name = _group_name(graph)
    if name is not None and name != _group["name"] and _group["name"] == "npu_compile_tp_group":
        _group["name"] = name
    return name is not None


def _megatron_site(node) -> bool | str:
    """A max all-reduce of a row max (Megatron's loss, its first collective) is a site; one over another group
    than the pattern's is left by design."""
    src = node.args[0]
    if not (isinstance(src, torch.fx.Node) and src.target is operator.getitem
            and getattr(src.args[0], "target", None) == aten.max.dim and node.args[1] == "max"):
        return False
    rows = src.args[0].args[0].meta.get("val") if isinstance(src.args[0].args[0], torch.fx.Node) else None
    if rows is not None and not all(isinstance(d, int) for d in rows.shape):
        return ("symbolic token count: Megatron's loss is matched at static shapes only (the pattern does not "
                "match its graph at symbolic sizes yet)")
    if node.args[2] != _group["name"]:
        return (f"the loss all-reduces over group {node.args[2]!r}; the pattern was traced with {_group['name']!r}, "
                "the TP group of this process's first loss")
    return True


def _wants_megatron_fused(graph) -> bool:
    """_wants_megatron, and a sum all-reduce of a concatenation (the fused loss's target logits and sums of
    exponentials, reduced as one): a graph of the other loss never traces these variants."""
    return _wants_megatron(graph) and any(
        node.args[1] == "sum" and getattr(node.args[0], "target", None) == aten.cat.default
        for node in graph.find_nodes(op="call_function", target=torch.ops._c10d_functional.all_reduce.default))


# the fused form first: its graphs then stop before the other form's variants are traced (a graph of the
# other form does not want the fused ones); then the logits as GPTModel hands them over, then their .float()
_MEGATRON_FORMS = [(True, _sp, False, False) for _sp in (False, True)] + [
    (False, _sp, _smooth, _cast) for _cast, _sp, _smooth in itertools.product((False, True), repeat=3)]

for _native, _sp, _smooth, _cast in _MEGATRON_FORMS:
    register_rule(Rule(
        name="vocab_parallel_cross_entropy",
        pattern=megatron_loss_pattern(_smooth, _sp, _native, _cast),
        replacement=megatron_loss_replacement(_smooth, _sp, _native),
        example_inputs=_megatron_examples(_sp),
        scalars={"start": VOCAB_START, "end": VOCAB_END,
                 **({"smoothing": SMOOTHING, "keep": SMOOTH_KEEP, "spread": SMOOTH_SPREAD} if _smooth else {})},
        extra_check=_megatron_check,
        modes=("training",),
        anchors=(torch.ops._c10d_functional.all_reduce.default,),
        site=_megatron_site,
        wanted=_wants_megatron_fused if _native else _wants_megatron,
        grad_optional=("weight",),
    ))
