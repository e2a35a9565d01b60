"""lowering/npu/ (the table, graph_modes): fused ops → torch_npu calls (run here by npu-sim), the checks that refuse, graph-mode plans,
and the hand-off to torchair."""

import sys
import types

import pytest
import torch

from npu_compile import config
from npu_compile.lowering import npu, npu_sim
from npu_compile.lowering.npu import graph_modes

from .cases import CASES, S, B, N, NKV, D, lowered_graphs, lowered_ops, run

F = torch.ops.npu_compile
RTOL, ATOL = 1e-5, 1e-5


def _assert_close(got, expected, what, tol=RTOL):
    for i, (g, e) in enumerate(zip(got, expected)):
        if e is None:
            assert g is None, f"{what}[{i}]"
            continue
        torch.testing.assert_close(g, e, rtol=tol, atol=tol, msg=lambda m: f"{what}[{i}]: {m}")


@pytest.mark.parametrize("name", CASES)
def test_lowered_graph_equals_eager(name):
    """Outputs and input gradients of the lowered graph, run by the emulator, equal eager's (the reference
    kernels), and the graph holds the torch_npu calls the mapping promises."""
    r = run(name)
    _assert_close(r.outputs, r.expected_outputs, "output", CASES[name].tolerance)
    _assert_close(r.grads, r.expected_grads, "grad", CASES[name].tolerance)
    ops = lowered_ops(r)
    assert set(CASES[name].lowered_to) <= ops, ops
    if CASES[name].lowered_to and name != "attention_bias_grad":
        assert not [op for op in ops if op.startswith("npu_compile.")], ops


@pytest.mark.parametrize("name, op, reason", [
    ("attention_bias_grad", "npu_compile.fused_attention_backward", "gradient of attn_bias"),
    ("attention_small_fill", "npu_compile.fused_attention", "fill=-1.0"),
    ("swiglu_not_contiguous", "npu_compile.swiglu", "contiguous"),
    ("bias_dropout_add_p", "npu_compile.bias_dropout_add", "no bias-dropout-add kernel"),
])
def test_refused_nodes_keep_their_reference_kernel_and_say_why(name, op, reason):
    r = run(name)
    assert op in lowered_ops(r)
    entries = [u for u in r.report.unfused if u["op"] == op]
    assert entries and all(reason in u["reason"] and u["reason"].startswith("npu: ") for u in entries), r.report.unfused


def test_bias_dropout_add_becomes_plain_ops_and_says_so():
    r = run("bias_dropout_add_p0")
    assert not [op for op in lowered_ops(r) if op.startswith(("npu_compile.", "npu."))]
    assert {u["op"] for u in r.report.unfused} == {"npu_compile.bias_dropout_add",
                                                   "npu_compile.bias_dropout_add_backward"}
    assert all("plain aten" in u["reason"] for u in r.report.unfused)


def _calls(r, name):
    return [n for gm in r.graphs for n in gm.graph.nodes if getattr(n.target, "__name__", "") == f"{name}.default"]


def test_attention_arguments_follow_the_device_conventions():
    """graph_mode eager: npu_fusion_attention on free views of our layouts (graph modes: test_attention_modes)."""
    causal = _calls(run("attention_sbnd_causal_gqa_eager"), "npu_fusion_attention")[0]
    assert causal.args[3:5] == (N, "SBH")  # head_num is the query's; kv heads come from key's shape (GQA)
    assert causal.kwargs["sparse_mode"] == 2 and causal.kwargs["next_tockens"] == 0
    assert tuple(causal.kwargs["atten_mask"].meta["val"].shape) == (2048, 2048)
    assert causal.kwargs["scale"] == pytest.approx(D ** -0.5) and causal.kwargs["keep_prob"] == 1.0
    assert causal.kwargs.get("inner_precise", 0) == 0

    masked = _calls(run("attention_bsnd_mask_megatron_fill"), "npu_fusion_attention")[0]
    assert masked.args[4] == "BSH" and masked.kwargs["sparse_mode"] == 0 and masked.kwargs["inner_precise"] == 2
    assert tuple(masked.kwargs["atten_mask"].meta["val"].shape) == (B, 1, S, S)  # B1SS

    biased = _calls(run("attention_bnsd_mask_causal_bias_eager"), "npu_fusion_attention")[0]
    assert biased.args[4] == "BNSD" and biased.kwargs["next_tockens"] == 0  # the mask or-ed with the triangle
    assert biased.kwargs["atten_mask"].target is torch.ops.aten.bitwise_or.Tensor
    assert biased.kwargs["pse"].meta["val"].shape == (1, N, S, S)  # 1NSS, pse = bias / scale

    grad = _calls(run("attention_sbnd_causal_gqa_eager"), "npu_fusion_attention_grad")[0]
    assert grad.kwargs["softmax_max"].meta["val"].shape == (B, N, S, 8)
    assert {"softmax_sum", "attention_in", "scale_value"} <= grad.kwargs.keys()


