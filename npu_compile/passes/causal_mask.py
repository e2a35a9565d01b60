"""Fusion rule ``causal_mask``: a fused attention over Megatron's default causal mask becomes causal, without the
mask.

megatron-core's attention without an attention mask asks for ``get_default_causal_mask(sq)``, an s×s bool tensor
hiding the keys after each query (``torch.triu(torch.ones(sq, sq), diagonal=1)``, transformer/utils.py), and masks
its scores with it (``masked_fill_(mask, -10000.0)``). The attention rules fuse that into
``fused_attention(q, k, v, mask, ..., fill=-10000.0)`` and its backward: the graph still builds the mask each
step and, in training, keeps it for the backward — s² bytes a layer, 1 GiB at 32K tokens, that the fused op does
not need: it reads such a mask as ``causal`` anyway (ops/attention.py ``_is_causal_mask``).

This rule runs after the attention rules and takes each such pair: where the mask is ``triu(ones([s, s]), 1)`` (or
a view, expansion or copy of it) with s the call's query and key length, the forward and backward calls get
``causal=True`` and no mask, and the mask is dead code. The results are the same: a causal mask hides no whole
row (each query sees its own key), so the fill −10000 and the causal kernel's −inf both give those scores a
weight of exactly 0 in fp32.
"""

from __future__ import annotations

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

import npu_compile.ops  # noqa: F401  (registers torch.ops.npu_compile.*)
from npu_compile.passes.engine import GraphRule, register_graph_rule

NAME = "causal_mask"
aten = torch.ops.aten
FORWARD = torch.ops.npu_compile.fused_attention.default
BACKWARD = torch.ops.npu_compile.fused_attention_backward.default
MASK_ARG = {FORWARD: 3, BACKWARD: 7}
# ops whose output holds the first argument's values at the same (query, key) places, broadcast or copied
_SAME = {aten.alias.default, aten.clone.default, aten._to_copy.default, aten.detach.default, aten.expand.default,
         aten.unsqueeze.default, aten.view.default, aten._unsafe_view.default, aten.reshape.default,
         torch.ops.prims.convert_element_type.default}


def _mask(node: torch.fx.Node):
    i = MASK_ARG[node.target]
    return node.args[i] if len(node.args) > i else node.kwargs.get("attn_mask")


def _ones(node) -> bool:
    while isinstance(node, torch.fx.Node) and node.target in _SAME and node.target is not aten.expand.default:
        node = node.args[0]
    if not isinstance(node, torch.fx.Node):
        return False
    if node.target is aten.ones.default:
        return True
    return node.target in (aten.full.default,) and node.args[1] in (1, True)


def causal_square(mask) -> object | None:
    """s if `mask` holds triu(ones([s, s]), diagonal=1), the last two dims (query, key) intact; else None."""
    node = mask
    while isinstance(node, torch.fx.Node) and node.target in _SAME:
        if node.target in (aten.view.default, aten._unsafe_view.default, aten.reshape.default):
            before, after = node.args[0].meta["val"].shape, node.meta["val"].shape
            if tuple(before[-2:]) != tuple(after[-2:]):
                return None
        node = node.args[0]
    if not isinstance(node, torch.fx.Node) or node.target is not aten.triu.default:
        return None
    diagonal = node.args[1] if len(node.args) > 1 else node.kwargs.get("diagonal", 0)
    shape = node.meta["val"].shape
    if diagonal != 1 or len(shape) != 2 or not _same(shape[0], shape[1]) or not _ones(node.args[0]):
        return None
    return shape[0]


def _same(a, b) -> bool:
    """a == b, decided without a guard (sizes may be symbols)."""
    return statically_known_true(a == b)


def _lengths(node: torch.fx.Node):
    layout = node.kwargs.get("layout", "bnsd")
    q, k = (node.args[1], node.args[2]) if node.target is BACKWARD else (node.args[0], node.args[1])
    dim = layout.index("s")
    return q.meta["val"].shape[dim], k.meta["val"].shape[dim]


def apply(graph: torch.fx.Graph, mode: str) -> tuple[int, list[dict[str, str]]]:
    sites = 0
    for node in [*graph.find_nodes(op="call_function", target=FORWARD),
                 *graph.find_nodes(op="call_function", target=BACKWARD)]:
        mask = _mask(node)
        s = causal_square(mask) if isinstance(mask, torch.fx.Node) else None
        if s is None or node.kwargs.get("causal", False):
            continue
        sq, sk = _lengths(node)
        if not (_same(sq, s) and _same(sk, s)):
            continue
        i = MASK_ARG[node.target]
        args = list(node.args)
        if len(args) > i:
            args[i] = None
        node.args = tuple(args)
        node.kwargs = {**{k: v for k, v in node.kwargs.items() if k != "attn_mask"}, "causal": True}
        sites += node.target is FORWARD
    return sites, []  # the engine removes the masks left without users


register_graph_rule(GraphRule(NAME, apply))
