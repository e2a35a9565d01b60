"""The GPT pieces of Megatron-LM's `pretrain_gpt.py` on megatron-core, every transformer layer compiled with
`torch.compile(backend="ascend")`; `main` is what the door runs:

    torchrun --nproc_per_node=8 -m megatron_glue.pretrain_gpt <Megatron-LM's pretrain_gpt.py flags>

The pieces live here as they do in Megatron-LM's script (the model provider, the batch, the loss, the datasets);
`training.pretrain` is the job around them. `--no-npu-compile` runs the same job eagerly.
"""

from __future__ import annotations

import math
import sys
from functools import partial

import torch

from megatron_glue.capture import quiet_megatron
from megatron_glue.training import noop_layers
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
    args.padded_vocab_size_given = given is not None  # checkpointing.check_architecture reads it
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
    elif getattr(args, "full_attention_interval", None):
        # MindSpeed-LLM's qwen3_next_spec: Gated DeltaNet layers, every N-th layer full attention
        from megatron_glue.capture.adaptations import set_gated_delta_rule_chunk_size

        set_gated_delta_rule_chunk_size(args.mamba_chunk_size)
        spec = linear_attention_block_spec(config, getattr(args, "qk_layernorm", False), vp_stage)
    else:
        spec = get_gpt_layer_local_spec(normalization=args.normalization,
                                        qk_layernorm=getattr(args, "qk_layernorm", False))
    if getattr(args, "context_parallel_size", 1) > 1:
        # megatron-core's CP attention is Transformer Engine's only: ours in place of DotProductAttention
        from megatron_glue.capture.context_parallel import cp_layer_spec

        spec = cp_layer_spec(spec, args.context_parallel_algo)
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=args.padded_vocab_size, max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process, post_process=post_process, parallel_output=True,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type, rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base, rope_scaling=getattr(args, "use_rope_scaling", False),
        rope_scaling_factor=getattr(args, "rope_scaling_factor", 8.0), **gpt_model_kwargs(vp_stage))
    noop_layers.replace(model, getattr(args, "noop_layers", None))  # MindSpeed's --noop-layers: empty layers
    if getattr(args, "post_norm", False):
        add_post_norms(model, config, args)
    if getattr(args, "rope_scaling_type", None) == "longrope":
        model.rotary_pos_emb.inv_freq = longrope_inv_freq(args, model.rotary_pos_emb.inv_freq)
    if getattr(args, "input_embeds_norm", False) and pre_process:
        model.embedding.register_forward_hook(partial(_scale_embeddings, args.hidden_size ** 0.5))
    if getattr(args, "output_logit_softcapping", None) and post_process:
        model.output_layer.register_forward_hook(partial(_softcap_logits, args.output_logit_softcapping))
    return model


def linear_attention_block_spec(config, qk_layernorm: bool, vp_stage: int | None = None):
    """The hybrid decoder block of MindSpeed-LLM's qwen3_next_spec (docs/linear_attention.md) from megatron-core's own
    modules (0.16+), local (no Transformer Engine), for this pipeline (virtual) stage: megatron-core's layer pattern
    of config.linear_attention_freq N (experimental_attention_variant_module_specs.py:316-350: layer i, 1-based, is
    full attention when i % N == 0, as MindSpeed-LLM's transformer_block.py:176-185), its GatedDeltaNet spec
    (get_gated_delta_net_module_spec) for the linear-attention layers, and the local GPT layer (q/k norms as
    `qk_layernorm`, the output gate as config.attention_output_gate) for the others.

    megatron-core's own block builder (get_transformer_block_with_experimental_attention_variant_spec) asserts
    Transformer Engine (:356-359), whose fused norm + linear is the GatedDeltaNet input projection's; the local backend
    has none (models/backends.py:100-102), so here the layer keeps its own input norm and the projection is the plain
    ColumnParallelLinear: the same norm, then the same matmul."""
    import dataclasses

    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
        get_gated_delta_net_module_spec, get_linear_attention_pattern)
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.enums import LayerType
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    local = LocalSpecProvider()
    full = get_gpt_layer_local_spec(normalization=config.normalization, qk_layernorm=qk_layernorm)
    gated_delta_net = get_gated_delta_net_module_spec(config, backend=local)
    gated_delta_net.submodules.in_proj = local.column_parallel_linear()
    # checkpoint keys as Transformer Engine's layer has them (the input norm fused into in_proj), as the local
    # layer maps its own input norm onto linear_qkv's (gpt_layer_specs.py:417-420)
    keys = {**full.submodules.sharded_state_dict_keys_map, "input_layernorm.": "self_attention.in_proj.layer_norm_"}
    linear = ModuleSpec(module=full.module, submodules=dataclasses.replace(
        full.submodules, self_attention=gated_delta_net, sharded_state_dict_keys_map=keys))
    layers = [linear if is_linear else full for is_linear in get_linear_attention_pattern(config)]
    if config.pipeline_model_parallel_layout is not None:
        ids = config.pipeline_model_parallel_layout.get_layer_id_list(layer_type=LayerType.decoder,
                                                                      vp_stage=vp_stage)
    else:
        offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
        ids = range(offset, offset + get_num_layers_to_build(config, vp_stage=vp_stage))
    return TransformerBlockSubmodules(layer_specs=[layers[i] for i in ids],
                                      layer_norm=full.submodules.input_layernorm)


