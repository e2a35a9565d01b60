"""The npu norm kernels on the CPU: npu_rms_norm, npu_add_rms_norm, npu_add_layer_norm and their backwards.

- npu_add_rms_norm / npu_add_layer_norm normalize the fp32 sum x1 + x2 (the x output is that sum rounded to
  x1's dtype); in fp32 both readings agree.
- npu_add_layer_norm_backward returns dgamma/dbeta in fp32 (like npu_rms_norm_backward's documented dgamma).
"""

from __future__ import annotations

import torch
from torch import Tensor

from npu_compile.lowering.npu_sim.common import ACC, check, check_float, like


def _norm_dims(x: Tensor, gamma: Tensor) -> tuple[int, ...]:
    g = gamma.dim()
    check(0 < g <= x.dim() and tuple(x.shape[x.dim() - g:]) == tuple(gamma.shape),
           f"gamma {tuple(gamma.shape)} must match the trailing dims of x {tuple(x.shape)}")
    return tuple(range(x.dim() - g, x.dim()))


def _stat_shape(x: Tensor, gamma: Tensor) -> tuple[int, ...]:
    return (*x.shape[: x.dim() - gamma.dim()], *([1] * gamma.dim()))


def _leading_sum(t: Tensor, gamma: Tensor) -> Tensor:
    """Σ over the dims in front of gamma's: a parameter's gradient, fp32."""
    return t.sum(tuple(range(t.dim() - gamma.dim()))) if t.dim() > gamma.dim() else t


def npu_rms_norm(x, gamma, epsilon=1e-06):
    """rstd = 1/√(mean(x²) + eps) over gamma's dims; y = x·rstd·γ. Returns (y: x.dtype, rstd: fp32)."""
    check_float(self=x, gamma=gamma)
    dims = _norm_dims(x, gamma)
    xf = x.to(ACC)
    rstd = torch.rsqrt(xf.square().mean(dims, keepdim=True) + epsilon)
    return (xf * rstd * gamma.to(ACC)).to(x.dtype), rstd


def npu_rms_norm_backward(dy, x, gamma, rstd):
    """dx = rstd·dy·γ − x·rstd³·mean(dy·γ·x); dγ = Σ dy·x·rstd. Returns (dx: x.dtype, dγ: fp32)."""
    dims = _norm_dims(x, gamma)
    xf, dyf, gf = x.to(ACC), dy.to(ACC), gamma.to(ACC)
    dx = rstd * dyf * gf - xf * rstd.pow(3) * (dyf * gf * xf).mean(dims, keepdim=True)
    return dx.to(x.dtype), _leading_sum(dyf * xf * rstd, gamma)


def npu_add_rms_norm(x1, x2, gamma, epsilon=1e-06):
    """x = x1 + x2; returns (rms_norm(x)·γ, rstd, x in x1.dtype)."""
    check(x1.shape == x2.shape, f"x1 {tuple(x1.shape)} and x2 {tuple(x2.shape)} must have one shape")
    check_float(x1=x1, x2=x2, gamma=gamma)
    total = x1.to(ACC) + x2.to(ACC)
    y, rstd = npu_rms_norm(total, gamma.to(ACC), epsilon)
    return y.to(x1.dtype), rstd, total.to(x1.dtype)


def _layer_norm_stats(x1, x2, gamma):
    check(x1.shape == x2.shape, f"x1 {tuple(x1.shape)} and x2 {tuple(x2.shape)} must have one shape")
    dims = _norm_dims(x1, gamma)
    total = x1.to(ACC) + x2.to(ACC)
    mean = total.mean(dims, keepdim=True)
    return dims, total, mean


def npu_add_layer_norm(x1, x2, gamma, beta, epsilon=1e-05, additional_output=False):
    """x = x1 + x2; y = (x − mean)·rstd·γ + β with the biased variance. Returns (y, mean, rstd, x)."""
    check_float(x1=x1, x2=x2, gamma=gamma, beta=beta)
    dims, total, mean = _layer_norm_stats(x1, x2, gamma)
    rstd = torch.rsqrt((total - mean).square().mean(dims, keepdim=True) + epsilon)
    y = (total - mean) * rstd * gamma.to(ACC) + beta.to(ACC)
    return y.to(x1.dtype), mean, rstd, total.to(x1.dtype)


def npu_add_layer_norm_backward(dy_opt, x1, x2, rstd, mean, gamma, dsum_opt):
    """dx = rstd·(g − mean(g) − x̂·mean(g·x̂)) + dsum with g = dy·γ, x̂ = (x − mean)·rstd; returns
    (dx, dx, dγ, dβ): the same gradient for both summands."""
    dims, total, _ = _layer_norm_stats(x1, x2, gamma)
    x_hat = (total - mean) * rstd
    dyf = torch.zeros_like(total) if dy_opt is None else dy_opt.to(ACC)
    g = dyf * gamma.to(ACC)
    dx = rstd * (g - g.mean(dims, keepdim=True) - x_hat * (g * x_hat).mean(dims, keepdim=True))
    if dsum_opt is not None:
        dx = dx + dsum_opt.to(ACC)
    dx = dx.to(x1.dtype)
    return dx, dx.clone(), _leading_sum(dyf * x_hat, gamma), _leading_sum(dyf, gamma)



def _rms_norm_fake(x, gamma, epsilon=1e-06):
    return like(x), x.new_empty(_stat_shape(x, gamma), dtype=torch.float32)


def _add_layer_norm_fake(x1, x2, gamma, beta, epsilon=1e-05, additional_output=False):
    stat = x1.new_empty(_stat_shape(x1, gamma), dtype=torch.float32)
    return like(x1), stat, torch.empty_like(stat), like(x1)


KERNELS = {  # op name -> (CPU kernel, fake kernel giving torch_npu's output shapes and dtypes)
    "npu_rms_norm": (npu_rms_norm, _rms_norm_fake),
    "npu_rms_norm_backward": (npu_rms_norm_backward, lambda dy, x, gamma, rstd: (like(x), like(gamma, torch.float32))),
    "npu_add_rms_norm": (npu_add_rms_norm, lambda x1, x2, gamma, epsilon=1e-06: (*_rms_norm_fake(x1, gamma), like(x1))),
    "npu_add_layer_norm": (npu_add_layer_norm, _add_layer_norm_fake),
    "npu_add_layer_norm_backward": (npu_add_layer_norm_backward, lambda dy, x1, x2, rstd, mean, gamma, dsum: (
        like(x1), like(x1), like(gamma, torch.float32), like(gamma, torch.float32))),
}
