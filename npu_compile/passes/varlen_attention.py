"""Fusion rule, packed documents: attention under Megatron's reset mask becomes ``npu_compile.varlen_attention``,
which takes the documents' lengths and never forms the s×s mask.

Megatron-LM's ``--reset-attention-mask`` masks each token off every document but its own (the dense
[b, 1, s, s] mask megatron-core's GPTDataset builds from the end-of-document tokens). In a graph, that mask is
``npu_compile.document_mask(cu_seqlens, b, s)`` — the dense mask made from the cumulative lengths (what
megatron_glue passes a packed batch's attention as, see ``megatron_glue.capture.packed``) — and the attention
rules have already turned Megatron's core attention over it (baddbmm, ``masked_fill_(mask, -10000.0)``, softmax,
bmm; any of its spellings) into one ``fused_attention(..., mask, layout="sbnd", fill=-10000.0)`` and its
backward. This rule runs after them and takes that pair: with the mask made from lengths, the call is
``varlen_attention(q, k, v, cu_seqlens)`` and its backward, and the mask is left without users (dead code).

The fill −10000 and removal agree here: a document mask never hides a whole row (each token sees itself), so
every row has a visible score and exp(−10000 − max) is 0 in fp32 (ops/attention.py, ``fill``).

Left dense, with the reason in report.json ``unfused``: calls with dropout (varlen_attention has none: Megatron
draws its dropout over the dense probabilities), and masks that are not a document mask.
"""

from __future__ import annotations

import torch

import npu_compile.ops  # noqa: F401  (registers torch.ops.npu_compile.*)
from npu_compile.passes.engine import Rule, register_rule

NAME = "varlen_attention"
ANCHORS = (torch.ops.npu_compile.fused_attention.default,)
MEGATRON_FILL = -10000.0
SCALE = 0.1234567  # traced in place of the scale, so a match reads the real one

# Example shapes: s=8, b=2, n=4 query heads (2 kv heads for GQA), d=16.
S, B, NQ, NKV, D = 8, 2, 4, 2, 16


def packed_attention(query, key, value, cu_seqlens, scale):
    """What the attention rules leave for Megatron's core attention over a document mask."""
    mask = torch.ops.npu_compile.document_mask(cu_seqlens, query.size(1), query.size(0))
    out, _, _ = torch.ops.npu_compile.fused_attention(query, key, value, mask, None, None, layout="sbnd",
                                                      scale=scale, fill=MEGATRON_FILL)
    return out


def varlen(query, key, value, cu_seqlens, scale):
    out, _, _ = torch.ops.npu_compile.varlen_attention(query, key, value, cu_seqlens, layout="sbnd", scale=scale)
    return out


def examples() -> list[list]:
    """GQA and MHA, fp32 and bf16 (the op's statistics are fp32 either way; one traced graph may serve both)."""
    cu = torch.tensor([S // 2, S, 2 * S, 2 * S], dtype=torch.int64)
    return [[torch.empty(S, B, NQ, D, dtype=dtype, requires_grad=True),
             torch.empty(S, B, kv, D, dtype=dtype, requires_grad=True),
             torch.empty(S, B, kv, D, dtype=dtype, requires_grad=True), cu]
            for kv in (NKV, NQ) for dtype in (torch.float32, torch.bfloat16)]


def _document_masked(node: torch.fx.Node) -> bool:
    mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
    return isinstance(mask, torch.fx.Node) and mask.target is torch.ops.npu_compile.document_mask.default


def site(node: torch.fx.Node) -> bool | str:
    """A fused attention over a document mask is a site; with dropout, one this rule leaves dense by design."""
    if not _document_masked(node):
        return False
    if node.kwargs.get("dropout_p", 0.0) > 0.0:
        return ("dropout: varlen_attention takes none (Megatron draws attention dropout over the dense "
                "probabilities); the call keeps the dense document mask")
    return True


def check(match) -> bool | str:
    scale = match.kwargs.get("scale")
    if isinstance(scale, torch.fx.Node):
        return f"scale is the tensor {scale.name}, not a number the op can take"
    val = match.kwargs["query"].meta["val"], match.kwargs["key"].meta["val"], match.kwargs["value"].meta["val"]
    if not val[0].dtype == val[1].dtype == val[2].dtype:
        return "query, key and value dtypes differ"
    if val[0].shape[0] != val[1].shape[0]:
        return "query and key lengths differ: a document mask is self-attention"
    return True


register_rule(Rule(
    NAME, packed_attention, varlen, example_inputs=examples, scalars={"scale": SCALE}, extra_check=check,
    anchors=ANCHORS, site=site,
    wanted=lambda graph: bool(graph.find_nodes(op="call_function",
                                               target=torch.ops.npu_compile.document_mask.default)),
))
