"""Liveness estimate: exact bytes on graphs small enough to count by hand."""

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import npu_compile.ops  # noqa: F401  (the fused ops)

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



def _arena_rescanning(buffers):
    """The arena as first written: every placement collects the buffers placed so far that overlap it in time and
    sorts them by offset (quadratic with a large constant); the reference the sorted-placement arena must equal."""
    order = sorted(range(len(buffers)), key=lambda i: (-buffers[i].bytes, buffers[i].start))
    placed, offsets, size = [], {}, 0
    for i in order:
        b = buffers[i]
        busy = sorted((offsets[j], offsets[j] + buffers[j].bytes) for j in placed
                      if buffers[j].start <= b.end and b.start <= buffers[j].end)
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


@pytest.mark.parametrize("seed", range(6))
def test_arena_places_every_buffer_where_the_rescanning_arena_does(seed):
    # few distinct sizes and steps: ties in size, start and offset, touching gaps, zero-byte buffers
    g = torch.Generator().manual_seed(seed)
    n, steps = 150 + 50 * seed, 40

    def draw(high: int) -> int:
        return int(torch.randint(0, high, (), generator=g))

    bufs = []
    for i in range(n):
        start = draw(steps)
        end = min(steps - 1, start + (draw(steps) if draw(4) == 0 else draw(4)))  # a few long-lived ones
        bufs.append(Buffer(f"b{i}", "op", (), "float32", 64 * draw(6), start, end))
    assert arena(bufs) == _arena_rescanning(bufs)

# ==== aliasing: views, in-place updates of inputs, outputs that alias inputs ==================================

def test_in_place_update_of_an_input_allocates_nothing():
    def f(a):
        a.mul_(2)  # writes the caller's storage
        b = a.view(32, 32)  # and a view of it
        return b.t()  # an output aliasing the input

    live = graph_liveness(trace(f, torch.randn(N)).graph)
    assert live.peak == 0 and live.at_peak == []


def test_output_aliasing_an_input_beside_a_fresh_output():
    def f(a):
        return a.t(), a * 2, a[:5]

    live = graph_liveness(trace(f, torch.randn(32, 32)).graph)
    assert live.peak == B  # only a * 2
    assert [t.op for t in live.at_peak] == ["aten.mul.Tensor"]


def test_a_view_keeps_its_base_alive_to_the_views_last_use():
    def f(a):
        big = a * 2  # B
        first = big[:1]  # view: keeps all of big's storage
        other = a + 1  # B, while big is still live through `first`
        return (first * other[:1]).sum()

    live = graph_liveness(trace(f, torch.randn(N)).graph)
    assert live.peak == 2 * B + 4  # big + other + the [1] product (4 bytes) at the multiply


def test_compiled_in_place_input_update_planned_and_equal_to_eager():
    from npu_compile.debug.report import collect

    def f(x, y):
        x.add_(1)  # stays a mutation of the input (keep_inference_input_mutations)
        return x.view(-1)[:8], y * x

    x, y = torch.randn(N), torch.randn(N)
    x_eager, x_comp = x.clone(), x.clone()
    expected = f(x_eager, y)
    with collect() as reports, torch.no_grad():
        got = torch.compile(f, backend="ascend")(x_comp, y)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    torch.testing.assert_close(x_comp, x_eager, rtol=0, atol=0)
    assert got[0].data_ptr() == x_comp.data_ptr()  # the output aliases the caller's tensor
    (report,) = reports
    # fresh bytes: x + 1 (functional, then copied into the caller's storage) and y * x; nothing for the views
    assert report.memory["lower_bound_bytes"] == 2 * B
    assert {t["name"] for t in report.memory["peak_tensors"]} == {"add", "mul"}


# ==== kernel scratch: planned from the fused ops' own kernels, against the allocator ===========================

def _measured_scratch(fn):
    """Peak CPU bytes allocated while ``fn`` runs, minus what it returns (the profiler's memory events)."""
    from bench.harness import peak_bytes

    out = {}
    peak = peak_bytes(lambda: out.setdefault("value", fn()))
    leaves = torch.utils._pytree.tree_leaves(out["value"])
    return peak - sum(t.untyped_storage().nbytes() for t in leaves if isinstance(t, torch.Tensor))


