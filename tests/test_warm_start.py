"""Warm start (npu_compile.precompile): a second process runs the stored compile of a function without Dynamo's,
aot_autograd's or the backend's work, with results and gradients equal to eager; anything that shapes the compile
and changed since (shapes, dtypes, a module attribute the trace read, options, fusion rules, the traced source, the
process group a module holds) gets a new compile instead of the stored one.

In-process tests stand for a restarted process by dropping everything precompile and Dynamo hold in memory
(``restart``), so artifacts come back from disk through the same loader; the first test runs two real processes."""

import functools
import json
import linecache
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters

from npu_compile import cache, passes, precompile

ON = {"cache": True}


class Block(torch.nn.Module):
    def __init__(self, width=16, act="gelu"):
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.fc = torch.nn.Linear(width, width)
        self.act = act

    def forward(self, x):
        h = self.fc(self.norm(x))
        h = torch.nn.functional.gelu(h) if self.act == "gelu" else torch.relu(h)
        return h + x


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(cache.CACHE_DIR_ENV, str(tmp_path / "cache"))
    restart()
    yield tmp_path / "cache"
    restart()


def restart():
    """What a new process starts without: precompile's loaded artifacts, Dynamo's code cache, the counters."""
    precompile._artifacts.clear()
    precompile.counts.clear()
    torch._dynamo.reset()
    counters.clear()


def artifacts(folder):
    return sorted((folder / "precompiled").rglob("*.bin"))


def run(model, x, options=ON):
    """Forward and backward through precompile: output and parameter + input gradients."""
    x = x.detach().requires_grad_(x.is_floating_point())
    fn = precompile.compile(model.forward, options)
    out = fn(x)
    out.sum().backward()
    grads = [p.grad.clone() for p in model.parameters()] + [x.grad]
    model.zero_grad()
    return out.detach(), grads


def eager(model, x):
    x = x.detach().requires_grad_(True)
    out = model(x)
    out.sum().backward()
    grads = [p.grad.clone() for p in model.parameters()] + [x.grad]
    model.zero_grad()
    return out.detach(), grads


def assert_same(a, b):
    torch.testing.assert_close(a[0], b[0], rtol=1e-5, atol=1e-6)
    for g, h in zip(a[1], b[1]):
        torch.testing.assert_close(g, h, rtol=1e-5, atol=1e-6)


def assert_traced_nothing():
    assert counters["stats"]["unique_graphs"] == 0 and counters["aot_autograd"]["total"] == 0, dict(counters)


_MODEL = """
import torch


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = torch.nn.LayerNorm(16)
        self.fc = torch.nn.Linear(16, 16)

    def forward(self, x):
        return torch.nn.functional.gelu(self.fc(self.norm(x))) + x
"""

_CHILD = r"""
import json, sys, torch
from torch._dynamo.utils import counters
from npu_compile import precompile
sys.path.insert(0, sys.argv[1])
from warm_model import Model
torch.manual_seed(0)
model, x = Model(), torch.randn(4, 16, requires_grad=True)
out = precompile.compile(model.forward, {"cache": True})(x)
out.sum().backward()
torch.save([out.detach(), *[p.grad for p in model.parameters()], x.grad], sys.argv[2])
print(json.dumps({"precompile": dict(precompile.counts), "graphs": counters["stats"]["unique_graphs"],
                  "aot_autograd": counters["aot_autograd"]["total"], "frames": counters["frames"]["total"]}))
"""


def test_a_second_process_runs_the_stored_compile_without_tracing(tmp_path, monkeypatch):
    (tmp_path / "warm_model.py").write_text(_MODEL)
    env = dict(os.environ, NPU_COMPILE_CACHE_DIR=str(tmp_path / "cache"), TORCH_DEVICE_BACKEND_AUTOLOAD="0",
               PYTHONPATH=os.pathsep.join([str(Path(__file__).parent.parent), os.environ.get("PYTHONPATH", "")]))

    def process(name):
        done = subprocess.run([sys.executable, "-c", _CHILD, str(tmp_path), str(tmp_path / f"{name}.pt")], env=env,
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout.strip().splitlines()[-1]), torch.load(tmp_path / f"{name}.pt")

    cold, cold_values = process("cold")
    assert cold["precompile"] == {"compiled": 1, "stored": 1} and cold["graphs"] == 1
    warm, warm_values = process("warm")
    # Dynamo converted no frame, aot_autograd traced nothing, the backend compiled nothing: the artifact ran
    assert warm == {"precompile": {"loaded": 1, "hit": 1}, "graphs": 0, "aot_autograd": 0, "frames": 0}
    assert all(torch.equal(a, b) for a, b in zip(cold_values, warm_values))
    monkeypatch.syspath_prepend(str(tmp_path))
    from warm_model import Model

    torch.manual_seed(0)
    model, x = Model(), torch.randn(4, 16)
    assert_same((warm_values[0], warm_values[1:]), eager(model, x))
    sys.modules.pop("warm_model", None)