def add_post_norms(model, config, args) -> None:
    """MindSpeed-LLM's --post-norm (mindspeed_llm/tasks/models/transformer/transformer_layer.py,
    TransformerLayerWithPostNorm): each layer's post_attn_norm on the attention output and post_mlp_layernorm on the
    MLP output, before the bias-dropout-add of the residual; the bias (none with --disable-bias-linear) is left as
    it is. The norms are the layer's own kind (the local spec's input_layernorm: --normalization, with
    --add-rmsnorm-offset's offset), named as MindSpeed-LLM names them in its checkpoints."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import build_module

    norm = get_gpt_layer_local_spec(normalization=args.normalization).submodules.input_layernorm
    for layer in noop_layers.real_layers(model.decoder.layers):
        for name, sublayer in (("post_attn_norm", layer.self_attention), ("post_mlp_layernorm", layer.mlp)):
            module = build_module(norm, config=config, hidden_size=config.hidden_size, eps=config.layernorm_epsilon)
            setattr(layer, name, module)
            sublayer.register_forward_hook(partial(_post_norm, module))


def _post_norm(norm, module, inputs, output):
    out, bias = output
    return norm(out), bias


def _scale_embeddings(normalizer: float, module, inputs, output):
    """MindSpeed-LLM's --input-embeds-norm (mindspeed_llm/core/transformer/transformer_block.py): the decoder's
    input times sqrt(hidden), the factor in the activations' dtype."""
    return output * torch.tensor(normalizer, dtype=output.dtype)


def _softcap_logits(cap: float, module, inputs, output):
    """MindSpeed-LLM's --output-logit-softcapping (mindspeed_llm/core/models/gpt/gpt_model.py): cap x tanh(logits /
    cap) on the output layer's logits, before the loss."""
    logits, bias = output
    return torch.tanh(logits / cap) * cap, bias


def _longrope_is_long(args) -> bool:
    return args.seq_length > args.rope_scaling_original_max_position_embeddings


def longrope_inv_freq(args, inv_freq: torch.Tensor) -> torch.Tensor:
    """LongRoPE's rotary frequencies (MindSpeed-LLM's rotary_pos_embedding.py `rotary_embedding_forward`; Phi-3's
    `_compute_longrope_parameters` in transformers): each divided by its factor, --long-factor when --seq-length
    exceeds --rope-scaling-original-max-position-embeddings, else --short-factor. outer: 1 / (factor x
    base^(2i/d)); mul: megatron-core's own frequencies x 1 / factor."""
    factors = torch.tensor(args.long_factor if _longrope_is_long(args) else args.short_factor, dtype=torch.float32,
                           device=inv_freq.device)
    if args.longrope_freqs_type == "outer":
        dim = 2 * inv_freq.numel()
        exponents = torch.arange(0, dim, 2, dtype=torch.int64, device=inv_freq.device).float() / dim
        return 1.0 / (factors * args.rotary_base ** exponents)
    return inv_freq * (1.0 / factors)


