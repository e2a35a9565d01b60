"""Nested compile regions (torch.compiler.nested_compile_region) under backend="ascend": a plain torch model whose
layers share a class, marked once, has its layers traced, fused, lowered and planned once and run at every call."""

import operator

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from npu_compile import backend, cache, regions
from npu_compile.config import resolve
from npu_compile.debug.report import collect
from npu_compile.executor import boxed_executor

HIDDEN, HEADS, LAYERS = 32, 4, 3


class Layer(nn.Module):
    """Pre-norm attention + GeLU MLP: SDPA attention, the residual add into the second norm and the bias-GeLU
    are fusion sites inside the layer."""

    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(HIDDEN), nn.LayerNorm(HIDDEN)
        self.qkv, self.proj = nn.Linear(HIDDEN, 3 * HIDDEN), nn.Linear(HIDDEN, HIDDEN)
        self.fc1, self.fc2 = nn.Linear(HIDDEN, 4 * HIDDEN), nn.Linear(4 * HIDDEN, HIDDEN)

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, HEADS, h // HEADS).permute(2, 0, 3, 1, 4)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, h))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class RegionLayer(Layer):
    forward = torch.compiler.nested_compile_region(Layer.forward)  # the one line a plain model needs


class Model(nn.Module):
    def __init__(self, layer):
        super().__init__()
        self.embed = nn.Embedding(64, HIDDEN)
        self.layers = nn.ModuleList(layer() for _ in range(LAYERS))
        self.norm = nn.LayerNorm(HIDDEN)

    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.norm(x).square().mean()


def _model(layer, seed=0):
    torch.manual_seed(seed)
    return Model(layer)


def _step(model, module):
    loss = model(torch.arange(48).remainder(64).view(2, 24))
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in module.named_parameters()}


@pytest.fixture
def fresh():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("target", ["reference", "npu-sim"])
def test_a_marked_layer_compiles_once_and_trains_as_eager(fresh, target, tmp_path):
    eager = _model(RegionLayer)
    expected = _step(eager, eager)
    model = _model(RegionLayer)
    with collect() as reports:
        got = _step(torch.compile(model, backend="ascend", options={"target": target, "cache": False,
                                                                     "dump_dir": str(tmp_path)}), model)

    torch.testing.assert_close(got[0], expected[0], rtol=1e-5, atol=1e-6)
    for n, g in expected[1].items():
        torch.testing.assert_close(got[1][n], g, rtol=1e-5, atol=1e-6, msg=lambda m: f"grad of {n}: {m}")
    (report,) = reports
    ((name, region),) = report.regions.items()
    assert region == {"fusions": {"attention": 1, "add_layer_norm": 1, "bias_gelu": 1}, "calls": LAYERS}
    assert {k: report.fusions[k] for k in region["fusions"]} == {k: LAYERS for k in region["fusions"]}
    # the region's graphs were lowered for the target once, and every call runs the lowered ops
    fused = "npu.npu_fusion_attention" if target == "npu-sim" else "npu_compile.fused_attention"
    assert report.lowered_ops[fused] == LAYERS
    assert report.lowered_ops["higher_order.invoke_subgraph"] == 2 * LAYERS
    assert "npu_compile.fused_attention" not in report.lowered_ops or target == "reference"
    # what holds the peak is named alike in every process: a region call by its region, never by an address
    peak_ops = {t["op"] for r in reports for t in r.memory.get("peak_tensors", [])}
    assert f"region {name}" in peak_ops and not any(" at 0x" in op for op in peak_ops), peak_ops
    lowered = sorted((tmp_path / "0_0" / "regions").glob("*_lowered_*"))
    assert [p.name.split("_", 1)[1] for p in lowered] == [
        f"{name}_forward_lowered_{target}.py", f"{name}_backward_lowered_{target}.py"]


def test_the_memory_plan_sees_inside_the_region(fresh):
    """A region call is one step of its caller; the estimate counts what the region holds inside (its live-bytes
    peak beyond its outputs) at that step, so the regions' plan comes near the inlined layers' (measured: 0.90 of it)."""
    peaks = {}
    for layer in (Layer, RegionLayer):
        torch._dynamo.reset()
        model = _model(layer)
        with collect() as reports:
            _step(torch.compile(model, backend="ascend", options={"cache": False}), model)
        (report,) = reports
        peaks[layer.__name__] = report.memory["lower_bound_bytes"]
    assert peaks["RegionLayer"] >= 0.85 * peaks["Layer"], peaks  # 0.75 with a call counted as its outputs only


