"""megatron-core's MoE layer on CPU through the "moe" adaptation group (megatron_glue.capture.adaptations), and the
job's MoE flags (docs/moe.md). In one process, seconds each; the EP=2 runs over gloo are marked `training`."""

from __future__ import annotations

import json

import pytest
import torch

from megatron_glue.capture.adaptations import groups_for, megatron_core_in, registry
from megatron_glue.capture.testing import adaptations_reverted
from megatron_glue.training.arguments import ArgumentError, parse_args
from pretrain_runs import TINY, assert_close, pretrain

MOE = [*TINY, "--train-iters", "2", "--num-experts", "4", "--disable-bias-linear"]


def _args(*flags, world_size=1):
    return parse_args([*MOE, *flags], world_size=world_size)


def _error(*flags, world_size=1) -> str:
    with pytest.raises(ArgumentError) as info:
        parse_args([*MOE, *flags], world_size=world_size)
    return info.value.message


# -- the flags ------------------------------------------------------------------------------------------------------

def test_moe_flags_become_megatron_cores_config_fields():
    from megatron_glue.training.training import moe_fields

    args = _args("--moe-router-topk", "2", "--moe-aux-loss-coeff", "0.01", "--moe-z-loss-coeff", "0.001",
                 "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
                 "--moe-router-topk-scaling-factor", "2.5", "--moe-token-dispatcher-type", "alltoall",
                 "--moe-router-load-balancing-type", "seq_aux_loss")
    fields = moe_fields(args)
    assert fields["num_moe_experts"] == 4 and fields["moe_ffn_hidden_size"] == args.ffn_hidden_size == 256
    assert fields["moe_router_load_balancing_type"] == "seq_aux_loss" and fields["moe_aux_loss_coeff"] == 0.01
    assert fields["moe_z_loss_coeff"] == 0.001 and fields["moe_router_score_function"] == "sigmoid"
    assert fields["moe_router_enable_expert_bias"] and fields["moe_router_topk_scaling_factor"] == 2.5
    assert fields["moe_token_dispatcher_type"] == "alltoall" and fields["expert_model_parallel_size"] == 1
    assert fields["expert_tensor_parallel_size"] == 1 and fields["moe_grouped_gemm"] is False
    assert moe_fields(parse_args([*TINY, "--train-iters", "2"])) == {}  # a dense model: none


def test_mindspeed_llm_shared_experts_and_first_dense_layers():
    args = _args("--num-layers", "6", "--moe-ffn-hidden-size", "32", "--n-shared-experts", "2",
                 "--first-k-dense-replace", "2", "--moe-layer-freq", "2")
    assert args.moe_shared_expert_intermediate_size == 64  # 2 x --moe-ffn-hidden-size
    assert args.moe_layer_freq == [0, 0, 1, 0, 1, 0]  # MindSpeed-LLM: layer i is MoE iff i >= k and i % freq == 0
    assert _args("--moe-layer-freq", "([0]+[1])").moe_layer_freq == [0, 1]  # Megatron-LM's list expression
    assert _args("--moe-shared-expert-intermediate-size", "48", "--n-shared-experts", "2") \
        .moe_shared_expert_intermediate_size == 48  # given wins, as in MindSpeed-LLM


def test_shared_expert_gate():
    """--moe-shared-expert-gate (Qwen2-MoE's gated shared expert): megatron-core 0.16's moe_shared_expert_gate, a
    gate_weight [1, hidden] in the shared experts; refused without shared experts and on 0.12."""
    from megatron_glue.training.training import moe_fields

    assert "moe_shared_expert_gate" not in moe_fields(_args())
    assert "--moe-shared-expert-gate gates the shared experts: give --moe-shared-expert-intermediate-size" in \
        _error("--moe-shared-expert-gate")
    if not megatron_core_in(">=0.16"):
        assert "--moe-shared-expert-gate needs megatron-core 0.16" in _error(
            "--moe-shared-expert-gate", "--moe-shared-expert-intermediate-size", "48")
        return
    args = _args("--moe-shared-expert-gate", "--moe-shared-expert-intermediate-size", "48")
    assert moe_fields(args)["moe_shared_expert_gate"] is True