def test_restart_loads_the_artifact_and_equals_eager(cache_dir, tmp_path):
    from npu_compile.debug.report import collect

    model, x = Block(), torch.randn(4, 16)
    with collect() as cold:
        first = run(model, x)
    assert precompile.counts == {"compiled": 1, "stored": 1} and len(artifacts(cache_dir)) == 1
    restart()
    with collect() as warm:
        second = run(model, x, {"cache": True, "dump_dir": str(tmp_path / "dump")})
        run(model, x)  # given once per process
    assert precompile.counts == {"loaded": 1, "hit": 2}
    assert_traced_nothing()
    assert_same(second, first)
    assert_same(second, eager(model, x))
    # the compile's report.json, as it was made, marked as loaded
    (report,) = warm
    assert report.cache == {"partition": "precompiled", "forward": "precompiled", "backward": "precompiled"}
    assert (report.fusions, report.graphs, report.lowered_ops) == (cold[0].fusions, cold[0].graphs,
                                                                     cold[0].lowered_ops)
    assert report.compile_s == {} and cold[0].compile_s  # seconds spent compiling in this process: none
    assert '"precompiled"' in (tmp_path / "dump" / report.graph_id / "report.json").read_text()


def test_modules_of_one_structure_share_an_artifact(cache_dir):
    """N identical layers: one artifact, run by each with its own parameters."""
    a, b, x = Block(), Block(), torch.randn(4, 16)
    run(a, x)
    restart()
    for m in (a, b):
        assert_same(run(m, x), eager(m, x))
    assert precompile.counts == {"loaded": 1, "hit": 2} and len(artifacts(cache_dir)) == 1


@pytest.mark.parametrize("change", ["shape", "dtype", "module attribute", "width"])
def test_what_dynamo_guards_gets_a_new_compile(cache_dir, change):
    model, x = Block(), torch.randn(4, 16)
    run(model, x)
    restart()
    if change == "shape":
        x = torch.randn(6, 16)
    elif change == "dtype":
        model, x = model.double(), x.double()
    elif change == "module attribute":  # read while tracing: the model's own config
        model.act = "relu"
    else:
        model, x = Block(width=32), torch.randn(4, 32)
    got = run(model, x)
    assert precompile.counts == {"loaded": 1, "compiled": 1, "stored": 1}
    assert len(artifacts(cache_dir)) == 2
    assert_same(got, eager(model, x))


def _gelu_tanh(x):
    return torch.nn.functional.gelu(x, approximate="tanh")


def _gelu_tanh_scaled(x):  # the same name in another process would be the same function: its code differs here
    return torch.nn.functional.gelu(x, approximate="tanh") * 2


class Activated(torch.nn.Module):
    """A layer that calls the function its config names, as megatron-core's MLP calls config.activation_func."""

    def __init__(self, fn, width=16):
        super().__init__()
        self.fc = torch.nn.Linear(width, width)
        self.activation_func = fn

    def forward(self, x):
        return self.activation_func(self.fc(x)) + x


@pytest.mark.parametrize("other", [torch.nn.functional.silu, _gelu_tanh_scaled,
                                   functools.partial(torch.nn.functional.gelu, approximate="tanh")],
                         ids=["torch function", "user function", "partial"])
def test_another_function_called_is_another_compile(cache_dir, other):
    """Dynamo guards the function a module calls by its identity, which torch cannot store (it drops the guard from
    a stored compile); precompile keeps a description of the function in its place: a model of the same shapes
    calling another activation gets its own compile, in this process and after a restart, and the stored one
    still serves its own function."""
    x = torch.randn(4, 16)
    first = Activated(_gelu_tanh)
    run(first, x)
    second = Activated(other)
    second.load_state_dict(first.state_dict())
    assert_same(run(second, x), eager(second, x))
    assert precompile.counts["compiled"] == 2 and len(artifacts(cache_dir)) == 2
    restart()
    for m in (second, first):
        assert_same(run(m, x), eager(m, x))
    assert precompile.counts == {"loaded": 2, "hit": 2}


