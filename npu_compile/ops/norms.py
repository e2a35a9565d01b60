"""Fused normalizations of a pre-norm transformer: `rms_norm`, `add_rms_norm`, `add_layer_norm`, and their
backward ops, all in namespace npu_compile.

Each forward returns what torch_npu's op returns, in the same order, so the lowering is one call:
    rms_norm(x, weight, eps)                      -> (y, rstd)             ~ npu_rms_norm
    add_rms_norm(x, residual, weight, eps)        -> (y, rstd, sum)        ~ npu_add_rms_norm
    add_layer_norm(x, residual, weight, bias, eps) -> (y, mean, rstd, sum) ~ npu_add_layer_norm(..., True)
`sum = x + residual` is the pre-norm residual stream that feeds the next block. The statistics mean and rstd
are fp32 (fp64 for fp64 inputs), shaped x.shape[:-k] + [1]·k for a k-dim weight, and are what the backward
saves, never the normalized activations; outputs and gradients come back in the input dtypes, contiguous.

Decisions:
- The normalized dims are the last weight.dim() dims of x (the npu_rms_norm rule); Megatron's 1-D weight
  normalizes the hidden dim. weight is required (Megatron always has one; a zero-centred gamma is the rule's
  `weight + 1`). add_layer_norm's bias may be None.
- y is computed in fp32 from x·rstd·weight and rounded once to x.dtype: the npu semantics, eager's when
  x and weight share a dtype, and F.rms_norm's / F.layer_norm's for an fp32 weight on bf16/fp16 x (Megatron's
  torch norms keep fp32 weights in a bf16 model). Rules must not fire where the weight's dtype promotes y
  (a hand-written ``x·rstd·weight`` with an fp32 weight on bf16 x gives fp32).
- x and residual share a dtype, or one is bf16/fp16 and the other fp32 (an fp32 residual stream,
  ``residual.float() + x``): sum is x + residual in the wider dtype, exactly eager's promoting add, and the norm
  and y follow the sum's dtype; each summand's gradient comes back in its own dtype.
- The add ops save sum, not x and residual: one tensor instead of two, and the gradient of both summands is
  the same tensor.
- Plain layer_norm is not here: aten.native_layer_norm already is a fused op with fp32 statistics.
"""

from typing import Optional

import torch
from torch import Tensor

from npu_compile.ops.common import acc_dtype, no_grad_placeholder, sum_to_shape


def _norm_dims(x: Tensor, weight: Tensor) -> tuple[int, ...]:
    k = weight.dim()
    if k == 0 or k > x.dim() or tuple(x.shape[x.dim() - k:]) != tuple(weight.shape):
        raise ValueError(f"weight {tuple(weight.shape)} must match the trailing dims of x {tuple(x.shape)}")
    return tuple(range(x.dim() - k, x.dim()))


def _stat_shape(x: Tensor, weight: Tensor) -> tuple:
    k = weight.dim()
    return tuple(x.shape[: x.dim() - k]) + (1,) * k


LOW_PRECISION = (torch.bfloat16, torch.float16)


def sum_dtype(a: torch.dtype, b: torch.dtype) -> torch.dtype | None:
    """The dtype of the fused ops' x + residual: their common dtype, or fp32 for a bf16/fp16 summand and an
    fp32 one (what eager's add promotes to, exactly); None for any other pair."""
    if a == b:
        return a
    if {a, b} in ({torch.float32, torch.bfloat16}, {torch.float32, torch.float16}):
        return torch.float32
    return None


def _check_add(x: Tensor, residual: Tensor) -> torch.dtype:
    dtype = sum_dtype(x.dtype, residual.dtype)
    if x.shape != residual.shape or dtype is None:
        raise ValueError(f"x {tuple(x.shape)} {x.dtype} and residual {tuple(residual.shape)} {residual.dtype} "
                         "must share shape and dtype, or be a bf16/fp16 tensor and an fp32 one")
    return dtype


def _add(x: Tensor, residual: Tensor) -> Tensor:
    dtype = _check_add(x, residual)
    return (x.to(dtype) + residual.to(dtype)).contiguous()


# ---- RMSNorm -------------------------------------------------------------------------------------------

