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
    assert "--expert-tensor-parallel-size 2: experts split over tensor-parallel ranks are not implemented here" in \
        _error("--expert-tensor-parallel-size", "2", "--expert-model-parallel-size", "1", world_size=2)
    assert "(it defaults to --tensor-model-parallel-size)" in _error("--tensor-model-parallel-size", "2",
                                                                     world_size=2)
    assert "--moe-router-load-balancing-type sinkhorn: sinkhorn balancing is not implemented here" in _error(
        "--moe-router-load-balancing-type", "sinkhorn")
    assert "--disable-bias-linear" in parse_args_error([*TINY, "--train-iters", "2", "--num-experts", "4"], 1)
    assert "--moe-aux-loss-coeff gives 2 coefficients for 1" in _error("--moe-aux-loss-coeff", "0.1", "0.2")


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


@pytest.mark.slow
@pytest.mark.training  # about a minute of rule tracing: with the job runs (make test-training), not make test
def test_moe_layer_compiles_with_the_ascend_backend(moe_group, fresh_dynamo):
    """backend="ascend": one graph, the SwiGLU sites of the experts (whose rows are data-dependent token counts)
    declined with the reason in report.json, and the gradients equal eager's."""
    import npu_compile

    from megatron_glue.training.training import moe_dynamo_config

    layer = _moe_layer(None, "allgather", aux=1.0)
    out, grads = _grads(layer, layer)
    moe_dynamo_config()
    x = torch.randn(8, 2, 32, generator=torch.Generator().manual_seed(1), requires_grad=True)
    (report,) = npu_compile.explain(layer, x, attention_mask=None, options={"cache": False}).graphs
    assert report.graph_breaks == 0
    declined = [u for u in report.unfused if u["rule"] == "swiglu"]
    assert declined and all(u["reason"].startswith("a data-dependent size decides the check") for u in declined)
    compiled_out, compiled_grads = _grads(layer, torch.compile(layer, backend="ascend", options={"cache": False}))
    torch.testing.assert_close(compiled_out, out, rtol=1e-5, atol=1e-6)
    for name, grad in grads.items():
        torch.testing.assert_close(compiled_grads[name], grad, rtol=1e-5, atol=1e-6, msg=name)


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


# -- the job over gloo processes -------------------------------------------------------------------------------------

EP_FLAGS = ["--moe-aux-loss-coeff", "0.01", "--moe-router-topk", "2", "--train-iters", "3"]


@pytest.fixture(scope="module")
def moe_start(tmp_path_factory):
    folder = tmp_path_factory.mktemp("moe_start")
    pretrain(folder, *MOE[len(TINY):], "--train-iters", "1", "--save", str(folder / "ckpt"),
             "--no-npu-compile").check()
    return folder / "ckpt"


def _norms(run):
    return [r["grad_norm"] for r in run.rows("train")]


@pytest.mark.slow
@pytest.mark.training
@pytest.mark.parametrize("dispatcher", ["allgather", "alltoall"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_expert_parallel_2_equals_one_process(moe_start, tmp_path, dispatcher, compiled):
    """EP=2 over 2 gloo processes (DP=2 for the dense part) equals one process of the same global batch: losses,
    gradient norms and the load-balancing loss, fp32 1e-5."""
    flags = [*MOE[len(TINY):], *EP_FLAGS, "--moe-token-dispatcher-type", dispatcher, "--load", str(moe_start),
             "--finetune", *([] if compiled else ["--no-npu-compile"])]
    one = pretrain(tmp_path / "one", *flags, "--no-npu-compile").check()
    two = pretrain(tmp_path / "ep2", *flags, "--expert-model-parallel-size", "2", nproc=2).check()
    assert_close(two.losses, one.losses, what="lm loss")
    assert_close(_norms(two), _norms(one), what="grad norm")
    assert_close([r["load_balancing_loss"] for r in two.rows("train")],
                 [r["load_balancing_loss"] for r in one.rows("train")], what="load_balancing_loss")
    assert " load_balancing_loss: " in two.output
