"""Gemma 2's layer as the job builds it from MindSpeed-LLM's flags (--post-norm, --interleave-sliding-window with
--gelu-tanh, --query-pre-attn-scalar, --input-embeds-norm, --output-logit-softcapping, --add-rmsnorm-offset):
the whole model against transformers' Gemma2Model with the same weights, and compiled as the job compiles it
against eager, logits and every gradient."""

from __future__ import annotations

import pytest
import torch

from megatron_glue.capture.adaptations import megatron_core_in

from tests.megatron_glue.test_model_flags import BASE, SEQ, VOCAB, _model, _run, _sp_group

WINDOW = 4
GEMMA2 = [f for f in BASE if f not in ("--swiglu", "--qk-layernorm")] + [
    "--gelu-tanh", "--post-norm", "--query-pre-attn-scalar", "24", "--input-embeds-norm",
    "--output-logit-softcapping", "0.5", "--add-rmsnorm-offset", "--norm-epsilon", "1e-6"]

needs_window = pytest.mark.skipif(not megatron_core_in(">=0.15"),
                                  reason="megatron-core's local attention has a window from 0.15")


def _randomize_norms(model):
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.randn_like(p) * 0.2)


def _hf_from(model, args, window):
    """transformers' Gemma2ForCausalLM of the job's model's shape, its weights copied (megatron-core's grouped
    [q; k; v] rows and [gate; up] fc1 split; norm weights w, which Gemma2RMSNorm applies as 1 + w as the job's
    --add-rmsnorm-offset norms do)."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    heads, groups, d = args.num_attention_heads, args.num_query_groups, args.kv_channels
    config = Gemma2Config(vocab_size=VOCAB, hidden_size=args.hidden_size, intermediate_size=args.ffn_hidden_size,
                          num_hidden_layers=args.num_layers, num_attention_heads=heads, num_key_value_heads=groups,
                          head_dim=d, max_position_embeddings=SEQ, rms_norm_eps=1e-6, rope_theta=10000.0,
                          query_pre_attn_scalar=args.query_pre_attn_scalar, sliding_window=window,
                          final_logit_softcapping=args.output_logit_softcapping, attn_logit_softcapping=None,
                          hidden_activation="gelu_pytorch_tanh", attention_dropout=0.0, tie_word_embeddings=True,
                          attn_implementation="eager")
    hf = Gemma2ForCausalLM(config).float().eval()
    ours = model.state_dict()
    with torch.no_grad():
        hf.model.embed_tokens.weight.copy_(ours["embedding.word_embeddings.weight"])
        hf.model.norm.weight.copy_(ours["decoder.final_layernorm.weight"])
        for i, layer in enumerate(hf.model.layers):
            p = f"decoder.layers.{i}."
            qkv = ours[p + "self_attention.linear_qkv.weight"].view(groups, (heads // groups + 2) * d, -1)
            q, k, v = qkv.split([heads // groups * d, d, d], dim=1)
            a = layer.self_attn
            a.q_proj.weight.copy_(q.reshape(heads * d, -1)), a.k_proj.weight.copy_(k.reshape(groups * d, -1))
            a.v_proj.weight.copy_(v.reshape(groups * d, -1))
            a.o_proj.weight.copy_(ours[p + "self_attention.linear_proj.weight"])
            gate, up = ours[p + "mlp.linear_fc1.weight"].chunk(2)
            layer.mlp.gate_proj.weight.copy_(gate), layer.mlp.up_proj.weight.copy_(up)
            layer.mlp.down_proj.weight.copy_(ours[p + "mlp.linear_fc2.weight"])
            layer.input_layernorm.weight.copy_(ours[p + "input_layernorm.weight"])
            layer.post_attention_layernorm.weight.copy_(ours[p + "post_attn_norm.weight"])
            layer.pre_feedforward_layernorm.weight.copy_(ours[p + "pre_mlp_layernorm.weight"])
            layer.post_feedforward_layernorm.weight.copy_(ours[p + "post_mlp_layernorm.weight"])
    return hf


@needs_window
def test_gemma2_model_is_transformers_gemma2(megatron_cpu):
    """The job's model with Gemma 2's flags equals transformers' Gemma2ForCausalLM (its sliding layers 0, 2, ...
    of window 4 < sequence 16); without --interleave-sliding-window it does not (the window bites), and without
    --post-norm it has no post norms."""
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(7))
    positions = torch.arange(SEQ).expand_as(ids)
    with _sp_group():
        model, args = _model("--interleave-sliding-window", str(WINDOW), base=GEMMA2)
        full, _ = _model(base=GEMMA2)
        plain, _ = _model(base=[f for f in GEMMA2 if f != "--post-norm"])
    assert not any("post_" in n for n, _ in plain.named_parameters())
    assert sum("post_attn_norm" in n or "post_mlp_layernorm" in n for n, _ in model.named_parameters()) == 4
    _randomize_norms(model)
    full.load_state_dict(model.state_dict())
    hf = _hf_from(model, args, WINDOW)
    with torch.no_grad():
        ref = hf(ids).logits
        out = model(ids, positions, None)
        no_window = full(ids, positions, None)
    assert out.shape == ref.shape
    assert (out - ref).abs().max().item() < 1e-5
    assert (no_window - ref).abs().max().item() > 1e-3


@needs_window
def test_gemma2_compiled_equals_eager_and_two_windows_do_not_share_a_graph(megatron_cpu, fresh_dynamo):
    """Compiled as the job compiles it (the persistent cache on, as in the job) equals eager, logits and every
    gradient; then a model of the same shapes with another window, in the same process, runs its own window."""
    from megatron_glue.training import training

    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(8))
    for window in (WINDOW, 6):
        with _sp_group():
            model, args = _model("--interleave-sliding-window", str(window), base=GEMMA2)
            compiled, _ = _model("--interleave-sliding-window", str(window), base=GEMMA2)
        _randomize_norms(model)
        compiled.load_state_dict(model.state_dict())
        args.npu_compile_options = {}
        training.compile_model(compiled, args)
        out, grads = _run(model, ids)
        got, got_grads = _run(compiled, ids)
        assert (got - out).abs().max().item() < 1e-5, window
        for name, g in grads.items():
            assert (got_grads[name] - g).abs().max().item() < 1e-5, (window, name)


def test_gemma2_flags_refused_where_they_cannot_hold():
    from megatron_glue.training.arguments import ArgumentError, parse_args

    def error(*flags):
        with pytest.raises(ArgumentError) as info:
            parse_args([*GEMMA2, *flags], world_size=1)
        return info.value.message.split("error: ", 1)[1]

    assert error("--interleave-sliding-window", "0") == "--interleave-sliding-window 0 must be >= 1"
    assert error("--attn-logit-softcapping", "50") == (
        "--attn-logit-softcapping: attention logit soft-capping (Gemma 2's attn_logit_softcapping) is not "
        "implemented here; MindSpeed-LLM's gemma2 scripts train without it: drop it")
    if megatron_core_in(">=0.15"):
        assert error("--interleave-sliding-window", "4", "--reset-attention-mask") == (
            "--interleave-sliding-window with --reset-attention-mask is not implemented here (megatron-core's local "
            "attention builds the window's mask in place of the documents' one); drop one of them")
    else:
        assert error("--interleave-sliding-window", "4").startswith(
            "--interleave-sliding-window needs megatron-core 0.15 or later (its local attention's window_size)")


def test_gemma2_spec_builds_the_local_layer():
    from megatron_glue.training.arguments import parse_args

    args = parse_args([*GEMMA2, "--spec", "mindspeed_llm.tasks.models.spec.gemma2_spec", "layer_spec"],
                      world_size=1)
    assert args.post_norm


@needs_window
def test_the_window_mask_adaptation_is_needed(megatron_cpu):
    """megatron-core builds the window's mask on "cuda": without the "cpu" group's sliding_window_mask_on_default_device
    a CPU forward fails so; with it, the mask is megatron-core's, on the default device."""
    from megatron.core.transformer import utils

    from megatron_glue.capture.adaptations import registry
    from megatron_glue.capture.testing import adaptations_reverted

    assert "sliding_window_mask_on_default_device" in registry.applied()
    for sq, skv, window in ((6, 6, (2, 0)), (3, 7, (4, 1))):
        keep = ~utils.get_sliding_window_causal_mask(sq, skv, window)
        i, j = torch.arange(sq)[:, None] + skv - sq, torch.arange(skv)[None, :]
        assert torch.equal(keep, (j >= i - window[0]) & (j <= i + window[1]))
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(9))
    with _sp_group():
        model, _ = _model("--interleave-sliding-window", str(WINDOW), base=GEMMA2)
    with adaptations_reverted("sliding_window_mask_on_default_device"), torch.no_grad(), \
            pytest.raises(Exception, match="Torch not compiled with CUDA"):
        model(ids, torch.arange(SEQ).expand_as(ids), None)
