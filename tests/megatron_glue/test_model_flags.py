"""MindSpeed-LLM's model flags as the job builds them: the model of `parse_args(flags)` against a reference
(transformers' own module of the family that has the feature, or the same model spelled without the flag),
compiled with backend="ascend" as the job compiles it against eager, logits and gradients."""

from __future__ import annotations

import contextlib
import math
import types

import pytest
import torch

from megatron_glue.capture.adaptations import ZeroCenteredRMSNorm, registry

VOCAB, SEQ = 128, 16
BASE = ("--num-layers 2 --hidden-size 64 --ffn-hidden-size 96 --num-attention-heads 4 --group-query-attention "
        "--num-query-groups 2 --seq-length 16 --max-position-embeddings 16 --micro-batch-size 2 --train-iters 1 "
        "--skip-train --tokenizer-type NullTokenizer --vocab-size 128 --make-vocab-size-divisible-by 128 "
        "--position-embedding-type rope --swiglu --disable-bias-linear --normalization RMSNorm --qk-layernorm "
        "--attention-dropout 0 --hidden-dropout 0").split()


@contextlib.contextmanager
def _sp_group():
    """The job's "sp" group (the norms) on for the block, taken off after (megatron_cpu applies cpu, compile)."""
    before = set(registry.applied())
    registry.apply_groups(("sp",))
    try:
        yield
    finally:
        registry.revert(*[n for n in registry.applied() if n not in before])


def _model(*flags, seed=0, base=BASE):
    from megatron_glue.training import gpt, training
    from megatron_glue.training.arguments import parse_args

    args = parse_args([*base, *flags], world_size=1)
    args.padded_vocab_size = VOCAB
    # the persistent cache off: with it, a layer compiled for one MLP activation is taken by another of the same
    # shapes in the same process (--openai-gelu then GeLU, --gelu-tanh then --swiglu: its stored Dynamo guards do
    # not tell the activation functions apart), which these tests, each comparing one model, are not about
    args.npu_compile_options = {"cache": False}
    config = training.transformer_config(args, types.SimpleNamespace(device=torch.device("cpu")))
    torch.manual_seed(seed)
    return gpt.model_provider(args, config), args


def _norms(model):
    return {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.RMSNorm)}


def _run(model, ids):
    out = model(ids, torch.arange(ids.shape[1]).expand_as(ids), None)
    out.float().pow(2).mean().backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

def _compiled_equals_eager(model, compiled, args, ids):
    """``compiled`` (``model``'s weights) compiled as the job compiles it: output and every gradient within 1e-5."""
    from megatron_glue.training import training

    training.compile_model(compiled, args)
    out, grads = _run(model, ids)
    got, got_grads = _run(compiled, ids)
    assert (got - out).abs().max().item() < 1e-5
    for name, g in grads.items():
        assert (got_grads[name] - g).abs().max().item() < 1e-5, name



def test_zero_centered_rms_norm_is_gemmas():
    """--add-rmsnorm-offset --rmsnorm-weight-in-fp32 in bf16 is transformers' GemmaRMSNorm (and Qwen3-Next's),
    bit for bit; without --rmsnorm-weight-in-fp32, 1 + w is formed in the weight's dtype."""
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm

    torch.manual_seed(0)
    x, w = torch.randn(4, 8, 64).bfloat16(), (torch.randn(64) * 0.1).bfloat16()
    gemma = GemmaRMSNorm(64, eps=1e-6).bfloat16()
    ours = torch.nn.RMSNorm(64, eps=1e-6).bfloat16()
    ours.__class__, ours.weight_in_fp32 = ZeroCenteredRMSNorm, True
    ours.reset_parameters()
    assert torch.equal(ours.weight, torch.zeros(64, dtype=torch.bfloat16))  # gamma 1 at init
    with torch.no_grad():
        gemma.weight.copy_(w), ours.weight.copy_(w)
    assert torch.equal(ours(x), gemma(x))
    ours.weight_in_fp32 = False
    assert torch.equal(ours(x), torch.nn.functional.rms_norm(x, (64,), 1 + w, 1e-6))
    assert not torch.equal(ours(x), gemma(x))  # bf16 1 + w rounds


