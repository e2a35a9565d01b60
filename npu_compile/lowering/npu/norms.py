"""Norms on the npu targets: rms_norm, add_rms_norm, add_layer_norm (and their backwards) → torch_npu's norm kernels.

Semantics of the torch_npu ops: docs/npu_ops.md. npu_add_rms_norm has no backward in torch_npu: ours is
npu_rms_norm_backward plus the gradient reaching the sum. npu_add_layer_norm_backward takes x1 and x2 but our op
saves only their sum: x2 is a broadcast zero (no memory). dgamma comes back in fp32 and is cast to the weight's
dtype.
"""

from __future__ import annotations

import torch

from npu_compile.config import Options
from npu_compile.lowering.npu.emit import Call, Emitter, Mapping, Outputs, dtype_problem, fused, npu_op

aten = torch.ops.aten

def _norm_check(x: torch.Tensor, *params: torch.Tensor | None, upcast_x: bool = False) -> str | None:
    """The npu norm kernels take x, gamma (and beta) of one dtype (torch_npu/_op_plugin_docs.py, npu_rms_norm:
    "gamma ... 数据类型需要和self保持一致"). A weight of another float dtype is cast to the wider of the two, which
    is exact: our ops compute in fp32 whatever their dtypes. With ``upcast_x``, x may be the narrower one (it is
    then cast up, and y back down, as our op rounds y to x's dtype)."""
    if problem := dtype_problem("the npu norm kernels", x.dtype):
        return problem
    for p in params:
        if p is None or p.dtype == x.dtype:
            continue
        if problem := dtype_problem("the npu norm kernels", p.dtype):
            return problem
        if not upcast_x and torch.promote_types(x.dtype, p.dtype) != x.dtype:
            return (f"weight/bias dtype {p.dtype} is wider than x's {x.dtype}; the npu add-norm kernels take one "
                    f"dtype, and x + residual must round to {x.dtype}")
    return None


def check_rms_norm(c: Call) -> str | None:
    return _norm_check(c.val("x"), c.val("weight"), upcast_x=True)


def check_add_norm(c: Call) -> str | None:
    x = c.val("x") if "x" in c.args else c.val("total")  # the backward ops take the saved sum
    if "residual" in c.args and c.val("residual").dtype != x.dtype:  # an fp32 residual stream
        return (f"x {x.dtype} and residual {c.val('residual').dtype} differ; the npu add-norm kernels take one "
                "dtype for both summands")
    bias = c.val("bias") if "bias" in c.args else None
    return _norm_check(x, c.val("weight"), bias)


def _kernel_dtype(c: Call, x: str) -> torch.dtype:
    return torch.promote_types(c.val(x).dtype, c.val("weight").dtype)


def emit_rms_norm(em: Emitter, c: Call, opts: Options) -> Outputs:
    dtype = _kernel_dtype(c, "x")
    y, rstd = em.outputs(em(npu_op("npu_rms_norm"), em.cast(c["x"], dtype), em.cast(c["weight"], dtype),
                            c["eps"]), 2)
    return em.cast(y, c.val("x").dtype), rstd


def emit_rms_norm_backward(em: Emitter, c: Call, opts: Options) -> Outputs:
    dtype = _kernel_dtype(c, "x")
    grad_x, grad_weight = em.outputs(
        em(npu_op("npu_rms_norm_backward"), em.cast(c["grad_y"], dtype), em.cast(c["x"], dtype),
           em.cast(c["weight"], dtype), c["rstd"]), 2)
    # the device gives dgamma in fp32
    return em.cast(grad_x, c.val("x").dtype), em.cast(grad_weight, c.val("weight").dtype)


def emit_add_rms_norm(em: Emitter, c: Call, opts: Options) -> Outputs:
    weight = em.cast(c["weight"], c.val("x").dtype)  # a narrower weight, cast up (check_add_norm)
    return em.outputs(em(npu_op("npu_add_rms_norm"), c["x"], c["residual"], weight, c["eps"]), 3)


def emit_add_rms_norm_backward(em: Emitter, c: Call, opts: Options) -> Outputs:
    weight = em.cast(c["weight"], c.val("total").dtype)
    grad_x, grad_weight = em.outputs(
        em(npu_op("npu_rms_norm_backward"), c["grad_y"], c["total"], weight, c["rstd"]), 2)
    if c["grad_sum"] is not None:  # the gradient that reached the sum from the next block
        grad_x = em(aten.add.Tensor, grad_x, c["grad_sum"])
    return grad_x, em.cast(grad_weight, c.val("weight").dtype)


