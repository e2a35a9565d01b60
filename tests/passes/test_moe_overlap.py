"""The MoE token communication priced and overlapped (rule ``moe_token_hints``, MindSpeed's
``--moe-alltoall-overlap-comm`` / ``--moe-permutation-async-comm``; docs/moe.md, "Overlap of the token
communication"): balanced-routing hints for the data-dependent token counts, on a traced dispatch in one process,
and megatron-core's alltoall MoE layer with a shared expert at EP=2 over two gloo processes, compiled with and
without the rule: equal to eager in output and every gradient, and less exposed communication by the cost model
with it."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from npu_compile.passes.moe import token_hints

TOKENS, EXPERTS, TOPK, H = 12, 6, 2, 8


def _aten_forward(fn, *inputs):
    """The aten forward graph of ``fn`` as the backend gets it (Dynamo with its data-dependent-shape switches,
    AOT autograd), given to ``seen``; the function runs eagerly."""
    from functorch.compile import make_boxed_func
    from torch._functorch.aot_autograd import aot_module_simplified

    seen = []

    def backend(gm, example_inputs):
        def forward(g, _inputs):
            seen.append(g)
            return make_boxed_func(g.forward)
        return aot_module_simplified(gm, example_inputs, fw_compiler=forward)

    torch._dynamo.reset()
    with torch._dynamo.config.patch(capture_scalar_outputs=True, capture_dynamic_output_shape_ops=True):
        torch.compile(fn, backend=backend, fullgraph=True)(*inputs)
    torch._dynamo.reset()
    (gm,) = seen
    return gm


def _hint_of(gm, target, index=0):
    from torch.fx.experimental.symbolic_shapes import optimization_hint

    node = [n for n in gm.graph.nodes if n.target is target][index]
    return optimization_hint(node.meta["val"].shape[0], fallback=0)


def _dispatch(x, logits):
    """megatron-core's permute by a top-k routing map, then the tokens per expert as split sizes."""
    _, top = torch.topk(logits, TOPK, dim=-1)
    routing = torch.zeros_like(logits, dtype=torch.bool).scatter(1, top, True)
    idx = torch.arange(x.shape[0]).unsqueeze(0).expand(EXPERTS, -1).masked_select(routing.t().contiguous())
    rows = x.index_select(0, idx)
    return [t.sum() for t in torch.split(rows, routing.sum(0).tolist())]


def test_balanced_routing_hints():
    x, logits = torch.randn(TOKENS, H), torch.randn(TOKENS, EXPERTS)
    gm = _aten_forward(_dispatch, x, logits)
    aten = torch.ops.aten
    assert _hint_of(gm, aten.masked_select.default) == 0  # unhinted: the cost model's 0 rows
    hinted, why = token_hints(gm.graph)
    assert why is None
    # every token's k copies, and each expert an equal share of them
    assert _hint_of(gm, aten.masked_select.default) == TOKENS * TOPK
    (split,) = [n for n in gm.graph.nodes if n.target is aten.split_with_sizes.default]
    from torch.fx.experimental.symbolic_shapes import optimization_hint

    assert [optimization_hint(t.shape[0], fallback=0) for t in split.meta["val"]] == [TOKENS * TOPK // EXPERTS] * EXPERTS
    assert len(hinted) == 1 + EXPERTS
    assert token_hints(gm.graph) == ({}, "no data-dependent token counts in the graph")  # all set already


def test_no_hints_without_one_router():
    def two_routers(x, logits):
        a = _dispatch(x, logits)
        _, top = torch.topk(logits, 3, dim=-1)  # a second router over as many experts, another k
        return a, top

    gm = _aten_forward(two_routers, torch.randn(TOKENS, H), torch.randn(TOKENS, EXPERTS))
    assert token_hints(gm.graph) == ({}, f"top-k over {EXPERTS} columns with k = [2, 3]: routers of different k")

    def no_router(x, counts):
        return [t.sum() for t in torch.split(x, counts.tolist())]

    gm = _aten_forward(no_router, torch.randn(TOKENS, H), torch.tensor([5, 7]))
    assert token_hints(gm.graph) == ({}, "no router top-k in the graph")


# -- megatron-core's MoE layer at EP=2 ----------------------------------------------------------------------------

WORLD = 2
LAYER = dict(hidden=256, ffn=512, tokens=64)  # large enough that the cost model's compute can hide the comm


def _layer():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.spec_utils import build_module

    from megatron_glue.capture import quiet_megatron

    with quiet_megatron():
        config = TransformerConfig(
            num_layers=1, hidden_size=LAYER["hidden"], num_attention_heads=4, ffn_hidden_size=LAYER["ffn"],
            num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=LAYER["ffn"], add_bias_linear=False,
            gated_linear_unit=True, activation_func=F.silu, bias_activation_fusion=False,
            masked_softmax_fusion=False, bias_dropout_fusion=False, apply_rope_fusion=False,
            use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0, moe_aux_loss_coeff=1.0,
            moe_token_dispatcher_type="alltoall", expert_model_parallel_size=WORLD,
            moe_shared_expert_intermediate_size=LAYER["ffn"])
        torch.manual_seed(0)
        spec = get_gpt_layer_local_spec(num_experts=4, normalization="RMSNorm")
        return build_module(spec.submodules.mlp, config=config)


def _run(moe, module, rank):
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    x = torch.randn(LAYER["tokens"], 1, LAYER["hidden"], generator=torch.Generator().manual_seed(1 + rank),
                    requires_grad=True)
    out, _ = module(x)
    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor([0.25]))  # as the schedule: after the forward
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(2)))
    grads = {"input": x.grad.clone(), **{n: p.grad.clone() for n, p in moe.named_parameters()}}
    moe.zero_grad(set_to_none=True)
    return out.detach(), grads


