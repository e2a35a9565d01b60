"""torchair's own converters on the graphs target npu hands them (npu_compile/lowering/npu/torchair_check.py).

The graphs are npu-sim's (the very lowering target npu runs), recorded where the executor gets them, each with
the graph mode target npu plans for it. torchair, from the pinned torch-npu 2.13.0 wheel with only
``torchair.core._torchair`` stubbed, converts every ``ge`` graph into its GE GraphDef and runs its FX passes and
code generation on every ``aclgraph`` graph, all in one forked child per process-group setting (importing
torchair costs seconds; a graph well under one). A graph torchair rejects fails the test with the op, its
arguments and torchair's message.
"""

from __future__ import annotations

import collections
import re

import pytest
import torch

from megatron_glue.capture.models import build_gpt_model, gpt_config, llama_config, synthetic_batch
from npu_compile.lowering import npu_sim
from npu_compile.lowering.npu import graph_modes, torchair_check
from npu_compile.lowering.npu.schemas import SCHEMAS

from . import wheel
from .cases import CASES, lowered_graphs, run

pytestmark = pytest.mark.slow

VOCAB, SEQ, BATCH = 128, 64, 2
FP32, BF16 = torch.float32, torch.bfloat16
# (config, dtype, torch.compile dynamic): megatron-core GPT (LayerNorm, GeLU, learned positions) and Llama-style
# (RMSNorm, SwiGLU, RoPE, GQA) at head dims 64 and 128, one layer (every op kind a layer has), the fused loss on
# its output.


def _gpt(head_dim: int):
    return lambda: gpt_config(num_layers=1, hidden_size=2 * head_dim, num_attention_heads=2)


def _llama(head_dim: int):  # GQA: 4 query heads over 2 groups
    return lambda: llama_config(num_layers=1, hidden_size=4 * head_dim, num_attention_heads=4, num_query_groups=2)


# Each pair of (model, head dim, dtype) values once: every model at both head dims and both dtypes, every head dim in
# both dtypes, in four compiles rather than all eight combinations.
PAIRWISE = [("gpt", 64, "fp32"), ("gpt", 128, "bf16"), ("llama", 64, "bf16"), ("llama", 128, "fp32")]
MEGATRON = {
    **{f"{name} d{d} {dt}": ({"gpt": _gpt, "llama": _llama}[name](d), {"fp32": FP32, "bf16": BF16}[dt], False)
       for name, d, dt in PAIRWISE},
    "llama d64 dropout": (lambda: llama_config(num_layers=1, hidden_size=128, num_attention_heads=2,
                                               attention_dropout=0.1, hidden_dropout=0.1), FP32, False),
    "llama d64 dynamic seq": (lambda: llama_config(num_layers=1, hidden_size=128, num_attention_heads=2), FP32, True),
}
# single-op graphs: every argument form the emitters produce (tests/lowering/cases.py)
CASE_NAMES = [name for name in CASES if not name.endswith("_eager")]


def _megatron_calls(name: str) -> list[torchair_check.Graph]:
    config, dtype, dynamic = MEGATRON[name]
    calls: list[torchair_check.Graph] = []
    torch._dynamo.reset()
    with lowered_graphs(calls):
        model = build_gpt_model(config(), VOCAB, SEQ, seed=0).to(dtype)
        compiled = torch.compile(model, backend="ascend", options={"target": "npu-sim", "graph_mode": "ge"})
        batch = synthetic_batch(BATCH, SEQ, VOCAB)
        if dynamic:  # the sequence length symbolic from the first compile
            for key, dims in (("input_ids", (1,)), ("position_ids", (1,)), ("labels", (1,)),
                              ("attention_mask", (2, 3))):
                for dim in dims:
                    torch._dynamo.mark_dynamic(batch[key], dim)
        compiled(**batch).float().mean().backward()
    for i, call in enumerate(calls):
        call.name = f"{name}: {'forward' if i % 2 == 0 else 'backward'}"
    return calls


def _planted() -> torchair_check.Graph:
    """The fused loss's backward with its where.self(valid, g, 0) put back as aten.where.ScalarOther, handed to
    GE as if planned so: what the fused loss emitted before (the check must fail on it)."""
    call = next(c for c in run("linear_cross_entropy_mean_smoothed_chunked").calls if "graph 1" in c.name)
    graph = torch.fx.Graph()
    graph.output(graph.graph_copy(call.gm.graph, {}))
    gm = torch.fx.GraphModule(call.gm, graph)
    for n in gm.graph.nodes:
        if n.target is torch.ops.aten.where.self and n.args[2].target is torch.ops.aten.new_zeros.default:
            n.target, n.args = torch.ops.aten.where.ScalarOther, (n.args[0], n.args[1], 0.0)
            break
    else:
        raise AssertionError("the fused loss's backward holds no where.self against a zero")
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return torchair_check.Graph("planted where.ScalarOther", gm, call.example_inputs, "ge", call.in_fake_mode)


