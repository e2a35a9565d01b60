"""Every reorder and bucketing preserves results: random graphs of matmuls, pointwise ops, in-place updates,
RNG draws and collectives run over a 2-process gloo group in their original order, after the overlap pass
(bucketing + the adopted order), and in a random order drawn from the pass's dependency graph; all three must
agree exactly, outputs and updated inputs alike. Two processes are spawned once and run every graph."""

import os
import random

import networkx as nx
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from comm_graphs import random_program
from npu_compile.comm import schedule_overlap
from npu_compile.comm.schedule import apply_order, dependency_graph

GRAPHS = 30
WORLD = 2
# Slow links make comm dominate these tiny graphs, so the pass reorders (and buckets) nearly all of them.
SLOW_LINKS = {"link_latency_us": 100.0}


def random_topological_order(graph, rng):
    """A uniformly drawn tie-break at each step of a topological sort of the pass's dependency graph."""
    deps = dependency_graph(graph)
    pending = {n: deps.in_degree(n) for n in deps}
    ready = [n for n in graph.nodes if pending[n] == 0]
    order = []
    while ready:
        n = ready.pop(rng.randrange(len(ready)))
        order.append(n)
        for s in deps.successors(n):
            pending[s] -= 1
            if pending[s] == 0:
                ready.append(s)
    placeholders = [n for n in order if n.op == "placeholder"]
    rest = [n for n in order if n.op not in ("placeholder", "output")]
    return placeholders + rest + [graph.output_node()]


def run(gm, inputs, seed):
    inputs = [t.clone() for t in inputs]
    torch.manual_seed(seed)  # the RNG draws see the same stream in every order
    outputs = gm(*inputs)
    return list(outputs) + inputs  # updated inputs are results too


def assert_same(got, want, what):
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        torch.testing.assert_close(g, w, rtol=0, atol=0, equal_nan=True, msg=lambda m: f"{what}, value {i}: {m}")


def worker(rank, store_path, first_seed):
    os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
    store = dist.FileStore(store_path, WORLD)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD)
    group = dist.group.WORLD.group_name
    reordered = bucketed = 0
    try:
        for seed in range(first_seed, first_seed + GRAPHS):
            program = random_program(seed, world_size=WORLD, group=group)
            inputs = program.example_inputs(seed, rank)
            want = run(program.trace(), inputs, seed)

            scheduled = program.trace()
            result = schedule_overlap(scheduled, SLOW_LINKS)
            reordered += result.strategy != "unchanged"
            bucketed += result.buckets
            assert_same(run(scheduled, inputs, seed), want, f"graph {seed} after the overlap pass ({result.strategy})")

            shuffled = program.trace()
            apply_order(shuffled.graph, random_topological_order(shuffled.graph, random.Random(seed)))
            shuffled.recompile()
            assert_same(run(shuffled, inputs, seed), want, f"graph {seed} in a random dependency order")
        # The test must exercise the pass, not only its "leave it alone" branch.
        assert reordered >= GRAPHS // 2, f"only {reordered} of {GRAPHS} graphs were reordered"
        assert bucketed > 0, "no graph was bucketed"
    finally:
        dist.destroy_process_group()


@pytest.mark.gloo
def test_reorder_and_bucketing_preserve_results_over_gloo(tmp_path):
    mp.spawn(worker, args=(str(tmp_path / "store"), 0), nprocs=WORLD, join=True)


def test_dependency_graph_is_acyclic_and_follows_the_original_order():
    for seed in range(20):
        gm = random_program(seed).trace()
        deps = dependency_graph(gm.graph)
        index = {n: i for i, n in enumerate(gm.graph.nodes)}
        assert nx.is_directed_acyclic_graph(deps)
        assert all(index[a] < index[b] for a, b in deps.edges)
