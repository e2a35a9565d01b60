"""The MoE fusions on megatron-core's own MoE transformer layer (SequentialMLP experts, the router, the token
dispatcher), compiled with backend="ascend" for npu-sim: fusion counts, the npu ops the graphs run, 0 breaks with
the aux loss on, and output and every gradient equal to eager. On both megatron-core lines (make test-mcore012
runs this file on 0.12.1). Only the MoE rules are switched on: the others (attention, norms, ...) have their own
tests, and tracing their patterns would cost this file a minute."""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F

from megatron_glue.capture.adaptations import groups_for, registry

EXPERTS = 4
MOE_RULES = ["grouped_matmul", "unpermute", "topk_softmax", "permute"]
# the aux loss's scores take a top-k of their own (0.16.1; not 0.12.1)
AUX_TOPK = hasattr(importlib.import_module("megatron.core.transformer.moe.moe_utils"),
                   "compute_routing_scores_for_aux_loss")


@pytest.fixture
def moe_adapted(megatron_cpu, fresh_dynamo):
    before = set(registry.applied())
    registry.apply_groups(groups_for(training=True))  # as the job
    yield
    registry.revert(*[n for n in registry.applied() if n not in before])


def _layer(dispatcher: str, glu: bool, experts: int = EXPERTS, **router):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.spec_utils import build_module

    from megatron_glue.capture import quiet_megatron

    with quiet_megatron():
        config = TransformerConfig(
            num_layers=1, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, num_moe_experts=experts,
            moe_router_topk=2, moe_ffn_hidden_size=48, add_bias_linear=False, gated_linear_unit=glu,
            activation_func=F.silu if glu else F.gelu, bias_activation_fusion=False, masked_softmax_fusion=False,
            bias_dropout_fusion=False, apply_rope_fusion=False, use_cpu_initialization=True, hidden_dropout=0.0,
            attention_dropout=0.0, moe_aux_loss_coeff=1.0, moe_token_dispatcher_type=dispatcher, **router)
        torch.manual_seed(0)
        return build_module(get_gpt_layer_local_spec(num_experts=experts, normalization="RMSNorm"), config=config,
                            layer_number=1)


def _run(layer, module):
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    x = torch.randn(8, 2, 32, generator=torch.Generator().manual_seed(1), requires_grad=True)
    out, _ = module(x, attention_mask=None)
    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor([0.25]))  # as the schedule: after the forward
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(2)))
    grads = {"input": x.grad.clone(), **{n: p.grad.clone() for n, p in layer.named_parameters()}}
    layer.zero_grad(set_to_none=True)
    return out.detach(), grads