def test_each_calls_outputs_are_laid_out_as_the_subgraph_has_them(fresh, monkeypatch):
    """aot_autograd's values for a region call's outputs need not share storage where the subgraph's do (a layer's
    q, k and v, views of one projection, came as three storages each the size of its view's extent, the plan
    1.5-1.7x the measured peak of this model); the estimate lays each call's outputs out as the subgraph has them,
    one storage per call for the outputs that share one there. And a parameter a call returns for its backward is
    the caller's memory, not a saved activation."""
    from npu_compile.debug import report as report_mod
    from npu_compile.passes import memory

    graphs = {}
    done = report_mod.Recorder.graph_done
    monkeypatch.setattr(report_mod.Recorder, "graph_done", lambda self, kind, gm: graphs.setdefault(kind, gm) and
                        done(self, kind, gm))
    model = _model(RegionLayer)
    _step(torch.compile(model, backend="ascend", options={"cache": False}), model)
    fw, bw = graphs["forward"], graphs["backward"]
    memory.unshare_region_outputs(fw.graph)
    calls = [n for n in fw.graph.nodes if regions.subgraph(n) is not None]
    assert len(calls) == LAYERS
    layout = memory._output_layout(regions.subgraph(calls[0]))
    numbers = [number for number, *_ in layout.values()]
    assert len(set(numbers)) < len(numbers)  # some outputs share a storage in the subgraph (q, k, v)
    per_call = []
    for call in calls:
        storages = {}
        for i, (number, nbytes, *_) in layout.items():
            st = call.meta["val"][i].untyped_storage()
            assert storages.setdefault(number, st._cdata) == st._cdata and st.nbytes() == nbytes
        assert len(set(storages.values())) == len(storages)  # apart in the subgraph, apart here
        per_call.append(set(storages.values()))
    assert not set.intersection(*per_call)  # no call's outputs read as another's

    t = memory.training_memory(fw.graph, bw.graph)
    inputs = {n.meta["val"].untyped_storage()._cdata for n in fw.graph.find_nodes(op="placeholder")
              if isinstance(n.meta.get("val"), torch.Tensor)}
    on_inputs = [n for n in bw.graph.find_nodes(op="placeholder") if memory.is_saved_activation(n)
                 and n.meta["val"].untyped_storage()._cdata in inputs]
    assert on_inputs  # the parameters the calls return for their backward
    saved = {n.meta["val"].untyped_storage()._cdata: n.meta["val"].untyped_storage().nbytes()
             for n in bw.graph.find_nodes(op="placeholder") if memory.is_saved_activation(n) and n not in on_inputs}
    assert t.saved_bytes == sum(saved.values())


