"""`--model-type-hf qwen3-next`: transformers' dense Qwen3-Next (Gated DeltaNet layers with a full-attention layer
every full_attention_interval) <-> megatron-core 0.16's own hybrid model (GatedDeltaNet, attention with
attention_output_gate), the family table `families.QWEN3_NEXT`.

The Megatron template is megatron-core's model built here from its own specs as the job builds it (local layers;
the Gated DeltaNet layer's input norm saved under Transformer Engine's fused name), on the meta device: its
sharded_state_dict gives the checkpoint's keys, including the six keys in_proj is saved as and the three of
conv1d. GatedDeltaNet refuses to be built without the `fla` package (ssm/gated_delta_net.py:103-106); building
it needs no kernel, so the fixture sets its HAVE_FLA gate for the build only. While the job's parser refuses the
linear-attention flags (they land with the Gated DeltaNet model in the job), the fixture parses the architecture
without them and sets them on the args.

Checked: every HF tensor converts to a megatron-core key of the model's shape and back, bitwise; the projections
that change layout (in_proj from in_proj_qkvz + in_proj_ba, the gated linear_qkv from q_proj, k_proj, v_proj)
give on an input the same query, key, value, gate, beta and alpha as transformers' own code; out_norm's weight
is stored for megatron-core's 1 + w norm.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import types

import pytest
import torch
from safetensors.torch import load_file

from megatron_glue.capture.adaptations import megatron_core_in
from megatron_glue.convert import core, families, torch_dist, transforms


# Gated DeltaNet layers are megatron-core 0.16's (megatron.core.ssm.gated_delta_net): the job refuses them before
pytestmark = [pytest.mark.usefixtures("process_state_kept"),
              pytest.mark.skipif(not megatron_core_in(">=0.16"), reason="Gated DeltaNet layers need megatron-core "
                                 "0.16 or later (the job refuses --full-attention-interval before)")]

LINEAR_FLAGS = ("--full-attention-interval", "--linear-key-head-dim", "--linear-value-head-dim",
                "--linear-num-key-heads", "--linear-num-value-heads", "--mamba-d-conv", "--partial-rotary-factor")


def hf_config():
    import transformers as tf

    # 4 layers, a full-attention layer every 2nd (layer_types linear, full, linear, full); 2 key heads serving 2
    # value heads each; head sizes that differ (query/key 16, value 8, attention 16: not hidden / heads)
    return tf.Qwen3NextConfig(vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_key_head_dim=16,
                              linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
                              linear_conv_kernel_dim=4, full_attention_interval=2, partial_rotary_factor=0.25,
                              num_experts=0, rms_norm_eps=1e-6, tie_word_embeddings=False,
                              max_position_embeddings=64)


def _weights(folder) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(glob.glob(os.path.join(folder, "*.safetensors"))):
        out.update(load_file(f))
    return out


def _job_takes_linear_attention() -> bool:
    from megatron_glue.training.arguments import REFUSED

    return "--full-attention-interval" not in REFUSED


def _model(args, dtype, pre_process=True, post_process=True):
    """megatron-core 0.16's hybrid GPT model of `args` on the meta device, local layers (as the job builds it)."""
    import megatron.core.ssm.gated_delta_net as gdn_module
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
        get_gated_delta_net_module_spec, get_linear_attention_pattern)
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    from megatron_glue.capture import quiet_megatron
    from megatron_glue.training import training

    one = types.SimpleNamespace(**vars(args))
    one.tensor_model_parallel_size = one.pipeline_model_parallel_size = 1
    one.virtual_pipeline_model_parallel_size, one.sequence_parallel = None, False
    config = training.transformer_config(one, types.SimpleNamespace(device=torch.device("cpu")))
    config.perform_initialization = False
    config.params_dtype = dtype
    for field, value in (("experimental_attention_variant", "gated_delta_net"),
                         ("linear_attention_freq", args.full_attention_interval),
                         ("linear_conv_kernel_dim", args.mamba_d_conv),
                         ("linear_key_head_dim", args.linear_key_head_dim),
                         ("linear_value_head_dim", args.linear_value_head_dim),
                         ("linear_num_key_heads", args.linear_num_key_heads),
                         ("linear_num_value_heads", args.linear_num_value_heads),
                         ("attention_output_gate", True)):
        setattr(config, field, value)
    local = LocalSpecProvider()
    full = get_gpt_layer_local_spec(normalization=config.normalization, qk_layernorm=True)
    gdn = get_gated_delta_net_module_spec(config, backend=local)
    gdn.submodules.in_proj = local.column_parallel_linear()
    keys = {**full.submodules.sharded_state_dict_keys_map, "input_layernorm.": "self_attention.in_proj.layer_norm_"}
    linear = ModuleSpec(module=full.module, submodules=dataclasses.replace(
        full.submodules, self_attention=gdn, sharded_state_dict_keys_map=keys))
    block = TransformerBlockSubmodules(
        layer_specs=[linear if is_linear else full for is_linear in get_linear_attention_pattern(config)],
        layer_norm=full.submodules.input_layernorm)
    have_fla, current_device = gdn_module.HAVE_FLA, torch.cuda.current_device
    # construction only, on the meta device: no FLA kernel runs, and GatedDeltaNet's parameters, which it places on
    # torch.cuda.current_device() (gated_delta_net.py:172,187,196), go to the meta device too
    gdn_module.HAVE_FLA, torch.cuda.current_device = True, lambda: torch.device("meta")
    try:
        with torch.device("meta"), quiet_megatron():
            model = GPTModel(config=config, transformer_layer_spec=block, vocab_size=args.padded_vocab_size,
                             max_sequence_length=args.max_position_embeddings, pre_process=pre_process,
                             post_process=post_process, share_embeddings_and_output_weights=False,
                             position_embedding_type="rope", rotary_percent=args.partial_rotary_factor,
                             rotary_base=args.rotary_base)
    finally:
        gdn_module.HAVE_FLA, torch.cuda.current_device = have_fla, current_device
    return model.to(dtype)