def _worker(rank, store_path, results):
    os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, WORLD), rank=rank, world_size=WORLD)
    from megatron.core import parallel_state

    import npu_compile.comm.schedule as schedule
    from megatron_glue.capture.adaptations import groups_for, registry
    from megatron_glue.training.training import moe_dynamo_config
    from npu_compile.comm import simulate
    from npu_compile.debug.report import collect

    parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=WORLD)
    registry.apply_groups(groups_for(training=True))
    try:
        moe = _layer()
        want, want_grads = _run(moe, moe, rank)
        moe_dynamo_config()
        scheduled = []
        plan = schedule.schedule_overlap

        def keep(gm, *args, **kwargs):  # a copy of each graph as the overlap pass leaves it
            result = plan(gm, *args, **kwargs)
            scheduled.append(schedule.copy_module(gm))
            return result

        schedule.schedule_overlap = keep
        out = {}
        for hints in (False, True):
            torch._dynamo.reset()
            scheduled.clear()
            rules = ["grouped_matmul", "unpermute", *(["moe_token_hints"] if hints else [])]
            compiled = torch.compile(moe, backend="ascend",
                                     options={"target": "npu-sim", "fusions": rules, "cache": False})
            with collect() as reports:
                got, got_grads = _run(moe, compiled, rank)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
            for name, grad in want_grads.items():
                torch.testing.assert_close(got_grads[name], grad, rtol=1e-5, atol=1e-6, msg=name)
            (report,) = reports
            if not hints:  # the same schedule, priced with the token counts the rule would give
                for g in scheduled:  # the router's graph gives the hints (one shape environment for all)
                    token_hints(g.graph)
                repriced = sum(simulate(g).exposed_comm_us for g in scheduled)
            out[hints] = dict(comm=dict(report.comm), fusions=dict(report.fusions), breaks=report.graph_breaks,
                              unfused=[u for u in report.unfused if u.get("rule") == "moe_token_hints"],
                              repriced=repriced if not hints else None)
        schedule.schedule_overlap = plan
        results[rank] = out
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


@pytest.mark.gloo
def test_alltoall_layer_with_token_hints_equals_eager_and_exposes_less(tmp_path):
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_worker, args=(str(tmp_path / "store"), results), nprocs=WORLD, join=True)
        without, with_ = results[0][False], results[0][True]
    assert without["breaks"] == with_["breaks"] == 0
    # the dispatch's two all-to-alls (tokens, probs), the combine's, their gradients', the count all-gather
    assert with_["comm"]["collectives"] == without["comm"]["collectives"] == 7
    assert with_["fusions"]["moe_token_hints"] == 2 and with_["unfused"] == []  # token indices and probs permuted
    assert "moe_token_hints" not in without["fusions"]
    # without the rule the token counts the memory analysis sizes (the routed rows, the splits torch's asserts tie
    # to them: passes/unbacked_hints.py) price part of the traffic; the all-to-alls' received counts stay at 0 rows
    assert with_["comm"]["comm_us"] > 1.5 * without["comm"]["comm_us"]
    assert with_["comm"]["compute_us"] > without["comm"]["compute_us"]
    # priced alike, the schedule planned with the token counts leaves less of them exposed
    assert with_["comm"]["exposed_comm_us_after"] < without["repriced"], (with_, without)
    assert with_["comm"]["exposed_comm_us_after"] < with_["comm"]["exposed_comm_us_before"]

