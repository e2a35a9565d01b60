"""The training job's command line: Megatron-LM's `pretrain_gpt.py` flags, with their names, defaults and meanings.

`parse_args(argv, world_size)` returns an `argparse.Namespace` shaped like Megatron-LM's `args` (the same
attribute names), checked against the world size before anything is built. Flags are grouped as Megatron-LM
groups them in `--help`. Three kinds of flag exist here:

- implemented: Megatron-LM's meaning, end to end;
- MindSpeed's switches (`--use-flash-attn`, ...): Ascend users pass them today; here they name fusions of
  the `ascend` backend, which runs them by default, so they map onto its `fusions` option;
- known to Megatron-LM but not implemented (`NOT_IMPLEMENTED`): refused with a message that says so, never
  accepted and ignored. Anything else is argparse's "unrecognized arguments" error.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

# Megatron-LM flags this job does not implement, each with what to use instead (shown in the error).
NOT_IMPLEMENTED = {
    "--context-parallel-size": "context parallelism is not implemented; use TP/PP/DP",
    "--expert-model-parallel-size": "MoE is not implemented",
    "--num-experts": "MoE is not implemented",
    "--transformer-impl": "only the local (megatron-core, no Transformer Engine) layers exist here; drop the flag",
    "--train-samples": "give --train-iters",
    "--rampup-batch-size": "batch-size ramp-up is not implemented; give a fixed --global-batch-size",
    "--async-save": "asynchronous checkpoint saves are not implemented",
    "--use-checkpoint-args": "architecture flags must be given on the command line",
    "--tensorboard-dir": "use the metrics JSONL (--metrics-file) and the loss-curve PNG",
    "--wandb-project": "use the metrics JSONL (--metrics-file) and the loss-curve PNG",
    "--fp8-format": "fp8 is not implemented",
    "--fp8": "fp8 is not implemented",
    "--num-workers": "the data loader reads in the training process",
    "--data-args-path": "give --data-path",
    "--train-data-path": "give --data-path with --split",
    "--valid-data-path": "give --data-path with --split",
    "--test-data-path": "give --data-path with --split",
    "--lr-decay-samples": "give --lr-decay-iters",
    "--lr-warmup-samples": "give --lr-warmup-iters",
    "--lr-wsd-decay-style": "WSD schedules are not implemented",
    "--use-torch-fsdp2": "FSDP is not implemented; use --use-distributed-optimizer",
    "--use-megatron-fsdp": "FSDP is not implemented; use --use-distributed-optimizer",
    "--num-distributed-optimizer-instances": "only one distributed-optimizer instance is supported",
    "--tp-comm-overlap": "TE's TP comm overlap is not used; the compiler overlaps TP collectives itself",
    "--use-tp-pp-dp-mapping": "the default rank order (tp-cp-ep-dp-pp) is used",
    "--exit-duration-in-mins": "give --exit-interval",
    "--exit-signal-handler": "not implemented; give --exit-interval",
    "--ckpt-convert-format": "use `npu-compile convert`",
    "--auto-detect-ckpt-format": "give --ckpt-format",
}

# MindSpeed's switches -> the backend's fusion rules they name (all on by default in the backend).
MINDSPEED_FUSIONS = {
    "use_flash_attn": ("attention",),
    "use_fused_rmsnorm": ("add_rms_norm", "rms_norm"),
    "use_fused_layer_norm": ("add_layer_norm",),
    "use_fused_swiglu": ("swiglu",),
    "use_fused_rotary_pos_emb": ("rotary",),
}


class ArgumentError(SystemExit):
    """A bad command line: one line naming what was wrong and what would be right (exit status 2)."""

    def __init__(self, message: str):
        self.message = message
        super().__init__(2)

    def __str__(self):
        return self.message


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser whose own errors (unknown flag, bad value) are ArgumentError's one line; the converter's
    command line uses it too."""

    def error(self, message):  # argparse's own errors (unknown flag, bad value) in the same one-line form
        raise ArgumentError(f"{self.prog}: error: {message}")


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="python -m megatron_glue.pretrain_gpt", allow_abbrev=False,
                       description="Megatron-LM GPT pretraining on megatron-core, each transformer layer compiled "
                                   "with torch.compile(backend='ascend').")

    g = p.add_argument_group("network size")
    g.add_argument("--num-layers", type=int, required=True)
    g.add_argument("--hidden-size", type=int, required=True)
    g.add_argument("--ffn-hidden-size", type=int, default=None,
                   help="default 4 x hidden (with --swiglu 8/3 x, rounded down to a multiple of 64)")
    g.add_argument("--num-attention-heads", type=int, required=True)
    g.add_argument("--kv-channels", type=int, default=None, help="default hidden / heads")
    g.add_argument("--group-query-attention", action="store_true")
    g.add_argument("--num-query-groups", type=int, default=1)
    g.add_argument("--max-position-embeddings", type=int, default=None)
    g.add_argument("--position-embedding-type", choices=["learned_absolute", "rope"], default="learned_absolute")
    g.add_argument("--rotary-base", type=int, default=10000)
    g.add_argument("--rotary-percent", type=float, default=1.0)
    g.add_argument("--use-rope-scaling", action="store_true", help="Llama 3.1's RoPE frequency scaling")
    g.add_argument("--rope-scaling-factor", type=float, default=8.0)
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    g.add_argument("--normalization", choices=["LayerNorm", "RMSNorm"], default="LayerNorm")
    g.add_argument("--norm-epsilon", type=float, default=1e-5)
    g.add_argument("--swiglu", action="store_true")
    g.add_argument("--openai-gelu", action="store_true", help="the tanh approximation of GeLU (GPT-2's gelu_new)")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--disable-bias-linear", action="store_false", dest="add_bias_linear")
    g.add_argument("--add-qkv-bias", action="store_true")
    g.add_argument("--use-mcore-models", action="store_true", help="accepted: megatron-core models are the only ones")

    g = p.add_argument_group("regularization")
    g.add_argument("--attention-dropout", type=float, default=0.1)
    g.add_argument("--hidden-dropout", type=float, default=0.1)
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)

    g = p.add_argument_group("activation recompute (Megatron-LM's meanings; see docs/recompute.md)")
    g.add_argument("--recompute-activations", action="store_true",
                   help="the same as --recompute-granularity selective")
    g.add_argument("--recompute-granularity", choices=["full", "selective"], default=None,
                   help="full: checkpoint whole transformer layers (Megatron's own checkpointing around the compiled "
                        "layers; needs --recompute-method and --recompute-num-layers); selective: core attention, "
                        "which the backend's fused attention recomputes in its backward")
    g.add_argument("--recompute-method", choices=["uniform", "block"], default=None,
                   help="uniform: every layer, in chunks of --recompute-num-layers checkpointed together; block: "
                        "only the first --recompute-num-layers layers of each pipeline stage")
    g.add_argument("--recompute-num-layers", type=int, default=None,
                   help="layers per checkpointed chunk (uniform), or layers recomputed per pipeline stage (block)")

    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, default=None)
    g.add_argument("--global-batch-size", type=int, default=None)
    g.add_argument("--train-iters", type=int, default=None)
    g.add_argument("--exit-interval", type=int, default=None, help="exit after the iteration divisible by this")
    g.add_argument("--skip-train", action="store_true", help="no training: load, evaluate, exit")
    g.add_argument("--no-check-for-nan-in-loss-and-grad", action="store_false", dest="check_for_nan_in_loss_and_grad")
    g.add_argument("--optimizer", choices=["adam", "sgd"], default="adam")

    g = p.add_argument_group("initialization")
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--init-method-std", type=float, default=0.02)

    g = p.add_argument_group("learning rate")
    g.add_argument("--lr", type=float, default=None)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--lr-decay-style", choices=["constant", "linear", "cosine", "inverse-square-root"], default="linear")
    g.add_argument("--lr-decay-iters", type=int, default=None)
    g.add_argument("--lr-warmup-fraction", type=float, default=None)
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--lr-warmup-init", type=float, default=0.0)

    g = p.add_argument_group("checkpointing")
    g.add_argument("--save", default=None)
    g.add_argument("--save-interval", type=int, default=None)
    g.add_argument("--load", default=None)
    g.add_argument("--no-load-optim", action="store_true")
    g.add_argument("--no-load-rng", action="store_true")
    g.add_argument("--no-save-optim", action="store_true")
    g.add_argument("--no-save-rng", action="store_true")
    g.add_argument("--finetune", action="store_true", help="load model weights only; iteration starts at 0")
    g.add_argument("--ckpt-format", choices=["torch_dist", "torch"], default="torch_dist")

    g = p.add_argument_group("mixed precision")
    g.add_argument("--fp16", action="store_true")
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--loss-scale", type=float, default=None, help="static loss scale (fp16); default dynamic")
    g.add_argument("--initial-loss-scale", type=float, default=2 ** 32)
    g.add_argument("--min-loss-scale", type=float, default=1.0)
    g.add_argument("--loss-scale-window", type=float, default=1000)
    g.add_argument("--hysteresis", type=int, default=2)
    g.add_argument("--accumulate-allreduce-grads-in-fp32", action="store_true")

    g = p.add_argument_group("distributed")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None)
    g.add_argument("--sequence-parallel", action="store_true")
    g.add_argument("--distributed-backend", choices=["nccl", "gloo", "hccl"], default="nccl")
    g.add_argument("--distributed-timeout-minutes", type=int, default=10)
    g.add_argument("--use-distributed-optimizer", action="store_true")
    g.add_argument("--overlap-grad-reduce", action="store_true")
    g.add_argument("--overlap-param-gather", action="store_true")
    g.add_argument("--ddp-bucket-size", type=int, default=None)
    g.add_argument("--local-rank", "--local_rank", type=int, default=None,
                   help="this process's device index, set by older launchers (torchrun sets $LOCAL_RANK)")

    g = p.add_argument_group("validation")
    g.add_argument("--eval-iters", type=int, default=100)
    g.add_argument("--eval-interval", type=int, default=1000)

    g = p.add_argument_group("data and dataloader")
    g.add_argument("--data-path", nargs="*", default=None, help="prefix, or weight prefix weight prefix ...")
    g.add_argument("--mock-data", action="store_true")
    g.add_argument("--split", default=None, help="train,valid,test weights; default 969,30,1")
    g.add_argument("--data-cache-path", default=None)
    g.add_argument("--seq-length", type=int, required=True)
    g.add_argument("--vocab-file", default=None)
    g.add_argument("--merge-file", default=None)
    g.add_argument("--tokenizer-type", choices=["GPT2BPETokenizer", "HuggingFaceTokenizer", "NullTokenizer"],
                   default=None)
    g.add_argument("--tokenizer-model", default=None)
    g.add_argument("--vocab-size", type=int, default=None,
                   help="NullTokenizer's vocabulary (ids; eod is this id); with a tokenizer with files, the model's "
                        "vocabulary when its embedding has more rows than the tokenizer has tokens")

    g = p.add_argument_group("logging")
    g.add_argument("--log-interval", type=int, default=100)
    g.add_argument("--log-throughput", action="store_true", help="accepted: tokens/s is always logged")
    g.add_argument("--metrics-file", default=None, help="metrics JSONL (default <save>/metrics.jsonl)")
    g.add_argument("--no-progress-bar", action="store_true")

    g = p.add_argument_group("MindSpeed switches (fusions of the ascend backend, on by default)")
    for name in MINDSPEED_FUSIONS:
        g.add_argument("--" + name.replace("_", "-"), action="store_true")
    g.add_argument("--use-ascend-mc2", action="store_true",
                   help="the tensor-parallel linears' all-gather + matmul and matmul + reduce-scatter as MC2 ops at "
                        "every site (npu_compile option mc2='on'); needs --sequence-parallel and TP > 1")

    g = p.add_argument_group("npu_compile")
    g.add_argument("--npu-compile-options", type=_json_object, default={},
                   help="JSON object passed to torch.compile(..., options=)")
    g.add_argument("--no-npu-compile", action="store_false", dest="npu_compile",
                   help="the same job, eager (the reference)")
    return p


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e.msg} at char {e.pos}): {text!r}")
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"needs a JSON object like '{{\"dump_dir\": \"dumps\"}}', got {text!r}")
    return value


