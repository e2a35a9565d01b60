"""The persistent compile cache: a miss compiles and stores, a second compile of the same graph loads every step,
a corrupt or mismatched entry is ignored and rebuilt, and cache=False reads and writes nothing. The key holds
everything that shapes an entry: each keyed option, the registered rules (a user's too), the device profile, the
process groups the graph names with the target's communicator names, the versions; each is checked alone."""

import dataclasses
import logging

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from megatron_glue.capture.testing import fake_process_group
from npu_compile import cache, config, lowering, passes
from npu_compile.debug.report import collect
from npu_compile.device import profile


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = torch.nn.LayerNorm(16)
        self.fc = torch.nn.Linear(16, 16)

    def forward(self, x):
        return torch.nn.functional.gelu(self.fc(self.norm(x))) + x


def step(options, seed=0):
    torch.manual_seed(seed)
    model = Block()
    x = torch.randn(4, 16, requires_grad=True)
    compiled = torch.compile(model, backend="ascend", options=options)
    with collect() as reports:
        out = compiled(x)
        out.sum().backward()
    return out.detach(), [p.grad for p in model.parameters()], reports[0]


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(cache.CACHE_DIR_ENV, str(tmp_path / "cache"))
    return tmp_path / "cache"


def entries(folder):
    return sorted(folder.rglob("*.bin"))


def test_second_compile_loads_every_step_and_equals_the_first(cache_dir):
    out1, grads1, r1 = step({"cache": True})
    assert r1.cache == {"partition": "miss", "forward": "miss", "backward": "miss"}
    assert len(entries(cache_dir)) == 3
    torch._dynamo.reset()  # a restarted process: Dynamo's in-memory code cache gone, the files kept
    out2, grads2, r2 = step({"cache": True})
    assert r2.cache == {"partition": "hit", "forward": "hit", "backward": "hit"}
    assert torch.equal(out1, out2) and all(torch.equal(a, b) for a, b in zip(grads1, grads2))
    assert (r2.fusions, r2.lowered_ops, r2.graphs) == (r1.fusions, r1.lowered_ops, r1.graphs)


def test_other_options_are_another_key(cache_dir):
    step({"cache": True})
    torch._dynamo.reset()
    _, _, r = step({"cache": True, "fusions": []})
    assert r.cache["partition"] == "miss"


def test_corrupt_entry_is_ignored_and_rebuilt(cache_dir, caplog):
    out1, _, _ = step({"cache": True})
    for path in entries(cache_dir):
        data = path.read_bytes()
        path.write_bytes(data[:-10] + b"x" * 10)  # the payload no longer matches its checksum
    torch._dynamo.reset()
    with caplog.at_level(logging.WARNING, logger="npu_compile"):
        out2, _, r = step({"cache": True})
    assert r.cache == {"partition": "rebuilt", "forward": "rebuilt", "backward": "rebuilt"}
    assert "checksum mismatch" in caplog.text
    assert torch.equal(out1, out2)
    torch._dynamo.reset()
    _, _, r3 = step({"cache": True})  # rebuilt entries are good again
    assert set(r3.cache.values()) == {"hit"}


def test_entry_of_another_key_is_not_trusted(cache_dir):
    step({"cache": True})
    paths = entries(cache_dir)
    blobs = [p.read_bytes() for p in paths]
    for p, b in zip(paths, blobs[1:] + blobs[:1]):  # every entry holds another one's content
        p.write_bytes(b)
    torch._dynamo.reset()
    out, _, r = step({"cache": True})
    assert "hit" not in r.cache.values()
    assert torch.isfinite(out).all()


def test_cache_off_reads_and_writes_nothing(cache_dir):
    _, _, r = step({"cache": False})
    assert set(r.cache.values()) == {"off"}
    assert not entries(cache_dir)


# ---- what the key holds, one field at a time --------------------------------------------------------------------