def test_expert_parallel_sizes_are_checked_against_experts_and_world():
    assert _args("--expert-model-parallel-size", "2", world_size=2).expert_model_parallel_size == 2
    assert "--num-experts 4 is not divisible by --expert-model-parallel-size 3" in _error(
        "--expert-model-parallel-size", "3", "--global-batch-size", "6", world_size=3)
    assert "world size 2 is not divisible by --expert-tensor-parallel-size 1 x --expert-model-parallel-size 4" in \
        _error("--expert-model-parallel-size", "4", world_size=2)
    message = parse_args_error([*TINY, "--train-iters", "2", "--expert-model-parallel-size", "2"], 2)
    assert message.endswith("--expert-model-parallel-size 2 needs --num-experts (experts to spread over the ranks)")


def parse_args_error(argv, world_size):
    with pytest.raises(ArgumentError) as info:
        parse_args(argv, world_size=world_size)
    return info.value.message


def test_unimplemented_moe_parts_are_refused_with_the_reason():
    assert "--moe-token-dispatcher-type flex: the flex dispatcher needs DeepEP or HybridEP" in _error(
        "--moe-token-dispatcher-type", "flex")
    assert "--moe-router-load-balancing-type sinkhorn: sinkhorn balancing is not implemented here" in _error(
        "--moe-router-load-balancing-type", "sinkhorn")
    assert "--disable-bias-linear" in parse_args_error([*TINY, "--train-iters", "2", "--num-experts", "4"], 1)
    assert "--moe-aux-loss-coeff gives 2 coefficients for 1" in _error("--moe-aux-loss-coeff", "0.1", "0.2")


def test_tensor_parallel_experts_and_sequence_parallel():
    """Experts split over the TP ranks (--expert-tensor-parallel-size, by default TP) with every dispatcher (behind
    the all-to-all ones through the "moe" group's uneven gather over gloo, test_uneven_collectives.py); MoE at
    TP > 1 needs --sequence-parallel, as megatron-core's MoE layer does."""
    args = _args("--tensor-model-parallel-size", "2", "--sequence-parallel", world_size=2)
    assert args.expert_tensor_parallel_size == 2 and args.moe_token_dispatcher_type == "allgather"
    assert _args("--expert-tensor-parallel-size", "2", "--sequence-parallel", "--tensor-model-parallel-size", "2",
                 "--expert-model-parallel-size", "2", world_size=4).expert_tensor_parallel_size == 2
    for dispatcher in ("alltoall", "alltoall_seq"):
        args = _args("--tensor-model-parallel-size", "2", "--sequence-parallel", "--moe-token-dispatcher-type",
                     dispatcher, "--expert-model-parallel-size", "2", world_size=4)
        assert (args.expert_tensor_parallel_size, args.expert_model_parallel_size) == (2, 2)
    assert _args("--tensor-model-parallel-size", "2", "--sequence-parallel", "--moe-token-dispatcher-type",
                 "alltoall", "--expert-tensor-parallel-size", "1", world_size=2).expert_tensor_parallel_size == 1
    assert _error("--tensor-model-parallel-size", "2", world_size=2).endswith(
        "MoE at --tensor-model-parallel-size 2 needs --sequence-parallel (megatron-core's MoE layer refuses to train "
        "with tensor parallelism without it)")


EXTEND = ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--moe-token-dispatcher-type", "alltoall_seq",
          "--moe-tp-extend-ep"]