def test_attention_dropout_crosses_from_forward_to_backward_through_the_seed():
    """Forward and grad draw the same mask: the compiled result equals dense attention under the emulator's
    keep mask for (seed, offset 0), values and gradients."""
    p, seed = 0.3, 1234
    torch.manual_seed(0)
    q, k, v = torch.randn(S, B, N, D), torch.randn(S, B, NKV, D), torch.randn(S, B, NKV, D)

    def fn(q, k, v, seed):
        return F.fused_attention(q, k, v, None, None, seed, layout="sbnd", causal=True, dropout_p=p)[0]

    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    with lowered_graphs() as graphs:  # the backward compiles on the first .backward()
        out = torch.compile(fn, backend="ascend", options={"target": "npu-sim"})(*leaves, torch.tensor(seed))
        grad_out = torch.randn_like(out)
        out.backward(grad_out)

    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    qb, kb, vb = (t.permute(1, 2, 0, 3).repeat_interleave(N // t.shape[2], 1) for t in ref)
    scores = (qb @ kb.transpose(-1, -2)) * D ** -0.5
    scores = scores.masked_fill(torch.ones(S, S, dtype=torch.bool).triu(1), float("-inf"))
    keep = npu_sim.attention.dropout_keep_mask(seed, 0, (B, N, S, S), 1 - p)
    expected = ((scores.softmax(-1) * keep / (1 - p)) @ vb).permute(2, 0, 1, 3)
    expected.backward(grad_out)
    torch.testing.assert_close(out, expected, rtol=RTOL, atol=ATOL)
    for got, want in zip(leaves, ref):
        torch.testing.assert_close(got.grad, want.grad, rtol=RTOL, atol=ATOL)
    seeds = [n for gm in graphs for n in gm.graph.nodes if n.target is torch.ops.aten._local_scalar_dense.default]
    assert len(seeds) == 2  # read once in each graph, from the seed tensor the partitioner saved
    (grad,) = [n for gm in graphs for n in gm.graph.nodes
               if n.target is torch.ops.npu.npu_fusion_attention_grad.default]
    assert grad.kwargs["keep_prob"] == pytest.approx(1 - p) and grad.kwargs["numels"] == B * N * S * S
    assert [graph_modes.plan_graph(gm, "ge").graph_mode for gm in graphs] == ["eager", "eager"]


def test_inference_graphs_lower_too():
    """Without autograd the forward alone is compiled; the statistics nobody saves leave no trace."""
    torch.manual_seed(0)
    q, k, v = (t.detach() for t in CASES["attention_sbnd_causal_gqa"].inputs())
    fn = CASES["attention_sbnd_causal_gqa"].fn
    with torch.no_grad(), lowered_graphs() as graphs:
        out = torch.compile(fn, backend="ascend", options={"target": "npu-sim"})(q, k, v)
    torch.testing.assert_close(out, fn(q, k, v), rtol=RTOL, atol=ATOL)
    (gm,) = graphs
    targets = {n.target for n in gm.graph.nodes}
    assert torch.ops.npu.npu_fusion_attention.default in targets and torch.ops.aten.select.int not in targets


def test_fast_gelu_is_opt_in():
    assert config.validate({}).fast_gelu is False
    with pytest.raises(ValueError, match="fast_gelu"):
        config.validate({"fast_gelu": "yes"})
    assert "npu.npu_fast_gelu" not in lowered_ops(run("bias_gelu_tanh"))
    assert "npu.npu_gelu" not in lowered_ops(run("bias_gelu_fast_opt_in"))


# ---- graph modes ------------------------------------------------------------------------------------------

def _plans(name, mode="ge"):
    return [graph_modes.plan_graph(gm, mode) for gm in run(name).graphs]


def test_graph_mode_plans_follow_torchair_limits():
    # BNSD, no dropout, no pse: GE takes both graphs.
    assert [p.graph_mode for p in _plans("attention_bnsd_empty_row")] == ["ge", "ge"]
    # Lowered for ge, Megatron's sbnd goes to the GE converter in BSH; lowered for eager, its SBH is not among the
    # GE converter's layouts: aclgraph, with the reason.
    assert [p.graph_mode for p in _plans("attention_sbnd_causal_gqa")] == ["ge", "ge"]
    plans = _plans("attention_sbnd_causal_gqa_eager")
    assert [p.graph_mode for p in plans] == ["aclgraph", "aclgraph"]
    assert "input_layout BSH or BNSD only, got 'SBH'" in plans[0].reasons[0][1]
    # The GE converter drops pse: lowered for ge, a biased call takes v3, which has no GE converter.
    assert any("drops pse" in why for _, why in _plans("attention_bnsd_mask_causal_bias_eager")[0].reasons)
    assert _plans("attention_bnsd_mask_causal_bias")[0].reasons == (
        ("npu.npu_fusion_attention_v3", "graph_mode 'ge' -> 'aclgraph': torchair has no GE converter for "
                                        "npu_fusion_attention_v3"),)
    # npu_add_layer_norm has no GE converter; a reference kernel has none either.
    assert _plans("add_layer_norm")[0].graph_mode == "aclgraph"
    assert _plans("swiglu_not_contiguous")[0].graph_mode == "aclgraph"
    # A reference kernel with dropout reads its seed on the host: no capture.
    assert _plans("bias_dropout_add_p")[0].graph_mode == "eager"
    # What was asked stays when nothing blocks it.
    assert [p.graph_mode for p in _plans("rms_norm", "aclgraph")] == ["aclgraph", "aclgraph"]
    assert _plans("rms_norm", "eager")[0] == graph_modes.GraphPlan(requested="eager", graph_mode="eager")


def test_torchair_hand_off(monkeypatch):
    """What target npu would pass to torchair, checked with a stand-in torchair module (torch_npu is never
    imported here): its CompilerConfig with the mode of the plan, our lowered graph, the example inputs."""
    handed = []

    class CompilerConfig:
        def __init__(self):
            self.mode = "max-autotune"
            self.debug = types.SimpleNamespace()

    def get_compiler(cfg):
        return lambda gm, example_inputs: handed.append((cfg.mode, gm, example_inputs)) or (lambda *args: "ran")

    monkeypatch.setitem(sys.modules, "torchair", types.SimpleNamespace(CompilerConfig=CompilerConfig,
                                                                       get_compiler=get_compiler))
    gm = run("rms_norm").graphs[0]
    inputs = [torch.randn(2)]
    for mode, torchair_mode in (("ge", "max-autotune"), ("aclgraph", "npugraph_ex")):
        gm.meta[graph_modes.PLAN_META] = graph_modes.GraphPlan(requested=mode, graph_mode=mode)
        assert graph_modes.executor(gm, inputs, config.Options())() == "ran"
        assert handed[-1] == (torchair_mode, gm, inputs)
    gm.meta[graph_modes.PLAN_META] = graph_modes.GraphPlan(requested="ge", graph_mode="eager", reasons=(("x", "y"),))
    assert getattr(graph_modes.executor(gm, inputs, config.Options()), "_boxed_call", False) and len(handed) == 2  # op by op, no torchair
    assert graph_modes.GraphPlan("ge", "ge").torchair_settings() == {"mode": "max-autotune"}
    assert graph_modes.GraphPlan("ge", "eager").torchair_settings() == {}
    assert (graph_modes.GraphPlan("ge", "ge").device, graph_modes.GraphPlan("ge", "ge").collectives) == ("npu", "hccl")


def test_npu_target_records_the_plan_in_the_report():
    """npu.lower: the table (as npu-sim) plus the plan, whose demotions land in report.json ``unfused``."""
    gm = run("attention_sbnd_causal_gqa_eager").graphs[0]  # SBH: lowered for graph_mode eager
    copy = torch.fx.GraphModule(gm, gm.graph)
    entries = npu.lower(copy, config.validate({"graph_mode": "ge"}))
    assert copy.meta[graph_modes.PLAN_META].graph_mode == "aclgraph"
    assert entries == [{"op": "npu.npu_fusion_attention", "reason":
                        "npu: graph_mode 'ge' -> 'aclgraph': torchair's GE converter takes input_layout BSH or BNSD "
                        "only, got 'SBH'"}]


def test_varlen_attention_is_tnd_with_the_lengths_tensor_and_runs_op_by_op():
    """Both halves are npu_fusion_attention_v3 / _grad_v3 in TND, the lengths the graph's own int64 tensor (no
    host read), causal per document; GE has no converter for the _v3 pair and aclgraph is documented for BNSD
    only, so target npu plans the graphs op by op and says why."""
    r = run("varlen_attention_sbnd_gqa")
    calls = [n for gm in r.graphs for n in gm.graph.nodes if getattr(n.target, "namespace", None) == "npu"]
    assert sorted(n.target._schema.name for n in calls) == ["npu::npu_fusion_attention_grad_v3",
                                                           "npu::npu_fusion_attention_v3"]
    for n in calls:
        layout = n.args[5] if "grad" in n.target._schema.name else n.args[4]
        assert layout == "TND"
        lengths = n.kwargs["actual_seq_qlen"]
        assert lengths is n.kwargs["actual_seq_kvlen"] and lengths.op == "placeholder"
        assert lengths.meta["val"].dtype == torch.int64
        assert n.kwargs["sparse_mode"] == 2 and n.kwargs["softmax_layout"] == "TND"
        assert not [m for gm in r.graphs for m in gm.graph.nodes
                    if m.target is torch.ops.aten._local_scalar_dense.default]
    assert [c.graph_mode for c in r.calls] == ["eager", "eager"]
    reasons = {why for c in r.calls for _, why in c.reasons}
    assert any("aclgraph is documented for input_layout BNSD only" in why for why in reasons), reasons
    assert any("varlen_attention → npu_fusion_attention_v3" in u["reason"] for u in r.report.unfused)
