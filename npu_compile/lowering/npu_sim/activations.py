"""npu_gelu, npu_fast_gelu and npu_swiglu (and their backwards) on the CPU.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from npu_compile.lowering.npu_sim.common import ACC, check, check_float, like


_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_FAST_GELU_K = 1.702


def _check_approximate(approximate: str) -> None:
    check(approximate in ("none", "tanh"), f"approximate must be 'none' or 'tanh', got {approximate!r}")


def npu_gelu(x, *, approximate="none"):
    """'none': x·Φ(x); 'tanh': 0.5x(1 + tanh(√(2/π)(x + 0.044715x³)))."""
    check_float(self=x)
    _check_approximate(approximate)
    xf = x.to(ACC)
    if approximate == "tanh":
        y = 0.5 * xf * (1.0 + torch.tanh(_SQRT_2_OVER_PI * (xf + 0.044715 * xf.pow(3))))
    else:
        y = 0.5 * xf * (1.0 + torch.erf(xf / math.sqrt(2.0)))
    return y.to(x.dtype)


def npu_gelu_backward(grad_output, x, *, approximate="none"):
    _check_approximate(approximate)
    xf = x.to(ACC)
    if approximate == "tanh":
        t = torch.tanh(_SQRT_2_OVER_PI * (xf + 0.044715 * xf.pow(3)))
        slope = 0.5 * (1.0 + t) + 0.5 * xf * (1.0 - t * t) * _SQRT_2_OVER_PI * (1.0 + 3 * 0.044715 * xf * xf)
    else:
        slope = 0.5 * (1.0 + torch.erf(xf / math.sqrt(2.0))) + xf * torch.exp(-0.5 * xf * xf) / math.sqrt(2 * math.pi)
    return (grad_output.to(ACC) * slope).to(x.dtype)


def npu_fast_gelu(x):
    """x·σ(1.702x), in the documented form x·e^{0.851(x−|x|)} / (1 + e^{−1.702|x|}) (no overflow)."""
    check_float(self=x)
    xf = x.to(ACC)
    y = xf * torch.exp(0.5 * _FAST_GELU_K * (xf - xf.abs())) / (1.0 + torch.exp(-_FAST_GELU_K * xf.abs()))
    return y.to(x.dtype)


def npu_fast_gelu_backward(grad, x):
    """g·(σ + 1.702x·σ(1 − σ)) with σ = σ(1.702x)."""
    xf = x.to(ACC)
    sig = torch.sigmoid(_FAST_GELU_K * xf)
    return (grad.to(ACC) * (sig + _FAST_GELU_K * xf * sig * (1.0 - sig))).to(x.dtype)


def _swiglu_halves(x: Tensor, dim: int) -> tuple[Tensor, Tensor]:
    check_float(self=x)
    check(x.is_contiguous(), "npu_swiglu takes a contiguous input")
    check(x.shape[dim] % 2 == 0, f"npu_swiglu needs an even size along dim {dim}, got {tuple(x.shape)}")
    a, b = x.to(ACC).chunk(2, dim=dim)
    return a, b


def npu_swiglu(x, dim=-1):
    """A, B = chunk(x, 2, dim); A·σ(A)·B, half of x along dim."""
    a, b = _swiglu_halves(x, dim)
    return (a * torch.sigmoid(a) * b).to(x.dtype)


def npu_swiglu_backward(grad_output, x, dim=-1):
    a, b = _swiglu_halves(x, dim)
    g = grad_output.to(ACC)
    sig = torch.sigmoid(a)
    grad_a = g * b * sig * (1.0 + a * (1.0 - sig))
    return torch.cat([grad_a, g * a * sig], dim=dim).to(x.dtype)


def _swiglu_fake(x, dim=-1):
    shape = list(x.shape)
    check(shape[dim] % 2 == 0, f"npu_swiglu needs an even size along dim {dim}, got {tuple(x.shape)}")
    shape[dim] //= 2
    return x.new_empty(shape)


KERNELS = {  # op name -> (CPU kernel, fake kernel giving torch_npu's output shapes and dtypes)
    "npu_gelu": (npu_gelu, lambda x, *, approximate="none": like(x)),
    "npu_gelu_backward": (npu_gelu_backward, lambda grad_output, x, *, approximate="none": like(x)),
    "npu_fast_gelu": (npu_fast_gelu, lambda x: like(x)),
    "npu_fast_gelu_backward": (npu_fast_gelu_backward, lambda grad, x: like(x)),
    "npu_swiglu": (npu_swiglu, _swiglu_fake),
    "npu_swiglu_backward": (npu_swiglu_backward, lambda grad_output, x, dim=-1: like(x)),
}