# A value other than the default for each option in the key. A new option must get one here: it is keyed unless
# config.UNKEYED lists it, and this test fails until it is shown to be keyed.
OTHER_VALUE = {"target": "npu-sim", "graph_mode": "eager", "fusions": ("attention",), "memory_budget": 0.5,
               "device_memory": 2**30, "resident_memory": 1, "activation_copies": 2, "overlap": False, "mc2": "off",
               "fast_gelu": True, "recompute": ("activation",), "offload": ("self_attention",)}
UNKEYED_VALUE = {"dump_dir": "/tmp/dumps", "verify": True, "cache": False, "pattern_cache": False,
                 "torchair_check": True}
BASE = config.Options(target="reference")


@pytest.fixture(scope="module")
def gm():
    return make_fx(lambda x, w: torch.nn.functional.gelu(x @ w), tracing_mode="fake")(
        torch.empty(4, 8), torch.empty(8, 8))


def test_every_option_is_keyed_or_listed_unkeyed():
    assert set(OTHER_VALUE) | set(UNKEYED_VALUE) == set(config.KEYS)
    assert set(UNKEYED_VALUE) == config.UNKEYED


@pytest.mark.parametrize("field", sorted(OTHER_VALUE))
def test_each_keyed_option_alone_changes_the_key(field, gm):
    other = dataclasses.replace(BASE, **{field: OTHER_VALUE[field]})
    assert getattr(other, field) != getattr(BASE, field)
    assert cache.graph_key("forward", gm, other) != cache.graph_key("forward", gm, BASE)


@pytest.mark.parametrize("field", sorted(UNKEYED_VALUE))
def test_unkeyed_options_leave_the_key(field, gm):
    other = dataclasses.replace(BASE, **{field: UNKEYED_VALUE[field]})
    assert cache.graph_key("forward", gm, other) == cache.graph_key("forward", gm, BASE)


def _changed(value):
    if isinstance(value, str):
        return value + "-other"
    if isinstance(value, (int, float)):
        return value * 2 + 1
    return {**value, "extra": 1}


@pytest.mark.parametrize("field", [f.name for f in dataclasses.fields(profile.DeviceProfile)])
def test_each_device_profile_field_changes_the_key(field, gm, monkeypatch):
    before = cache.graph_key("forward", gm, BASE)
    changed = dataclasses.replace(profile.DEFAULT, **{field: _changed(getattr(profile.DEFAULT, field))})
    monkeypatch.setattr(profile, "DEFAULT", changed)  # what device.profile.load() and so the cost model read
    assert profile.load() is changed
    assert cache.graph_key("forward", gm, BASE) != before


def test_the_versions_change_the_key(gm, monkeypatch):
    before = cache.graph_key("forward", gm, BASE)
    monkeypatch.setattr(cache, "versions", lambda: ("torch 0", "megatron-core -", "npu_compile 0 0"))
    assert cache.graph_key("forward", gm, BASE) != before


def silu_pattern(x):
    return x * torch.sigmoid(x)


def silu_replacement(x):
    return torch.nn.functional.silu(x)


def _silu_rule(pattern=silu_pattern, **fields):
    """The README's rule example (``pattern`` and ``fields`` changed for the key tests)."""
    return passes.Rule(**{"name": "handwritten_silu", "pattern": pattern, "replacement": silu_replacement,
                          "example_inputs": lambda: [[torch.empty(8, 16, requires_grad=True)]],
                          "anchors": (torch.ops.aten.sigmoid.default,), **fields})


@pytest.fixture
def user_rules():
    registered = []

    def register(rule):
        registered.append(passes.register_rule(rule).name)

    yield register
    for name in registered:
        passes.unregister_rule(name)


def _pattern_of(scale):
    def pattern(x):
        return x * torch.sigmoid(x * scale)
    return pattern


def _rule_key(gm, register, rule):
    register(rule)
    try:
        return cache.graph_key("partition", gm, BASE)
    finally:
        passes.unregister_rule(rule.name)