@pytest.mark.parametrize("fp32_weight", [False, True])
def test_add_rmsnorm_offset_model_compiled_equals_eager_and_the_plain_model(megatron_cpu, fresh_dynamo, fp32_weight):
    """Every RMSNorm of the job's model (input, pre-MLP, q/k, final) stores gamma - 1; the model equals the one
    without the flag whose norm weights are 1 + w (fp32), and compiled as the job compiles it equals eager."""
    from megatron_glue.training import training

    flags = ["--add-rmsnorm-offset"] + (["--rmsnorm-weight-in-fp32"] if fp32_weight else [])
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    with _sp_group():
        model, args = _model(*flags)
        plain, _ = _model()
        compiled, _ = _model(*flags)
    norms = _norms(model)
    assert len(norms) == 2 * 4 + 1 and all(type(m) is ZeroCenteredRMSNorm for m in norms.values())
    assert all(not m.weight.any() for m in norms.values())
    assert not any(type(m) is ZeroCenteredRMSNorm for m in plain.modules())
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.rsplit(".", 1)[0] in norms:
                p.copy_(torch.randn_like(p) * 0.1)
        plain.load_state_dict({k: v + 1 if k.rsplit(".", 1)[0] in norms else v
                               for k, v in model.state_dict().items() if not k.endswith("_extra_state")},
                              strict=False)
        compiled.load_state_dict(model.state_dict())
    training.compile_model(compiled, args)
    out, grads = _run(model, ids)
    ref, ref_grads = _run(plain, ids)
    got, got_grads = _run(compiled, ids)
    assert (out - ref).abs().max().item() < 1e-5
    assert (got - out).abs().max().item() < 1e-5
    for name, g in grads.items():
        assert (ref_grads[name] - g).abs().max().item() < 1e-5, name
        assert (got_grads[name] - g).abs().max().item() < 1e-5, name


def test_add_rmsnorm_offset_needs_rmsnorm():
    from megatron_glue.training.arguments import ArgumentError, parse_args

    flags = [f for f in BASE if f not in ("RMSNorm", "--qk-layernorm")] + ["--add-rmsnorm-offset"]
    flags[flags.index("--normalization")] = "--normalization"
    flags.insert(flags.index("--normalization") + 1, "LayerNorm")
    with pytest.raises(ArgumentError) as info:
        parse_args(flags, world_size=1)
    assert info.value.message.endswith(
        "--add-rmsnorm-offset needs --normalization RMSNorm (got LayerNorm); a LayerNorm with a unit offset "
        "(Megatron-LM's --apply-layernorm-1p) is not implemented here")


def test_without_the_adaptation_megatron_refuses_the_offset(megatron_cpu):
    from megatron_glue.capture.testing import adaptations_reverted

    with _sp_group(), adaptations_reverted("zero_centered_rms_norm"), pytest.raises(AssertionError,
                                                                                     match="zero_centered_gamma"):
        _model("--add-rmsnorm-offset")


def test_a_checkpoint_of_the_other_norm_convention_is_refused():
    """Weights stored as gamma - 1 loaded as gamma (or the other way) would be off by one: the job refuses it, and
    so does mg -> hf (no family converted here stores gamma - 1)."""
    from megatron_glue.convert.core import ConvertError, _check_same_architecture
    from megatron_glue.training.arguments import parse_args
    from megatron_glue.training.checkpointing import CheckpointError, check_architecture

    plain = vars(parse_args(BASE, world_size=1))
    offset = parse_args([*BASE, "--add-rmsnorm-offset"], world_size=1)
    with pytest.raises(CheckpointError) as info:
        check_architecture(offset, plain, "ckpt")
    assert str(info.value) == ("the checkpoint at ckpt was saved with --add-rmsnorm-offset False, this job has True; "
                               "use the checkpoint's value")
    with pytest.raises(ConvertError, match="was saved with add_rmsnorm_offset True; the recorded config.json gives "
                                           "False: it describes another model"):
        _check_same_architecture(parse_args(BASE, world_size=1), vars(offset), "ckpt", None)


LONGROPE = ["--rope-scaling-type", "longrope", "--rope-scaling-original-max-position-embeddings", "8",
            "--long-factor", "1,2,3,4,5,6,7,8", "--short-factor", "1,1,1,1,2,2,2,2"]