@pytest.mark.parametrize("tp, ep, pp, world", [(2, 1, 1, 2), (2, 2, 1, 8), (4, 2, 2, 32)])
def test_moe_tp_extend_ep_is_megatron_cores_layout_at_expert_tp_1(tp, ep, pp, world):
    """MindSpeed's --moe-tp-extend-ep (whole experts on the TP ranks, tokens exchanged over its expert TP x EP
    group) is megatron-core's ETP 1 with EP x TP expert-parallel ranks: megatron-core's expert-parallel groups are
    MindSpeed's TP x EP groups, rank for rank, so each rank holds the experts MindSpeed gives it ((e x TP + t) x
    local experts on, mindspeed/core/transformer/moe/moe_feature/overlap/moe_layer.py:37-43), and the expert
    data-parallel groups (the experts' gradient reduction) are the same."""
    from megatron.core.parallel_state import RankGenerator

    args = _args("--num-experts", "16", "--tensor-model-parallel-size", str(tp), "--sequence-parallel",
                 "--expert-model-parallel-size", str(ep), "--pipeline-model-parallel-size", str(pp),
                 "--num-layers", str(2 * pp), "--moe-token-dispatcher-type", "alltoall_seq", "--moe-tp-extend-ep",
                 "--global-batch-size", str(8 * world), world_size=world)
    assert (args.expert_model_parallel_size, args.expert_tensor_parallel_size) == (tp * ep, 1)
    # megatron-core 0.12's alltoall_seq takes ETP = TP only; 0.16 has no alltoall_seq
    assert args.moe_token_dispatcher_type == "alltoall"

    def experts(etp, ep_size):  # megatron-core's expert rank generator (parallel_state.initialize_model_parallel)
        return RankGenerator(tp=etp, ep=ep_size, dp=world // (etp * ep_size * pp), pp=pp, cp=1,
                             order="tp-cp-ep-dp-pp")

    mindspeed, ours = experts(tp, ep), experts(1, args.expert_model_parallel_size)
    dense = RankGenerator(tp=tp, ep=1, dp=world // (tp * pp), pp=pp, cp=1, order="tp-cp-ep-dp-pp")
    assert ours.get_ranks("ep") == mindspeed.get_ranks("tp-ep")
    assert ours.get_ranks("dp") == mindspeed.get_ranks("dp")

    def index(groups, rank):
        return next(group.index(rank) for group in groups if rank in group)

    for rank in range(world):  # megatron-core's experts of EP rank r: from r x local experts on (MoELayer)
        t, e = index(dense.get_ranks("tp"), rank), index(mindspeed.get_ranks("ep"), rank)
        assert index(ours.get_ranks("ep"), rank) == e * tp + t


def test_moe_tp_extend_ep_refusals():
    assert _error(*EXTEND, "--expert-tensor-parallel-size", "1", world_size=2).endswith(
        "--moe-tp-extend-ep spreads the experts over the tensor-parallel ranks instead of splitting each over "
        "--expert-tensor-parallel-size; 1 given with --tensor-model-parallel-size 2: drop one of them")
    assert _error(*EXTEND, "--moe-token-dispatcher-type", "allgather", world_size=2).endswith(
        "--moe-tp-extend-ep exchanges tokens by all-to-all over the tensor x expert-parallel ranks (MindSpeed: "
        "alltoall_seq only, docs/zh/features/megatron_moe/megatron-moe-tp-extend-ep.md); this job's "
        "--moe-token-dispatcher-type is 'allgather': give alltoall or alltoall_seq")
    assert _error(*EXTEND, "--num-experts", "6", "--expert-model-parallel-size", "2", world_size=4).endswith(
        "--moe-tp-extend-ep puts whole experts on each of --tensor-model-parallel-size 2 x "
        "--expert-model-parallel-size 2 ranks: --num-experts 6 must be divisible by 4")
    # the world checks see the extended layout: 1 x (2 x 2) x 1 expert ranks on 2 processes
    assert "world size 2 is not divisible by --expert-tensor-parallel-size 1 x --expert-model-parallel-size 4" in \
        _error(*EXTEND, "--expert-model-parallel-size", "2", world_size=2)


def test_moe_layer_freq_negative_as_megatron_core_reads_it():
    """MindSpeed-LLM's MoE scripts pass --moe-layer-freq -1 --first-k-dense-replace -1: every layer MoE, as
    megatron-core's i % freq == 0 and MindSpeed-LLM's i >= k read them; 0 is an error."""
    args = _args("--num-layers", "4", "--moe-layer-freq", "-1", "--first-k-dense-replace", "-1")
    assert args.moe_layer_freq == [1, 1, 1, 1]
    assert _args("--num-layers", "4", "--moe-layer-freq", "-2").moe_layer_freq == -2  # layers 0 and 2, as 2
    assert "--moe-layer-freq 0: layer i is an MoE layer when i % N == 0" in _error("--moe-layer-freq", "0")


@pytest.mark.skipif(not megatron_core_in(">=0.13"), reason="0.12 has alltoall_seq itself")
def test_alltoall_seq_is_alltoall_on_megatron_core_0_16(capsys):
    assert _args("--moe-token-dispatcher-type", "alltoall_seq").moe_token_dispatcher_type == "alltoall"
    assert "alltoall_seq is megatron-core 0.12's (removed in 0.13)" in capsys.readouterr().err


# -- the adaptations --------------------------------------------------------------------------------------------------

def _moe_layer(megatron_cpu, dispatcher="allgather", aux=0.01):
    import torch.nn.functional as F
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.spec_utils import build_module

    from megatron_glue.capture import quiet_megatron

    with quiet_megatron():
        config = TransformerConfig(
            num_layers=1, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, num_moe_experts=4,
            moe_router_topk=2, moe_ffn_hidden_size=64, add_bias_linear=False, gated_linear_unit=True,
            activation_func=F.silu, bias_activation_fusion=False, masked_softmax_fusion=False,
            bias_dropout_fusion=False, apply_rope_fusion=False, use_cpu_initialization=True, hidden_dropout=0.0,
            attention_dropout=0.0, moe_aux_loss_coeff=aux, moe_token_dispatcher_type=dispatcher)
        torch.manual_seed(0)
        return build_module(get_gpt_layer_local_spec(num_experts=4, normalization="RMSNorm"), config=config,
                            layer_number=1)


@pytest.fixture
def moe_group(megatron_cpu):
    before = set(registry.applied())
    registry.apply_groups(groups_for(training=True))  # as the job
    yield
    registry.revert(*[n for n in registry.applied() if n not in before])


def _grads(layer, module, scale=0.25):
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    x = torch.randn(8, 2, 32, generator=torch.Generator().manual_seed(1), requires_grad=True)
    out, _ = module(x, attention_mask=None)
    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor([scale]))  # as the schedule: after the forward
    out.sum().backward()
    grads = {n: p.grad.clone() for n, p in layer.named_parameters()}
    layer.zero_grad(set_to_none=True)
    return out.detach(), grads


