"""Fused MLP activations: `bias_gelu` and `swiglu`, with their backward ops, in namespace npu_compile.

    bias_gelu(x, bias, approximate) = gelu(x + bias)       ~ npu_gelu(x + bias, approximate=...)
    swiglu(x, dim)                  = silu(a) · b,  a, b = chunk(x, 2, dim)   ~ npu_swiglu(x, dim)

approximate is "none" (x·Φ(x), erf) or "tanh" (0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³))), the form of
Megatron's bias_gelu_impl, whose 0.79788456 is √(2/π) to 8 digits). The bias is optional and added in the
input dtype first, as eager's `x + bias` rounds it; the activation is then computed in fp32 and rounded once.
The backward ops save x (and bias, a parameter) and recompute x + bias, as Megatron's fused bias-GeLU does;
outputs are contiguous, in x's dtype.
"""

from typing import Optional

import torch
from torch import Tensor

from npu_compile.ops.common import acc_dtype, broadcasts_to, no_grad_placeholder, sum_to_shape

GELU_APPROXIMATIONS = ("none", "tanh")


def _check_gelu(x: Tensor, bias: Optional[Tensor], approximate: str) -> None:
    if approximate not in GELU_APPROXIMATIONS:
        raise ValueError(f"approximate must be one of {GELU_APPROXIMATIONS}, got {approximate!r}")
    if bias is not None and (bias.dtype != x.dtype or not broadcasts_to(bias.shape, x.shape)):
        raise ValueError(f"bias {tuple(bias.shape)} {bias.dtype} must broadcast to x {tuple(x.shape)} {x.dtype}")


def _biased(x: Tensor, bias: Optional[Tensor]) -> Tensor:
    z = x if bias is None else x + bias
    return z.to(acc_dtype(x.dtype))


def _gelu(z: Tensor, approximate: str) -> Tensor:
    """gelu(z) by torch's native kernel (one pass; the kernel's only scratch is z itself when the bias made it).
    The tests judge it against F.gelu in float64."""
    return torch.nn.functional.gelu(z, approximate=approximate)


def _gelu_grad_times(grad_y: Tensor, z: Tensor, approximate: str) -> Tensor:
    """grad_y · d gelu/dz in z's dtype, by torch's native gelu_backward kernel (one pass, z never written)."""
    return torch.ops.aten.gelu_backward(grad_y.to(z.dtype), z, approximate=approximate)


@torch.library.custom_op("npu_compile::bias_gelu", mutates_args=())
def bias_gelu(x: Tensor, bias: Optional[Tensor] = None, approximate: str = "none") -> Tensor:
    """gelu(x + bias) in x.dtype."""
    _check_gelu(x, bias, approximate)
    return _gelu(_biased(x, bias), approximate).to(x.dtype).contiguous()


@bias_gelu.register_fake
def _(x, bias=None, approximate="none"):
    _check_gelu(x, bias, approximate)
    return x.new_empty(x.shape)


@torch.library.custom_op("npu_compile::bias_gelu_backward", mutates_args=())
def bias_gelu_backward(grad_y: Tensor, x: Tensor, bias: Optional[Tensor] = None, approximate: str = "none",
                       bias_grad: bool = False) -> tuple[Tensor, Tensor]:
    """Returns (grad_x, grad_bias — the sum of grad_x over the broadcast dims; empty [0] unless bias_grad)."""
    _check_gelu(x, bias, approximate)
    grad_z = _gelu_grad_times(grad_y, _biased(x, bias), approximate)
    grad_x = grad_z.to(x.dtype).contiguous()
    if bias_grad:
        if bias is None:
            raise ValueError("bias_grad=True needs a bias")
        grad_bias = sum_to_shape(grad_z, bias.shape).to(bias.dtype).contiguous()
    else:
        grad_bias = no_grad_placeholder(x)
    return grad_x, grad_bias


@bias_gelu_backward.register_fake
def _(grad_y, x, bias=None, approximate="none", bias_grad=False):
    _check_gelu(x, bias, approximate)
    return x.new_empty(x.shape), bias.new_empty(bias.shape) if bias_grad else no_grad_placeholder(x)


def _bias_gelu_setup_context(ctx, inputs, output):
    x, bias, approximate = inputs
    ctx.save_for_backward(x, bias)
    ctx.approximate = approximate


def _bias_gelu_grad(ctx, grad_y):
    x, bias = ctx.saved_tensors
    bias_grad = bias is not None and ctx.needs_input_grad[1]
    grad_x, grad_bias = torch.ops.npu_compile.bias_gelu_backward(grad_y, x, bias, ctx.approximate, bias_grad)
    return grad_x, grad_bias if bias_grad else None, None


bias_gelu.register_autograd(_bias_gelu_grad, setup_context=_bias_gelu_setup_context)


# ---- SwiGLU --------------------------------------------------------------------------------------------

def _halves(x: Tensor, dim: int) -> tuple[Tensor, Tensor]:
    if x.shape[dim] % 2 != 0:
        raise ValueError(f"swiglu needs an even size along dim {dim}, got {tuple(x.shape)}")
    a, b = torch.chunk(x, 2, dim=dim)
    return a, b


@torch.library.custom_op("npu_compile::swiglu", mutates_args=())
def swiglu(x: Tensor, dim: int = -1) -> Tensor:
    """silu(a)·b for a, b = chunk(x, 2, dim): half of x's size along dim, in x.dtype."""
    a, b = (h.to(acc_dtype(x.dtype)) for h in _halves(x, dim))
    return torch.sigmoid(a).mul_(a).mul_(b).to(x.dtype).contiguous()


@swiglu.register_fake
def _(x, dim=-1):
    a, _ = _halves(x, dim)
    return x.new_empty(a.shape)


@torch.library.custom_op("npu_compile::swiglu_backward", mutates_args=())
def swiglu_backward(grad_y: Tensor, x: Tensor, dim: int = -1) -> Tensor:
    """grad_x shaped like x: [g·b·σ(a)·(1 + a·(1 − σ(a))), g·a·σ(a)] along dim ~ npu_swiglu_backward."""
    a, b = (h.to(acc_dtype(x.dtype)) for h in _halves(x, dim))
    grad_x = torch.empty(x.shape, dtype=a.dtype, device=x.device)
    grad_a, grad_b = torch.chunk(grad_x, 2, dim=dim)
    torch.sigmoid(a, out=grad_b)  # σ(a), then each half in place
    torch.mul(grad_b, -1.0, out=grad_a).add_(1.0).mul_(a).add_(1.0).mul_(grad_b).mul_(b).mul_(grad_y)
    grad_b.mul_(a).mul_(grad_y)  # g·a·σ(a)
    return grad_x.to(x.dtype).contiguous()


@swiglu_backward.register_fake
def _(grad_y, x, dim=-1):
    _halves(x, dim)
    return x.new_empty(x.shape)


def _swiglu_setup_context(ctx, inputs, output):
    x, dim = inputs
    ctx.save_for_backward(x)
    ctx.dim = dim


def _swiglu_grad(ctx, grad_y):
    (x,) = ctx.saved_tensors
    return torch.ops.npu_compile.swiglu_backward(grad_y, x, ctx.dim), None


swiglu.register_autograd(_swiglu_grad, setup_context=_swiglu_setup_context)
