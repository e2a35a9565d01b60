"""Rotary position embedding: `npu_compile::rotary` and its backward, `npu_compile::rotary_backward`.

    out[..., :r] = x[..., :r]·cos + rot(x[..., :r])·sin,   out[..., r:] = x[..., r:],   r = cos.shape[-1]

~ npu_rotary_mul(x, cos, sin, rotary_mode=mode). mode "half": rot(x) = cat(−x₂, x₁) over the two halves of the
rotated channels (Megatron's default `_rotate_half`); "interleave": each pair (x₂ᵢ, x₂ᵢ₊₁) becomes
(−x₂ᵢ₊₁, x₂ᵢ) (Megatron's rotary_interleaved). cos and sin carry the full rotated width (Megatron's
cat(freqs, freqs), or the pair-repeated freqs when interleaved) and broadcast against x[..., :r], e.g.
[s, 1, 1, r] against [s, b, n, d].

Decisions:
- Partial rotary is the op's: when r < x.shape[-1] the remaining channels pass through unchanged, as in
  Megatron's apply_rotary_pos_emb (`cat((rotated, t_pass), -1)`), so a rule replaces the slice, the rotation
  and the cat with one op and one output buffer. The NPU lowering slices and concatenates around
  npu_rotary_mul when r < d, and calls it directly when r == d.
- cos and sin are differentiable, but the backward computes their gradients only when asked
  (`cos_sin_grad`, set by the autograd formula from requires_grad): Megatron's frequencies are constants, and
  their gradient is a full-size product and a reduction.
- The rotation is computed in fp32 and rounded once to x.dtype; cos/sin may be any float dtype.
- Saved: cos and sin, and x only when cos or sin needs a gradient. The op is linear in x, so grad_x needs
  no x, and eager's `x·cos + rot(x)·sin` saves no x either; the backward op takes x = None then (an NPU
  lowering may pass grad_out as npu_rotary_mul_backward's `self`, which only feeds dr1/dr2).
"""

from typing import Optional

import torch
from torch import Tensor

from npu_compile.ops.common import acc_dtype, broadcasts_to, no_grad_placeholder, sum_to_shape

ROTARY_MODES = ("half", "interleave")


def _rotary_dim(x: Tensor, cos: Tensor, sin: Tensor, mode: str) -> int:
    if mode not in ROTARY_MODES:
        raise ValueError(f"mode must be one of {ROTARY_MODES}, got {mode!r}")
    if cos.shape != sin.shape or not cos.is_floating_point() or cos.dtype != sin.dtype:
        raise ValueError(f"cos {tuple(cos.shape)} {cos.dtype} and sin {tuple(sin.shape)} {sin.dtype} must match")
    rot = cos.shape[-1]
    if rot % 2 != 0 or rot > x.shape[-1]:
        raise ValueError(f"the rotated width {rot} must be even and at most x's last dim {x.shape[-1]}")
    rotated_shape = tuple(x.shape[:-1]) + (rot,)
    if not broadcasts_to(cos.shape, rotated_shape):
        raise ValueError(f"cos/sin {tuple(cos.shape)} must broadcast to x[..., :{rot}] {rotated_shape}")
    return rot


def rotate(t: Tensor, mode: str) -> Tensor:
    """rot(t) over the last dim: cat(−t₂, t₁) ("half") or (t₂ᵢ, t₂ᵢ₊₁) -> (−t₂ᵢ₊₁, t₂ᵢ) ("interleave")."""
    if mode == "half":
        first, second = t.chunk(2, dim=-1)
        return torch.cat([-second, first], dim=-1)
    pairs = t.unflatten(-1, (-1, 2))
    return torch.stack([-pairs[..., 1], pairs[..., 0]], dim=-1).flatten(-2)


def _check_backward_x(x: Optional[Tensor], grad_out: Tensor, cos_sin_grad: bool) -> Tensor:
    if x is None:
        if cos_sin_grad:
            raise ValueError("cos_sin_grad=True needs x")
        return grad_out
    return x


@torch.library.custom_op("npu_compile::rotary", mutates_args=())
def rotary(x: Tensor, cos: Tensor, sin: Tensor, mode: str = "half") -> Tensor:
    """x·cos + rot(x)·sin over the first cos.shape[-1] channels; the rest pass through. Contiguous, x.dtype."""
    rot = _rotary_dim(x, cos, sin, mode)
    acc = acc_dtype(x.dtype)
    x_rot = x[..., :rot].to(acc)
    out = x.new_empty(x.shape)
    out[..., :rot] = x_rot * cos.to(acc) + rotate(x_rot, mode) * sin.to(acc)
    out[..., rot:] = x[..., rot:]
    return out


@rotary.register_fake
def _(x, cos, sin, mode="half"):
    _rotary_dim(x, cos, sin, mode)
    return x.new_empty(x.shape)


@torch.library.custom_op("npu_compile::rotary_backward", mutates_args=())
def rotary_backward(grad_out: Tensor, x: Optional[Tensor], cos: Tensor, sin: Tensor, mode: str = "half",
                    cos_sin_grad: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """Returns (grad_x, grad_cos, grad_sin) ~ npu_rotary_mul_backward; grad_cos/grad_sin are reduced to
    cos's shape, or empty [0] tensors unless cos_sin_grad (x may be None then).

    rot is a signed permutation with rotᵀ = −rot, so grad_x[..., :r] = g·cos − rot(g·sin)."""
    rot = _rotary_dim(_check_backward_x(x, grad_out, cos_sin_grad), cos, sin, mode)
    acc = acc_dtype(grad_out.dtype)
    g = grad_out[..., :rot].to(acc)
    grad_x = grad_out.new_empty(grad_out.shape)
    grad_x[..., :rot] = g * cos.to(acc) - rotate(g * sin.to(acc), mode)
    grad_x[..., rot:] = grad_out[..., rot:]
    if cos_sin_grad:
        x_rot = x[..., :rot].to(acc)
        grad_cos = sum_to_shape(g * x_rot, cos.shape).to(cos.dtype).contiguous()
        grad_sin = sum_to_shape(g * rotate(x_rot, mode), sin.shape).to(sin.dtype).contiguous()
    else:
        grad_cos = grad_sin = None
    if grad_cos is None:
        return grad_x, no_grad_placeholder(cos), no_grad_placeholder(sin)
    return grad_x, grad_cos, grad_sin


@rotary_backward.register_fake
def _(grad_out, x, cos, sin, mode="half", cos_sin_grad=False):
    _rotary_dim(_check_backward_x(x, grad_out, cos_sin_grad), cos, sin, mode)
    grad_x = grad_out.new_empty(grad_out.shape)
    if cos_sin_grad:
        return grad_x, cos.new_empty(cos.shape), sin.new_empty(sin.shape)
    return grad_x, no_grad_placeholder(cos), no_grad_placeholder(sin)


def _rotary_setup_context(ctx, inputs, output):
    x, cos, sin, mode = inputs
    ctx.cos_sin_grad = ctx.needs_input_grad[1] or ctx.needs_input_grad[2]
    ctx.save_for_backward(x if ctx.cos_sin_grad else None, cos, sin)
    ctx.mode = mode


def _rotary_grad(ctx, grad_out):
    x, cos, sin = ctx.saved_tensors
    grad_x, grad_cos, grad_sin = torch.ops.npu_compile.rotary_backward(
        grad_out, x, cos, sin, ctx.mode, ctx.cos_sin_grad)
    if not ctx.cos_sin_grad:
        return grad_x, None, None, None
    return grad_x, grad_cos, grad_sin, None


rotary.register_autograd(_rotary_grad, setup_context=_rotary_setup_context)
