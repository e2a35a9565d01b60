"""HuggingFace model families as tables: the architecture flags of `megatron_glue.pretrain_gpt` read from a
`config.json`, and the tensors, each megatron-core name with its HF names, its transform and its
tensor-parallel split.

Adding a family is adding a `Family` row to FAMILIES; the converter has no code path per family. Names are
megatron-core's local layer spec (`get_gpt_layer_local_spec`, the spec `pretrain_gpt` builds), per layer
relative to `decoder.layers.<i>.`; HF names carry `{i}` for the layer index.

Sources of the mappings: transformers' modeling files (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM,
Qwen3ForCausalLM, SeedOssForCausalLM, GPT2LMHeadModel: names, Conv1D's [in, out] storage, rotate-half RoPE;
Qwen3's q_norm / k_norm, an RMSNorm over each head's head_dim before RoPE) and megatron-core's layers
(`SelfAttention` reads linear_qkv per query group: [q heads of the group; k; v], attention.py
`get_query_key_value_tensors`; the GLU fc1 is [gate; up], transformer/mlp.py; `ColumnParallelLinear` splits
dim 0, `RowParallelLinear` dim 1).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable


class ConfigError(ValueError):
    """An HF config this converter cannot represent faithfully; the message names the field and why."""


@dataclass(frozen=True)
class Tensor:
    """One megatron-core tensor and where it comes from.

    transform: a key of `transforms.TRANSFORMS` (hf tensors -> megatron tensor, and back).
    tp_dim: Megatron's tensor-parallel split: 0 (ColumnParallel, embeddings), 1 (RowParallel), "glu" (fc1 of a
    gated MLP: rank r holds [gate_r; up_r]) or None (replicated).
    when: the architecture flag (an attribute of the job's args) that must be true for the tensor to exist.
    expert: one tensor per routed expert of an MoE layer: mcore and hf names carry `{e}` for the expert index.
    """

    mcore: str
    hf: tuple[str, ...]
    transform: str = "copy"
    tp_dim: int | str | None = None
    layer: bool = True
    when: str | None = None
    expert: bool = False
    layers: str | None = None  # a key of LAYER_KINDS: only the layers of that kind have the tensor (else every one)


# A config.json field -> flag value: a field name, or a function of the whole config.
ConfigSource = str | Callable[[dict], Any]


@dataclass(frozen=True)
class Family:
    name: str
    hf_model_types: tuple[str, ...]      # config.json "model_type" values it takes
    hf_architecture: str                 # config.json "architectures" written on the way back
    config: tuple[tuple[str, ConfigSource], ...]   # pretrain_gpt flag -> its value in config.json
    flags: tuple[str, ...]               # flags every model of the family has
    tensors: tuple[Tensor, ...]
    # (predicate on config.json, why it is refused): what the Megatron model would compute differently
    refuse: tuple[tuple[Callable[[dict], bool], str], ...] = ()
    ignored_hf: tuple[str, ...] = ()     # HF tensors that are not weights (buffers some checkpoints carry)
    notes: tuple[tuple[Callable[[dict], bool], str], ...] = field(default=())  # warned, converted anyway
    # megatron-core tensors its sharded_state_dict saves as several keys, split along dim 0: (module tensor name,
    # the key suffixes in order, their sizes as a function of the architecture)
    split: tuple[tuple[str, tuple[str, ...], Callable[[Any], list[int]]], ...] = ()


# -- config readers --------------------------------------------------------------------------------------------

def rope_parameters(cfg: dict) -> dict:
    """transformers 5 writes `rope_parameters` {rope_type, rope_theta, ...}; 4.x `rope_theta` + `rope_scaling`."""
    params = dict(cfg.get("rope_scaling") or {})
    params.update(cfg.get("rope_parameters") or {})
    if "rope_theta" not in params:
        params["rope_theta"] = cfg.get("rope_theta", 10000.0)
    params.setdefault("rope_type", params.get("type", "default"))
    return params


def rope_theta(cfg: dict) -> int:
    theta = float(rope_parameters(cfg)["rope_theta"])
    if theta != int(theta):
        raise ConfigError(f"rope_theta {theta} is not an integer; --rotary-base takes integers (Megatron-LM's type)")
    return int(theta)


# Megatron-core's llama3 RoPE scaling fixes these (models/common/embeddings/rotary_pos_embedding.py,
# `_apply_scaling`: low_freq_factor 1, high_freq_factor 4, original_max_position_embeddings 8192); only
# `factor` is a GPTModel argument.
MCORE_LLAMA3_SCALING = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def _llama3_scaling(cfg: dict) -> bool:
    return rope_parameters(cfg)["rope_type"] == "llama3"


def _rope_refusal(cfg: dict) -> bool:
    p = rope_parameters(cfg)
    if p["rope_type"] == "default":
        return False
    if p["rope_type"] != "llama3":
        return True
    return any(float(p.get(k, -1)) != v for k, v in MCORE_LLAMA3_SCALING.items())


def head_dim(cfg: dict) -> int:
    return cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]


def _kv_heads(cfg: dict) -> int:
    return cfg.get("num_key_value_heads") or cfg["num_attention_heads"]


def _layer_tensors(prefix: str, names: dict[str, str]) -> dict[str, str]:
    return {k: f"{prefix}.{{i}}.{v}" for k, v in names.items()}


# -- the Llama layout (Llama 2/3, Mistral, Qwen2/2.5) ---------------------------------------------------------

_L = _layer_tensors("model.layers", {
    "ln1": "input_layernorm.weight", "q": "self_attn.q_proj.weight", "k": "self_attn.k_proj.weight",
    "v": "self_attn.v_proj.weight", "qb": "self_attn.q_proj.bias", "kb": "self_attn.k_proj.bias",
    "vb": "self_attn.v_proj.bias", "o": "self_attn.o_proj.weight", "ln2": "post_attention_layernorm.weight",
    "gate": "mlp.gate_proj.weight", "up": "mlp.up_proj.weight", "down": "mlp.down_proj.weight"})

LLAMA_TENSORS = (
    Tensor("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "vocab", 0, layer=False),
    Tensor("input_layernorm.weight", (_L["ln1"],)),
    Tensor("self_attention.linear_qkv.weight", (_L["q"], _L["k"], _L["v"]), "qkv", 0),
    Tensor("self_attention.linear_qkv.bias", (_L["qb"], _L["kb"], _L["vb"]), "qkv", 0, when="add_qkv_bias"),
    Tensor("self_attention.linear_proj.weight", (_L["o"],), tp_dim=1),
    Tensor("pre_mlp_layernorm.weight", (_L["ln2"],)),
    Tensor("mlp.linear_fc1.weight", (_L["gate"], _L["up"]), "gate_up", "glu"),
    Tensor("mlp.linear_fc2.weight", (_L["down"],), tp_dim=1),
    Tensor("decoder.final_layernorm.weight", ("model.norm.weight",), layer=False),
    Tensor("output_layer.weight", ("lm_head.weight",), "vocab", 0, layer=False,
           when="untie_embeddings_and_output_weights"),
)

LLAMA_CONFIG = (
    ("--num-layers", "num_hidden_layers"),
    ("--hidden-size", "hidden_size"),
    ("--ffn-hidden-size", "intermediate_size"),
    ("--num-attention-heads", "num_attention_heads"),
    ("--num-query-groups", _kv_heads),
    ("--kv-channels", head_dim),
    ("--max-position-embeddings", "max_position_embeddings"),
    ("--norm-epsilon", "rms_norm_eps"),
    ("--rotary-base", rope_theta),
    ("--untie-embeddings-and-output-weights", lambda c: not c.get("tie_word_embeddings", False)),
    ("--use-rope-scaling", _llama3_scaling),
    ("--rope-scaling-factor", lambda c: float(rope_parameters(c).get("factor", 8.0)) if _llama3_scaling(c) else None),
)
LLAMA_FLAGS = ("--normalization", "RMSNorm", "--swiglu", "--position-embedding-type", "rope",
               "--disable-bias-linear", "--group-query-attention")
LLAMA_REFUSE = (
    (lambda c: c.get("hidden_act", "silu") != "silu", "hidden_act must be silu (Megatron's --swiglu is SiLU-gated)"),
    (lambda c: bool(c.get("attention_bias")), "attention_bias adds an o_proj bias, which megatron-core's "
                                             "--add-qkv-bias does not cover"),
    (lambda c: bool(c.get("mlp_bias")), "mlp_bias: gate/up/down biases have no place with --swiglu "
                                       "--disable-bias-linear"),
    (_rope_refusal, "rope scaling other than llama3's with low_freq_factor 1, high_freq_factor 4, "
                    "original_max_position_embeddings 8192 (the values megatron-core fixes)"),
)
_SLIDING = (lambda c: bool(c.get("sliding_window")) and c.get("sliding_window") < c.get("max_position_embeddings", 0)
            and c.get("use_sliding_window", True) is not False,
            "sliding_window: the Megatron model attends over the whole causal context; it equals the HF model on "
            "sequences no longer than the window")

LLAMA = Family("llama", ("llama",), "LlamaForCausalLM", LLAMA_CONFIG, LLAMA_FLAGS, LLAMA_TENSORS, LLAMA_REFUSE,
               ignored_hf=("model.layers.{i}.self_attn.rotary_emb.inv_freq",))
MISTRAL = Family("mistral", ("mistral",), "MistralForCausalLM", LLAMA_CONFIG, LLAMA_FLAGS, LLAMA_TENSORS,
                 LLAMA_REFUSE, ignored_hf=LLAMA.ignored_hf, notes=(_SLIDING,))
QWEN2 = Family("qwen2", ("qwen2",), "Qwen2ForCausalLM", LLAMA_CONFIG, LLAMA_FLAGS + ("--add-qkv-bias",),
               LLAMA_TENSORS, LLAMA_REFUSE, ignored_hf=LLAMA.ignored_hf, notes=(_SLIDING,))

# -- Qwen3 (dense): the Llama layout with an RMSNorm on each head's query and key ------------------------------
# megatron-core's --qk-layernorm: q_layernorm / k_layernorm of kv_channels features, applied per head before RoPE
# (attention.py `get_query_key_value_tensors`), replicated across TP.

_Q3 = _layer_tensors("model.layers", {"qn": "self_attn.q_norm.weight", "kn": "self_attn.k_norm.weight"})
QWEN3_TENSORS = LLAMA_TENSORS + (
    Tensor("self_attention.q_layernorm.weight", (_Q3["qn"],)),
    Tensor("self_attention.k_layernorm.weight", (_Q3["kn"],)),
)
QWEN3 = Family("qwen3", ("qwen3",), "Qwen3ForCausalLM", LLAMA_CONFIG, LLAMA_FLAGS + ("--qk-layernorm",),
               QWEN3_TENSORS, LLAMA_REFUSE, ignored_hf=LLAMA.ignored_hf, notes=(_SLIDING,))

# -- Seed-OSS: the Llama layout with q/k/v biases (attention_bias) and none on o_proj (attention_out_bias) --------
# transformers' SeedOssAttention: q/k/v_proj bias=attention_bias, o_proj bias=attention_out_bias; its MLP and
# norms are Llama's. Its dropouts (attention_dropout, residual_dropout: after o_proj and down_proj, before the
# residual add, Megatron's --hidden-dropout) are training settings the job takes from its own flags.

SEED_OSS_CONFIG = LLAMA_CONFIG + (("--add-qkv-bias", lambda c: bool(c.get("attention_bias", True))),)
SEED_OSS_REFUSE = tuple(r for r in LLAMA_REFUSE if "attention_bias" not in r[1]) + (
    (lambda c: bool(c.get("attention_out_bias")), "attention_out_bias: an o_proj bias without an MLP bias has no "
                                                 "megatron-core counterpart (--disable-bias-linear drops both)"),
)
_DROPOUT = (lambda c: bool(c.get("attention_dropout")) or bool(c.get("residual_dropout")),
            "attention_dropout / residual_dropout in config.json are training settings: the job's "
            "--attention-dropout / --hidden-dropout decide them")
SEED_OSS = Family("seed_oss", ("seed_oss",), "SeedOssForCausalLM", SEED_OSS_CONFIG, LLAMA_FLAGS, LLAMA_TENSORS,
                  SEED_OSS_REFUSE, ignored_hf=LLAMA.ignored_hf, notes=(_DROPOUT,))

# -- Phi-3 / Phi-3.5 (dense): the Llama layer with q/k/v in one qkv_proj and gate/up in one gate_up_proj, and
# LongRoPE --------------------------------------------------------------------------------------------------
# transformers' Phi3Attention: qkv_proj rows [q (heads x head_dim); k (kv heads x head_dim); v]; Phi3MLP:
# gate_up_proj rows [gate; up] (chunk(2): gate first), megatron-core's fc1 order. Its longrope: frequencies
# 1 / (factor x base^(2i/d)), long_factor above original_max_position_embeddings, cos/sin x attention_factor
# (default sqrt(1 + ln(max / original) / ln(original))) (modeling_rope_utils.py `_compute_longrope_parameters`).

def _longrope(cfg: dict) -> bool:
    return rope_parameters(cfg)["rope_type"] in ("longrope", "su")


def _original_max(cfg: dict):
    return rope_parameters(cfg).get("original_max_position_embeddings") or cfg.get("original_max_position_embeddings")


def _factors(key: str) -> Callable[[dict], str | None]:
    return lambda c: ",".join(repr(float(x)) for x in rope_parameters(c)[key]) if _longrope(c) else None


def _attention_factor(c: dict):
    factor = rope_parameters(c).get("attention_factor")
    return float(factor) if _longrope(c) and factor is not None else None


_P = _layer_tensors("model.layers", {
    "ln1": "input_layernorm.weight", "qkv": "self_attn.qkv_proj.weight", "o": "self_attn.o_proj.weight",
    "ln2": "post_attention_layernorm.weight", "gate_up": "mlp.gate_up_proj.weight", "down": "mlp.down_proj.weight"})
PHI3_TENSORS = (
    Tensor("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "vocab", 0, layer=False),
    Tensor("input_layernorm.weight", (_P["ln1"],)),
    Tensor("self_attention.linear_qkv.weight", (_P["qkv"],), "packed_qkv", 0),
    Tensor("self_attention.linear_proj.weight", (_P["o"],), tp_dim=1),
    Tensor("pre_mlp_layernorm.weight", (_P["ln2"],)),
    Tensor("mlp.linear_fc1.weight", (_P["gate_up"],), "copy", "glu"),
    Tensor("mlp.linear_fc2.weight", (_P["down"],), tp_dim=1),
    Tensor("decoder.final_layernorm.weight", ("model.norm.weight",), layer=False),
    Tensor("output_layer.weight", ("lm_head.weight",), "vocab", 0, layer=False,
           when="untie_embeddings_and_output_weights"),
)
PHI3_CONFIG = tuple(row for row in LLAMA_CONFIG if row[0] not in ("--use-rope-scaling", "--rope-scaling-factor")) + (
    ("--rope-scaling-type", lambda c: "longrope" if _longrope(c) else None),
    ("--longrope-freqs-type", lambda c: "outer" if _longrope(c) else None),
    ("--rope-scaling-original-max-position-embeddings", lambda c: _original_max(c) if _longrope(c) else None),
    ("--long-factor", _factors("long_factor")),
    ("--short-factor", _factors("short_factor")),
    ("--long-mscale", _attention_factor),
    ("--short-mscale", _attention_factor),
)
PHI3_REFUSE = (
    LLAMA_REFUSE[0],
    (lambda c: rope_parameters(c)["rope_type"] not in ("default", "longrope", "su"),
     "rope scaling other than LongRoPE (rope_type longrope)"),
    (lambda c: float(rope_parameters(c).get("partial_rotary_factor", c.get("partial_rotary_factor", 1.0))) != 1.0,
     "partial_rotary_factor below 1 (rotary on part of each head, Phi-4-mini) with LongRoPE is not implemented here"),
)
_PHI3_DROPOUT = (lambda c: any(c.get(k) for k in ("resid_pdrop", "embd_pdrop", "attention_dropout")),
                 "resid_pdrop / embd_pdrop / attention_dropout in config.json are training settings: the job's "
                 "--hidden-dropout / --attention-dropout decide them")
PHI3 = Family("phi3", ("phi3",), "Phi3ForCausalLM", PHI3_CONFIG, LLAMA_FLAGS, PHI3_TENSORS, PHI3_REFUSE,
              notes=(_SLIDING, _PHI3_DROPOUT))

# -- Gemma 2: the Llama layout with four norms a layer (Gemma's 1 + w RMSNorm), GeGLU and soft-capped logits -------
# transformers' Gemma2DecoderLayer: input_layernorm, post_attention_layernorm (on the attention output, before the
# residual add: MindSpeed-LLM's post_attn_norm), pre_feedforward_layernorm (megatron-core's pre_mlp_layernorm),
# post_feedforward_layernorm (post_mlp_layernorm); Gemma2RMSNorm stores w and applies 1 + w
# (--add-rmsnorm-offset); the embeddings times sqrt(hidden) (--input-embeds-norm); scores x
# query_pre_attn_scalar^-0.5; layer_types alternate sliding (even layer_idx) and full attention
# (--interleave-sliding-window); final_logit_softcapping (--output-logit-softcapping).

_G2 = _layer_tensors("model.layers", {
    "post_attn": "post_attention_layernorm.weight", "pre_mlp": "pre_feedforward_layernorm.weight",
    "post_mlp": "post_feedforward_layernorm.weight"})
GEMMA2_TENSORS = tuple(t for t in LLAMA_TENSORS if t.mcore not in ("pre_mlp_layernorm.weight",
                                                                   "self_attention.linear_qkv.bias")) + (
    Tensor("post_attn_norm.weight", (_G2["post_attn"],)),
    Tensor("pre_mlp_layernorm.weight", (_G2["pre_mlp"],)),
    Tensor("post_mlp_layernorm.weight", (_G2["post_mlp"],)),
)


def _gemma2_alternating(cfg: dict) -> bool:
    types_ = cfg.get("layer_types")
    return types_ is None or list(types_) == ["sliding_attention" if i % 2 == 0 else "full_attention"
                                              for i in range(cfg["num_hidden_layers"])]


GEMMA2_CONFIG = tuple(row for row in LLAMA_CONFIG if row[0] not in ("--use-rope-scaling", "--rope-scaling-factor")) + (
    ("--query-pre-attn-scalar", "query_pre_attn_scalar"),
    ("--output-logit-softcapping", "final_logit_softcapping"),
    ("--interleave-sliding-window", "sliding_window"),
)
GEMMA2_FLAGS = ("--normalization", "RMSNorm", "--add-rmsnorm-offset", "--gelu-tanh", "--post-norm",
                "--input-embeds-norm", "--position-embedding-type", "rope", "--disable-bias-linear",
                "--group-query-attention")
GEMMA2_REFUSE = (
    (lambda c: c.get("hidden_activation", c.get("hidden_act", "gelu_pytorch_tanh")) not in ("gelu_pytorch_tanh",
                                                                                           "gelu_new"),
     "hidden_activation must be gelu_pytorch_tanh (--gelu-tanh is the tanh GeLU, gated)"),
    (lambda c: bool(c.get("attention_bias")), "attention_bias: q/k/v/o biases are not converted for Gemma 2"),
    (lambda c: rope_parameters(c)["rope_type"] != "default", "rope scaling (Gemma 2 has none)"),
    (lambda c: not _gemma2_alternating(c), "layer_types other than Gemma 2's alternation (sliding on even "
                                           "layer_idx, full on odd), which --interleave-sliding-window builds"),
)
_ATTN_SOFTCAP = (lambda c: c.get("attn_logit_softcapping") is not None,
                 "attn_logit_softcapping: the Megatron model does not soft-cap attention scores (nor do "
                 "MindSpeed-LLM's gemma2 scripts: --attn-logit-softcapping is not implemented here); it equals the "
                 "HF model only while the scores stay far below the cap")
GEMMA2 = Family("gemma2", ("gemma2",), "Gemma2ForCausalLM", GEMMA2_CONFIG, GEMMA2_FLAGS, GEMMA2_TENSORS,
                GEMMA2_REFUSE, notes=(_ATTN_SOFTCAP,))

# -- GPT-2 ------------------------------------------------------------------------------------------------------

_G = _layer_tensors("transformer.h", {
    "ln1w": "ln_1.weight", "ln1b": "ln_1.bias", "qkvw": "attn.c_attn.weight", "qkvb": "attn.c_attn.bias",
    "ow": "attn.c_proj.weight", "ob": "attn.c_proj.bias", "ln2w": "ln_2.weight", "ln2b": "ln_2.bias",
    "fc1w": "mlp.c_fc.weight", "fc1b": "mlp.c_fc.bias", "fc2w": "mlp.c_proj.weight", "fc2b": "mlp.c_proj.bias"})

GPT2_TENSORS = (
    Tensor("embedding.word_embeddings.weight", ("transformer.wte.weight",), "vocab", 0, layer=False),
    Tensor("embedding.position_embeddings.weight", ("transformer.wpe.weight",), layer=False),
    Tensor("input_layernorm.weight", (_G["ln1w"],)),
    Tensor("input_layernorm.bias", (_G["ln1b"],)),
    # Conv1D stores [in, out]: the fused c_attn is [h, 3h] = [q | k | v] along its output
    Tensor("self_attention.linear_qkv.weight", (_G["qkvw"],), "fused_qkv_conv1d", 0),
    Tensor("self_attention.linear_qkv.bias", (_G["qkvb"],), "fused_qkv", 0),
    Tensor("self_attention.linear_proj.weight", (_G["ow"],), "conv1d", 1),
    Tensor("self_attention.linear_proj.bias", (_G["ob"],)),
    Tensor("pre_mlp_layernorm.weight", (_G["ln2w"],)),
    Tensor("pre_mlp_layernorm.bias", (_G["ln2b"],)),
    Tensor("mlp.linear_fc1.weight", (_G["fc1w"],), "conv1d", 0),
    Tensor("mlp.linear_fc1.bias", (_G["fc1b"],), tp_dim=0),
    Tensor("mlp.linear_fc2.weight", (_G["fc2w"],), "conv1d", 1),
    Tensor("mlp.linear_fc2.bias", (_G["fc2b"],)),
    Tensor("decoder.final_layernorm.weight", ("transformer.ln_f.weight",), layer=False),
    Tensor("decoder.final_layernorm.bias", ("transformer.ln_f.bias",), layer=False),
)
GPT2 = Family(
    "gpt2", ("gpt2",), "GPT2LMHeadModel",
    config=(("--num-layers", "n_layer"), ("--hidden-size", "n_embd"),
            ("--ffn-hidden-size", lambda c: c.get("n_inner") or 4 * c["n_embd"]),
            ("--num-attention-heads", "n_head"), ("--max-position-embeddings", "n_positions"),
            ("--norm-epsilon", "layer_norm_epsilon")),
    # GPT-2's gelu_new is the tanh approximation: Megatron-LM's --openai-gelu
    flags=("--normalization", "LayerNorm", "--position-embedding-type", "learned_absolute", "--openai-gelu"),
    tensors=GPT2_TENSORS,
    refuse=((lambda c: c.get("activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh"),
             "activation_function must be gelu_new or gelu_pytorch_tanh (the tanh GeLU, --openai-gelu)"),
            (lambda c: bool(c.get("scale_attn_by_inverse_layer_idx")), "scale_attn_by_inverse_layer_idx has no "
             "megatron-core counterpart"),
            (lambda c: bool(c.get("reorder_and_upcast_attn")), "reorder_and_upcast_attn has no megatron-core "
             "counterpart"),
            (lambda c: c.get("scale_attn_weights") is False, "scale_attn_weights false (unscaled attention) has no "
             "megatron-core counterpart"),
            (lambda c: c.get("tie_word_embeddings") is False, "GPT-2 with untied lm_head")),
    ignored_hf=("transformer.h.{i}.attn.bias", "transformer.h.{i}.attn.masked_bias", "lm_head.weight"),
)

# -- Mixture of experts: Mixtral, Qwen3-MoE ---------------------------------------------------------------------
# The Llama attention with an MoE layer in place of the MLP: megatron-core's MoELayer (`--num-experts`), its
# TopKRouter (`mlp.router.weight` [experts, hidden], no bias: HF's gate) and SequentialMLP experts, each a SwiGLU
# MLP (`mlp.experts.local_experts.<e>.linear_fc1` = [gate; up], `linear_fc2` = down). The routing each family
# computes (transformers' modeling files):
# - Mixtral (MixtralSparseMoeBlock / MixtralTopKRouter): softmax over all experts, top k, the k weights divided by
#   their sum. megatron-core's softmax router without --moe-router-pre-softmax takes the top k of the logits and
#   softmaxes over those k (moe_utils.py `topk_routing_with_score_function`): the same weights (exp(l_i) / sum of
#   the k exp(l_j)), the same experts.
# - Qwen3-MoE / Qwen2-MoE: softmax over all experts, top k, divided by their sum only with norm_topk_prob. With
#   norm_topk_prob the Mixtral case; without, --moe-router-pre-softmax (softmax over all experts, then top k,
#   not renormalised).
# The load-balancing loss (router_aux_loss_coef, output_router_logits) is a training setting: the job's
# --moe-aux-loss-coeff decides it. Every layer must be an MoE layer here (Qwen's mlp_only_layers /
# decoder_sparse_step != 1 are refused).

_M = _layer_tensors("model.layers", {"router": "block_sparse_moe.gate.weight",
                                     "w1": "block_sparse_moe.experts.{e}.w1.weight",
                                     "w3": "block_sparse_moe.experts.{e}.w3.weight",
                                     "w2": "block_sparse_moe.experts.{e}.w2.weight"})
_QM = _layer_tensors("model.layers", {"router": "mlp.gate.weight", "gate": "mlp.experts.{e}.gate_proj.weight",
                                      "up": "mlp.experts.{e}.up_proj.weight",
                                      "down": "mlp.experts.{e}.down_proj.weight"})


def _moe_tensors(dense: tuple[Tensor, ...], names: dict[str, str], gate: str, up: str, down: str) -> tuple:
    """A dense family's rows with its MLP replaced by the router and the per-expert SwiGLU MLPs."""
    rows = tuple(r for r in dense if not r.mcore.startswith("mlp."))
    return rows + (
        Tensor("mlp.router.weight", (names["router"],)),
        Tensor("mlp.experts.local_experts.{e}.linear_fc1.weight", (names[gate], names[up]), "gate_up", expert=True),
        Tensor("mlp.experts.local_experts.{e}.linear_fc2.weight", (names[down],), expert=True),
    )


_MOE_DENSE_LAYERS = (
    lambda c: bool(c.get("mlp_only_layers")) or (c.get("decoder_sparse_step") or 1) != 1,
    "mlp_only_layers / decoder_sparse_step != 1 (dense MLP layers among the MoE layers) are not converted here")
_JITTER = (lambda c: bool(c.get("router_jitter_noise")),
           "router_jitter_noise (training only) scales the MoE block's input in transformers, megatron-core's "
           "--moe-input-jitter-eps the router's input only: not carried over")
MIXTRAL_CONFIG = LLAMA_CONFIG + (
    ("--num-experts", "num_local_experts"),
    ("--moe-ffn-hidden-size", "intermediate_size"),
    ("--moe-router-topk", "num_experts_per_tok"),
)
MIXTRAL = Family("mixtral", ("mixtral",), "MixtralForCausalLM", MIXTRAL_CONFIG, LLAMA_FLAGS,
                 _moe_tensors(LLAMA_TENSORS, _M, "w1", "w3", "w2"), LLAMA_REFUSE, ignored_hf=LLAMA.ignored_hf,
                 notes=(_SLIDING, _JITTER))
QWEN_MOE_CONFIG = LLAMA_CONFIG + (
    # the hub's Qwen MoE config.json files say num_experts; transformers 5 writes num_local_experts (attribute_map)
    ("--num-experts", lambda c: c.get("num_experts") or c.get("num_local_experts")),
    ("--moe-ffn-hidden-size", "moe_intermediate_size"),
    ("--moe-router-topk", "num_experts_per_tok"),
    ("--moe-router-pre-softmax", lambda c: not c.get("norm_topk_prob", False)),
)
# Qwen2-MoE: Qwen2's attention (q/k/v biases) with the MoE layer and a gated shared expert: transformers'
# Qwen2MoeSparseMoeBlock adds sigmoid(shared_expert_gate(x)) x shared_expert(x) (a SwiGLU MLP of
# shared_expert_intermediate_size) to the routed output; megatron-core 0.16's SharedExpertMLP with
# moe_shared_expert_gate computes the same (shared_experts.py `forward`: sigmoid(linear(x, gate_weight)) x out).
_Q2M = _layer_tensors("model.layers", {"sgate": "mlp.shared_expert.gate_proj.weight",
                                       "sup": "mlp.shared_expert.up_proj.weight",
                                       "sdown": "mlp.shared_expert.down_proj.weight",
                                       "sg": "mlp.shared_expert_gate.weight"})
QWEN2_MOE_TENSORS = _moe_tensors(LLAMA_TENSORS, _QM, "gate", "up", "down") + (
    Tensor("mlp.shared_experts.linear_fc1.weight", (_Q2M["sgate"], _Q2M["sup"]), "gate_up", "glu"),
    Tensor("mlp.shared_experts.linear_fc2.weight", (_Q2M["sdown"],), tp_dim=1),
    Tensor("mlp.shared_experts.gate_weight", (_Q2M["sg"],)),
)
QWEN2_MOE = Family("qwen2_moe", ("qwen2_moe",), "Qwen2MoeForCausalLM", QWEN_MOE_CONFIG + (
    ("--moe-shared-expert-intermediate-size", "shared_expert_intermediate_size"),
    ("--moe-shared-expert-gate", lambda c: bool(c.get("shared_expert_intermediate_size"))),
    ("--add-qkv-bias", lambda c: c.get("qkv_bias", True))),  # transformers 5's qkv_bias; earlier: always
    LLAMA_FLAGS, QWEN2_MOE_TENSORS, LLAMA_REFUSE + (_MOE_DENSE_LAYERS,) + (
        (lambda c: not c.get("shared_expert_intermediate_size"), "a Qwen2-MoE without a shared expert "
         "(shared_expert_intermediate_size 0): transformers' block still adds the gated shared expert"),),
    ignored_hf=LLAMA.ignored_hf, notes=(_SLIDING,))
QWEN3_MOE = Family("qwen3_moe", ("qwen3_moe",), "Qwen3MoeForCausalLM", QWEN_MOE_CONFIG,
                   LLAMA_FLAGS + ("--qk-layernorm",), _moe_tensors(QWEN3_TENSORS, _QM, "gate", "up", "down"),
                   LLAMA_REFUSE + (_MOE_DENSE_LAYERS,), ignored_hf=LLAMA.ignored_hf, notes=(_SLIDING,))

# -- Qwen3-Next (dense): Gated DeltaNet layers with a full-attention layer every full_attention_interval ---------
# The Megatron side is megatron-core 0.16's own hybrid model: experimental_attention_variant "gated_delta_net"
# with linear_attention_freq N (models/gpt/experimental_attention_variant_module_specs.py:316-350: layer i, 0-based,
# is full attention when (i + 1) % N == 0, as transformers' default layer_types), GatedDeltaNet
# (ssm/gated_delta_net.py) in the others, megatron-core's attention with attention_output_gate in the full ones.
# transformers' Qwen3NextForCausalLM (models/qwen3_next/modeling_qwen3_next.py), dense when num_experts is 0:
# - linear_attn.in_proj_qkvz [per key head g: q_g (dk); k_g (dk); v_g (nv/nk x dv); z_g (nv/nk x dv)] and
#   in_proj_ba [per key head g: b_g (nv/nk); a_g (nv/nk)] (`fix_query_key_value_ordering`) -> GatedDeltaNet's one
#   in_proj [q (nk x dk); k; v (nv x dv); z; beta (nv); alpha (nv)] (gated_delta_net.py:139,309-318), saved as six
#   keys in_proj.weight.{query,key,value,z,beta,alpha}, each split over TP along dim 0 (:474-488);
# - linear_attn.conv1d.weight [q; k; v channels, 1, kernel] -> conv1d.weight, saved as conv1d.weight.{query,key,value}
#   (:495-509); A_log, dt_bias [nv] as they are (split over TP); out_proj as it is (RowParallel);
# - linear_attn.norm (Qwen3NextRMSNormGated: w x normalized, weight init 1) -> out_norm, built with the layer's
#   config: with --add-rmsnorm-offset (Qwen3-Next's other norms are (1 + w), Qwen3NextRMSNorm) it applies 1 + w, so
#   it holds w - 1 (exact both ways for 0.5 <= w <= 2, Sterbenz);
# - self_attn.q_proj [per head h: q_h (d); gate_h (d)] (`torch.chunk(..., 2)` of each head's 2d rows), k_proj,
#   v_proj -> linear_qkv with attention_output_gate [per query group g: q_g (nh/ng heads); gate_g; k_g; v_g]
#   (attention.py:1265-1267,1414-1432); q_norm / k_norm ((1 + w)) -> q_layernorm / k_layernorm;
# - input_layernorm: a full layer's -> input_layernorm (saved as linear_qkv.layer_norm_weight); a Gated DeltaNet
#   layer's -> saved as self_attention.in_proj.layer_norm_weight, where Transformer Engine's fused norm + in_proj
#   (the spec's column_parallel_layer_norm_linear, :68) keeps it.

def _linear_attention_layer(a, i: int) -> bool:
    return (i + 1) % a.full_attention_interval != 0


LAYER_KINDS = {"linear_attention": _linear_attention_layer,
               "full_attention": lambda a, i: not _linear_attention_layer(a, i)}


def _gdn_sizes(a) -> tuple[int, int, int]:
    """(qk_dim, v_dim, value heads) of a Gated DeltaNet layer."""
    return (a.linear_key_head_dim * a.linear_num_key_heads, a.linear_value_head_dim * a.linear_num_value_heads,
            a.linear_num_value_heads)


def _in_proj_parts(a) -> list[int]:
    qk, v, nv = _gdn_sizes(a)
    return [qk, qk, v, v, nv, nv]


def _conv_parts(a) -> list[int]:
    qk, v, _ = _gdn_sizes(a)
    return [qk, qk, v]


def _partial_rotary(cfg: dict) -> float:
    """transformers 5 keeps it in rope_parameters, 4.x beside them."""
    return float(rope_parameters(cfg).get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))