def longrope_mscale(args) -> float:
    """LongRoPE's scale of cos and sin (MindSpeed-LLM's `apply_rotary_pos_emb_bshd`, transformers' attention_factor):
    --long-mscale / --short-mscale, or sqrt(1 + ln(s) / ln(original)), s = max-position-embeddings / original,
    1 when s <= 1."""
    if args.long_mscale is not None:
        return args.long_mscale if _longrope_is_long(args) else args.short_mscale
    original = args.rope_scaling_original_max_position_embeddings
    scale = args.max_position_embeddings / original
    return 1.0 if scale <= 1.0 else math.sqrt(1 + math.log(scale) / math.log(original))


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Sum of the per-token losses under the mask, the token count, and [sum, count] for reporting
    (megatron-core's schedules divide by the count; the report is reduced over micro-batches and DP)."""
    losses = output_tensor.float().view(-1)
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().detach().to(torch.int)
    report = torch.cat([loss.detach().view(1), mask.sum().detach().view(1)])
    if cp_loss_over_group():
        # as MindSpeed-LLM's loss_func (pretrain_gpt.py:155-161, sft_trainer.py:191-195) and Megatron-LM 0.12's: the
        # sum and the token count over the CP group, so that the loss is the mean over the whole rows even where
        # the CP ranks hold unequal token counts (packed rows with --eod-mask-loss, instruction data's prompts).
        # The value is the group's sum; the gradient this rank's sum's times CP (DDP averages over DP x CP), the
        # factor megatron-core 0.12's schedule applies itself (versions.loss_times_cp_size)
        from megatron.core import parallel_state

        from megatron_glue.training.versions import loss_times_cp_size

        total = torch.stack([loss.detach(), mask.sum().detach()])
        torch.distributed.all_reduce(total, group=parallel_state.get_context_parallel_group())
        if not loss_times_cp_size():
            loss = loss * parallel_state.get_context_parallel_world_size()
        loss = loss + (total[0] - loss.detach())
        num_tokens = total[1].to(torch.int)
    return loss, num_tokens, {"lm loss": report}


def cp_loss_over_group() -> bool:
    """At CP > 1."""
    from megatron.core import parallel_state

    return parallel_state.get_context_parallel_world_size() > 1


def forward_step(data_iterator, model):
    """One micro-batch through this stage's chunk. Stages in the middle read no data: their input is the
    previous stage's output (set by the schedule)."""
    batch = next(data_iterator) if data_iterator is not None else None
    if batch is None:
        return model(None, None, None), partial(loss_func, None)
    batch = on_this_cp_rank(batch)
    tokens, labels = batch["tokens"], batch["labels"]
    position_ids, loss_mask = batch["position_ids"], batch["loss_mask"]
    # attention_mask None: the layers' own causal mask (attn_mask_type causal), the same on every stage; with
    # --reset-attention-mask the documents' mask (eager) or their lengths (compiled: packed_documents)
    output = model(tokens, position_ids, batch.get("attention_mask"), labels=labels,
                   packed_seq_params=batch.get("packed_seq_params"))
    return output, partial(loss_func, loss_mask)


def on_this_cp_rank(batch: dict) -> dict:
    """This context-parallel rank's part of each sequence of the batch: megatron-core's get_batch_on_this_cp_rank
    (2 x CP chunks, rank r holding chunks r and 2CP-1-r; the batch as is at CP 1). Packed documents' mask
    (eager) stays whole, as their lengths (compiled) do: the CP attention reads the whole rows' documents (Ulysses
    attends over whole rows; the ring takes each step's block of it by global position), docs/context_parallel.md."""
    from megatron.core import parallel_state
    from megatron.core.utils import get_batch_on_this_cp_rank

    if parallel_state.get_context_parallel_world_size() == 1:
        return batch
    keys = ("tokens", "labels", "position_ids", "loss_mask")
    split = get_batch_on_this_cp_rank({k: batch[k] for k in keys if batch.get(k) is not None})
    return {**batch, **split}


def packed_documents(batch: dict, eod: int) -> dict:
    """A batch whose rows pack documents, for the compiled job with --reset-attention-mask: the documents'
    lengths as megatron-core's PackedSeqParams (qkv_format "sbhd": the tensors keep their layout), cut as
    Megatron-LM cuts them (after each end-of-document token), padded to one length so that the number of
    documents never changes the compiled graph (npu_compile.ops.varlen_attention): b·s entries, at most the
    device's 1024 (a batch of more documents than that, possible only in rows of more than 1024 tokens, gets b·s:
    one more graph, on the reference kernel). The attention then builds no s x s mask (docs/packed_sequences.md)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    from npu_compile.ops.varlen_attention import DEVICE_MAX_DOCUMENTS, cu_seqlens_from_eod

    tokens = batch["tokens"]
    b, s = tokens.shape
    documents = cu_seqlens_from_eod(tokens, eod).numel()
    cu = cu_seqlens_from_eod(tokens, eod, pad_to=b * s if documents > DEVICE_MAX_DOCUMENTS
                             else min(b * s, DEVICE_MAX_DOCUMENTS))
    return {**batch, "packed_seq_params": PackedSeqParams(qkv_format="sbhd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                                          max_seqlen_q=s, max_seqlen_kv=s)}


def passes_lengths(args) -> bool:
    """Whether the job gives the layers its documents' lengths rather than Megatron's dense mask: compiled, with
    --reset-attention-mask, on megatron-core 0.13 or later (0.12 takes any PackedSeqParams for THD: see the
    adaptation packed_documents; there the compiled job keeps the dense mask, attention fused over it)."""
    from megatron_glue.capture.adaptations import megatron_core_in

    return bool(args.reset_attention_mask and args.npu_compile and megatron_core_in(">=0.13"))


def loader_for(args, build_loader):
    """build_loader, its batches given their documents' lengths where the job passes them (passes_lengths)."""
    if not passes_lengths(args):
        return build_loader
    eod = args.tokenizer.eod

    def build(dataset, **kwargs):
        batches = build_loader(dataset, **kwargs)
        return None if batches is None else (packed_documents(batch, eod) for batch in batches)

    return build


def datasets_provider(args):
    from megatron_glue.data.datasets import build_datasets

    gbs = args.global_batch_size
    eval_runs = (args.train_iters // args.eval_interval + 1) if args.eval_interval else 1
    num_samples = (args.train_iters * gbs, eval_runs * args.eval_iters * gbs, args.eval_iters * gbs)
    return build_datasets(data_path=args.data_path, split=args.split, seq_length=args.seq_length, seed=args.seed,
                          tokenizer=args.tokenizer, num_samples=num_samples, data_cache_path=args.data_cache_path,
                          mock=args.mock_data, reset_position_ids=args.reset_position_ids,
                          reset_attention_mask=args.reset_attention_mask, eod_mask_loss=args.eod_mask_loss,
                          # Megatron's dense [1, s, s] document mask for the eager job; compiled, the documents'
                          # lengths instead (passes_lengths), and no s x s mask anywhere
                          create_attention_mask=args.reset_attention_mask and not passes_lengths(args))


def main(argv: list[str] | None = None, before_start=None, refusals=(), datasets=datasets_provider,
         name: str = "pretrain_gpt", loader=loader_for) -> int:
    """The job; `refusals` join the argument check (parse_args), and `before_start(args)`, when given, runs after
    it and before any process group (the door passes the converter's --enable-hf2mg-convert check and step: this
    room does not import the converter)."""
    from megatron_glue.training import training
    from megatron_glue.training.checkpointing import CheckpointError
    from megatron_glue.data.datasets import build_loader
    from megatron_glue.data.tokenizer import DataError
    from megatron_glue.training.lora import LoraError

    try:
        args = parse_args(argv, refusals=refusals)
        if before_start is not None:
            before_start(args)
        set_vocabulary(args)
        with quiet_megatron():
            training.pretrain(args, model_provider, forward_step, datasets, loader(args, build_loader))
    except ArgumentError as e:
        print(e.message, file=sys.stderr)
        return 2
    except (CheckpointError, DataError, LoraError, FileNotFoundError) as e:  # bad input found while setting up: one line, no traceback
        print(f"{name}: error: {e}", file=sys.stderr)
        return 1
    finally:
        from megatron_glue.capture.distributed import end_process_group

        end_process_group()
    return 0