def _layer_norm_in_aten(em: Emitter, c: Call) -> Outputs:
    """graph_mode ge: torchair has no GE converter for npu_add_layer_norm (nor its backward), and CANN's
    registry has no NpuAddLayerNorm for torchair to generate one from; the sum and aten.native_layer_norm
    convert (LayerNormV4, ge_converter/aten/native_layer_norm.py). The sum is rounded to x's dtype as our op
    does, the norm runs in fp32 (our op's statistics are fp32) and y is cast back."""
    total = em(aten.add.Tensor, c["x"], c["residual"])
    f32 = torch.float32
    bias = em.cast(c["bias"], f32) if c["bias"] is not None else None
    y, mean, rstd = em.outputs(em(aten.native_layer_norm.default, em.cast(total, f32),
                                  list(c.val("weight").shape), em.cast(c["weight"], f32), bias, c["eps"]), 3)
    return [em.cast(y, c.val("x").dtype), mean, rstd, total]


def _layer_norm_backward_in_aten(em: Emitter, c: Call) -> Outputs:
    """The backward of :func:`_layer_norm_in_aten`: aten.native_layer_norm_backward (LayerNormGradV3)."""
    f32, weight = torch.float32, c.val("weight")
    bias = em(aten.zeros_like.default, em.cast(c["weight"], f32))  # only its presence matters for dbeta
    grad_x, grad_weight, grad_bias = em.outputs(em(
        aten.native_layer_norm_backward.default, em.cast(c["grad_y"], f32), em.cast(c["total"], f32),
        list(weight.shape), c["mean"], c["rstd"], em.cast(c["weight"], f32), bias, [True, True, c["bias_grad"]]), 3)
    if c["grad_sum"] is not None:
        grad_x = em(aten.add.Tensor, grad_x, em.cast(c["grad_sum"], f32))
    return (em.cast(grad_x, c.val("total").dtype), em.cast(grad_weight, weight.dtype),
            em.cast(grad_bias, weight.dtype) if c["bias_grad"] else None)


def emit_add_layer_norm(em: Emitter, c: Call, opts: Options) -> Outputs:
    if opts.graph_mode == "ge":
        return _layer_norm_in_aten(em, c)
    beta = c["bias"] if c["bias"] is not None else em(aten.zeros_like.default, c["weight"])
    x = c.val("x")
    if x.dtype in (torch.bfloat16, torch.float16):
        # The kernel normalizes its fp32-internal sum but returns the sum rounded, and the backward sees only
        # that rounded sum: its x̂ would disagree with the saved mean / rstd by the rounding, which the mean's
        # subtraction amplifies (a bf16 GPT's gradients came out 2-3x eager's error against fp32). So in half
        # precision the sum is rounded first, as eager and our op do, and the kernel normalizes that.
        total = em(aten.add.Tensor, c["x"], c["residual"])
        zero = em(aten.expand.default, em(aten.new_zeros.default, total, []), list(x.shape))
        y, mean, rstd, _ = em.outputs(
            em(npu_op("npu_add_layer_norm"), total, zero, c["weight"], beta, c["eps"], True), 4)
        return [y, mean, rstd, total]
    call = em(npu_op("npu_add_layer_norm"), c["x"], c["residual"], c["weight"], beta, c["eps"], True)
    return em.outputs(call, 4)  # (y, mean, rstd, x1 + x2): our op's order


def emit_add_layer_norm_backward(em: Emitter, c: Call, opts: Options) -> Outputs:
    if opts.graph_mode == "ge":
        return _layer_norm_backward_in_aten(em, c)
    total = c.val("total")
    zero = em(aten.expand.default, em(aten.new_zeros.default, c["total"], []), list(total.shape))
    call = em(npu_op("npu_add_layer_norm_backward"), c["grad_y"], c["total"], zero, c["rstd"], c["mean"],
              c["weight"], c["grad_sum"])
    grad_x, _, grad_weight, grad_bias = em.outputs(call, 4)
    dtype = c.val("weight").dtype
    return grad_x, em.cast(grad_weight, dtype), em.cast(grad_bias, dtype) if c["bias_grad"] else None


ROWS = {
    fused.rms_norm.default: Mapping(("npu_rms_norm",), check_rms_norm, emit_rms_norm),
    fused.rms_norm_backward.default: Mapping(("npu_rms_norm_backward",), check_rms_norm, emit_rms_norm_backward),
    fused.add_rms_norm.default: Mapping(("npu_add_rms_norm",), check_add_norm, emit_add_rms_norm),
    fused.add_rms_norm_backward.default: Mapping(
        ("npu_rms_norm_backward",), check_add_norm, emit_add_rms_norm_backward),
    fused.add_layer_norm.default: Mapping(("npu_add_layer_norm",), check_add_norm, emit_add_layer_norm),
    fused.add_layer_norm_backward.default: Mapping(
        ("npu_add_layer_norm_backward",), check_add_norm, emit_add_layer_norm_backward),
}
