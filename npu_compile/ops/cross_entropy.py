"""Fused output projection + cross-entropy: `linear_cross_entropy` and its backward op, in namespace npu_compile.

    linear_cross_entropy(hidden, weight, target, ignore_index, label_smoothing, reduction, chunk_size)
        -> (loss, lse)
    = F.cross_entropy((hidden @ weight.T).float(), target, ignore_index=..., label_smoothing=...,
                      reduction=...), with lse = logsumexp of each token's logits (fp32)

hidden is [..., H] (the tokens are its leading dims, N of them), weight [V, H] in hidden's dtype, target int64
shaped like hidden's leading dims. The logits are the matmul in hidden's dtype, rounded once, then fp32 (fp64 for
fp64 inputs), as eager's ``linear(...).float()`` gives them. loss is fp32: shaped like target for reduction
"none", 0-dim for "mean" and "sum". lse is shaped like target and is what the backward saves, with hidden,
weight and target: never the logits.

Decisions:
- Chunked over tokens: forward and backward hold the fp32 logits (and then their gradient, in place) of at
  most `chunk_size` tokens at a time, never [N, V]; the backward recomputes each chunk's logits from hidden
  and weight (one more matmul per chunk) and accumulates grad_weight over the chunks in fp32. chunk_size 0
  picks the chunk: as many tokens as keep one chunk's fp32 logits within CHUNK_ELEMENTS (16 MiB), at least 1.
- label_smoothing ε is PyTorch's: loss_i = (1 − ε)·nll_i + ε·(lse_i − mean_j logit_ij) (the uniform target
  spread over all V classes). Megatron's smoothing α is ε = α·V/(V − 1) of this form.
- A token whose target is ignore_index has loss 0 and gradient 0; "mean" divides the sum by the number of
  tokens that are not ignored (nan when all are, as eager). Targets are not range-checked (that would be a
  host read); one out of [0, V) that is not ignore_index is an error of the caller, as in eager.
- The gradient of the logits is cast to hidden's dtype before the matmuls, as eager's ``.float()`` backward
  casts it; grad_hidden and grad_weight come back in the input dtypes, contiguous.
"""

from __future__ import annotations

import torch
from torch import Tensor

from npu_compile.ops.common import acc_dtype, no_grad_placeholder

REDUCTIONS = ("none", "mean", "sum")
CHUNK_ELEMENTS = 2**22  # one chunk's fp32 logits: 16 MiB (vocab 32000: 131 tokens a chunk)


def _check_operands(hidden: Tensor, weight: Tensor, target: Tensor, rows: str) -> None:
    """hidden [..., H] and weight [rows, H] of one floating dtype, target int64 of hidden's leading dims."""
    if (hidden.dim() < 1 or weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]
            or weight.dtype != hidden.dtype or not hidden.is_floating_point()):
        raise ValueError(f"hidden {tuple(hidden.shape)} {hidden.dtype} and weight {tuple(weight.shape)} "
                         f"{weight.dtype} must be [..., H] and [{rows}, H] of one floating dtype")
    if tuple(target.shape) != tuple(hidden.shape[:-1]) or target.dtype != torch.int64:
        raise ValueError(f"target {tuple(target.shape)} {target.dtype} must be int64 shaped like hidden's "
                         f"leading dims {tuple(hidden.shape[:-1])}")


def _check(hidden: Tensor, weight: Tensor, target: Tensor, label_smoothing: float, reduction: str) -> None:
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
    _check_operands(hidden, weight, target, "V")


def chunk_rows(tokens: int, vocab: int, chunk_size: int) -> int:
    """Tokens per chunk: chunk_size, or for 0 as many as keep a chunk's logits within CHUNK_ELEMENTS."""
    if chunk_size < 0:
        raise ValueError(f"chunk_size must be >= 0, got {chunk_size}")
    rows = chunk_size if chunk_size > 0 else CHUNK_ELEMENTS // max(vocab, 1)
    return max(1, min(rows, max(tokens, 1)))


def _logits(h: Tensor, weight: Tensor) -> Tensor:
    return (h @ weight.t()).to(acc_dtype(h.dtype))


