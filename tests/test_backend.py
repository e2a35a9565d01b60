"""The pipeline end to end on small modules: results, dumps, report.json, the executor, the entry point."""

import json
import logging
import os
import subprocess
import sys
import textwrap
import weakref

import pytest
import torch

import npu_compile
from npu_compile.executor import boxed_executor

REPORT_KEYS = {"graph_id", "target", "fusions", "unfused", "lowered_ops", "graph_breaks", "memory", "comm"}
MEMORY_KEYS = {"peak_bytes_before", "peak_bytes_after", "lower_bound_bytes", "saved_activation_bytes"}
COMM_KEYS = {"collectives", "comm_us", "compute_us", "exposed_comm_us_before", "exposed_comm_us_after"}


class Block(torch.nn.Module):
    def __init__(self, h=32):
        super().__init__()
        self.norm = torch.nn.LayerNorm(h)
        self.fc1 = torch.nn.Linear(h, 4 * h)
        self.fc2 = torch.nn.Linear(4 * h, h)

    def forward(self, x):
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x))))


def _stages(folder):
    """Stage names of a dump folder in order (files are NN_<stage>.py)."""
    names = sorted(os.listdir(folder))
    assert [n[:2] for n in names] == [f"{i:02d}" for i in range(len(names))]
    return [n[3:].removesuffix(".py") for n in names]


def _train_steps(model, x, steps=3):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    outs = []
    for _ in range(steps):
        opt.zero_grad()
        y = model(x)
        y.square().mean().backward()
        outs.append((y.detach().clone(), [p.grad.clone() for p in model.parameters()]))
        opt.step()
    return outs


def test_training_bitwise_equal_to_eager_when_nothing_fuses():
    torch.manual_seed(0)
    eager = Block()
    compiled = Block()
    compiled.load_state_dict(eager.state_dict())
    x = torch.randn(4, 16, 32)
    ref = _train_steps(eager, x)
    # Block's Linear → GeLU would fuse (bias_gelu): with every rule off, nothing does
    got = _train_steps(torch.compile(compiled, backend="ascend", options={"fusions": []}), x)
    for (y0, g0), (y1, g1) in zip(ref, got):
        assert torch.equal(y0, y1)
        assert all(torch.equal(a, b) for a, b in zip(g0, g1))


def test_inference_graph_goes_through_pipeline(tmp_path):
    m = Block().eval()
    x = torch.randn(2, 8, 32)
    with torch.no_grad():
        y = torch.compile(m, backend="ascend", options={"dump_dir": str(tmp_path), "fusions": []})(x)
        assert torch.equal(y, m(x))  # nothing fused: bitwise
    report = json.loads((tmp_path / "0_0" / "report.json").read_text())
    assert report["graphs"] == ["inference"]
    assert _stages(tmp_path / "0_0" / "inference") == ["aot", "fused", "memory_order", "overlap", "lowered_reference"]
    assert report["memory"]["saved_activation_bytes"] == 0


