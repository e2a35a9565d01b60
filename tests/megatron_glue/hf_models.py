"""Random-init HF models of every converted family (no downloads), and the converted checkpoints' logits from
megatron-core at any TP x PP over gloo processes, loaded by the training job's own `load_checkpoint`."""

from __future__ import annotations

import contextlib
import os
import types

import torch

# LongRoPE factors for a head of 16 (8 frequencies), in the spread of Phi-3.5-mini's
LONG_FACTOR = [1.08, 1.11, 1.34, 2.62, 4.79, 9.09, 17.67, 25.5]
SHORT_FACTOR = [1.0, 1.02, 1.03, 1.05, 1.07, 1.11, 1.16, 1.29]
VOCAB = 100          # padded to 128 at TP=1 and 256 at TP=2: every layout exercises the padding
SEQ = 16


def hf_config(name: str, **over):
    """A small transformers config of family `name` (a --model-type-hf value)."""
    import transformers as tf

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, max_position_embeddings=64)
    if name == "llama2":
        cfg = tf.LlamaConfig(**common, num_key_value_heads=4, rms_norm_eps=1e-5, tie_word_embeddings=False)
    elif name == "llama3":
        cfg = tf.LlamaConfig(**common, num_key_value_heads=2, rms_norm_eps=1e-5, tie_word_embeddings=False,
                             rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                              "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                              "original_max_position_embeddings": 8192})
    elif name == "mistral":
        cfg = tf.MistralConfig(**common, num_key_value_heads=2, rms_norm_eps=1e-5, sliding_window=None,
                               tie_word_embeddings=False, rope_parameters={"rope_type": "default",
                                                                          "rope_theta": 1000000.0})
    elif name == "qwen2":  # the small Qwen2s tie their embeddings
        cfg = tf.Qwen2Config(**common, num_key_value_heads=2, rms_norm_eps=1e-6, tie_word_embeddings=True,
                             rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    elif name == "qwen2.5":
        cfg = tf.Qwen2Config(**common, num_key_value_heads=2, rms_norm_eps=1e-6, tie_word_embeddings=False,
                             rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    elif name == "qwen3":  # head_dim 32, not hidden / heads (16), as the real Qwen3s (0.6B: 128, not 1024 / 16)
        cfg = tf.Qwen3Config(**common, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6,
                             tie_word_embeddings=False, rope_parameters={"rope_type": "default",
                                                                        "rope_theta": 1000000.0})
    elif name == "seed-oss":  # q/k/v biases, none on o_proj; head_dim 32 (the real one: 128, not 5120 / 80)
        cfg = tf.SeedOssConfig(**common, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6,
                               attention_bias=True, attention_out_bias=False, attention_dropout=0.0,
                               residual_dropout=0.0, tie_word_embeddings=False,
                               rope_parameters={"rope_type": "default", "rope_theta": 10000000.0})
    elif name == "phi3.5":  # LongRoPE with the original context (8) below SEQ: the long factors, attention x sqrt(2)
        cfg = tf.Phi3Config(**common, num_key_value_heads=2, rms_norm_eps=1e-5, tie_word_embeddings=False,
                            original_max_position_embeddings=8, pad_token_id=None, bos_token_id=None,
                            eos_token_id=None, resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0,
                            rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                             "long_factor": LONG_FACTOR, "short_factor": SHORT_FACTOR})
    elif name == "gemma2":  # window 4 < SEQ: the sliding layers' window bites; head_dim 32, scalar 24 (neither the
        # head size nor hidden / heads), final soft-cap 2 (bites: |logits| ~ 1-2); no attention soft-cap (not built)
        cfg = tf.Gemma2Config(**common, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6,
                              query_pre_attn_scalar=24, sliding_window=4, final_logit_softcapping=2.0,
                              attn_logit_softcapping=None, hidden_activation="gelu_pytorch_tanh",
                              tie_word_embeddings=True, attention_dropout=0.0,
                              rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    elif name == "mixtral":  # 4 experts, top 2: softmax, top k, renormalised (megatron-core's default router)
        cfg = tf.MixtralConfig(**common, num_key_value_heads=2, rms_norm_eps=1e-5, num_local_experts=4,
                               num_experts_per_tok=2, sliding_window=None, router_jitter_noise=0.0,
                               tie_word_embeddings=False, rope_parameters={"rope_type": "default",
                                                                          "rope_theta": 1000000.0})
    elif name == "qwen2-moe":  # q/k/v biases, a gated shared expert of 48; norm_topk_prob false (its default)
        cfg = tf.Qwen2MoeConfig(**common, num_key_value_heads=2, rms_norm_eps=1e-6, num_experts=4,
                                num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                                norm_topk_prob=False, use_sliding_window=False, tie_word_embeddings=False,
                                rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    elif name == "qwen3-moe":  # norm_topk_prob as the real Qwen3-MoEs; experts of 32, not intermediate_size
        cfg = tf.Qwen3MoeConfig(**common, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6, num_experts=4,
                                num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
                                tie_word_embeddings=False, rope_parameters={"rope_type": "default",
                                                                           "rope_theta": 1000000.0})
    elif name == "gpt2":
        cfg = tf.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    else:
        raise ValueError(name)
    for k, v in over.items():
        setattr(cfg, k, v)
    return cfg


FAMILIES = ("llama2", "llama3", "mistral", "qwen2", "qwen2.5", "qwen3", "seed-oss", "phi3.5", "gpt2")
MOE_FAMILIES = ("mixtral", "qwen2-moe", "qwen3-moe")  # tests/megatron_glue/test_convert_moe.py


def _sliding_window_built() -> bool:
    from megatron_glue.capture.adaptations import megatron_core_in

    return megatron_core_in(">=0.15")


# Gemma 2's alternating window is megatron-core's local attention's from 0.15 (the job refuses it before)
FAMILIES += ("gemma2",) if _sliding_window_built() else ()


def save_random_hf(name: str, folder: str, seed: int = 0, **over):
    """A random-init HF model of family `name`, every parameter moved off its init (norm weights off 1, biases
    off 0) so that a dropped or misplaced tensor shows, saved with save_pretrained. Returns the model (eval)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config(name, **over)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(folder)
    return model


def tokens(batch: int = 2, seq: int = SEQ, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def hf_logits(folder: str, ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        return model(ids).logits


def _load_and_run(mg_dir: str, cfg: dict, ids: torch.Tensor, tp: int, pp: int, save_to: str | None = None,
                  ckpt_format: str = "torch_dist", full_vocab: bool = False):
    """On this rank: the converted model built as pretrain_gpt builds it, loaded with its load_checkpoint
    (`--ckpt-format ckpt_format`), run on `ids`; the last stage's TP rank 0 returns logits [b, s, V] (sliced to the
    true vocabulary; with full_vocab, Megatron's padded vocabulary). `save_to`: the model is then saved there by
    the job's save_checkpoint (iteration 1, no optimizer), at this layout."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_glue.capture import quiet_megatron
    from megatron_glue.training import checkpointing, gpt, training, versions
    from megatron_glue.convert.core import architecture
    from megatron_glue.convert.families import family_for

    args = architecture(family_for(None, cfg), cfg, tp, pp)
    args.load, args.finetune, args.ckpt_format = mg_dir, True, ckpt_format
    config = training.transformer_config(args, types.SimpleNamespace(device=torch.device("cpu")))
    pre, post = versions.pipeline_position(None)
    with quiet_megatron():
        model = gpt.model_provider(args, config, pre, post).eval()
    checkpointing.load_checkpoint(args, [model], None, None)
    if save_to is not None:
        args.save, args.no_save_optim, args.no_save_rng = save_to, True, True
        checkpointing.save_checkpoint(args, 1, [model], None, None, 0)
    b, s = ids.shape
    with torch.no_grad():
        if pre:
            out = model(ids, torch.arange(s).expand(b, s), None)
        else:
            hidden = torch.empty(s, b, args.hidden_size)
            dist.recv(hidden, src=ps.get_pipeline_model_parallel_prev_rank())
            model.set_input_tensor(hidden)
            out = model(None, None, None)
        if not post:
            dist.send(out.contiguous(), dst=ps.get_pipeline_model_parallel_next_rank())
            return None
    group = ps.get_tensor_model_parallel_group()
    shards = [torch.empty_like(out) for _ in range(tp)]
    dist.all_gather(shards, out.contiguous(), group=group)
    if ps.get_tensor_model_parallel_rank() != 0:
        return None
    logits = torch.cat(shards, dim=-1)
    return logits if full_vocab else logits[..., : cfg["vocab_size"]]


def _worker(runs, tp: int, pp: int, ckpt_format: str = "torch_dist", full_vocab: bool = False):
    from megatron_glue.capture.adaptations import groups_for
    from megatron_glue.capture.distributed import init_distributed

    # the job's adaptations (training=True: the tied output weight of the last stage, language_module.py)
    init_distributed(tp, pipeline_model_parallel_size=pp, groups=groups_for(training=True))
    return [_load_and_run(*run[:3], tp, pp, *run[3:], ckpt_format=ckpt_format, full_vocab=full_vocab)
            for run in runs]


def megatron_logits(runs: list[tuple], tp: int = 1, pp: int = 1, ckpt_format: str = "torch_dist",
                    full_vocab: bool = False) -> list[torch.Tensor]:
    """Logits of each (converted checkpoint, its HF config dict, token ids[, folder to save it to]) at TP x PP,
    loaded as `--ckpt-format ckpt_format`; TP=PP=1 in this process, otherwise over tp*pp gloo processes (one
    launch for all runs). full_vocab: the logits over Megatron's padded vocabulary, unsliced."""
    if tp * pp == 1:
        from megatron_glue.capture.models import init_single_process, teardown_single_process

        import megatron_glue

        moe = any(run[1].get("num_local_experts") or run[1].get("num_experts") for run in runs)
        # what the in-process tests' megatron_cpu fixture applies; an MoE model also the router's current-device
        # stand-in ("sp") and the "moe" group (docs/moe.md)
        megatron_glue.adapt(("cpu", "compile") + (("sp", "moe") if moe else ()))
        teardown_single_process()
        init_single_process()
        try:
            return [_load_and_run(*run[:3], 1, 1, *run[3:], ckpt_format=ckpt_format, full_vocab=full_vocab)
                    for run in runs]
        finally:
            teardown_single_process()
    from megatron_glue.capture.distributed import run_on_ranks

    results = run_on_ranks(_worker, runs, tp, pp, ckpt_format, full_vocab, world_size=tp * pp, timeout=600)
    return [next(r[i] for r in results if r[i] is not None) for i in range(len(runs))]


def read_config(folder: str) -> dict:
    import json

    with open(os.path.join(folder, "config.json")) as f:
        return json.load(f)


def _outcome_worker(runs, tp: int, pp: int, ckpt_format: str):
    from megatron_glue.capture.adaptations import groups_for
    from megatron_glue.training.checkpointing import CheckpointError
    from megatron_glue.capture.distributed import init_distributed

    init_distributed(tp, pipeline_model_parallel_size=pp, groups=groups_for(training=True))  # as _worker
    out = []
    for mg_dir, cfg, ids in runs:
        try:
            out.append(_load_and_run(mg_dir, cfg, ids, tp, pp, ckpt_format=ckpt_format))
        except CheckpointError as e:  # raised by every rank alike, before any exchange between them
            out.append(str(e))
    return out


def megatron_outcomes(runs: list[tuple[str, dict, torch.Tensor]], tp: int, pp: int,
                      ckpt_format: str = "torch_dist") -> list[torch.Tensor | str]:
    """As megatron_logits over tp*pp gloo processes, but a checkpoint the job's load_checkpoint refuses gives its
    CheckpointError message (a str) in place of logits, and the other runs go on."""
    from megatron_glue.capture.distributed import run_on_ranks

    results = run_on_ranks(_outcome_worker, runs, tp, pp, ckpt_format, world_size=tp * pp, timeout=600)
    return [next(r[i] for r in results if r[i] is not None) for i in range(len(runs))]


@contextlib.contextmanager
def process_state_kept():
    """Converting in this process and megatron_logits at TP=PP=1 apply adaptation groups and set up
    or tear down the gloo group and Megatron's parallel state: after the block, the adaptations it applied are
    taken off again and the group and parallel state are as before (for the tests that run after)."""
    import torch.distributed as dist

    from megatron_glue.capture.adaptations import registry
    from megatron_glue.capture.models import init_single_process, teardown_single_process

    before = set(registry.applied())
    was_initialized = dist.is_initialized()
    try:
        yield
    finally:
        teardown_single_process()
        registry.revert(*[n for n in registry.applied() if n not in before])
        from megatron_glue.capture import testing

        if was_initialized or testing.SESSION:  # (megatron_cpu may have been set up inside the block)
            init_single_process()


def _ep_worker(runs, ep: int, dispatcher: str):
    from megatron_glue.capture.adaptations import groups_for
    from megatron_glue.capture.distributed import init_distributed
    from megatron_glue.capture import quiet_megatron
    from megatron_glue.convert.core import architecture
    from megatron_glue.convert.families import family_for
    from megatron_glue.training import checkpointing, gpt, training

    init_distributed(1, expert_model_parallel_size=ep, groups=groups_for(training=True))
    out = []
    for mg_dir, cfg, ids, *save_to in runs:
        args = architecture(family_for(None, cfg), cfg)
        # the converted flags at EP=ep: every rank holds num_experts / ep experts (data parallel over the same ids)
        args.expert_model_parallel_size, args.moe_token_dispatcher_type = ep, dispatcher
        args.load, args.finetune = mg_dir, True
        config = training.transformer_config(args, types.SimpleNamespace(device=torch.device("cpu")))
        with quiet_megatron():
            model = gpt.model_provider(args, config).eval()
        checkpointing.load_checkpoint(args, [model], None, None)
        if save_to:  # saved again by the job at this layout (iteration 1, no optimizer)
            args.save, args.no_save_optim, args.no_save_rng = save_to[0], True, True
            checkpointing.save_checkpoint(args, 1, [model], None, None, 0)
        local = {k.split(".local_experts.")[1].split(".")[0] for k in model.state_dict() if ".local_experts." in k}
        b, s = ids.shape
        with torch.no_grad():
            logits = model(ids, torch.arange(s).expand(b, s), None)[..., : cfg["vocab_size"]]
        out.append((logits, len(local)))
    return out


def megatron_logits_ep(runs: list[tuple], ep: int = 2, dispatcher: str = "allgather") -> list[list]:
    """Each rank's (logits, local experts) of each (converted checkpoint, its HF config dict, token ids[, folder to
    save it to]) loaded by the job's load_checkpoint at expert-parallel size `ep` over `ep` gloo processes."""
    from megatron_glue.capture.distributed import run_on_ranks

    return run_on_ranks(_ep_worker, runs, ep, dispatcher, world_size=ep, timeout=600)