def _full_attention_interval(cfg: dict) -> int:
    """transformers 5 saves the pattern as layer_types only (full_attention_interval gives its default)."""
    types_ = cfg.get("layer_types")
    if types_ and "full_attention" in types_:
        return list(types_).index("full_attention") + 1
    return cfg.get("full_attention_interval") or 4


def _qwen3_next_layer_types(cfg: dict) -> bool:
    interval = _full_attention_interval(cfg)
    want = ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
            for i in range(cfg["num_hidden_layers"])]
    return cfg.get("layer_types") is not None and list(cfg["layer_types"]) != want


_N = _layer_tensors("model.layers", {
    "ln1": "input_layernorm.weight", "qkvz": "linear_attn.in_proj_qkvz.weight", "ba": "linear_attn.in_proj_ba.weight",
    "conv": "linear_attn.conv1d.weight", "A": "linear_attn.A_log", "dt": "linear_attn.dt_bias",
    "norm": "linear_attn.norm.weight", "out": "linear_attn.out_proj.weight"})
_LIN, _FULL = "linear_attention", "full_attention"
QWEN3_NEXT_TENSORS = (
    LLAMA_TENSORS[0],  # the embedding
    Tensor("input_layernorm.weight", (_L["ln1"],), layers=_FULL),
    Tensor("self_attention.linear_qkv.weight", (_L["q"], _L["k"], _L["v"]), "gated_qkv", 0, layers=_FULL),
    Tensor("self_attention.linear_proj.weight", (_L["o"],), tp_dim=1, layers=_FULL),
    Tensor("self_attention.q_layernorm.weight", (_Q3["qn"],), layers=_FULL),
    Tensor("self_attention.k_layernorm.weight", (_Q3["kn"],), layers=_FULL),
    Tensor("self_attention.in_proj.layer_norm_weight", (_N["ln1"],), layers=_LIN),
    Tensor("self_attention.in_proj.weight", (_N["qkvz"], _N["ba"]), "gdn_in_proj", 0, layers=_LIN),
    Tensor("self_attention.conv1d.weight", (_N["conv"],), tp_dim=0, layers=_LIN),
    Tensor("self_attention.A_log", (_N["A"],), tp_dim=0, layers=_LIN),
    Tensor("self_attention.dt_bias", (_N["dt"],), tp_dim=0, layers=_LIN),
    Tensor("self_attention.out_norm.weight", (_N["norm"],), "unit_offset", layers=_LIN),
    Tensor("self_attention.out_proj.weight", (_N["out"],), tp_dim=1, layers=_LIN),
) + tuple(t for t in LLAMA_TENSORS[4:] if t.mcore != "self_attention.linear_proj.weight")
QWEN3_NEXT_CONFIG = LLAMA_CONFIG + (
    ("--full-attention-interval", _full_attention_interval),
    ("--linear-key-head-dim", "linear_key_head_dim"),
    ("--linear-value-head-dim", "linear_value_head_dim"),
    ("--linear-num-key-heads", "linear_num_key_heads"),
    ("--linear-num-value-heads", "linear_num_value_heads"),
    ("--mamba-d-conv", "linear_conv_kernel_dim"),
    ("--partial-rotary-factor", lambda c: None if _partial_rotary(c) == 1.0 else _partial_rotary(c)),
)
QWEN3_NEXT_REFUSE = LLAMA_REFUSE + (
    (lambda c: bool(c.get("num_experts")), "num_experts: Qwen3-Next's mixture-of-experts layers are not converted "
                                           "here (the dense model, num_experts 0, is)"),
    (_qwen3_next_layer_types, "layer_types other than a full-attention layer every full_attention_interval "
                              "(megatron-core's linear_attention_freq pattern)"),
)
QWEN3_NEXT = Family(
    "qwen3_next", ("qwen3_next",), "Qwen3NextForCausalLM", QWEN3_NEXT_CONFIG,
    LLAMA_FLAGS + ("--qk-layernorm", "--add-rmsnorm-offset"), QWEN3_NEXT_TENSORS, QWEN3_NEXT_REFUSE,
    split=(("self_attention.in_proj.weight", ("query", "key", "value", "z", "beta", "alpha"), _in_proj_parts),
           ("self_attention.conv1d.weight", ("query", "key", "value"), _conv_parts)))

