"""Run a lowered FX graph, freeing each input as soon as the graph is done with it.

aot_autograd calls compiled graphs with the boxed convention: one list of arguments, which the callee may
clear. ``make_boxed_func(gm)`` keeps that list alive for the whole call, so every saved activation lives to
the end of the backward; here the generated code itself unpacks and clears the list, and the code FX generates
drops every value (inputs included) after its last use.

The code is straight-line Python generated once per graph (FX's code generation), not an interpreter loop:
each node is one call. What that call is, is decided per node in ``_dispatch``, in the graph and in each
region it calls (a whole model's layers): a target may give a table of
kernels to call in place of an op (the reference target calls its fused ops' Python kernels directly, without
the custom-op dispatcher's Python layers around each call), ``detach``, a no-op in a graph that runs with
no autograd recording, is dropped where only other nodes read it, and the commonest aten ops are called through
torch's own Python bindings (``Tensor.view``, ``torch.mm``: the same operator, parsed in C++) rather than their
``torch.ops`` OpOverload (a Python ``__call__`` and boxed arguments: about 1 µs more a call, of the 1.5–4 µs a
view or a small add takes; a transformer layer's forward and backward make about 70 such calls).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch.fx.graph import _BoxedCodeGen

from npu_compile import regions

Kernels = Mapping[object, Callable]

_aten = torch.ops.aten
# OpOverload -> the Python binding that resolves to that same overload for the argument kinds an FX graph passes
# it (positional tensors, ints and int lists, a bool keepdim), used where the node has no keyword arguments. Each
# pair is checked against the op in tests/test_backend.py (same values, shape, strides, storage, aliasing).
BINDINGS: dict[object, Callable] = {
    _aten.view.default: torch.Tensor.view,
    _aten.t.default: torch.Tensor.t,
    _aten.permute.default: torch.Tensor.permute,
    _aten.transpose.int: torch.Tensor.transpose,
    _aten.expand.default: torch.Tensor.expand,
    _aten.detach.default: torch.Tensor.detach,
    _aten.unsqueeze.default: torch.Tensor.unsqueeze,
    _aten.squeeze.dim: torch.Tensor.squeeze,
    _aten.select.int: torch.Tensor.select,
    _aten.add.Tensor: torch.add,
    _aten.mul.Tensor: torch.mul,
    _aten.mm.default: torch.mm,
    _aten.sum.dim_IntList: torch.sum,
}


def boxed_executor(gm: torch.fx.GraphModule, kernels: Kernels | None = None) -> Callable[[list], object]:
    """A boxed callable running ``gm`` that releases its arguments as it goes; ``kernels`` maps an op
    (OpOverload) to the callable to run for it, in ``gm`` and in the regions it calls alike; a region call runs the
    region's compiled subgraph. ``gm`` and its regions are left as they are (they may be cached or dumped), but
    for ``gm``'s region calls, which call the compiled regions."""
    regions.run_compiled(gm)
    kernels = kernels or {}
    graph = _dispatched(gm.graph, kernels)
    graph.set_codegen(_BoxedCodeGen())
    runner = torch.fx.GraphModule(gm, graph)
    _dispatch_regions(runner, kernels, {})

    def run(args: list) -> object:
        return runner(args)

    run._boxed_call = True  # type: ignore[attr-defined]
    run.graph_module = runner  # type: ignore[attr-defined]  # the code that runs, for dumps and tests
    return run


def _dispatched(source: torch.fx.Graph, kernels: Kernels) -> torch.fx.Graph:
    """A copy of ``source`` with the per-node dispatch applied to each of its nodes."""
    graph = torch.fx.Graph()
    out, old_output = graph.graph_copy(source, {}, return_output_node=True)
    graph.output(out, type_expr=old_output.type)
    for node in list(graph.nodes):
        if node.op == "call_function":
            _dispatch(graph, node, kernels)
    return graph


def _dispatch_regions(owner: torch.fx.GraphModule, kernels: Kernels, done: dict[int, torch.fx.GraphModule]) -> None:
    """Each region ``owner`` calls (regions inside regions too) runs a dispatched copy of its subgraph, one copy
    per region however many calls: a whole model's layers are region calls, and without this their fused ops
    would go through the custom-op dispatcher at every call of every layer. The subgraphs themselves are kept."""
    for node in owner.graph.nodes:
        sub = regions.subgraph(node)
        if sub is None:
            continue
        if id(sub) not in done:
            copy = torch.fx.GraphModule(sub, _dispatched(sub.graph, kernels))
            _dispatch_regions(copy, kernels, done)
            done[id(sub)] = copy
        parent, _, attr = str(node.args[0].target).rpartition(".")
        setattr(owner.get_submodule(parent) if parent else owner, attr, done[id(sub)])


def _dispatch(graph: torch.fx.Graph, node: torch.fx.Node, kernels: Kernels) -> None:
    """What the generated code calls for ``node``: the per-node decision point."""
    if node.target is torch.ops.aten.detach.default and all(u.op == "call_function" for u in node.users):
        # Graph outputs keep their detach: aot_autograd's output aliasing analysis saw a distinct tensor.
        node.replace_all_uses_with(node.args[0])
        graph.erase_node(node)
        return
    kernel = kernels.get(node.target)
    if kernel is None and not node.kwargs:
        kernel = BINDINGS.get(node.target)
    if kernel is not None:
        node.target = kernel
