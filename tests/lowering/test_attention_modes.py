"""Attention per graph mode: the torch_npu op each mode gets, the reason in report.json, and npu-sim running each
mode's graphs equal to eager, dropout included."""

import pytest
import torch

from npu_compile.lowering import npu_sim
from npu_compile.lowering.npu import graph_modes

from .cases import B, D, N, NKV, S, lowered_graphs, run

F = torch.ops.npu_compile
npu = torch.ops.npu
V3_DOC = ("npu_fusion_attention does not support graph mode or aclgraph; npu_fusion_attention_v3 is its graph-mode "
          "version, aclgraph for BNSD only: torch_npu/_op_plugin_docs.py, npu_fusion_attention and "
          "npu_fusion_attention_v3 constraints")
GE_DOC = "torchair's GE converter for npu_fusion_attention (ge_converter/custom/npu_fusion_attention.py)"
V3_DROPOUT = ("npu_fusion_attention_v3 takes no seed: it returns the (seed, offset) its generator drew, which "
              "reaches npu_fusion_attention_grad_v3 only through a (seed, offset) state the forward saves for "
              "this call alone")
aten_local_scalar = torch.ops.aten._local_scalar_dense.default
FWD, BWD = "npu_compile.fused_attention", "npu_compile.fused_attention_backward"


def _notes(r):
    return [u for u in r.report.unfused if u["op"] in (FWD, BWD)]


@pytest.mark.parametrize("name, layout, ops, reason", [
    ("attention_sbnd_causal_gqa_eager", "SBH", ("npu_fusion_attention", "npu_fusion_attention_grad"), None),
    ("attention_sbnd_causal_gqa", "BSH", ("npu_fusion_attention", "npu_fusion_attention_grad"),
     f"npu: graph_mode 'ge': npu_fusion_attention in BSH ({GE_DOC} takes input_layout BSH or BNSD with keep_prob 1)"),
    ("attention_sbnd_causal_gqa_aclgraph", "BNSD", ("npu_fusion_attention_v3", "npu_fusion_attention_grad_v3"),
     f"npu: graph_mode 'aclgraph': npu_fusion_attention_v3 in BNSD, for aclgraph ({V3_DOC})"),
    ("attention_bnsd_mask_causal_bias", "BNSD", ("npu_fusion_attention_v3", "npu_fusion_attention_grad_v3"),
     f"npu: graph_mode 'ge': npu_fusion_attention_v3 in BNSD, for aclgraph ({V3_DOC}); {GE_DOC} takes keep_prob 1 "
     f"without pse, not pse (it drops it)"),
])
def test_each_graph_mode_gets_its_attention_op_and_says_why(name, layout, ops, reason):
    r = run(name)
    calls = [n for gm in r.graphs for n in gm.graph.nodes if n.op == "call_function" and n.target in
             (npu.npu_fusion_attention.default, npu.npu_fusion_attention_grad.default,
              npu.npu_fusion_attention_v3.default, npu.npu_fusion_attention_grad_v3.default)]
    assert [n.target._schema.name.split("::")[1] for n in calls] == list(ops)
    assert {n.args[5] if "grad" in str(n.target) else n.args[4] for n in calls} == {layout}
    expected = [] if reason is None else [{"op": FWD, "reason": reason}, {"op": BWD, "reason": reason}]
    assert _notes(r) == expected


def test_plans_of_each_mode_keep_what_was_asked():
    """v3 needs no host read: the aclgraph graphs stay aclgraph; ge's BSH calls stay ge."""
    assert [graph_modes.plan_graph(gm, "aclgraph").graph_mode
            for gm in run("attention_sbnd_causal_gqa_aclgraph").graphs] == ["aclgraph", "aclgraph"]
    assert [graph_modes.plan_graph(gm, "ge").graph_mode
            for gm in run("attention_sbnd_causal_gqa").graphs] == ["ge", "ge"]
    assert not [n for gm in run("attention_sbnd_causal_gqa_aclgraph").graphs for n in gm.graph.nodes
                if n.target is torch.ops.aten._local_scalar_dense.default]


CARRIED = "; its (seed, offset) saved for npu_fusion_attention_grad_v3 in the call's dropout state"
EAGER_DROPOUT = f"npu_fusion_attention with its seed read on the host, so the graph runs eagerly ({V3_DROPOUT})"


