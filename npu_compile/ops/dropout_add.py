"""Megatron's bias-dropout-add: `npu_compile::bias_dropout_add` and its backward.

    out = residual + dropout(x + bias, p)

torch_npu 2.13 has no such op (docs/npu_ops.md). On the npu targets (npu_compile/lowering/npu/dropout_add.py)
p == 0 lowers to plain aten adds, and p > 0 keeps this op's reference kernel: its keep mask is regenerated from
the seed by our counter RNG (npu_compile/ops/rng.py), which no device dropout reproduces, so forward and
backward must both run it. The op exists so that rules can replace Megatron's `bias_dropout_add` as one node
whose backward saves nothing but a seed.

Decisions:
- Dropout is regenerated from the seed (a 0-dim int64 tensor the caller draws) in the backward instead of
  saving the keep mask. A saved bool mask costs one byte per element, half the activation itself in bf16,
  for every layer until its backward; the seed costs 8 bytes, and regenerating the mask costs one pass of
  random numbers. The mask is made in blocks of DROPOUT_BLOCK elements of x (row-major order), block i from
  `rng.drop_mask(seed, i, ...)`, so the working memory is one block. p == 0 touches no RNG; p == 1 drops all.
- x and residual have the same shape; bias is optional, of x's dtype, and broadcasts to x (Megatron's [h]).
  out's dtype is promote(x, residual): Megatron's fp32 residual stream with a bf16 branch gives fp32.
  x + bias is rounded to x's dtype first, as eager's `x + bias` is; the rest runs in fp32.
- The backward takes bias only for its shape and dtype (a parameter: saving it costs nothing) and x's dtype
  as an argument, so neither x nor the output is saved.
"""

from typing import Optional

import torch
from torch import Tensor

from npu_compile.ops import rng
from npu_compile.ops.common import acc_dtype, broadcasts_to, no_grad_placeholder, sum_to_shape

# Elements of x per RNG block: the keep mask exists 1 Mi elements (1 MiB of bool) at a time.
DROPOUT_BLOCK = 1 << 20


def _check(x: Tensor, bias: Optional[Tensor], residual: Tensor, p: float) -> None:
    if x.shape != residual.shape:
        raise ValueError(f"x {tuple(x.shape)} and residual {tuple(residual.shape)} must have the same shape")
    if bias is not None and (bias.dtype != x.dtype or not broadcasts_to(bias.shape, x.shape)):
        raise ValueError(f"bias {tuple(bias.shape)} {bias.dtype} must broadcast to x {tuple(x.shape)} {x.dtype}")
    rng.check_p(p)


def _blocks(numel: int):
    for index, start in enumerate(range(0, numel, DROPOUT_BLOCK)):
        yield index, start, min(start + DROPOUT_BLOCK, numel)


def _drop_blockwise(flat: Tensor, seed_int: int, p: float) -> None:
    """Zero the dropped elements of a flat acc-dtype tensor and scale the kept by 1/(1 − p), in place."""
    for index, start, stop in _blocks(flat.numel()):
        drop = rng.drop_mask(seed_int, index, (stop - start,), p, flat.device)
        flat[start:stop].masked_fill_(drop, 0.0).mul_(rng.keep_scale(p))


@torch.library.custom_op("npu_compile::bias_dropout_add", mutates_args=())
def bias_dropout_add(x: Tensor, bias: Optional[Tensor], residual: Tensor, p: float,
                     seed: Optional[Tensor] = None) -> Tensor:
    """residual + dropout(x + bias, p); contiguous, dtype promote(x, residual)."""
    _check(x, bias, residual, p)
    seed_int = rng.seed_value(seed, p)
    branch = x if bias is None else x + bias
    # A fresh contiguous acc-dtype copy: reshape(-1) is then a view we can drop into in place.
    dropped = branch.to(acc_dtype(torch.promote_types(x.dtype, residual.dtype)), copy=True,
                        memory_format=torch.contiguous_format)
    if p > 0.0:
        _drop_blockwise(dropped.view(-1), seed_int, p)
    dropped += residual
    return dropped.to(torch.promote_types(x.dtype, residual.dtype))


@bias_dropout_add.register_fake
def _(x, bias, residual, p, seed=None):
    _check(x, bias, residual, p)
    return x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, residual.dtype))


@torch.library.custom_op("npu_compile::bias_dropout_add_backward", mutates_args=())
def bias_dropout_add_backward(grad_out: Tensor, bias: Optional[Tensor], seed: Optional[Tensor], p: float,
                              x_dtype: torch.dtype, bias_grad: bool = False) -> tuple[Tensor, Tensor]:
    """Returns (grad_x = grad_out·keep/(1 − p) in x_dtype, grad_bias = grad_x summed to bias's shape — empty [0]
    unless bias_grad). The residual's gradient is grad_out itself."""
    rng.check_p(p)
    seed_int = rng.seed_value(seed, p)
    grad_x = grad_out.to(acc_dtype(x_dtype), copy=True, memory_format=torch.contiguous_format)
    if p > 0.0:
        _drop_blockwise(grad_x.view(-1), seed_int, p)
    if bias_grad:
        if bias is None:
            raise ValueError("bias_grad=True needs the bias")
        grad_bias = sum_to_shape(grad_x, bias.shape).to(bias.dtype).contiguous()
    else:
        grad_bias = no_grad_placeholder(grad_out)
    return grad_x.to(x_dtype), grad_bias


@bias_dropout_add_backward.register_fake
def _(grad_out, bias, seed, p, x_dtype, bias_grad=False):
    grad_bias = bias.new_empty(bias.shape) if bias_grad else no_grad_placeholder(grad_out)
    return grad_out.new_empty(grad_out.shape, dtype=x_dtype), grad_bias


def _setup_context(ctx, inputs, output):
    x, bias, residual, p, seed = inputs
    ctx.save_for_backward(bias, seed)
    ctx.p = p
    ctx.x_dtype = x.dtype
    ctx.residual_dtype = residual.dtype


def _backward(ctx, grad_out):
    bias, seed = ctx.saved_tensors
    bias_grad = bias is not None and ctx.needs_input_grad[1]
    grad_x, grad_bias = torch.ops.npu_compile.bias_dropout_add_backward(
        grad_out, bias, seed, ctx.p, ctx.x_dtype, bias_grad)
    grad_residual = grad_out.to(ctx.residual_dtype)
    return grad_x, grad_bias if bias_grad else None, grad_residual, None, None


bias_dropout_add.register_autograd(_backward, setup_context=_setup_context)