FAMILIES = {"llama": LLAMA, "mistral": MISTRAL, "qwen2": QWEN2, "qwen3": QWEN3, "seed_oss": SEED_OSS, "phi3": PHI3,
            "gpt2": GPT2, "gemma2": GEMMA2, "mixtral": MIXTRAL, "qwen2_moe": QWEN2_MOE,
            "qwen3_moe": QWEN3_MOE, "qwen3_next": QWEN3_NEXT}
# --model-type-hf values (MindSpeed-LLM's names: convert_ckpt_v2.py's and convert_ckpt.py's choices, and the
# spellings of the models' own names) -> family. MindSpeed-LLM's Magistral is a Mistral-architecture checkpoint.
MODEL_TYPES = {"llama2": "llama", "llama3": "llama", "mistral": "mistral", "magistral": "mistral", "qwen2": "qwen2",
               "qwen2.5": "qwen2", "qwen25": "qwen2", "qwen3": "qwen3", "seed-oss": "seed_oss", "phi3": "phi3",
               "phi3.5": "phi3", "gpt2": "gpt2", "gemma2": "gemma2", "mixtral": "mixtral", "qwen2-moe": "qwen2_moe",
               "qwen3-moe": "qwen3_moe", "qwen3-next": "qwen3_next"}
# MindSpeed-LLM's convert_ckpt.py (its 2.x scripts) says `--model-type-hf llama2` for every Llama-layout checkpoint,
# Qwen 1.5 / 2 / 2.5 included (with --add-qkv-bias): the family is then config.json's, among these.
LLAMA_LAYOUT = {"llama2": ("llama", "qwen2")}
# MindSpeed-LLM's names of families not converted here, by the feature they need
_NOT_CONVERTED = {
    "a mixture-of-experts model other than Mixtral, Qwen2-MoE and Qwen3-MoE": (
                           "deepseek2", "deepseek2-lite", "deepseek3", "deepseek32", "deepseek4", "deepseek4_base",
                           "glm45", "glm45-air", "glm5", "bailing_mini", "phi3.5-moe", "minicpm-moe", "longcat", "minimax_m2", "HYV3", "hunyuan"),
    "a state-space (Mamba) model": ("mamba2",),
}