@pytest.mark.parametrize("dispatcher,glu", [("allgather", True), ("alltoall", False)])
def test_moe_layer_fusion_counts_and_equality_with_eager(moe_adapted, monkeypatch, dispatcher, glu):
    import torch._dynamo.utils as dynamo_utils

    from npu_compile.passes import engine, moe

    from npu_compile.debug.report import collect

    from megatron_glue.training.training import moe_dynamo_config

    permutes = []

    def recording(graph, mode):  # the permute rule, keeping the ops it made
        result = moe.apply_permute(graph, mode)
        permutes.extend(n for n in graph.nodes if n.target is torch.ops.npu_compile.permute_tokens.default)
        return result

    monkeypatch.setitem(engine.GRAPH_RULES, "permute", engine.GraphRule("permute", recording))
    layer = _layer(dispatcher, glu)
    want, want_grads = _run(layer, layer)
    moe_dynamo_config()
    dynamo_utils.counters.clear()
    compiled = torch.compile(layer, backend="ascend",
                             options={"target": "npu-sim", "fusions": MOE_RULES, "cache": False})
    with collect() as reports:
        got, got_grads = _run(layer, compiled)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, rtol=1e-5, atol=1e-6, msg=name)
    assert dynamo_utils.counters["stats"]["unique_graphs"] == 1
    (report,) = reports
    assert report.graph_breaks == 0
    # fc1 and fc2 forward, and their inputs' gradients: one npu_grouped_matmul each, every expert in it
    assert report.fusions["grouped_matmul"] == 4
    assert report.lowered_ops["npu.npu_grouped_matmul"] == 4
    assert "npu_compile.grouped_matmul" not in report.lowered_ops
    weight_grads = [u for u in report.unfused if u.get("rule") == "grouped_matmul"]
    assert [u["reason"].split(" weight-gradient")[0] for u in weight_grads] == [str(2 * EXPERTS)], weight_grads
    # megatron-core's unpermute (scatter_add into zeros), and the permute's input gradient (index_add into zeros:
    # the same sum of rows into tokens), one npu_moe_token_unpermute_with_routing_map each
    assert report.fusions["unpermute"] == 2
    assert report.lowered_ops["npu.npu_moe_token_unpermute_with_routing_map"] == 2
    assert "npu_compile.unpermute_tokens" not in report.lowered_ops
    assert [u for u in report.unfused if u.get("rule") == "unpermute"] == []
    # each in the op's slot layout (token t's rows at t x topK ..): the forward's the lowered permute's own
    # sorted_indices (the same routing map), the backward's (no permute there) a sort of megatron-core's row tokens;
    # npu-sim emulates that layout, so the equality above checks the indices handed over
    prefix = "npu: unpermute_tokens: sorted_indices in npu_moe_token_unpermute_with_routing_map's slot layout (int32): "
    assert [u["reason"] for u in report.unfused if u["op"] == "npu_compile.unpermute_tokens"] == [
        prefix + "the graph's npu_moe_token_permute_with_routing_map's",
        prefix + "a sort of megatron-core's row tokens"]
    assert report.lowered_ops["aten.sort"] == 1
    # megatron-core's permute (index_select of the tokens by the masked_select of their numbers; alltoall also
    # the probs' masked_select, allgather its own of the local probs by the same map): one permute_tokens, lowered
    # to npu_moe_token_permute_with_routing_map (the map is the router's top-k scatter: topK known)
    assert report.fusions["permute"] == 1
    (op,) = permutes  # with the probs (alltoall: permute's own; allgather: its own masked_select by the same map)
    assert op.args[3] is not None and op.args[4] == 2, op.args
    assert report.lowered_ops["npu.npu_moe_token_permute_with_routing_map"] == 1
    assert "npu_compile.permute_tokens" not in report.lowered_ops
    assert report.lowered_ops.get("aten.index_select", 0) == 0
    assert [u for u in report.unfused if u.get("rule") == "permute"] == []
    # the memory analysis sizes the routed rows by the router's top-k (16 tokens x top-2, exact) and each
    # expert's rows (and, alltoall, each split of the dispatch) by an even share (passes/unbacked_hints.py)
    hints = sorted(report.memory["unbacked_hints"].values())
    assert hints[-2:] == [32, 32] and set(hints[:-2]) == {32 // EXPERTS}, hints
    # the router's softmax over the top-k logits: one npu_moe_gating_top_k_softmax_v2; on 0.16.1 the aux loss's own
    # top-k of the softmaxed scores (compute_routing_scores_for_aux_loss: its routing map, indices only) declined
    # with its reason (0.12.1's aux loss reads the router's routing map)
    assert report.fusions["topk_softmax"] == 1
    assert report.lowered_ops["npu.npu_moe_gating_top_k_softmax_v2"] == 1
    assert [u["reason"] for u in report.unfused if u.get("rule") == "topk_softmax"] == [] if not AUX_TOPK else [
        "not megatron-core's softmax-after-top-k router: only the top-k's indices are read (the aux loss's routing "
        "map, or softmax before the top-k (--moe-router-pre-softmax, or the aux loss's scores))"]


def test_moe_layer_sigmoid_router_with_expert_bias_and_groups(moe_adapted):
    """DeepSeek-V3's router scaled down in megatron-core's MoE layer (sigmoid scores, expert bias, 8 experts in 2
    groups of which 1 is kept by its top-2 sum, top-2, scaling 2.5): one topk_gating, lowered to
    npu_moe_gating_top_k on npu-sim; output and every gradient equal to eager."""
    from npu_compile.debug.report import collect

    from megatron_glue.training.training import moe_dynamo_config

    layer = _layer("alltoall", True, experts=8, moe_router_score_function="sigmoid",
                   moe_router_enable_expert_bias=True, moe_router_num_groups=2, moe_router_group_topk=1,
                   moe_router_topk_scaling_factor=2.5, moe_router_load_balancing_type="seq_aux_loss")
    with torch.no_grad():
        layer.mlp.router.expert_bias.copy_(torch.randn(8, generator=torch.Generator().manual_seed(3)) / 4)
    want, want_grads = _run(layer, layer)
    moe_dynamo_config()
    compiled = torch.compile(layer, backend="ascend", options={
        "target": "npu-sim", "fusions": [*MOE_RULES, "topk_gating"], "cache": False})
    with collect() as reports:
        got, got_grads = _run(layer, compiled)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, rtol=1e-5, atol=1e-6, msg=name)
    (report,) = reports
    assert report.graph_breaks == 0
    assert report.fusions["topk_gating"] == 1
    assert report.lowered_ops["npu.npu_moe_gating_top_k"] == 1
    assert "npu_compile.topk_gating" not in report.lowered_ops
    assert [u for u in report.unfused if u.get("rule") == "topk_gating"] == []
    assert report.fusions["permute"] == 1  # the routing map is the gating op's top-k scatter: topK known