def _accumulate(grad: Tensor, h: Tensor, weight: Tensor, grad_hidden: Tensor, grad_weight: Tensor | None) -> None:
    """One chunk's share of the backward from its logits' gradient ``grad`` (fp32 or wider, [chunk, V]):
    grad_hidden's rows = grad @ weight, and grad_weight (the fp32 accumulator) += gradᵀ @ h, in place, with the
    gradient rounded to the inputs' dtype first as autograd's would be. Half-precision inputs: the rounded
    gradient is held in ``grad`` itself (no second [chunk, V] fp32 buffer, no [V, H] product per chunk)."""
    low = grad.to(h.dtype) if h.dtype != grad.dtype else grad
    torch.mm(low, weight, out=grad_hidden)
    if grad_weight is not None:
        if low is not grad:
            grad.copy_(low)
        grad_weight.addmm_(grad.t(), h.to(grad.dtype))


def _forward(hidden, weight, target, ignore_index, label_smoothing, reduction, chunk_size):
    _check(hidden, weight, target, label_smoothing, reduction)
    h2, t1 = hidden.reshape(-1, hidden.shape[-1]), target.reshape(-1)
    n, vocab = h2.shape[0], weight.shape[0]
    acc = acc_dtype(hidden.dtype)
    losses = torch.empty(n, dtype=acc, device=hidden.device)
    lse = torch.empty(n, dtype=acc, device=hidden.device)
    step = chunk_rows(n, vocab, chunk_size)
    for start in range(0, n, step):
        logits = _logits(h2[start:start + step], weight)
        t = t1[start:start + step]
        valid = t != ignore_index
        chunk_lse = torch.logsumexp(logits, dim=-1)
        picked = logits.gather(1, torch.where(valid, t, 0).unsqueeze(1)).squeeze(1)
        loss = chunk_lse - picked
        if label_smoothing:
            loss = loss * (1.0 - label_smoothing) + (chunk_lse - logits.mean(-1)) * label_smoothing
        losses[start:start + step] = torch.where(valid, loss, 0.0)
        lse[start:start + step] = chunk_lse
    if reduction == "none":
        out = losses.view(target.shape)
    elif reduction == "sum":
        out = losses.sum()
    else:
        out = losses.sum() / (t1 != ignore_index).sum()
    return out, lse.view(target.shape)


@torch.library.custom_op("npu_compile::linear_cross_entropy", mutates_args=())
def linear_cross_entropy(hidden: Tensor, weight: Tensor, target: Tensor, ignore_index: int = -100,
                         label_smoothing: float = 0.0, reduction: str = "mean",
                         chunk_size: int = 0) -> tuple[Tensor, Tensor]:
    """cross_entropy((hidden @ weight.T).float(), target); returns (loss fp32, lse fp32 shaped like target)."""
    return _forward(hidden, weight, target, ignore_index, label_smoothing, reduction, chunk_size)


@linear_cross_entropy.register_fake
def _(hidden, weight, target, ignore_index=-100, label_smoothing=0.0, reduction="mean", chunk_size=0):
    _check(hidden, weight, target, label_smoothing, reduction)
    acc = acc_dtype(hidden.dtype)
    loss_shape = target.shape if reduction == "none" else ()
    return hidden.new_empty(loss_shape, dtype=acc), hidden.new_empty(target.shape, dtype=acc)


