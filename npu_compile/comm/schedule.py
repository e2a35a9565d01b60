"""Comm/compute overlap on an aten graph: bucket small collectives, then reorder the graph so that every
collective is issued as early as its inputs allow and waited as late as its users allow.

The pass, :func:`schedule_overlap`:
1. Bucket latency-bound collectives of one kind and group with Inductor's FX bucketing
   (``bucket_*_by_mb`` / ``merge_*``), which merges only collectives with adjacent waits and no path between them.
2. Build the dependency graph (networkx): data edges, plus order edges that keep semantics — side effects
   (mutations, RNG draws, effectful ops) stay in their order, and a mutation stays after every earlier reader
   and before every later reader of the storage it writes.
3. List-schedule it with the two-stream simulator running alongside: a ready collective is issued at once
   (the most urgent first) unless its output would take live bytes over the cap while other work could run;
   a wait whose collective is still running is held back while any other node can run; among runnable nodes
   the pick is either the one with the longest remaining path to the end (``critical_path``: off-path work
   such as weight gradients is saved for hiding comm) or the first in the original order
   (``keep_compute_order``: waits sink and collectives rise, compute keeps its order). While live bytes exceed
   the cap, the original order decides (it is the order that fits).
4. Keep the strategy with the least simulated time whose peak live bytes (torch's ``MemoryTracker``, CPU
   tensors counted) stay within ``max_extra_bytes`` of the original order's; keep the original graph if
   neither beats it. Ranks compile the same graph with the same costs, so they pick the same collective order.

All work is done on a copy: the graph changes only when the result is adopted, and a failure leaves it as it was.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Sequence

import networkx as nx
import torch
from torch._inductor.fx_passes import bucketing
from torch._inductor.fx_passes.memory_estimator import MemoryTracker
from torch._inductor.pattern_matcher import stable_topological_sort

from npu_compile.config import Options
from npu_compile.device import cost, nodes
from npu_compile.device.profile import DeviceProfile, load
from npu_compile.comm.simulate import Timeline, simulate

log = logging.getLogger("npu_compile")

MiB = 2**20
MAX_EXTRA_BYTES = 256 * MiB  # live bytes the new order may add over the original's peak
BUCKET_CAP_BYTES = 32 * MiB  # largest merged collective
LATENCY_BOUND_SHARE = 0.2  # a collective whose latency terms are ≥ this share of its time is worth bucketing
STRATEGIES = ("keep_compute_order", "critical_path")


@dataclasses.dataclass
class OverlapResult:
    before: Timeline
    after: Timeline
    strategy: str  # the strategy adopted, or "unchanged"
    buckets: int  # merged collectives created
    peak_bytes_before: int | None  # peak live bytes (None: a graph without collectives is not measured)
    peak_bytes_after: int | None


# -- semantics: what must keep its order ---------------------------------------------------------------------


def _written(node: torch.fx.Node) -> list[torch.fx.Node]:
    """Inputs a node mutates (schema arguments marked ``(a!)``)."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return []
    written = []
    for i, arg in enumerate(node.target._schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            value = node.kwargs.get(arg.name) if arg.kwarg_only or i >= len(node.args) else node.args[i]
            values = value if isinstance(value, (list, tuple)) else [value]
            written += [v for v in values if isinstance(v, torch.fx.Node)]
    return written


def _aliases_base(node: torch.fx.Node) -> bool:
    """Whether a node's output shares its first input's storage (views, and ``wait_tensor``, which returns it)."""
    if node.op != "call_function" or not node.args or not isinstance(node.args[0], torch.fx.Node):
        return False
    return nodes.is_wait(node) or (isinstance(node.target, torch._ops.OpOverload) and node.target.is_view)


def _storage_root(node: torch.fx.Node) -> torch.fx.Node:
    while _aliases_base(node):
        node = node.args[0]
    return node


def dependency_graph(graph: torch.fx.Graph) -> nx.DiGraph:
    """Every constraint a reorder of ``graph`` must respect, as edges between its nodes (all pointing forward in
    the current order, so the current order is one valid topological order)."""
    order = list(graph.nodes)
    index = {n: i for i, n in enumerate(order)}
    deps = nx.DiGraph()
    deps.add_nodes_from(order)
    deps.add_edges_from((i, n) for n in order for i in n.all_input_nodes)
    # Side effects happen in their original order: mutations, RNG draws (each takes the next random numbers),
    # effectful calls.
    effects = [n for n in order if n.op == "call_function" and n.is_impure()]
    deps.add_edges_from(zip(effects, effects[1:]))
    # A mutation comes after every earlier reader of the storage it writes and before every later one.
    aliases: dict[torch.fx.Node, list[torch.fx.Node]] = {}
    for n in order:
        aliases.setdefault(_storage_root(n), []).append(n)
    for m in effects:
        for written in _written(m):
            for alias in aliases.get(_storage_root(written), []):
                for reader in [alias, *alias.users]:
                    if reader is m or reader.op in ("placeholder", "output"):
                        continue
                    deps.add_edge(*((reader, m) if index[reader] < index[m] else (m, reader)))
    return deps


# -- bucketing ---------------------------------------------------------------------------------------------


def _latency_bound(node: torch.fx.Node, profile: DeviceProfile) -> bool:
    full = cost.comm_us(node, profile)
    return full > 0 and cost.comm_us(node, profile, nbytes=1) >= LATENCY_BOUND_SHARE * full


def bucket_small_collectives(
    gm: torch.fx.GraphModule, profile: DeviceProfile, cap_bytes: int = BUCKET_CAP_BYTES
) -> int:
    """Merge latency-bound all-gathers, reduce-scatters and all-reduces of one group (Inductor's FX bucketing);
    returns the number of merged collectives made. Inductor's bucketing assumes a functional graph, so
    collectives whose input storage is updated in place anywhere in the graph are left out."""

    # A merged collective reads its inputs where the last of its members was: none may be written in between.
    effects = [n for n in gm.graph.nodes if n.op == "call_function" and n.is_impure()]
    written = {_storage_root(w) for n in effects for w in _written(n)}

    def small(wait: torch.fx.Node) -> bool:
        coll = nodes.collective_of(wait)
        if coll is None or not isinstance(coll.args[0], torch.fx.Node):
            return False
        return _storage_root(coll.args[0]) not in written and _latency_bound(coll, profile)

    def cap_mb(_bucket_index: int) -> float:
        return cap_bytes / MiB

    made = 0
    # Merging all-gathers asks the process group for this rank's index, so it needs a live group.
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        ag = bucketing.bucket_all_gather_by_mb(gm, cap_mb, small, mode="default")
        bucketing.merge_all_gather(gm, ag, mode="default")
        made += len(ag)
    rs = bucketing.bucket_reduce_scatter_by_mb(gm, cap_mb, small, mode="default")
    bucketing.merge_reduce_scatter(gm, rs, mode="default")
    ar = bucketing.bucket_all_reduce_by_mb(gm, cap_mb, small)
    for bucket in ar:
        bucketing.merge_all_reduce_bucket(gm.graph, bucket)
    made += len(rs) + len(ar)
    if made:
        stable_topological_sort(gm.graph)
    return made


# -- ordering ----------------------------------------------------------------------------------------------


def _bottom_levels(order: Sequence[torch.fx.Node], deps: nx.DiGraph, costs: dict) -> dict[torch.fx.Node, float]:
    """Longest path (in µs, collectives included) from each node to the end of the graph."""
    level: dict[torch.fx.Node, float] = {}
    for n in reversed(order):
        level[n] = costs[n] + max((level[s] for s in deps.successors(n)), default=0.0)
    return level


def peak_bytes(graph: torch.fx.Graph, order: Iterable[torch.fx.Node]) -> int:
    """Peak live bytes of ``graph`` run in ``order`` (torch's MemoryTracker, every device counted)."""
    tracker = MemoryTracker(graph, device_filter=lambda device: True)
    for n in order:
        if n.op not in ("placeholder", "get_attr"):
            tracker.schedule_node(n)
    return tracker.peak_memory


def list_schedule(
    graph: torch.fx.Graph, costs: dict, strategy: str = "critical_path", allowed_bytes: int | None = None
) -> list[torch.fx.Node]:
    """A new order of ``graph`` (placeholders first, output last), built alongside a two-stream simulation."""
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown overlap strategy {strategy!r}; valid: {', '.join(STRATEGIES)}")
    original = list(graph.nodes)
    index = {n: i for i, n in enumerate(original)}
    deps = dependency_graph(graph)
    level = _bottom_levels(original, deps, costs)
    tracker = MemoryTracker(graph, device_filter=lambda device: True)
    pending = {n: deps.in_degree(n) for n in original}
    order = [n for n in original if n.op == "placeholder"]
    for n in order:
        for s in deps.successors(n):
            pending[s] -= 1
    ready = [n for n in original if pending[n] == 0 and n.op not in ("placeholder", "output")]
    clock = comm_free = 0.0
    finish: dict[torch.fx.Node, float] = {}

    def urgency(n: torch.fx.Node):
        return level[n], -index[n]

    def in_order(n: torch.fx.Node):
        return -index[n]

    def fits(n: torch.fx.Node) -> bool:
        return allowed_bytes is None or tracker.current_memory_bytes + nodes.nbytes(n.meta.get("val")) <= allowed_bytes

    def blocked_until(n: torch.fx.Node) -> float:
        """When ``n`` could start without idling the compute stream: a wait when its collective ends, an MC2 node
        when the link is free; anything else now."""
        if nodes.is_wait(n):
            return finish.get(nodes.collective_of(n), 0.0)
        if nodes.fused_collective(n) is not None:
            return comm_free
        return 0.0

    while ready:
        runnable = [n for n in ready if blocked_until(n) <= clock]
        issuable = [n for n in runnable if nodes.is_collective(n)]
        if len(issuable) < len(runnable):  # with other work to do, an early collective must fit under the cap
            issuable = [n for n in issuable if fits(n)]
        if issuable:
            node = max(issuable, key=urgency)
        elif runnable:
            over_cap = allowed_bytes is not None and tracker.current_memory_bytes > allowed_bytes
            node = max(runnable, key=in_order if strategy == "keep_compute_order" or over_cap else urgency)
        else:  # only waits on running collectives (or MC2 nodes wanting the link): the first to be unblocked
            node = min(ready, key=lambda n: (blocked_until(n), -level[n], index[n]))
        ready.remove(node)
        order.append(node)
        tracker.schedule_node(node)
        if nodes.fused_collective(node) is not None:  # on the compute stream, holding the link
            clock = comm_free = max(clock, comm_free) + costs[node]
        elif nodes.is_collective(node):
            comm_free = finish[node] = max(clock, comm_free) + costs[node]
        elif nodes.is_wait(node):
            clock = max(clock, finish.get(nodes.collective_of(node), clock))
        else:
            clock += costs[node]
        for s in deps.successors(node):
            pending[s] -= 1
            if pending[s] == 0 and s.op != "output":
                ready.append(s)
    order.append(graph.output_node())
    if len(order) != len(original):
        raise RuntimeError("overlap scheduling lost nodes: the dependency graph has a cycle")
    return order


def apply_order(graph: torch.fx.Graph, order: Sequence[torch.fx.Node]) -> None:
    """Move the nodes of ``graph`` into ``order`` (placeholders and the output stay where they are)."""
    output = graph.output_node()
    for n in order:
        if n.op not in ("placeholder", "output"):
            output.prepend(n)
    graph.lint()


def copy_module(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A new GraphModule over a copy of ``gm``'s graph (node metadata shared, not copied)."""
    graph = torch.fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    return torch.fx.GraphModule(gm, graph)


def schedule_overlap(
    gm: torch.fx.GraphModule,
    profile: DeviceProfile | dict | None = None,
    *,
    max_extra_bytes: int = MAX_EXTRA_BYTES,
    bucket: bool = True,
    strategies: Sequence[str] = STRATEGIES,
) -> OverlapResult:
    """Bucket and reorder ``gm`` in place for comm/compute overlap; never makes its simulated time longer."""
    profile = load(profile)
    before = simulate(gm, profile)
    if before.collectives == 0:  # nothing to overlap: not even worth measuring memory
        return OverlapResult(before, before, "unchanged", 0, None, None)
    peak_before = peak_bytes(gm.graph, gm.graph.nodes)
    unchanged = OverlapResult(before, before, "unchanged", 0, peak_before, peak_before)
    candidate = copy_module(gm)
    buckets = bucket_small_collectives(candidate, profile) if bucket else 0
    costs = cost.costs(candidate.graph, profile)
    allowed = peak_before + max_extra_bytes
    best = None
    for strategy in strategies:
        order = list_schedule(candidate.graph, costs, strategy, allowed)
        peak = peak_bytes(candidate.graph, order)
        timeline = simulate(order, profile, cost_us=costs.__getitem__)
        log.debug("overlap %s: total %.1f µs, exposed %.1f µs, peak %d B", strategy, timeline.total_us,
                  timeline.exposed_comm_us, peak)
        if peak <= allowed and (best is None or timeline.total_us < best[0].total_us):
            best = (timeline, strategy, order, peak)
    if best is None or best[0].total_us >= before.total_us:
        return unchanged
    timeline, strategy, order, peak = best
    apply_order(candidate.graph, order)
    gm.graph = candidate.graph
    gm.recompile()
    after = simulate(gm, profile)
    return OverlapResult(before, after, strategy, buckets, peak_before, peak)


def overlap_stage(gm: torch.fx.GraphModule, opts: Options, kind: str = "",
                  profile: DeviceProfile | dict | None = None) -> None:
    """The backend's aten stage (any ``kind`` of graph): schedule for overlap when ``options.overlap`` is on.

    It runs after the target's own stages (a target that fuses matmuls with their collectives has done so by then,
    and the fused ops cost as their emitter declared them: :func:`npu_compile.device.nodes.fused_collective`).
    Overlap is an optimisation: if it fails, the graph compiles in its original order and the reason is logged.
    ``profile``: the device profile it costs with (default: :data:`npu_compile.device.profile.DEFAULT`)."""
    if not opts.overlap:
        return
    try:
        result = schedule_overlap(gm, profile)
    except Exception:
        log.warning("npu_compile: overlap scheduling of the %s graph failed; keeping its order", kind, exc_info=True)
        return
    if result.strategy != "unchanged":
        log.info(
            "overlap of the %s graph (%s, %d buckets): exposed comm %.1f → %.1f µs of %.1f µs comm",
            kind, result.strategy, result.buckets, result.before.exposed_comm_us, result.after.exposed_comm_us,
            result.after.comm_us,
        )