def _rms_forward(x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    dims = _norm_dims(x, weight)
    xf = x.to(acc_dtype(x.dtype))
    # Reductions of a permuted x can come back permuted; the statistics are contiguous, like the fakes.
    rstd = torch.rsqrt(xf.square().mean(dims, keepdim=True) + eps).contiguous()
    y = (xf * rstd * weight.to(xf.dtype)).to(x.dtype).contiguous()
    return y, rstd


def _rms_backward(grad_y: Tensor, x: Tensor, weight: Tensor, rstd: Tensor) -> tuple[Tensor, Tensor]:
    """dx = rstd·(g − x̂·mean(g·x̂)) with g = dy·γ and x̂ = x·rstd; dγ = Σ dy·x̂ (both in fp32)."""
    dims = _norm_dims(x, weight)
    acc = rstd.dtype
    x_hat = x.to(acc) * rstd
    dy = grad_y.to(acc)
    g = dy * weight.to(acc)
    grad_x = rstd * (g - x_hat * (g * x_hat).mean(dims, keepdim=True))
    grad_weight = sum_to_shape(dy * x_hat, weight.shape)
    return grad_x, grad_weight


@torch.library.custom_op("npu_compile::rms_norm", mutates_args=())
def rms_norm(x: Tensor, weight: Tensor, eps: float = 1e-6) -> tuple[Tensor, Tensor]:
    """y = x / sqrt(mean(x², last weight.dim() dims) + eps) · weight; returns (y, rstd)."""
    return _rms_forward(x, weight, eps)


@rms_norm.register_fake
def _(x, weight, eps=1e-6):
    return x.new_empty(x.shape), x.new_empty(_stat_shape(x, weight), dtype=acc_dtype(x.dtype))


@torch.library.custom_op("npu_compile::rms_norm_backward", mutates_args=())
def rms_norm_backward(grad_y: Tensor, x: Tensor, weight: Tensor, rstd: Tensor) -> tuple[Tensor, Tensor]:
    """Returns (grad_x in x.dtype, grad_weight in weight.dtype) ~ npu_rms_norm_backward."""
    grad_x, grad_weight = _rms_backward(grad_y, x, weight, rstd)
    return grad_x.to(x.dtype).contiguous(), grad_weight.to(weight.dtype).contiguous()


@rms_norm_backward.register_fake
def _(grad_y, x, weight, rstd):
    return x.new_empty(x.shape), weight.new_empty(weight.shape)


def _rms_setup_context(ctx, inputs, output):
    x, weight, _ = inputs
    _, rstd = output
    ctx.save_for_backward(x, weight, rstd)
    ctx.mark_non_differentiable(rstd)


def _rms_grad(ctx, grad_y, _grad_rstd):
    x, weight, rstd = ctx.saved_tensors
    grad_x, grad_weight = torch.ops.npu_compile.rms_norm_backward(grad_y, x, weight, rstd)
    return grad_x, grad_weight, None


rms_norm.register_autograd(_rms_grad, setup_context=_rms_setup_context)


# ---- residual add + RMSNorm ----------------------------------------------------------------------------

@torch.library.custom_op("npu_compile::add_rms_norm", mutates_args=())
def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float = 1e-6) -> tuple[Tensor, Tensor, Tensor]:
    """sum = x + residual; returns (rms_norm(sum)·weight, rstd, sum)."""
    total = _add(x, residual)
    y, rstd = _rms_forward(total, weight, eps)
    return y, rstd, total


@add_rms_norm.register_fake
def _(x, residual, weight, eps=1e-6):
    dtype = _check_add(x, residual)
    return (x.new_empty(x.shape, dtype=dtype), x.new_empty(_stat_shape(x, weight), dtype=acc_dtype(dtype)),
            x.new_empty(x.shape, dtype=dtype))


@torch.library.custom_op("npu_compile::add_rms_norm_backward", mutates_args=())
def add_rms_norm_backward(grad_y: Tensor, grad_sum: Optional[Tensor], total: Tensor, weight: Tensor,
                          rstd: Tensor) -> tuple[Tensor, Tensor]:
    """Returns (grad of x and of residual — the same —, grad_weight): the norm's dx plus the gradient that
    reached `sum` from the next block."""
    grad_x, grad_weight = _rms_backward(grad_y, total, weight, rstd)
    if grad_sum is not None:
        grad_x = grad_x + grad_sum.to(grad_x.dtype)
    return grad_x.to(total.dtype).contiguous(), grad_weight.to(weight.dtype).contiguous()


@add_rms_norm_backward.register_fake
def _(grad_y, grad_sum, total, weight, rstd):
    return total.new_empty(total.shape), weight.new_empty(weight.shape)


def _sum_without_grad(ctx, total: Tensor) -> tuple[Tensor, ...]:
    """(sum,) when neither summand needs grad: x + residual then needs none either (it does not depend on the
    weight), as autograd has it for the eager add."""
    return () if ctx.needs_input_grad[0] or ctx.needs_input_grad[1] else (total,)


def _add_rms_setup_context(ctx, inputs, output):
    _, _, weight, _ = inputs
    _, rstd, total = output
    ctx.save_for_backward(total, weight, rstd)
    ctx.mark_non_differentiable(rstd, *_sum_without_grad(ctx, total))


def _add_rms_grad(ctx, grad_y, _grad_rstd, grad_sum):
    total, weight, rstd = ctx.saved_tensors
    grad_total, grad_weight = torch.ops.npu_compile.add_rms_norm_backward(grad_y, grad_sum, total, weight, rstd)
    return grad_total, grad_total, grad_weight, None  # autograd casts a narrower summand's back to its dtype


add_rms_norm.register_autograd(_add_rms_grad, setup_context=_add_rms_setup_context)


# ---- residual add + LayerNorm --------------------------------------------------------------------------

