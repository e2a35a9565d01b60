import pytest
import torch
import torch.distributed as dist

from megatron_glue.capture.models import (
    build_gpt_model,
    gpt_config,
    init_single_process,
    llama_config,
    synthetic_batch,
    train_step,
)
from megatron_glue.capture.adaptations import megatron_core_in, registry
from megatron_glue.capture.testing import adaptations_reverted, megatrons_own_rng_tracker

VOCAB, SEQ = 128, 32
CONFIGS = {"gpt": gpt_config, "llama": llama_config}


def test_init_single_process_twice_is_safe(megatron_cpu):
    from megatron.core import parallel_state

    init_single_process()
    assert dist.get_world_size() == 1 and dist.get_backend() == "gloo"
    assert parallel_state.get_tensor_model_parallel_world_size() == 1
    assert parallel_state.get_pipeline_model_parallel_world_size() == 1


def test_configs():
    gpt, llama = gpt_config(), llama_config(num_query_groups=2, hidden_size=64)
    assert (gpt.num_layers, gpt.hidden_size, gpt.num_attention_heads) == (2, 128, 4)
    assert gpt.params_dtype == torch.float32 and gpt.use_cpu_initialization
    assert gpt.hidden_dropout == gpt.attention_dropout == 0.0
    assert gpt.normalization == "LayerNorm" and gpt.add_bias_linear and not gpt.gated_linear_unit
    assert gpt.activation_func is torch.nn.functional.gelu
    assert llama.normalization == "RMSNorm" and not llama.add_bias_linear and llama.gated_linear_unit
    assert llama.activation_func is torch.nn.functional.silu
    assert (llama.hidden_size, llama.num_query_groups) == (64, 2)


def test_synthetic_batch_is_a_causal_next_token_task():
    b = synthetic_batch(batch=3, seq=8, vocab=10, seed=1)
    assert b["input_ids"].shape == b["labels"].shape == b["position_ids"].shape == (3, 8)
    assert torch.equal(b["labels"][:, :-1], b["input_ids"][:, 1:])
    assert torch.equal(b["labels"], (b["input_ids"] + 1) % 10)  # learnable: next = current + 1
    mask = b["attention_mask"]
    assert mask.dtype == torch.bool and mask.shape == (1, 1, 8, 8)
    assert not mask[0, 0].diagonal().any() and mask[0, 0, 0, 1] and not mask[0, 0, 1, 0]  # True = masked
    assert torch.equal(synthetic_batch(3, 8, 10, seed=1)["input_ids"], b["input_ids"])


def test_same_seed_same_weights(megatron_cpu):
    a, b, c = (build_gpt_model(llama_config(hidden_size=64), VOCAB, SEQ, seed=s) for s in (0, 0, 1))
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert not all(torch.equal(p, q) for p, q in zip(a.parameters(), c.parameters()))


def test_position_embedding_follows_the_config(megatron_cpu):
    assert build_gpt_model(gpt_config(hidden_size=64), VOCAB, SEQ).position_embedding_type == "learned_absolute"
    assert build_gpt_model(llama_config(hidden_size=64), VOCAB, SEQ).position_embedding_type == "rope"


@pytest.mark.parametrize("kind", CONFIGS)
def test_eager_training_lowers_the_loss(megatron_cpu, kind):
    model = build_gpt_model(CONFIGS[kind](hidden_size=64, num_query_groups=2), VOCAB, SEQ)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    batch = synthetic_batch(4, SEQ, VOCAB)
    losses = [train_step(model, batch, optimizer) for _ in range(8)]
    assert losses[-1] < 0.8 * losses[0], losses
    assert all(later < earlier for earlier, later in zip(losses, losses[1:])), losses


def test_dropout_runs_with_the_cpu_rng_tracker(megatron_cpu):
    model = build_gpt_model(gpt_config(hidden_size=64, hidden_dropout=0.1, attention_dropout=0.1), VOCAB, SEQ)
    batch = synthetic_batch(2, SEQ, VOCAB)
    torch.manual_seed(0)
    first = model(**batch)
    assert not torch.equal(first, model(**batch))  # dropout draws fresh masks
    torch.manual_seed(0)
    assert torch.equal(first, model(**batch))  # ... from torch's own generator


def test_model_parallel_cuda_manual_seed_works_on_cpu(megatron_cpu):
    from megatron.core import tensor_parallel

    # Megatron's training entry does this; force_reset_rng exists from 0.14 (0.14.0: tensor_parallel/random.py:334)
    reset = dict(force_reset_rng=True) if megatron_core_in(">=0.14") else {}
    tensor_parallel.model_parallel_cuda_manual_seed(1234, **reset)
    model = build_gpt_model(gpt_config(hidden_size=64), VOCAB, SEQ)
    assert torch.isfinite(model(**synthetic_batch(2, SEQ, VOCAB))).all()


# Each "cpu" adaptation is needed: without it, a forward on CPU fails the way its reason says.
# A fix whose code differs per megatron-core line has one entry per line; the one for this line is applied.
@pytest.mark.parametrize("names, kind, mask", [
    (("fresh_global_buffer",), "gpt", True),
    (("causal_mask_on_default_device",), "gpt", False),
    (("rope_stays_on_device", "rope_stays_on_device_0_12"), "llama", True),
    (("inference_rng_tracker", "inference_rng_tracker_0_12"), "gpt", True),
], ids=lambda v: v[0] if isinstance(v, tuple) else None)
def test_each_cpu_adaptation_is_needed(megatron_cpu, names, kind, mask):
    (name,) = [n for n in names if registry.applies(n)]  # exactly one entry per fix applies to this line
    assert name in registry.applied()
    model = build_gpt_model(CONFIGS[kind](hidden_size=64), VOCAB, SEQ)
    batch = synthetic_batch(2, SEQ, VOCAB)
    if not mask:
        batch["attention_mask"] = None
    with adaptations_reverted(name):
        # The tracker is state, not an attribute: build Megatron's own again, as a fresh process would.
        megatrons_own_rng_tracker()
        expected = "is not added" if name.startswith("inference_rng_tracker") else "Torch not compiled with CUDA"
        with pytest.raises(Exception, match=expected):
            model(**batch)
    assert torch.isfinite(model(**batch)).all()  # and runs once it is back