HOST_COPY = "host copy (option offload)"


def _host_copy() -> torchair_check.Graph:
    """A copy to host memory as lowering/npu/offload.py emits it, planted in a graph planned for GE by hand."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def copy_to_host(x):
        host = torch.ops.aten._to_copy.default(x, device=torch.device("cpu"), non_blocking=True)
        return (torch.ops.aten.add.Tensor(host, 1),)

    x = torch.randn(4, 8)
    return torchair_check.Graph(HOST_COPY, make_fx(copy_to_host)(x), [x], "ge")


def test_ge_would_keep_a_host_copy_on_the_device(converted):
    """Why plan_graph takes a graph with option offload's copies out of GE (graph_modes.HOST_COPY_GE): torchair's
    converter of aten._to_copy drops ``device`` and builds a TensorMove, a copy on the device."""
    table, _, _ = converted
    ((_, verdict),) = table[HOST_COPY]
    assert verdict.status == torchair_check.CHECKED, verdict.detail
    ops = [line.split(" = ")[0] for line in verdict.ge_summary.splitlines()[1:]]  # (the first names the graph)
    assert ops == ["x_1", "TensorMove", "Const", "Add", "NetOutput"], verdict.ge_summary


def _probes() -> list:
    """Ops whose converters the plan's tables speak for: every npu op we define, and the aten ops plan_graph
    rejects."""
    npu_sim.register()
    return [getattr(torch.ops.npu, name).default for name in SCHEMAS] + list(graph_modes.GE_REJECTED_ATEN)


@pytest.fixture(scope="module")
def converted(megatron_cpu):
    """{configuration: [(graph, verdict)]} over the Megatron models and the single-op cases, one child; and the
    converter probes."""
    path = wheel.wheel_path()  # downloads the pinned wheel once, as the schema test does
    by_config: dict[str, list[torchair_check.Graph]] = {name: _megatron_calls(name) for name in MEGATRON}
    by_config["single-op cases"] = [c for name in CASE_NAMES for c in run(name).calls]
    by_config[HOST_COPY] = [_host_copy()]
    planted = _planted()
    graphs = [g for calls in by_config.values() for g in calls] + [planted]
    verdicts, probed = torchair_check.run(graphs, _probes(), wheel_path=path)
    assert not isinstance(probed, str), probed
    found = dict(zip(map(id, graphs), verdicts))
    table = {name: [(g, found[id(g)]) for g in calls] for name, calls in by_config.items()}
    return table, found[id(planted)], probed


def _summary(table) -> str:
    lines = ["| configuration | ge | aclgraph | eager | converted |", "|---|---|---|---|---|"]
    for name, rows in table.items():
        modes = collections.Counter(g.graph_mode for g, _ in rows)
        ok = sum(v.status == torchair_check.CHECKED for g, v in rows if g.graph_mode != "eager")
        lines.append(f"| {name} | {modes['ge']} | {modes['aclgraph']} | {modes['eager']} | "
                     f"{ok}/{modes['ge'] + modes['aclgraph']} |")
    demoted = {f"{name}: {op}: {why}" for name, rows in table.items() if name in MEGATRON
               for g, _ in rows for op, why in g.reasons}
    return "\n".join(lines + sorted(demoted))


def test_every_planned_graph_converts(converted):
    table, _, _ = converted
    print("\n" + _summary(table))
    failures = [f"{g.name} ({g.graph_mode}): {v.detail}" for rows in table.values() for g, v in rows
                if v.status != torchair_check.CHECKED]
    assert not failures, "torchair rejects graphs target npu plans for it:\n" + "\n".join(failures)
    # aclgraph: the module torchair generates to capture the graph (capture itself needs a device)
    generated = [v.aclgraph_code for rows in table.values() for g, v in rows if g.graph_mode == "aclgraph"]
    assert generated and all("AclGraph(" in code and "def kernel(" in code for code in generated)


def test_training_graphs_with_attention_stay_in_ge(converted):
    """The fused loss, attention's backward (the dsink converter) and the fp32 norms: whole models in GE."""
    table, _, _ = converted
    for name in [name for name in MEGATRON if name.endswith(("fp32", "bf16"))]:
        rows = table[name]
        assert [g.graph_mode for g, _ in rows] == ["ge", "ge"], (name, [(g.name, g.graph_mode) for g, _ in rows])
    (_, forward), (_, backward) = table["llama d128 fp32"]
    assert {"FlashAttentionScore", "RmsNorm", "AddRmsNorm", "SwiGlu", "RotaryMul"} <= set(forward.ge_ops)
    assert {"FlashAttentionScoreGrad", "RmsNormGrad", "SwiGluGrad", "RotaryMulGrad"} <= set(backward.ge_ops)
    (attention,) = [line for line in forward.ge_summary.splitlines() if "= FlashAttentionScore(" in line]
    assert "input_layout: 'BSH'" in attention and "head_num: 4" in attention, attention


