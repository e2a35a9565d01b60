"""megatron_glue.training.arguments: the dialect of MindSpeed-LLM's training scripts. Each kind of flag (implemented, mapped
onto the backend, accepted with no effect, refused) with its exact message; every refused or unknown flag of a
command line reported at once; --help listing the refused and no-effect flags with their reasons; and real
MindSpeed-LLM launch lines (flags and values extracted from its scripts: fixtures/mindspeed_llm_scripts.json),
scaled down to a tiny model on 2 processes, through parse_args."""

from __future__ import annotations

import gc
import json
import re
import types
from pathlib import Path

import pytest

from bench.mindspeed_census import scale_down
from megatron_glue.training.arguments import (MOE_GROUPED_GEMM, NO_EFFECT, REFUSED, ArgumentError,
                                             DialectError, INSTRUCTION, LORA_MODULES_TO_SAVE, build_parser,
                                             parse_args)
from pretrain_runs import TINY, pretrain

PROG = "python -m megatron_glue.pretrain_gpt: error: "
JOB = [*TINY, "--train-iters", "5"]
SCRIPTS = json.loads((Path(__file__).parent / "fixtures" / "mindspeed_llm_scripts.json").read_text())["scripts"]


def script(name: str) -> list[str]:
    (key,) = [k for k in SCRIPTS if k.endswith("/" + name)]
    return SCRIPTS[key]


def error(argv, world_size=1) -> str:
    with pytest.raises(ArgumentError) as info:
        parse_args(argv, world_size=world_size)
    assert info.value.code == 2
    return info.value.message


# -- implemented ----------------------------------------------------------------------------------------------------

def test_transformer_impl_local_is_what_runs_and_transformer_engine_is_refused():
    assert parse_args(JOB).transformer_impl == "local"
    assert parse_args([*JOB, "--transformer-impl", "local"]).transformer_impl == "local"
    assert error([*JOB, "--transformer-impl", "transformer_engine"]) == PROG + (
        "--transformer-impl transformer_engine: Transformer Engine is CUDA-only and not used here; use "
        "--transformer-impl local (megatron-core's own layers, the default here)")


def test_context_parallel_size_1_is_accepted_with_its_algorithm():
    args = parse_args([*JOB, "--context-parallel-size", "1", "--context-parallel-algo", "megatron_cp_algo"])
    assert args.context_parallel_size == 1


def test_rope_flags():
    args = parse_args([*JOB, "--use-rotary-position-embeddings", "--rotary-base", "1000000"])
    assert (args.position_embedding_type, args.rotary_base, args.use_rope_scaling) == ("rope", 1000000, False)
    # MindSpeed-LLM's llama3 scaling is megatron-core's (factor as given; its other parameters fixed)
    llama31 = ["--rope-scaling-type", "llama3", "--rope-scaling-factor", "8.0", "--low-freq-factor", "1.0",
               "--high-freq-factor", "4.0", "--original-max-position-embeddings", "8192"]
    args = parse_args([*JOB, "--position-embedding-type", "rope", *llama31])
    assert (args.use_rope_scaling, args.rope_scaling_factor) == (True, 8.0)
    assert error([*JOB, "--position-embedding-type", "rope", *llama31[:-1], "32768"]) == PROG + (
        "--original-max-position-embeddings 32768: megatron-core's Llama 3 RoPE scaling fixes it at 8192; other "
        "values are not implemented here")
    assert error([*JOB, "--rope-scaling-type", "yarn", "--beta-fast", "32"]) == "\n".join([
        PROG + "2 flags of this command line are refused or unknown:",
        "  --beta-fast: YaRN / PLM RoPE scaling is not implemented here; Llama 3's scaling is "
        "(--rope-scaling-type llama3, or Megatron-LM's --use-rope-scaling), and LongRoPE's (--rope-scaling-type "
        "longrope)",
        "  --rope-scaling-type yarn: YaRN / PLM RoPE scaling is not implemented here; Llama 3's scaling is "
        "(--rope-scaling-type llama3, or Megatron-LM's --use-rope-scaling), and LongRoPE's (--rope-scaling-type "
        "longrope)"])