@pytest.fixture
def hybrid(monkeypatch):
    """core's architecture and meta model for qwen3_next where the job does not build it yet; where it does, the
    converter's own (the job's parser and model provider) are used as they are."""
    if _job_takes_linear_attention():
        return
    real = core.architecture

    def architecture(family, cfg, tp=1, pp=1, divisible_by=128, dtype=torch.float32):
        if family is not families.QWEN3_NEXT:
            return real(family, cfg, tp, pp, divisible_by, dtype)
        flags = core.architecture_flags(family, cfg)
        linear = {f: flags[flags.index(f) + 1] for f in LINEAR_FLAGS if f in flags}
        base = dataclasses.replace(family, config=tuple(r for r in family.config if r[0] not in LINEAR_FLAGS))
        args = real(base, cfg, tp, pp, divisible_by, dtype)
        for flag, value in linear.items():
            setattr(args, flag[2:].replace("-", "_"), float(value) if "factor" in flag else int(value))
        args.flags = flags
        return args

    monkeypatch.setattr(core, "architecture", architecture)
    monkeypatch.setattr(core, "meta_model", _model)


@pytest.fixture
def hf(tmp_path):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf_config()).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(tmp_path / "hf")
    return model, tmp_path / "hf"


def test_the_flags_of_the_family():
    cfg = hf_config().to_dict()
    flags = core.architecture_flags(families.family_for("qwen3-next", cfg), cfg)
    text = " ".join(flags)
    for expected in ("--full-attention-interval 2", "--linear-key-head-dim 16", "--linear-value-head-dim 8",
                     "--linear-num-key-heads 2", "--linear-num-value-heads 4", "--mamba-d-conv 4",
                     "--partial-rotary-factor 0.25", "--num-query-groups 2", "--kv-channels 16", "--qk-layernorm",
                     "--add-rmsnorm-offset", "--swiglu", "--untie-embeddings-and-output-weights"):
        assert expected in text, (expected, text)


@pytest.mark.parametrize("change, why", [
    (dict(num_experts=4), "num_experts: Qwen3-Next's mixture-of-experts layers are not converted here (the dense "
                          "model, num_experts 0, is)"),
    (dict(layer_types=["linear_attention", "full_attention", "full_attention", "linear_attention"]), "layer_types other than a full-attention layer every "
                                               "full_attention_interval (megatron-core's linear_attention_freq "
                                               "pattern)"),
])
def test_what_the_family_refuses(change, why):
    cfg = {**hf_config().to_dict(), **change}
    with pytest.raises(families.ConfigError) as e:
        core.architecture_flags(families.QWEN3_NEXT, cfg)
    assert str(e.value) == f"qwen3_next: config.json is not convertible: {why}"


