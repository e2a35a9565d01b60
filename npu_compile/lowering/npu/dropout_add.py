"""bias_dropout_add on the npu targets: torch_npu has no kernel for it.

With p == 0 it becomes plain aten adds; with p > 0 it keeps its reference kernel (its mask is regenerated from
our seed by our counter RNG, which no device call reproduces). Either way report.json says so.
"""

from __future__ import annotations

import torch

from npu_compile.config import Options
from npu_compile.lowering.npu.emit import Call, Emitter, Mapping, Outputs, fused

aten = torch.ops.aten

def check_bias_dropout_add(c: Call) -> str | None:
    if c["p"] > 0.0:
        return ("torch_npu has no bias-dropout-add kernel, and the op's dropout mask is regenerated from its seed by "
                "our counter RNG, which no device call reproduces: kept on its reference kernel (plain torch)")
    return None


def note_bias_dropout_add(c: Call) -> str | None:
    return "torch_npu has no bias-dropout-add kernel: lowered to plain aten adds (p == 0)"


def emit_bias_dropout_add(em: Emitter, c: Call, opts: Options) -> Outputs:
    x, residual = c.val("x"), c.val("residual")
    out_dtype = torch.promote_types(x.dtype, residual.dtype)
    acc = torch.float64 if out_dtype == torch.float64 else torch.float32
    branch = c["x"] if c["bias"] is None else em(aten.add.Tensor, c["x"], c["bias"])  # rounded to x's dtype
    total = em(aten.add.Tensor, em.cast(branch, acc), c["residual"])
    return (em.cast(total, out_dtype),)


def emit_bias_dropout_add_backward(em: Emitter, c: Call, opts: Options) -> Outputs:
    grad_out, x_dtype = c["grad_out"], c["x_dtype"]
    grad_x = em.cast(grad_out, x_dtype)
    if grad_x is grad_out:  # outputs of the op never alias its inputs
        grad_x = em(aten.clone.default, grad_out)
    bias = c.val("bias")
    return grad_x, em.sum_to(grad_out, bias.shape, bias.dtype) if c["bias_grad"] else None


ROWS = {
    fused.bias_dropout_add.default: Mapping((), check_bias_dropout_add, emit_bias_dropout_add, note_bias_dropout_add),
    fused.bias_dropout_add_backward.default: Mapping(
        (), check_bias_dropout_add, emit_bias_dropout_add_backward, note_bias_dropout_add),
}
