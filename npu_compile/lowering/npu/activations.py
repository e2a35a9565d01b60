"""Activations on the npu targets: bias_gelu → add + npu_gelu, swiglu → npu_swiglu (and their backwards).

bias_gelu keeps its ``approximate``. npu_fast_gelu (x·σ(1.702x)) is another function: only with the option
``fast_gelu=True``. Semantics of the torch_npu ops: docs/npu_ops.md.
"""

from __future__ import annotations

import torch

from npu_compile.config import Options
from npu_compile.lowering.npu.emit import Call, Emitter, Mapping, Outputs, dtype_problem, fused, npu_op

aten = torch.ops.aten

def check_gelu(c: Call) -> str | None:
    return dtype_problem("npu_gelu", c.val("x").dtype)


def emit_bias_gelu(em: Emitter, c: Call, opts: Options) -> Outputs:
    z = c["x"] if c["bias"] is None else em(aten.add.Tensor, c["x"], c["bias"])
    if opts.fast_gelu:
        return (em(npu_op("npu_fast_gelu"), z),)
    return (em(npu_op("npu_gelu"), z, approximate=c["approximate"]),)


def emit_bias_gelu_backward(em: Emitter, c: Call, opts: Options) -> Outputs:
    z = c["x"] if c["bias"] is None else em(aten.add.Tensor, c["x"], c["bias"])
    if opts.fast_gelu:
        grad_z = em(npu_op("npu_fast_gelu_backward"), c["grad_y"], z)
    else:
        grad_z = em(npu_op("npu_gelu_backward"), c["grad_y"], z, approximate=c["approximate"])
    bias = c.val("bias")
    return grad_z, em.sum_to(grad_z, bias.shape, bias.dtype) if c["bias_grad"] else None


def check_swiglu(c: Call) -> str | None:
    x, dim = c.val("x"), c["dim"]
    if problem := dtype_problem("npu_swiglu", x.dtype):
        return problem
    if not x.is_contiguous():
        return f"npu_swiglu takes a contiguous input; x has strides {tuple(x.stride())}"
    if x.shape[dim] % 2:
        return f"npu_swiglu needs an even size along dim {dim}, got {tuple(x.shape)}"
    return None


def emit_swiglu(em: Emitter, c: Call, opts: Options) -> Outputs:
    return (em(npu_op("npu_swiglu"), c["x"], c["dim"]),)


def emit_swiglu_backward(em: Emitter, c: Call, opts: Options) -> Outputs:
    return (em(npu_op("npu_swiglu_backward"), c["grad_y"], c["x"], c["dim"]),)


ROWS = {
    fused.bias_gelu.default: Mapping(("npu_gelu", "npu_fast_gelu"), check_gelu, emit_bias_gelu),
    fused.bias_gelu_backward.default: Mapping(
        ("npu_gelu_backward", "npu_fast_gelu_backward"), check_gelu, emit_bias_gelu_backward),
    fused.swiglu.default: Mapping(("npu_swiglu",), check_swiglu, emit_swiglu),
    fused.swiglu_backward.default: Mapping(("npu_swiglu_backward",), check_swiglu, emit_swiglu_backward),
}
