"""The training job's machinery, composed from megatron-core: parallel state, the model per pipeline stage (each
transformer layer compiled with `backend="ascend"`), Float16Module, Megatron's DDP and optimizer (distributed or
not, mixed precision with loss scaling), the LR scheduler, the pipeline schedules, `finalize_model_grads`,
evaluation, checkpoints and logs. `pretrain(args, model_provider, forward_step, datasets_provider)` is
Megatron-LM's `pretrain()`; `megatron_glue.pretrain_gpt` gives it the GPT pieces.

Nothing here is a hand-written training loop over a model: one iteration is megatron-core's
`get_forward_backward_func()` (no pipelining, 1F1B or interleaved) followed by the Megatron optimizer's `step()`.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import random
import time
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from megatron_glue.capture import quiet_megatron
from megatron_glue.training import checkpointing, device as glue_device, lora, monitor, noop_layers, versions
from megatron_glue.training.log import (Metrics, TensorBoard, arguments_lines, iteration_line,
                                        num_floating_point_operations, parameters_line, peak_memory_mb, print_rank0,
                                        validation_lines)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class State:
    iteration: int = 0
    consumed_train_samples: int = 0
    consumed_valid_samples: int = 0
    skipped_iterations: int = 0
    has_split: tuple = (False, False, False)  # train/valid/test exist (every stage evaluates, reading or not)
    graph_counts: dict = field(default_factory=dict)


# -- set-up ------------------------------------------------------------------------------------------------------

def initialize(args):
    """Process group, adaptations, Megatron's parallel state, the micro-batch calculator, seeds."""
    where = glue_device.init(args)
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.num_microbatches_calculator import init_num_microbatches_calculator

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    with quiet_megatron():
        parallel_state.initialize_model_parallel(
            args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
            virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
            context_parallel_size=getattr(args, "context_parallel_size", 1),
            expert_model_parallel_size=getattr(args, "expert_model_parallel_size", 1),
            expert_tensor_parallel_size=getattr(args, "expert_tensor_parallel_size", None))
    init_num_microbatches_calculator(dist.get_rank(), None, args.global_batch_size, args.micro_batch_size,
                                     args.data_parallel_size)
    # as Megatron-LM's initialize_megatron (--rerun-mode's default, disabled): set up before the first step asks for
    # it, which would otherwise initialize it implicitly with a warning
    from megatron.core.rerun_state_machine import initialize_rerun_state_machine

    initialize_rerun_state_machine()
    # Megatron-LM's _set_random_seed: pipeline stages differ so that their dropout masks do
    seed = args.seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    return where


def _activation(args):
    import torch.nn.functional as F

    if args.swiglu:
        return F.silu
    if getattr(args, "squared_relu", False):
        return _squared_relu
    if getattr(args, "gelu_tanh", False):  # MindSpeed-LLM's, gated (training.transformer_config)
        return _tanh_gelu
    # Megatron-LM's --openai-gelu: the tanh approximation; functools.partial would hide F.gelu from
    # megatron-core's own checks of activation_func, so a named function
    return _tanh_gelu if getattr(args, "openai_gelu", False) else F.gelu


def _squared_relu(x):
    """Megatron-LM's --squared-relu (megatron-core 0.16's activations.squared_relu; 0.12 has no module for it)."""
    import torch.nn.functional as F

    return torch.pow(F.relu(x), 2)


def _tanh_gelu(x):
    import torch.nn.functional as F

    return F.gelu(x, approximate="tanh")