def _caller_of(sub: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A graph that calls ``sub`` twice through invoke_subgraph, as Dynamo writes a region's calls."""
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    attr = graph.get_attr("subgraph_0")
    first = graph.call_function(torch.ops.higher_order.invoke_subgraph, (attr, "subgraph_0", x))
    y = graph.call_function(operator.getitem, (first, 0))
    second = graph.call_function(torch.ops.higher_order.invoke_subgraph, (attr, "subgraph_0", y))
    graph.output((graph.call_function(operator.getitem, (second, 0)),))
    root = nn.Module()
    root.subgraph_0 = sub
    return torch.fx.GraphModule(root, graph)


def _sub(fn) -> torch.fx.GraphModule:
    return torch.fx.symbolic_trace(lambda x: (fn(x),))


def test_the_executor_runs_the_region_subgraph_at_each_call():
    gm = _caller_of(_sub(lambda x: x * 2 + 1))
    run = boxed_executor(gm)
    assert [n.target for n in gm.graph.nodes if n.op == "call_function"].count(regions.call_region) == 2
    assert not gm.graph.find_nodes(op="call_function", target=torch.ops.higher_order.invoke_subgraph)
    (out,) = run([torch.tensor([1.0, 2.0])])
    torch.testing.assert_close(out, torch.tensor([7.0, 11.0]))


def _region_call(graph: torch.fx.Graph, attr: str, *operands: torch.fx.Node) -> torch.fx.Node:
    call = graph.call_function(torch.ops.higher_order.invoke_subgraph, (graph.get_attr(attr), attr, *operands))
    return graph.call_function(operator.getitem, (call, 0))


def test_the_reference_executor_calls_the_kernels_inside_regions():
    """A region's fused ops run their Python kernels directly, as the calling graph's do (not through the
    custom-op dispatcher at every call of every layer), in a region inside a region too; the compiled subgraphs
    themselves are left as they were (they may be cached or dumped)."""
    from torch.profiler import ProfilerActivity, profile

    from npu_compile.lowering import reference

    gelu = torch.ops.npu_compile.bias_gelu.default
    inner = torch.fx.symbolic_trace(lambda x, b: (gelu(x, b),))
    graph = torch.fx.Graph()
    x, b = graph.placeholder("x"), graph.placeholder("b")
    graph.output((graph.call_function(gelu, (_region_call(graph, "inner", x, b), b)),))
    root = nn.Module()
    root.inner = inner
    outer = torch.fx.GraphModule(root, graph)  # a layer: a region calling a region, then a fused op of its own

    graph = torch.fx.Graph()
    x, b = graph.placeholder("x"), graph.placeholder("b")
    graph.output((_region_call(graph, "outer", _region_call(graph, "outer", x, b), b),))
    root = nn.Module()
    root.outer = outer
    run = reference.TARGET.executor(torch.fx.GraphModule(root, graph), [], None)
    for sub in (inner, outer):  # as compiled: the op, not its kernel
        assert len(sub.graph.find_nodes(op="call_function", target=gelu)) == 1

    x, bias = torch.randn(3, 2), torch.randn(2)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        (out,) = run([x, bias])
    ran = [e.name for e in prof.events()]
    assert "npu_compile::bias_gelu" not in ran and ran.count("aten::gelu") == 4, ran
    want = x
    for _ in range(4):
        want = F.gelu(want + bias)
    torch.testing.assert_close(out, want)


def test_a_cache_key_covers_the_regions_a_graph_calls():
    # the same calling graph around two different regions: its own code is the same, its key must not be
    opts = resolve({})

    def key(gm):
        return cache.graph_key("forward", gm, opts)

    doubled, squared = _caller_of(_sub(lambda x: x * 2)), _caller_of(_sub(lambda x: x * x))
    assert doubled.code == squared.code
    assert key(doubled) != key(squared)
    assert key(doubled) == key(_caller_of(_sub(lambda x: x * 2)))
    # a region loaded back from the cache is of another class (an unpickled GraphModule is a GraphModuleImpl): the
    # same graph, the same key
    reloaded = cache._decode(cache._encode({"gm": _sub(lambda x: x * 2)}), FakeTensorMode())["gm"]
    assert type(reloaded).__name__ == "GraphModuleImpl"
    assert key(_caller_of(reloaded)) == key(doubled)


def test_a_second_compile_in_the_process_hits_the_cache_at_every_step(fresh, tmp_path, monkeypatch):
    # the region's partition comes back from the cache at the second compile, and the outer graph's key must not
    # depend on that (its region subgraphs are then GraphModuleImpl): every step a hit, the same numbers
    monkeypatch.setenv("NPU_COMPILE_CACHE_DIR", str(tmp_path))
    steps = []
    for _ in range(2):
        torch._dynamo.reset()
        model = _model(RegionLayer)
        with collect() as reports:
            steps.append(_step(torch.compile(model, backend="ascend", options={"cache": True}), model))
        (r,) = reports
    assert r.cache == {"region_partition": "hit", "partition": "hit", "forward": "hit", "backward": "hit"}
    torch.testing.assert_close(steps[1], steps[0], rtol=0, atol=0)


def test_each_region_calls_saved_activations_count_in_the_outer_forward(fresh, monkeypatch):
    """aot_autograd gives every call of a region the first call's output FakeTensors; the estimate gives each call's
    own outputs storages of their own, so the outer forward holds every layer's saved activations to its end."""
    from npu_compile.passes.memory import _returned_inputs, graph_liveness

    graphs = []
    ordering = backend.reorder_for_peak

    def keep(gm, dies_inside):
        graphs.append(gm)
        return ordering(gm, dies_inside)

    monkeypatch.setattr(backend, "reorder_for_peak", keep)
    model = _model(RegionLayer)
    _step(torch.compile(model, backend="ascend", options={"cache": False}), model)
    (outer_fw,) = [gm for gm in graphs if len(regions.calls(gm)) and not any(
        n.op == "placeholder" and n.name.startswith("tangents") for n in gm.graph.nodes)]
    calls = [n for n in outer_fw.graph.nodes if regions.subgraph(n) is not None]
    assert len(calls) == LAYERS
    (output,) = outer_fw.graph.find_nodes(op="output")
    weights = _returned_inputs(regions.subgraph(calls[0]))  # the inputs a call hands the backward as they are
    assert weights
    saved = [[u for u in call.users if u in output.all_input_nodes and u.args[1] not in weights]
             for call in calls]  # the activations each call makes and hands the backward
    storages = [{u.meta["val"].untyped_storage()._cdata for u in us} for us in saved]
    assert all(storages) and not set.intersection(*storages)  # no call's activations read as another's
    distinct = {u.meta["val"].untyped_storage()._cdata: u.meta["val"].untyped_storage().nbytes()
                for us in saved for u in us}  # a call's q, k and v: views of one projection, one storage
    assert len(distinct) < sum(map(len, saved))
    assert graph_liveness(outer_fw.graph).peak >= sum(distinct.values())


def _schema_calls(monkeypatch) -> list[str]:
    """The identifiers invoke_subgraph's own gen_schema (the class's: what traces the region again) is called for."""
    from torch._higher_order_ops.invoke_subgraph import InvokeSubgraphHOP

    seen, generate = [], InvokeSubgraphHOP.gen_schema

    def counted(self, subgraph, identifier, *operands):
        seen.append(identifier)
        return generate(self, subgraph, identifier, *operands)

    monkeypatch.setattr(InvokeSubgraphHOP, "gen_schema", counted)
    return seen


def test_a_region_schema_is_worked_out_once_not_per_call(fresh, monkeypatch):
    """torch's autograd step asks invoke_subgraph for its schema at every call, tracing the region again each
    time (torch/_ops.py, maybe_run_autograd): within the backend's compile it is worked out once per region and
    operand kind, so the count does not grow with the calls; the memo leaves the HOP as it found it."""
    seen = _schema_calls(monkeypatch)
    counts = {}
    for layers in (2, 6):
        torch._dynamo.reset()
        seen.clear()
        model, eager = _model(RegionLayer), _model(RegionLayer)
        model.layers = nn.ModuleList(RegionLayer() for _ in range(layers))
        eager.layers = nn.ModuleList(RegionLayer() for _ in range(layers))
        eager.load_state_dict(model.state_dict())
        expected = _step(eager, eager)
        got = _step(torch.compile(model, backend="ascend", options={"cache": False}), model)

        torch.testing.assert_close(got[0], expected[0], rtol=1e-5, atol=1e-6)
        for n, g in expected[1].items():
            torch.testing.assert_close(got[1][n], g, rtol=1e-5, atol=1e-6, msg=lambda m: f"grad of {n}: {m}")
        counts[layers] = sorted(seen)
        assert "gen_schema" not in vars(torch.ops.higher_order.invoke_subgraph)
    # the captured region, then its forward and backward after the partition: each once, at 2 calls as at 6
    assert counts[2] == counts[6] and len(counts[6]) == len(set(counts[6])) == 3, counts


class MutatingLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(HIDDEN))
        self.register_buffer("steps", torch.zeros(()))

    @torch.compiler.nested_compile_region
    def forward(self, x):
        self.steps.add_(1)  # writes into a region input (the buffer): torch refuses it in training
        return x * self.scale