def test_dump_dir_layout_and_report_keys(tmp_path):
    m = Block()
    cm = torch.compile(m, backend="ascend", options={"dump_dir": str(tmp_path)})
    cm(torch.randn(2, 8, 32)).sum().backward()
    root = tmp_path / "0_0"
    assert sorted(os.listdir(root)) == ["backward", "dynamo", "forward", "joint", "memory.png", "report.json"]
    assert (root / "memory.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert _stages(root / "forward") == ["aot", "memory_order", "overlap", "lowered_reference"]
    assert sorted(os.listdir(root / "joint")) == ["00_aot_joint.py", "01_fused.py"]
    assert "torch.ops.aten.native_layer_norm.default" in sorted((root / "forward").iterdir())[-1].read_text()
    report = json.loads((root / "report.json").read_text())
    assert REPORT_KEYS <= report.keys()
    assert MEMORY_KEYS <= report["memory"].keys() and COMM_KEYS <= report["comm"].keys()
    assert report["graph_id"] == "0_0" and report["target"] == "reference" and report["graph_breaks"] == 0
    assert report["graphs"] == ["forward", "backward"]
    assert report["lowered_ops"]["aten.native_layer_norm"] == 1
    assert report["lowered_ops"]["aten.native_layer_norm_backward"] == 1
    mem = report["memory"]
    # 8x128 fp32 hidden activations at least are saved for the backward (fc1 out / gelu in).
    assert mem["saved_activation_bytes"] >= 2 * 8 * 128 * 4
    assert mem["peak_bytes_after"] >= mem["lower_bound_bytes"] >= mem["saved_activation_bytes"] > 0
    top = mem["peak_tensors"][0]
    assert top["bytes"] == max(t["bytes"] for t in mem["peak_tensors"]) and top["start"] <= top["end"]


def test_environment_variable_sets_dump_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("NPU_COMPILE_DUMP_DIR", str(tmp_path))
    torch.compile(torch.nn.Linear(4, 4), backend="ascend")(torch.randn(2, 4))
    assert (tmp_path / "0_0" / "report.json").exists()


def test_unwritable_dump_dir_warns_and_compiles_on(tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    m = torch.nn.Linear(4, 4)
    x = torch.randn(2, 4)
    with caplog.at_level(logging.WARNING, logger="npu_compile"):
        y = torch.compile(m, backend="ascend", options={"dump_dir": str(blocker / "dumps")})(x)
    assert torch.equal(y, m(x))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert warnings[0].startswith(f"npu_compile: cannot write dumps under {blocker / 'dumps' / '0_0'} (")
    assert warnings[0].endswith("); compiling on without them")


def test_graph_break_is_reported():
    def f(x):
        y = x.sin()
        torch._dynamo.graph_break()
        return y.cos()

    exp = npu_compile.explain(f, torch.randn(3))
    assert exp.graph_count == 2 and exp.graph_break_count == 1
    assert [r.graph_breaks for r in exp.graphs] == [1, 0]
    assert "graph_break" in exp.break_reasons[0]


def test_explain_reports_backward_without_running_it():
    m = Block()
    exp = npu_compile.explain(m, torch.randn(2, 8, 32), options={"fusions": []})
    assert exp.graph_count == 1 and exp.graph_break_count == 0
    (r,) = exp.graphs
    assert r.graphs == ["forward", "backward"]
    assert r.lowered_ops["aten.gelu_backward"] == 1  # in the backward graph, compiled without running it
    assert all(p.grad is None for p in m.parameters())
    assert json.loads(str(exp))["graphs"][0]["graph_id"] == r.graph_id


def test_explain_passes_the_models_keyword_arguments_through():
    class Keywords(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(16, 8)

        def forward(self, input_ids, attention_mask=None, target=None):
            h = self.emb(input_ids)
            return h * attention_mask[..., None] if target is None else h

    batch = {"input_ids": torch.randint(0, 16, (2, 5)), "attention_mask": torch.ones(2, 5)}
    exp = npu_compile.explain(Keywords(), **batch, options={"fusions": []})  # `target` would be an option's name
    assert exp.graph_count == 1 and exp.graphs[0].options["fusions"] == []
    with pytest.raises(ValueError, match=r"^unknown npu_compile option\(s\) 'budget'"):
        npu_compile.explain(Keywords(), **batch, options={"budget": 1.0})


def test_verify_compares_first_call(tmp_path):
    m = Block()
    cm = torch.compile(m, backend="ascend", options={"verify": True, "dump_dir": str(tmp_path)})
    cm(torch.randn(2, 8, 32)).sum().backward()
    report = json.loads((tmp_path / "0_0" / "report.json").read_text())
    v = report["verify"]
    assert report["fusions"]["bias_gelu"] == 1  # the comparison has something to compare
    assert v["ok"] is True and v["max_abs_diff"] < 1e-5 and v["gradients"]["ok"] is True


def test_memory_budget_zero_saves_less():
    def saved(budget):
        (r,) = npu_compile.explain(Block(64), torch.randn(4, 32, 64), options={"memory_budget": budget}).graphs
        return r.memory["saved_activation_bytes"]

    assert saved(0.0) < saved(1.0)


def test_executor_frees_each_input_after_its_last_use():
    # x's last use is the sum; a later node checks that x is already gone while the graph still runs.
    seen_alive = []

    def probe(y):
        seen_alive.append(x_ref() is not None)
        return y

    g = torch.fx.Graph()
    x_node, y_node = g.placeholder("x"), g.placeholder("y")
    s = g.call_function(torch.ops.aten.sum.default, (x_node,))
    p = g.call_function(probe, (y_node,))
    g.output(g.call_function(torch.ops.aten.add.Tensor, (p, s)))
    run = boxed_executor(torch.fx.GraphModule(torch.nn.Module(), g))

    x = torch.randn(1000)
    x_ref = weakref.ref(x)
    args = [x, torch.randn(3)]
    del x
    out = run(args)
    assert args == [] and seen_alive == [False] and out.shape == (3,)


def test_reference_executor_calls_the_kernels_directly():
    """The reference target runs each fused op's Python kernel without the dispatcher (no npu_compile:: op
    event, the kernel's aten ops only), drops a detach only other nodes read, keeps one that is an output,
    still frees as it goes, and leaves the graph it was given as it was."""
    from torch.profiler import ProfilerActivity, profile

    from npu_compile.lowering import reference

    g = torch.fx.Graph()
    x_node, b_node = g.placeholder("x"), g.placeholder("b")
    gelu = g.call_function(torch.ops.npu_compile.bias_gelu.default, (x_node, b_node))
    inner = g.call_function(torch.ops.aten.detach.default, (gelu,))
    twice = g.call_function(torch.ops.aten.mul.Tensor, (inner, 2.0))
    g.output((twice, g.call_function(torch.ops.aten.detach.default, (gelu,))))
    gm = torch.fx.GraphModule(torch.nn.Module(), g)
    code_before = gm.code
    run = reference.TARGET.executor(gm, [], None)
    assert gm.code == code_before
    ran_graph = run.graph_module.graph
    # the kept detach is called through its Python binding (executor.BINDINGS)
    assert [n.target for n in ran_graph.nodes if n.op == "call_function"].count(torch.Tensor.detach) == 1

    x, b = torch.randn(4, 8), torch.randn(8)
    want = torch.nn.functional.gelu(x + b)
    args = [x, b]
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        doubled, out = run(args)
    ran = {e.name for e in prof.events()}
    assert "npu_compile::bias_gelu" not in ran and "aten::gelu" in ran, ran
    assert args == [] and torch.equal(out, want) and torch.equal(doubled, want * 2)


def test_entry_point_works_in_fresh_interpreter():
    code = textwrap.dedent(
        """
        import sys, torch
        m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
        x = torch.randn(3, 4)
        assert "npu_compile" not in sys.modules
        y = torch.compile(m, backend="ascend")(x)
        assert torch.equal(y, m(x))
        assert "npu_compile" in sys.modules  # loaded by Dynamo through the entry point
        print("ok")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "ok"


_X = torch.arange(24.0).reshape(2, 3, 4)
BINDING_CALLS = {  # op -> positional arguments as an FX graph passes them
    torch.ops.aten.view.default: (_X, [6, 4]),
    torch.ops.aten.t.default: (torch.arange(6.0).reshape(2, 3),),
    torch.ops.aten.permute.default: (_X, [2, 0, 1]),
    torch.ops.aten.transpose.int: (_X, 0, 2),
    torch.ops.aten.expand.default: (torch.arange(3.0).reshape(3, 1), [-1, 5]),
    torch.ops.aten.detach.default: (_X,),
    torch.ops.aten.unsqueeze.default: (_X, 1),
    torch.ops.aten.squeeze.dim: (torch.arange(3.0).reshape(3, 1), 1),
    torch.ops.aten.select.int: (_X, 1, 2),
    torch.ops.aten.add.Tensor: (_X, torch.arange(4.0)),
    torch.ops.aten.mul.Tensor: (_X, 0.5),
    torch.ops.aten.mm.default: (torch.arange(6.0).reshape(2, 3), torch.arange(12.0).reshape(3, 4)),
    torch.ops.aten.sum.dim_IntList: (_X, [0, 2], True),
}


@pytest.mark.parametrize("op", list(BINDING_CALLS), ids=str)
def test_each_python_binding_the_executor_calls_is_its_op(op):
    """The executor calls BINDINGS[op] for ``op``: the same values, shape, strides, dtype, and the same aliasing
    (a view of the same storage at the same offset, or a tensor of its own) as the op gives."""
    from npu_compile.executor import BINDINGS

    args = BINDING_CALLS[op]
    want, got = op(*args), BINDINGS[op](*args)
    assert type(got) is type(want) and torch.equal(got, want)
    assert (got.shape, got.stride(), got.dtype) == (want.shape, want.stride(), want.dtype)
    assert got._is_view() == want._is_view()

    def aliases(t):
        return t.untyped_storage().data_ptr() == args[0].untyped_storage().data_ptr()

    assert aliases(got) == aliases(want)
    if aliases(want):
        assert got.storage_offset() == want.storage_offset()


def test_every_binding_has_its_check():
    from npu_compile.executor import BINDINGS

    assert set(BINDINGS) == set(BINDING_CALLS)


def test_the_executor_calls_bindings_only_for_nodes_without_keyword_arguments():
    g = torch.fx.Graph()
    x = g.placeholder("x")
    plain = g.call_function(torch.ops.aten.add.Tensor, (x, x))
    scaled = g.call_function(torch.ops.aten.add.Tensor, (plain, x), {"alpha": 2})
    g.output(g.call_function(torch.ops.aten.view.default, (scaled, [-1])))
    run = boxed_executor(torch.fx.GraphModule(torch.nn.Module(), g))
    assert [n.target for n in run.graph_module.graph.nodes if n.op == "call_function"] == [
        torch.add, torch.ops.aten.add.Tensor, torch.Tensor.view]
    x = torch.randn(2, 3)
    assert torch.equal(run([x]), (x + x + 2 * x).view(-1))
