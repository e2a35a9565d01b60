"""Fusion rules, rotary family: rotary position embedding → ``npu_compile::rotary`` (lowers to npu_rotary_mul).

One rule, ``rotary``, over the forms RoPE takes in training graphs:

- Megatron's ``_apply_rotary_pos_emb_bshd`` (megatron-core 0.16.1): ``t, t_pass = t[..., :r], t[..., r:]``
  with r = freqs' last dim, ``t·cos + rot(t)·sin``, then ``cat((t, t_pass), -1)``. When r is t's full width
  the first slice is a no-op and t_pass is empty (its cat stays in the graph); when r is smaller (partial
  rotary) the fused op passes the other channels through, so the slices and the cat go with the match.
- rot is "half" (``chunk`` + ``cat(−t₂, t₁)``, Megatron's default) or "interleave" (rotary_interleaved=True:
  ``stack(−t[..., 1::2], t[..., ::2], -1)`` viewed back to t's shape): npu_rotary_mul's two modes.
- The Hugging Face form ``q·cos + rotate_half(q)·sin`` on the whole of q, its halves by ``chunk`` or, as
  HF's ``rotate_half`` writes them, by slicing (``q[..., :d//2]``, ``q[..., d//2:]``). HF's q is a transposed
  view ([b, s, n, d] memory as [b, n, s, d]); the product keeps that layout, so the replacement does too.

cos and sin are matched as they arrive: Megatron computes ``cos(freqs)·mscale`` in the graph, and those ops stay
outside the match. They carry no gradient in Megatron (its frequencies are buffers), but the patterns are
traced both ways, so a model whose cos/sin need gradients is fused too. A neg that starts a rotation (the first
operand of its cat or stack) left after the pass is reported as an unfused site.
"""

from __future__ import annotations

import torch

import npu_compile.ops  # noqa: F401  (registers torch.ops.npu_compile)
from npu_compile.passes.engine import Rule, in_layout_of, layout_check, register_rule

aten = torch.ops.aten
fused = torch.ops.npu_compile


def rotate_half(t):
    t1, t2 = torch.chunk(t, 2, dim=-1)
    return torch.cat((-t2, t1), dim=-1)


def rotate_half_sliced(t):
    """Hugging Face's ``rotate_half``: the halves by slicing, ``t[..., :d//2]`` first."""
    half = t.shape[-1] // 2
    t1, t2 = t[..., :half], t[..., half:]
    return torch.cat((-t2, t1), dim=-1)


def rotate_half_sliced_in_place(t):
    """The halves sliced where the cat takes them, ``t[..., d//2:]`` first: autograd then adds the halves'
    gradients in the other order, so this is a joint graph of its own."""
    half = t.shape[-1] // 2
    return torch.cat((-t[..., half:], t[..., :half]), dim=-1)


def rotate_interleaved(t):
    t1, t2 = t[..., ::2], t[..., 1::2]
    pairs = torch.stack((-t2, t1), dim=-1)
    return pairs.view(*pairs.shape[:-2], -1)  # the size list ends in -1 in Megatron's graph too


def megatron_rope(rotate):
    def apply_rotary_pos_emb_bshd(t, cos, sin):
        r = cos.shape[-1]
        t, t_pass = t[..., :r], t[..., r:]
        t = t * cos + rotate(t) * sin
        return torch.cat((t, t_pass), dim=-1)

    return apply_rotary_pos_emb_bshd


def hf_rope(t, cos, sin):
    return t * cos + rotate_half(t) * sin


def hf_rope_sliced(t, cos, sin):
    return t * cos + rotate_half_sliced(t) * sin


def hf_rope_sliced_in_place(t, cos, sin):
    return t * cos + rotate_half_sliced_in_place(t) * sin


def fused_megatron_rope(mode):
    def rotary(t, cos, sin):
        return fused.rotary(t, cos, sin, mode)  # contiguous, as Megatron's cat is

    return rotary


def fused_hf_rope(t, cos, sin):
    return in_layout_of(fused.rotary(t, cos, sin, "half"), t)


def examples(widths):
    """t [s, b, n, d] with cos/sin [s, 1, 1, r]: one example per distinct joint graph: r = d (t_pass empty) or
    r < d (two real slices); cos/sin without grad, or with grad, broadcast (their gradient is a sum over the
    broadcast dims) or of t's full shape (no sum). Ranks, layouts and dtypes need no variants: the aten ops
    carry none of them, and each match is retraced on its real inputs."""

    def make():
        for r in widths:
            for cos_grad, cos_shape in ((False, (3, 1, 1, r)), (True, (3, 1, 1, r)), (True, (3, 2, 2, r))):
                cos, sin = (torch.empty(cos_shape, requires_grad=cos_grad) for _ in range(2))
                yield [torch.empty(3, 2, 2, 8, requires_grad=True), cos, sin]

    return make


def rotary_check(layout):
    def check(match):
        t, cos, sin = (match.kwargs[k].meta["val"] for k in ("t", "cos", "sin"))
        if cos.shape != sin.shape or cos.dtype != sin.dtype:
            return f"cos {tuple(cos.shape)} {cos.dtype} and sin {tuple(sin.shape)} {sin.dtype} differ"
        if cos.dtype != t.dtype:
            return f"cos/sin dtype {cos.dtype} differs from the input's {t.dtype} (the product promotes; rotary does not)"
        rotated = (*t.shape[:-1], cos.shape[-1])
        if cos.shape[-1] % 2 or torch.broadcast_shapes(rotated, cos.shape) != rotated:
            return f"cos/sin {tuple(cos.shape)} do not broadcast to the rotated channels {rotated} with an even width"
        return layout(match)

    return check


def rotation_site(node: torch.fx.Node) -> bool:
    """A neg that starts a rotation: the first operand of a cat (half) or a stack (interleave). The backward
    of an unfused RoPE negates the other operand, so one site is not counted twice."""
    return any(u.target in (aten.cat.default, aten.stack.default) and u.args[0][0] is node for u in node.users)


def _calls(*ops):
    """A ``wanted`` test: the graph calls every op in ``ops`` (rules are traced only for graphs that may use them)."""
    return lambda graph: all(graph.find_nodes(op="call_function", target=op) for op in ops)


for _pattern, _replacement, _widths, _layout, _rotation in (
    (megatron_rope(rotate_half), fused_megatron_rope("half"), (8, 4), layout_check(), aten.cat.default),
    (megatron_rope(rotate_interleaved), fused_megatron_rope("interleave"), (8, 4), layout_check(), aten.stack.default),
    (hf_rope, fused_hf_rope, (8,), layout_check("t"), aten.cat.default),
    (hf_rope_sliced, fused_hf_rope, (8,), layout_check("t"), aten.cat.default),
    (hf_rope_sliced_in_place, fused_hf_rope, (8,), layout_check("t"), aten.cat.default),
):
    register_rule(Rule(
        name="rotary",
        pattern=_pattern,
        replacement=_replacement,
        example_inputs=examples(_widths),
        extra_check=rotary_check(_layout),
        anchors=(aten.neg.default,),
        site=rotation_site,
        wanted=_calls(aten.neg.default, _rotation),
    ))