def model_type_refusal(name: str) -> str:
    """The line for a --model-type-hf name this converter does not have: the families it has."""
    why = next((f" ({name} is {kind}: not converted here)" for kind, names in _NOT_CONVERTED.items()
                if name in names), "")
    return (f"--model-type-hf {name}: not a family this converter has{why}; it converts "
            f"{', '.join(MODEL_TYPES)}")


def family_for(model_type_hf: str | None, cfg: dict) -> Family:
    """The family named by --model-type-hf, or the one whose model_type config.json names; checked against it."""
    hf_type = cfg.get("model_type")
    if model_type_hf is None:
        for family in FAMILIES.values():
            if hf_type in family.hf_model_types:
                return family
        raise ConfigError(f"config.json model_type {hf_type!r} is not a known family; known: "
                          f"{sorted(t for f in FAMILIES.values() for t in f.hf_model_types)}")
    if model_type_hf not in MODEL_TYPES:
        raise ConfigError(model_type_refusal(model_type_hf))
    candidates = [FAMILIES[f] for f in LLAMA_LAYOUT.get(model_type_hf, (MODEL_TYPES[model_type_hf],))]
    if hf_type is None:
        return candidates[0]
    for family in candidates:
        if hf_type in family.hf_model_types:
            return family
    raise ConfigError(f"--model-type-hf {model_type_hf} expects config.json model_type "
                      f"{' or '.join(t for f in candidates for t in f.hf_model_types)}, the config says {hf_type!r}")