def test_longrope_flags():
    """MindSpeed-LLM's phi35 script's LongRoPE flags: the factors chosen by --seq-length against the original
    context, one per rotary frequency; outer (transformers' Phi-3 formula) and mul (megatron-core's frequencies
    divided) agree to rounding; MindSpeed-LLM's mscale."""
    from megatron_glue.training.arguments import ArgumentError, parse_args
    from megatron_glue.training.gpt import longrope_inv_freq, longrope_mscale

    base = 1.0 / (10000 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16))  # megatron-core's, head 16
    args = parse_args([*BASE, *LONGROPE, "--longrope-freqs-type", "outer"], world_size=1)
    assert args.long_factor == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]
    outer = longrope_inv_freq(args, base)  # seq 16 > 8: the long factors
    assert torch.allclose(outer, base / torch.arange(1, 9), rtol=1e-6)
    args.longrope_freqs_type = "mul"
    assert torch.allclose(longrope_inv_freq(args, base), outer, rtol=1e-6)
    args.seq_length = 8
    assert torch.allclose(longrope_inv_freq(args, base), base / torch.tensor([1, 1, 1, 1, 2, 2, 2, 2.0]), rtol=1e-6)
    assert longrope_mscale(args) == pytest.approx((1 + math.log(2) / math.log(8)) ** 0.5)  # max 16 / original 8
    args.long_mscale, args.short_mscale = 1.5, 1.2
    assert longrope_mscale(args) == 1.2

    def error(*flags):
        with pytest.raises(ArgumentError) as info:
            parse_args([*BASE, *flags], world_size=1)
        return info.value.message.split("error: ", 1)[1]

    assert error("--rope-scaling-type", "longrope") == (
        "--rope-scaling-type longrope needs --rope-scaling-original-max-position-embeddings, --long-factor and "
        "--short-factor")
    assert error(*LONGROPE[:-1], "1,1") == (
        "--short-factor has 2 factors; LongRoPE needs one per rotary frequency: 8 (kv-channels 16 / 2)")
    assert error(*LONGROPE, "--long-mscale", "1.2") == (
        "--long-mscale and --short-mscale go together (LongRoPE's cos/sin scale for long and short sequences)")
    assert error(*LONGROPE, "--rotary-percent", "0.5") == (
        "--rope-scaling-type longrope with --rotary-percent 0.5 is not implemented here (LongRoPE's scale applies to "
        "the rotated channels only); use --rotary-percent 1")
    assert error(*LONGROPE[:5], "1,x", *LONGROPE[6:]) == "argument --long-factor: '1,x' is not comma-separated numbers"


def test_squared_relu_compiled_equals_eager_and_megatrons_own(megatron_cpu, fresh_dynamo):
    """--squared-relu: the MLP's relu(x)^2 (PLM's scripts); the job's model compiled as the job compiles it equals
    eager (logits and gradients), and eager equals megatron-core's own activations.squared_relu where it has one."""
    from megatron_glue.training import training
    from megatron_glue.training.arguments import ArgumentError, parse_args

    gelu = [f for f in BASE if f != "--swiglu"]
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(2))
    model, args = _model("--squared-relu", base=gelu)
    compiled, _ = _model("--squared-relu", base=gelu)
    x = torch.linspace(-2, 2, 9)
    assert torch.equal(model.decoder.layers[0].mlp.activation_func(x), torch.relu(x) ** 2)
    compiled.load_state_dict(model.state_dict())
    _compiled_equals_eager(model, compiled, args, ids)
    try:
        from megatron.core.activations import squared_relu
    except ImportError:  # megatron-core 0.12 has no activations module
        squared_relu = None
    if squared_relu is not None:
        assert torch.equal(model.decoder.layers[0].mlp.activation_func(x), squared_relu(x))
    with pytest.raises(ArgumentError, match="--squared-relu with --swiglu: choose one MLP activation"):
        parse_args([*BASE, "--squared-relu"], world_size=1)


def _gelu_tanh_mindspeed(x):
    """MindSpeed-LLM's gelu_tanh_approximation (mindspeed_llm/core/transformer/mlp.py), spelled out."""
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * torch.pow(x, 3))))


