"""npu_rotary_mul and its backward on the CPU (half and interleave modes).
"""

from __future__ import annotations

import torch
from torch import Tensor

from npu_compile.lowering.npu_sim.common import ACC, check, check_float, unsupported, like


_MAX_ROTARY_DIM = 896


def _rotate(t: Tensor, mode: str) -> Tensor:
    """half: cat(−x₂, x₁) over the halves of the last dim; interleave: each (x₂ᵢ, x₂ᵢ₊₁) -> (−x₂ᵢ₊₁, x₂ᵢ)."""
    if mode == "half":
        half = t.shape[-1] // 2
        return torch.cat([-t[..., half:], t[..., :half]], dim=-1)
    pairs = t.unflatten(-1, (-1, 2))
    return torch.stack([-pairs[..., 1], pairs[..., 0]], dim=-1).flatten(-2)


def _check_rotary(x: Tensor, r1: Tensor, r2: Tensor, mode: str) -> None:
    unsupported(mode in ("half", "interleave"), f"rotary_mode {mode!r} (A2/A3 take half and interleave)")
    check_float(self=x, r1=r1, r2=r2)
    check(x.dim() == 4, f"npu_rotary_mul takes a 4-D input, got {tuple(x.shape)}")
    d = x.shape[-1]
    check(d % 2 == 0 and d < _MAX_ROTARY_DIM, f"the last dim must be even and below {_MAX_ROTARY_DIM}, got {d}")
    check(r1.shape == r2.shape and r1.dim() == 4 and r1.shape[-1] == d
           and torch.broadcast_shapes(r1.shape, x.shape) == x.shape,
           f"r1 {tuple(r1.shape)} and r2 {tuple(r2.shape)} must be 4-D and broadcast to x {tuple(x.shape)}")


def npu_rotary_mul(x, r1, r2, rotary_mode="half", rotate=None):
    """x·r1 + rot(x)·r2; with `rotate` given, rot(x) = x @ rotate."""
    _check_rotary(x, r1, r2, rotary_mode)
    xf = x.to(ACC)
    rotated = xf @ rotate.to(ACC) if rotate is not None else _rotate(xf, rotary_mode)
    return (xf * r1.to(ACC) + rotated * r2.to(ACC)).to(x.dtype)


def npu_rotary_mul_backward(grad, x, r1, r2, rotary_mode="half"):
    """rot is a signed permutation with rotᵀ = −rot: dx = g·r1 − rot(g·r2); dr1 = Σ g·x, dr2 = Σ g·rot(x),
    reduced to r1's shape. Returns (dx, dr1, dr2) in x's dtype."""
    _check_rotary(x, r1, r2, rotary_mode)
    g, xf = grad.to(ACC), x.to(ACC)
    dx = g * r1.to(ACC) - _rotate(g * r2.to(ACC), rotary_mode)
    dr1 = (g * xf).sum_to_size(r1.shape)
    dr2 = (g * _rotate(xf, rotary_mode)).sum_to_size(r2.shape)
    return dx.to(x.dtype), dr1.to(x.dtype).contiguous(), dr2.to(x.dtype).contiguous()


KERNELS = {  # op name -> (CPU kernel, fake kernel giving torch_npu's output shapes and dtypes)
    "npu_rotary_mul": (npu_rotary_mul, lambda x, r1, r2, rotary_mode="half", rotate=None: like(x)),
    "npu_rotary_mul_backward": (npu_rotary_mul_backward, lambda grad, x, r1, r2, rotary_mode="half": (
        like(x), like(r1, x.dtype), like(r2, x.dtype))),
}