def _refuse_not_implemented(argv: list[str]) -> None:
    for arg in argv:
        flag = arg.split("=", 1)[0]
        if flag in NOT_IMPLEMENTED:
            raise ArgumentError(f"{flag} is a Megatron-LM flag that megatron_glue.pretrain_gpt does not implement: "
                                f"{NOT_IMPLEMENTED[flag]}")


def parse_args(argv: list[str] | None = None, world_size: int | None = None) -> argparse.Namespace:
    """Megatron-LM's args from `argv` (default sys.argv[1:]), checked against `world_size`
    (default $WORLD_SIZE or 1). Raises ArgumentError (a SystemExit with one line) on bad input."""
    argv = sys.argv[1:] if argv is None else list(argv)
    _refuse_not_implemented(argv)
    args = build_parser().parse_args(argv)
    args.world_size = int(os.environ.get("WORLD_SIZE", "1")) if world_size is None else world_size
    validate(args)
    return args


def validate(args: argparse.Namespace) -> None:
    """Megatron-LM's derived values and consistency checks; each failure one line naming the fix."""
    def fail(message):
        raise ArgumentError(f"pretrain_gpt: error: {message}")

    tp, pp, world = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.world_size
    if tp < 1 or pp < 1:
        fail("--tensor-model-parallel-size and --pipeline-model-parallel-size must be >= 1")
    if world % (tp * pp):
        fail(f"world size {world} is not divisible by --tensor-model-parallel-size {tp} x "
             f"--pipeline-model-parallel-size {pp}; use sizes whose product divides {world}")
    args.data_parallel_size = world // (tp * pp)

    if args.micro_batch_size is None:
        fail("--micro-batch-size is required")
    if args.global_batch_size is None:
        args.global_batch_size = args.micro_batch_size * args.data_parallel_size
    per_step = args.micro_batch_size * args.data_parallel_size
    if args.global_batch_size % per_step:
        fail(f"--global-batch-size {args.global_batch_size} is not divisible by --micro-batch-size "
             f"{args.micro_batch_size} x data-parallel size {args.data_parallel_size}; use a multiple of {per_step}")
    args.num_microbatches = args.global_batch_size // per_step

    if args.train_iters is None:
        fail("--train-iters is required: the number of iterations to train (with --skip-train, 0 is fine)")
    if args.lr is None and not args.skip_train:
        fail("--lr is required: the peak learning rate, e.g. --lr 3e-4")
    if args.lr is None:
        args.lr = 0.0
    if args.fp16 and args.bf16:
        fail("--fp16 and --bf16 are exclusive; pick one")
    args.params_dtype = "float16" if args.fp16 else "bfloat16" if args.bf16 else "float32"

    if args.hidden_size % args.num_attention_heads:
        fail(f"--hidden-size {args.hidden_size} is not divisible by --num-attention-heads {args.num_attention_heads}")
    if args.num_attention_heads % tp:
        fail(f"--num-attention-heads {args.num_attention_heads} is not divisible by --tensor-model-parallel-size {tp}")
    if not args.group_query_attention:
        args.num_query_groups = args.num_attention_heads
    elif args.num_attention_heads % args.num_query_groups or args.num_query_groups % tp:
        fail(f"--num-query-groups {args.num_query_groups} must divide --num-attention-heads "
             f"{args.num_attention_heads} and be divisible by --tensor-model-parallel-size {tp}")
    if args.ffn_hidden_size is None:
        args.ffn_hidden_size = default_ffn_hidden_size(args.hidden_size, args.swiglu)
        if args.ffn_hidden_size < 1:
            fail(f"--swiglu with --hidden-size {args.hidden_size} gives Megatron-LM's default --ffn-hidden-size 0 "
                 "(8/3 x hidden rounded down to a multiple of 64); give --ffn-hidden-size")
    if args.kv_channels is None:  # Megatron-LM's validate_args: the head size, stored and compared resolved
        args.kv_channels = args.hidden_size // args.num_attention_heads
    if args.max_position_embeddings is None:
        if args.position_embedding_type == "learned_absolute":
            fail("--max-position-embeddings is required with --position-embedding-type learned_absolute")
        args.max_position_embeddings = args.seq_length
    if args.seq_length > args.max_position_embeddings and args.position_embedding_type == "learned_absolute":
        fail(f"--seq-length {args.seq_length} exceeds --max-position-embeddings {args.max_position_embeddings}")
    if args.use_ascend_mc2 and (tp == 1 or not args.sequence_parallel):
        # MindSpeed refuses it so too (mindspeed/features_manager/tensor_parallel/mc2.py, MC2Feature.validate_args)
        fail(f"--use-ascend-mc2 needs --sequence-parallel and --tensor-model-parallel-size > 1 (got "
             f"{'--sequence-parallel' if args.sequence_parallel else 'no --sequence-parallel'}, TP {tp}): MC2 fuses "
             "the all-gather + matmul and matmul + reduce-scatter that sequence parallelism puts around the "
             "tensor-parallel linears")
    if args.sequence_parallel and tp == 1:
        args.sequence_parallel = False  # Megatron-LM turns it off at TP=1 too

    if args.num_layers % pp:
        fail(f"--num-layers {args.num_layers} is not divisible by --pipeline-model-parallel-size {pp}")
    args.virtual_pipeline_model_parallel_size = None
    if args.num_layers_per_virtual_pipeline_stage is not None:
        per_stage = args.num_layers // pp
        if pp < 2:
            fail("--num-layers-per-virtual-pipeline-stage needs --pipeline-model-parallel-size > 1")
        if per_stage % args.num_layers_per_virtual_pipeline_stage:
            fail(f"--num-layers-per-virtual-pipeline-stage {args.num_layers_per_virtual_pipeline_stage} must "
                 f"divide the {per_stage} layers of each pipeline stage")
        args.virtual_pipeline_model_parallel_size = per_stage // args.num_layers_per_virtual_pipeline_stage
        if args.num_microbatches % pp:
            fail(f"the interleaved schedule needs the number of micro-batches ({args.num_microbatches}) to be a "
                 f"multiple of --pipeline-model-parallel-size {pp}")
    if args.overlap_param_gather and not args.use_distributed_optimizer:
        fail("--overlap-param-gather needs --use-distributed-optimizer")
    validate_recompute(args, fail)

    if args.split is None:
        args.split = "969, 30, 1"
    if not args.mock_data and not args.data_path and not args.skip_train:
        fail("--data-path is required (or --mock-data): the prefix of a .bin/.idx pair written by "
             "`npu-compile preprocess`")
    if args.tokenizer_type is None:
        if args.vocab_file and args.merge_file:
            args.tokenizer_type = "GPT2BPETokenizer"
        elif args.mock_data and args.vocab_size:
            args.tokenizer_type = "NullTokenizer"
        else:
            fail("--tokenizer-type is required: GPT2BPETokenizer (with --vocab-file, --merge-file), "
                 "HuggingFaceTokenizer (with --tokenizer-model) or NullTokenizer (with --vocab-size)")
    if args.tokenizer_type == "GPT2BPETokenizer" and not (args.vocab_file and args.merge_file):
        fail("--tokenizer-type GPT2BPETokenizer needs --vocab-file (vocab.json) and --merge-file (merges.txt)")
    if args.tokenizer_type == "HuggingFaceTokenizer" and not args.tokenizer_model:
        fail("--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model (a local directory)")
    if args.tokenizer_type == "NullTokenizer" and not args.vocab_size:
        fail("--tokenizer-type NullTokenizer needs --vocab-size")
    if args.save:  # a job that cannot write its checkpoints is refused here, not after training to its first save
        from megatron_glue.training.checkpointing import save_refusal

        if (why := save_refusal(args)) is not None:
            fail(why)
    if args.save_interval is not None and not args.save and int(os.environ.get("RANK", "0")) == 0:
        print(" WARNING: --save-interval has no effect without --save; no checkpoints will be written",
              file=sys.stderr)
    if args.lr_decay_iters is None:
        # --train-iters 0 (evaluate only) steps no schedule; megatron-core's scheduler still wants a decay > 0
        args.lr_decay_iters = args.train_iters or 1
    if args.lr_warmup_fraction is not None:
        args.lr_warmup_iters = int(args.lr_warmup_fraction * args.lr_decay_iters)
    if args.lr_warmup_iters >= args.lr_decay_iters and args.lr_warmup_iters > 0:
        # megatron-core's OptimizerParamScheduler asserts it, bare
        fail(f"--lr-warmup-iters {args.lr_warmup_iters} must be below --lr-decay-iters {args.lr_decay_iters} "
             "(default --train-iters); warm up for fewer iterations")

    mindspeed = [rule for flag, rules in MINDSPEED_FUSIONS.items() if getattr(args, flag) for rule in rules]
    if args.use_ascend_mc2 and args.npu_compile_options.get("mc2", "on") != "on":
        fail(f"--use-ascend-mc2 sets npu_compile option mc2='on', but --npu-compile-options gives mc2="
             f"{args.npu_compile_options['mc2']!r}; drop one of them")
    args.npu_compile_options = compile_options(args.npu_compile_options, mindspeed, args.use_ascend_mc2)
    from npu_compile import config as npu_config

    try:  # here, before any model is built or traced (torch.compile checks them only at the first graph)
        options = npu_config.validate(args.npu_compile_options)
    except npu_config.OptionError as e:
        fail(f"--npu-compile-options: {e}")
    if args.use_ascend_mc2:  # MC2 is the compiler's, and only the npu targets have its ops: never a silent no-op
        if not args.npu_compile:
            fail("--use-ascend-mc2 is done by the compiler (option mc2='on'), which --no-npu-compile turns off; "
                 "drop one of them")
        if options.target == "reference" or options.target == "auto" and npu_config.resolve_target("auto") != "npu":
            why = "as --npu-compile-options says" if options.target == "reference" else "auto: no usable torch_npu here"
            fail(f"--use-ascend-mc2 makes MC2 ops, which only the npu and npu-sim targets have; this job compiles for "
                 f"target 'reference' ({why}); to run them on the CPU, give --npu-compile-options "
                 "'{\"target\": \"npu-sim\"}'")