def test_pretrained_from_hf_tokenizer_and_padded_vocab_size():
    from megatron_glue.training.gpt import set_vocabulary

    hf = [f for f in JOB if f != "--mock-data"] + ["--data-path", "corpus_text_document"]
    args = parse_args([*hf, "--tokenizer-type", "PretrainedFromHF", "--tokenizer-name-or-path", "tok",
                       "--tokenizer-not-use-fast"])
    assert (args.tokenizer_type, args.tokenizer_name_or_path, args.tokenizer_use_fast) == ("PretrainedFromHF", "tok",
                                                                                          False)
    assert error([*hf, "--tokenizer-type", "PretrainedFromHF"]) == (
        "pretrain_gpt: error: --tokenizer-type PretrainedFromHF needs --tokenizer-name-or-path (a local directory)")
    # NullTokenizer --vocab-size 500: 501 ids, Megatron pads to 512; --padded-vocab-size is taken as given
    for given, rows in ((None, 512), (600, 600)):
        args = parse_args([*JOB, *(["--padded-vocab-size", str(given)] if given else [])])
        set_vocabulary(args)
        assert (args.orig_vocab_size, args.padded_vocab_size) == (501, rows)
    args = parse_args([*JOB, "--padded-vocab-size", "400"])
    with pytest.raises(ArgumentError) as info:
        set_vocabulary(args)
    assert info.value.message == ("pretrain_gpt: error: --padded-vocab-size 400 is smaller than the model's "
                                  "vocabulary (501 tokens); give at least 501")


def test_qk_layernorm_and_softmax_in_fp32_reach_the_model(megatron_cpu):
    from megatron_glue.training import gpt as pretrain_gpt, training
    from megatron_glue.capture.models import init_single_process

    init_single_process()
    args = parse_args([*JOB, "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--qk-layernorm",
                       "--attention-softmax-in-fp32", "--spec", "mindspeed_llm.tasks.models.spec.qwen3_spec",
                       "layer_spec"])
    pretrain_gpt.set_vocabulary(args)
    config = training.transformer_config(args, types.SimpleNamespace(device=types.SimpleNamespace(type="cpu")))
    assert config.attention_softmax_in_fp32 is True
    model = pretrain_gpt.model_provider(args, config)
    for layer in model.decoder.layers:
        for norm in (layer.self_attention.q_layernorm, layer.self_attention.k_layernorm):
            assert type(norm).__name__ != "IdentityOp" and tuple(norm.weight.shape) == (args.kv_channels,)
    plain = parse_args(JOB)
    pretrain_gpt.set_vocabulary(plain)
    assert training.transformer_config(plain, types.SimpleNamespace(
        device=types.SimpleNamespace(type="cpu"))).attention_softmax_in_fp32 is False  # Megatron-LM's default
    layer = pretrain_gpt.model_provider(plain, config).decoder.layers[0]
    assert type(layer.self_attention.q_layernorm).__name__ == "IdentityOp"


@pytest.mark.training
def test_qk_layernorm_trains_compiled(tmp_path):
    run = pretrain(tmp_path, "--train-iters", "12", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
                   "--swiglu", "--ffn-hidden-size", "128", "--qk-layernorm").check()
    losses = run.losses
    assert len(losses) == 12 and sum(losses[-3:]) < sum(losses[:3]), losses


def test_spec_names_the_layers_built_and_refuses_the_others():
    assert parse_args([*JOB, "--spec", "mindspeed_llm.tasks.models.spec.qwen3_spec", "layer_spec"]).spec == [
        "mindspeed_llm.tasks.models.spec.qwen3_spec", "layer_spec"]
    assert parse_args([*JOB, "--spec", "mindspeed_llm.tasks.models.spec.gemma2_spec", "layer_spec"]).spec[0] == (
        "mindspeed_llm.tasks.models.spec.gemma2_spec")
    assert error([*JOB, "--spec", "mindspeed_llm.tasks.models.spec.plm_spec", "layer_spec"]) == PROG + (
        "--spec mindspeed_llm.tasks.models.spec.plm_spec layer_spec: PLM's layer (MLA, squared ReLU) is not "
        "implemented here; the specs built here: mindspeed_llm.tasks.models.spec.qwen3_spec layer_spec, "
        "mindspeed_llm.tasks.models.spec.gemma2_spec layer_spec, mindspeed_llm.tasks.models.spec.qwen3_next_spec "
        "layer_spec (or leave --spec out: megatron-core's local GPT "
        "layer)")
    assert error([*JOB, "--spec", "my.module", "my_spec"]) == PROG + (
        "--spec my.module my_spec: this layer spec is not one this job builds; the specs built here: "
        "mindspeed_llm.tasks.models.spec.qwen3_spec layer_spec, mindspeed_llm.tasks.models.spec.gemma2_spec "
        "layer_spec, mindspeed_llm.tasks.models.spec.qwen3_next_spec layer_spec (or leave --spec out: megatron-core's "
        "local GPT layer)")