def _module_pattern(tmp_path, body):
    """``pattern`` of a user's module holding ``body``, loaded afresh: the same module and function name, as a
    rule file edited between two runs."""
    import importlib.util

    path = tmp_path / "my_rules.py"
    path.write_text(f"import torch\n\ndef pattern(x):\n    return {body}\n")
    spec = importlib.util.spec_from_file_location("my_rules", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.pattern


def _exec_pattern(body):
    """``pattern`` defined where no source is kept (exec, as in a REPL)."""
    scope = {"torch": torch}
    exec(f"def pattern(x):\n    return {body}\n", scope)
    return scope["pattern"]


@pytest.mark.parametrize("change", ["registered", "pattern source", "pattern code", "closure", "extra_check",
                                    "scalars", "modes", "anchors"])
def test_each_rule_change_changes_the_key(change, gm, user_rules, tmp_path):
    base = _silu_rule(pattern={"pattern source": lambda: _module_pattern(tmp_path, "x * torch.sigmoid(x)"),
                               "pattern code": lambda: _exec_pattern("x * torch.sigmoid(x)")}.get(
        change, lambda: silu_pattern)())
    before = _rule_key(gm, user_rules, base)
    other = {
        "registered": None,
        "pattern source": lambda: _silu_rule(pattern=_module_pattern(tmp_path, "torch.sigmoid(x) * x")),
        "pattern code": lambda: _silu_rule(pattern=_exec_pattern("torch.sigmoid(x) * x")),
        "closure": lambda: _silu_rule(pattern=_pattern_of(2.0)),
        "extra_check": lambda: _silu_rule(extra_check=lambda match: True),
        "scalars": lambda: _silu_rule(scalars={"eps": 1e-6}),
        "modes": lambda: _silu_rule(modes=(passes.TRAINING,)),
        "anchors": lambda: _silu_rule(anchors=(torch.ops.aten.mul.Tensor,)),
    }[change]
    if other is None:
        assert cache.graph_key("partition", gm, BASE) != before  # without it
    else:
        assert _rule_key(gm, user_rules, other()) != before
    if change == "closure":  # the same source with another value captured
        assert _rule_key(gm, user_rules, _silu_rule(pattern=_pattern_of(3.0))) != _rule_key(
            gm, user_rules, _silu_rule(pattern=_pattern_of(2.0)))


@pytest.mark.slow
def test_a_rule_key_is_the_same_in_another_process():
    """No addresses or hash seeds in the rules' digest: a second interpreter, its hash seed another, agrees."""
    import os
    import subprocess
    import sys

    code = "from npu_compile import cache; print(cache.rules_digest())"
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": "12345"}).stdout.strip()
    assert other == cache.rules_digest()


class Silu(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(16, 16)

    def forward(self, x):
        h = self.fc(x)
        return h * torch.sigmoid(h)


def test_a_rule_registered_after_caching_fires(cache_dir, user_rules):
    """The README's rule example, registered once a graph was cached: the next compile misses and fuses."""
    torch.manual_seed(0)
    model, x = Silu(), torch.randn(4, 16)
    with collect() as reports:
        torch.compile(model, backend="ascend", options={"cache": True})(x).sum().backward()
    assert set(reports[0].cache.values()) == {"miss"} and "handwritten_silu" not in reports[0].fusions
    user_rules(_silu_rule())
    torch._dynamo.reset()
    with collect() as reports:
        out = torch.compile(model, backend="ascend", options={"cache": True})(x)
        out.sum().backward()
    (r,) = reports
    assert r.cache["partition"] == "miss"
    assert r.fusions["handwritten_silu"] == 1
    assert r.lowered_ops["aten.silu"] == 1 and "aten.sigmoid" not in r.lowered_ops
    torch.testing.assert_close(out, model.fc(x) * torch.sigmoid(model.fc(x)))


def _all_reduce_graph(group_name):
    c10d = torch.ops._c10d_functional
    return make_fx(lambda x: c10d.wait_tensor(c10d.all_reduce(x, "sum", group_name)), tracing_mode="fake")(
        torch.empty(4, 4))


def test_the_group_a_graph_names_is_in_the_key():
    """The graph code names a group by its c10d name ('0'); the same name in a world of another size, or with
    another communicator name baked in by the target, is another key."""
    with fake_process_group(2) as group:
        gm = _all_reduce_graph(group.group_name)
        assert f"'{group.group_name}'" in gm.code
        two = cache.graph_key("forward", gm, BASE)
        named = {hcom: cache.graph_key("forward", gm, BASE, lambda pg, hcom=hcom: hcom) for hcom in ("a", "b")}
        assert cache.groups(gm, lambda pg: "a") == [(group.group_name, 2, (0, 1), "fake", "a")]
    assert len({two, *named.values()}) == 3
    with fake_process_group(4):
        assert cache.graph_key("forward", gm, BASE) != two


@pytest.mark.parametrize("name", ["npu", "npu-sim"])
def test_the_key_holds_what_the_targets_mc2_stage_bakes(name):
    """The communicator a target's MC2 stage names groups with is the one its key is given."""
    target = lowering.target(name)
    (stage_name, stage), = target.stages
    assert stage_name == "mc2" and stage.keywords["hcom"] is target.communicator is not None
    assert lowering.target("reference").communicator is None


def test_the_backend_keys_with_the_targets_communicator(cache_dir, monkeypatch):
    from npu_compile.lowering import npu_sim

    given = []
    key = cache.graph_key
    monkeypatch.setattr(cache, "graph_key", lambda *args: given.append(args[3:]) or key(*args))
    torch.compile(lambda x: x * 2, backend="ascend", options={"cache": True, "target": "npu-sim"})(torch.ones(2))
    assert given == [(npu_sim.c10d_group_name,)]


def test_this_packages_rules_are_keyed_by_their_place_in_the_registry():
    """The package's own rules enter the keys by their place (their content is in the package's source digest):
    the same objects back in the same places give the same key; fewer of them, or the same in another order, give
    another — in the backend cache's key and in precompile's folder key alike."""
    from npu_compile import precompile

    gm = torch.fx.symbolic_trace(lambda x: x + 1)
    saved = {n: rules[:] for n, rules in passes.RULES.items()}
    family = "bias_gelu"
    tail = list(saved)[list(saved).index(family):]  # the family and those after it: re-registered in their order

    def registry(rules_of_family):
        for n in tail:
            passes.unregister_rule(n)
        for n in tail:
            for rule in (rules_of_family if n == family else saved[n]):
                passes.register_rule(rule)
        return cache.graph_key("partition", gm, BASE), precompile.rules_digest()

    first = (cache.graph_key("partition", gm, BASE), precompile.rules_digest())
    try:
        assert registry(saved[family]) == first
        reordered = registry(saved[family][::-1])
        fewer = registry(saved[family][1:])
        assert reordered[0] != first[0] and reordered[1] != first[1]
        assert fewer[0] != first[0] and fewer[1] != first[1]
    finally:
        assert registry(saved[family]) == first


def test_a_graph_with_pytree_inputs_loads_without_torchs_own_deprecation_warning(cache_dir):
    """torch 2.13's unpickler of a graph's pytree specs warns of its own deprecated ``LeafSpec`` check, once per
    process that loads such a graph (a job's every rank): nothing a user can act on, so not shown."""
    import warnings

    traced = make_fx(lambda d: d["a"] + 1)({"a": torch.ones(2)})
    assert type(traced.graph._codegen).__name__ == "_PyTreeCodeGen"
    assert cache.store("a" * 64, {"gm": traced})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state, entry = cache.load("a" * 64, cache.fake_mode_of([]))
    assert state == "hit" and entry["gm"]({"a": torch.ones(2)}).tolist() == [2.0, 2.0]
    assert [str(w.message) for w in caught] == []
