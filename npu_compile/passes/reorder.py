"""Peak-aware node ordering: a least-peak-memory-first topological order of an FX graph.

The greedy rule (Inductor's LPMF, here on FX nodes and storages): among the nodes whose inputs are ready, compute
for each the live bytes *during* it (live + what it allocates) and *after* it (minus what it frees). If some can
run without raising the peak so far, take the one that leaves the least live; otherwise the one that raises the
peak least. Ties keep the original order.

Nodes whose relative order carries meaning stay in that order: collectives and their waits (the comm schedule),
random ops (the RNG stream), and ops that mutate. The new order is applied only when it lowers the peak.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Callable

import torch
from torch.fx.experimental.symbolic_shapes import optimization_hint

from npu_compile.passes.memory import AliasTracker, graph_liveness, in_host_memory


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
    """The compute nodes of ``graph`` in least-peak-memory-first order.

    Incremental, O((nodes + uses) log nodes): the live bytes shift every candidate's score alike, so a node is
    ranked by ``alloc - frees`` (among those that fit under the peak) or by ``alloc`` (when none does). ``alloc`` is
    fixed; ``frees`` changes only when a storage drops to one reader left, and then for that reader alone. The ready
    nodes sit in a min-segment tree over the nodes sorted by ``alloc``: the ones that fit are a prefix of it."""
    nodes = list(graph.nodes)
    alias = AliasTracker(nodes)
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
    readers = {key: [u for u in alias.storage_to_uses[key] if u in index] for key in size}
    remaining = {key: len(us) for key, us in readers.items()}
    live = sum(size[k] for n in nodes if n.op == "placeholder" and dies_inside(n) for k in alias.get_fresh_allocations(n))
    peak = live

    alloc = {n: sum(size[k] for k in alias.get_fresh_allocations(n)) for n in steps}
    uses = {n: alias.get_storage_uses(n) for n in steps}
    # what a node frees when it runs: its fresh storages nobody reads (fixed), and the storages it reads last
    # (kept current for the ready nodes as readers run)
    freed = {n: sum(size[k] for k in alias.get_fresh_allocations(n)
                    if k in releasable and remaining[k] == 0 and k not in uses[n]) for n in steps}

    by_alloc = sorted(steps, key=lambda n: (alloc[n], index[n]))
    position = {n: i for i, n in enumerate(by_alloc)}
    alloc_sorted = [alloc[n] for n in by_alloc]
    width = 1
    while width < len(steps):
        width *= 2
    none = (float("inf"), len(steps))
    tree = [none] * (2 * width)  # leaf: (alloc - frees, index) of a ready node, else none; inner: min of children

    def put(n: torch.fx.Node, value: tuple) -> None:
        i = position[n] + width
        tree[i] = value
        i //= 2
        while i:
            tree[i] = min(tree[2 * i], tree[2 * i + 1])
            i //= 2

    def best_below(end: int) -> tuple:  # min over leaves [0, end)
        lo, hi, best = width, end + width, none
        while lo < hi:
            if lo & 1:
                best = min(best, tree[lo])
                lo += 1
            if hi & 1:
                hi -= 1
                best = min(best, tree[hi])
            lo //= 2
            hi //= 2
        return best

    ready: set[torch.fx.Node] = set()
    done: set[torch.fx.Node] = set()
    by_position: list[int] = []  # heap of the ready nodes' positions (stale ones skipped): the least alloc first

    def make_ready(n: torch.fx.Node) -> None:
        freed[n] += sum(size[k] for k in uses[n] if k in releasable and remaining[k] == 1)
        ready.add(n)
        heapq.heappush(by_position, position[n])
        put(n, (alloc[n] - freed[n], index[n]))

    indegree = {n: len(preds[n]) for n in steps}
    for n in steps:
        if indegree[n] == 0:
            make_ready(n)
    order: list[torch.fx.Node] = []
    while ready:
        fit = best_below(bisect.bisect_right(alloc_sorted, peak - live))
        if fit != none:
            n = steps[fit[1]]
        else:  # none fits under the peak: the one that raises it least
            while by_alloc[by_position[0]] not in ready:
                heapq.heappop(by_position)
            n = by_alloc[by_position[0]]
        during = live + alloc[n]
        live, peak = during - freed[n], max(peak, during)
        ready.remove(n)
        done.add(n)
        put(n, none)
        order.append(n)
        for k in uses[n]:
            remaining[k] -= 1
            if remaining[k] == 1 and k in releasable:  # its last reader now frees it (counted when it gets ready)
                (last,) = [u for u in readers[k] if u not in done]
                if last in ready:
                    freed[last] += size[k]
                    put(last, (alloc[last] - freed[last], index[last]))
        for s in succs[n]:
            indegree[s] -= 1
            if indegree[s] == 0:
                make_ready(s)
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
