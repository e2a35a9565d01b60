"""Rotary embeddings on the npu targets: rotary / rotary_backward → npu_rotary_mul / _backward.

Partial rotary (cos/sin narrower than the head) rotates the first channels and passes the rest through; cos/sin
must be in one of the kernel's broadcast forms. Semantics of the torch_npu ops: docs/npu_ops.md.
"""

from __future__ import annotations

import torch
from torch.fx import Node

from npu_compile.config import Options
from npu_compile.lowering.npu.emit import Call, Emitter, Mapping, Outputs, dtype_problem, fused, npu_op

aten = torch.ops.aten

# The positions of cos/sin's non-broadcast leading dims that npu_rotary_mul takes, with the possible S positions:
# half mode: 11SD/B1SD/BNSD (x BNSD), 1S1D/BS1D/BSND (x BSND), S11D/SB1D/SBND (x SBND); interleave: 11SD/1S1D/S11D.
_ROTARY_FORMS = {
    "half": {(2,): (2,), (0, 2): (2,), (1,): (1,), (0, 1): (0, 1), (0,): (0,), (0, 1, 2): (0, 1, 2)},
    "interleave": {(2,): (2,), (1,): (1,), (0,): (0,)},
}


def check_rotary(c: Call) -> str | None:
    x = c.val("grad_out") if "grad_out" in c.args else c.val("x")
    cos, mode = c.val("cos"), c["mode"]
    if problem := dtype_problem("npu_rotary_mul", x.dtype):
        return problem
    if cos.dtype != x.dtype:
        return f"npu_rotary_mul takes cos/sin in x's dtype {x.dtype}, got {cos.dtype}"
    if x.dim() != 4 or cos.dim() > 4:
        return f"npu_rotary_mul takes 4-D x and cos/sin; got x {tuple(x.shape)}, cos {tuple(cos.shape)}"
    r = cos.shape[-1]
    if r % 2 or r >= 896:
        return f"npu_rotary_mul needs an even rotated dim below 896, got {r}"
    cos4 = (1,) * (4 - cos.dim()) + tuple(cos.shape)
    leading = tuple(i for i in range(3) if cos4[i] != 1)
    seq_positions = _ROTARY_FORMS[mode].get(leading)
    if seq_positions is None:
        return (f"cos/sin {cos4} is not one of npu_rotary_mul's broadcast forms for {mode} mode against "
                f"x {tuple(x.shape)}")
    # B and N are the leading dims of x other than S; where the form leaves S open, take the worst case.
    batch_heads = [[x.shape[i] for i in range(3) if i != s] for s in seq_positions]
    bn = max(b * n for b, n in batch_heads)
    if mode == "interleave" and bn >= 1000:
        return f"npu_rotary_mul in interleave mode needs B·N < 1000, got {bn}"
    if mode == "half" and max(max(pair) for pair in batch_heads) >= 1000:
        return f"npu_rotary_mul needs B, N < 1000, got x {tuple(x.shape)}"
    if c.args.get("cos_sin_grad") and bn > 1024:
        return f"npu_rotary_mul_backward computes cos/sin gradients only for B·N <= 1024, got {bn}"
    return None


def _rotary_parts(em: Emitter, c: Call, t: Node) -> tuple[Node, Node | None, Node, Node]:
    """(the rotated channels of t, the passed-through rest or None, cos, sin as 4-D)."""
    r, d = c.val("cos").shape[-1], t.meta["val"].shape[-1]
    rotated, rest = t, None
    if r < d:  # partial rotary: npu_rotary_mul sees the first r channels only
        rotated, rest = em(aten.slice.Tensor, t, -1, 0, r), em(aten.slice.Tensor, t, -1, r, d)
    cos_sin = []
    for n in ("cos", "sin"):
        shape = tuple(c.val(n).shape)
        cos_sin.append(c[n] if len(shape) == 4 else em(aten.view.default, c[n], [1] * (4 - len(shape)) + list(shape)))
    return rotated, rest, cos_sin[0], cos_sin[1]


def emit_rotary(em: Emitter, c: Call, opts: Options) -> Outputs:
    rotated, rest, cos, sin = _rotary_parts(em, c, c["x"])
    out = em(npu_op("npu_rotary_mul"), rotated, cos, sin, rotary_mode=c["mode"])
    return (out if rest is None else em(aten.cat.default, [out, rest], -1),)


def emit_rotary_backward(em: Emitter, c: Call, opts: Options) -> Outputs:
    grad, rest, cos, sin = _rotary_parts(em, c, c["grad_out"])
    # Without x (cos/sin need no gradient) the grad itself stands in: `self` feeds only dr1/dr2.
    x = grad if c["x"] is None else _rotary_parts(em, c, c["x"])[0]
    grad_x, grad_cos, grad_sin = em.outputs(
        em(npu_op("npu_rotary_mul_backward"), grad, x, cos, sin, rotary_mode=c["mode"]), 3)
    if rest is not None:
        grad_x = em(aten.cat.default, [grad_x, rest], -1)
    if not c["cos_sin_grad"]:
        return grad_x, None, None
    return (grad_x, *(em(aten.view.default, g, list(c.val(n).shape)) if c.val(n).dim() != 4 else g
                      for g, n in ((grad_cos, "cos"), (grad_sin, "sin"))))


ROWS = {
    fused.rotary.default: Mapping(("npu_rotary_mul",), check_rotary, emit_rotary),
    fused.rotary_backward.default: Mapping(("npu_rotary_mul_backward",), check_rotary, emit_rotary_backward),
}
