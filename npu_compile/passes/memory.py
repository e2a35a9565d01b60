"""Memory analysis: live bytes of a graph's schedule, from FakeTensor metadata, storage-aware.

A view shares its base's storage, so a storage is counted once, from the node that first produces it to the
last node that touches any alias of it (torch's ``GraphAliasTracker`` gives both). Graph inputs are counted only
when the caller says they die inside the graph: the saved activations of a backward graph do (the executor frees
its arguments as it goes); parameters, user inputs and incoming gradients do not. Graph outputs stay live to
the end. For training, the forward's saved activations stay live across the forward→backward boundary.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch._inductor.fx_passes.memory_estimator import GraphAliasTracker
from torch.fx.experimental.symbolic_shapes import optimization_hint


@dataclasses.dataclass(frozen=True)
class LiveTensor:
    name: str
    op: str
    shape: tuple[int, ...]
    dtype: str
    bytes: int


@dataclasses.dataclass
class Liveness:
    curve: list[int]  # live bytes after each node of the schedule
    peak: int
    peak_node: str | None  # the node at which the peak is reached
    at_peak: list[LiveTensor]  # the storages live at the peak, largest first


def _nbytes(storage: torch.UntypedStorage) -> int:
    return optimization_hint(storage.nbytes(), fallback=0)


def _first_tensor(val: object) -> torch.Tensor | None:
    if isinstance(val, torch.Tensor):
        return val
    if isinstance(val, (tuple, list)):
        return next((v for v in val if isinstance(v, torch.Tensor)), None)
    return None


def _describe(node: torch.fx.Node, nbytes: int) -> LiveTensor:
    val = _first_tensor(node.meta.get("val"))
    shape = tuple(optimization_hint(s, fallback=0) for s in val.shape) if val is not None else ()
    dtype = str(val.dtype).removeprefix("torch.") if val is not None else "?"
    op = "input" if node.op == "placeholder" else str(node.target)
    return LiveTensor(node.name, op, shape, dtype, nbytes)


def graph_liveness(
    graph: torch.fx.Graph, dies_inside: Callable[[torch.fx.Node], bool] = lambda n: False
) -> Liveness:
    """Live bytes after each node of ``graph`` in its current order.

    ``dies_inside(placeholder)`` says whether an input's storage is counted and freed after its last use.
    """
    nodes = list(graph.nodes)
    alias = GraphAliasTracker(nodes)
    live: dict = {}  # storage key -> (allocating node, bytes)
    for node in graph.find_nodes(op="placeholder"):
        if dies_inside(node):
            for key in alias.get_fresh_allocations(node):
                live[key] = (node, _nbytes(key.storage))
    outputs = {key for out in graph.find_nodes(op="output") for key in alias.get_storage_uses(out)}
    current = sum(b for _, b in live.values())
    curve, peak, peak_node, at_peak = [], current, None, list(live.values())
    for node in nodes:
        if node.op in ("placeholder", "get_attr", "output"):
            continue
        for key in alias.get_fresh_allocations(node):
            if key not in live:
                live[key] = (node, _nbytes(key.storage))
                current += live[key][1]
        if current > peak:
            peak, peak_node, at_peak = current, node.name, list(live.values())
        curve.append(current)
        for key in alias.get_storages_last_used(node):
            if key in live and key not in outputs:
                current -= live.pop(key)[1]
    top = sorted((_describe(n, b) for n, b in at_peak), key=lambda t: -t.bytes)
    return Liveness(curve, peak, peak_node, top)


def is_saved_activation(placeholder: torch.fx.Node) -> bool:
    """In a partitioned backward graph: inputs that are neither parameters/user inputs nor incoming grads."""
    return not placeholder.name.startswith(("primals", "tangents"))


def saved_activation_bytes(bw: torch.fx.Graph) -> int:
    """Bytes of the distinct storages the forward saves for this backward."""
    alias = GraphAliasTracker(list(bw.nodes))
    keys = {k for n in bw.find_nodes(op="placeholder") if is_saved_activation(n) for k in alias.get_fresh_allocations(n)}
    return sum(_nbytes(k.storage) for k in keys)


def training_liveness(fw: torch.fx.Graph, bw: torch.fx.Graph) -> Liveness:
    """Live bytes over the forward then the backward schedule, saved activations live across the boundary."""
    f = graph_liveness(fw)
    b = graph_liveness(bw, dies_inside=is_saved_activation)
    # The forward's non-saved outputs (the loss, user outputs) are small and owned by the caller: not counted on.
    top = f if f.peak >= b.peak else b
    return Liveness(f.curve + b.curve, top.peak, top.peak_node, top.at_peak)