def _softmax_scale(args):
    """None (megatron-core's 1 / sqrt(kv-channels)) unless MindSpeed-LLM's --query-pre-attn-scalar N (1 / sqrt(N))
    or LongRoPE (x mscale^2) changes it."""
    from megatron_glue.training.gpt import longrope_mscale

    pre_attn = getattr(args, "query_pre_attn_scalar", None)
    longrope = getattr(args, "rope_scaling_type", None) == "longrope"
    if pre_attn is None and not longrope:
        return None
    scale = 1.0 / math.sqrt(pre_attn or args.kv_channels or args.hidden_size // args.num_attention_heads)
    return scale * longrope_mscale(args) ** 2 if longrope else scale


def transformer_config(args, where):
    from megatron.core.transformer import TransformerConfig

    dtype = DTYPES[args.params_dtype]
    pipelined = args.pipeline_model_parallel_size > 1
    interleaved = args.virtual_pipeline_model_parallel_size is not None
    fields = dict(
        num_layers=args.num_layers, hidden_size=args.hidden_size, ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads, kv_channels=args.kv_channels,
        num_query_groups=args.num_query_groups, hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout, init_method_std=args.init_method_std,
        normalization=args.normalization, layernorm_epsilon=args.norm_epsilon,
        gated_linear_unit=args.swiglu or getattr(args, "gelu_tanh", False), activation_func=_activation(args),
        add_bias_linear=args.add_bias_linear, add_qkv_bias=args.add_qkv_bias,
        qk_layernorm=getattr(args, "qk_layernorm", False),
        # --query-pre-attn-scalar; LongRoPE scales the rotated q and k by mscale (the whole head: --rotary-percent
        # 1): scores x mscale^2
        softmax_scale=_softmax_scale(args),
        # MindSpeed-LLM's --add-rmsnorm-offset: the "sp" group's zero_centered_rms_norm builds it
        layernorm_zero_centered_gamma=getattr(args, "add_rmsnorm_offset", False),
        **sliding_window_fields(args),
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
        sequence_parallel=args.sequence_parallel,
        context_parallel_size=getattr(args, "context_parallel_size", 1),
        params_dtype=dtype, pipeline_dtype=dtype, fp16=args.fp16, bf16=args.bf16,
        # Fusions are the compiler's: Megatron's hand-fused kernels (jit/apex/TE) stay off so that the plain
        # ops reach the backend's rules.
        bias_activation_fusion=False, masked_softmax_fusion=False, bias_dropout_fusion=False,
        apply_rope_fusion=False, persist_layer_norm=False, gradient_accumulation_fusion=False,
        # Megatron-LM's --attention-softmax-in-fp32 (default off); megatron-core's own default is on
        attention_softmax_in_fp32=getattr(args, "attention_softmax_in_fp32", False),
        use_cpu_initialization=where.device.type == "cpu",
        # p2p: no torch.cuda.synchronize; at PP=2 interleaved, batched p2p posts the send to and the receive
        # from the same peer with the same tag, and gloo swaps activations and grads (wrong losses, no error)
        batch_p2p_comm=not interleaved, batch_p2p_sync=False, overlap_p2p_comm=False,
        deallocate_pipeline_outputs=pipelined,
        **recompute_fields(args),
        **(versions.uneven_stages(args.num_layer_list) if getattr(args, "num_layer_list", None) else {}),
        **moe_fields(args),
        **linear_attention_fields(args),
    )
    fields.update(versions.transformer_config_extras())
    with quiet_megatron():
        try:
            config = TransformerConfig(**fields)
        except (AssertionError, ValueError) as e:
            if not fields.get("num_moe_experts"):
                raise
            # megatron-core's own MoE rules (router and dispatcher combinations): one line, as the other checks
            from megatron_glue.training.arguments import ArgumentError

            raise ArgumentError(f"pretrain_gpt: error: megatron-core refuses this MoE configuration: {e}") from None
    if getattr(args, "no_pad_to_seq_lengths", False) and pipelined:
        # micro-batches of their own lengths: the pipeline's p2p sends each shape first (MindSpeed-LLM's
        # FinetuneFeature sets it for --no-pad-to-seq-lengths). Set after the config's checks, as MindSpeed-LLM's
        # transformer_config patch does: megatron-core refuses it with the allgather MoE dispatcher, its default
        # even without experts, and p2p is all it changes in a dense model
        config.variable_seq_lengths = True
    # no TransformerConfig field: read by the "sp" group's zero_centered_rms_norm
    config.rmsnorm_weight_in_fp32 = getattr(args, "rmsnorm_weight_in_fp32", False)
    return config


def sliding_window_fields(args) -> dict:
    """MindSpeed-LLM's --interleave-sliding-window W as megatron-core's local attention spells it (0.15+:
    dot_product_attention.py, utils.is_layer_window_attention): layer_number % 2 != 0 (1-based: 1, 3, ...) keeps
    the keys i - (W - 1) .. i (window_size (W - 1, 0)), as MindSpeed-LLM's TransformerLayerWithPostNorm
    (is_sliding = not (layer_number - 1) % 2, mask tril(diagonal=-W)) and transformers' Gemma2 (layer_idx % 2 == 0)
    do; the others attend causally."""
    window = getattr(args, "interleave_sliding_window", None)
    return {} if window is None else dict(window_size=(window - 1, 0), window_attn_skip_freq=2)


def linear_attention_fields(args) -> dict:
    """MindSpeed-LLM's Qwen3-Next flags as megatron-core 0.16's TransformerConfig fields (docs/linear_attention.md):
    Gated DeltaNet layers with every --full-attention-interval-th layer full attention, that attention with Qwen3-Next's
    sigmoid output gate (MindSpeed-LLM's qwen3_next_full_attention.py:152-155,210); none without the flag."""
    interval = getattr(args, "full_attention_interval", None)
    if interval is None:
        return {}
    return dict(experimental_attention_variant="gated_delta_net", linear_attention_freq=interval,
                attention_output_gate=True, linear_conv_kernel_dim=args.mamba_d_conv,
                linear_key_head_dim=args.linear_key_head_dim, linear_value_head_dim=args.linear_value_head_dim,
                linear_num_key_heads=args.linear_num_key_heads, linear_num_value_heads=args.linear_num_value_heads)


def moe_fields(args) -> dict:
    """The MoE flags as TransformerConfig fields (megatron-core's MoELayer with SequentialMLP experts; docs/moe.md);
    none for a dense model."""
    if not getattr(args, "num_experts", None):
        return {}
    types, coeffs = args.moe_router_load_balancing_type, args.moe_aux_loss_coeff
    return dict(
        num_moe_experts=args.num_experts, moe_ffn_hidden_size=args.moe_ffn_hidden_size,
        moe_router_topk=args.moe_router_topk,
        # one type: a string and a float, as 0.12's config takes them (0.16 takes lists too)
        moe_router_load_balancing_type=types[0] if len(types) == 1 else list(types),
        moe_aux_loss_coeff=coeffs[0] if len(coeffs) == 1 else list(coeffs),
        moe_z_loss_coeff=args.moe_z_loss_coeff, moe_router_score_function=args.moe_router_score_function,
        moe_router_pre_softmax=args.moe_router_pre_softmax,
        moe_router_topk_scaling_factor=args.moe_router_topk_scaling_factor,
        moe_router_enable_expert_bias=args.moe_router_enable_expert_bias,
        moe_router_bias_update_rate=args.moe_router_bias_update_rate,
        moe_router_num_groups=args.moe_router_num_groups, moe_router_group_topk=args.moe_router_group_topk,
        moe_router_dtype=args.moe_router_dtype, moe_input_jitter_eps=args.moe_input_jitter_eps,
        moe_shared_expert_intermediate_size=args.moe_shared_expert_intermediate_size,
        moe_layer_freq=args.moe_layer_freq, moe_token_dispatcher_type=args.moe_token_dispatcher_type,
        expert_model_parallel_size=args.expert_model_parallel_size,
        expert_tensor_parallel_size=args.expert_tensor_parallel_size,
        moe_grouped_gemm=False,
        # Transformer Engine's fused permute (moe_utils.py permute(fused=True)); --moe-permute-fusion names the
        # backend's permute / unpermute rules instead (arguments.MINDSPEED_FUSIONS)
        moe_permute_fusion=False,
        # 0.16's field; set only when asked (0.12's config has none; the parser refuses the flag there)
        **({"moe_shared_expert_gate": True} if getattr(args, "moe_shared_expert_gate", False) else {}),
    )


def recompute_fields(args) -> dict:
    """--recompute-* as TransformerConfig fields. Full recompute is megatron-core's own: TransformerBlock's
    checkpointed forward wraps the chosen layers (uniform: every chunk of N; block: the first N of the stage) in
    tensor_parallel.checkpoint, around the compiled layers, whose graphs stay whole (docs/recompute.md).
    Selective (core attention): eagerly megatron-core's checkpointed core attention; compiled, the backend's
    fused attention, whose backward recomputes the attention probabilities from the saved softmax statistics,
    so the config asks for nothing more (checkpointing inside a layer's graph would break it)."""
    granularity = getattr(args, "recompute_granularity", None)
    if granularity is None or granularity == "selective" and args.npu_compile:
        return {}
    if granularity == "selective":
        return dict(recompute_granularity="selective")
    return dict(recompute_granularity="full", recompute_method=args.recompute_method,
                recompute_num_layers=args.recompute_num_layers)


def compile_model(chunk, args) -> None:
    """Each transformer layer, the embedding, and the output layer with the loss (see loss_in_graph): compiled
    with backend="ascend", in place (parameter names, sharded_state_dict and DDP's grad hooks unchanged). Layers
    of the same structure share one compiled graph: Dynamo (torch 2.13, inline_inbuilt_nn_modules) takes their parameters as inputs and
    guards on structure, not identity, so N identical layers compile once and never approach the recompile limit;
    report.json ``reused_by`` counts the layers running each graph. The module's own hooks stay outside the graph
    (megatron_glue.capture.training_adaptations: --overlap-param-gather). With the ``cache`` option on (the
    default), each is compiled through npu_compile.precompile: a restarted job loads what Dynamo, aot_autograd and
    the backend made instead of tracing again."""
    from megatron_glue.capture.training_adaptations import COMPILED_FORWARD

    from npu_compile import precompile
    from npu_compile.config import DUMP_DIR_ENV

    options = dict(args.npu_compile_options)
    dump_dir = options.get("dump_dir") or os.environ.get(DUMP_DIR_ENV)
    if dump_dir and dist.is_initialized() and dist.get_world_size() > 1:
        # every rank compiles graphs with the same ids: one folder per rank keeps them apart
        options["dump_dir"] = os.path.join(dump_dir, f"rank{dist.get_rank()}")
    if getattr(args, "num_experts", None):
        moe_dynamo_config()
    layers = noop_layers.real_layers(chunk.decoder.layers)  # --noop-layers' empty layers: nothing to compile
    modules = list(layers)
    if chunk.pre_process:
        modules.append(chunk.embedding)
    if chunk.post_process:
        if loss_in_graph(chunk, args):
            # the output layer and the loss in one graph, where the loss fuses (vocab_parallel_cross_entropy)
            chunk._postprocess = precompile.compile(chunk._postprocess, options)
        else:
            modules.append(chunk.output_layer)
    layer_options = options
    if options.get("memory_budget") == "auto":
        # the memory plan of "auto": what the job holds besides activations, and how many forwards of the layer
        # graph hold theirs at once (every layer of the chunk, for each micro-batch in flight), unless given
        options.setdefault("resident_memory", model_state_bytes(chunk, args))
        layer_options = {**options}
        layer_options.setdefault("activation_copies", len(layers) * in_flight_micro_batches(args))
    for module in modules:
        opts = layer_options if module in layers else options
        module.forward = precompile.compile(module.forward, opts)
        setattr(module, COMPILED_FORWARD, True)


def compile_layers(model, options: dict | None = None):
    """A megatron-core GPTModel compiled in place as the training job compiles it (:func:`compile_model`): each
    transformer layer's forward, the embedding, and the output layer with the loss (0.16; 0.12: the output layer),
    each through npu_compile.precompile.compile with ``options`` (backend="ascend"'s). Layers of one structure share
    one compiled graph; with the ``cache`` option on (the default) a second process loads what Dynamo,
    aot_autograd and the backend made instead of tracing again, which ``torch.compile(model)`` under layer frames
    cannot. For a loop of your own after ``megatron_glue.adapt()``: call the model itself, not a torch.compile of
    it. With ``memory_budget="auto"``, the resident memory defaults to the model's parameters, gradients and fp32
    Adam state. Returns the model."""
    config = model.config
    compile_model(model, argparse.Namespace(npu_compile_options=dict(options or {}),
                                            num_experts=config.num_moe_experts,
                                            bf16=config.bf16, fp16=config.fp16))
    return model


# The router's layer number, by its Dynamo source in a layer's frame (self.mlp.router.layer_number) or a model's
ROUTER_LAYER_NUMBER = r".*\._modules\['router'\]\.layer_number"


def moe_dynamo_config() -> None:
    """Dynamo settings an MoE layer needs to be captured whole (docs/moe.md): the router's token counts become
    the dispatcher's split sizes and permutation sizes (`.tolist()`, `masked_select`, `nonzero`), data-dependent
    values Dynamo keeps in the graph as unbacked symbols only with these on (otherwise a graph break at each).
    And the router's ``layer_number`` a symbol, not a constant: the aux-loss tracker indexes its per-layer values
    with it (``save_to_aux_losses_tracker``), and Dynamo, which takes a module's int attributes as constants,
    compiled every MoE layer of the job once more and ran those past its recompile limit (8) uncompiled.
    Process-wide, as torchtitan sets them for its MoE blocks; set before the first layer is traced."""
    import torch._dynamo.config as dynamo_config

    dynamo_config.capture_scalar_outputs = True
    dynamo_config.capture_dynamic_output_shape_ops = True
    sources = torch.compiler.config.dynamic_sources  # appended to: $TORCH_COMPILE_DYNAMIC_SOURCES stays in
    if ROUTER_LAYER_NUMBER not in sources.split(","):
        torch.compiler.config.dynamic_sources = ",".join(filter(None, [sources, ROUTER_LAYER_NUMBER]))


def model_state_bytes(chunk, args) -> int:
    """Bytes of one chunk's parameters, gradients and optimizer state on this rank, as megatron-core keeps them:
    parameters in bf16/fp16 or fp32; gradients in fp32 with --accumulate-allreduce-grads-in-fp32 (or fp32
    training), else in the parameters' dtype; Adam's two fp32 moments (bf16 with --o2-optimizer; SGD's one
    momentum) plus an fp32 master
    copy of half-precision parameters, divided over the data-parallel ranks with --use-distributed-optimizer;
    gradients and optimizer state only for the trained parameters (with LoRA, the adapters)."""
    n = sum(p.numel() for p in chunk.parameters())
    trained = sum(p.numel() for p in chunk.parameters() if p.requires_grad)  # LoRA: the adapters alone
    half = bool(getattr(args, "bf16", False) or getattr(args, "fp16", False))
    param = 2 if half else 4
    grad = 4 if getattr(args, "accumulate_allreduce_grads_in_fp32", False) or not half else 2
    moments = 4 if getattr(args, "o2_optimizer", False) else 8  # two fp32 moments, or bf16 with --o2-optimizer
    state = (moments if getattr(args, "optimizer", "adam") == "adam" else 4) + (4 if half else 0)
    if getattr(args, "use_distributed_optimizer", False):
        from megatron.core import parallel_state

        state /= parallel_state.get_data_parallel_world_size()
    return int(n * param + trained * (grad + state))


def in_flight_micro_batches(args) -> int:
    """Micro-batches whose activations a stage holds at once: 1 without pipelining; with it, 1F1B's warm-up on
    the first stage holds one per pipeline stage (an upper bound for the later stages; interleaving holds more,
    counted as one per virtual stage too)."""
    pp = getattr(args, "pipeline_model_parallel_size", 1) or 1
    vpp = getattr(args, "virtual_pipeline_model_parallel_size", None) or 1
    return pp * vpp if pp > 1 else 1


def loss_in_graph(chunk, args) -> bool:
    """Whether the last stage compiles its output layer together with the loss: megatron-core 0.16's GPTModel
    runs both in ``_postprocess`` (0.12 inlines them in ``forward``, which holds the decoder too: there the
    output layer compiles alone and the loss runs eagerly). Not with --overlap-param-gather, whose forward
    pre-hook on the output layer would run inside the graph (an async collective's wait: a graph break)."""
    return callable(getattr(chunk, "_postprocess", None)) and not getattr(args, "overlap_param_gather", False)


def build_model(args, where, model_provider):
    """Model chunks for this pipeline stage (one per virtual stage), compiled, wrapped in Float16Module and
    Megatron's DDP; returns (chunks, config)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer.module import Float16Module

    config = transformer_config(args, where)
    vpp = args.virtual_pipeline_model_parallel_size
    chunks = []
    for stage in range(vpp or 1):
        vp_stage = stage if vpp else None
        pre, post = versions.pipeline_position(vp_stage)
        with quiet_megatron():
            chunk = model_provider(args, config, pre_process=pre, post_process=post, vp_stage=vp_stage)
        if lora.enabled(args):  # adapters in, the rest frozen: before compiling, Float16Module and DDP see it
            lora.inject(chunk, config, args)
        chunk.to(where.device)
        if args.npu_compile:
            compile_model(chunk, args)
        chunks.append(chunk)
    if args.fp16 or args.bf16:
        chunks = [Float16Module(config, c) for c in chunks]
    dynamic_fp16 = args.fp16 and args.loss_scale is None
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=args.accumulate_allreduce_grads_in_fp32,
        overlap_grad_reduce=args.overlap_grad_reduce, overlap_param_gather=args.overlap_param_gather,
        use_distributed_optimizer=args.use_distributed_optimizer,
        # With dynamic loss scaling an overflowed fp16 step has non-finite grads by design: the grad scaler
        # finds them and skips the step. The loss itself is still checked (train_step).
        check_for_nan_in_grad=args.check_for_nan_in_loss_and_grad and not dynamic_fp16,
        bucket_size=args.ddp_bucket_size)
    _print_parameters(chunks, lora.enabled(args))
    chunks = [DistributedDataParallel(config=config, ddp_config=ddp_config, module=c,
                                      disable_bucketing=i > 0) for i, c in enumerate(chunks)]
    for c in chunks:
        c.broadcast_params()  # DP replicas start equal (Megatron-LM does this after wrapping)
    return chunks, config


def _print_parameters(chunks, adapters: bool = False) -> None:
    """Megatron-LM's get_model: the parameter count of this model-parallel rank, printed by its DP rank 0; with
    LoRA, the trainable part too (peft's print_trainable_parameters)."""
    from megatron.core import parallel_state as ps

    if ps.get_data_parallel_rank() == 0:
        tp, pp = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
        print(parameters_line(tp, pp, sum(p.nelement() for c in chunks for p in c.parameters())), flush=True)
        if adapters:
            print(lora.trainable_line(chunks, tp, pp), flush=True)


def build_optimizer(args, chunks, config):
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    opt_config = OptimizerConfig(
        optimizer=args.optimizer, lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay,
        adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2, adam_eps=args.adam_eps,
        fp16=args.fp16, bf16=args.bf16, params_dtype=DTYPES[args.params_dtype], loss_scale=args.loss_scale,
        initial_loss_scale=args.initial_loss_scale, min_loss_scale=args.min_loss_scale,
        loss_scale_window=args.loss_scale_window, hysteresis=args.hysteresis, clip_grad=args.clip_grad,
        use_distributed_optimizer=args.use_distributed_optimizer,
        # 0.14 on also tell the optimizer (0.12: the DDP config alone)
        **({"overlap_param_gather": args.overlap_param_gather}
           if "overlap_param_gather" in OptimizerConfig.__dataclass_fields__ else {}))
    with quiet_megatron():
        optimizer = get_megatron_optimizer(opt_config, chunks)
    if getattr(args, "o2_optimizer", False):  # MindSpeed-LLM's O2: Adam's moments in bf16
        from megatron_glue.training import o2

        inner = o2.enable(optimizer)
        print_rank0(f" --o2-optimizer: Adam moment bytes on rank 0 {o2.moment_bytes(inner, torch.float32)} -> "
                    f"{o2.moment_bytes(inner, torch.bfloat16)} (bf16 between steps)")
    if args.reuse_fp32_param:  # MindSpeed's: the fp32 master weights kept as bf16 weights + 16-bit residuals
        from megatron_glue.training import reuse_fp32_param

        for reused in reuse_fp32_param.enable(optimizer):
            print_rank0(f" --reuse-fp32-param: parameter and optimizer bytes on rank 0 {reused.bytes_before} -> "
                        f"{reused.bytes_after} (fp32 master weights in the bf16 parameter buffer)")
    gbs = args.global_batch_size
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=args.lr_warmup_init, max_lr=args.lr, min_lr=args.min_lr,
        lr_warmup_steps=args.lr_warmup_iters * gbs, lr_decay_steps=args.lr_decay_iters * gbs,
        lr_decay_style=args.lr_decay_style, start_wd=args.weight_decay, end_wd=args.weight_decay,
        wd_incr_steps=args.train_iters * gbs, wd_incr_style="constant")
    _wire_config(args, config, chunks, optimizer)
    return optimizer, scheduler


def _wire_config(args, config, chunks, optimizer):
    """The callbacks Megatron-LM's setup puts on the config for the schedules (training.py, `train`)."""
    from megatron.core.distributed import finalize_model_grads

    config.grad_scale_func = optimizer.scale_loss
    config.finalize_model_grads_func = finalize_model_grads
    if args.overlap_grad_reduce:
        config.no_sync_func = [c.no_sync for c in chunks]
        config.grad_sync_func = [c.start_grad_sync for c in chunks]
        if len(chunks) == 1:
            config.no_sync_func, config.grad_sync_func = config.no_sync_func[0], config.grad_sync_func[0]
    if args.overlap_param_gather:
        config.param_sync_func = [c.start_param_sync for c in chunks]
        if len(chunks) == 1:
            config.param_sync_func = config.param_sync_func[0]


# -- one iteration ------------------------------------------------------------------------------------------------

def _loss_pairs(losses_reduced) -> dict[str, torch.Tensor]:
    """Per key, the [loss sum, token count] pairs summed over micro-batches and DP x CP (last stage only: each CP
    rank holds its part of every sequence)."""
    from megatron.core import parallel_state

    out = {}
    if not parallel_state.is_pipeline_last_stage(ignore_virtual=True) or not losses_reduced:
        return out
    for key in losses_reduced[0]:
        pair = torch.vstack([x[key].view(-1).float() for x in losses_reduced]).sum(dim=0)
        dist.all_reduce(pair, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
        out[key] = pair
    return out


def _reduce_losses(losses_reduced) -> dict[str, float]:
    """Megatron-LM's reduction: per key, the loss sum over the token count, both summed over micro-batches and
    DP."""
    return {key: (pair[0] / pair[1]).item() for key, pair in _loss_pairs(losses_reduced).items()}


def _broadcast_from_last_stage(values: dict[str, float], keys) -> dict[str, float]:
    """The last pipeline stage's losses on every rank (rank 0 logs them)."""
    from megatron.core import parallel_state

    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return values
    t = torch.tensor([values.get(k, 0.0) for k in keys], dtype=torch.float64)
    last = parallel_state.get_pipeline_model_parallel_last_rank()
    dist.broadcast(t, src=last, group=parallel_state.get_pipeline_model_parallel_group())
    return dict(zip(keys, t.tolist()))


def train_step(args, forward_step, data_iterator, chunks, optimizer, scheduler):
    from megatron.core.num_microbatches_calculator import get_num_microbatches
    from megatron.core.pipeline_parallel import get_forward_backward_func

    for c in chunks:
        c.zero_grad_buffer()
    optimizer.zero_grad()
    losses = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=data_iterator, model=chunks,
        num_microbatches=get_num_microbatches(), seq_length=args.seq_length,
        micro_batch_size=args.micro_batch_size, decoder_seq_length=args.seq_length, forward_only=False)
    update_successful, grad_norm, _ = optimizer.step()
    if update_successful:
        scheduler.step(increment=args.global_batch_size)
    return _reduce_losses(losses), not update_successful, grad_norm


def evaluate(args, forward_step, data_iterator, chunks) -> dict[str, float]:
    from megatron.core.num_microbatches_calculator import get_num_microbatches
    from megatron.core.pipeline_parallel import get_forward_backward_func

    for c in chunks:
        c.eval()
    # Megatron-LM's evaluate: loss sums and token counts summed over every eval iteration, divided once (an
    # iteration with fewer unmasked tokens weighs less)
    totals: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for _ in range(args.eval_iters):
            losses = get_forward_backward_func()(
                forward_step_func=forward_step, data_iterator=data_iterator, model=chunks,
                num_microbatches=get_num_microbatches(), seq_length=args.seq_length,
                micro_batch_size=args.micro_batch_size, decoder_seq_length=args.seq_length, forward_only=True)
            for key, pair in _loss_pairs(losses).items():
                totals[key] = totals[key] + pair if key in totals else pair
    for c in chunks:
        c.train()
    values = {k: (pair[0] / pair[1]).item() for k, pair in totals.items()}
    return _broadcast_from_last_stage(values, ["lm loss"])


# -- the job ------------------------------------------------------------------------------------------------------

def _iterators(args, build, datasets, consumed: tuple[int, int], chunks):
    """(train, valid, test) iterators, one per model chunk that reads data (first or last stage), else None."""
    from megatron.core import parallel_state

    train_ds, valid_ds, test_ds = datasets
    per_chunk = []
    for inner in versions.unwrap_model(chunks):
        reads = inner.pre_process or inner.post_process
        if not reads:
            per_chunk.append((None, None, None))
            continue
        dp_rank, dp = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
        per_chunk.append(tuple(
            build(ds, consumed_samples=c, micro_batch_size=args.micro_batch_size, data_parallel_rank=dp_rank,
                  data_parallel_size=dp, num_workers=getattr(args, "num_workers", 0)) if ds is not None else None
            for ds, c in ((train_ds, consumed[0]), (valid_ds, consumed[1]), (test_ds, 0))))
    if len(chunks) == 1:
        return per_chunk[0]
    return tuple([p[i] for p in per_chunk] for i in range(3))


def init_moe_metrics(args, device) -> None:
    """The tracker entries of the MoE losses this job logs, made before the first step: Megatron-LM's
    track_moe_metrics(force_initialize=True) makes the missing ones on "cuda"; made here on the job's device, and
    before any layer is traced, so that a compiled layer finds them (one graph, no recompile when they appear)."""
    tracker = versions.moe_tracker()
    for name in versions.moe_track_names(args):
        if name not in tracker:
            tracker[name] = {"values": torch.zeros(args.num_layers, device=device), "reduce_group": None,
                             "avg_group": None, "reduce_group_has_dp": False}


class _NoWriter:
    """A TensorBoard writer's add_scalar, writing nothing (TensorBoard is refused here: --tensorboard-dir)."""

    def add_scalar(self, *args, **kwargs):
        pass


def moe_metrics(args, iteration: int) -> dict[str, float]:
    """This iteration's MoE losses as Megatron-LM logs them: megatron-core's track_moe_metrics (reduced over the
    pipeline and the router's groups, scaled by 1 / micro-batches, averaged over the MoE layers; the tracker
    cleared; the load-balancing loss averaged over DP on 0.12 too: versions.average_load_balancing_over_dp), the
    same value on every rank."""
    from megatron.core.num_microbatches_calculator import get_num_microbatches
    from megatron.core.transformer.moe.moe_utils import track_moe_metrics

    totals: dict = {}
    versions.average_load_balancing_over_dp(args)
    # a writer that writes nothing: 0.12's track_moe_metrics fills total_loss_dict only when given a writer (0.12.1:
    # transformer/moe/moe_utils.py:692), 0.16's always
    track_moe_metrics(loss_scale=1 / get_num_microbatches(), iteration=iteration, writer=_NoWriter(),
                      total_loss_dict=totals, track_names=versions.moe_track_names(args), num_layers=args.num_layers,
                      moe_layer_freq=args.moe_layer_freq)
    # MindSpeed's --noop-layers: the mean over the MoE layers less the empty ones (moe_metrics_tracker.py get_mean)
    scale = noop_layers.moe_mean_scale(args)
    return {name: float(value) * scale for name, value in totals.items()}


def _count_graphs() -> dict:
    import torch._dynamo.utils as dynamo_utils

    stats = dynamo_utils.counters["stats"]
    breaks = sum(dynamo_utils.counters["graph_break"].values())
    return {"graphs": int(stats.get("unique_graphs", 0)), "graph_breaks": int(breaks)}


def pretrain(args, model_provider, forward_step, datasets_provider, build_loader):
    """Megatron-LM's pretrain(): set up, load, train with periodic evaluation and saves, evaluate, exit."""
    where = initialize(args)
    # Megatron-LM's validate_args ends with the arguments dump (its tokenizer is not among its args)
    print_rank0(arguments_lines(argparse.Namespace(**{k: v for k, v in vars(args).items() if k != "tokenizer"})))
    if args.load and getattr(args, "exit_on_missing_checkpoint", False) and checkpointing.read_tracker(args.load) is None:
        raise checkpointing.CheckpointError(
            f"--load {args.load}: no checkpoint there ({checkpointing.TRACKER} missing), and "
            "--exit-on-missing-checkpoint says to stop rather than start from random weights")
    state = State()
    if getattr(args, "num_experts", None):
        init_moe_metrics(args, where.device)
    chunks, config = build_model(args, where, model_provider)
    optimizer, scheduler = build_optimizer(args, chunks, config)
    if args.load:
        state.iteration, state.consumed_train_samples, state.consumed_valid_samples = \
            checkpointing.load_checkpoint(args, chunks, optimizer, scheduler)
    datasets = datasets_provider(args)
    state.has_split = tuple(d is not None for d in datasets)
    train_it, valid_it, test_it = _iterators(
        args, build_loader, datasets, (state.consumed_train_samples, state.consumed_valid_samples), chunks)

    metrics_path = args.metrics_file or (os.path.join(args.save, "metrics.jsonl") if args.save else None)
    metrics = Metrics(metrics_path, show_progress=not args.no_progress_bar, total=args.train_iters,
                      start=state.iteration, tensorboard=TensorBoard(args, where.device))
    tokens_per_iteration = args.global_batch_size * args.seq_length
    if not args.skip_train:
        _train(args, forward_step, chunks, optimizer, scheduler, train_it, valid_it, state, metrics,
               tokens_per_iteration, where)
    # Megatron-LM's order: the last save, then the final evaluation
    if args.save and not args.skip_train and state.iteration > 0 and (
            args.save_interval is None or state.iteration % args.save_interval):
        checkpointing.save_checkpoint(args, state.iteration, chunks, optimizer, scheduler,
                                      state.consumed_train_samples, state.consumed_valid_samples)
    if args.eval_iters > 0:
        _evaluate_and_print(args, forward_step, valid_it, chunks, state, metrics, "on validation set")
        _evaluate_and_print(args, forward_step, test_it, chunks, state, metrics, "on test set", split=2)
    state.graph_counts = _count_graphs()
    metrics.record("end", iteration=state.iteration, skipped_iterations=state.skipped_iterations,
                   **state.graph_counts)
    plot = metrics.close()
    if plot:
        print_rank0(f" loss curve: {plot}")
    return state


def _evaluate_and_print(args, forward_step, data_iterator, chunks, state, metrics, suffix="", split=1):
    """Megatron-LM's evaluate_and_print_results on the validation (split 1) or test (split 2) data."""
    if not state.has_split[split]:
        return
    manual_gc = getattr(args, "manual_gc", False) and getattr(args, "manual_gc_eval", True)
    if manual_gc:
        gc.collect()  # Megatron-LM: everything, before the evaluation
    losses = evaluate(args, forward_step, data_iterator, chunks)
    if getattr(args, "num_experts", None):
        from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker

        clear_aux_losses_tracker()  # evaluation's forwards are not the next iteration's MoE losses
    if manual_gc:
        gc.collect(generation=0)  # and what the evaluation made, after it
    if split == 1:
        state.consumed_valid_samples += args.eval_iters * args.global_batch_size
    prefix = f"iteration {state.iteration}" + (f" {suffix}" if suffix else "")
    print_rank0(validation_lines(prefix, losses))
    metrics.record("validation" if split == 1 else "test", iteration=state.iteration, **losses)
    if not args.skip_train:  # Megatron-LM: write_to_tensorboard=not args.skip_train
        metrics.tensorboard.validation(state.iteration, state.consumed_train_samples, losses)


@dataclass
class _Interval:
    """What one --log-interval accumulates (Megatron-LM's total_loss_dict): reset after each log line."""
    seconds: float = 0.0
    iterations: int = 0
    skipped: int = 0
    nan: int = 0
    loss_sums: dict = field(default_factory=dict)


def _train(args, forward_step, chunks, optimizer, scheduler, train_it, valid_it, state, metrics, tokens_per_it,
           where):
    interval = _Interval()
    for c in chunks:
        c.train()
    if getattr(args, "manual_gc", False):
        # Megatron-LM's --manual-gc: no threshold-based collection, so that ranks collect at the same points
        gc.disable()
        gc.collect()
    flops_per_iteration = (num_floating_point_operations(args, args.global_batch_size)
                           if getattr(args, "log_throughput", False) else None)
    utilization = monitor.Utilization(where.device)
    try:
        _train_loop(args, forward_step, chunks, optimizer, scheduler, train_it, valid_it, state, metrics,
                    tokens_per_it, where, interval, flops_per_iteration, utilization)
    finally:
        utilization.close()


def _train_loop(args, forward_step, chunks, optimizer, scheduler, train_it, valid_it, state, metrics, tokens_per_it,
                where, interval, flops_per_iteration, utilization):
    # Megatron-LM's report_memory_flag: the memory line at the logged iterations until one after the first
    report_memory, first = True, state.iteration
    while state.iteration < args.train_iters:
        started = time.perf_counter()
        losses, skipped, grad_norm = train_step(args, forward_step, train_it, chunks, optimizer, scheduler)
        losses = _broadcast_from_last_stage(losses, ["lm loss"])
        if getattr(args, "num_experts", None):
            losses.update(moe_metrics(args, state.iteration + 1))
        state.iteration += 1
        state.consumed_train_samples += args.global_batch_size
        loss = losses.get("lm loss")
        if loss is not None and not math.isfinite(loss) and args.check_for_nan_in_loss_and_grad:
            raise FloatingPointError(f"iteration {state.iteration}: the lm loss is {loss}; stopping "
                                     "(--no-check-for-nan-in-loss-and-grad trains on)")
        # Megatron-LM's bookkeeping: a skipped step's loss is left out of the average; among skipped steps,
        # those whose loss is not finite are the "nan iterations"
        interval.iterations += 1
        interval.seconds += time.perf_counter() - started  # evaluation and saves are not iteration time
        if skipped:
            interval.skipped += 1
            interval.nan += int(loss is not None and not math.isfinite(loss))
        else:
            for k, v in losses.items():
                interval.loss_sums[k] = interval.loss_sums.get(k, 0.0) + v
        state.skipped_iterations += int(skipped)
        metrics.step(loss)
        lr = optimizer.param_groups[0]["lr"]
        scale = optimizer.get_loss_scale().item()
        norm = None if grad_norm is None else float(grad_norm)
        used = utilization.mean()
        metrics.record("train", iteration=state.iteration, lr=lr, loss_scale=scale, skipped=bool(skipped),
                       grad_norm=norm, **losses, **monitor.memory_mb(where.device), **used)
        metrics.tensorboard.train(state.iteration, state.consumed_train_samples, learning_rate=lr,
                                  batch_size=args.global_batch_size, losses=losses, loss_scale=scale,
                                  grad_norm=norm, utilization=used)
        if state.iteration % args.log_interval == 0:
            counted = max(1, interval.iterations - interval.skipped)
            elapsed = interval.seconds / interval.iterations
            tflops = (flops_per_iteration / (elapsed * 1e12 * args.world_size)
                      if flops_per_iteration is not None else None)
            metrics.tensorboard.timing(state.iteration, elapsed, tflops)
            print_rank0(iteration_line(
                iteration=state.iteration, train_iters=args.train_iters,
                consumed_samples=state.consumed_train_samples, elapsed_ms=elapsed * 1000.0, learning_rate=lr,
                global_batch_size=args.global_batch_size,
                # Megatron-LM's training_log prints a loss only when its average is above 0 (an MoE loss whose
                # coefficient is 0 is not computed)
                losses={k: v / counted for k, v in interval.loss_sums.items() if k == "lm loss" or v > 0},
                loss_scale=scale, grad_norm=norm,
                skipped=interval.skipped, nan=interval.nan, tokens_per_sec=tokens_per_it / elapsed,
                peak_mb=peak_memory_mb(where.device),
                tflops_per_device=tflops))
            interval = _Interval()
            if report_memory:
                from megatron.core import parallel_state

                if parallel_state.get_data_parallel_rank() == 0:
                    print(monitor.report_memory_line(f"(after {state.iteration} iterations)", where.device,
                                                     dist.get_rank()), flush=True)
                report_memory = state.iteration <= first + 1
        if args.eval_interval and state.iteration % args.eval_interval == 0 and args.eval_iters > 0 \
                and state.iteration < args.train_iters:
            _evaluate_and_print(args, forward_step, valid_it, chunks, state, metrics)
        if args.save and args.save_interval and state.iteration % args.save_interval == 0:
            checkpointing.save_checkpoint(args, state.iteration, chunks, optimizer, scheduler,
                                          state.consumed_train_samples, state.consumed_valid_samples)
            for after_save in checkpointing.AFTER_INTERVAL_SAVE.values():
                after_save(args, state.iteration)
        if getattr(args, "manual_gc", False) and args.manual_gc_interval and \
                state.iteration % args.manual_gc_interval == 0:
            gc.collect()
        if args.exit_interval and state.iteration % args.exit_interval == 0:
            print_rank0(f" exiting program at iteration {state.iteration}")
            break