@pytest.mark.skipif(not megatron_core_in(">=0.13"), reason="0.12's router has no TE gemm")
def test_router_without_transformer_engine(moe_group):
    layer = _moe_layer(None)
    with adaptations_reverted("router_gemm_without_te"):
        with pytest.raises(NameError, match="name 'te_general_gemm' is not defined"):
            _grads(layer, layer)
    _grads(layer, layer)


@pytest.mark.parametrize("dispatcher", ["allgather", "alltoall"])
def test_moe_layer_compiles_whole_with_the_aux_loss_and_matches_eager(moe_group, fresh_dynamo, dispatcher):
    """One graph, no break, with the aux loss on; outputs and every gradient (the aux loss's scale read when the
    backward runs) equal eager's."""
    import torch._dynamo.utils as dynamo_utils

    from megatron_glue.training.training import moe_dynamo_config

    layer = _moe_layer(None, dispatcher, aux=1.0)  # a coefficient that shows in the router's gradient
    out, grads = _grads(layer, layer)
    moe_dynamo_config()
    dynamo_utils.counters.clear()
    compiled_out, compiled_grads = _grads(layer, torch.compile(layer, backend="aot_eager"))
    assert dynamo_utils.counters["stats"]["unique_graphs"] == 1
    assert sum(dynamo_utils.counters["graph_break"].values()) == 0, dict(dynamo_utils.counters["graph_break"])
    torch.testing.assert_close(compiled_out, out, rtol=1e-5, atol=1e-6)
    for name, grad in grads.items():
        torch.testing.assert_close(compiled_grads[name], grad, rtol=1e-5, atol=1e-7, msg=name)
    # the scale as set after the compiled forward reaches the router's gradient
    _, scaled = _grads(layer, torch.compile(layer, backend="aot_eager"), scale=1.0)
    _, eager_scaled = _grads(layer, layer, scale=1.0)
    router = "mlp.router.weight"
    torch.testing.assert_close(scaled[router], eager_scaled[router], rtol=1e-5, atol=1e-7)
    assert not torch.allclose(scaled[router], grads[router], rtol=1e-3)


def _aux_loss_tracker() -> dict:
    from megatron.core import parallel_state
    from megatron.core.transformer.moe import moe_utils

    # 0.16.1 keeps the tracker in moe_utils, 0.12.1 in parallel_state
    get = getattr(moe_utils, "get_moe_layer_wise_logging_tracker", None) or \
        parallel_state.get_moe_layer_wise_logging_tracker
    return get()


@pytest.fixture
def empty_aux_loss_tracker():
    """A tracker sized by this test's layers (an entry keeps the layer count of the model that made it)."""
    _aux_loss_tracker().clear()
    yield
    _aux_loss_tracker().clear()