def test_every_tensor_maps_to_the_megatron_model_and_back_bitwise(hybrid, hf, tmp_path):
    """hf -> mg (torch_dist, the template megatron-core's own sharded_state_dict: the save asks for every key of
    the model, and the converter refuses one the table does not produce, or an HF tensor no row reads) -> hf: the
    same tensors, bitwise; in_proj is saved as six keys and conv1d as three, at the model's shapes."""
    _, folder = hf
    core.hf_to_mg(str(folder), str(tmp_path / "mg"), "qwen3-next")
    meta = torch_dist.tensor_metadata(str(tmp_path / "mg" / "release"))
    # layers of two kinds: megatron-core saves each layer under its number (transformer_block.py,
    # non_homogeneous_layers), no layer axis; layers 0 and 2 Gated DeltaNet, 1 and 3 full attention
    linear, full = torch_dist.LAYERS + "0.", torch_dist.LAYERS + "1."
    for part in ("query", "key", "value", "z", "beta", "alpha"):
        assert f"{linear}self_attention.in_proj.weight.{part}" in meta
    for part in ("query", "key", "value"):
        assert f"{linear}self_attention.conv1d.weight.{part}" in meta
    assert meta[f"{linear}self_attention.in_proj.weight.z"][0] == (32, 64)       # 4 value heads x 8
    assert meta[f"{linear}self_attention.in_proj.weight.beta"][0] == (4, 64)
    assert meta[f"{linear}self_attention.conv1d.weight.key"][0] == (32, 1, 4)
    assert meta[f"{linear}self_attention.out_norm.weight"][0] == (8,)
    assert meta[f"{linear}self_attention.in_proj.layer_norm_weight"][0] == (64,)
    assert meta[f"{full}self_attention.linear_qkv.weight"][0] == (2 * 64 + 2 * 32, 64)  # q, gate, k, v
    assert meta[f"{full}self_attention.linear_qkv.layer_norm_weight"][0] == (64,)
    assert not any(k.startswith(f"{full}self_attention.in_proj") for k in meta)
    assert not any(k.startswith(f"{linear}self_attention.linear_qkv.weight") for k in meta)
    core.mg_to_hf(str(tmp_path / "mg"), str(tmp_path / "back"))
    a, b = _weights(folder), _weights(tmp_path / "back")
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name


def _args():
    return types.SimpleNamespace(num_attention_heads=4, num_query_groups=2, kv_channels=16, hidden_size=64,
                                 linear_key_head_dim=16, linear_value_head_dim=8, linear_num_key_heads=2,
                                 linear_num_value_heads=4)


def test_in_proj_gives_transformers_query_key_value_gate_beta_alpha():
    """x through megatron's in_proj, split as GatedDeltaNet.forward splits it (gated_delta_net.py:309-345), equals
    transformers' `fix_query_key_value_ordering` of x through in_proj_qkvz and in_proj_ba."""
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

    torch.manual_seed(1)
    hf_layer = Qwen3NextGatedDeltaNet(hf_config(), layer_idx=0)
    a = _args()
    w = transforms.TRANSFORMS["gdn_in_proj"].to_mcore(
        [hf_layer.in_proj_qkvz.weight.data, hf_layer.in_proj_ba.weight.data], a)
    x = torch.randn(2, 5, 64)  # b, s, h
    want = hf_layer.fix_query_key_value_ordering(hf_layer.in_proj_qkvz(x), hf_layer.in_proj_ba(x))
    qk, v, nv = 32, 32, 4
    qkv, gate, beta, alpha = torch.split(x @ w.t(), [qk * 2 + v, v, nv, nv], dim=-1)
    query, key, value = torch.split(qkv, [qk, qk, v], dim=-1)
    got = (query.reshape(2, 5, -1, 16), key.reshape(2, 5, -1, 16), value.reshape(2, 5, -1, 8),
           gate.reshape(2, 5, -1, 8), beta, alpha)
    for name, g, h in zip(("query", "key", "value", "z", "b", "a"), got, want):
        torch.testing.assert_close(g, h.reshape(g.shape), rtol=1e-6, atol=1e-6, msg=name)  # matmuls of other shapes
    back = transforms.TRANSFORMS["gdn_in_proj"].to_hf(w, a)
    assert torch.equal(back[0], hf_layer.in_proj_qkvz.weight) and torch.equal(back[1], hf_layer.in_proj_ba.weight)


def test_the_conv_channels_are_transformers_order():
    """transformers convolves cat(query, key, value) flattened in head order (modeling_qwen3_next.py, forward:
    `mixed_qkv = torch.cat((query, key, value), dim=-1)`), megatron-core the in_proj's first qk + qk + v channels in
    the same order (gated_delta_net.py:309-325): conv1d.weight is copied."""
    row = next(r for r in families.QWEN3_NEXT.tensors if r.mcore == "self_attention.conv1d.weight")
    assert row.transform == "copy"