def validate_recompute(args: argparse.Namespace, fail) -> None:
    """Megatron-LM's recompute rules (megatron/training/arguments.py validate_args and TransformerConfig's
    __post_init__, core_v0.16.1; docs/recompute.md cites the lines), each broken one a one-line error.
    Afterwards args.recompute_activations is gone, as in Megatron-LM, and recompute_granularity says it all."""
    if args.recompute_activations:  # Megatron-LM: --recompute-activations sets selective, over any granularity
        args.recompute_granularity = "selective"
    del args.recompute_activations
    granularity, method, n = args.recompute_granularity, args.recompute_method, args.recompute_num_layers
    per_stage = args.num_layers // args.pipeline_model_parallel_size
    per_chunk = per_stage // (args.virtual_pipeline_model_parallel_size or 1)
    if granularity is None:
        if method is not None or n is not None:
            given = "--recompute-method" if method is not None else "--recompute-num-layers"
            fail(f"{given} has no effect without --recompute-granularity full (Megatron-LM ignores it); give "
                 "--recompute-granularity full, or drop it")
        return
    if granularity == "selective":
        fusions = args.npu_compile_options.get("fusions", "all")
        attention_fused = fusions == "all" or (fusions.get("attention", False) if isinstance(fusions, dict)
                                               else "attention" in fusions)
        if args.npu_compile and not attention_fused:
            fail("--recompute-granularity selective (core attention) is done by the fused attention, whose backward "
                 "recomputes the attention probabilities, and --npu-compile-options 'fusions' leaves the attention "
                 "rule out; add \"attention\" to 'fusions', or drop the recompute flag")
        if method is not None:
            fail("--recompute-method is not supported with --recompute-granularity selective (Megatron-LM: "
                 "recompute method is not yet supported for selective recomputing granularity); drop "
                 "--recompute-method, or use --recompute-granularity full")
        if n is not None:
            fail("--recompute-num-layers must be None with --recompute-granularity selective (selective "
                 "recomputes core attention in every layer); drop --recompute-num-layers")
        return
    if method is None:
        fail('--recompute-granularity full needs --recompute-method "block" or "uniform"')
    if n is None or n < 1:
        got = "" if n is None else f" (got {n})"
        fail(f"--recompute-granularity full needs --recompute-num-layers between 1 and the {per_chunk} layers of "
             f"each model chunk{got}")
    if args.npu_compile and (args.hidden_dropout > 0 or args.attention_dropout > 0):
        # the checkpointed forward runs the layer's no-grad graph, the recompute its training graph, and the two
        # draw their dropout seeds in different orders: the backward would use other masks than the forward's
        fail(f"--recompute-granularity full in the compiled job needs --hidden-dropout 0 and --attention-dropout 0 "
             f"(got {args.hidden_dropout} and {args.attention_dropout}): the recomputed layer's graph draws its "
             "dropout masks in another order than the forward's; set both to 0, or run --no-npu-compile")
    if method == "uniform" and per_chunk % n:
        # Megatron's uniform loop steps over chunks of n layers and would index past the last layer
        fail(f"--recompute-method uniform checkpoints chunks of --recompute-num-layers {n} layers, which must "
             f"divide the {per_chunk} layers of each model chunk; use a divisor of {per_chunk}")