@pytest.mark.parametrize("dispatcher,graphs", [("allgather", 1), ("alltoall", 2)])
def test_moe_layers_compiled_one_by_one_share_their_graphs(moe_group, fresh_dynamo, empty_aux_loss_tracker,
                                                           dispatcher, graphs):
    """Each MoE layer of a 5-layer GPT compiled on its own, as the job does: a fixed number of graphs for all of
    them (the router's layer_number a symbol: moe_dynamo_config), where one per layer ran the layers past Dynamo's
    recompile limit uncompiled; loss, every gradient and the aux-loss tracker's per-layer values equal eager's."""
    import torch._dynamo.utils as dynamo_utils
    from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker

    from megatron_glue.capture import models
    from megatron_glue.training.training import moe_dynamo_config

    def run(compiled: bool):
        model = models.build_gpt_model(models.llama_config(
            hidden_size=32, num_attention_heads=4, num_layers=5, ffn_hidden_size=32, num_moe_experts=4,
            moe_router_topk=2, moe_ffn_hidden_size=32, moe_aux_loss_coeff=0.1, moe_token_dispatcher_type=dispatcher),
            64, 8, seed=0)
        if compiled:
            for layer in model.decoder.layers:
                layer.forward = torch.compile(layer.forward, backend="aot_eager")
        data = models.synthetic_batch(2, 8, 64, seed=0)
        steps = []
        for _ in range(2):  # the second step: the graphs of the state the first one leaves (tracker, sync point)
            clear_aux_losses_tracker()
            model.zero_grad(set_to_none=True)
            loss = models.loss_fn(model, data)
            loss.backward()
            steps.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()},
                          {name: entry["values"].clone() for name, entry in _aux_loss_tracker().items()}))
        return steps

    want = run(False)  # the tracker's entries exist from here on: no graph for their creation
    moe_dynamo_config()
    dynamo_utils.counters.clear()
    got = run(True)
    # alltoall: a second graph once the dispatcher's cuda_sync_point, set by its first call, is read as set
    assert dynamo_utils.counters["stats"]["unique_graphs"] == graphs
    assert sum(dynamo_utils.counters["graph_break"].values()) == 0
    for (loss, grads, tracker), (want_loss, want_grads, want_tracker) in zip(got, want):
        torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-6)
        for name, grad in want_grads.items():
            torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-6, msg=name)
        assert tracker.keys() == want_tracker.keys() and "load_balancing_loss" in tracker
        for name, values in want_tracker.items():
            assert values.shape == (5,) and bool((values != 0).all()), (name, values)
            torch.testing.assert_close(tracker[name], values, rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.slow
@pytest.mark.training  # about a minute of rule tracing: with the job runs (make test-training), not make test
def test_moe_layer_compiles_with_the_ascend_backend(moe_group, fresh_dynamo):
    """backend="ascend": one graph, the SwiGLU sites of the experts (whose rows are data-dependent token counts)
    declined with the reason in report.json, and the gradients equal eager's. One compile: the report is that of
    the graph whose gradients are compared (tracing the rules takes most of a minute beside other work)."""
    from megatron_glue.training.training import moe_dynamo_config
    from npu_compile.debug.report import collect

    layer = _moe_layer(None, "allgather", aux=1.0)
    out, grads = _grads(layer, layer)
    moe_dynamo_config()
    with collect() as reports:
        compiled_out, compiled_grads = _grads(layer, torch.compile(layer, backend="ascend",
                                                                   options={"cache": False}))
    (report,) = reports
    assert report.graph_breaks == 0 and report.graphs == ["forward", "backward"]
    declined = [u for u in report.unfused if u["rule"] == "swiglu"]
    assert declined and all(u["reason"].startswith("a data-dependent size decides the check") for u in declined)
    torch.testing.assert_close(compiled_out, out, rtol=1e-5, atol=1e-6)
    for name, grad in grads.items():
        torch.testing.assert_close(compiled_grads[name], grad, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_norm_topk_prob_changes_nothing_in_megatron_cores_router(moe_group, score):
    """--norm-topk-prob is accepted as changing nothing: MindSpeed-LLM divides the routed probabilities by their sum
    per token, and megatron-core's router (softmax after top-k; sigmoid normalised at top-k > 1) already gives sums
    of 1."""
    layer = _moe_layer(None)
    layer.mlp.router.config.moe_router_score_function = score
    layer.mlp.router.score_function = score
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(2))
    probs, routing_map = layer.mlp.router(x.view(8, 2, 32))
    assert routing_map.sum(-1).eq(2).all()
    torch.testing.assert_close(probs / probs.sum(-1, keepdim=True), probs, rtol=1e-6, atol=0)


def test_alltoall_dispatcher_without_cuda(moe_group):
    layer = _moe_layer(None, "alltoall")
    with adaptations_reverted("moe_split_sizes_on_host"):  # megatron-core's host copy on a CUDA side stream
        with pytest.raises(AssertionError, match="Torch not compiled with CUDA enabled"):
            _grads(layer, layer)
    _grads(layer, layer)


def test_moe_group_reverts_cleanly(megatron_cpu):
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    backward = moe_utils.MoEAuxLossAutoScaler.__dict__["backward"]
    dtoh = token_dispatcher.MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize
    before = set(registry.applied())
    registry.apply_groups(["moe"])
    assert moe_utils.MoEAuxLossAutoScaler.__dict__["backward"] is not backward
    registry.revert(*[n for n in registry.applied() if n not in before])
    assert moe_utils.MoEAuxLossAutoScaler.__dict__["backward"] is backward
    assert token_dispatcher.MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize is dtoh
    assert not hasattr(moe_utils, "te_general_gemm")


# -- the job over gloo processes: each layout equals one process -----------------------------------------------------

# two iterations (the second's loss and gradients come after one step), no evaluation (its no-grad graphs would be
# compiled too); the aux loss on, so the router's gradient carries it
LAYOUT_FLAGS = [*MOE[len(TINY):], "--moe-aux-loss-coeff", "0.01", "--moe-router-topk", "2", "--train-iters", "2",
                "--eval-iters", "0"]
TP2_SP = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]


