"""Peak-aware node ordering: a least-peak-memory-first topological order of an FX graph.

The greedy rule (Inductor's LPMF, here on FX nodes and storages): among the nodes whose inputs are ready, compute
for each the live bytes *during* it (live + what it allocates) and *after* it (minus what it frees). If some can
run without raising the peak so far, take the one that leaves the least live; otherwise the one that raises the
peak least. Ties keep the original order.

Nodes whose relative order carries meaning stay in that order: collectives and their waits (the comm schedule),
random ops (the RNG stream), and ops that mutate. The new order is applied only when it lowers the peak.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch._inductor.fx_passes.memory_estimator import GraphAliasTracker
from torch.fx.experimental.symbolic_shapes import optimization_hint

from npu_compile.passes.memory import graph_liveness, in_host_memory


def is_pinned(node: torch.fx.Node) -> bool:
    """Whether ``node`` must keep its order relative to the other pinned nodes."""
    target = node.target
    if isinstance(target, torch._ops.HigherOrderOperator):
        return True
    if not isinstance(target, torch._ops.OpOverload):
        return False
    return (
        target.namespace in ("_c10d_functional", "c10d_functional")
        or torch.Tag.nondeterministic_seeded in target.tags
        or target is torch.ops.aten.randint.low or target is torch.ops.aten.randint.default
        or target._schema.is_mutable
    )


def lpmf_order(graph: torch.fx.Graph, dies_inside: Callable[[torch.fx.Node], bool]) -> list[torch.fx.Node]:
    """The compute nodes of ``graph`` in least-peak-memory-first order."""
    nodes = list(graph.nodes)
    alias = GraphAliasTracker(nodes)
    steps = [n for n in nodes if n.op not in ("placeholder", "get_attr", "output")]
    index = {n: i for i, n in enumerate(steps)}
    (output,) = graph.find_nodes(op="output")
    outputs = alias.get_storage_uses(output)

    preds: dict[torch.fx.Node, set[torch.fx.Node]] = {n: {m for m in n.all_input_nodes if m in index} for n in steps}
    pinned = [n for n in steps if is_pinned(n)]
    for a, b in zip(pinned, pinned[1:]):
        preds[b].add(a)
    succs: dict[torch.fx.Node, list[torch.fx.Node]] = {n: [] for n in steps}
    for n, ps in preds.items():
        for p in ps:
            succs[p].append(n)

    size = {}
    releasable = set()
    for n in nodes:
        for key in alias.get_fresh_allocations(n):
            size[key] = 0 if in_host_memory(n) else optimization_hint(key.storage.nbytes(), fallback=0)
            if (n in index or (n.op == "placeholder" and dies_inside(n))) and key not in outputs:
                releasable.add(key)
    remaining = {key: len([u for u in alias.storage_to_uses[key] if u in index]) for key in size}
    live = sum(size[k] for n in nodes if n.op == "placeholder" and dies_inside(n) for k in alias.get_fresh_allocations(n))
    peak = live

    def alloc(n: torch.fx.Node) -> int:
        return sum(size[k] for k in alias.get_fresh_allocations(n))

    def frees(n: torch.fx.Node) -> list:
        uses = alias.get_storage_uses(n)
        out = [k for k in uses if k in releasable and remaining[k] == 1]
        out += [k for k in alias.get_fresh_allocations(n) if k in releasable and remaining[k] == 0 and k not in uses]
        return out

    indegree = {n: len(preds[n]) for n in steps}
    ready = [n for n in steps if indegree[n] == 0]
    order: list[torch.fx.Node] = []
    while ready:
        scored = []
        for n in ready:
            during = live + alloc(n)
            after = during - sum(size[k] for k in frees(n))
            scored.append((n, during, after))
        fits = [s for s in scored if s[1] <= peak]
        n, during, after = (
            min(fits, key=lambda s: (s[2], index[s[0]])) if fits else min(scored, key=lambda s: (s[1], index[s[0]]))
        )
        freed = frees(n)
        for k in alias.get_storage_uses(n):
            remaining[k] -= 1
        live, peak = during - sum(size[k] for k in freed), max(peak, during)
        order.append(n)
        ready.remove(n)
        for s in succs[n]:
            indegree[s] -= 1
            if indegree[s] == 0:
                ready.append(s)
    assert len(order) == len(steps), "ordering constraints form a cycle"
    return order


def reorder_for_peak(gm: torch.fx.GraphModule, dies_inside: Callable[[torch.fx.Node], bool]) -> tuple[int, int]:
    """Reorder ``gm`` least-peak-memory-first when that lowers its peak; returns (peak before, peak after)."""
    before = graph_liveness(gm.graph, dies_inside).peak
    original = [n for n in gm.graph.nodes if n.op not in ("placeholder", "get_attr", "output")]
    order = lpmf_order(gm.graph, dies_inside)
    if order == original:
        return before, before
    _place(gm.graph, order)
    after = graph_liveness(gm.graph, dies_inside).peak
    if after >= before:
        _place(gm.graph, original)
        return before, before
    gm.graph.lint()
    gm.recompile()
    return before, after


def _place(graph: torch.fx.Graph, order: list[torch.fx.Node]) -> None:
    (output,) = graph.find_nodes(op="output")
    for n in order:
        output.prepend(n)  # each node moves to just before the output: the final order is `order`