@torch.library.custom_op("npu_compile::linear_cross_entropy_backward", mutates_args=())
def linear_cross_entropy_backward(grad_loss: Tensor, hidden: Tensor, weight: Tensor, target: Tensor, lse: Tensor,
                                  ignore_index: int = -100, label_smoothing: float = 0.0, reduction: str = "mean",
                                  chunk_size: int = 0, weight_grad: bool = True) -> tuple[Tensor, Tensor]:
    """Returns (grad_hidden, grad_weight — empty [0] unless weight_grad).

    d loss_i / d logit_ij = g_i·(softmax_ij − (1 − ε)·[j = t_i] − ε/V), g_i = 0 where t_i is ignored, g_i =
    grad_loss / (tokens not ignored) for "mean"."""
    _check(hidden, weight, target, label_smoothing, reduction)
    h2, t1 = hidden.reshape(-1, hidden.shape[-1]), target.reshape(-1)
    lse1 = lse.reshape(-1)
    n, vocab = h2.shape[0], weight.shape[0]
    acc = lse.dtype
    g = grad_loss.to(acc)
    if reduction == "mean":
        g = g / (t1 != ignore_index).sum()
    g = g.reshape(-1).expand(n) if reduction != "none" else g.reshape(-1)
    grad_hidden = torch.empty_like(h2, memory_format=torch.contiguous_format)
    grad_weight = torch.zeros(weight.shape, dtype=acc, device=weight.device) if weight_grad else None
    step = chunk_rows(n, vocab, chunk_size)
    for start in range(0, n, step):
        h = h2[start:start + step]
        t = t1[start:start + step]
        valid = t != ignore_index
        grad = _logits(h, weight).sub_(lse1[start:start + step].unsqueeze(1)).exp_()  # softmax, in place
        if label_smoothing:
            grad.sub_(label_smoothing / vocab)
        rows = torch.arange(grad.shape[0], device=grad.device)
        grad[rows, torch.where(valid, t, 0)] -= 1.0 - label_smoothing
        grad.mul_(torch.where(valid, g[start:start + step], 0.0).unsqueeze(1))
        _accumulate(grad, h, weight, grad_hidden[start:start + step], grad_weight)
    grad_weight = grad_weight.to(weight.dtype) if grad_weight is not None else no_grad_placeholder(weight)
    return grad_hidden.view(hidden.shape), grad_weight


@linear_cross_entropy_backward.register_fake
def _(grad_loss, hidden, weight, target, lse, ignore_index=-100, label_smoothing=0.0, reduction="mean",
      chunk_size=0, weight_grad=True):
    _check(hidden, weight, target, label_smoothing, reduction)
    return hidden.new_empty(hidden.shape), weight.new_empty(weight.shape) if weight_grad else no_grad_placeholder(weight)


def _setup_context(ctx, inputs, output):
    hidden, weight, target, ignore_index, label_smoothing, reduction, chunk_size = inputs
    _, lse = output
    ctx.save_for_backward(hidden, weight, target, lse)
    ctx.params = (ignore_index, label_smoothing, reduction, chunk_size)
    ctx.mark_non_differentiable(lse)


def _grad(ctx, grad_loss, _grad_lse):
    hidden, weight, target, lse = ctx.saved_tensors
    weight_grad = ctx.needs_input_grad[1]
    grad_hidden, grad_weight = torch.ops.npu_compile.linear_cross_entropy_backward(
        grad_loss, hidden, weight, target, lse, *ctx.params, weight_grad)
    return grad_hidden, grad_weight if weight_grad else None, None, None, None, None, None


linear_cross_entropy.register_autograd(_grad, setup_context=_setup_context)


# ==== Megatron's vocab-parallel loss after its output layer ================================================
#
#     vocab_parallel_linear_cross_entropy(hidden, weight, target, vocab_start, smoothing, group_name, chunk_size,
#                                         logits_grad_dtype) -> (loss, lse)
#     = megatron.core.tensor_parallel.vocab_parallel_cross_entropy((hidden @ weight.T).float(), target, α)
#     (logits_grad_dtype bf16: megatron.core.fusions.fused_cross_entropy.fused_vocab_parallel_cross_entropy(
#      hidden @ weight.T, target, group))
#
# weight is this rank's shard of the output layer, [Vp, H] for vocab ids [vocab_start, vocab_start + Vp); the
# ranks of the tensor-parallel group `group_name` hold the other shards. loss is per token, fp32, shaped like
# target, equal on every rank up to the smoothing term (below); lse is the logsumexp over the whole vocabulary,
# what the backward saves. The three all-reduces of Megatron's forward (the max, the target's logit and the sum
# of exponentials over the group) run inside the op, per chunk of tokens, as functional collectives; the
# backward needs none (Megatron's has none; the output layer's dgrad all-reduce stays in the graph).
#
# Decisions (each is Megatron's, reproduced so that the fused loss equals the eager one):
# - A target outside every shard (Megatron has no ignore_index; a padding id such as -100 is masked by the
#   caller's loss mask) has its logit counted as 0 after the max is subtracted: loss = lse − max, gradient
#   softmax (− smoothing/Vp).
# - smoothing is the ε of PyTorch's form on the shard: loss = (1 − ε)·nll − ε·mean_{j in shard} log p_j.
#   Megatron's label_smoothing α gives ε = α·Vp/(Vp − 1) (Vp = the shard's vocab size, as Megatron takes
#   it); at TP=1 that is F.cross_entropy's label_smoothing=ε. At TP > 1 Megatron's mean runs over the shard
#   only (not all-reduced), so the smoothed loss differs between ranks; the op does the same.
# - Chunked over tokens as linear_cross_entropy (chunk_size, CHUNK_ELEMENTS), the backward recomputes the logits.
# - logits_grad_dtype (None: none) is a dtype the logits' gradient is rounded to before hidden's dtype: Megatron's
#   fused_vocab_parallel_cross_entropy returns it in bf16 whatever the logits' dtype (autograd casts it back),
#   so an fp32 model's gradients carry bf16 rounding there; with bf16 the op reproduces that.


