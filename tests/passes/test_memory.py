"""Liveness estimate: exact bytes on graphs small enough to count by hand."""

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from npu_compile.passes.memory import (
    Buffer,
    arena,
    graph_liveness,
    liveness,
    saved_activation_bytes,
    training_buffers,
    training_liveness,
)

N = 1024  # elements; fp32 → 4 KiB per full tensor
B = 4 * N


def trace(fn, *args):
    return make_fx(fn, tracing_mode="fake")(*args)


def test_chain_frees_after_last_use_and_counts_views_once():
    def f(a):
        b = a * 2  # B
        c = b.view(32, 32)  # alias of b: no new bytes
        d = c + 1  # B; b/c die here
        e = d * 3  # B; d dies here
        return e

    live = graph_liveness(trace(f, torch.randn(N)).graph)
    assert live.peak == 2 * B
    assert live.curve == [B, B, 2 * B, 2 * B]  # mul, view, add, mul (after each node's allocation)
    assert {t.bytes for t in live.at_peak} == {B}


def test_outputs_stay_live_to_the_end():
    def f(a):
        b = a * 2
        c = a + 1  # b still live (it is an output)
        d = c * 2
        return b, d

    live = graph_liveness(trace(f, torch.randn(N)).graph)
    assert live.peak == 3 * B  # b (output), c, d at d's allocation
    assert live.curve[-1] == 3 * B


def test_inputs_counted_only_when_they_die_inside():
    g = trace(lambda a, b: (a * b).sum(), torch.randn(N), torch.randn(N)).graph
    assert graph_liveness(g).peak == B + 4  # a*b, then the 0-dim sum allocated before a*b is released
    # both inputs live at entry (2B), plus a*b (B); the sum's 4 bytes come after a and b are freed
    assert graph_liveness(g, dies_inside=lambda n: True).peak == 3 * B


def test_peak_names_the_tensors_that_make_it():
    def f(a):
        big = a.repeat(8)  # 8B
        return big.sum() + a.sum()

    live = graph_liveness(trace(f, torch.randn(N)).graph)
    assert live.peak == 8 * B + 4  # big, and its 0-dim sum allocated before big is released
    top = live.at_peak[0]
    assert (top.name, top.op, top.shape, top.dtype, top.bytes) == ("repeat", "aten.repeat.default", (8 * N,), "float32", 8 * B)
    assert live.peak_step == 1  # the first sum, while `big` is still live


def test_training_liveness_carries_saved_activations_across_the_boundary():
    from functorch.compile import default_partition
    from torch._functorch.aot_autograd import aot_function

    graphs = {}

    def keep(name):
        def compiler(gm, _):
            graphs[name] = gm
            return gm

        return compiler

    def f(w, x):
        h = (x @ w).relu()  # [64, 64]: saved for the backward
        return (h @ w).sum()

    w, x = torch.randn(64, 64, requires_grad=True), torch.randn(64, 64)
    aot_function(f, keep("fw"), keep("bw"), partition_fn=default_partition)(w, x).backward()
    bw_saved = saved_activation_bytes(graphs["bw"].graph)
    assert bw_saved >= 64 * 64 * 4
    live = training_liveness(graphs["fw"].graph, graphs["bw"].graph)
    assert live.peak >= bw_saved
    assert len(live.curve) == sum(1 for g in graphs.values() for n in g.graph.nodes if n.op == "call_function")
    # each saved activation is ONE buffer spanning the boundary, not one per graph
    buffers, n = training_buffers(graphs["fw"].graph, graphs["bw"].graph)
    n_fw = sum(1 for node in graphs["fw"].graph.nodes if node.op == "call_function")
    spanning = [b for b in buffers if b.start < n_fw <= b.end]
    assert sum(b.bytes for b in spanning) == bw_saved
    assert not any(b.op == "input" for b in buffers)


def test_arena_reaches_the_bound_on_disjoint_lifetimes_and_never_goes_below():
    bufs = [Buffer(f"b{i}", "op", (), "float32", size, start, end)
            for i, (size, start, end) in enumerate([(100, 0, 1), (50, 1, 2), (100, 2, 3), (70, 3, 4), (30, 0, 4)])]
    offsets, size = arena(bufs)
    peak = liveness(bufs, 5).peak
    assert peak == 200  # b2 + b3 + b4 at step 3
    assert size >= peak
    for i, a in enumerate(bufs):  # no two buffers live at once share bytes
        for j, b in enumerate(bufs[:i]):
            if a.start <= b.end and b.start <= a.end:
                assert offsets[i] + a.bytes <= offsets[j] or offsets[j] + b.bytes <= offsets[i]
    assert size == peak  # the two 100-byte buffers share one slot, the rest fits beside them