@torch.library.custom_op("npu_compile::add_layer_norm", mutates_args=())
def add_layer_norm(x: Tensor, residual: Tensor, weight: Tensor, bias: Optional[Tensor] = None,
                   eps: float = 1e-5) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """sum = x + residual; returns ((sum − mean)·rstd·weight + bias, mean, rstd, sum), biased variance."""
    total = _add(x, residual)
    dims = _norm_dims(total, weight)
    if total.device.type == "cpu" and (weight.dtype == total.dtype or (
            total.dtype in LOW_PRECISION and weight.dtype == torch.float32)) and (
            bias is None or bias.dtype == weight.dtype):
        # torch's native kernel: fp32 statistics, the normalization in fp32, rounded once (one pass).
        y, mean, rstd = torch.native_layer_norm(total, weight.shape, weight, bias, eps)
        acc = acc_dtype(total.dtype)
        return y.contiguous(), mean.to(acc).contiguous(), rstd.to(acc).contiguous(), total
    xf = total.to(acc_dtype(total.dtype))
    mean = xf.mean(dims, keepdim=True).contiguous()
    centered = xf - mean
    rstd = torch.rsqrt(centered.square().mean(dims, keepdim=True) + eps).contiguous()
    y = centered * rstd * weight.to(xf.dtype)
    if bias is not None:
        y = y + bias.to(xf.dtype)
    return y.to(total.dtype).contiguous(), mean, rstd, total


@add_layer_norm.register_fake
def _(x, residual, weight, bias=None, eps=1e-5):
    dtype = _check_add(x, residual)
    stat = _stat_shape(x, weight)
    acc = acc_dtype(dtype)
    return (x.new_empty(x.shape, dtype=dtype), x.new_empty(stat, dtype=acc), x.new_empty(stat, dtype=acc),
            x.new_empty(x.shape, dtype=dtype))


@torch.library.custom_op("npu_compile::add_layer_norm_backward", mutates_args=())
def add_layer_norm_backward(grad_y: Tensor, grad_sum: Optional[Tensor], total: Tensor, mean: Tensor,
                            rstd: Tensor, weight: Tensor, bias_grad: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """Returns (grad of x and of residual, grad_weight, grad_bias — empty [0] unless bias_grad).

    dx = rstd·(g − mean(g) − x̂·mean(g·x̂)) with g = dy·γ, x̂ = (sum − mean)·rstd; plus grad_sum."""
    dims = _norm_dims(total, weight)
    acc = rstd.dtype
    if total.dtype == acc and grad_y.dtype == acc and weight.dtype == acc and mean.dtype == acc:
        # All in the statistics' dtype: torch's kernel computes the same formula in one pass instead of a dozen
        # elementwise ops. It reads its bias argument only as the template of grad_bias (empty_like), which
        # has the weight's shape and dtype: the weight serves.
        grad_x, grad_weight, grad_bias = torch.ops.aten.native_layer_norm_backward(
            grad_y, total, weight.shape, mean, rstd, weight, weight if bias_grad else None, [True, True, bias_grad])
        if grad_sum is not None:
            grad_x.add_(grad_sum.to(acc))
        return (grad_x.contiguous(), grad_weight.contiguous(),
                grad_bias.contiguous() if bias_grad else no_grad_placeholder(weight))
    x_hat = (total.to(acc) - mean) * rstd
    dy = grad_y.to(acc)
    g = dy * weight.to(acc)
    grad_x = rstd * (g - g.mean(dims, keepdim=True) - x_hat * (g * x_hat).mean(dims, keepdim=True))
    if grad_sum is not None:
        grad_x = grad_x + grad_sum.to(acc)
    grad_weight = sum_to_shape(dy * x_hat, weight.shape).to(weight.dtype).contiguous()
    if bias_grad:
        grad_bias = sum_to_shape(dy, weight.shape).to(weight.dtype).contiguous()
    else:
        grad_bias = no_grad_placeholder(weight)
    return grad_x.to(total.dtype).contiguous(), grad_weight, grad_bias


@add_layer_norm_backward.register_fake
def _(grad_y, grad_sum, total, mean, rstd, weight, bias_grad=False):
    grad_bias = weight.new_empty(weight.shape) if bias_grad else no_grad_placeholder(weight)
    return total.new_empty(total.shape), weight.new_empty(weight.shape), grad_bias


def _add_ln_setup_context(ctx, inputs, output):
    _, _, weight, bias, _ = inputs
    _, mean, rstd, total = output
    ctx.save_for_backward(total, mean, rstd, weight)
    ctx.has_bias = bias is not None
    ctx.mark_non_differentiable(mean, rstd, *_sum_without_grad(ctx, total))


def _add_ln_grad(ctx, grad_y, _grad_mean, _grad_rstd, grad_sum):
    total, mean, rstd, weight = ctx.saved_tensors
    bias_grad = ctx.has_bias and ctx.needs_input_grad[3]
    grad_x, grad_weight, grad_bias = torch.ops.npu_compile.add_layer_norm_backward(
        grad_y, grad_sum, total, mean, rstd, weight, bias_grad)
    return grad_x, grad_x, grad_weight, grad_bias if bias_grad else None, None


add_layer_norm.register_autograd(_add_ln_grad, setup_context=_add_ln_setup_context)