def default_ffn_hidden_size(hidden_size: int, swiglu: bool) -> int:
    """Megatron-LM's default --ffn-hidden-size (megatron/training/arguments.py, validate_args): 4h, and with
    --swiglu 2/3 of that rounded down to a multiple of 64 (hidden 4096: 10880)."""
    return int((4 * hidden_size * 2 / 3) / 64) * 64 if swiglu else 4 * hidden_size


def compile_options(options: dict, switched_on: list[str], mc2: bool) -> dict:
    """`--npu-compile-options` with MindSpeed's switches applied: each switch turns its fusions on (they are on
    unless `fusions` says otherwise); `--use-ascend-mc2` sets option `mc2` to "on": as MindSpeed's MC2 linears, every
    all-gather + matmul and matmul + reduce-scatter torch_npu takes becomes one MC2 op, whatever the cost model
    would choose (without the flag, `mc2` stays as given, by default "auto": the cost model's choice)."""
    options = dict(options)
    fusions = options.get("fusions", "all")
    if switched_on and fusions != "all":
        if isinstance(fusions, dict):
            fusions = {**fusions, **{rule: True for rule in switched_on}}
        elif isinstance(fusions, list):
            fusions = list(dict.fromkeys([*fusions, *switched_on]))
        options["fusions"] = fusions
    if mc2:
        options["mc2"] = "on"
    return options