@pytest.fixture(scope="module")
def moe_one_process(tmp_path_factory):
    """A checkpoint of the model after one iteration (every layout below loads it, --finetune: the same weights
    whatever the layout's own initialisation), and one process trained from it, eager, with the allgather dispatcher
    (at EP=1 the alltoall dispatcher computes the same)."""
    folder = tmp_path_factory.mktemp("moe_one_process")
    pretrain(folder / "start", *MOE[len(TINY):], "--train-iters", "1", "--save", str(folder / "ckpt"),
             "--no-npu-compile").check()
    start = ["--load", str(folder / "ckpt"), "--finetune"]
    return start, pretrain(folder / "one", *LAYOUT_FLAGS, *start, "--no-npu-compile").check()


def _moe_rows(run, key):
    return [r[key] for r in run.rows("train")]


# Every (dispatcher, compiled or eager) pair at EP=2, in four launches: 2 processes EP=2 (DP=2 for the dense part),
# compiled with allgather and eager with alltoall; 4 processes TP=2 x PP=2 x EP=2 (alltoall, experts whole: ETP=1)
# and TP=2 x EP=2 with the experts split over the TP ranks (ETP=2 by default) behind each dispatcher (alltoall_seq
# on 0.12 only), eager; MindSpeed's --moe-tp-extend-ep on 2 processes. Compiled at TP=2 and PP=2 (four processes
# compiling on two cores: minutes) is in `python -m bench.moe_parallel`; the uneven gather compiled is in
# test_uneven_collectives.py.
LAYOUTS = {
    "ep2-allgather-compiled": (2, ["--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "allgather"]),
    "ep2-alltoall-eager": (2, ["--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall",
                               "--no-npu-compile"]),
    "tp2-pp2-ep2-alltoall-eager": (4, [*TP2_SP, "--pipeline-model-parallel-size", "2", "--expert-model-parallel-size",
                                       "2", "--expert-tensor-parallel-size", "1", "--moe-token-dispatcher-type",
                                       "alltoall", "--no-npu-compile"]),
    "tp2-etp2-ep2-allgather-eager": (4, [*TP2_SP, "--expert-model-parallel-size", "2", "--moe-token-dispatcher-type",
                                         "allgather", "--no-npu-compile"]),
    # the experts split over the TP ranks behind the all-to-all dispatchers: the tokens gathered over the expert-TP
    # group in counts that differ per rank (the "moe" group's uneven_gather_on_gloo)
    "tp2-etp2-ep2-alltoall-eager": (4, [*TP2_SP, "--expert-model-parallel-size", "2", "--moe-token-dispatcher-type",
                                        "alltoall", "--no-npu-compile"]),
    "tp2-etp2-ep2-alltoall_seq-eager": (4, [*TP2_SP, "--expert-model-parallel-size", "2",
                                            "--moe-token-dispatcher-type", "alltoall_seq", "--no-npu-compile"]),
    # MindSpeed's --moe-tp-extend-ep: ETP 1, EP 2 over the TP ranks
    "tp2-extend-ep-eager": (2, [*TP2_SP, "--moe-token-dispatcher-type", "alltoall_seq", "--moe-tp-extend-ep",
                                "--no-npu-compile"]),
}


@pytest.mark.slow
@pytest.mark.training
# megatron_lines: the eager layouts, where the logged load-balancing loss is averaged over DP by the job on 0.12
# (versions.average_load_balancing_over_dp; without it 3.1e-4 off at EP=2)
@pytest.mark.parametrize("layout", [pytest.param(name, marks=[pytest.mark.megatron_lines] if name.endswith("eager")
                                                 else []) for name in LAYOUTS])
def test_parallel_layouts_equal_one_process(moe_one_process, tmp_path, layout):
    """EP=2 (allgather and alltoall), TP=2 with EP=2 (experts whole or split over the TP ranks, each dispatcher),
    PP=2 with EP=2 and MindSpeed's --moe-tp-extend-ep, compiled and eager, equal one process of the same global batch: losses, gradient norms and the load-balancing
    loss, fp32 1e-5."""
    if layout.endswith("alltoall_seq-eager") and megatron_core_in(">=0.13"):
        pytest.skip("megatron-core 0.13 removed alltoall_seq; the job runs the alltoall dispatcher for it (the "
                    "tp2-etp2-ep2-alltoall-eager layout)")
    start, one = moe_one_process
    nproc, flags = LAYOUTS[layout]
    run = pretrain(tmp_path / layout, *LAYOUT_FLAGS, *start, *flags, nproc=nproc).check()
    assert_close(run.losses, one.losses, what="lm loss")
    assert_close(_moe_rows(run, "grad_norm"), _moe_rows(one, "grad_norm"), what="grad norm")
    assert_close(_moe_rows(run, "load_balancing_loss"), _moe_rows(one, "load_balancing_loss"),
                 what="load_balancing_loss")
    assert " load_balancing_loss: " in run.output


@pytest.mark.parametrize("name, dispatcher", [("pretrain_qwen3_480b_4k_A3_ptd.sh", "alltoall"),
                                              ("pretrain_qwen3_30b_a3b_4K_ptd.sh", "alltoall_seq")])
def test_mindspeed_llm_moe_scripts_refuse_only_what_the_bench_drops(name, dispatcher):
    """MindSpeed-LLM master's Qwen3-MoE pretraining scripts, scaled down as bench.mindspeed_scripts runs them: the
    argument check refuses exactly the flags the bench drops (each with its reason), and without them the script
    parses: --moe-layer-freq -1 --first-k-dense-replace -1 make every layer MoE, --norm-topk-prob changes nothing."""
    from test_arguments import script

    from bench.mindspeed_census import scale_down
    from bench.mindspeed_scripts import MOE_DROPPED, MOE_DROPPED_COMBINED, MOE_SIZES, _drop, _set
    from megatron_glue.convert.at_start import refusal

    argv = _set(scale_down(script(f"qwen3_moe/{name}")), MOE_SIZES)
    assert f"--moe-token-dispatcher-type {dispatcher}" in " ".join(argv) and "--norm-topk-prob" in argv
    with pytest.raises(ArgumentError) as info:
        parse_args(argv, world_size=2, refusals=(refusal,))
    lines = info.value.message.splitlines()  # one refusal: one line; several: a header, then one line each
    refused = [line.strip().split(":")[0] for line in lines[1:]] if len(lines) > 1 else [lines[0].split(": ")[2]]
    assert sorted(refused) == sorted(f for f in MOE_DROPPED if f in argv)
    if "--swap-attention" in argv:  # implemented, but not beside Megatron's full recompute, which they also ask
        with pytest.raises(ArgumentError, match="--swap-attention with --recompute-granularity full: MindSpeed pairs"):
            parse_args(_drop(argv, MOE_DROPPED)[0], world_size=2, refusals=(refusal,))
    args = parse_args(_drop(argv, MOE_DROPPED + MOE_DROPPED_COMBINED)[0], world_size=2, refusals=(refusal,))
    assert args.moe_layer_freq == [1, 1, 1, 1] and args.norm_topk_prob and args.num_experts == 4
    assert args.moe_token_dispatcher_type == (dispatcher if not megatron_core_in(">=0.13") else "alltoall")


# -- MindSpeed-LLM's router switches --------------------------------------------------------------------------------

def test_router_gating_in_fp32_is_megatron_cores_fp32_router_dtype(moe_group):
    """MindSpeed-LLM's --router-gating-in-fp32 (mindspeed_llm/core/transformer/moe/router.py:497-515: the router's
    linear on float32 copies of its input and weight) is megatron-core's moe_router_dtype fp32: the job's
    TransformerConfig gets the field, and megatron-core's router gives MindSpeed-LLM's logits and gradients, bit for
    bit, for bf16 input and weight."""
    from megatron_glue.training.training import moe_fields

    assert moe_fields(_args("--router-gating-in-fp32"))["moe_router_dtype"] == "fp32"
    assert moe_fields(_args())["moe_router_dtype"] is None
    assert "--router-gating-in-fp32 with --moe-router-dtype fp64: one says float32 logits, the other float64" in \
        _error("--router-gating-in-fp32", "--moe-router-dtype", "fp64")
    assert not parse_args([*TINY, "--train-iters", "2", "--router-gating-in-fp32"]).moe_router_dtype  # no experts

    router = _moe_layer(None).mlp.router.to(torch.bfloat16)
    router.config.moe_router_dtype = "fp32"
    x = torch.randn(6, 32, generator=torch.Generator().manual_seed(1)).bfloat16().requires_grad_()
    logits = router.gating(x)
    seed = torch.randn(6, 4, generator=torch.Generator().manual_seed(2))
    logits.backward(seed)
    # MindSpeed-LLM's: F.linear(input.float(), weight.float()), the casts differentiated back to bfloat16
    x_ms = x.detach().clone().requires_grad_()
    w_ms = router.weight.detach().clone().requires_grad_()
    want = torch.nn.functional.linear(x_ms.float(), w_ms.float())
    want.backward(seed)
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, want, rtol=0, atol=0)
    torch.testing.assert_close(x.grad, x_ms.grad, rtol=0, atol=0)
    torch.testing.assert_close(router.weight.grad, w_ms.grad, rtol=0, atol=0)


@pytest.mark.parametrize("flags,message", [
    (("--seq-aux",), "--seq-aux: MindSpeed-LLM's sequence-wise balance loss (--seq-aux: apply_seq_aux_loss after the "
                     "routing"),
    (("--topk-softmax-in-fp32",), "--topk-softmax-in-fp32: MindSpeed-LLM's --topk-softmax-in-fp32 (with "
                                  "--moe-router-pre-softmax the softmax scores are kept in float32"),
    (("--moe-router-load-balancing-type", "softmax_topk"),
     "--moe-router-load-balancing-type softmax_topk: MindSpeed-LLM's softmax_topk routing"),
    (("--moe-router-load-balancing-type", "pai_megatron_aux_loss"),
     "--moe-router-load-balancing-type pai_megatron_aux_loss: MindSpeed-LLM's pai_megatron_aux_loss routing"),
    (("--moe-router-load-balancing-type", "sparsemixer_topk"),
     "--moe-router-load-balancing-type sparsemixer_topk: MindSpeed-LLM's sparsemixer_topk routing"),
    (("--moe-router-load-balancing-type", "group_limited_greedy"),
     "--moe-router-load-balancing-type group_limited_greedy: MindSpeed-LLM's group_limited_greedy routing"),
    (("--moe-router-score-function", "sqrtsoftplus"),
     "--moe-router-score-function sqrtsoftplus: MindSpeed-LLM's sqrtsoftplus scores (sqrt(softplus(logits))"),
])
def test_mindspeed_llm_router_switches_megatron_core_lacks_are_refused(flags, message):
    """Refused with what differs from megatron-core (not argparse's "invalid choice"); without --num-experts they
    configure nothing and are accepted, as MindSpeed-LLM reads them only for experts."""
    assert message in _error(*flags)
    assert parse_args([*TINY, "--train-iters", "2", *flags])