def test_demotions_name_what_torchair_rejects(converted):
    """Dropout: torchair's converters take keep_prob 1 only and reject the seed draw; the graph-mode attention
    op with dropout carries its seed through the host, so the graphs run op by op. Dynamic lengths: Megatron's
    index_put has no GE converter, so aclgraph."""
    table, _, _ = converted
    reasons = lambda name: {why.split(": ", 1)[1] for g, _ in table[name] for _, why in g.reasons}  # noqa: E731
    assert [g.graph_mode for g, _ in table["llama d64 dropout"]] == ["eager", "eager"]
    assert "torchair's GE converter takes keep_prob == 1 only, got 0.9" in reasons("llama d64 dropout") or \
        graph_modes.GE_REJECTED_ATEN[torch.ops.aten.randint.low] in reasons("llama d64 dropout"), \
        reasons("llama d64 dropout")
    dynamic = table["llama d64 dynamic seq"]
    assert all(any(isinstance(x, torch.SymInt) or isinstance(x, torch.Tensor) and not all(
        isinstance(s, int) for s in x.shape) for x in g.example_inputs) for g, _ in dynamic)  # symbolic sizes
    assert {g.graph_mode for g, _ in dynamic} == {"aclgraph"}
    assert graph_modes.GE_REJECTED_ATEN[torch.ops.aten.index_put.default] in reasons("llama d64 dynamic seq"), \
        reasons("llama d64 dynamic seq")


def test_the_check_fails_on_a_planted_where_scalar_other(converted):
    _, planted, _ = converted
    assert planted.status == torchair_check.FAILED
    assert re.fullmatch(
        r"torchair rejects aten\.where\.ScalarOther\(\w+: bool\[\d+\], \w+: int64\[\d+\], 0\.0\): "
        r"RuntimeError: torch\.ops\.aten\.where\.ScalarOther ge_converter is not supported!", planted.detail), \
        planted.detail


def test_plan_tables_agree_with_torchairs_converters(converted):
    """GE_CONVERTERS names exactly the npu ops torchair has a converter for; every aten op plan_graph rejects is
    one whose converter raises whatever it is given."""
    _, _, probed = converted
    npu = {name: probed[str(getattr(torch.ops.npu, name).default)] for name in SCHEMAS}
    assert {name for name, answer in npu.items() if answer != "none"} == graph_modes.GE_CONVERTERS, npu
    for op in graph_modes.GE_REJECTED_ATEN:
        assert probed[str(op)].startswith("rejects: "), (op, probed[str(op)])


def test_tensor_and_sequence_parallel_mc2_graphs_convert(megatron_cpu):
    """TP=2 + SP with MC2 on every site (the Megatron MLP of test_mc2.py over a fake group of 2: compiled, not
    communicating): AllGatherMatmul and MatmulReduceScatter in GE, their group the one the graph names. Converted
    in a child of its own, inside the fake group, which its collectives name (torchair resolves the group)."""
    from megatron_glue.capture.testing import fake_process_group

    from .test_mc2 import _TensorParallelMLP

    path = wheel.wheel_path()
    calls: list[torchair_check.Graph] = []
    torch._dynamo.reset()
    with fake_process_group(2) as group, lowered_graphs(calls):
        model = torch.compile(_TensorParallelMLP(group.group_name), backend="ascend", fullgraph=True,
                              options={"target": "npu-sim", "mc2": "on", "graph_mode": "ge"})
        model(torch.randn(4, 2, 256).to(BF16).requires_grad_()).float().square().sum().backward()
        verdicts = torchair_check.check(calls, wheel_path=path)
    print("\n| TP=2+SP MC2 MLP (bf16) | " + " | ".join(f"{g.graph_mode}: {v.status}" for g, v in zip(calls, verdicts)))
    assert [(g.graph_mode, v.status, v.detail) for g, v in zip(calls, verdicts)] == [("ge", "checked", "")] * 2
    forward, backward = verdicts
    assert {"AllGatherMatmul", "MatmulReduceScatter"} <= set(forward.ge_ops) & set(backward.ge_ops), \
        (forward.ge_ops, backward.ge_ops)


