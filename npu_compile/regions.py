"""Nested compile regions: the subgraphs a graph calls through invoke_subgraph, compiled once each.

``torch.compiler.nested_compile_region`` marks a function (a transformer layer's forward) whose calls Dynamo
traces once and calls as ``invoke_subgraph(subgraph, identifier, *operands)``, the subgraph a ``get_attr`` submodule
of the calling graph. aot_autograd keeps the form: each region's joint graph is partitioned on its own, and the
forward / backward graphs call ``partitioned_fw_<identifier>`` / ``partitioned_bw_<identifier>`` submodules. The
backend compiles each subgraph once; the passes that look at a whole graph (memory, cost) see a call site as one
step whose cost is the subgraph's; the executor runs the lowered subgraph at each call site (:func:`call_region`).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator

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


@contextlib.contextmanager
def schema_once_per_region() -> Iterator[None]:
    """Within it, invoke_subgraph's schema is worked out once per region and operand kind, not once per call.

    When a region's operands require grad, ``HigherOrderOperator``'s autograd step asks the HOP for its schema
    before anything else, to refuse a subgraph that writes into its inputs (torch/_ops.py, ``py_autograd_impl``:
    ``maybe_run_autograd``), and invoke_subgraph's ``gen_schema`` answers by tracing the subgraph again with
    ``materialize_as_graph`` (torch/_higher_order_ops/invoke_subgraph.py) — at every call, before invoke_subgraph's
    own cache of the traced region is looked at: N calls of one layer trace it N more times in each of aot_autograd's
    two passes. A schema depends on the subgraph and on its operands' kinds (tensor class, shape, stride, dtype,
    device, requires_grad; other operands by type and value), so a call whose subgraph and operands match an earlier
    call's gets that call's schema: torch's check runs, as torch runs it, on each distinct call. The HOP is a
    process-wide object: the memo is an attribute of that one object for the duration of this compile only, the
    class and every other HOP untouched, and removed on the way out."""
    hop = torch.ops.higher_order.invoke_subgraph
    if "gen_schema" in vars(hop):  # a compile inside a compile: the outer one's memo serves both
        yield
        return
    generate = hop.gen_schema
    memo: dict[tuple, tuple[object, object]] = {}

    def gen_schema(subgraph, identifier, *operands):
        graph = getattr(subgraph, "subgraph", subgraph)  # FunctionalizeCtxWrapper carries the traced graph
        key = (id(graph), identifier, tuple(_operand_kind(o) for o in operands))
        hit = memo.get(key)
        if hit is not None and hit[0] is graph:
            return hit[1]
        schema = generate(subgraph, identifier, *operands)
        memo[key] = (graph, schema)  # the graph kept alive with its entry: its id is not reused meanwhile
        return schema

    hop.gen_schema = gen_schema
    try:
        yield
    finally:
        del hop.gen_schema


def _operand_kind(operand: object) -> tuple:
    if isinstance(operand, torch.Tensor):
        return (type(operand), tuple(operand.shape), tuple(operand.stride()), operand.dtype, operand.device,
                operand.requires_grad)
    return (type(operand), operand if isinstance(operand, (int, float, bool, str, type(None))) else id(operand))
