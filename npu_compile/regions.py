"""Nested compile regions: the subgraphs a graph calls through invoke_subgraph, compiled once each.

``torch.compiler.nested_compile_region`` marks a function (a transformer layer's forward) whose calls Dynamo
traces once and calls as ``invoke_subgraph(subgraph, identifier, *operands)``, the subgraph a ``get_attr`` submodule
of the calling graph. aot_autograd keeps the form: each region's joint graph is partitioned on its own, and the
forward / backward graphs call ``partitioned_fw_<identifier>`` / ``partitioned_bw_<identifier>`` submodules. The
backend compiles each subgraph once; the passes that look at a whole graph (memory, cost) see a call site as one
step whose cost is the subgraph's; the executor runs the lowered subgraph at each call site (:func:`call_region`).
"""

from __future__ import annotations

import re

import torch


def call_region(subgraph: torch.fx.GraphModule, identifier: str, *operands: object) -> tuple:
    """One call of a compiled region: its lowered subgraph's code, run directly. The invoke_subgraph HOP would
    get there too, through the dispatcher, on every call of every layer."""
    return subgraph.forward(*operands)


def subgraph(node: torch.fx.Node) -> torch.fx.GraphModule | None:
    """The subgraph a region call node runs (invoke_subgraph, or :func:`call_region` once the executor took
    over), else None."""
    if node.op != "call_function" or node.target not in (torch.ops.higher_order.invoke_subgraph, call_region):
        return None
    attr = node.args[0]
    owner = node.graph.owning_module
    if not (isinstance(attr, torch.fx.Node) and attr.op == "get_attr") or owner is None:
        return None
    sub = getattr(owner, str(attr.target), None)
    return sub if isinstance(sub, torch.fx.GraphModule) else None


def regions(gm: torch.fx.GraphModule) -> list[tuple[str, torch.fx.GraphModule]]:
    """The subgraphs ``gm`` calls, each once, innermost first: (attribute name, module)."""
    found: dict[int, tuple[str, torch.fx.GraphModule]] = {}

    def walk(owner: torch.fx.GraphModule) -> None:
        for node in owner.graph.nodes:
            sub = subgraph(node)
            if sub is not None and id(sub) not in found:
                walk(sub)
                found[id(sub)] = (str(node.args[0].target), sub)

    walk(gm)
    return list(found.values())


def calls(gm: torch.fx.GraphModule) -> dict[int, int]:
    """id(subgraph module) -> how many nodes of ``gm`` call it."""
    counts: dict[int, int] = {}
    for node in gm.graph.nodes:
        sub = subgraph(node)
        if sub is not None:
            counts[id(sub)] = counts.get(id(sub), 0) + 1
    return counts


def name(attr: str) -> str:
    """A region's report.json name from its attribute: aot_autograd's ``partitioned_fw_subgraph_1_0`` (a region's
    forward after the partition) and Dynamo's ``subgraph_1`` (as captured: an inference graph's) name
    ``subgraph_1_0`` and ``subgraph_1``."""
    return re.sub(r"^(partitioned_)?(fw_|bw_)?", "", attr)


def run_compiled(gm: torch.fx.GraphModule) -> None:
    """Every invoke_subgraph node of ``gm`` (regions inside regions too) calls its subgraph through
    :func:`call_region`."""
    changed = False
    for node in gm.graph.find_nodes(op="call_function", target=torch.ops.higher_order.invoke_subgraph):
        sub = subgraph(node)
        if sub is not None:
            run_compiled(sub)
            node.target = call_region
            changed = True
    if changed:
        gm.recompile()
