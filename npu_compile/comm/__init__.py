"""Collectives in the graph: counting now; the Ascend cost model, overlap scheduling and MC2 rewrites build here."""

from __future__ import annotations

import torch

# Functional collectives (``_c10d_functional``) as Dynamo emits them; ``wait_tensor`` only completes one.
_NOT_COLLECTIVES = {"wait_tensor"}


def collectives(*graphs: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """The collective nodes of ``graphs`` in order."""
    return [
        n
        for gm in graphs
        for n in gm.graph.nodes
        if n.op == "call_function"
        and isinstance(n.target, torch._ops.OpOverload)
        and n.target.namespace == "_c10d_functional"
        and n.target._opname not in _NOT_COLLECTIVES
    ]