def test_dump_dir_holds_the_ge_graph_and_report_json_its_verdict(tmp_path, monkeypatch):
    """Option torchair_check: each graph's GE GraphDef text beside its FX stages, report.json graph_modes the
    mode and the verdict. Without it, or without the wheel, the verdict is "unchecked" with the reason."""
    import json

    monkeypatch.setenv(torchair_check.WHEEL_ENV, str(wheel.wheel_path()))
    fn = CASES["attention_bnsd_empty_row"].fn
    torch.manual_seed(0)
    inputs = CASES["attention_bnsd_empty_row"].inputs()
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="ascend", options={
        "target": "npu-sim", "torchair_check": True, "dump_dir": str(tmp_path / "on")})
    compiled(*inputs).sum().backward()
    (report,) = [json.loads(p.read_text()) for p in (tmp_path / "on").glob("*/report.json")]
    assert {kind: (v["graph_mode"], v["torchair_check"]) for kind, v in report["graph_modes"].items()} == {
        "forward": ("ge", "checked"), "backward": ("ge", "checked")}
    (forward,) = (tmp_path / "on").glob("*/forward/*_ge_graph.txt")
    (backward,) = (tmp_path / "on").glob("*/backward/*_ge_graph.txt")
    attention = [line for line in forward.read_text().splitlines() if "= FlashAttentionScore(" in line]
    assert len(attention) == 1 and "input_layout: 'BNSD'" in attention[0] and "keep_prob: 1" in attention[0]
    assert "= FlashAttentionScoreGrad(" in backward.read_text()
    (full,) = forward.parent.glob("*_ge_graph.pbtxt")  # the GraphDef in full, protobuf text
    assert 'type: "FlashAttentionScore"' in full.read_text()
    # after the lowered stage, in the stage order
    assert forward.name.split("_")[0] > max(p.name.split("_")[0] for p in forward.parent.glob("*_lowered_*.py"))

    monkeypatch.setenv(torchair_check.WHEEL_ENV, str(tmp_path / "nowhere.whl"))
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="ascend", options={
        "target": "npu-sim", "torchair_check": True, "dump_dir": str(tmp_path / "no_wheel")})
    compiled(*inputs).sum().backward()
    (report,) = [json.loads(p.read_text()) for p in (tmp_path / "no_wheel").glob("*/report.json")]
    assert report["graph_modes"]["forward"] == {
        "graph_mode": "ge", "torchair_check": "unchecked",
        "reason": f"no torch-npu {torchair_check.VERSION} wheel at {tmp_path / 'nowhere.whl'} (set "
                  f"{torchair_check.WHEEL_ENV}, or run the tests once with network: tests/lowering/wheel.py "
                  f"downloads it)"}
    assert not list((tmp_path / "no_wheel").glob("*/*/*_ge_graph.txt"))


def test_a_graph_torchair_refuses_on_the_device_is_demoted_not_fatal(monkeypatch):
    """Target npu's executor: torchair's refusal of a ge graph (its converter raising) demotes the graph to
    aclgraph with torchair's message, logged and in the plan, and the job goes on."""
    import sys
    import types

    from npu_compile import config

    modes = []

    class CompilerConfig:
        def __init__(self):
            self.mode = "max-autotune"

    def get_compiler(cfg):
        def compile_graph(gm, example_inputs):
            modes.append(cfg.mode)
            if cfg.mode == "max-autotune":
                raise RuntimeError("torch.ops.aten.where.ScalarOther ge_converter is not supported!")
            return lambda *args: "captured"
        return compile_graph

    monkeypatch.setitem(sys.modules, "torchair", types.SimpleNamespace(CompilerConfig=CompilerConfig,
                                                                       get_compiler=get_compiler))
    gm = run("rms_norm").graphs[0]
    gm = torch.fx.GraphModule(gm, gm.graph)
    gm.meta[graph_modes.PLAN_META] = graph_modes.GraphPlan("ge", "ge")
    assert graph_modes.executor(gm, [], config.Options())() == "captured"
    assert modes == ["max-autotune", "npugraph_ex"]
    plan = gm.meta[graph_modes.PLAN_META]
    assert (plan.graph_mode, plan.reasons) == ("aclgraph", (("torchair", (
        "graph_mode 'ge' -> 'aclgraph': torchair refused the graph: RuntimeError: torch.ops.aten.where.ScalarOther "
        "ge_converter is not supported!")),))
