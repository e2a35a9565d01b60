"""Peak-aware reordering: lower peaks, same results, pinned nodes keep their order."""

import random

import torch
from hypothesis import given, settings, strategies as st
from torch.fx.experimental.proxy_tensor import make_fx

from npu_compile.passes.memory import graph_liveness
from npu_compile.passes.reorder import is_pinned, lpmf_order, reorder_for_peak

N = 1024
B = 4 * N
never = lambda n: False  # noqa: E731


def trace(fn, *args):
    return make_fx(fn, tracing_mode="fake")(*args)


def two_branches(x):
    big1 = x.repeat(8)  # traced first: both big tensors live at once
    big2 = (x * 2).repeat(8)
    return big1.sum() + big2.sum()


def test_lpmf_finishes_one_branch_before_starting_the_next():
    gm = trace(two_branches, torch.randn(N))
    assert graph_liveness(gm.graph).peak >= 16 * B
    before, after = reorder_for_peak(gm, never)
    assert before >= 16 * B and after == 9 * B + 4  # x * 2 and big2, beside the first 0-dim sum
    assert graph_liveness(gm.graph).peak == after
    x = torch.randn(N)
    torch.testing.assert_close(gm(x), two_branches(x), rtol=0, atol=0)


def test_order_kept_when_it_cannot_improve():
    gm = trace(lambda x: (x * 2).sum(), torch.randn(N))
    code = gm.code
    assert reorder_for_peak(gm, never) == (graph_liveness(gm.graph).peak,) * 2
    assert gm.code == code


def test_random_ops_keep_their_relative_order():
    def f(x):
        a = torch.rand_like(x).repeat(8)
        b = torch.rand_like(x).repeat(8)
        return a.sum() + b.sum()

    gm = make_fx(f, tracing_mode="fake")(torch.randn(N))
    rand = [n for n in gm.graph.nodes if is_pinned(n)]
    assert len(rand) == 2
    order = lpmf_order(gm.graph, never)
    assert [n for n in order if n in rand] == rand


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 6), min_size=2, max_size=6), st.integers(0, 2**16))
def test_random_branchy_graphs_same_result_never_higher_peak(widths, seed):
    def f(x):
        outs = [(x + i).repeat(w) for i, w in enumerate(widths)]  # all materialized before any reduction
        return sum(o.sum() * (i + 1) for i, o in enumerate(outs))

    x = torch.randn(64, generator=torch.Generator().manual_seed(seed))
    gm = make_fx(f)(x)
    expected = gm(x)
    before, after = reorder_for_peak(gm, never)
    assert after <= before
    assert torch.equal(gm(x), expected)


def _rescoring_order(graph: torch.fx.Graph, dies_inside) -> list[torch.fx.Node]:
    """The greedy rule spelled directly: every ready node rescored at every step (quadratic), the reference the
    incremental ``lpmf_order`` must reproduce node for node."""
    from torch._inductor.fx_passes.memory_estimator import GraphAliasTracker
    from torch.fx.experimental.symbolic_shapes import optimization_hint

    from npu_compile.passes.memory import in_host_memory

    nodes = list(graph.nodes)
    alias = GraphAliasTracker(nodes)
    steps = [n for n in nodes if n.op not in ("placeholder", "get_attr", "output")]
    index = {n: i for i, n in enumerate(steps)}
    (output,) = graph.find_nodes(op="output")
    outputs = alias.get_storage_uses(output)
    preds = {n: {m for m in n.all_input_nodes if m in index} for n in steps}
    pinned = [n for n in steps if is_pinned(n)]
    for a, b in zip(pinned, pinned[1:]):
        preds[b].add(a)
    size, releasable = {}, set()
    for n in nodes:
        for key in alias.get_fresh_allocations(n):
            size[key] = 0 if in_host_memory(n) else optimization_hint(key.storage.nbytes(), fallback=0)
            if (n in index or (n.op == "placeholder" and dies_inside(n))) and key not in outputs:
                releasable.add(key)
    remaining = {key: len([u for u in alias.storage_to_uses[key] if u in index]) for key in size}
    live = sum(size[k] for n in nodes if n.op == "placeholder" and dies_inside(n) for k in alias.get_fresh_allocations(n))
    peak = live

    def frees(n):
        uses = alias.get_storage_uses(n)
        out = [k for k in uses if k in releasable and remaining[k] == 1]
        return out + [k for k in alias.get_fresh_allocations(n) if k in releasable and remaining[k] == 0 and k not in uses]

    order, done = [], set()
    while len(order) < len(steps):
        ready = [n for n in steps if n not in done and preds[n] <= done]
        scored = []
        for n in ready:
            during = live + sum(size[k] for k in alias.get_fresh_allocations(n))
            scored.append((n, during, during - sum(size[k] for k in frees(n))))
        fits = [s for s in scored if s[1] <= peak]
        n, during, after = (
            min(fits, key=lambda s: (s[2], index[s[0]])) if fits else min(scored, key=lambda s: (s[1], index[s[0]]))
        )
        for k in alias.get_storage_uses(n):
            remaining[k] -= 1
        live, peak = after, max(peak, during)
        order.append(n)
        done.add(n)
    return order


