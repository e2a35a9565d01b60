"""Small megatron-core GPT models on one process: set-up, configs, batches, a training step.

Used by tests, the demo and the benchmarks. Everything here runs on CPU at TP=1 once the "cpu" adaptations are
applied (`megatron_glue.adapt()`), and at TP>1 in workers set up by `megatron_glue.distributed`; nothing here
patches Megatron itself.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_glue import quiet_megatron
from megatron_glue.distributed import allreduce_sequence_parallel_grads

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
        cuda_graph_scope=[],  # the default, "full", only earns a deprecation warning (transformer_config.py:1705)
    )
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
    """megatron-core GPTModel with the local (no TE) layer spec; same seed, same weights.

    position_embedding_type defaults to "rope" for RMSNorm configs (llama_config) and "learned_absolute" otherwise.
    """
    if position_embedding_type is None:
        position_embedding_type = "rope" if config.normalization == "RMSNorm" else "learned_absolute"
    if not parallel_state.model_parallel_is_initialized():
        raise RuntimeError("Megatron's model-parallel state is not initialised: call init_single_process() first")
    torch.manual_seed(seed)  # use_cpu_initialization draws every weight from torch's CPU generator
    with quiet_megatron():
        return GPTModel(
            config=config,
            transformer_layer_spec=get_gpt_layer_local_spec(normalization=config.normalization),
            vocab_size=vocab_size,
            max_sequence_length=seq_len,
            position_embedding_type=position_embedding_type,
        )


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