def _dropout_run(mode, state, monkeypatch):
    """fused_attention with dropout compiled for npu-sim under ``mode``, its dropout state an input; returns the
    compiled values and gradients, the dense reference under the keep mask the emulated device drew (the
    (seed, offset) every forward and backward kernel was given, which must be one pair), the lowered graphs and
    the attention notes of report.json."""
    from npu_compile.debug.report import collect

    p = 0.3
    drawn = []
    keep_mask = npu_sim.attention.dropout_keep_mask

    def recording(seed, offset, shape, keep_prob):
        drawn.append((seed, offset))
        return keep_mask(seed, offset, shape, keep_prob)

    monkeypatch.setattr(npu_sim.attention, "dropout_keep_mask", recording)
    torch.manual_seed(0)
    q, k, v = torch.randn(S, B, N, D), torch.randn(S, B, NKV, D), torch.randn(S, B, NKV, D)

    def fn(q, k, v, state):
        return F.fused_attention(q, k, v, None, None, state, layout="sbnd", causal=True, dropout_p=p)[0]

    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    torch._dynamo.reset()
    with collect() as reports, lowered_graphs() as graphs:
        out = torch.compile(fn, backend="ascend", options={"target": "npu-sim", "graph_mode": mode})(*leaves, state)
        grad_out = torch.randn_like(out)
        out.backward(grad_out)
    torch._dynamo.reset()
    assert len(set(drawn)) == 1 and len(drawn) == 2, drawn  # forward and backward: one (seed, offset)

    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    qb, kb, vb = (t.permute(1, 2, 0, 3).repeat_interleave(N // t.shape[2], 1) for t in ref)
    scores = (qb @ kb.transpose(-1, -2)) * D ** -0.5
    scores = scores.masked_fill(torch.ones(S, S, dtype=torch.bool).triu(1), float("-inf"))
    keep = keep_mask(*drawn[0], (B, N, S, S), 1 - p)
    expected = ((scores.softmax(-1) * keep / (1 - p)) @ vb).permute(2, 0, 1, 3)
    expected.backward(grad_out)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    for got, want in zip(leaves, ref):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-5, atol=1e-5)
    notes = [u for r in reports for u in r.unfused if u["op"] in (FWD, BWD)]
    return drawn[0], graphs, notes


@pytest.mark.parametrize("mode", ["ge", "aclgraph"])
def test_v3_carries_its_dropout_state_from_forward_to_backward(mode, monkeypatch):
    """Under ge and aclgraph a call whose dropout state is a (seed, offset) pair (what the attention rules draw)
    runs npu_fusion_attention_v3: the forward graph returns, in the state's saved slot, the pair the emulated
    device drew, and the backward's grad_v3 drops with it. No host read: the graphs stay captured (aclgraph;
    ge demoted to aclgraph, torchair has no GE converter for v3)."""
    drawn, graphs, notes = _dropout_run(mode, torch.tensor([1234, 7]), monkeypatch)
    assert drawn[0] != 1234 and drawn[1] == 0  # the device's draw, not the input state
    targets = [n.target for gm in graphs for n in gm.graph.nodes]
    assert npu.npu_fusion_attention_v3.default in targets and npu.npu_fusion_attention_grad_v3.default in targets
    assert npu.npu_fusion_attention.default not in targets
    assert aten_local_scalar not in targets
    assert [graph_modes.plan_graph(gm, mode).graph_mode for gm in graphs] == ["aclgraph", "aclgraph"]
    why = f"npu: graph_mode '{mode}': npu_fusion_attention_v3 in BNSD, for aclgraph ({V3_DOC}){CARRIED}"
    if mode == "ge":
        why += f"; {GE_DOC} takes keep_prob 1 without pse, not keep_prob 0.7"
    assert notes == [{"op": FWD, "reason": why}, {"op": BWD, "reason": why}]


def test_eager_mode_passes_the_dropout_state_as_seed_and_offset(monkeypatch):
    drawn, graphs, notes = _dropout_run("eager", torch.tensor([1234, 7]), monkeypatch)
    assert drawn == (1234, 7) and notes == []
    targets = [n.target for gm in graphs for n in gm.graph.nodes]
    assert npu.npu_fusion_attention.default in targets and npu.npu_fusion_attention_grad.default in targets
    assert [graph_modes.plan_graph(gm, "eager").graph_mode for gm in graphs] == ["eager", "eager"]


def test_a_bare_seed_cannot_carry_v3s_state(monkeypatch):
    """A 0-dim seed has no slot for v3's (seed, offset): aclgraph keeps npu_fusion_attention with the seed read on
    the host, the graphs run eagerly, and the note says why."""
    drawn, graphs, notes = _dropout_run("aclgraph", torch.tensor(1234), monkeypatch)
    assert drawn == (1234, 0)
    targets = [n.target for gm in graphs for n in gm.graph.nodes]
    assert npu.npu_fusion_attention.default in targets and npu.npu_fusion_attention_v3.default not in targets
    assert [graph_modes.plan_graph(gm, "aclgraph").graph_mode for gm in graphs] == ["eager", "eager"]
    why = f"npu: graph_mode 'aclgraph': {EAGER_DROPOUT}"
    assert notes == [{"op": FWD, "reason": why}, {"op": BWD, "reason": why}]
