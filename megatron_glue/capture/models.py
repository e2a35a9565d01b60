"""Small megatron-core GPT models on one process: set-up, configs, batches, a training step.

Used by tests, the demo and the benchmarks. Everything here runs on CPU at TP=1 once the "cpu" adaptations are
applied (`megatron_glue.adapt()`), and at TP>1 in workers set up by `megatron_glue.capture.distributed`; nothing here
patches Megatron itself.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_glue.capture import quiet_megatron
from megatron_glue.capture.adaptations import megatron_core_in
from megatron_glue.capture.distributed import allreduce_sequence_parallel_grads

with quiet_megatron():
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig


def init_single_process() -> None:
    """torch.distributed (gloo, world size 1) and Megatron's model-parallel state at TP=PP=1; safe to repeat."""
    if not dist.is_initialized():
        # An in-process store: one rank needs no rendezvous, so no port or file to pick.
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)


def teardown_single_process() -> None:
    """Undo init_single_process; safe to call when nothing is initialised."""
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def _config(defaults: dict, overrides: dict) -> TransformerConfig:
    base = dict(
        num_layers=2,
        hidden_size=128,
        num_attention_heads=4,
        params_dtype=torch.float32,
        use_cpu_initialization=True,  # Megatron's default init path allocates on CUDA
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    if megatron_core_in(">=0.16"):
        # From 0.16 the default, "full", only earns a deprecation warning (transformer_config.py:1705); before,
        # cuda_graph_scope is a plain string and "full" its normal value (0.12.1: transformer_config.py:498).
        base["cuda_graph_scope"] = []
    return TransformerConfig(**{**base, **defaults, **overrides})


def gpt_config(**overrides) -> TransformerConfig:
    """GPT-2 style: LayerNorm, GeLU, biases (position embedding is learned, chosen in build_gpt_model)."""
    return _config(dict(normalization="LayerNorm", activation_func=F.gelu, add_bias_linear=True), overrides)


def llama_config(**overrides) -> TransformerConfig:
    """Llama style: RMSNorm, SwiGLU, no biases (RoPE chosen in build_gpt_model); GQA via num_query_groups=."""
    return _config(
        dict(normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False),
        overrides,
    )


def build_gpt_model(config: TransformerConfig, vocab_size: int = 128, seq_len: int = 64,
                    position_embedding_type: str | None = None, seed: int = 0) -> GPTModel:
    """megatron-core GPTModel with the local (no TE) layer spec; same seed, same weights (the same full model at
    every TP size, on every megatron-core line).

    position_embedding_type defaults to "rope" for RMSNorm configs (llama_config) and "learned_absolute" otherwise.
    A config with ``num_moe_experts`` builds MoE layers (megatron-core's local MoE spec).
    """
    if position_embedding_type is None:
        position_embedding_type = "rope" if config.normalization == "RMSNorm" else "learned_absolute"
    if not parallel_state.model_parallel_is_initialized():
        raise RuntimeError("Megatron's model-parallel state is not initialised: call init_single_process() first")
    torch.manual_seed(seed)  # use_cpu_initialization draws every weight from torch's CPU generator
    with quiet_megatron():
        model = GPTModel(
            config=config,
            # with num_moe_experts: every layer's MLP is megatron-core's MoELayer (SequentialMLP experts)
            transformer_layer_spec=get_gpt_layer_local_spec(num_experts=config.num_moe_experts,
                                                            normalization=config.normalization),
            vocab_size=vocab_size,
            max_sequence_length=seq_len,
            position_embedding_type=position_embedding_type,
        )
    if not megatron_core_in(">=0.16"):
        _glu_fc1_shards_as_from_0_16(model)
    return model


def _glu_fc1_shards_as_from_0_16(model: torch.nn.Module) -> None:
    """Same seed, same model at every TP size, on megatron-core before 0.16 too.

    A GLU's fc1 weight is [gate; up]; each TP rank computes gate and up from the halves of its own shard
    (0.12.1: transformer/mlp.py:139-141), so rank r must hold [gate_r; up_r]. From 0.16 Megatron initialises it
    so (stride 2, transformer/mlp.py:105-109); before, it gives rank r contiguous rows of the master weight
    (no stride, 0.12.1: transformer/mlp.py:69-82), a function other than TP=1's from the same seed. Here each
    rank takes its [gate_r; up_r] of that master weight and its params say stride 2, as they do from 0.16
    (which `distributed.gather_tensor_parallel` reads). Collective over the TP group: all its ranks build.
    """
    from megatron.core.transformer.mlp import MLP

    group = parallel_state.get_tensor_model_parallel_group()
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if world == 1:
        return
    for module in model.modules():
        if not (isinstance(module, MLP) and module.config.gated_linear_unit):
            continue
        for param in (module.linear_fc1.weight, module.linear_fc1.bias):
            if param is None or param.partition_stride != 1:
                continue
            shards = [torch.empty_like(param) for _ in range(world)]
            dist.all_gather(shards, param.detach().contiguous(), group=group)
            chunks = torch.cat(shards, dim=param.partition_dim).chunk(2 * world, dim=param.partition_dim)
            with torch.no_grad():
                param.copy_(torch.cat([chunks[rank], chunks[world + rank]], dim=param.partition_dim))
            param.partition_stride = 2


def synthetic_batch(batch: int = 2, seq: int = 64, vocab: int = 128, seed: int = 0) -> dict:
    """GPTModel keyword arguments for a learnable task: each row counts up from a random start (mod vocab),
    so the next token is a fixed function of the current one and the loss can go to zero.

    attention_mask is bool [1, 1, s, s], True where attention is masked (causal).
    """
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, vocab, (batch, 1), generator=g)
    counting = (start + torch.arange(seq + 1)) % vocab
    return dict(
        input_ids=counting[:, :-1].contiguous(),
        position_ids=torch.arange(seq).expand(batch, seq).contiguous(),
        attention_mask=torch.triu(torch.ones(1, 1, seq, seq, dtype=torch.bool), diagonal=1),
        labels=counting[:, 1:].contiguous(),
    )


def loss_fn(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    """Mean next-token loss: GPTModel returns the per-token loss [b, s] when given labels."""
    return model(**batch).mean()


def train_step(model: torch.nn.Module, batch: dict, optimizer: torch.optim.Optimizer) -> float:
    """Forward, backward, step; returns the loss. `model` may be a torch.compile'd GPTModel.

    Under sequence parallelism the grads of params tagged `.sequence_parallel` are summed over TP before the
    step (Megatron's DDP would do it); the grads stay on the params afterwards."""
    optimizer.zero_grad(set_to_none=True)
    loss = loss_fn(model, batch)
    loss.backward()
    allreduce_sequence_parallel_grads(model)
    optimizer.step()
    return loss.item()