def test_gelu_tanh_is_a_gated_tanh_gelu_and_compiles(megatron_cpu, fresh_dynamo):
    """--gelu-tanh (Gemma 2's scripts): fc1 is [gate; up] (2 x ffn rows), the output gelu_tanh(gate) * up with
    MindSpeed-LLM's tanh GeLU; compiled as the job compiles it equals eager, logits and gradients."""
    from megatron_glue.training import training
    from megatron_glue.training.arguments import ArgumentError, parse_args

    gelu = [f for f in BASE if f != "--swiglu"]
    model, args = _model("--gelu-tanh", base=gelu)
    compiled, _ = _model("--gelu-tanh", base=gelu)
    mlp = model.decoder.layers[0].mlp
    assert mlp.linear_fc1.weight.shape == (2 * 96, 64)
    h = torch.randn(SEQ, 2, 64)
    with torch.no_grad():
        gate, up = torch.nn.functional.linear(h, mlp.linear_fc1.weight).chunk(2, dim=-1)
        ref = torch.nn.functional.linear(_gelu_tanh_mindspeed(gate) * up, mlp.linear_fc2.weight)
        assert (mlp(h)[0] - ref).abs().max().item() < 1e-5
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))
    compiled.load_state_dict(model.state_dict())
    _compiled_equals_eager(model, compiled, args, ids)
    with pytest.raises(ArgumentError, match="--gelu-tanh with --swiglu: choose one MLP activation"):
        parse_args([*BASE, "--gelu-tanh"], world_size=1)


def test_query_pre_attn_scalar_scales_the_scores(megatron_cpu):
    """--query-pre-attn-scalar N: scores x 1 / sqrt(N), i.e. the model without it whose query rows of linear_qkv
    are scaled by sqrt(kv-channels / N) (RoPE is linear in q; no q norm here)."""
    plain_base = [f for f in BASE if f != "--qk-layernorm"]
    model, args = _model("--query-pre-attn-scalar", "64", base=plain_base)
    plain, _ = _model(base=plain_base)
    assert model.decoder.layers[0].self_attention.core_attention.softmax_scale == 64 ** -0.5
    ng, d, per_group = args.num_query_groups, args.kv_channels, args.num_attention_heads // args.num_query_groups
    state = model.state_dict()
    with torch.no_grad():
        for key, value in list(state.items()):
            if key.endswith("self_attention.linear_qkv.weight"):
                grouped = value.clone().view(ng, (per_group + 2) * d, -1)
                grouped[:, : per_group * d] *= math.sqrt(d / 64)
                state[key] = grouped.view_as(value)
    plain.load_state_dict(state)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        a = model(ids, torch.arange(SEQ).expand_as(ids), None)
        b = plain(ids, torch.arange(SEQ).expand_as(ids), None)
    assert (a - b).abs().max().item() < 1e-5 and d != 64


def test_input_embeds_norm_and_output_logit_softcapping(megatron_cpu, fresh_dynamo):
    """--input-embeds-norm: the model equals the one without it whose (untied) embedding is x sqrt(hidden);
    --output-logit-softcapping c: logits c x tanh(plain / c); compiled as the job compiles it (the output layer
    with the loss) equals eager, losses and gradients."""
    from megatron_glue.training import training

    untied = [*BASE, "--untie-embeddings-and-output-weights"]
    model, args = _model("--input-embeds-norm", "--output-logit-softcapping", "0.2", base=untied)
    plain, _ = _model(base=untied)
    compiled, _ = _model("--input-embeds-norm", "--output-logit-softcapping", "0.2", base=untied)
    state = model.state_dict()
    plain.load_state_dict({k: v * 64 ** 0.5 if k == "embedding.word_embeddings.weight" else v
                           for k, v in state.items()})
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(5))
    positions = torch.arange(SEQ).expand_as(ids)
    with torch.no_grad():
        logits, ref = model(ids, positions, None), plain(ids, positions, None)
    assert ref.abs().max().item() > 0.4  # the cap bites
    assert (logits - torch.tanh(ref / 0.2) * 0.2).abs().max().item() < 1e-5
    compiled.load_state_dict(state)
    training.compile_model(compiled, args)

    def step(m):
        loss = m(ids, positions, None, labels=ids.roll(-1, 1))
        loss.sum().backward()
        return loss.detach(), {n: p.grad.clone() for n, p in m.named_parameters()}

    loss, grads = step(model)
    got, got_grads = step(compiled)
    assert (got - loss).abs().max().item() < 1e-5
    for name, g in grads.items():
        assert (got_grads[name] - g).abs().max().item() < 1e-5, name
