"""The rule engine: the README's worked example, switches, counts, unfused reasons, training and inference."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import npu_compile
from npu_compile import passes


# --- the README's worked example: a hand-written SiLU becomes aten.silu (whose backward is one op too) ---
def silu_pattern(x):
    return x * torch.sigmoid(x)


def silu_replacement(x):
    return torch.nn.functional.silu(x)


SILU = passes.Rule(
    name="handwritten_silu",
    pattern=silu_pattern,
    replacement=silu_replacement,
    example_inputs=lambda: [[torch.empty(8, 16, requires_grad=True)]],
    anchors=(torch.ops.aten.sigmoid.default,),
)


@pytest.fixture
def silu_rule():
    passes.register_rule(SILU)
    yield SILU
    passes.unregister_rule(SILU.name)


class Mlp(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(16, 16)

    def forward(self, x):
        h = self.fc(x)
        return h * torch.sigmoid(h)


def test_worked_example_fuses_forward_and_backward(silu_rule, tmp_path):
    m = Mlp()
    x = torch.randn(4, 16)
    exp = npu_compile.explain(m, x)
    (r,) = exp.graphs
    assert r.fusions["handwritten_silu"] == 1
    assert r.lowered_ops["aten.silu"] == 1 and r.lowered_ops["aten.silu_backward"] == 1
    assert "aten.sigmoid" not in r.lowered_ops and not [u for u in r.unfused if u["rule"] == "handwritten_silu"]
    # numerics: forward and grads against eager
    twin = Mlp()
    twin.load_state_dict(m.state_dict())
    cm = torch.compile(twin, backend="ascend")
    y0, y1 = m(x), cm(x)
    torch.testing.assert_close(y1, y0, rtol=1e-6, atol=1e-6)
    y0.sum().backward()
    y1.sum().backward()
    torch.testing.assert_close(twin.fc.weight.grad, m.fc.weight.grad, rtol=1e-5, atol=1e-6)


def test_worked_example_in_inference(silu_rule):
    with torch.no_grad():
        (r,) = npu_compile.explain(Mlp(), torch.randn(4, 16)).graphs
    assert r.graphs == ["inference"] and r.fusions["handwritten_silu"] == 1
    assert r.lowered_ops["aten.silu"] == 1


def test_switched_off_rule_reports_site_unfused(silu_rule):
    (r,) = npu_compile.explain(Mlp(), torch.randn(4, 16), options={"fusions": {"handwritten_silu": False}}).graphs
    assert "handwritten_silu" not in r.fusions
    assert [u for u in r.unfused if u["rule"] == "handwritten_silu"] == [
        {"op": "aten.sigmoid.default", "node": "sigmoid", "rule": "handwritten_silu",
         "reason": "rule 'handwritten_silu' is switched off by options['fusions']"}
    ]


def test_declined_match_reports_the_reason(silu_rule):
    passes.unregister_rule(SILU.name)
    passes.register_rule(
        passes.Rule(**{**SILU.__dict__, "extra_check": lambda match: "rows shorter than 32 stay unfused"})
    )
    (r,) = npu_compile.explain(Mlp(), torch.randn(4, 16)).graphs
    assert r.fusions["handwritten_silu"] == 0
    assert [u["reason"] for u in r.unfused if u["rule"] == "handwritten_silu"] == ["rows shorter than 32 stay unfused"]


def test_a_check_that_a_data_dependent_size_decides_declines_the_site(silu_rule):
    """An MoE expert's rows are a data-dependent size (an unbacked symbol): a rule's check that compares it
    cannot add a guard Dynamo would keep, so the site is declined with the reason; the compile goes on, and the
    graph (forward and backward, partitioned with the unbacked size) computes what eager does."""
    from npu_compile.passes.engine import stride_order

    passes.unregister_rule(SILU.name)
    passes.register_rule(passes.Rule(**{**SILU.__dict__, "extra_check": lambda match: bool(stride_order(
        match.output_nodes()[0].meta["val"]))}))

    def rows_of_positive_sum(x):
        h = x[x.sum(-1) > 0]  # data-dependent rows
        return (h * torch.sigmoid(h)).sum(0)

    x = torch.randn(8, 16)
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        (r,) = npu_compile.explain(rows_of_positive_sum, x.clone().requires_grad_(True)).graphs
        xc = x.clone().requires_grad_(True)
        out = torch.compile(rows_of_positive_sum, backend="ascend")(xc)
    assert r.fusions["handwritten_silu"] == 0 and r.graph_breaks == 0
    (site,) = [u for u in r.unfused if u["rule"] == "handwritten_silu"]
    assert site["reason"].startswith("a data-dependent size decides the check (Could not guard on data-dependent "
                                     "expression"), site["reason"]
    xe = x.clone().requires_grad_(True)
    torch.testing.assert_close(out, rows_of_positive_sum(xe))
    out.sum().backward()
    rows_of_positive_sum(xe).sum().backward()
    torch.testing.assert_close(xc.grad, xe.grad)


def test_unmatched_site_says_so(silu_rule):
    def f(x):
        return torch.sigmoid(x) + 1  # a sigmoid, but no x * sigmoid(x)

    (r,) = npu_compile.explain(f, torch.randn(4, 16, requires_grad=True)).graphs
    assert r.fusions["handwritten_silu"] == 0
    (site,) = [u for u in r.unfused if u["rule"] == "handwritten_silu"]
    assert site["reason"] == "no handwritten_silu pattern matched the ops around it"


def test_registration_is_lazy(silu_rule):
    from npu_compile.passes import engine

    assert (SILU.name, passes.TRAINING) not in engine._groups  # nothing traced at registration
    npu_compile.explain(Mlp(), torch.randn(4, 16))
    assert (SILU.name, passes.TRAINING) in engine._groups


# --- gradients a training graph may not want: grad_optional ---
def scaled_silu(x, p):
    return x * torch.sigmoid(x) * p  # p trains, x needs no grad: a training graph with no gradient for x


@pytest.mark.parametrize("optional, fused", [((), 0), (("x",), 1)])
def test_grad_optional_input_is_traced_without_grad_too(optional, fused):
    rule = passes.Rule(**{**SILU.__dict__, "name": "silu_grad_optional", "grad_optional": optional})
    passes.register_rule(rule)
    try:
        x, p = torch.randn(4, 16), torch.randn(16, requires_grad=True)
        (r,) = npu_compile.explain(scaled_silu, x, p, options={"fusions": [rule.name]}).graphs
    finally:
        passes.unregister_rule(rule.name)
    assert r.graphs == ["forward", "backward"] and r.fusions[rule.name] == fused
    assert ("aten.sigmoid" in r.lowered_ops) == (not fused)


def test_grad_variants_switch_off_each_subset_most_gradients_first():
    from npu_compile.passes.engine import grad_variants

    def pattern(x, residual, weight):
        return x + residual * weight

    example = [torch.empty(2, requires_grad=True), torch.empty(2, requires_grad=True), torch.empty(2)]
    variants = grad_variants(pattern, [example], ("x", "residual", "weight"))
    assert [[a.requires_grad for a in v] for v in variants] == [
        [True, True, False], [True, False, False], [False, True, False], [False, False, False]]
    assert [[a.requires_grad for a in v] for v in grad_variants(pattern, [example], ("x",), keep=("x",))] == [
        [True, True, False]]
    with pytest.raises(ValueError, match=r"grad_optional/shared_inputs name \['bias'\], which are not arguments "
                                         r"of pattern\('x', 'residual', 'weight'\)"):
        grad_variants(pattern, [example], ("bias",))


# --- a slice_backward that takes the whole dim is the identity ---
def test_full_slice_backward_is_folded_and_a_partial_one_kept():
    from torch.fx.experimental.proxy_tensor import make_fx

    from npu_compile.passes.engine import fold_full_slice_backwards

    aten = torch.ops.aten

    def f(g, h):
        full = aten.slice_backward(g, [4, 8], 0, 0, 2**63 - 1, 1)
        part = aten.slice_backward(h, [4, 8], 0, 1, 3, 1)
        return full * 2 + part, aten.slice_backward(g, [4, 8], 1, 0, 8, 1)  # the last: an output, g an input

    g, h = torch.randn(4, 8), torch.randn(2, 8)
    gm = make_fx(f)(g, h)
    fold_full_slice_backwards(gm.graph)
    gm.recompile()
    kept = [n.args[1:] for n in gm.graph.find_nodes(op="call_function", target=aten.slice_backward.default)]
    assert kept == [([4, 8], 0, 1, 3, 1), ([4, 8], 1, 0, 8, 1)]
    for got, want in zip(gm(g, h), f(g, h)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_rule_registered_twice_is_kept_once_and_comes_back_after_unregister():
    """Importing a rules module twice registers nothing new; after unregister_rule the same rule registers again
    (the set of registered patterns is a hint the rule list decides)."""
    from npu_compile.passes.engine import RULES

    try:
        passes.register_rule(SILU)
        passes.register_rule(SILU)
        assert RULES[SILU.name] == [SILU]
        passes.unregister_rule(SILU.name)
        assert SILU.name not in RULES
        passes.register_rule(SILU)
        assert RULES[SILU.name] == [SILU]
        RULES[SILU.name].clear()  # a list emptied by hand: the hint alone does not keep the rule out
        passes.register_rule(SILU)
        assert RULES[SILU.name] == [SILU]
    finally:
        passes.unregister_rule(SILU.name)


# --- torch's exact re-trace of each match, cached (engine.TraceCache) ---
def _counting_tracer(name="handwritten_silu", pattern=silu_pattern, trace_fn=None):
    """A TraceCache tracer around a trace function that counts its calls, and the call count."""
    from npu_compile.passes.engine import TraceCache, trace_training

    calls, cache = [], TraceCache()
    rule = passes.Rule(**{**SILU.__dict__, "name": name, "pattern": pattern})
    return cache, cache.tracer(rule, pattern, silu_replacement, _count_into(calls, trace_fn or trace_training)), calls


def _fake(mode, shape=(4, 8), stride=None, dtype=torch.float32, device="cpu", requires_grad=True, offset=0):
    with mode:
        storage = torch.empty_strided((64,), (1,), dtype=dtype, device=device)
        t = storage.as_strided(shape, stride or torch.empty(shape).stride(), offset)
        return t.detach().requires_grad_(requires_grad)


def test_a_match_retrace_is_cached_and_handed_out_as_a_copy():
    from npu_compile.passes.engine import decompositions

    cache, trace, calls = _counting_tracer()
    mode = FakeTensorMode()
    first = trace(silu_pattern, [_fake(mode)], get_decomp_fn=decompositions)
    again = trace(silu_pattern, [_fake(mode)], get_decomp_fn=decompositions)
    assert len(calls) == 1 and (cache.hits, cache.misses) == (1, 1)
    code = first.code
    assert again is not first and again.graph is not first.graph and again.code == code
    # each copy's values its own (the replacement carries them into the model graph, where a shared storage
    # would read as one buffer for two sites)
    storages = [{n.meta["val"].untyped_storage()._cdata for n in got.graph.nodes
                 if isinstance(n.meta.get("val"), torch.Tensor)} for got in (first, again)]
    assert storages[0] and not storages[0] & storages[1]
    for got in (first, again):  # torch renames the placeholders of the graph it gets
        next(iter(got.graph.nodes)).target = "renamed"
        got.recompile()
        assert trace(silu_pattern, [_fake(mode)], get_decomp_fn=decompositions).code == code
    # another compile's fake mode: the same graph, its values made anew under that mode
    other = FakeTensorMode()
    moved = trace(silu_pattern, [_fake(other)], get_decomp_fn=decompositions)
    assert len(calls) == 1 and moved.code == code
    vals = [n.meta["val"] for n in moved.graph.nodes if isinstance(n.meta.get("val"), torch.Tensor)]
    assert vals and all(v.fake_mode is other for v in vals)
    assert [(v.shape, v.stride(), v.dtype) for v in vals] == [
        (n.meta["val"].shape, n.meta["val"].stride(), n.meta["val"].dtype)
        for n in first.graph.nodes if isinstance(n.meta.get("val"), torch.Tensor)]


def _key_changes() -> dict:
    """Each field of a cache key changed alone, as overrides of the base call in the test below."""
    other_pattern = lambda x: x * torch.sigmoid(x)  # noqa: E731  (the same code, another function)
    return {
        "shape": dict(args=dict(shape=(2, 8))),  # the same strides
        "strides": dict(args=dict(stride=(1, 4))),
        "storage offset": dict(args=dict(offset=8)),
        "dtype": dict(args=dict(dtype=torch.float64)),
        "device": dict(args=dict(device="meta")),
        "requires_grad": dict(args=dict(requires_grad=False)),
        "a scalar's value": dict(scalar=0.25),
        "a scalar's type": dict(scalar=2),  # an int read from the graph, where the base call has 2.0
        "replacement, not pattern": dict(fn="replacement"),
        "grad mode": dict(grad=False),
        "functorch's rng switch": dict(rng=True),
        "decomposition table": dict(decomp=lambda: {}),
        "rule": dict(name="another_silu"),
        "pattern function": dict(pattern=other_pattern),
        "trace function (mode)": dict(trace_fn=_symbolic_trace_too),
    }


def _symbolic_trace(fn, args, *, get_decomp_fn):
    """A stand-in trace function (the key test counts calls; functorch's rng switch cannot trace on CPU)."""
    return torch.fx.symbolic_trace(fn)


def _symbolic_trace_too(fn, args, *, get_decomp_fn):
    """Another trace function, as the training and inference ones are."""
    return torch.fx.symbolic_trace(fn)


@pytest.mark.parametrize("field", list(_key_changes()))
def test_a_change_of_each_key_field_misses_the_cache(field):
    from npu_compile.passes.engine import TraceCache, decompositions

    cache, mode, calls = TraceCache(), FakeTensorMode(), []
    base = dict(args={}, scalar=2.0, fn="pattern", grad=True, rng=False, decomp=decompositions, name=SILU.name,
                pattern=silu_pattern, trace_fn=_symbolic_trace)
    counting = {}  # trace function -> the same, counting its calls (one object each, as a variant has)

    def call(args, scalar, fn, grad, rng, decomp, name, pattern, trace_fn):
        if trace_fn not in counting:
            counting[trace_fn] = _count_into(calls, trace_fn)
        rule = passes.Rule(**{**SILU.__dict__, "name": name, "pattern": pattern})
        trace = cache.tracer(rule, pattern, silu_replacement, counting[trace_fn])
        with torch.set_grad_enabled(grad), torch._functorch.config.patch(functionalize_rng_ops=rng):
            trace(pattern if fn == "pattern" else silu_replacement, [_fake(mode, **args), scalar], get_decomp_fn=decomp)

    call(**base)
    call(**base)
    assert (cache.hits, cache.misses, len(calls)) == (1, 1, 1)
    changed = {**base, **_key_changes()[field]}
    call(**changed)
    assert (cache.hits, cache.misses, len(calls)) == (1, 2, 2), f"a change of {field} hit the cache"
    call(**changed)
    assert (cache.hits, len(calls)) == (2, 2), f"the entry for the changed {field} was not kept"


def test_symbolic_sizes_hit_only_within_their_shape_environment():
    """``s0`` of one compile is not ``s0`` of another (and a trace may add guards to its own environment)."""
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from npu_compile.passes.engine import decompositions

    cache, trace, calls = _counting_tracer()

    a, b = _symbolic_fakes(ShapeEnv())
    trace(silu_pattern, [a], get_decomp_fn=decompositions)
    trace(silu_pattern, [b], get_decomp_fn=decompositions)
    assert (cache.hits, len(calls)) == (1, 1)
    (c,) = _symbolic_fakes(ShapeEnv(), 1)  # also named s0
    assert str(c.shape[0]) == str(a.shape[0])
    trace(silu_pattern, [c], get_decomp_fn=decompositions)
    assert (cache.hits, len(calls)) == (1, 2)


def _symbolic_fakes(env, n=2):
    """``n`` fake (s0, 8) tensors that need grad, ``s0`` one size of ``env`` with the hint 4."""
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import DimDynamic

    s0 = env.create_symintnode(env.create_symbol(4, ConstantSource("x"), dynamic_dim=DimDynamic.DYNAMIC), hint=4)
    with FakeTensorMode(shape_env=env):
        return [torch.empty_strided((s0, 8), (8, 1)).requires_grad_(True) for _ in range(n)]


def _count_into(calls, trace_fn):
    def counted(fn, args, *, get_decomp_fn):
        calls.append(fn)
        return trace_fn(fn, args, get_decomp_fn=get_decomp_fn)

    return counted


def test_an_argument_without_strides_is_traced_each_time():
    from npu_compile.passes.engine import decompositions, trace_training

    cache, trace, calls = _counting_tracer(trace_fn=lambda fn, args, get_decomp_fn: trace_training(
        fn, [a.to_dense() for a in args], get_decomp_fn=get_decomp_fn))
    sparse = torch.eye(4).to_sparse().requires_grad_(True)
    trace(silu_pattern, [sparse], get_decomp_fn=decompositions)
    trace(silu_pattern, [sparse], get_decomp_fn=decompositions)
    assert (cache.hits, cache.misses, len(calls)) == (0, 0, 2)


def test_layers_at_one_shape_trace_each_match_once_and_train_like_eager(silu_rule):
    """Two sites of one shape in a graph, compiled twice (another fake mode): the exact re-trace runs for the first
    site only; the fused graph still computes what eager does."""
    from npu_compile.passes.engine import TRACE_CACHE

    class TwoLayers(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = Mlp(), Mlp()

        def forward(self, x):
            return self.b(self.a(x))

    torch.manual_seed(0)
    m, x = TwoLayers(), torch.randn(4, 16)
    TRACE_CACHE.clear()
    for _ in range(2):
        torch._dynamo.reset()
        twin = TwoLayers()
        twin.load_state_dict(m.state_dict())
        (r,) = npu_compile.explain(twin, x).graphs
        assert r.fusions["handwritten_silu"] == 2 and "aten.sigmoid" not in r.lowered_ops
        y = torch.compile(twin, backend="ascend")(x)
        y.sum().backward()
    misses = TRACE_CACHE.misses
    assert misses and TRACE_CACHE.hits >= 3 * misses, (TRACE_CACHE.hits, misses)
    y0 = m(x)
    y0.sum().backward()
    torch.testing.assert_close(y, y0, rtol=1e-6, atol=1e-6)
    for p, q in zip(twin.parameters(), m.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-6)


# --- the pattern traces in the persistent cache (TraceCache.persisting, option pattern_cache) ---
def _compile_silu_mlp(m, x):
    """A new process as far as the silu rule goes: its variants untraced, no trace in memory; the compiled twin's
    output and gradients, and the cache's counts."""
    from npu_compile.passes import engine

    for key in [k for k in engine._groups if k[0] == SILU.name]:
        del engine._groups[key]
    engine.TRACE_CACHE.clear()
    torch._dynamo.reset()
    twin = Mlp()
    twin.load_state_dict(m.state_dict())
    y = torch.compile(twin, backend="ascend")(x)
    y.sum().backward()
    c = engine.TRACE_CACHE
    return (c.misses, c.stored, c.loaded), y, [p.grad for p in twin.parameters()]


def test_pattern_traces_are_stored_and_a_new_process_loads_them(silu_rule, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("NPU_COMPILE_CACHE_DIR", str(tmp_path))
    m, x = Mlp(), torch.randn(4, 16)
    y0 = m(x)
    y0.sum().backward()
    (misses, stored, loaded), y1, g1 = _compile_silu_mlp(m, x)
    assert misses > 0 and (stored, loaded) == (misses, 0)  # the pattern and each match's exact re-trace
    files = sorted((tmp_path / "patterns").rglob("*.trace"))
    assert len(files) == stored and not list(tmp_path.rglob("*.bin"))  # option cache is off here, this is not
    counts, y2, g2 = _compile_silu_mlp(m, x)
    assert counts == (misses, 0, misses)  # nothing traced
    for y, grads in ((y1, g1), (y2, g2)):
        torch.testing.assert_close(y, y0, rtol=1e-6, atol=1e-6)
        for g, p in zip(grads, m.parameters()):
            torch.testing.assert_close(g, p.grad, rtol=1e-6, atol=1e-6)
    # an entry that fails its checks is ignored, removed and traced again
    for f in files:
        f.write_bytes(b"not an entry")
    with caplog.at_level("WARNING", logger="npu_compile"):
        counts, y3, _ = _compile_silu_mlp(m, x)
    assert counts == (misses, misses, 0)
    assert "npu_compile cache: ignoring entry" in caplog.text and "not a cache entry" in caplog.text
    torch.testing.assert_close(y3, y0, rtol=1e-6, atol=1e-6)


def test_pattern_cache_off_writes_and_reads_nothing(silu_rule, tmp_path, monkeypatch):
    from npu_compile import config

    monkeypatch.setenv("NPU_COMPILE_CACHE_DIR", str(tmp_path))
    m, x = Mlp(), torch.randn(4, 16)
    _compile_silu_mlp(m, x)
    with config.patch(pattern_cache=False):
        (misses, stored, loaded), _, _ = _compile_silu_mlp(m, x)
    assert misses > 0 and (stored, loaded) == (0, 0)


def _disk_key_contexts() -> dict:
    """Each part of a persistent trace key changed alone: (overrides of the base arguments, a context to call in)."""
    import contextlib

    from npu_compile.passes.engine import trace_inference

    def other_replacement(x):
        return torch.nn.functional.silu(x) + 0

    def default_dtype():
        stack = contextlib.ExitStack()
        stack.callback(torch.set_default_dtype, torch.get_default_dtype())
        torch.set_default_dtype(torch.float64)
        return stack

    none = contextlib.nullcontext
    return {
        "rule's name": ({"rule": passes.Rule(**{**SILU.__dict__, "name": "another_silu"})}, none),
        "rule's replacement source": ({"rule": passes.Rule(**{**SILU.__dict__, "replacement": other_replacement})},
                                      none),
        "traced function": ({"fn": silu_replacement}, none),
        "role": ({"role": "replacement"}, none),
        "trace function": ({"trace_fn": trace_inference}, none),
        "decomposition table": ({"decomp": lambda: {}}, none),
        "arguments": ({"args": [torch.empty(4, 8, dtype=torch.float64, requires_grad=True)]}, none),
        "grad mode": ({}, torch.no_grad),
        "functorch's rng switch": ({}, lambda: torch._functorch.config.patch(functionalize_rng_ops=True)),
        "autocast": ({}, lambda: torch.autocast("cpu", dtype=torch.bfloat16)),
        "default dtype": ({}, default_dtype),
    }


@pytest.mark.parametrize("field", [*_disk_key_contexts(), "versions"])
def test_each_part_of_a_persistent_trace_key_changes_it(field, monkeypatch):
    from npu_compile import cache
    from npu_compile.passes.engine import TraceCache, _trace_key, decompositions, trace_training

    def key(rule=SILU, fn=silu_pattern, trace_fn=trace_training, decomp=decompositions, role="pattern",
            args=(torch.empty(4, 8, requires_grad=True),)):
        return TraceCache._disk_key(rule, fn, trace_fn, decomp, role, _trace_key(list(args)))

    base = key()
    assert key() == base  # the same in one process (and in another: the next test)
    if field == "versions":
        monkeypatch.setattr(cache, "versions", lambda: ("torch another",))
        assert key() != base
        return
    overrides, context = _disk_key_contexts()[field]
    with context():
        assert key(**overrides) != base


def test_a_persistent_trace_key_is_the_same_in_another_process():
    """No address or id in the key: a builtin rule's pattern key worked out here and in a fresh interpreter."""
    import subprocess
    import sys

    script = (
        "import torch\n"
        "from npu_compile.passes import RULES\n"
        "from npu_compile.passes.engine import TraceCache, _trace_key, decompositions, trace_training\n"
        "rule = RULES['rms_norm'][0]\n"
        "print(TraceCache._disk_key(rule, rule.pattern, trace_training, decompositions, 'pattern',"
        " _trace_key(list(next(iter(rule.example_inputs()))))))\n"
    )
    from npu_compile.passes import RULES
    from npu_compile.passes.engine import TraceCache, _trace_key, decompositions, trace_training

    rule = RULES["rms_norm"][0]
    here = TraceCache._disk_key(rule, rule.pattern, trace_training, decompositions, "pattern",
                                _trace_key(list(next(iter(rule.example_inputs())))))
    there = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=True)
    assert there.stdout.split()[-1] == here


def test_a_trace_holding_a_collective_stays_in_memory(tmp_path, monkeypatch):
    """A collective's group name is this process's (the vocab-parallel loss traces with the TP group of the first
    graph it meets): such a trace is never stored, where the same trace without it is."""
    from npu_compile.passes.engine import TraceCache, decompositions

    monkeypatch.setenv("NPU_COMPILE_CACHE_DIR", str(tmp_path))
    c10d = torch.ops._c10d_functional

    def reduced(x):
        return c10d.wait_tensor.default(c10d.all_reduce.default(torch.sigmoid(x), "sum", "this_process_tp_group"))

    def traced(fn, args, *, get_decomp_fn):
        return torch.fx.symbolic_trace(fn)

    def fused_loss(x):  # the vocab-parallel loss's replacement: the group's name is an argument of our op
        loss, _lse = npu_compile.ops.cross_entropy.vocab_parallel_linear_cross_entropy(
            x, x, x.long(), 0, 0.0, "this_process_tp_group")
        return loss

    def floored(x):  # "floor" is a string argument; below, also the name of a group registered in this process
        return torch.div(torch.sigmoid(x), 2, rounding_mode="floor")

    class World:  # c10d's registry of this process's groups, as torch.distributed keeps it
        pg_names = {object(): "floor"}

    def run(pattern, stored):
        cache = TraceCache(persist=True)
        rule = passes.Rule(**{**SILU.__dict__, "pattern": pattern})
        gm = cache.tracer(rule, pattern, silu_replacement, traced)(pattern, [torch.empty(4, 8)],
                                                                   get_decomp_fn=decompositions)
        assert len(gm.graph.nodes) > 2 and cache.stored == stored, pattern.__name__

    for pattern, stored in ((reduced, 0), (fused_loss, 0), (floored, 1), (silu_pattern, 1)):
        run(pattern, stored)
    assert len(list((tmp_path / "patterns").rglob("*.trace"))) == 2
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed.distributed_c10d, "_world", World)
    monkeypatch.setenv("NPU_COMPILE_CACHE_DIR", str(tmp_path / "with_a_group"))
    run(floored, 0)
    run(silu_pattern, 1)