def _scratch_cases():
    ops = torch.ops.npu_compile
    s, b, n, d = 384, 2, 4, 32  # two query tiles
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(s, b, n, 3 * d, generator=g)
    q, k, v = qkv.split(d, dim=-1)
    out, smax, ssum = ops.fused_attention(q, k, v, layout="sbnd", causal=True)
    x, bias, gy = torch.randn(s, b, 256, generator=g), torch.randn(256, generator=g), torch.randn(s, b, 256, generator=g)
    h, w = torch.randn(s, b, 64, generator=g), torch.randn(64, generator=g)
    return {
        "fused_attention": (ops.fused_attention, (q, k, v), dict(layout="sbnd", causal=True)),
        "fused_attention_backward": (ops.fused_attention_backward, (out, q, k, v, out, smax, ssum),
                                     dict(layout="sbnd", causal=True)),
        # the same calls once more, on torch's flash kernel (attention.FAST_PATH): scratch is the output's copy
        # into its layout, no tiles
        "fused_attention_fast": (ops.fused_attention, (q, k, v), dict(layout="sbnd", causal=True)),
        "fused_attention_backward_fast": (ops.fused_attention_backward, (out, q, k, v, out, smax, ssum),
                                          dict(layout="sbnd", causal=True)),
        "bias_gelu": (ops.bias_gelu, (x, bias, "tanh"), {}),
        "bias_gelu_backward": (ops.bias_gelu_backward, (gy, x, bias, "tanh", True), {}),
        "swiglu_backward": (ops.swiglu_backward, (gy[..., :128], x), {}),
        "add_layer_norm": (ops.add_layer_norm, (h, h, w, w), {}),
    }



@pytest.mark.parametrize("op", ["fused_attention", "fused_attention_backward", "fused_attention_fast",
                                "fused_attention_backward_fast", "bias_gelu", "bias_gelu_backward",
                                "swiglu_backward", "add_layer_norm"])
def test_planned_kernel_scratch_equals_the_allocators(op, monkeypatch):
    from npu_compile.ops import attention
    from npu_compile.passes import memory
    from npu_compile.passes.memory import workspace_bytes

    # The attention cases without _fast measure the tiled kernels (calls with dropout take them); the
    # estimates are memoised per signature, which the two kinds of case share.
    monkeypatch.setattr(attention, "FAST_PATH", op.endswith("_fast"))
    monkeypatch.setattr(memory, "_SCRATCH", {})

    fn, args, kwargs = _scratch_cases()[op]
    gm = make_fx(lambda *a: fn(*a, **kwargs), tracing_mode="fake")(*args)
    (node,) = [n for n in gm.graph.nodes if getattr(n.target, "namespace", None) == "npu_compile"]
    planned = workspace_bytes(node)
    measured = _measured_scratch(lambda: fn(*args, **kwargs))
    # equal but for eager's 0-dim tensors wrapping Python scalars (4 bytes each, a handful per kernel)
    assert abs(planned - measured) <= 32, f"{op}: planned {planned} B of scratch, the allocator saw {measured} B"
    if op.startswith("fused_attention") and not op.endswith("_fast"):  # one (forward) or two (backward) fp32 tiles of 256 rows × 384 keys
        tile = 2 * 4 * 256 * 384 * 4
        assert (2 if op.endswith("backward") else 1) * tile <= planned < (2 if op.endswith("backward") else 1) * tile * 1.2


def test_scratch_counts_in_the_liveness_at_its_step():
    x, bias = torch.randn(64, 256), torch.randn(256)
    gm = trace(lambda x, b: torch.ops.npu_compile.bias_gelu(x, b, "none") * 2, x, bias)
    live = graph_liveness(gm.graph)
    # at bias_gelu: its output, and x + bias (its scratch, freed inside the kernel); then the output and * 2
    size = 64 * 256 * 4
    assert live.curve == [2 * size, 2 * size]
    assert live.peak_step == 0
    assert {(b.name, b.bytes) for b in live.at_peak} == {("bias_gelu", size), ("bias_gelu:workspace", size)}


