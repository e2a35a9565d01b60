"""The GPT pieces of Megatron-LM's `pretrain_gpt.py` on megatron-core, every transformer layer compiled with
`torch.compile(backend="ascend")`; `main` is what the door runs:

    torchrun --nproc_per_node=8 -m megatron_glue.pretrain_gpt <Megatron-LM's pretrain_gpt.py flags>

The pieces live here as they do in Megatron-LM's script (the model provider, the batch, the loss, the datasets);
`training.pretrain` is the job around them. `--no-npu-compile` runs the same job eagerly.
"""

from __future__ import annotations

import sys
from functools import partial

import torch

from megatron_glue.capture import quiet_megatron
from megatron_glue.training.arguments import ArgumentError, parse_args


def tokenizer_for(args):
    """The tokenizer named by the flags (NullTokenizer: ids 0..vocab-size-1, eod = vocab-size)."""
    from megatron_glue.data.tokenizer import NullTokenizer, build_tokenizer

    if args.tokenizer_type == "NullTokenizer":
        return NullTokenizer(args.vocab_size)
    return build_tokenizer(args.tokenizer_type, vocab_file=args.vocab_file, merge_file=args.merge_file,
                           tokenizer_model=args.tokenizer_model,
                           tokenizer_name_or_path=getattr(args, "tokenizer_name_or_path", None),
                           use_fast=getattr(args, "tokenizer_use_fast", True))


def model_vocab_size(args) -> int:
    """The model's vocabulary before Megatron's padding: the tokenizer's, or --vocab-size where a model's
    embedding is larger than its tokenizer (Qwen2's 151936 rows for 151646 tokens)."""
    tokens = args.tokenizer.vocab_size
    if args.tokenizer_type == "NullTokenizer" or args.vocab_size is None:
        return tokens
    if args.vocab_size < tokens:
        raise ArgumentError(f"pretrain_gpt: error: --vocab-size {args.vocab_size} is smaller than the tokenizer's "
                            f"{tokens} tokens; give at least {tokens}, or leave it out")
    return args.vocab_size


def set_vocabulary(args) -> None:
    """The job's tokenizer and model vocabulary: args.tokenizer, args.orig_vocab_size (model_vocab_size) and
    args.padded_vocab_size: --padded-vocab-size as given (MindSpeed-LLM's meaning), else Megatron-LM's padding for
    --make-vocab-size-divisible-by and TP."""
    from megatron_glue.data.tokenizer import padded_vocab_size

    args.tokenizer = tokenizer_for(args)
    args.orig_vocab_size = model_vocab_size(args)
    given = getattr(args, "padded_vocab_size", None)
    if given is not None:
        if given < args.orig_vocab_size:
            raise ArgumentError(f"pretrain_gpt: error: --padded-vocab-size {given} is smaller than the model's "
                                f"vocabulary ({args.orig_vocab_size} tokens); give at least {args.orig_vocab_size}")
        if given % args.tensor_model_parallel_size:
            raise ArgumentError(f"pretrain_gpt: error: --padded-vocab-size {given} is not divisible by "
                                f"--tensor-model-parallel-size {args.tensor_model_parallel_size}; the embedding "
                                "rows are split over TP")
        return
    args.padded_vocab_size = padded_vocab_size(args.orig_vocab_size, args.make_vocab_size_divisible_by,
                                               args.tensor_model_parallel_size)


def model_provider(args, config, pre_process=True, post_process=True, vp_stage=None):
    """megatron-core GPTModel with the local layer spec for one pipeline (virtual) stage."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_glue.training.versions import gpt_model_kwargs

    from megatron_glue.training.versions import moe_block_spec

    if getattr(args, "num_experts", None):
        # Megatron-LM's pretrain_gpt: MoE and dense layers by --moe-layer-freq, megatron-core's local modules
        spec = moe_block_spec(config, args.normalization, vp_stage)
    else:
        spec = get_gpt_layer_local_spec(normalization=args.normalization,
                                        qk_layernorm=getattr(args, "qk_layernorm", False))
    return GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=args.padded_vocab_size, max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process, post_process=post_process, parallel_output=True,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type, rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base, rope_scaling=getattr(args, "use_rope_scaling", False),
        rope_scaling_factor=getattr(args, "rope_scaling_factor", 8.0), **gpt_model_kwargs(vp_stage))


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Sum of the per-token losses under the mask, the token count, and [sum, count] for reporting
    (megatron-core's schedules divide by the count; the report is reduced over micro-batches and DP)."""
    losses = output_tensor.float().view(-1)
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().detach().to(torch.int)
    report = torch.cat([loss.detach().view(1), mask.sum().detach().view(1)])
    return loss, num_tokens, {"lm loss": report}


def forward_step(data_iterator, model):
    """One micro-batch through this stage's chunk. Stages in the middle read no data: their input is the
    previous stage's output (set by the schedule)."""
    batch = next(data_iterator) if data_iterator is not None else None
    if batch is None:
        return model(None, None, None), partial(loss_func, None)
    tokens, labels = batch["tokens"], batch["labels"]
    position_ids, loss_mask = batch["position_ids"], batch["loss_mask"]
    # attention_mask None: the layers' own causal mask (attn_mask_type causal), the same on every stage
    output = model(tokens, position_ids, None, labels=labels)
    return output, partial(loss_func, loss_mask)


def datasets_provider(args):
    from megatron_glue.data.datasets import build_datasets

    gbs = args.global_batch_size
    eval_runs = (args.train_iters // args.eval_interval + 1) if args.eval_interval else 1
    num_samples = (args.train_iters * gbs, eval_runs * args.eval_iters * gbs, args.eval_iters * gbs)
    return build_datasets(data_path=args.data_path, split=args.split, seq_length=args.seq_length, seed=args.seed,
                          tokenizer=args.tokenizer, num_samples=num_samples, data_cache_path=args.data_cache_path,
                          mock=args.mock_data, create_attention_mask=False)


def main(argv: list[str] | None = None, before_start=None, refusals=()) -> int:
    """The job; `refusals` join the argument check (parse_args), and `before_start(args)`, when given, runs after
    it and before any process group (the door passes the converter's --enable-hf2mg-convert check and step: this
    room does not import the converter)."""
    from megatron_glue.training import training
    from megatron_glue.training.checkpointing import CheckpointError
    from megatron_glue.data.datasets import build_loader
    from megatron_glue.data.tokenizer import DataError

    try:
        args = parse_args(argv, refusals=refusals)
        if before_start is not None:
            before_start(args)
        set_vocabulary(args)
        with quiet_megatron():
            training.pretrain(args, model_provider, forward_step, datasets_provider, build_loader)
    except ArgumentError as e:
        print(e.message, file=sys.stderr)
        return 2
    except (CheckpointError, DataError, FileNotFoundError) as e:  # bad input found while setting up: one line, no traceback
        print(f"pretrain_gpt: error: {e}", file=sys.stderr)
        return 1
    finally:
        from megatron_glue.capture.distributed import end_process_group

        end_process_group()
    return 0
