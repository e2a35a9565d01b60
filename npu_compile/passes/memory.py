"""Memory analysis: the buffers of a graph's schedule and their live bytes, from FakeTensor metadata.

A view shares its base's storage, so a buffer is one storage, live from the node that first produces it to the
last node that touches any alias of it (torch's ``GraphAliasTracker`` gives both). Graph inputs are buffers only
when the caller says they die inside the graph: the saved activations of a backward graph do (the executor frees
its arguments as it goes); parameters, user inputs and incoming gradients do not. Graph outputs stay live to
the end. Over forward then backward, each saved activation is one buffer from its forward allocation to its last
backward use.

The live-bytes peak is the lower bound of any allocator for that order; ``arena`` plans offsets in one arena
and its size beside that bound is the fragmentation.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch._inductor.fx_passes.memory_estimator import GraphAliasTracker
from torch.fx.experimental.symbolic_shapes import optimization_hint


@dataclasses.dataclass(frozen=True)
class Buffer:
    """One storage over a schedule: allocated at step ``start``, released after step ``end`` (inclusive)."""

    name: str  # the node that allocates it (the input's name for inputs)
    op: str
    shape: tuple[int, ...]
    dtype: str
    bytes: int
    start: int
    end: int


@dataclasses.dataclass
class Liveness:
    curve: list[int]  # live bytes at each step of the schedule (after the step's allocations, before its frees)
    peak: int
    peak_step: int
    at_peak: list[Buffer]  # the buffers live at the peak, largest first


def _first_tensor(val: object) -> torch.Tensor | None:
    if isinstance(val, torch.Tensor):
        return val
    if isinstance(val, (tuple, list)):
        return next((v for v in val if isinstance(v, torch.Tensor)), None)
    return None


def _buffer(node: torch.fx.Node, storage: torch.UntypedStorage, start: int, end: int) -> Buffer:
    val = _first_tensor(node.meta.get("val"))
    shape = tuple(optimization_hint(s, fallback=0) for s in val.shape) if val is not None else ()
    dtype = str(val.dtype).removeprefix("torch.") if val is not None else "?"
    op = "input" if node.op == "placeholder" else str(node.target)
    return Buffer(node.name, op, shape, dtype, optimization_hint(storage.nbytes(), fallback=0), start, end)


@dataclasses.dataclass
class GraphBuffers:
    steps: list[torch.fx.Node]  # the compute nodes, in schedule order
    buffers: list[Buffer]
    by_output_node: dict[str, Buffer]  # output-producing node name -> the buffer holding its value


def graph_buffers(
    graph: torch.fx.Graph, dies_inside: Callable[[torch.fx.Node], bool] = lambda n: False
) -> GraphBuffers:
    """The buffers of ``graph`` in its current order; ``dies_inside(placeholder)`` says which inputs count."""
    nodes = list(graph.nodes)
    alias = GraphAliasTracker(nodes)
    steps = [n for n in nodes if n.op not in ("placeholder", "get_attr", "output")]
    index = {n: i for i, n in enumerate(steps)}
    last = len(steps) - 1
    (output,) = graph.find_nodes(op="output")
    outputs = alias.get_storage_uses(output)
    started: dict = {}  # storage key -> (allocating node, start step)
    for node in nodes:
        if node.op == "placeholder" and dies_inside(node):
            for key in alias.get_fresh_allocations(node):
                started[key] = (node, 0)
        elif node in index:
            for key in alias.get_fresh_allocations(node):
                started.setdefault(key, (node, index[node]))
    buffers, by_key = [], {}
    for key, (node, start) in started.items():
        if key in outputs:
            end = last
        else:
            user = alias.storage_to_last_user.get(key)
            end = index.get(user, start)
        by_key[key] = _buffer(node, key.storage, start, max(end, start))
        buffers.append(by_key[key])
    by_output_node = {
        n.name: by_key[k] for n in output.all_input_nodes for k in alias.node_to_output_storages.get(n, ()) if k in by_key
    }
    return GraphBuffers(steps, buffers, by_output_node)


def liveness(buffers: list[Buffer], n_steps: int) -> Liveness:
    """Live bytes per step, the peak, and the buffers that make it."""
    delta = [0] * (n_steps + 1)
    for b in buffers:
        delta[b.start] += b.bytes
        delta[b.end + 1] -= b.bytes
    curve, current = [], 0
    for i in range(n_steps):
        current += delta[i]
        curve.append(current)
    peak = max(curve, default=0)
    step = curve.index(peak) if curve else 0
    at_peak = sorted((b for b in buffers if b.start <= step <= b.end), key=lambda b: -b.bytes)
    return Liveness(curve, peak, step, at_peak)


def graph_liveness(graph: torch.fx.Graph, dies_inside: Callable[[torch.fx.Node], bool] = lambda n: False) -> Liveness:
    """Live bytes after each compute node of ``graph`` in its current order."""
    gb = graph_buffers(graph, dies_inside)
    return liveness(gb.buffers, len(gb.steps))


def is_saved_activation(placeholder: torch.fx.Node) -> bool:
    """In a partitioned backward graph: inputs that are neither parameters/user inputs nor incoming grads."""
    return not placeholder.name.startswith(("primals", "tangents"))


def saved_activation_bytes(bw: torch.fx.Graph) -> int:
    """Bytes of the distinct storages the forward saves for this backward."""
    return sum(b.bytes for b in graph_buffers(bw, is_saved_activation).buffers if b.op == "input")


def training_buffers(fw: torch.fx.Graph, bw: torch.fx.Graph) -> tuple[list[Buffer], int]:
    """Buffers over the forward then the backward schedule, one per saved activation across the boundary."""
    f = graph_buffers(fw)
    b = graph_buffers(bw, is_saved_activation)
    n_f = len(f.steps)
    saved_end: dict[str, int] = {}  # forward buffer name -> last backward step that reads it
    bw_buffers = []
    for buf in b.buffers:
        fw_buf = f.by_output_node.get(buf.name) if buf.op == "input" else None
        if fw_buf is not None:
            saved_end[fw_buf.name] = max(saved_end.get(fw_buf.name, 0), n_f + buf.end)
        else:
            bw_buffers.append(dataclasses.replace(buf, start=n_f + buf.start, end=n_f + buf.end))
    fw_buffers = [dataclasses.replace(x, end=saved_end[x.name]) if x.name in saved_end else x for x in f.buffers]
    return fw_buffers + bw_buffers, n_f + len(b.steps)


def training_liveness(fw: torch.fx.Graph, bw: torch.fx.Graph) -> Liveness:
    """Live bytes over the forward then the backward schedule, saved activations live across the boundary."""
    return liveness(*training_buffers(fw, bw))


def arena(buffers: list[Buffer]) -> tuple[dict[int, int], int]:
    """Offsets of every buffer in one arena (greedy by size, best fit in time); returns (offsets, arena bytes).

    Buffers are placed largest first; each takes the lowest gap, among the buffers already placed that overlap it
    in time, where it fits. The result is never below the live-bytes peak; the gap to it is fragmentation.
    """
    order = sorted(range(len(buffers)), key=lambda i: (-buffers[i].bytes, buffers[i].start))
    placed: list[int] = []
    offsets: dict[int, int] = {}
    size = 0
    for i in order:
        b = buffers[i]
        busy = sorted(
            (offsets[j], offsets[j] + buffers[j].bytes)
            for j in placed
            if buffers[j].start <= b.end and b.start <= buffers[j].end
        )
        best, best_gap, cursor = None, None, 0
        for lo, hi in busy:
            gap = lo - cursor
            if gap >= b.bytes and (best_gap is None or gap < best_gap):
                best, best_gap = cursor, gap
            cursor = max(cursor, hi)
        offsets[i] = best if best is not None else cursor
        placed.append(i)
        size = max(size, offsets[i] + b.bytes)
    return offsets, size