def _all_reduce(t: Tensor, op: str, group_name: str) -> Tensor:
    """``t`` reduced over the group; a group of one process reduces to ``t`` itself, with no collective (Megatron
    calls it at TP 1 too: three functional collectives and their waits a step, about a twentieth of a small
    model's CPU step)."""
    if torch.distributed.distributed_c10d._get_group_size_by_name(group_name) == 1:
        return t
    return torch.ops._c10d_functional.wait_tensor(torch.ops._c10d_functional.all_reduce(t, op, group_name))


def _check_vocab_parallel(hidden, weight, target, smoothing):
    if not 0.0 <= smoothing < 1.0:
        raise ValueError(f"smoothing must be in [0, 1), got {smoothing}")
    _check_operands(hidden, weight, target, "Vp")


def _shard_target(t: Tensor, vocab_start: int, vocab: int) -> tuple[Tensor, Tensor]:
    """(outside: the target is not in this shard, the target's column in the shard or 0)."""
    outside = (t < vocab_start) | (t >= vocab_start + vocab)
    return outside, torch.where(outside, 0, t - vocab_start)


@torch.library.custom_op("npu_compile::vocab_parallel_linear_cross_entropy", mutates_args=())
def vocab_parallel_linear_cross_entropy(hidden: Tensor, weight: Tensor, target: Tensor, vocab_start: int,
                                        smoothing: float, group_name: str, chunk_size: int = 0,
                                        logits_grad_dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor]:
    """Megatron's vocab_parallel_cross_entropy of (hidden @ weight.T).float(); returns (loss, lse), fp32."""
    _check_vocab_parallel(hidden, weight, target, smoothing)
    h2, t1 = hidden.reshape(-1, hidden.shape[-1]), target.reshape(-1)
    n, vocab = h2.shape[0], weight.shape[0]
    acc = acc_dtype(hidden.dtype)
    losses = torch.empty(n, dtype=acc, device=hidden.device)
    lse = torch.empty(n, dtype=acc, device=hidden.device)
    step = chunk_rows(n, vocab, chunk_size)
    for start in range(0, n, step):
        logits = _logits(h2[start:start + step], weight)
        outside, column = _shard_target(t1[start:start + step], vocab_start, vocab)
        logits_max = _all_reduce(logits.max(dim=-1)[0], "max", group_name)
        logits.sub_(logits_max.unsqueeze(1))
        picked = logits.gather(1, column.unsqueeze(1)).squeeze(1).masked_fill(outside, 0.0)
        picked = _all_reduce(picked, "sum", group_name)
        sum_exp = _all_reduce(logits.exp().sum(-1), "sum", group_name)
        log_sum = sum_exp.log()
        loss = log_sum - picked
        if smoothing:
            mean_log_p = logits.mean(-1) - log_sum  # log(exp(l − max) / Σ), averaged over the shard
            loss = (1.0 - smoothing) * loss - smoothing * mean_log_p
        losses[start:start + step] = loss
        lse[start:start + step] = logits_max + log_sum
    return losses.view(target.shape), lse.view(target.shape)