def test_other_options_are_another_key(cache_dir):
    """Compiled again by this backend with the new options: torch's AOTAutograd cache, which aot_compile consults
    and whose key knows nothing of them, never answers (even with Python's random seeded as training seeds it)."""
    import random

    from npu_compile.debug.report import collect

    model, x = Block(), torch.randn(4, 16)
    random.seed(1234)
    with collect() as reports:
        run(model, x)
    assert reports[0].fusions.get("bias_gelu") == 1
    restart()
    random.seed(1234)
    with collect() as reports:
        run(model, x, {"cache": True, "fusions": []})
    assert precompile.counts == {"compiled": 1, "stored": 1}  # nothing loaded: another folder
    # compiled by this backend with these options, not taken from torch's AOTAutograd cache of the same graph
    assert reports[0].graphs == ["forward", "backward"] and not reports[0].fusions.get("bias_gelu")
    assert len({p.parent for p in artifacts(cache_dir)}) == 2
    restart()
    run(model, x, {"cache": True, "memory_budget": 0.5})
    assert precompile.counts == {"compiled": 1, "stored": 1}


def test_a_rule_registered_since_is_another_key(cache_dir):
    """The README's rule example, registered after the artifact was stored: the new compile fuses with it."""
    class Silu(torch.nn.Module):
        def forward(self, x):
            return x * torch.sigmoid(x)

    model, x = Silu(), torch.randn(8, 16)
    run(model, x)
    restart()
    for entry in cache_dir.glob("??/*.bin"):  # the backend's own per-graph cache: this test is about precompile's key
        entry.unlink()
    passes.register_rule(passes.Rule(
        name="warm_start_silu", pattern=lambda x: x * torch.sigmoid(x), replacement=torch.nn.functional.silu,
        example_inputs=lambda: [[torch.empty(8, 16, requires_grad=True)]], anchors=(torch.ops.aten.sigmoid.default,)))
    try:
        from npu_compile.debug.report import collect

        with collect() as reports:
            got = run(model, x)
        assert precompile.counts == {"compiled": 1, "stored": 1}
        assert reports[0].fusions["warm_start_silu"] == 1
        assert_same(got, eager(model, x))
    finally:
        passes.unregister_rule("warm_start_silu")
    restart()
    run(model, x)  # the registry as before: the first artifact again
    assert precompile.counts == {"loaded": 1, "hit": 1}