def test_gated_qkv_gives_transformers_query_gate_key_value():
    """x through megatron's linear_qkv, split as attention.py:1414-1432 splits it with attention_output_gate, equals
    transformers' Qwen3NextAttention: each head's q_proj rows chunked into query and gate (:270-273), k_proj, v_proj."""
    torch.manual_seed(2)
    q_proj, k_proj, v_proj = torch.randn(128, 64), torch.randn(32, 64), torch.randn(32, 64)
    a = _args()
    w = transforms.TRANSFORMS["gated_qkv"].to_mcore([q_proj, k_proj, v_proj], a)
    x = torch.randn(5, 2, 64)  # s, b, h
    mixed = (x @ w.t()).view(5, 2, 2, (2 * 2 + 2) * 16)  # ng groups of (2 np/ng + 2) heads
    query, gate, key, value = torch.split(mixed, [32, 32, 16, 16], dim=3)
    hf_query, hf_gate = torch.chunk((x @ q_proj.t()).view(5, 2, -1, 32), 2, dim=-1)
    close = dict(rtol=1e-5, atol=1e-5)  # matmuls of other shapes: |x @ w| ~ 10
    torch.testing.assert_close(query.reshape(5, 2, 4, 16), hf_query, **close)
    torch.testing.assert_close(gate.reshape(5, 2, 4 * 16), hf_gate.reshape(5, 2, -1), **close)
    torch.testing.assert_close(key.reshape(5, 2, 2, 16), (x @ k_proj.t()).view(5, 2, 2, 16), **close)
    torch.testing.assert_close(value.reshape(5, 2, 2, 16), (x @ v_proj.t()).view(5, 2, 2, 16), **close)
    assert all(torch.equal(p, q) for p, q in zip(transforms.TRANSFORMS["gated_qkv"].to_hf(w, a),
                                                  (q_proj, k_proj, v_proj)))


def test_out_norm_is_stored_for_the_unit_offset_norm():
    """transformers' Qwen3NextRMSNormGated applies w; megatron-core's out_norm, built with the layer's config,
    applies 1 + w under --add-rmsnorm-offset (the family's): the converted weight is w - 1, and 1 + (w - 1) is w
    exactly for 0.5 <= w <= 2."""
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNormGated

    norm = Qwen3NextRMSNormGated(8, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * torch.randn(8).clamp(-1, 1))
    stored = transforms.TRANSFORMS["unit_offset"].to_mcore([norm.weight.data], None)
    x, gate = torch.randn(3, 8), torch.randn(3, 8)
    normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    megatron = (normed * (1 + stored)) * torch.nn.functional.silu(gate)  # gated_delta_net.py:412-421
    torch.testing.assert_close(megatron, norm(x, gate), rtol=1e-6, atol=1e-6)
    assert torch.equal(transforms.TRANSFORMS["unit_offset"].to_hf(stored, None)[0], norm.weight.data)


def test_the_legacy_format_is_refused(hybrid, hf, tmp_path):
    _, folder = hf
    with pytest.raises(core.ConvertError, match=r"--ckpt-format torch: the legacy format of a hybrid model "
                                                r"\(qwen3_next: layers of two kinds\) is not written here"):
        core.hf_to_mg(str(folder), str(tmp_path / "mg"), "qwen3-next", ckpt_format="torch")


@pytest.mark.training
def test_the_converted_model_gives_transformers_logits(hf, tmp_path):
    """The converted checkpoint loaded by the job's own load into the job's Gated DeltaNet model (at PP=2 over two
    gloo processes: Gated DeltaNet takes no TP here) gives transformers' logits (fp32, |logits| ~ 1)."""
    if not _job_takes_linear_attention():
        pytest.skip("needs the job's Gated DeltaNet model (the linear-attention block of megatron_glue.training.gpt "
                    "and the stand-ins for the fla kernels), which lands on its own branch")
    import hf_models

    model, folder = hf
    core.hf_to_mg(str(folder), str(tmp_path / "mg"), "qwen3-next")
    ids = hf_models.tokens()
    with torch.no_grad():
        want = model(ids).logits
    got = hf_models.megatron_logits([(str(tmp_path / "mg"), hf_models.read_config(str(folder)), ids)], pp=2)[0]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