def test_a_region_writing_its_inputs_is_still_refused_with_torchs_error(fresh):
    """The memo keeps torch's check: the first call of each kind runs it, so a training region that writes into
    an input fails as torch makes it fail, and the HOP is left as it was after the failure."""
    model = nn.Sequential(MutatingLayer(), MutatingLayer())
    x = torch.randn(2, HIDDEN, requires_grad=True)
    with pytest.raises(Exception, match="invoke_subgraph HigherOrderOperator does not currently support training "
                                        "with in-place input or buffer mutations"):
        torch.compile(model, backend="ascend", options={"cache": False})(x).sum().backward()
    assert "gen_schema" not in vars(torch.ops.higher_order.invoke_subgraph)


def _count_ops_per_call(*graphs):
    """count_ops as first written: every call site walks its region again; the reference for the per-region walk."""
    from collections import Counter

    from npu_compile.debug.report import op_name

    counts = Counter()

    def walk(gm):
        for n in gm.graph.nodes:
            sub = regions.subgraph(n)
            if sub is not None:
                counts["higher_order.invoke_subgraph"] += 1
                walk(sub)
            elif (name := op_name(n)) is not None:
                counts[name] += 1

    for gm in graphs:
        walk(gm)
    return dict(counts.most_common())


def test_a_region_is_analysed_once_not_once_per_call(fresh, monkeypatch):
    """The outer graphs call one lowered subgraph LAYERS times: the memory estimate, the cost model and the op count
    look at it once per pass and give each call the same figures as walking it at every call would."""
    from npu_compile.comm import simulate
    from npu_compile.debug import report as report_mod
    from npu_compile.device import cost
    from npu_compile.passes import memory, recompute

    graphs = {}
    done = report_mod.Recorder.graph_done

    def keep(self, kind, gm):
        graphs[kind] = gm
        return done(self, kind, gm)

    monkeypatch.setattr(report_mod.Recorder, "graph_done", keep)
    model = _model(RegionLayer)
    _step(torch.compile(model, backend="ascend", options={"cache": False}), model)
    fw, bw = graphs["forward"], graphs["backward"]
    assert [len(regions.calls(g)) for g in (fw, bw)] == [1, 1]
    assert [sum(regions.calls(g).values()) for g in (fw, bw)] == [LAYERS, LAYERS]

    # op counts: equal to walking every call, key order (most common first, ties as met) included
    assert list(report_mod.count_ops(fw, bw).items()) == list(_count_ops_per_call(fw, bw).items())

    # the cost model: a region's time and FLOPs once per pass, equal to summing its nodes at every call
    summed = []
    node_us = cost.node_us
    monkeypatch.setattr(cost, "node_us", lambda n, *a, **k: summed.append(n) or node_us(n, *a, **k))
    for g in (fw, bw):
        summed.clear()
        got = simulate(g)
        inner = [n for n in summed if n.graph is not g.graph]
        assert inner and len(inner) == len(set(inner))  # each node of the region costed once, not LAYERS times
        assert got == simulate(g, cost_us=lambda n: node_us(n))  # no memo: every call summed again
        assert recompute.matrix_flops(g.graph) == sum(cost.flops(n) for n in g.graph.nodes if n.op == "call_function")

    # the memory estimate: a region's returned inputs and scratch once per graph, the same buffers as per call
    returned, scratch = [], []
    returned_inputs, region_scratch = memory._returned_inputs, memory._region_scratch
    monkeypatch.setattr(memory, "_returned_inputs", lambda sub: returned.append(sub) or returned_inputs(sub))
    monkeypatch.setattr(memory, "_region_scratch", lambda sub: scratch.append(sub) or region_scratch(sub))
    for g, dies in ((fw, lambda n: False), (bw, memory.is_saved_activation)):
        returned.clear(), scratch.clear()
        gb = memory.graph_buffers(g.graph, dies)
        assert len(returned) == len(scratch) == 1
        per_call = [(f"{n.name}:workspace", memory.workspace_bytes(n)) for n in gb.steps]  # each call asks again
        assert [(b.name, b.bytes) for b in gb.buffers if b.dtype == "scratch"] == [x for x in per_call if x[1]]
        calls = {f"{n.name}:workspace" for n in gb.steps if regions.subgraph(n) is not None}
        assert len(calls) == LAYERS and calls <= {b.name for b in gb.buffers}  # every call holds its scratch

    # the backward analysed once for the plan and the saved bytes: the same figures as analysing it twice
    t = memory.training_memory(fw.graph, bw.graph)
    assert (t.buffers, t.steps) == memory.training_buffers(fw.graph, bw.graph)
    assert t.saved_bytes == memory.saved_activation_bytes(bw.graph, fw.graph) > 0


def test_the_backward_reads_each_calls_saved_activations_as_its_own(fresh, monkeypatch):
    """The partitioner copies a saved node's FakeTensor into the backward before the forward is analysed, so every
    call's saved inputs read as the first call's; the training analysis gives them the forward's values, and the
    saved bytes grow by one layer's with each layer (report.json ``saved_activation_bytes``)."""
    saved = {}
    for layers in (2, 3, 4):
        torch._dynamo.reset()
        model = _model(RegionLayer)
        model.layers = nn.ModuleList(RegionLayer() for _ in range(layers))
        with collect() as reports:
            _step(torch.compile(model, backend="ascend", options={"cache": False}), model)
        (report,) = reports
        saved[layers] = report.memory["saved_activation_bytes"]
    assert saved[3] - saved[2] == saved[4] - saved[3] > 0, saved