def test_an_edited_source_is_not_trusted(cache_dir, tmp_path, monkeypatch, caplog):
    path = tmp_path / "edited_model.py"
    path.write_text("import torch\n\n\ndef f(x):\n    return torch.sin(x) * 2\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import edited_model

    x = torch.randn(4, 16)
    run(Calls(edited_model.f), x)
    restart()
    path.write_text("import torch\n\n\ndef f(x):\n    return torch.cos(x) * 2\n")  # same lines, other code
    linecache.checkcache(str(path))
    with caplog.at_level(logging.WARNING, logger="npu_compile"):
        run(Calls(edited_model.f), x)
    assert "traced source changed: edited_model lines" in caplog.text
    assert precompile.counts == {"compiled": 1, "stored": 1}
    sys.modules.pop("edited_model", None)


class Calls(torch.nn.Module):
    """A module calling a function of another file (whose source the test edits)."""

    def __init__(self, f):
        super().__init__()
        self.f = f

    def forward(self, x):
        return self.f(x)


def test_a_corrupt_artifact_is_removed_and_compiled_again(cache_dir, caplog):
    model, x = Block(), torch.randn(4, 16)
    first = run(model, x)
    (path,) = artifacts(cache_dir)
    path.write_bytes(path.read_bytes()[:-10] + b"x" * 10)
    restart()
    with caplog.at_level(logging.WARNING, logger="npu_compile"):
        got = run(model, x)
    assert "checksum mismatch" in caplog.text
    assert precompile.counts == {"compiled": 1, "stored": 1}
    assert_same(got, first)


def test_a_graph_break_runs_under_plain_torch_compile_from_then_on(cache_dir):
    class Breaks(torch.nn.Module):
        def forward(self, x):
            y = torch.sin(x)
            torch._dynamo.graph_break()
            return y * 2

    model, x = Breaks(), torch.randn(4, 16)
    got = run(model, x)
    assert precompile.counts == {"compiled": 1, "fallback": 1}
    (marker,) = (cache_dir / "precompiled").rglob(precompile._FALLBACK)
    assert "graph_break" in marker.read_text() or "Unsupported" in marker.read_text()
    assert_same(got, eager(model, x))
    restart()
    assert_same(run(model, x), eager(model, x))
    assert precompile.counts == {}  # the marker read: no second attempt
    assert counters["stats"]["unique_graphs"] == 2  # plain torch.compile, both sides of the break


def test_cache_off_stores_nothing(cache_dir):
    model, x = Block(), torch.randn(4, 16)
    assert_same(run(model, x, {"cache": False}), eager(model, x))
    assert precompile.counts == {} and not (cache_dir / "precompiled").exists()


class Reduced(torch.nn.Module):
    """A module holding a process group, as Megatron's parallel layers hold theirs."""

    def __init__(self, group):
        super().__init__()
        self.fc = torch.nn.Linear(16, 16)
        self.group = group

    def forward(self, x):
        y = self.fc(x)
        torch.distributed.all_reduce(y, group=self.group)
        return y


@pytest.fixture
def two_groups():
    import torch.distributed as dist

    was = dist.is_initialized()
    if not was:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    a, b = dist.new_group([0]), dist.new_group([0])
    yield a, b
    dist.destroy_process_group(a)
    dist.destroy_process_group(b)
    if not was:
        dist.destroy_process_group()


def test_a_module_holding_another_process_group_gets_a_new_compile(cache_dir, two_groups):
    """torch stores a guard state's process groups as placeholders, so the guards on them are checked by
    precompile: same path, same group name."""
    a, b = two_groups
    x = torch.randn(4, 16)
    model = Reduced(a)
    run(model, x)
    restart()
    assert_same(run(model, x), eager(model, x))
    assert precompile.counts == {"loaded": 1, "hit": 1}
    other = Reduced(b)
    other.load_state_dict(model.state_dict())
    assert_same(run(other, x), eager(other, x))
    assert precompile.counts == {"loaded": 1, "hit": 1, "compiled": 1, "stored": 1}


def test_a_whole_module_starts_warm(cache_dir):
    """precompile.compile(model): the module itself, as torch.compile(model) takes it."""
    model, x = Block(), torch.randn(4, 16, requires_grad=True)
    first = precompile.compile(model, ON)(x)
    assert precompile.counts == {"compiled": 1, "stored": 1}
    restart()
    x = x.detach().requires_grad_(True)
    out = precompile.compile(model, ON)(x)
    out.sum().backward()
    assert precompile.counts == {"loaded": 1, "hit": 1}
    assert_traced_nothing()
    assert torch.equal(out.detach(), first.detach())
    assert_same((out.detach(), [p.grad for p in model.parameters()] + [x.grad]), eager(model, x.detach()))


def test_nested_collect_blocks_end_cleanly():
    """precompile collects a compile's reports inside the caller's block: both get each report and both end."""
    from npu_compile.debug import report as report_module

    r, later = (report_module.Report(graph_id=g, target="reference") for g in ("g", "later"))
    with report_module.collect() as outer:
        with report_module.collect() as inner:
            report_module.publish(r)
        report_module.publish(later)  # after the inner block: the outer one only
    assert (inner, outer) == ([r], [r, later])
    assert not report_module._collectors


@pytest.mark.parametrize("setting", ["autograd cache off", "caches force-disabled"])
def test_torchs_caches_off_run_plain_torch_compile_and_mark_nothing(cache_dir, setting, caplog):
    """aot_compile makes a storable compile only with torch's AOTAutograd cache on: with it off (or every cache
    force-disabled) the function runs under plain torch.compile, says why, and leaves no fallback marker, so a
    process without the setting stores and loads as usual."""
    model, x = Block(), torch.randn(4, 16)
    patch = (torch._functorch.config.patch(enable_autograd_cache=False) if setting == "autograd cache off"
             else torch.compiler.config.patch(force_disable_caches=True))
    with patch, caplog.at_level(logging.WARNING, logger="npu_compile"):
        assert_same(run(model, x), eager(model, x))
    assert precompile.counts == {"fallback": 1}
    assert ("TORCHINDUCTOR_AUTOGRAD_CACHE=0" if setting == "autograd cache off"
            else "force_disable_caches is set") in caplog.text
    assert not list((cache_dir / "precompiled").rglob("*"))
    restart()
    run(model, x)
    assert precompile.counts == {"compiled": 1, "stored": 1}