def test_handler_name_only_for_preprocessed_pretraining_data(tmp_path):
    assert parse_args([*JOB, "--handler-name", "GeneralPretrainHandler", "--workers", "4"]).handler_name == (
        "GeneralPretrainHandler")
    assert error([*JOB, "--handler-name", "AlpacaStyleInstructionHandler"]) == PROG + (
        "--handler-name AlpacaStyleInstructionHandler: " + INSTRUCTION)  # instruction data: --is-instruction-dataset
    assert error([*JOB, "--handler-name", "R1AlpacaStyleInstructionHandler", "--is-instruction-dataset"]) == PROG + (
        "--handler-name R1AlpacaStyleInstructionHandler: " + INSTRUCTION)
    raw = tmp_path / "corpus.jsonl"
    raw.write_text('{"text": "a"}\n')
    flags = [f for f in JOB if f != "--mock-data"]
    assert error([*flags, "--data-path", str(raw), "--handler-name", "GeneralPretrainHandler"]) == PROG + (
        f"--data-path {raw}: preprocessing raw data when the job starts (MindSpeed-LLM's --handler-name) is not "
        f"implemented here; write a .bin/.idx prefix with `npu-compile preprocess --input {raw} ...` and give the "
        "prefix")


def test_no_shared_storage_on_one_node_only(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert parse_args([*JOB, "--no-shared-storage"], world_size=2).no_shared_storage
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert error([*JOB, "--no-shared-storage"], world_size=2) == PROG + (
        "--no-shared-storage: this job runs on 2 nodes, and building the dataset index on each node is not "
        "implemented here; put --data-path and --data-cache-path on storage every node sees and drop the flag")


def test_enable_hf2mg_convert_needs_load_and_a_family_the_converter_has():
    from megatron_glue.convert.at_start import refusal

    args = parse_args([*JOB, "--enable-hf2mg-convert", "--model-type-hf", "llama2", "--load", "hf"])
    assert (args.model_type_hf, refusal(args)) == ("llama2", None)
    assert refusal(parse_args([*JOB, "--enable-hf2mg-convert", "--model-type-hf", "qwen25", "--load", "hf"])) is None
    assert error([*JOB, "--enable-hf2mg-convert"]) == (
        "pretrain_gpt: error: --enable-hf2mg-convert needs --load, the HuggingFace folder to start from")
    line = refusal(parse_args([*JOB, "--enable-hf2mg-convert", "--model-type-hf", "deepseek3", "--load", "hf"]))
    assert re.fullmatch(re.escape("--model-type-hf deepseek3: converting deepseek3 weights at start is not implemented "
                                  "here (the converter's families: ") + r"[a-z0-9., -]+" + re.escape(
        "); start from a Megatron checkpoint without --enable-hf2mg-convert"), line), line
    assert "llama2, llama3" in line and "qwen25" in line


def test_mindspeed_memory_switches_are_refused_naming_the_feature():
    """--reuse-fp32-param, --recompute-activation-function, --swap-attention and O2 are implemented
    (test_reuse_fp32_param.py, test_recompute_activation_function.py, test_swap_attention.py, test_o2.py); the
    optimizer swap is refused, naming what to do instead."""
    assert error([*JOB, "--swap-attention", "--swap-optimizer", "--swap-optimizer-times", "2"]) == "\n".join([
        PROG + "2 flags of this command line are refused or unknown:",
        "  --swap-optimizer: MindSpeed's swap of optimizer state to host memory is not implemented here; shard it "
        "over DP with --use-distributed-optimizer",
        "  --swap-optimizer-times: MindSpeed's swap of optimizer state to host memory is not implemented here; "
        "shard it over DP with --use-distributed-optimizer"])


def test_manual_gc_disables_and_collects_as_megatron_lm(monkeypatch):
    """gc.disable() + gc.collect() before the first iteration, gc.collect() every --manual-gc-interval."""
    from megatron_glue.training import training

    events = []
    fake_gc = types.SimpleNamespace(disable=lambda: events.append("disable"),
                                    collect=lambda generation=2: events.append(f"collect{generation}"))
    monkeypatch.setattr(training, "gc", fake_gc)
    monkeypatch.setattr(training, "train_step", lambda *a: (events.append("step") or ({"lm loss": 1.0}, False, 1.0)))
    monkeypatch.setattr(training, "_broadcast_from_last_stage", lambda losses, keys: losses)
    args = parse_args([*JOB, "--train-iters", "5", "--manual-gc", "--manual-gc-interval", "2", "--log-interval", "100"])
    optimizer = types.SimpleNamespace(param_groups=[{"lr": 1.0}], get_loss_scale=lambda: types.SimpleNamespace(
        item=lambda: 1.0))
    from megatron_glue.training.log import TensorBoard

    metrics = types.SimpleNamespace(step=lambda loss: None, record=lambda *a, **k: None, tensorboard=TensorBoard(None))
    import torch

    where = types.SimpleNamespace(device=torch.device("cpu"))  # the job's monitor reads the device's memory
    training._train(args, None, [], optimizer, None, None, None, training.State(), metrics, 1, where)
    assert events == ["disable", "collect2", "step", "step", "collect2", "step", "step", "collect2", "step"]
    assert gc.isenabled()  # the real collector was not touched


def test_num_workers_reach_the_loader(megatron_cpu):
    from megatron_glue.training import training
    from megatron_glue.capture.models import init_single_process

    init_single_process()
    seen = []
    chunk = types.SimpleNamespace(pre_process=True, post_process=True)
    training._iterators(parse_args([*JOB, "--num-workers", "3"]), lambda ds, **kw: seen.append(kw["num_workers"]),
                        ("train", None, None), (0, 0), [chunk])
    assert seen == [3]


def test_log_throughput_is_megatron_lms_model_flops():
    """Megatron-LM's count for a GPT with MHA and ffn = 4h: 72·B·s·L·h²·(1 + s/(12h) + V/(12·L·h)) (the attention
    matrix counted half, as causal), here through the job's own args."""
    from megatron_glue.training.gpt import set_vocabulary
    from megatron_glue.training.log import iteration_line, num_floating_point_operations

    args = parse_args([*JOB, "--log-throughput"])
    set_vocabulary(args)
    B, s, L, h, V = 8, 32, 2, 64, args.padded_vocab_size
    assert num_floating_point_operations(args, B) == pytest.approx(72 * B * s * L * h * h * (
        1 + s / (12 * h) + V / (12 * L * h)), rel=1e-12)
    line = iteration_line(iteration=1, train_iters=5, consumed_samples=8, elapsed_ms=100.0, learning_rate=1e-3,
                          global_batch_size=8, losses={}, loss_scale=1.0, grad_norm=None, skipped=0, nan=0,
                          tokens_per_sec=1.0, peak_mb=1.0, tflops_per_device=12.34)
    assert " elapsed time per iteration (ms): 100.0 | throughput per GPU (TFLOP/s/GPU): 12.3 |" in line


def test_log_throughput_by_hand_for_a_gqa_swiglu_model():
    """Megatron-LM's num_floating_point_operations (core_v0.16.1 training.py) worked by hand for h=64, 4 heads of 16
    in 2 query groups, SwiGLU ffn 128, 2 layers, s=32, padded vocabulary 512, batch 8. Per token and layer,
    3 (fwd, wgrad, dgrad) x 2 (FMA): attention h(q + 2kv) + qs + qh = 64·128 + 64·32 + 64·64 = 14336 -> 86016;
    MLP 3·h·ffn = 24576 -> 147456; logits h·V = 32768 -> 196608. 256 tokens x (2 x 233472 + 196608)."""
    from megatron_glue.training.log import num_floating_point_operations

    args = parse_args(["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--kv-channels", "16",
                       "--group-query-attention", "--num-query-groups", "2", "--swiglu", "--ffn-hidden-size", "128",
                       "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "8",
                       "--mock-data", "--vocab-size", "500",
                       "--train-iters", "1", "--lr", "1e-3"])
    args.padded_vocab_size = 512
    assert num_floating_point_operations(args, 8) == 256 * (2 * (86016 + 147456) + 196608) == 169869312


@pytest.mark.megatron_lines
def test_num_layer_list_is_megatron_cores_uneven_stages():
    """MindSpeed-LLM's --num-layer-list on megatron-core's own uneven stages: a first (or last) stage of its own
    size with equal stages between; any list through 0.16's pipeline_model_parallel_layout."""
    from megatron_glue.training.versions import uneven_stages

    args = parse_args([*TINY, "--train-iters", "5", "--num-layers", "4", "--pipeline-model-parallel-size", "2",
                       "--num-layer-list", "1,3"], world_size=2)
    assert args.num_layer_list == [1, 3]
    assert uneven_stages([1, 3]) == {"num_layers_in_first_pipeline_stage": 1}
    assert uneven_stages([2, 2]) == {}
    assert uneven_stages([3, 2, 2]) == {"num_layers_in_first_pipeline_stage": 3}
    assert uneven_stages([2, 2, 3]) == {"num_layers_in_last_pipeline_stage": 3}
    assert uneven_stages([1, 3, 3, 2]) == {"num_layers_in_first_pipeline_stage": 1,
                                           "num_layers_in_last_pipeline_stage": 2}
    assert uneven_stages([1, 2, 3]) == {"num_layers_in_first_pipeline_stage": 1,
                                        "num_layers_in_last_pipeline_stage": 3}
    from megatron_glue.capture.adaptations import megatron_core_in

    if megatron_core_in(">=0.16"):
        assert uneven_stages([1, 2, 3, 1]) == {"pipeline_model_parallel_layout": [
            ["embedding", "decoder"], ["decoder", "decoder"], ["decoder", "decoder", "decoder"], ["decoder", "loss"]]}
    else:
        with pytest.raises(ValueError) as info:
            uneven_stages([1, 2, 3, 1])
        assert str(info.value) == (
            "megatron-core 0.12.1 builds uneven stages only as a first and a last stage of their own sizes with equal "
            "stages between (num_layers_in_first/last_pipeline_stage); give such a list, or run on megatron-core 0.16, "
            "whose pipeline_model_parallel_layout takes any")


@pytest.mark.parametrize("flags, message", [
    (["--num-layer-list", "1;3"], "--num-layer-list '1;3': expected comma-separated layer counts, one per pipeline "
                                  "stage, e.g. 3,5"),
    (["--num-layer-list", "1,2"], "--num-layer-list 1,2: needs 2 stages (--pipeline-model-parallel-size) of at least "
                                  "one layer summing to --num-layers 4"),
    (["--num-layer-list", "0,4"], "--num-layer-list 0,4: needs 2 stages (--pipeline-model-parallel-size) of at least "
                                  "one layer summing to --num-layers 4"),
    (["--num-layer-list", "1,1,2"], "--num-layer-list 1,1,2: needs 2 stages (--pipeline-model-parallel-size) of at "
                                    "least one layer summing to --num-layers 4"),
    (["--num-layer-list", "1,3", "--num-layers-per-virtual-pipeline-stage", "1"],
     "--num-layer-list 1,3 and --num-layers-per-virtual-pipeline-stage are exclusive (as in MindSpeed-LLM): uneven "
     "stages are not split into virtual stages; drop one of them"),
    (["--num-layer-list", "1,3", "--recompute-granularity", "full", "--recompute-method", "uniform",
      "--recompute-num-layers", "2"],
     "--recompute-method uniform checkpoints chunks of --recompute-num-layers 2 layers, which must divide the 1 "
     "layers of each model chunk; use a divisor of 1"),
])
def test_num_layer_list_refusals(flags, message):
    job = [*TINY, "--train-iters", "5", "--num-layers", "4", "--pipeline-model-parallel-size", "2"]
    assert error([*job, *flags], world_size=2) == "pretrain_gpt: error: " + message
    assert error([*TINY, "--train-iters", "5", "--num-layers", "4", "--num-layer-list", "4"]) == (
        "pretrain_gpt: error: --num-layer-list 4 needs --pipeline-model-parallel-size > 1 (got 1): it splits the "
        "layers over pipeline stages")
    assert error([*job, "--num-layers", "3"], world_size=2) == (
        "pretrain_gpt: error: --num-layers 3 is not divisible by --pipeline-model-parallel-size 2; give one that is, "
        "or each stage's layers with --num-layer-list")


def test_tensorboard_flags():
    args = parse_args(JOB)
    assert (args.tensorboard_dir, args.tensorboard_log_interval, args.tensorboard_queue_size,
            args.log_loss_scale_to_tensorboard, args.log_timers_to_tensorboard) == (None, 1, 1000, True, False)
    args = parse_args([*JOB, "--tensorboard-dir", "tb", "--tensorboard-log-interval", "5",
                       "--no-log-loss-scale-to-tensorboard", "--log-validation-ppl-to-tensorboard"])
    assert (args.tensorboard_dir, args.tensorboard_log_interval, args.log_loss_scale_to_tensorboard,
            args.log_validation_ppl_to_tensorboard) == ("tb", 5, False, True)
    assert error([*JOB, "--tensorboard-dir", "tb", "--tensorboard-log-interval", "0"]) == (
        "pretrain_gpt: error: --tensorboard-log-interval 0 must be >= 1")


def test_tensorboard_dir_without_the_tensorboard_package_is_refused(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # what `import` meets without the package
    message = error([*JOB, "--tensorboard-dir", "tb"])
    assert message.startswith("pretrain_gpt: error: --tensorboard-dir needs the tensorboard package (")
    assert message.endswith("); install this project's 'megatron' extra (pip install 'npu_compile[megatron]') or "
                            "`pip install tensorboard`")


def test_exit_on_missing_checkpoint(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    run = pretrain(tmp_path / "run", "--train-iters", "2", "--load", str(empty), "--exit-on-missing-checkpoint")
    assert run.returncode == 1, run.output[-3000:]
    assert f"pretrain_gpt: error: --load {empty}: no checkpoint there (latest_checkpointed_iteration.txt missing), " \
           "and --exit-on-missing-checkpoint says to stop rather than start from random weights" in run.output


# -- mapped onto the backend ----------------------------------------------------------------------------------------

def test_coc_switches_map_onto_the_overlap_scheduler_and_mc2():
    assert parse_args([*JOB, "--use-ascend-coc", "--coc-fused-kernel"]).npu_compile_options == {}  # both on already
    assert error([*JOB, "--use-ascend-coc", "--npu-compile-options", '{"overlap": false}']) == (
        "pretrain_gpt: error: --use-ascend-coc is the backend's overlap scheduler (npu_compile option overlap), but "
        "--npu-compile-options gives overlap=false; drop one of them")
    assert error([*JOB, "--coc-fused-kernel", "--npu-compile-options", '{"mc2": "off"}']) == (
        "pretrain_gpt: error: --coc-fused-kernel is the backend's MC2 ops (npu_compile option mc2), but "
        "--npu-compile-options gives mc2='off'; drop one of them")


# -- accepted, no effect here ---------------------------------------------------------------------------------------

def test_no_effect_flags_parse_and_change_nothing_the_job_builds():
    given = ["--use-mcore-models", "--no-masked-softmax-fusion", "--no-gradient-accumulation-fusion",
             "--no-bias-swiglu-fusion", "--no-bias-dropout-fusion", "--no-rope-fusion", "--shape-order", "BNSD",
             "--tokenizer-padding-side", "left", "--loss-compute-mode", "default", "--model-type-hf", "llama2",
             "--tokenizer-not-use-fast", "--attention-mask-type", "causal"]
    args = parse_args([*JOB, *given])
    plain = parse_args(JOB)
    from megatron_glue.training import training

    where = types.SimpleNamespace(device=types.SimpleNamespace(type="cpu"))
    for a in (args, plain):
        a.padded_vocab_size = 512

    def fields(config):  # the init methods are partials, equal in what they do, not as objects
        return {k: v for k, v in vars(config).items() if "init_method" not in k}

    assert fields(training.transformer_config(args, where)) == fields(training.transformer_config(plain, where))
    assert args.npu_compile_options == plain.npu_compile_options
    assert error([*JOB, "--loss-compute-mode", "chunk"]) == PROG + (
        "--loss-compute-mode chunk: MindSpeed-LLM's chunked cross-entropy is not implemented here; the backend fuses "
        "the output layer with the loss (vocab_parallel_cross_entropy) instead")


# -- refused, all at once, and --help -------------------------------------------------------------------------------

def test_every_refused_and_unknown_flag_at_once():
    argv = [*JOB, "--num-experts", "8", "--gemm-gradient-accumulation-fusion", "--no-such-flag", "3",
            "--variable-seq-lengths", "--context-parallel-size", "2", "--cp-window-size", "2",
            "--lora-modules-to-save", "linear_qkv",
            "--no-such-switch"]
    with pytest.raises(DialectError) as info:
        parse_args(argv)
    assert info.value.message == "\n".join([
        PROG + "6 flags of this command line are refused or unknown:",
        "  --gemm-gradient-accumulation-fusion: " + MOE_GROUPED_GEMM,
        "  --variable-seq-lengths: " + INSTRUCTION,
        "  --lora-modules-to-save: " + LORA_MODULES_TO_SAVE,
        "  --cp-window-size 2: MindSpeed's double-ring attention (windows of the CP ring) is not implemented here; "
        "give --cp-window-size 1 (one ring)",
        "  --no-such-flag: unrecognized (not a flag of Megatron-LM, MindSpeed or MindSpeed-LLM that this job knows)",
        "  --no-such-switch: unrecognized (not a flag of Megatron-LM, MindSpeed or MindSpeed-LLM that this job "
        "knows)"])


def test_moe_settings_of_a_dense_model_configure_nothing():
    """MindSpeed-LLM's Qwen3 1.7B script passes --norm-topk-prob without experts: no MoE router reads it."""
    assert parse_args([*JOB, "--norm-topk-prob", "--moe-router-topk", "8"])
    # with experts: megatron-core's router already gives top-k probabilities that sum to 1 (test_moe.py,
    # test_norm_topk_prob_changes_nothing_in_megatron_cores_router); where MindSpeed-LLM's would differ, refused
    moe = [*JOB, "--num-experts", "8", "--moe-router-topk", "8", "--norm-topk-prob", "--disable-bias-linear"]
    assert parse_args(moe).norm_topk_prob
    assert error([*moe, "--moe-router-pre-softmax"]).endswith(
        "--norm-topk-prob with --moe-router-pre-softmax: MindSpeed-LLM's renormalisation of the top-k probabilities "
        "(undoing the softmax over all experts or the scaling) is not implemented here; drop one of them")


def test_a_bad_value_is_reported_with_the_refusals():
    message = error([*JOB, "--num-experts", "8", "--seq-aux", "--normalization", "Norm"])
    assert message == "\n".join([
        PROG + "2 flags of this command line are refused or unknown:",
        "  --seq-aux: " + REFUSED["--seq-aux"][1],
        "  argument --normalization: invalid choice: 'Norm' (choose from 'LayerNorm', 'RMSNorm')"])


def test_help_lists_refused_and_no_effect_flags_with_their_reasons():
    text = build_parser().format_help()
    refused = text.split("refused: not implemented here (each with the feature and what to do instead):")[1]
    no_effect = text.split("accepted, no effect here (each with the reason):")[1].split("refused:")[0]

    def flat(t):  # argparse wraps lines, at spaces and after hyphens
        return "".join(t.split())

    for flag, (_, reason) in REFUSED.items():
        assert re.search(rf"^  {re.escape(flag)}( VALUE)?( VALUE| \[VALUE \.\.\.\])?(\s|$)", refused, re.M), flag
        assert flat(reason) in flat(refused), flag
    for flag, (_, reason) in NO_EFFECT.items():
        assert re.search(rf"^  {re.escape(flag)}\b", no_effect, re.M) and flat(reason) in flat(no_effect), flag


def test_refused_flags_take_their_values():
    """A refused flag's values are its own (never read as flags of their own, or as unknown)."""
    assert error([*JOB, "--lora-modules-to-save", "linear_qkv", "linear_proj", "--fc-type", "h_to_4h"]) == "\n".join([
        PROG + "2 flags of this command line are refused or unknown:",
        "  --lora-modules-to-save: " + LORA_MODULES_TO_SAVE,
        "  --fc-type: MindSpeed-LLM's alternative MLP layouts (--fc-type) are not implemented here"])


# -- real MindSpeed-LLM launch lines, scaled down to 2 processes ----------------------------------------------------

def test_llama2_13b_script_passes():
    args = parse_args(scale_down(script("llama2/pretrain_llama2_13b_ptd.sh")), world_size=2)
    assert (args.tensor_model_parallel_size, args.sequence_parallel, args.tokenizer_type, args.ckpt_format) == (
        2, True, "PretrainedFromHF", "torch")
    assert (args.enable_hf2mg_convert, args.model_type_hf, args.load) == (True, "llama2", "ckpt")
    assert (args.position_embedding_type, args.normalization, args.swiglu, args.untie_embeddings_and_output_weights,
            args.add_bias_linear, args.attention_softmax_in_fp32) == ("rope", "RMSNorm", True, True, False, True)


def test_qwen25_7b_script_passes():
    args = parse_args(scale_down(script("qwen25/pretrain_qwen25_7b_32k_ptd.sh")), world_size=2)
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size) == (2, 1)
    assert (args.add_qkv_bias, args.num_query_groups, args.rotary_base, args.padded_vocab_size,
            args.log_throughput, args.norm_epsilon) == (True, 2, 1000000, 512, True, 1e-6)


def test_llama3_8b_script_passes():
    args = parse_args(scale_down(script("llama3/pretrain_llama3_8b_ptd.sh")), world_size=2)
    assert (args.position_embedding_type, args.rotary_base, args.make_vocab_size_divisible_by,
            args.num_query_groups, args.tokenizer_name_or_path) == ("rope", 500000, 16032, 2, "tokenizer")


def test_qwen3_8b_script_passes():
    """Qwen3's q/k norms, spec and HF family, and MindSpeed's --reuse-fp32-param (at 2 processes: TP 2, DP 1)."""
    from megatron_glue.convert.at_start import refusal

    args = parse_args(scale_down(script("qwen3/pretrain_qwen3_8b_4K_ptd.sh")), world_size=2, refusals=(refusal,))
    assert (args.qk_layernorm, args.model_type_hf, args.padded_vocab_size) == (True, "qwen3", 512)
    assert args.reuse_fp32_param and args.bf16 and args.use_distributed_optimizer


def test_a_moe_fine_tuning_script_parses_on_its_expert_grid():
    argv = scale_down(script("qwen3_moe/tune_qwen3_30b_a3b_4K_full_ptd.sh"))
    message = error(argv, world_size=2)
    lines = message.splitlines()
    # MoE itself is implemented (docs/moe.md), with its experts split over TP behind the all-to-all dispatcher
    # (--norm-topk-prob: no-op; --moe-permutation-async-comm: the overlap scheduler with the MoE token counts); at
    # world size 2 only its expert grid (ETP 2 x EP 2) does not fit
    assert len(lines) == 1 and lines[0].endswith(
        "error: world size 2 is not divisible by --expert-tensor-parallel-size 2 x --expert-model-parallel-size 2 x "
        "--pipeline-model-parallel-size 1; use sizes whose product divides 2")
    args = parse_args(argv, world_size=4)
    assert (args.expert_tensor_parallel_size, args.expert_model_parallel_size) == (2, 2)
    # --stage sft, --is-instruction-dataset, --prompt-type, its handler and --no-pad-to-seq-lengths are
    # posttrain_gpt's
    assert [line.split(":")[0].strip() for line in lines if INSTRUCTION in line] == []