def test_a_view_of_a_rewritten_node_is_no_allocation():
    """A rewrite gives ``b`` a new value (new fake storage) while the view read from it keeps the old one: the view
    must still count as an alias of ``b``, not as a fresh allocation."""
    from npu_compile.passes.memory import realias_views

    def f(a):
        b = a * 2  # B
        c = b.view(32, 32)  # alias of b
        return c.sum()

    gm = trace(f, torch.randn(N))
    mul = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.mul.Tensor)
    old = mul.meta["val"]
    with old.fake_mode:
        mul.meta["val"] = torch.empty_like(old)  # what a replacement's fresh tracing leaves behind
    view = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.view.default)
    assert view.meta["val"].untyped_storage()._cdata != mul.meta["val"].untyped_storage()._cdata
    assert realias_views(gm.graph) == 1
    assert view.meta["val"].untyped_storage()._cdata == mul.meta["val"].untyped_storage()._cdata
    assert realias_views(gm.graph) == 0
    live = graph_liveness(gm.graph)
    assert live.peak == B + 4 and [t.name for t in live.at_peak] == ["mul", "sum_1"]


def test_alias_tracker_memo_follows_a_new_value():
    """AliasTracker memoises a node's output storages per value: a rewrite that gives the node a new value (a new
    storage) is seen by the next tracker, as torch's own GraphAliasTracker sees it."""
    from torch._inductor.fx_passes.memory_estimator import GraphAliasTracker

    from npu_compile.passes.memory import AliasTracker

    gm = trace(lambda a: (a * 2).view(32, 32) + 1, torch.randn(N))
    nodes = list(gm.graph.nodes)
    mul = next(n for n in nodes if n.target is torch.ops.aten.mul.Tensor)
    assert AliasTracker(nodes).node_to_output_storages == GraphAliasTracker(nodes).node_to_output_storages
    old = mul.meta["val"]
    with old.fake_mode:
        mul.meta["val"] = torch.empty_like(old)
    ours, torchs = AliasTracker(nodes), GraphAliasTracker(nodes)
    assert ours.node_to_output_storages == torchs.node_to_output_storages
    (key,) = ours.node_to_output_storages[mul]
    assert key.storage._cdata == mul.meta["val"].untyped_storage()._cdata != old.untyped_storage()._cdata


def test_buffers_found_again_when_anything_they_depend_on_changes(monkeypatch):
    """graph_buffers keeps its analysis on the graph: asked again of the same state it does not analyse again, and
    each thing the storages and lifetimes depend on (order, a value, an argument, the host mark, dies_inside) found
    changed gives the figures a fresh analysis (of a copy) gives."""
    import copy

    from npu_compile.passes import memory

    def f(a):
        b = a * 2
        c = a + 1
        d = c * 3
        return (b + d).sum()

    g = trace(f, torch.randn(N)).graph
    analysed = []
    real = memory._storage_buffers
    monkeypatch.setattr(memory, "_storage_buffers", lambda graph, d: analysed.append(graph) or real(graph, d))

    def check(dies_inside=memory.nothing_dies_inside):
        ours = graph_liveness(g, dies_inside)
        fresh = graph_liveness(copy.deepcopy(g), dies_inside)
        assert (ours.curve, [(b.name, b.bytes) for b in ours.at_peak]) == \
            (fresh.curve, [(b.name, b.bytes) for b in fresh.at_peak])
        return ours.curve

    curves = [check()]
    assert analysed.count(g) == 1
    assert check() == curves[-1] and analysed.count(g) == 1  # the same state: nothing analysed again

    a, mul, add, mul_1 = list(g.nodes)[:4]
    mul_1.append(mul)  # the order: b allocated after d, when c is gone
    curves.append(check())
    with mul.meta["val"].fake_mode:  # a value: b four times larger
        mul.meta["val"] = torch.empty(4 * N)
    curves.append(check())
    mul_1.args = (a, 3)  # an argument: d from the input, c read by nothing (freed where it is made)
    curves.append(check())
    mul.meta["npu_compile_host"] = True  # in host memory: no device bytes
    curves.append(check())
    curves.append(check(lambda n: True))  # dies_inside: the input counted too
    assert all(x != y for x, y in zip(curves, curves[1:])), curves
    assert analysed.count(g) == len(curves)