@vocab_parallel_linear_cross_entropy.register_fake
def _(hidden, weight, target, vocab_start, smoothing, group_name, chunk_size=0, logits_grad_dtype=None):
    _check_vocab_parallel(hidden, weight, target, smoothing)
    acc = acc_dtype(hidden.dtype)
    return hidden.new_empty(target.shape, dtype=acc), hidden.new_empty(target.shape, dtype=acc)


@torch.library.custom_op("npu_compile::vocab_parallel_linear_cross_entropy_backward", mutates_args=())
def vocab_parallel_linear_cross_entropy_backward(grad_loss: Tensor, hidden: Tensor, weight: Tensor,
                                                 target: Tensor, lse: Tensor, vocab_start: int, smoothing: float,
                                                 chunk_size: int = 0, weight_grad: bool = True,
                                                 logits_grad_dtype: torch.dtype | None = None
                                                 ) -> tuple[Tensor, Tensor]:
    """Returns (grad_hidden, grad_weight — empty [0] unless weight_grad) of this rank's shard:
    d loss_i / d logit_ij = g_i·(softmax_ij − (1 − ε)·[j = t_i in the shard] − ε/Vp)."""
    _check_vocab_parallel(hidden, weight, target, smoothing)
    h2, t1, lse1 = hidden.reshape(-1, hidden.shape[-1]), target.reshape(-1), lse.reshape(-1)
    n, vocab = h2.shape[0], weight.shape[0]
    acc = lse.dtype
    g = grad_loss.to(acc).reshape(-1)
    grad_hidden = torch.empty_like(h2, memory_format=torch.contiguous_format)
    grad_weight = torch.zeros(weight.shape, dtype=acc, device=weight.device) if weight_grad else None
    step = chunk_rows(n, vocab, chunk_size)
    for start in range(0, n, step):
        h = h2[start:start + step]
        outside, column = _shard_target(t1[start:start + step], vocab_start, vocab)
        grad = _logits(h, weight).sub_(lse1[start:start + step].unsqueeze(1)).exp_()  # softmax, in place
        rows = torch.arange(grad.shape[0], device=grad.device)
        grad[rows, column] -= (1.0 - smoothing) * (~outside).to(acc)
        if smoothing:
            grad.sub_(smoothing / vocab)
        grad.mul_(g[start:start + step].unsqueeze(1))
        if logits_grad_dtype is not None:
            grad.copy_(grad.to(logits_grad_dtype))  # rounded as Megatron's fused loss rounds it, kept in fp32
        _accumulate(grad, h, weight, grad_hidden[start:start + step], grad_weight)
    grad_weight = grad_weight.to(weight.dtype) if grad_weight is not None else no_grad_placeholder(weight)
    return grad_hidden.view(hidden.shape), grad_weight


@vocab_parallel_linear_cross_entropy_backward.register_fake
def _(grad_loss, hidden, weight, target, lse, vocab_start, smoothing, chunk_size=0, weight_grad=True,
      logits_grad_dtype=None):
    _check_vocab_parallel(hidden, weight, target, smoothing)
    return hidden.new_empty(hidden.shape), weight.new_empty(weight.shape) if weight_grad else no_grad_placeholder(weight)


def _vp_setup_context(ctx, inputs, output):
    hidden, weight, target, vocab_start, smoothing, _group_name, chunk_size, logits_grad_dtype = inputs
    ctx.save_for_backward(hidden, weight, target, output[1])
    ctx.params = (vocab_start, smoothing, chunk_size)
    ctx.logits_grad_dtype = logits_grad_dtype
    ctx.mark_non_differentiable(output[1])


def _vp_grad(ctx, grad_loss, _grad_lse):
    hidden, weight, target, lse = ctx.saved_tensors
    weight_grad = ctx.needs_input_grad[1]
    grad_hidden, grad_weight = torch.ops.npu_compile.vocab_parallel_linear_cross_entropy_backward(
        grad_loss, hidden, weight, target, lse, *ctx.params, weight_grad, ctx.logits_grad_dtype)
    return grad_hidden, grad_weight if weight_grad else None, None, None, None, None, None, None


vocab_parallel_linear_cross_entropy.register_autograd(_vp_grad, setup_context=_vp_setup_context)