def _random_dag(seed: int):
    """A random graph of big and small allocations, views, reductions, in-place updates and random ops, each op
    reading any earlier value; the last three values are its outputs (make_fx keeps the others' nodes)."""
    pick = random.Random(seed).randrange

    def f(x, y):
        vals = [x, y]
        for _ in range(6 + pick(14)):
            a = vals[pick(len(vals))]
            kind = pick(7)
            if kind == 0:
                vals.append(a.repeat(1 + pick(6))[: a.numel()].reshape(a.shape) * 2)  # a big temporary, then small
            elif kind == 1:
                vals.append(a.view(-1)[: a.numel()].view(a.shape))  # views share the storage
            elif kind == 2:
                vals.append(a.sum() + vals[pick(len(vals))].mean())
            elif kind == 3:
                vals.append(torch.rand_like(a) + a)  # pinned: random ops keep their order
            elif kind == 4:
                vals.append(a.clone().add_(1))  # a mutation on a fresh value
            else:
                b = vals[pick(len(vals))]
                vals.append(a * b if a.shape == b.shape else a + b.sum())
        return tuple(vals[2:])[-3:]

    return make_fx(f, tracing_mode="fake")(torch.randn(N), torch.randn(N))


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**16), st.booleans())
def test_incremental_order_equals_rescoring_every_step(seed, inputs_die):
    gm = _random_dag(seed)
    dies = (lambda n: True) if inputs_die else never
    expected = _rescoring_order(gm.graph, dies)
    assert lpmf_order(gm.graph, dies) == expected


def test_incremental_order_equals_rescoring_on_a_transformer_layers_training_graphs():
    """The forward and backward of a transformer layer as aot_autograd partitions them (saved activations die in
    the backward): the same order as rescoring every ready node, hence the same planned peak."""
    from functorch.compile import min_cut_rematerialization_partition
    from torch._functorch.aot_autograd import aot_module

    from npu_compile.passes.memory import is_saved_activation

    graphs = {}

    def keep(kind):
        def compiler(gm, _):
            graphs[kind] = gm
            return gm
        return compiler

    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
    aot_module(layer, keep("fw"), keep("bw"), partition_fn=min_cut_rematerialization_partition)(
        torch.randn(2, 16, 32)).sum().backward()
    for kind, dies in (("fw", never), ("bw", is_saved_activation)):
        graph = graphs[kind].graph
        order = lpmf_order(graph, dies)
        assert order == _rescoring_order(graph, dies)
        assert len(order) > 40
    gm = graphs["bw"]
    peak_before = graph_liveness(gm.graph, is_saved_activation).peak
    before, after = reorder_for_peak(gm, is_saved_activation)
    assert before == peak_before and after <= before