# -- the flags: Megatron-LM's --moe-grouped-gemm names the grouped_matmul rule -------------------------------------

def _parse(*flags, world_size=1):
    from megatron_glue.training.arguments import parse_args
    from pretrain_runs import TINY

    return parse_args([*TINY, "--train-iters", "2", "--num-experts", "4", "--disable-bias-linear", *flags],
                      world_size=world_size)


def test_moe_grouped_gemm_is_the_grouped_matmul_rule():
    """On by default (fusions "all"); a `fusions` list without it gets it added, as each MindSpeed switch adds its
    rules; megatron-core's own GroupedMLP stays off (it needs the CUDA grouped_gemm package): SequentialMLP is
    built and the rule groups its matmuls."""
    from megatron_glue.training.training import moe_fields

    args = _parse("--moe-grouped-gemm")
    assert args.moe_grouped_gemm and args.npu_compile_options.get("fusions", "all") == "all"
    assert moe_fields(args)["moe_grouped_gemm"] is False
    listed = _parse("--moe-grouped-gemm", "--npu-compile-options", '{"fusions": ["swiglu"]}')
    assert listed.npu_compile_options["fusions"] == ["swiglu", "grouped_matmul"]
    switched_off = _parse("--moe-grouped-gemm", "--npu-compile-options", '{"fusions": {"grouped_matmul": false}}')
    assert switched_off.npu_compile_options["fusions"] == {"grouped_matmul": True}


def test_moe_grouped_gemm_without_the_compiler_is_refused():
    from megatron_glue.training.arguments import ArgumentError

    with pytest.raises(ArgumentError) as info:
        _parse("--moe-grouped-gemm", "--no-npu-compile")
    assert info.value.message.endswith(
        "--moe-grouped-gemm is the backend's grouped_matmul fusion (megatron-core's own grouped GEMM needs a CUDA "
        "package), which --no-npu-compile turns off; drop one of them")
    _parse("--no-npu-compile")  # without the flag: the eager experts


def test_moe_permute_fusion_is_the_permute_and_unpermute_rules():
    """Megatron-LM's --moe-permute-fusion and MindSpeed's --use-fused-moe-token-permute-and-unpermute, on both
    dispatchers: on by default (fusions "all"), added to a `fusions` list that leaves them out; megatron-core's own
    fused permute (Transformer Engine's) stays off in its config."""
    from megatron_glue.training.training import moe_fields

    for flag in ("--moe-permute-fusion", "--use-fused-moe-token-permute-and-unpermute"):
        for dispatcher in ("allgather", "alltoall"):
            args = _parse(flag, "--moe-token-dispatcher-type", dispatcher)
            assert args.npu_compile_options.get("fusions", "all") == "all"
            assert moe_fields(args)["moe_permute_fusion"] is False
        listed = _parse(flag, "--npu-compile-options", '{"fusions": ["swiglu"]}')
        assert listed.npu_compile_options["fusions"] == ["swiglu", "permute", "unpermute"]
        switched_off = _parse(flag, "--npu-compile-options", '{"fusions": {"permute": false, "unpermute": false}}')
        assert switched_off.npu_compile_options["fusions"] == {"permute": True, "unpermute": True}


def test_moe_permute_fusion_without_the_compiler_is_refused():
    from megatron_glue.training.arguments import ArgumentError

    for flag in ("--moe-permute-fusion", "--use-fused-moe-token-permute-and-unpermute"):
        with pytest.raises(ArgumentError) as info:
            _parse(flag, "--no-npu-compile")
        assert info.value.message.endswith(
            f"{flag} is the backend's permute and unpermute fusions (megatron-core's fused permute needs Transformer "
            "Engine), which --no-npu-compile turns off; drop one of them"), info.value.message
