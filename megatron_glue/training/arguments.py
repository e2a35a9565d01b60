"""The training job's command line: Megatron-LM's `pretrain_gpt.py` flags, with their names, defaults and meanings,
and the dialect Ascend users write (MindSpeed's and MindSpeed-LLM's flags, as their `examples/mcore/` scripts pass
them).

`parse_args(argv, world_size)` returns an `argparse.Namespace` shaped like Megatron-LM's `args` (the same
attribute names), checked against the world size before anything is built. Every flag is one of four kinds, each
listed in `--help` under its own heading:

- implemented: Megatron-LM's (or MindSpeed's / MindSpeed-LLM's) meaning, end to end;
- mapped onto the backend: MindSpeed's switches (`--use-flash-attn`, `--use-ascend-coc`, ...) name fusions or
  schedules the `ascend` backend runs (`MINDSPEED_FUSIONS`, `compile_options`);
- accepted, no effect here (`NO_EFFECT`): only where that is true of this job, each with the reason;
- refused (`REFUSED`, and some values in `_value_refusals`): a feature not implemented here, named, with what to
  do instead. Never accepted and ignored.

A command line with several refused or unknown flags is answered once, with all of them (`DialectError`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

# -- refused: the feature each flag belongs to, and what to do instead -------------------------------------------------

# MoE is megatron-core's MoELayer (docs/moe.md); these parts of it, or of MindSpeed's MoE, are not implemented here
MOE_GROUPED_GEMM = ("the grouped GEMM's weight-gradient accumulation into the main grads is not implemented here "
                    "(MindSpeed's fused GMM backward); drop it: --moe-grouped-gemm is the backend's grouped_matmul "
                    "fusion, whose weight gradients megatron-core's DDP accumulates as for any linear")
MOE_FB_OVERLAP = ("MindSpeed's forward/backward overlap of two micro-batches (--moe-fb-overlap: one micro-batch's "
                  "token all-to-alls behind another's compute, in its own 1F1B / DualPipeV schedule) is not "
                  "implemented here: each compiled graph is one micro-batch's forward or backward, run one after the "
                  "other by megatron-core's schedule, so no graph holds both; drop it (--moe-alltoall-overlap-comm "
                  "overlaps the all-to-alls within the layer)")
MOE_MINDSPEED = "MindSpeed-LLM's {} is not implemented here; drop it"
CP_ALGORITHMS = {"hybrid_cp_algo": "hybrid (Ulysses x ring)", "adaptive_cp_algo": "adaptive",
                 "hybrid_adaptive_cp_algo": "hybrid adaptive", "kvallgather_cp_algo": "K/V all-gather"}
INSTRUCTION = ("this part of MindSpeed-LLM's instruction data (variable p2p shapes without --no-pad-to-seq-lengths, "
               "the thinking switch at training time, templates from a file, other handlers) is not implemented "
               "here; -m megatron_glue.posttrain_gpt trains Alpaca/ShareGPT data padded to --seq-length, packed "
               "(--reset-attention-mask [--neat-pack]) or per batch (--no-pad-to-seq-lengths): "
               "docs/instruction_tuning.md")
DPO = "preference training (DPO) is not implemented here"
MLA = "multi-latent attention (MLA) is not implemented here; use a model with standard (GQA) attention"
MTP = "multi-token prediction (MTP) is not implemented here; drop the MTP flags"
LORA_MODULES_TO_SAVE = ("MindSpeed-LLM's --lora-modules-to-save (whole modules trained beside the LoRA adapters) is "
                        "not implemented here; train the adapters alone, or fine-tune all weights (--finetune without "
                        "--lora-target-modules)")
DSA = "DeepSeek sparse attention (its indexer, compressed KV) is not implemented here"
MHC = "hyper-connections (mHC) are not implemented here"
# Gated DeltaNet layers (--full-attention-interval) are megatron-core 0.16's (docs/linear_attention.md); these
# combinations with them are not implemented here
LINEAR_ATTENTION = "{} with Gated DeltaNet layers (--full-attention-interval) is not implemented here"
ROPE_EXTENSION = ("YaRN / PLM RoPE scaling is not implemented here; Llama 3's scaling is "
                  "(--rope-scaling-type llama3, or Megatron-LM's --use-rope-scaling), and LongRoPE's "
                  "(--rope-scaling-type longrope)")
RECOMPUTE = ("it is not implemented here; Megatron's --recompute-granularity full/selective is, and the compiler "
             "recomputes by its memory plan: --npu-compile-options '{\"memory_budget\": \"auto\"}'")

# MoE flags refused with --num-experts; without it they configure nothing (Megatron-LM and MindSpeed read them only for
# experts) and are accepted, as there. --num-experts and megatron-core's MoE settings are implemented (the parser's
# "mixture of experts" group)
MOE_REFUSED: dict[str, tuple[int | str, str]] = {
    "--gemm-gradient-accumulation-fusion": (0, MOE_GROUPED_GEMM),
    "--moe-fb-overlap": (0, MOE_FB_OVERLAP),
    "--moe-zero-memory": (1, MOE_MINDSPEED.format("MoE activation recompute / swap (--moe-zero-memory); Megatron's "
                                                  "--recompute-granularity full is implemented")),
    "--n-hash-layers": (1, MOE_MINDSPEED.format("hash routing (--n-hash-layers)")),
    "--num-zero-experts": (1, MOE_MINDSPEED.format("zero experts (--num-zero-experts)")),
    "--seq-aux": (0, "MindSpeed-LLM's sequence-wise balance loss (--seq-aux: apply_seq_aux_loss after the routing, "
                     "mindspeed_llm/core/transformer/moe/router.py:437-494, and group_limited_greedy's, 81-101) is "
                     "not implemented here: it adds the expert bias to the sigmoid scores before normalising them "
                     "and divides the coefficient by the tensor-parallel size, which megatron-core's seq_aux_loss "
                     "does not (compute_routing_scores_for_aux_loss: sigmoid scores without the bias); drop it, or "
                     "give --moe-router-load-balancing-type seq_aux_loss for megatron-core's"),
    "--topk-softmax-in-fp32": (0, "MindSpeed-LLM's --topk-softmax-in-fp32 (with --moe-router-pre-softmax the "
                                  "softmax scores are kept in float32 instead of being rounded to the logits' dtype "
                                  "before the top-k, its patched topk_softmax_with_capacity, "
                                  "mindspeed_llm/core/transformer/moe/moe_utils.py:282-284; the aux_loss routing's "
                                  "probs cast back, router.py:562-563) is not implemented here: no megatron-core "
                                  "setting computes that; --moe-router-dtype fp32 computes the whole router in "
                                  "float32"),
    "--shared-expert-gate": (0, MOE_MINDSPEED.format("gated shared expert (--shared-expert-gate)")),
}

# MindSpeed-LLM's own --moe-router-load-balancing-type values (mindspeed_llm/features_manager/moe/moe_router.py:
# 11-15, routed in mindspeed_llm/core/transformer/moe/router.py:533-600), each refused with its reason
MINDSPEED_LLM_ROUTING = {
    "softmax_topk": ("MindSpeed-LLM's softmax_topk routing (router.py:567-584: the softmax over all experts, the "
                     "expert bias added to it for the choice, --norm-topk-prob) is not implemented here; "
                     "megatron-core's --moe-router-load-balancing-type none --moe-router-pre-softmax routes the same "
                     "way without the expert bias"),
    "pai_megatron_aux_loss": ("MindSpeed-LLM's pai_megatron_aux_loss routing (mindspeed_llm/tasks/models/common/"
                              "pai_megatron.py) is not implemented here; use aux_loss, seq_aux_loss or none"),
    "sparsemixer_topk": ("MindSpeed-LLM's sparsemixer_topk routing (router.py:246-356, sparsemixer_top2) is not "
                         "implemented here; use aux_loss, seq_aux_loss or none"),
    "group_limited_greedy": ("MindSpeed-LLM's group_limited_greedy routing (router.py:35, DeepSeek-V2's device-"
                             "limited routing with its own balance losses) is not implemented here; megatron-core's "
                             "group-limited routing is --moe-router-num-groups / --moe-router-group-topk"),
}

# flag -> (values it takes: 0 a switch, 1 one value, "+" one or more; why it is refused)
REFUSED: dict[str, tuple[int | str, str]] = {
    **MOE_REFUSED,
    # context parallelism: Ulysses and ring are implemented (the parser's "distributed" group)
    "--ulysses-degree-in-cp": (1, "the Ulysses degree of MindSpeed's hybrid context parallelism, which is not "
                                  "implemented here; --context-parallel-algo ulysses_cp_algo or megatron_cp_algo take "
                                  "the whole CP group"),
    # instruction data, packing, preference data
    **{flag: (nargs, INSTRUCTION) for flag, nargs in {
        "--prompt-type-path": 1, "--variable-seq-lengths": 0}.items()},
    "--is-pairwise-dataset": (0, DPO),
    # attention and layer variants of other families
    **{flag: (nargs, MLA) for flag, nargs in {
        "--multi-latent-attention": 0, "--q-lora-rank": 1, "--kv-lora-rank": 1, "--qk-head-dim": 1,
        "--qk-pos-emb-head-dim": 1, "--v-head-dim": 1, "--mla-fa-without-pad": 0, "--mla-mm-split": 0,
        "--enable-mla-absorb": 0, "--enable-mla-scale-q-lora": 0, "--enable-mla-scale-kv-lora": 0}.items()},
    **{flag: (nargs, MTP) for flag, nargs in {
        "--mtp-num-layers": 1, "--mtp-loss-scaling-factor": 1, "--mtp-mem-efficient-logits": 0, "--mtp-spec": 2,
        "--index-share-for-mtp-iteration": 0}.items()},
    "--lora-modules-to-save": ("+", LORA_MODULES_TO_SAVE),
    **{flag: (nargs, DSA) for flag, nargs in {
        "--enable-dsa-indexer": 0, "--use-sparse-flash-attn": 0, "--use-fused-lightning-indexer": 0,
        "--use-fused-lightning-indexer-loss": 0, "--index-topk": 1, "--index-n-heads": 1, "--index-head-dim": 1,
        "--index-topk-freq": 1, "--index-skip-topk-offset": 1, "--indexer-loss-coeff": 1,
        "--no-use-sparse-c8-indexer": 0, "--compress-ratios": "+", "--compress-rope-theta": 1,
        "--original-seq-len": 1, "--rope-factor": 1, "--max-batch-size": 1, "--kv-compress": 0, "--o-groups": 1,
        "--o-lora-rank": 1, "--sliding-window-size": 1, "--swiglu-limit": 1, "--apply-rope-no-in-complex": 0}.items()},
    **{flag: (nargs, MHC) for flag, nargs in {
        "--enable-mhc": 0, "--hc-mult": 1, "--use-triton-mhc": 0, "--use-fused-mhc": 0}.items()},
    "--attn-logit-softcapping": (1, "attention logit soft-capping (Gemma 2's attn_logit_softcapping) is not "
                                    "implemented here; MindSpeed-LLM's gemma2 scripts train without it: drop it"),
    "--init-norm-weight-in-fp32": (0, "norm weights kept in fp32 under bf16 are not implemented here"),
    "--add-dense-bias": (0, "a bias on the attention output projection alone is not implemented here; "
                            "--disable-bias-linear off gives every linear its bias"),
    "--add-output-layer-bias": (0, "a bias on the output layer is not implemented here"),
    "--fc-type": (1, "MindSpeed-LLM's alternative MLP layouts (--fc-type) are not implemented here"),
    **{flag: (nargs, ROPE_EXTENSION) for flag, nargs in {
        "--beta-fast": 1, "--beta-slow": 1, "--rope-scaling-mscale": 1, "--rope-scaling-mscale-all-dim": 1,
        "--dynamic-factor": 1, "--use-glm-rope": 0}.items()},
    # recompute, memory switches, schedules
    "--recompute-norm": (0, "MindSpeed's recompute of the norms: " + RECOMPUTE),
    "--swap-optimizer": (0, "MindSpeed's swap of optimizer state to host memory is not implemented here; shard it "
                            "over DP with --use-distributed-optimizer"),
    "--swap-optimizer-times": (1, "MindSpeed's swap of optimizer state to host memory is not implemented here; "
                                  "shard it over DP with --use-distributed-optimizer"),
    "--schedules-method": (1, "MindSpeed's DualPipeV schedule is not implemented here; Megatron's 1F1B (with "
                              "--num-layers-per-virtual-pipeline-stage, interleaved) is"),
    "--disable-gloo-group": (0, "running without Megatron's gloo groups is not implemented here"),
    "--calculate-per-token-loss": (0, "per-token loss normalisation is not implemented here"),
    "--no-shuffle": (0, "unshuffled datasets are not implemented here"),
    # Megatron-LM flags of features not implemented here
    "--train-samples": (1, "sample-based training is not implemented here; give --train-iters"),
    "--rampup-batch-size": ("+", "batch-size ramp-up is not implemented here; give a fixed --global-batch-size"),
    "--async-save": (0, "asynchronous checkpoint saves are not implemented here"),
    "--use-checkpoint-args": (0, "architecture flags from the checkpoint are not implemented here; give them on the "
                                 "command line"),
    "--wandb-project": (1, "W&B logging is not implemented here; use the metrics JSONL (--metrics-file) and the "
                           "loss-curve PNG"),
    "--fp8-format": (1, "fp8 is not implemented here"),
    "--fp8": (1, "fp8 is not implemented here"),
    "--data-args-path": (1, "data paths from a file are not implemented here; give --data-path"),
    "--train-data-path": ("+", "separate split paths are not implemented here; give --data-path with --split"),
    "--valid-data-path": ("+", "separate split paths are not implemented here; give --data-path with --split"),
    "--test-data-path": ("+", "separate split paths are not implemented here; give --data-path with --split"),
    "--lr-decay-samples": (1, "sample-based schedules are not implemented here; give --lr-decay-iters"),
    "--lr-warmup-samples": (1, "sample-based schedules are not implemented here; give --lr-warmup-iters"),
    "--lr-wsd-decay-style": (1, "WSD schedules are not implemented here"),
    "--use-torch-fsdp2": (0, "FSDP is not implemented here; use --use-distributed-optimizer"),
    "--use-megatron-fsdp": (0, "FSDP is not implemented here; use --use-distributed-optimizer"),
    "--num-distributed-optimizer-instances": (1, "more than one distributed-optimizer instance is not implemented "
                                                 "here"),
    "--tp-comm-overlap": (0, "Transformer Engine's TP comm overlap is not used here; the compiler overlaps TP "
                             "collectives itself (--use-ascend-coc)"),
    "--use-tp-pp-dp-mapping": (0, "the tp-pp-dp rank order is not implemented here; the default (tp-cp-ep-dp-pp) is "
                                  "used"),
    "--exit-duration-in-mins": (1, "a time limit is not implemented here; give --exit-interval"),
    "--exit-signal-handler": (0, "exit on a signal is not implemented here; give --exit-interval"),
    "--ckpt-convert-format": (1, "checkpoint format conversion at save is not implemented here; use `npu-compile "
                                 "convert`"),
    "--auto-detect-ckpt-format": (0, "checkpoint format detection is not implemented here; give --ckpt-format"),
}

# Accepted, with no effect here: (argparse keywords, why it changes nothing in this job). Only where that is true.
NO_FUSION = ("Megatron's hand-fused {} kernel is never used here (the job keeps it off and leaves fusion to the "
             "ascend backend's rules)")
NO_EFFECT: dict[str, tuple[dict, str]] = {
    "--use-mcore-models": (dict(action="store_true"), "megatron-core models are the only ones here"),
    "--no-masked-softmax-fusion": (dict(action="store_false", dest="masked_softmax_fusion"),
                                   NO_FUSION.format("scale-mask-softmax")),
    "--no-gradient-accumulation-fusion": (dict(action="store_false", dest="gradient_accumulation_fusion"),
                                          NO_FUSION.format("weight-gradient accumulation")),
    "--no-bias-swiglu-fusion": (dict(action="store_false", dest="bias_swiglu_fusion"), NO_FUSION.format("bias-SwiGLU")),
    "--no-bias-gelu-fusion": (dict(action="store_false", dest="bias_gelu_fusion"), NO_FUSION.format("bias-GeLU")),
    "--no-bias-dropout-fusion": (dict(action="store_false", dest="bias_dropout_fusion"),
                                 NO_FUSION.format("bias-dropout-add")),
    "--no-rope-fusion": (dict(action="store_false", dest="apply_rope_fusion"), NO_FUSION.format("RoPE")),
    "--shape-order": (dict(choices=["SBH", "BSH", "BSND", "BNSD"], default="SBH"),
                      "the input layout of MindSpeed's fused attention; here the backend's attention rule chooses "
                      "the layout of npu_fusion_attention"),
    "--tokenizer-not-use-fast": (dict(action="store_false", dest="tokenizer_use_fast"),
                                 "MindSpeed-LLM's slow (Python) HF tokenizer; transformers 5, which this project "
                                 "requires, has fast tokenizers only (AutoTokenizer ignores use_fast)"),
    "--tokenizer-padding-side": (dict(choices=["left", "right"], default="right"),
                                 "the side instruction batches are padded on; pretraining data is not padded"),
    "--loss-compute-mode": (dict(choices=["default", "chunk"], default="default"),
                            "'default' is the plain cross-entropy this job computes ('chunk' is refused)"),
    "--loss-chunk-size": (dict(type=int, default=1024), "used only by --loss-compute-mode chunk"),
    "--handler-name": (dict(default=""),
                       "MindSpeed-LLM preprocesses at start only a --data-path that names raw data (a .jsonl/.json/"
                       ".parquet/... file or folder); for a .bin/.idx prefix it changes nothing. Raw data is refused "
                       "here: write the prefix with `npu-compile preprocess`"),
    "--workers": (dict(type=int, default=1), "the worker count of that start-time preprocessing (see --handler-name)"),
    "--pack": (dict(action="store_true"),
               "packs the rows of that start-time preprocessing (see --handler-name; MindSpeed-LLM's "
               "dataset_preprocess.py passes it on); write packed rows with `npu-compile preprocess --pack "
               "[--neat-pack] --seq-length N` and train them with --reset-attention-mask [--neat-pack]"),
    "--enable-thinking": (dict(type=str.lower, choices=["true", "false", "none"], default=None),
                          "the thinking switch of that start-time preprocessing (see --handler-name; give it to "
                          "`npu-compile preprocess`); in training MindSpeed-LLM reads it only to cut a sample "
                          "longer than --seq-length, which this job refuses"),
    "--attention-mask-type": (dict(choices=["causal", "general"], default="causal"),
                              "MindSpeed's two ways of computing the same attention mask (its "
                              "docs/zh/features/eod-reset.md:20: equal results): 'causal' its accelerated kernels "
                              "(causal sparse modes; with packed rows under CP, documents padded and split one by "
                              "one), 'general' its baseline over the full mask. Here both give the same attention: "
                              "causal, within each document with --reset-attention-mask, at any "
                              "--context-parallel-size (docs/context_parallel.md)"),
    "--use-triton-gdn": (dict(action="store_true"),
                         "MindSpeed-LLM's choice of its Triton kernel for the chunked gated delta rule over its torch "
                         "one (qwen3_next_gated_deltanet_attention.py:303-308), the same function; here the rule is "
                         "megatron-core's torch_chunk_gated_delta_rule, compiled with the layer by the backend"),
    "--mamba-expand": (dict(type=int, default=1),
                       "the inner-width factor of MindSpeed-LLM's Mamba mixer (mindspeed_llm/core/ssm/mamba_mixer.py:"
                       "25), which is not built here (its spec is refused); Gated DeltaNet layers do not read it"),
    "--no-enable-linear-qkv": (dict(action="store_true"),
                               "MindSpeed-LLM's Qwen3-Next attention projects q (with its gate), k and v by three "
                               "linears in place of linear_qkv (mindspeed_llm/core/transformer/attention.py:96-110, "
                               "qwen3_next_full_attention.py:56-91); here megatron-core's attention with "
                               "attention_output_gate holds the same weights as one linear_qkv: the same products, "
                               "another checkpoint layout. Only with --full-attention-interval"),
    "--norm-topk-prob": (dict(action="store_true"),
                         "MindSpeed-LLM divides the routed top-k probabilities by their sum "
                         "(mindspeed_llm/core/transformer/moe/router.py:560-561, aux_loss routing): megatron-core's "
                         "router has made them sum to 1 already (softmax over the top-k logits; sigmoid scores "
                         "divided by their sum at top-k > 1), so nothing changes; with --moe-router-pre-softmax or "
                         "--moe-router-topk-scaling-factor, where it would, it is refused"),
}

# MindSpeed's switches -> the backend's fusion rules they name (all on by default in the backend).
MINDSPEED_FUSIONS = {
    "use_flash_attn": ("attention",),
    "use_fused_rmsnorm": ("add_rms_norm", "rms_norm"),
    "use_fused_layer_norm": ("add_layer_norm",),
    "use_fused_swiglu": ("swiglu",),
    "use_fused_rotary_pos_emb": ("rotary",),
    # Megatron-LM's --moe-grouped-gemm: megatron-core's GroupedMLP needs the CUDA grouped_gemm package
    # (transformer/moe/experts.py:81), so the job keeps SequentialMLP (moe_grouped_gemm=False) and the flag names the
    # rule that turns its per-expert matmuls into one npu_grouped_matmul (docs/moe.md, "Fusions")
    "moe_grouped_gemm": ("grouped_matmul",),
    # Megatron-LM's --moe-permute-fusion and MindSpeed's --use-fused-moe-token-permute-and-unpermute (one switch
    # there: mindspeed/features_manager/fusions/fused_moe_permute.py): megatron-core's fused permute / unpermute is
    # Transformer Engine's (moe_utils.py permute(fused=True)), so the job keeps moe_permute_fusion=False and the
    # flags name the rules that turn megatron-core's own permute and unpermute into torch_npu's permute ops
    # (docs/moe.md, "Fusions")
    "moe_permute_fusion": ("permute", "unpermute"),
    "use_fused_moe_token_permute_and_unpermute": ("permute", "unpermute"),
    # MindSpeed's async MoE token communication overlapped with compute (the shared expert, the experts' weight
    # gradients): the backend's overlap scheduler, planning with the token counts rule moe_token_hints gives the
    # cost model (docs/moe.md, "Overlap of the token communication")
    "moe_alltoall_overlap_comm": ("moe_token_hints",),
    "moe_permutation_async_comm": ("moe_token_hints",),
}

# MindSpeed-LLM's --spec modules: the ones whose local-layer spec (no experts) is megatron-core's own local layer,
# which the job builds (qk norms as --qk-layernorm says); the others name their family's features.
SPECS_BUILT = {"mindspeed_llm.tasks.models.spec.qwen3_spec": "megatron-core's local GPT layer (q/k norms with "
                                                             "--qk-layernorm)",
               "mindspeed_llm.tasks.models.spec.gemma2_spec": "megatron-core's local GPT layer with Gemma 2's "
                                                              "post-norms (--post-norm) and sliding window "
                                                              "(--interleave-sliding-window)",
               "mindspeed_llm.tasks.models.spec.qwen3_next_spec": "Qwen3-Next's dense hybrid stack: megatron-core's "
                                                                  "GatedDeltaNet layers, every "
                                                                  "--full-attention-interval-th layer its local "
                                                                  "attention with the output gate (megatron-core "
                                                                  "0.16+; docs/linear_attention.md)"}
SPECS_REFUSED = {
    "mindspeed_llm.tasks.models.spec.deepseek_spec": "DeepSeek's layer (" + MLA.split(" is ")[0] + ", MoE)",
    "mindspeed_llm.tasks.models.spec.deepseek4_spec": "DeepSeek-V4's layer (sparse attention, mHC, MoE)",
    "mindspeed_llm.tasks.models.spec.plm_spec": "PLM's layer (MLA, squared ReLU)",
    "mindspeed_llm.tasks.models.spec.bailing_spec": "Bailing / Ling's layer (MoE)",
    "mindspeed_llm.tasks.models.spec.longcat_spec": "LongCat's layer (MoE, zero experts)",
    "mindspeed_llm.tasks.models.spec.minimax_spec": "MiniMax's layer (MoE)",
    "mindspeed_llm.tasks.models.spec.phi35_moe_spec": "Phi-3.5-MoE's layer (MoE)",
    "mindspeed_llm.tasks.models.spec.qwen2_moe_spec": "Qwen2-MoE's layer (MoE)",
    "mindspeed_llm.tasks.models.spec.mamba_spec": "Mamba's layer (linear attention)",
    "mindspeed_llm.tasks.models.spec.grok_spec": "Grok's layer (MoE)",
    "mindspeed_llm.tasks.models.spec.hunyuan_spec": "Hunyuan's layer (MoE)",
    "mindspeed_llm.tasks.models.spec.minicpm_spec": "MiniCPM's layer (scaled residuals)",
}
# Values of implemented flags whose feature is not: value -> what is missing
POSITION_EMBEDDINGS_REFUSED = {
    "mrope": "multimodal RoPE (mrope) is not implemented here",
    "relative": "relative position embeddings are not implemented here",
    "none": "models without position embeddings are not implemented here",
    "deepseek4": "DeepSeek-V4's position embedding is not implemented here",
}
TOKENIZERS_REFUSED = {
    name: f"the {name} is not implemented here" for name in (
        "BertWordPieceLowerCase", "BertWordPieceCase", "SentencePieceTokenizer", "GPTSentencePieceTokenizer",
        "Llama2Tokenizer", "TikTokenizer", "MultimodalTokenizer", "NullMultimodalTokenizer")}
# MindSpeed-LLM's --model-type-hf names spelled differently by the converter (megatron_glue.convert.families)
HF_MODEL_TYPE_ALIASES = {"qwen25": "qwen2.5"}
# Raw data MindSpeed-LLM preprocesses at start (mindspeed_llm/tasks/preprocess/data_handler.py `_get_data_format`)
RAW_DATA_SUFFIXES = (".jsonl", ".json", ".parquet", ".txt", ".csv", ".arrow")
PRETRAIN_HANDLERS = ("GeneralPretrainHandler",)
# taken with --is-instruction-dataset (megatron_glue.posttrain_gpt)
INSTRUCTION_HANDLERS = ("AlpacaStyleInstructionHandler", "SharegptStyleInstructionHandler")
# megatron-core's Llama 3 RoPE scaling (rotary_pos_embedding.py `_apply_scaling`): its fixed parameters
LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def _floats(text: str) -> list[float]:
    """MindSpeed-LLM's comma-separated factor lists (--long-factor 1.0,1.02,...)."""
    try:
        return [float(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not comma-separated numbers") from None


def _check_mg2hf(args, fail) -> None:
    """MindSpeed-LLM's rules for --enable-mg2hf-convert (mindspeed_llm/features_manager/convert_checkpoint/
    convert_checkpoint.py:147-154), and the saves it converts (mindspeed_llm/training/training.py:827-840: those of
    the training loop, every --save-interval iterations)."""
    if not args.enable_mg2hf_convert:
        for flag in ("--only-convert-last-checkpoint", "--hf-save-dir"):
            if getattr(args, flag[2:].replace("-", "_")):
                fail(f"{flag} says which saves --enable-mg2hf-convert converts, and where; give "
                     "--enable-mg2hf-convert with it, or drop it")
        return
    if not args.save:
        fail("--enable-mg2hf-convert needs --save: it converts the checkpoints the job saves there")
    if not args.save_interval:
        fail("--enable-mg2hf-convert converts the checkpoints the training loop saves every --save-interval "
             "iterations; give --save-interval")
    if args.only_convert_last_checkpoint and args.train_iters % args.save_interval:
        fail(f"--only-convert-last-checkpoint converts the save at iteration --train-iters {args.train_iters}, which "
             f"the training loop makes only when --save-interval divides it ({args.save_interval} does not)")
    if args.enable_hf2mg_convert and not args.hf_cfg_dir:
        args.hf_cfg_dir = args.load  # MindSpeed-LLM's default: the HF folder the job started from
    if not args.hf_cfg_dir:
        fail("--enable-mg2hf-convert needs --hf-cfg-dir, the HF folder whose config.json the exported folders get "
             "(transformers cannot load weights without it); with --enable-hf2mg-convert it is --load")


def _check_sliding_window(args, fail) -> None:
    from megatron_glue.capture.adaptations import megatron_core_in, megatron_core_version

    window = args.interleave_sliding_window
    if window < 1:
        fail(f"--interleave-sliding-window {window} must be >= 1")
    if not megatron_core_in(">=0.15"):
        fail(f"--interleave-sliding-window needs megatron-core 0.15 or later (its local attention's window_size); "
             f"this is {megatron_core_version()}")
    if args.reset_attention_mask:
        fail("--interleave-sliding-window with --reset-attention-mask is not implemented here (megatron-core's "
             "local attention builds the window's mask in place of the documents' one); drop one of them")


def _partial_rotary(args, fail) -> None:
    """MindSpeed-LLM's --partial-rotary-factor F as megatron-core's rotary_percent: its rotary embedding is built for
    int(head_dim x F) channels (mindspeed_llm/core/models/common/embeddings/rotary_pos_embedding.py:85-87), as
    megatron-core's is for int(kv_channels x rotary_percent)."""
    factor = args.partial_rotary_factor
    if not 0 < factor <= 1:
        fail(f"--partial-rotary-factor {factor:g} must be in (0, 1]: the share of each head's channels RoPE rotates")
    if args.rotary_percent not in (1.0, factor):
        fail(f"--partial-rotary-factor {factor:g} and --rotary-percent {args.rotary_percent:g} both set the rotated "
             "share of each head and disagree; give one of them")
    args.rotary_percent = factor


def _linear_attention_refusals(args) -> list[str]:
    """The features Gated DeltaNet layers do not combine with here, one line each (refusals, with the others)."""
    from megatron_glue.capture.adaptations import megatron_core_in, megatron_core_version

    if args.full_attention_interval is None:
        return []
    flag = f"--full-attention-interval {args.full_attention_interval}"
    if not megatron_core_in(">=0.16"):
        return [refusal(flag, f"Gated DeltaNet layers need megatron-core 0.16 or later (its "
                              f"megatron.core.ssm.gated_delta_net); this is {megatron_core_version()}: install "
                              "megatron-core>=0.16 (this project's extras pin 0.16.1)")]
    lines = []
    if args.num_experts:
        lines.append(refusal(f"--num-experts {args.num_experts}", LINEAR_ATTENTION.format(
            "MoE (Qwen3-Next's MoE layers)") + "; train the dense hybrid stack (no --num-experts)"))
    if args.context_parallel_size > 1:
        lines.append(refusal(f"--context-parallel-size {args.context_parallel_size}", LINEAR_ATTENTION.format(
            "context parallelism") + ": megatron-core's GatedDeltaNet has none (ssm/gated_delta_net.py:223; "
            "transformer_config.py:982-986 asserts CP 1); use --context-parallel-size 1"))
    if args.reset_attention_mask:
        lines.append(refusal("--reset-attention-mask", LINEAR_ATTENTION.format("packing documents") + ": "
                             "megatron-core's GatedDeltaNet raises on packed sequences and reads no attention mask "
                             "(ssm/gated_delta_net.py:280,295-297), so its recurrent state would run across "
                             "documents; train unpacked rows"))
    if args.tensor_model_parallel_size > 1:
        lines.append(refusal(f"--tensor-model-parallel-size {args.tensor_model_parallel_size}",
                             LINEAR_ATTENTION.format("tensor parallelism") + " (not verified against TP 1; "
                             "MindSpeed-LLM refuses it too: qwen3_next_gated_deltanet_attention.py:218-221); use "
                             "--tensor-model-parallel-size 1 and data or pipeline parallelism"))
    return lines


def _check_linear_attention(args, fail) -> None:
    """Gated DeltaNet's sizes as megatron-core checks them (transformer_config.py:948-980), each as a flag."""
    if args.full_attention_interval is None:
        fail("--no-enable-linear-qkv goes with Qwen3-Next's layers (--full-attention-interval N, --spec "
             "mindspeed_llm.tasks.models.spec.qwen3_next_spec layer_spec): without them MindSpeed-LLM's attention "
             "has no q/k/v projection at all")
    if args.full_attention_interval < 1:
        fail(f"--full-attention-interval {args.full_attention_interval} must be >= 1 (every N-th layer full "
             "attention; 1: every layer)")
    sizes = {"--linear-key-head-dim": args.linear_key_head_dim, "--linear-value-head-dim": args.linear_value_head_dim,
             "--linear-num-key-heads": args.linear_num_key_heads,
             "--linear-num-value-heads": args.linear_num_value_heads}
    missing = [f for f, v in sizes.items() if v is None or v < 1]
    if missing:
        fail(f"--full-attention-interval needs the Gated DeltaNet sizes {', '.join(missing)} (each >= 1)")
    if args.linear_num_value_heads % args.linear_num_key_heads:
        fail(f"--linear-num-value-heads {args.linear_num_value_heads} is not a multiple of --linear-num-key-heads "
             f"{args.linear_num_key_heads} (each key head serves value heads / key heads of them)")
    for flag, value in (("--mamba-d-conv", args.mamba_d_conv), ("--mamba-chunk-size", args.mamba_chunk_size)):
        if value < 1:
            fail(f"{flag} {value} must be >= 1")
    if not args.swiglu:
        fail("--full-attention-interval needs --swiglu: megatron-core's GatedDeltaNet applies the MLP's activation "
             "to its convolution and output gate (ssm/gated_delta_net.py:126,327,419), which Qwen3-Next's are SiLU "
             "(MindSpeed-LLM's qwen3_next_gated_deltanet_attention.py:42,235,410)")


def _check_longrope(args, fail) -> None:
    """LongRoPE's flags together, each factor list one per rotary frequency (MindSpeed-LLM's rotary.py
    validate_args, and the length its inv_freq division needs)."""
    if args.rope_scaling_original_max_position_embeddings is None or args.long_factor is None \
            or args.short_factor is None:
        fail("--rope-scaling-type longrope needs --rope-scaling-original-max-position-embeddings, --long-factor and "
             "--short-factor")
    if (args.long_mscale is None) != (args.short_mscale is None):
        fail("--long-mscale and --short-mscale go together (LongRoPE's cos/sin scale for long and short sequences)")
    head = args.kv_channels or args.hidden_size // args.num_attention_heads
    if args.rotary_percent != 1.0:
        fail(f"--rope-scaling-type longrope with --rotary-percent {args.rotary_percent:g} is not implemented here "
             "(LongRoPE's scale applies to the rotated channels only); use --rotary-percent 1")
    for flag, factors in (("--long-factor", args.long_factor), ("--short-factor", args.short_factor)):
        if len(factors) != head // 2:
            fail(f"{flag} has {len(factors)} factors; LongRoPE needs one per rotary frequency: {head // 2} "
                 f"(kv-channels {head} / 2)")


class ArgumentError(SystemExit):
    """A bad command line: one line naming what was wrong and what would be right (exit status 2)."""

    def __init__(self, message: str):
        self.message = message
        super().__init__(2)

    def __str__(self):
        return self.message


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser whose own errors (unknown flag, bad value) are ArgumentError's one line; the converter's
    command line uses it too."""

    def error(self, message):  # argparse's own errors (unknown flag, bad value) in the same one-line form
        raise ArgumentError(f"{self.prog}: error: {message}")


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="python -m megatron_glue.pretrain_gpt", allow_abbrev=False,
                       description="Megatron-LM GPT pretraining on megatron-core, each transformer layer compiled "
                                   "with torch.compile(backend='ascend').")

    g = p.add_argument_group("network size")
    g.add_argument("--num-layers", type=int, required=True)
    g.add_argument("--hidden-size", type=int, required=True)
    g.add_argument("--ffn-hidden-size", type=int, default=None,
                   help="default 4 x hidden (with --swiglu 8/3 x, rounded down to a multiple of 64)")
    g.add_argument("--num-attention-heads", type=int, required=True)
    g.add_argument("--kv-channels", type=int, default=None, help="default hidden / heads")
    g.add_argument("--group-query-attention", action="store_true")
    g.add_argument("--num-query-groups", type=int, default=1)
    g.add_argument("--max-position-embeddings", type=int, default=None)
    g.add_argument("--position-embedding-type", choices=["learned_absolute", "rope", *POSITION_EMBEDDINGS_REFUSED],
                   default="learned_absolute", help="learned_absolute or rope; the others are refused")
    g.add_argument("--use-rotary-position-embeddings", action="store_true",
                   help="Megatron-LM's older spelling of --position-embedding-type rope")
    g.add_argument("--rotary-base", type=int, default=10000)
    g.add_argument("--rotary-percent", type=float, default=1.0)
    g.add_argument("--use-rope-scaling", action="store_true", help="Llama 3.1's RoPE frequency scaling")
    g.add_argument("--rope-scaling-factor", type=float, default=8.0)
    g.add_argument("--rope-scaling-type", choices=["llama3", "yarn", "longrope", "plm"], default=None,
                   help="MindSpeed-LLM's RoPE scaling: llama3 is --use-rope-scaling (megatron-core's Llama 3 scaling, "
                        "with its fixed --low-freq-factor 1, --high-freq-factor 4, --original-max-position-embeddings "
                        "8192); longrope is Phi-3's LongRoPE (--long-factor, --short-factor, "
                        "--rope-scaling-original-max-position-embeddings); yarn and plm are refused")
    g.add_argument("--rope-scaling-original-max-position-embeddings", type=int, default=None,
                   help="LongRoPE: the pretraining context; --seq-length above it takes --long-factor, else "
                        "--short-factor")
    g.add_argument("--long-factor", type=_floats, default=None,
                   help="LongRoPE: comma-separated divisors of the rotary frequencies, one per frequency (kv-channels "
                        "/ 2), for sequences longer than the original context")
    g.add_argument("--short-factor", type=_floats, default=None, help="LongRoPE: the same, for shorter sequences")
    g.add_argument("--longrope-freqs-type", choices=["mul", "outer"], default="mul",
                   help="LongRoPE: how MindSpeed-LLM divides the frequencies (outer: 1 / (factor x base^(2i/d)), as "
                        "transformers' Phi-3; mul: position / factor x the frequency); the same product, rounded "
                        "in another order")
    g.add_argument("--long-mscale", type=float, default=None,
                   help="LongRoPE: the cos/sin scale for long sequences (with --short-mscale; default "
                        "sqrt(1 + ln(max-position-embeddings / original) / ln(original)))")
    g.add_argument("--short-mscale", type=float, default=None, help="LongRoPE: the same, for shorter sequences")
    g.add_argument("--low-freq-factor", type=float, default=None, help="with --rope-scaling-type llama3: 1 here")
    g.add_argument("--high-freq-factor", type=float, default=None, help="with --rope-scaling-type llama3: 4 here")
    g.add_argument("--original-max-position-embeddings", type=float, default=None,
                   help="with --rope-scaling-type llama3: 8192 here")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    g.add_argument("--normalization", choices=["LayerNorm", "RMSNorm"], default="LayerNorm")
    g.add_argument("--norm-epsilon", type=float, default=1e-5)
    g.add_argument("--swiglu", action="store_true")
    g.add_argument("--openai-gelu", action="store_true", help="the tanh approximation of GeLU (GPT-2's gelu_new)")
    g.add_argument("--gelu-tanh", action="store_true",
                   help="MindSpeed-LLM's: a gated MLP (GLU, fc1 [gate; up]) with the tanh GeLU on the gate (Gemma's "
                        "GeGLU)")
    g.add_argument("--query-pre-attn-scalar", type=int, default=None,
                   help="MindSpeed-LLM's: attention scores scaled by 1 / sqrt(this) instead of 1 / sqrt(kv-channels) "
                        "(Gemma 2's query_pre_attn_scalar)")
    g.add_argument("--input-embeds-norm", action="store_true",
                   help="MindSpeed-LLM's: the decoder's input (the embeddings, after their dropout) times "
                        "sqrt(hidden-size) in its dtype (Gemma's normalizer)")
    g.add_argument("--output-logit-softcapping", type=float, default=None,
                   help="MindSpeed-LLM's: logits = cap x tanh(logits / cap) before the loss (Gemma 2's final "
                        "soft-capping)")
    g.add_argument("--post-norm", action="store_true",
                   help="MindSpeed-LLM's (Gemma 2): a norm (--normalization, with --add-rmsnorm-offset's offset) on "
                        "the attention output and one on the MLP output, each before its residual add "
                        "(post_attn_norm, post_mlp_layernorm)")
    g.add_argument("--interleave-sliding-window", type=int, default=None, metavar="W",
                   help="MindSpeed-LLM's (Gemma 2): layers 1, 3, 5, ... (1-based, as MindSpeed-LLM's "
                        "TransformerLayerWithPostNorm and transformers' Gemma2) attend to the W latest positions, "
                        "themselves included; the others to all earlier ones (megatron-core's window_size (W-1, 0) "
                        "with window_attn_skip_freq 2)")
    g.add_argument("--squared-relu", action="store_true",
                   help="the MLP activation relu(x)^2 (Megatron-LM's, megatron-core's activations.squared_relu)")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--disable-bias-linear", action="store_false", dest="add_bias_linear")
    g.add_argument("--add-qkv-bias", action="store_true")
    g.add_argument("--qk-layernorm", action="store_true",
                   help="a norm (--normalization) on each head's query and key before attention (megatron-core's "
                        "q_layernorm / k_layernorm; Qwen3)")
    g.add_argument("--add-rmsnorm-offset", action="store_true",
                   help="MindSpeed-LLM's RMSNorm with a unit offset (Gemma / Qwen3-Next): every RMSNorm weight w is "
                        "stored as gamma - 1 and applied as 1 + w, zero at init (megatron-core's "
                        "layernorm_zero_centered_gamma)")
    g.add_argument("--rmsnorm-weight-in-fp32", action="store_true",
                   help="MindSpeed-LLM's: with --add-rmsnorm-offset, 1 + w is formed in fp32 and the normalized "
                        "activations are multiplied by it in fp32 under bf16/fp16; without the offset it changes "
                        "nothing here: torch's RMSNorm, which the local layers use, multiplies by its weight in "
                        "fp32 already")
    g.add_argument("--attention-softmax-in-fp32", action="store_true",
                   help="bf16/fp16 attention scores masked and soft-maxed in fp32 (megatron-core's "
                        "attention_softmax_in_fp32). Where the backend fuses attention (npu_fusion_attention, "
                        "--use-flash-attn) the softmax is in fp32 either way")
    g.add_argument("--transformer-impl", choices=["local", "transformer_engine"], default="local",
                   help="local: megatron-core's own layers, the only ones here (transformer_engine is refused: "
                        "Transformer Engine is CUDA-only)")
    g.add_argument("--spec", nargs="*", default=None, metavar="MODULE NAME",
                   help="a layer spec by module and name; MindSpeed-LLM's "
                        + ", ".join(f"{m} ({what})" for m, what in SPECS_BUILT.items())
                        + " is built; its other specs are refused, naming their features")

    g = p.add_argument_group("linear attention (Qwen3-Next's Gated DeltaNet: megatron-core 0.16's GatedDeltaNet; "
                             "docs/linear_attention.md)")
    g.add_argument("--full-attention-interval", type=int, default=None, metavar="N",
                   help="Gated DeltaNet layers, every N-th layer (1-based: N, 2N, ...) full attention with "
                        "Qwen3-Next's output gate, as MindSpeed-LLM's qwen3_next_spec builds them (TransformerConfig "
                        "experimental_attention_variant 'gated_delta_net', linear_attention_freq N, "
                        "attention_output_gate); needs --swiglu and the four --linear-* sizes")
    g.add_argument("--linear-key-head-dim", type=int, default=None,
                   help="the Gated DeltaNet query/key head size (TransformerConfig linear_key_head_dim)")
    g.add_argument("--linear-value-head-dim", type=int, default=None,
                   help="the Gated DeltaNet value/gate head size (TransformerConfig linear_value_head_dim)")
    g.add_argument("--linear-num-key-heads", type=int, default=None,
                   help="the Gated DeltaNet query/key heads (TransformerConfig linear_num_key_heads)")
    g.add_argument("--linear-num-value-heads", type=int, default=None,
                   help="the Gated DeltaNet value/gate heads, a multiple of --linear-num-key-heads (TransformerConfig "
                        "linear_num_value_heads)")
    g.add_argument("--mamba-d-conv", type=int, default=4,
                   help="the kernel width of the Gated DeltaNet's causal convolution over q, k, v (TransformerConfig "
                        "linear_conv_kernel_dim; MindSpeed-LLM's default 4)")
    g.add_argument("--mamba-chunk-size", type=int, default=256,
                   help="the chunk length of the chunked gated delta rule (megatron-core's "
                        "torch_chunk_gated_delta_rule, compiled into the layer's graph); the same function at any "
                        "length, which sets the size of the chunk's triangular solve (MindSpeed-LLM's default 256)")
    g.add_argument("--partial-rotary-factor", type=float, default=None, metavar="F",
                   help="RoPE on the first F x kv-channels channels of each head, the rest passed through "
                        "(MindSpeed-LLM's, Qwen3-Next's partial_rotary_factor): megatron-core's rotary_percent F, "
                        "the same as --rotary-percent F")

    g = p.add_argument_group("regularization")
    g.add_argument("--attention-dropout", type=float, default=0.1)
    g.add_argument("--hidden-dropout", type=float, default=0.1)
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)

    g = p.add_argument_group("activation recompute (Megatron-LM's meanings; see docs/recompute.md)")
    g.add_argument("--recompute-activations", action="store_true",
                   help="the same as --recompute-granularity selective")
    g.add_argument("--recompute-granularity", choices=["full", "selective"], default=None,
                   help="full: checkpoint whole transformer layers (Megatron's own checkpointing around the compiled "
                        "layers; needs --recompute-method and --recompute-num-layers); selective: core attention, "
                        "which the backend's fused attention recomputes in its backward")
    g.add_argument("--recompute-method", choices=["uniform", "block"], default=None,
                   help="uniform: every layer, in chunks of --recompute-num-layers checkpointed together; block: "
                        "only the first --recompute-num-layers layers of each pipeline stage")
    g.add_argument("--recompute-num-layers", type=int, default=None,
                   help="layers per checkpointed chunk (uniform), or layers recomputed per pipeline stage (block)")
    g.add_argument("--recompute-activation-function", action="store_true",
                   help="MindSpeed's: the MLP activation's output (GeLU / SwiGLU) is not saved for the backward but "
                        "computed again from its input; in the compiled job the backend's fused activation ops are "
                        "marked must-recompute in every layer graph (npu_compile option recompute: [\"activation\"]); "
                        "not with --recompute-granularity selective or --recompute-method uniform (MindSpeed's rules)")

    g.add_argument("--swap-attention", action="store_true",
                   help="MindSpeed's: the activations the --swap-modules of every layer save for the backward are "
                        "copied to host memory after their forward and prefetched back before their backward; in "
                        "the compiled job the backend's option offload (docs/offload.md)")
    g.add_argument("--swap-modules", default=None,
                   help="with --swap-attention: comma-separated module names (default MindSpeed's "
                        f"\"{SWAP_MODULES_DEFAULT}\"); MindSpeed's input_norm / post_attention_norm mean "
                        "megatron-core's input_layernorm / pre_mlp_layernorm")

    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, default=None)
    g.add_argument("--global-batch-size", type=int, default=None)
    g.add_argument("--train-iters", type=int, default=None)
    g.add_argument("--exit-interval", type=int, default=None, help="exit after the iteration divisible by this")
    g.add_argument("--skip-train", action="store_true", help="no training: load, evaluate, exit")
    g.add_argument("--no-check-for-nan-in-loss-and-grad", action="store_false", dest="check_for_nan_in_loss_and_grad")
    g.add_argument("--optimizer", choices=["adam", "sgd"], default="adam")

    g = p.add_argument_group("initialization")
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--init-method-std", type=float, default=0.02)

    g = p.add_argument_group("learning rate")
    g.add_argument("--lr", type=float, default=None)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--lr-decay-style", choices=["constant", "linear", "cosine", "inverse-square-root"], default="linear")
    g.add_argument("--lr-decay-iters", type=int, default=None)
    g.add_argument("--lr-warmup-fraction", type=float, default=None)
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--lr-warmup-init", type=float, default=0.0)

    g = p.add_argument_group("checkpointing")
    g.add_argument("--save", default=None)
    g.add_argument("--save-interval", type=int, default=None)
    g.add_argument("--load", default=None)
    g.add_argument("--no-load-optim", action="store_true")
    g.add_argument("--no-load-rng", action="store_true")
    g.add_argument("--no-save-optim", action="store_true")
    g.add_argument("--no-save-rng", action="store_true")
    g.add_argument("--finetune", action="store_true", help="load model weights only; iteration starts at 0")
    g.add_argument("--enable-hf2mg-convert", action="store_true",
                   help="--load is a HuggingFace folder: rank 0 converts it (`npu-compile convert`) into "
                        "<load>/megatron_cache_tp{TP}pp{PP}_{--ckpt-format} once, every rank waits, and the job "
                        "starts from those weights (MindSpeed-LLM's meaning)")
    g.add_argument("--model-type-hf", default=None,
                   help="with --enable-hf2mg-convert: the HF family (MindSpeed-LLM's names; default: config.json's "
                        "model_type); a family the converter lacks, or a folder of another family, is refused "
                        "before the job starts")
    # MindSpeed-LLM's Megatron -> HF export at save (megatron_glue.convert.at_save, docs/convert.md)
    g.add_argument("--enable-mg2hf-convert", action="store_true",
                   help="after each checkpoint the training loop saves every --save-interval iterations, rank 0 "
                        "converts it (`npu-compile convert`) into <--hf-save-dir or --save>/mg2hf_iteration{N}, a "
                        "folder transformers loads, every rank waiting (MindSpeed-LLM's meaning)")
    g.add_argument("--only-convert-last-checkpoint", action="store_true",
                   help="with --enable-mg2hf-convert: convert only the save at iteration --train-iters")
    g.add_argument("--hf-save-dir", default=None,
                   help="with --enable-mg2hf-convert: the folder the mg2hf_iteration{N} folders go in (default --save)")
    g.add_argument("--hf-cfg-dir", default=None,
                   help="with --enable-mg2hf-convert: the HF folder whose config.json (and tokenizer files) the "
                        "exported folders get (default with --enable-hf2mg-convert: --load); alone it changes "
                        "nothing, as in MindSpeed-LLM")
    g.add_argument("--mg-save-dir", default=None,
                   help="with --enable-hf2mg-convert: the folder the converted weights go in (default "
                        "<load>/megatron_cache_tp{TP}pp{PP}_{--ckpt-format})")
    g.add_argument("--exit-on-missing-checkpoint", action="store_true",
                   help="with --load: stop when there is no checkpoint there, instead of starting from random weights")
    g.add_argument("--ckpt-format", choices=["torch_dist", "torch"], default="torch_dist")

    g = p.add_argument_group("mixed precision")
    g.add_argument("--fp16", action="store_true")
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--loss-scale", type=float, default=None, help="static loss scale (fp16); default dynamic")
    g.add_argument("--initial-loss-scale", type=float, default=2 ** 32)
    g.add_argument("--min-loss-scale", type=float, default=1.0)
    g.add_argument("--loss-scale-window", type=float, default=1000)
    g.add_argument("--hysteresis", type=int, default=2)
    g.add_argument("--accumulate-allreduce-grads-in-fp32", action="store_true",
                   help="gradients accumulated and reduced in fp32 (with --bf16 the default, as in Megatron-LM)")
    g.add_argument("--grad-reduce-in-bf16", action="store_true",
                   help="Megatron-LM's: with --bf16, gradients accumulated and reduced in bf16 (megatron-core's DDP "
                        "gradient buffer in the parameters' dtype) instead of fp32")
    g.add_argument("--o2-gradient", action="store_true",
                   help="MindSpeed-LLM's O2 half-precision gradients: --grad-reduce-in-bf16 (2 bytes x parameters "
                        "less); needs --bf16 (megatron_glue/training/o2.py)")
    g.add_argument("--o2-optimizer", action="store_true",
                   help="MindSpeed-LLM's O2 half-precision optimizer: Adam's two moments kept in bf16 between steps, "
                        "each step computed in fp32 by torch's Adam (4 bytes x parameters / DP less with "
                        "--use-distributed-optimizer); needs --bf16 and --optimizer adam (megatron_glue/training/o2.py)")
    g.add_argument("--reuse-fp32-param", action="store_true",
                   help="MindSpeed's: the fp32 master weights share the bf16 weights' memory (each kept as its bf16 "
                        "rounding, the model weight, plus a 16-bit residual), saving 2 bytes x parameters / DP per "
                        "rank, with megatron-core's numerics bit for bit; needs --bf16 and "
                        "--use-distributed-optimizer (docs/mindspeed_dialect.md)")

    g = p.add_argument_group("distributed")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None)
    g.add_argument("--num-layer-list", default=None, metavar="N,N,...",
                   help="MindSpeed-LLM's uneven pipeline stages: the transformer layers of each stage, comma-separated "
                        "(one per stage, summing to --num-layers; not with virtual stages). Built with megatron-core's "
                        "own uneven stages: num_layers_in_first/last_pipeline_stage where the stages between are "
                        "equal, else (megatron-core 0.16) pipeline_model_parallel_layout")
    g.add_argument("--noop-layers", default=None, metavar="I,I,...",
                   help="MindSpeed's empty layers: the 0-based global indices of layers that pass their input through "
                        "(no parameters, not compiled), so that --num-layers divides the pipeline; the FLOPs of "
                        "--log-throughput and the MoE losses' mean count the real layers only "
                        "(megatron_glue/training/noop_layers.py)")
    g.add_argument("--sequence-parallel", action="store_true")
    g.add_argument("--distributed-backend", choices=["nccl", "gloo", "hccl"], default="nccl",
                   help="nccl: the machine's accelerator backend, as torch_npu makes it mean (hccl on an Ascend NPU, "
                        "nccl on CUDA; on a machine with neither, gloo, said in the log); hccl: Ascend; gloo: CPU")
    g.add_argument("--context-parallel-size", type=int, default=1,
                   help="context parallelism: each sequence split over this many ranks (megatron-core's chunking, "
                        "RoPE and gradient groups; the attention by --context-parallel-algo: docs/context_parallel.md)")
    g.add_argument("--context-parallel-algo", default="ulysses_cp_algo",
                   choices=["ulysses_cp_algo", "megatron_cp_algo", *CP_ALGORITHMS],
                   help="MindSpeed's context-parallel attention: ulysses_cp_algo (all-to-all from sequence to heads "
                        "around the ordinary attention) or megatron_cp_algo (ring attention, Megatron's load-balanced "
                        "chunks); the others are refused above size 1 (at size 1 none runs, as in MindSpeed)")
    g.add_argument("--cp-window-size", type=int, default=1,
                   help="MindSpeed's double-ring window for megatron_cp_algo: 1 (one ring) only")
    g.add_argument("--use-cp-send-recv-overlap", action="store_true",
                   help="MindSpeed's overlap of the ring's K/V exchange with each step's attention: what this job's "
                        "ring always does (the next exchange is issued before the step's attention: eagerly an "
                        "asynchronous functional collective, compiled one the backend's comm scheduling places)")
    g.add_argument("--cp-attention-mask-type", choices=["causal", "general"], dest="attention_mask_type",
                   default=argparse.SUPPRESS,
                   help="MindSpeed-LLM's deprecated spelling of --attention-mask-type (its deprecated_args.py)")
    g.add_argument("--distributed-timeout-minutes", type=int, default=10)
    g.add_argument("--use-distributed-optimizer", action="store_true")
    g.add_argument("--overlap-grad-reduce", action="store_true")
    g.add_argument("--overlap-param-gather", action="store_true")
    g.add_argument("--ddp-bucket-size", type=int, default=None)
    g.add_argument("--local-rank", "--local_rank", type=int, default=None,
                   help="this process's device index, set by older launchers (torchrun sets $LOCAL_RANK)")
    g.add_argument("--no-bind-cores", action="store_false", dest="bind_cores",
                   help="leave each rank's CPU affinity alone (default: bound to the cores of its device's NUMA "
                        "node, disjoint per local rank; see docs/operating.md)")

    g = p.add_argument_group("validation")
    g.add_argument("--eval-iters", type=int, default=100)
    g.add_argument("--eval-interval", type=int, default=1000)

    g = p.add_argument_group("data and dataloader")
    g.add_argument("--data-path", nargs="*", default=None, help="prefix, or weight prefix weight prefix ...")
    g.add_argument("--mock-data", action="store_true")
    g.add_argument("--split", default=None, help="train,valid,test weights; default 969,30,1")
    g.add_argument("--data-cache-path", default=None)
    # MindSpeed-LLM's posttrain_gpt.py instruction tuning (megatron_glue.posttrain_gpt, docs/instruction_tuning.md)
    g.add_argument("--stage", default=None, help="post-training stage; sft with megatron_glue.posttrain_gpt")
    g.add_argument("--is-instruction-dataset", action="store_true",
                   help="--data-path names instruction data (npu-compile preprocess --handler-name "
                        "AlpacaStyleInstructionHandler)")
    g.add_argument("--prompt-type", default=None, help="the prompt template the data was written with")
    g.add_argument("--neat-pack", action="store_true",
                   help="with --reset-attention-mask: the documents of a packed row are the ones its attention mask "
                        "numbers (data from npu-compile preprocess --pack --neat-pack), not the eos tokens")
    g.add_argument("--no-pad-to-seq-lengths", action="store_true",
                   help="each instruction micro-batch as long as its longest sample, rounded up to "
                        "--pad-to-multiple-of (compiled: dynamic shapes, one more graph per layer kind)")
    g.add_argument("--pad-to-multiple-of", type=int, default=None,
                   help="with --no-pad-to-seq-lengths: the multiple batches are rounded up to (MindSpeed-LLM's "
                        "default 8)")
    g.add_argument("--padded-samples", action="store_true",
                   help="each epoch of instruction samples filled up to a multiple of --global-batch-size with the "
                        "first documents (MindSpeed-LLM's, aligned with LLaMA-Factory)")
    g.add_argument("--num-workers", type=int, default=0,
                   help="data loader worker processes (default 0 here: the loader reads in the training process; "
                        "Megatron-LM's default is 2)")
    g.add_argument("--dataloader-type", choices=["single", "cyclic", "external"], default="single",
                   help="single: each sample once, in order, from where the job left off (Megatron-LM's cyclic and "
                        "external loaders are refused)")
    g.add_argument("--no-shared-storage", action="store_true",
                   help="MindSpeed-LLM: the nodes share no file system. On one node (all this job's processes on one "
                        "machine) it changes nothing; across nodes it is refused (the dataset index would be built "
                        "by rank 0 only)")
    g.add_argument("--reset-position-ids", action="store_true",
                   help="position ids restart after each end-of-document token (megatron-core's GPTDataset)")
    g.add_argument("--reset-attention-mask", action="store_true",
                   help="each token attends within its own document only (documents end at end-of-document "
                        "tokens); compiled, the attention takes the documents' lengths (varlen_attention, "
                        "npu_fusion_attention TND) and no s x s mask: docs/packed_sequences.md")
    g.add_argument("--eod-mask-loss", action="store_true",
                   help="no loss on end-of-document tokens (megatron-core's GPTDataset)")
    g.add_argument("--seq-length", type=int, required=True)
    g.add_argument("--vocab-file", default=None)
    g.add_argument("--merge-file", default=None)
    g.add_argument("--tokenizer-type", choices=["GPT2BPETokenizer", "HuggingFaceTokenizer", "PretrainedFromHF",
                                                "NullTokenizer", "MagistralTokenizer", *TOKENIZERS_REFUSED],
                   default=None,
                   help="GPT2BPETokenizer, HuggingFaceTokenizer, PretrainedFromHF (MindSpeed-LLM's: "
                        "HuggingFaceTokenizer read from --tokenizer-name-or-path), NullTokenizer or "
                        "MagistralTokenizer (MindSpeed-LLM's: Mistral's tekken.json as --tokenizer-model); the "
                        "others are refused")
    g.add_argument("--tokenizer-model", default=None)
    g.add_argument("--tokenizer-name-or-path", default=None,
                   help="PretrainedFromHF's tokenizer: a local directory written by save_pretrained (no hub downloads)")
    g.add_argument("--padded-vocab-size", type=int, default=None,
                   help="the model's embedding rows, as given (default: the tokenizer's vocabulary padded to a "
                        "multiple of --make-vocab-size-divisible-by x TP)")
    g.add_argument("--vocab-size", type=int, default=None,
                   help="NullTokenizer's vocabulary (ids; eod is this id); with a tokenizer with files, the model's "
                        "vocabulary when its embedding has more rows than the tokenizer has tokens")

    g = p.add_argument_group("logging")
    g.add_argument("--log-interval", type=int, default=100)
    g.add_argument("--log-throughput", action="store_true",
                   help="log Megatron-LM's model TFLOP/s per device in each iteration line")
    g.add_argument("--manual-gc", action="store_true",
                   help="Python's automatic garbage collection off; collected at the start, every "
                        "--manual-gc-interval iterations, and around each evaluation")
    g.add_argument("--manual-gc-interval", type=int, default=0,
                   help="with --manual-gc: collect every this many iterations (0: not between iterations)")
    g.add_argument("--no-manual-gc-eval", action="store_false", dest="manual_gc_eval",
                   help="with --manual-gc: no collection around evaluations")
    g.add_argument("--tensorboard-dir", default=None,
                   help="write Megatron-LM's TensorBoard scalars (its tag names: lm loss, learning-rate, grad-norm, "
                        "loss-scale, batch-size, ...) here, from the last rank")
    g.add_argument("--tensorboard-log-interval", type=int, default=1, help="write them every this many iterations")
    g.add_argument("--tensorboard-queue-size", type=int, default=1000,
                   help="events the writer queues before it flushes to disk")
    g.add_argument("--log-timers-to-tensorboard", action="store_true",
                   help="also iteration-time (s) and, with --log-throughput, throughput (TFLOP/s per device) at "
                        "each --log-interval")
    g.add_argument("--no-log-loss-scale-to-tensorboard", action="store_false", dest="log_loss_scale_to_tensorboard")
    g.add_argument("--log-validation-ppl-to-tensorboard", action="store_true")
    g.add_argument("--log-world-size-to-tensorboard", action="store_true")
    g.add_argument("--log-memory-to-tensorboard", action="store_true",
                   help="the allocator's memory figures (Megatron-LM's mem-* tags) on an accelerator; on the CPU, "
                        "which has no caching allocator, the peak resident set as mem-max-allocated-bytes")
    g.add_argument("--metrics-file", default=None, help="metrics JSONL (default <save>/metrics.jsonl)")
    g.add_argument("--no-progress-bar", action="store_true")

    g = p.add_argument_group("mixture of experts (megatron-core's MoELayer, router and token dispatchers; "
                             "docs/moe.md)")
    g.add_argument("--num-experts", type=int, default=None, help="experts per MoE layer (None: a dense model)")
    g.add_argument("--moe-ffn-hidden-size", type=int, default=None, help="each expert's FFN size (default "
                                                                         "--ffn-hidden-size)")
    g.add_argument("--moe-router-topk", type=int, default=2)
    g.add_argument("--moe-router-load-balancing-type", nargs="+", default=["aux_loss"],
                   choices=["aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none",
                            *MINDSPEED_LLM_ROUTING],
                   help="aux_loss, seq_aux_loss or none (several at once on megatron-core 0.16); global_aux_loss and "
                        "sinkhorn are refused")
    g.add_argument("--moe-aux-loss-coeff", type=float, nargs="+", default=[0.0],
                   help="the load-balancing loss's coefficient (one per --moe-router-load-balancing-type)")
    g.add_argument("--moe-z-loss-coeff", type=float, default=None)
    g.add_argument("--moe-router-score-function", choices=["softmax", "sigmoid", "sqrtsoftplus"], default="softmax",
                   help="softmax or sigmoid; MindSpeed-LLM's sqrtsoftplus is refused")
    g.add_argument("--moe-router-pre-softmax", action="store_true")
    g.add_argument("--moe-router-topk-scaling-factor", type=float, default=None)
    g.add_argument("--moe-router-enable-expert-bias", action="store_true",
                   help="aux-loss-free balancing: the expert bias updated from each step's token counts")
    g.add_argument("--moe-router-bias-update-rate", type=float, default=1e-3)
    g.add_argument("--moe-router-num-groups", type=int, default=None, help="group-limited routing: expert groups")
    g.add_argument("--moe-router-group-topk", type=int, default=None, help="group-limited routing: groups chosen")
    g.add_argument("--moe-router-dtype", choices=["fp32", "fp64"], default=None)
    g.add_argument("--moe-input-jitter-eps", type=float, default=None)
    g.add_argument("--moe-shared-expert-intermediate-size", type=int, default=None,
                   help="the shared experts' total FFN size")
    g.add_argument("--moe-shared-expert-gate", action="store_true",
                   help="the shared experts' output scaled by sigmoid(x . gate_weight) (megatron-core 0.16's "
                        "moe_shared_expert_gate; Qwen2-MoE's shared_expert_gate); needs "
                        "--moe-shared-expert-intermediate-size")
    g.add_argument("--router-gating-in-fp32", action="store_true",
                   help="MindSpeed-LLM: the router's linear in float32 (--moe-router-dtype fp32: the same logits)")
    g.add_argument("--n-shared-experts", type=int, default=None,
                   help="MindSpeed-LLM: shared experts, each of --moe-ffn-hidden-size (sets "
                        "--moe-shared-expert-intermediate-size when that is not given)")
    g.add_argument("--moe-layer-freq", type=moe_freq_type, default=1,
                   help="N: an MoE layer every N layers (from the first); or a Python list expression of 0/1 per "
                        "layer, e.g. \"[0]+[1]*3\"")
    g.add_argument("--first-k-dense-replace", type=int, default=None,
                   help="MindSpeed-LLM: the first k layers dense (then --moe-layer-freq's pattern)")
    g.add_argument("--moe-token-dispatcher-type", choices=["allgather", "alltoall", "alltoall_seq", "flex"],
                   default="allgather",
                   help="allgather or alltoall; alltoall_seq on megatron-core 0.12 (on 0.16, which removed it, the "
                        "alltoall dispatcher: the same tokens to the same experts); flex is refused")
    g.add_argument("--expert-model-parallel-size", type=int, default=1)
    g.add_argument("--expert-tensor-parallel-size", type=int, default=None,
                   help="default --tensor-model-parallel-size")
    g.add_argument("--moe-tp-extend-ep", action="store_true",
                   help="MindSpeed: the tensor-parallel ranks hold whole experts instead of slices of each; here "
                        "megatron-core's layout --expert-tensor-parallel-size 1 with --expert-model-parallel-size "
                        "multiplied by --tensor-model-parallel-size (the same ranks, the same experts on each)")

    g = p.add_argument_group("MindSpeed switches (fusions of the ascend backend, on by default)")
    for name in MINDSPEED_FUSIONS:
        g.add_argument("--" + name.replace("_", "-"), action="store_true")
    g.add_argument("--use-ascend-mc2", action="store_true",
                   help="the tensor-parallel linears' all-gather + matmul and matmul + reduce-scatter as MC2 ops at "
                        "every site (npu_compile option mc2='on'); needs --sequence-parallel and TP > 1")
    g.add_argument("--use-ascend-coc", action="store_true",
                   help="MindSpeed's computation/communication overlap of the tensor-parallel linears: the "
                        "backend's overlap scheduler (npu_compile option overlap, on by default)")
    g.add_argument("--coc-fused-kernel", action="store_true",
                   help="MindSpeed's fused matmul + collective kernels for --use-ascend-coc: the backend's MC2 ops "
                        "where its cost model finds them faster (npu_compile option mc2 'auto', the default; "
                        "--use-ascend-mc2 puts them everywhere)")

    g = p.add_argument_group("LoRA fine-tuning (MindSpeed-LLM's flags: peft's adapters on megatron-core's parallel "
                             "linears; docs/lora.md)")
    g.add_argument("--lora-target-modules", nargs="+", default=[], metavar="MODULE",
                   help="the layers' linears that get adapters (LoRA is on with this flag): any of "
                        "linear_qkv linear_proj linear_fc1 linear_fc2; every other weight is frozen")
    g.add_argument("--lora-r", type=int, default=None, help="the adapters' rank (default 16)")
    g.add_argument("--lora-alpha", type=int, default=None,
                   help="the adapters' scale numerator: each adds (alpha / r) B A x (default 32)")
    g.add_argument("--lora-load", default=None,
                   help="a checkpoint folder of LoRA adapters (from --save, --lora-ckpt-filter or not): the adapters "
                        "(and, without --finetune, the iteration and optimizer) from there, the base model from --load")
    g.add_argument("--lora-fusion", action="store_true",
                   help="MindSpeed-LLM's fused LoRA forward/backward (CC-LoRA): here each compiled layer's graph holds "
                        "the base matmul, its TP collective and the adapters' matmuls together, the backend's fusions "
                        "and overlap scheduler run over them (needs the compiled job)")
    g.add_argument("--lora-ckpt-filter", action="store_true",
                   help="checkpoints hold only the adapters of the model (optimizer, scheduler, RNG as usual); load "
                        "them with --lora-load beside the base model's --load")

    g = p.add_argument_group("npu_compile")
    g.add_argument("--npu-compile-options", type=_json_object, default={},
                   help="JSON object passed to torch.compile(..., options=)")
    g.add_argument("--no-npu-compile", action="store_false", dest="npu_compile",
                   help="the same job, eager (the reference)")

    g = p.add_argument_group("accepted, no effect here (each with the reason)")
    for flag, (kwargs, reason) in NO_EFFECT.items():
        g.add_argument(flag, help=reason, **kwargs)

    g = p.add_argument_group("refused: not implemented here (each with the feature and what to do instead)")
    for flag, (nargs, reason) in REFUSED.items():
        g.add_argument(flag, nargs=nargs, action=_Refused, default=argparse.SUPPRESS, help=reason,
                       metavar="VALUE")
    return p


def moe_freq_type(text: str):
    """Megatron-LM's --moe-layer-freq: an int N, or a Python list expression of 0/1 such as "([1]*3+[0])*2"."""
    try:
        return int(text)
    except ValueError:
        pass
    try:  # list arithmetic only: no names, no builtins
        value = eval(text, {"__builtins__": {}}, {})  # noqa: S307
    except Exception as e:
        raise argparse.ArgumentTypeError(f"{text!r} is neither an int nor a list expression of 0/1 ({e})")
    if not isinstance(value, list) or any(v not in (0, 1) for v in value):
        raise argparse.ArgumentTypeError(f"{text!r} is neither an int nor a list of 0/1 per layer")
    return value


class _Refused(argparse.Action):
    """Takes a refused flag's values (so that they are not read as flags of their own) and records the flag."""

    def __call__(self, parser, namespace, values, option_string=None):
        refused = getattr(namespace, "_refused", [])
        refused.append(option_string)
        setattr(namespace, "_refused", refused)


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e.msg} at char {e.pos}): {text!r}")
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"needs a JSON object like '{{\"dump_dir\": \"dumps\"}}', got {text!r}")
    return value


def refusal(flag: str, reason: str) -> str:
    """One line: a flag (or flag and value) and why it is refused, naming the feature and what to do instead."""
    return f"{flag}: {reason}"


def _value_refusals(args: argparse.Namespace) -> list[str]:
    """Flags this job takes with some values and refuses with others: one line each."""
    lines = []
    if args.transformer_impl == "transformer_engine":
        lines.append(refusal("--transformer-impl transformer_engine",
                             "Transformer Engine is CUDA-only and not used here; use --transformer-impl local "
                             "(megatron-core's own layers, the default here)"))
    if args.context_parallel_size > 1:
        lines.extend(_context_parallel_refusals(args))
    if args.spec is not None:
        module = args.spec[0] if args.spec else ""
        if len(args.spec) != 2 or args.spec[1] != "layer_spec" or module not in SPECS_BUILT:
            what = SPECS_REFUSED.get(module)
            lines.append(refusal(
                "--spec " + " ".join(args.spec),
                (f"{what} is not implemented here" if what else "this layer spec is not one this job builds")
                + "; the specs built here: " + ", ".join(f"{m} layer_spec" for m in SPECS_BUILT)
                + " (or leave --spec out: megatron-core's local GPT layer)"))
    if args.spec and args.spec[0] == "mindspeed_llm.tasks.models.spec.qwen3_next_spec" \
            and args.full_attention_interval is None:
        lines.append(refusal("--spec " + " ".join(args.spec),
                             "Qwen3-Next's layers without --full-attention-interval (every layer its gated "
                             "attention) are not implemented here; give --full-attention-interval N (N=1: every "
                             "layer full attention, with Qwen3-Next's output gate)"))
    lines.extend(_linear_attention_refusals(args))
    if args.num_experts:
        if args.moe_token_dispatcher_type == "flex":
            lines.append(refusal("--moe-token-dispatcher-type flex",
                                 "the flex dispatcher needs DeepEP or HybridEP (CUDA) and is not implemented here; "
                                 "use alltoall or allgather"))
        for kind in ("global_aux_loss", "sinkhorn"):
            if kind in args.moe_router_load_balancing_type:
                lines.append(refusal(f"--moe-router-load-balancing-type {kind}",
                                     f"{kind} balancing is not implemented here; use aux_loss, seq_aux_loss or none"))
        for kind, why in MINDSPEED_LLM_ROUTING.items():
            if kind in args.moe_router_load_balancing_type:
                lines.append(refusal(f"--moe-router-load-balancing-type {kind}", why))
        if args.moe_router_score_function == "sqrtsoftplus":
            lines.append(refusal("--moe-router-score-function sqrtsoftplus", (
                "MindSpeed-LLM's sqrtsoftplus scores (sqrt(softplus(logits)), "
                "mindspeed_llm/core/transformer/moe/moe_utils.py:298-305, a score function megatron-core does not "
                "have) are not implemented here, and torch_npu's gating ops have no such norm (npu_moe_gating_top_k: "
                "softmax or sigmoid); use softmax or sigmoid")))
    if args.position_embedding_type in POSITION_EMBEDDINGS_REFUSED:
        lines.append(refusal(f"--position-embedding-type {args.position_embedding_type}",
                             POSITION_EMBEDDINGS_REFUSED[args.position_embedding_type]
                             + "; use rope or learned_absolute"))
    if args.tokenizer_type in TOKENIZERS_REFUSED:
        lines.append(refusal(f"--tokenizer-type {args.tokenizer_type}",
                             TOKENIZERS_REFUSED[args.tokenizer_type] + "; use PretrainedFromHF (or "
                             "HuggingFaceTokenizer) with a local HF tokenizer folder, GPT2BPETokenizer or "
                             "NullTokenizer"))
    if args.loss_compute_mode == "chunk":
        lines.append(refusal("--loss-compute-mode chunk",
                             "MindSpeed-LLM's chunked cross-entropy is not implemented here; the backend fuses the "
                             "output layer with the loss (vocab_parallel_cross_entropy) instead"))
    if args.dataloader_type != "single":
        lines.append(refusal(f"--dataloader-type {args.dataloader_type}",
                             f"Megatron-LM's {args.dataloader_type} data loader is not implemented here; use single "
                             "(the default: each sample once, in order)"))
    if args.rope_scaling_type in ("yarn", "plm"):
        lines.append(refusal(f"--rope-scaling-type {args.rope_scaling_type}", ROPE_EXTENSION))
    if args.rope_scaling_type == "llama3":
        given = {"low_freq_factor": args.low_freq_factor, "high_freq_factor": args.high_freq_factor,
                 "original_max_position_embeddings": args.original_max_position_embeddings}
        for name, value in given.items():
            if value is not None and value != LLAMA3_ROPE[name]:
                lines.append(refusal(
                    f"--{name.replace('_', '-')} {value:g}",
                    f"megatron-core's Llama 3 RoPE scaling fixes it at {LLAMA3_ROPE[name]:g}; other values are not "
                    "implemented here"))
    if args.handler_name and args.handler_name not in PRETRAIN_HANDLERS + (
            INSTRUCTION_HANDLERS if args.is_instruction_dataset else ()):
        lines.append(refusal(f"--handler-name {args.handler_name}", INSTRUCTION))
    raw = [p for p in args.data_path or () if _is_raw_data(p)]
    if raw:
        lines.append(refusal(
            f"--data-path {raw[0]}",
            "preprocessing raw data when the job starts (MindSpeed-LLM's --handler-name) is not implemented here; "
            f"write a .bin/.idx prefix with `npu-compile preprocess --input {raw[0]} ...` and give the prefix"))
    nodes = _nodes(args)
    if args.no_shared_storage and nodes > 1:
        lines.append(refusal("--no-shared-storage",
                             f"this job runs on {nodes} nodes, and building the dataset index on each node is not "
                             "implemented here; put --data-path and --data-cache-path on storage every node sees "
                             "and drop the flag"))
    return lines


def _context_parallel_refusals(args) -> list[str]:
    """What context parallelism above 1 does not take here, one line each (docs/context_parallel.md)."""
    lines, cp, algo = [], args.context_parallel_size, args.context_parallel_algo
    if algo in CP_ALGORITHMS:
        lines.append(refusal(f"--context-parallel-algo {algo}",
                             f"MindSpeed's {CP_ALGORITHMS[algo]} context parallelism is not implemented here; use "
                             "ulysses_cp_algo or megatron_cp_algo"))
    if args.cp_window_size != 1:
        lines.append(refusal(f"--cp-window-size {args.cp_window_size}",
                             "MindSpeed's double-ring attention (windows of the CP ring) is not implemented here; "
                             "give --cp-window-size 1 (one ring)"))
    if algo == "megatron_cp_algo" and args.attention_dropout:
        lines.append(refusal(f"--attention-dropout {args.attention_dropout:g}",
                             "attention dropout under ring attention (megatron_cp_algo) is not implemented here; "
                             "give --attention-dropout 0, or use ulysses_cp_algo"))
    if getattr(args, "num_experts", None) and _moe_balancing_loss(args):
        from megatron_glue.capture.adaptations import megatron_core_in

        if not megatron_core_in(">=0.13"):
            lines.append(refusal(
                f"--num-experts with a load-balancing loss at --context-parallel-size {cp}",
                "on megatron-core 0.12 the schedule scales the router's aux-loss gradient by 1 / micro-batches only "
                "(0.12.1 pipeline_parallel/schedules.py:321), not also by CP as 0.13 on do (0.16.1 schedules.py:292), "
                "so the router would learn 1/CP of what it learns at CP 1; use megatron-core 0.13 or later, or "
                "--moe-aux-loss-coeff 0"))
    if algo == "megatron_cp_algo" and getattr(args, "interleave_sliding_window", None) is not None:
        lines.append(refusal("--interleave-sliding-window",
                             "sliding-window attention under ring attention (megatron_cp_algo) is not implemented "
                             "here; use ulysses_cp_algo"))
    return lines


def _moe_balancing_loss(args) -> bool:
    """Whether the router adds a load-balancing loss (a type other than none with a coefficient above 0)."""
    types, coeffs = args.moe_router_load_balancing_type, args.moe_aux_loss_coeff
    types = types if isinstance(types, (list, tuple)) else [types]
    coeffs = coeffs if isinstance(coeffs, (list, tuple)) else [coeffs] * len(types)
    return any(t != "none" and c for t, c in zip(types, coeffs))


def _is_raw_data(path: str) -> bool:
    """MindSpeed-LLM's test for data it preprocesses at start: a file, or a folder of files, of a raw format."""
    if os.path.isfile(path):
        return path.endswith(RAW_DATA_SUFFIXES)
    if os.path.isdir(path):
        return any(name.endswith(RAW_DATA_SUFFIXES) for name in os.listdir(path))
    return False


def _nodes(args) -> int:
    """Machines this job runs on: the world over the processes per machine ($LOCAL_WORLD_SIZE, set by torchrun)."""
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", args.world_size) or args.world_size)
    return max(1, -(-args.world_size // max(1, per_node)))


class DialectError(ArgumentError):
    """Every refused or unknown flag of one command line, one line each, under a line that counts them."""

    def __init__(self, prog: str, lines: list[str]):
        self.lines = lines
        if len(lines) == 1:
            message = f"{prog}: error: {lines[0]}"
        else:
            message = "\n".join([f"{prog}: error: {len(lines)} flags of this command line are refused or unknown:",
                                 *(f"  {line}" for line in lines)])
        super().__init__(message)


def _unknown(argv: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """Flags (`--name` or `--name=value`) the parser does not know, in order, each once."""
    known = parser._option_string_actions
    unknown = [a.split("=", 1)[0] for a in argv if a.startswith("--") and a.split("=", 1)[0] not in known]
    return list(dict.fromkeys(unknown))


def _gives(argv: list[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in argv)


def parse_args(argv: list[str] | None = None, world_size: int | None = None,
               refusals=()) -> argparse.Namespace:
    """Megatron-LM's args from `argv` (default sys.argv[1:]), checked against `world_size`
    (default $WORLD_SIZE or 1). Raises ArgumentError (a SystemExit with one line, or a DialectError listing
    every refused or unknown flag at once) on bad input. `refusals`: more checks of the parsed args, each giving
    a refusal line or None, reported with the others (the door adds the converter's, a room this one does not
    import)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    lines = [f"{flag}: unrecognized (not a flag of Megatron-LM, MindSpeed or MindSpeed-LLM that this job knows)"
             for flag in _unknown(argv, parser)]
    try:
        args, _ = parser.parse_known_args(argv)
    except ArgumentError as e:  # a bad value or a missing flag: reported with the refusals found so far
        refused = [a.split("=", 1)[0] for a in argv if a.split("=", 1)[0] in REFUSED]
        if not _gives(argv, "--num-experts"):
            refused = [f for f in refused if f not in MOE_REFUSED]
        lines = [refusal(f, REFUSED[f][1]) for f in dict.fromkeys(refused)] + lines
        if not lines:
            raise
        raise DialectError(parser.prog, lines + [e.message.split(": error: ", 1)[-1]]) from None
    args.world_size = int(os.environ.get("WORLD_SIZE", "1")) if world_size is None else world_size
    given = list(dict.fromkeys(getattr(args, "_refused", [])))
    if not _gives(argv, "--num-experts"):
        # MoE settings of a model without experts configure nothing (Megatron-LM and MindSpeed read them only for
        # experts): accepted, as there
        given = [f for f in given if f not in MOE_REFUSED]
    refused = [refusal(f, REFUSED[f][1]) for f in given]
    if hasattr(args, "_refused"):
        del args._refused
    lines = refused + _value_refusals(args) + [line for check in refusals if (line := check(args))] + lines
    if lines:
        raise DialectError(parser.prog, lines)
    validate(args)
    return args


def validate(args: argparse.Namespace) -> None:
    """Megatron-LM's derived values and consistency checks; each failure one line naming the fix."""
    def fail(message):
        raise ArgumentError(f"pretrain_gpt: error: {message}")

    tp, pp, world = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.world_size
    if tp < 1 or pp < 1:
        fail("--tensor-model-parallel-size and --pipeline-model-parallel-size must be >= 1")
    cp = args.context_parallel_size
    if cp < 1:
        fail("--context-parallel-size must be >= 1")
    if world % (tp * pp * cp):
        fail(f"world size {world} is not divisible by --tensor-model-parallel-size {tp} x "
             f"--pipeline-model-parallel-size {pp}" + (f" x --context-parallel-size {cp}" if cp > 1 else "")
             + f"; use sizes whose product divides {world}")
    args.data_parallel_size = world // (tp * pp * cp)
    if cp > 1:
        validate_context_parallel(args, fail)
    if getattr(args, "reset_attention_mask", False) and pp > 2:
        fail(f"--reset-attention-mask at --pipeline-model-parallel-size {pp}: the stages between the first and the "
             "last read no batch, so their layers would not see the documents; use at most 2 pipeline stages")

    if args.micro_batch_size is None:
        fail("--micro-batch-size is required")
    if args.global_batch_size is None:
        args.global_batch_size = args.micro_batch_size * args.data_parallel_size
    per_step = args.micro_batch_size * args.data_parallel_size
    if args.global_batch_size % per_step:
        fail(f"--global-batch-size {args.global_batch_size} is not divisible by --micro-batch-size "
             f"{args.micro_batch_size} x data-parallel size {args.data_parallel_size}; use a multiple of {per_step}")
    args.num_microbatches = args.global_batch_size // per_step

    if args.train_iters is None:
        fail("--train-iters is required: the number of iterations to train (with --skip-train, 0 is fine)")
    if args.lr is None and not args.skip_train:
        fail("--lr is required: the peak learning rate, e.g. --lr 3e-4")
    if args.lr is None:
        args.lr = 0.0
    if args.fp16 and args.bf16:
        fail("--fp16 and --bf16 are exclusive; pick one")
    args.params_dtype = "float16" if args.fp16 else "bfloat16" if args.bf16 else "float32"
    validate_gradient_precision(args, fail)

    if args.hidden_size % args.num_attention_heads:
        fail(f"--hidden-size {args.hidden_size} is not divisible by --num-attention-heads {args.num_attention_heads}")
    if args.num_attention_heads % tp:
        fail(f"--num-attention-heads {args.num_attention_heads} is not divisible by --tensor-model-parallel-size {tp}")
    if not args.group_query_attention:
        args.num_query_groups = args.num_attention_heads
    elif args.num_attention_heads % args.num_query_groups or args.num_query_groups % tp:
        fail(f"--num-query-groups {args.num_query_groups} must divide --num-attention-heads "
             f"{args.num_attention_heads} and be divisible by --tensor-model-parallel-size {tp}")
    if args.ffn_hidden_size is None:
        args.ffn_hidden_size = default_ffn_hidden_size(args.hidden_size, args.swiglu)
        if args.ffn_hidden_size < 1:
            fail(f"--swiglu with --hidden-size {args.hidden_size} gives Megatron-LM's default --ffn-hidden-size 0 "
                 "(8/3 x hidden rounded down to a multiple of 64); give --ffn-hidden-size")
    if args.kv_channels is None:  # Megatron-LM's validate_args: the head size, stored and compared resolved
        args.kv_channels = args.hidden_size // args.num_attention_heads
    if args.use_rotary_position_embeddings:  # Megatron-LM's validate_args: the older spelling of rope
        args.position_embedding_type = "rope"
    if args.rope_scaling_type == "llama3":  # megatron-core's Llama 3 scaling (MindSpeed-LLM's name for it)
        args.use_rope_scaling = True
    if args.max_position_embeddings is None:
        if args.position_embedding_type == "learned_absolute":
            fail("--max-position-embeddings is required with --position-embedding-type learned_absolute")
        args.max_position_embeddings = args.seq_length
    if args.seq_length > args.max_position_embeddings and args.position_embedding_type == "learned_absolute":
        fail(f"--seq-length {args.seq_length} exceeds --max-position-embeddings {args.max_position_embeddings}")
    if args.use_ascend_mc2 and (tp == 1 or not args.sequence_parallel):
        # MindSpeed refuses it so too (mindspeed/features_manager/tensor_parallel/mc2.py, MC2Feature.validate_args)
        fail(f"--use-ascend-mc2 needs --sequence-parallel and --tensor-model-parallel-size > 1 (got "
             f"{'--sequence-parallel' if args.sequence_parallel else 'no --sequence-parallel'}, TP {tp}): MC2 fuses "
             "the all-gather + matmul and matmul + reduce-scatter that sequence parallelism puts around the "
             "tensor-parallel linears (MindSpeed refuses this combination too)")
    if args.sequence_parallel and tp == 1:
        args.sequence_parallel = False  # Megatron-LM turns it off at TP=1 too

    if args.noop_layers is not None:
        from megatron_glue.training import noop_layers

        args.noop_layers = noop_layers.parse(args.noop_layers, args.num_layers, fail)
    if args.num_layer_list is not None:
        args.num_layer_list = num_layer_list(args, fail)
    elif args.num_layers % pp:
        fail(f"--num-layers {args.num_layers} is not divisible by --pipeline-model-parallel-size {pp}; give one "
             "that is, or each stage's layers with --num-layer-list")
    args.virtual_pipeline_model_parallel_size = None
    if args.num_layers_per_virtual_pipeline_stage is not None:
        per_stage = args.num_layers // pp
        if pp < 2:
            fail("--num-layers-per-virtual-pipeline-stage needs --pipeline-model-parallel-size > 1")
        if per_stage % args.num_layers_per_virtual_pipeline_stage:
            fail(f"--num-layers-per-virtual-pipeline-stage {args.num_layers_per_virtual_pipeline_stage} must "
                 f"divide the {per_stage} layers of each pipeline stage")
        args.virtual_pipeline_model_parallel_size = per_stage // args.num_layers_per_virtual_pipeline_stage
        if args.num_microbatches % pp:
            fail(f"the interleaved schedule needs the number of micro-batches ({args.num_microbatches}) to be a "
                 f"multiple of --pipeline-model-parallel-size {pp}")
    if args.overlap_param_gather and not args.use_distributed_optimizer:
        fail("--overlap-param-gather needs --use-distributed-optimizer")
    if args.tensorboard_dir is not None:
        if args.tensorboard_log_interval < 1:
            fail(f"--tensorboard-log-interval {args.tensorboard_log_interval} must be >= 1")
        try:
            import torch.utils.tensorboard  # noqa: F401  (SummaryWriter needs the tensorboard package)
        except ImportError as e:
            fail(f"--tensorboard-dir needs the tensorboard package ({e}); install this project's 'megatron' extra "
                 "(pip install 'npu_compile[megatron]') or `pip install tensorboard`")
    if args.reuse_fp32_param:
        validate_reuse_fp32_param(args, fail)
    validate_recompute(args, fail)
    validate_moe(args, fail)

    if args.split is None:
        args.split = "969, 30, 1"
    if not args.mock_data and not args.data_path and not args.skip_train:
        fail("--data-path is required (or --mock-data): the prefix of a .bin/.idx pair written by "
             "`npu-compile preprocess`")
    if args.tokenizer_type is None:
        if args.vocab_file and args.merge_file:
            args.tokenizer_type = "GPT2BPETokenizer"
        elif args.mock_data and args.vocab_size:
            args.tokenizer_type = "NullTokenizer"
        else:
            fail("--tokenizer-type is required: GPT2BPETokenizer (with --vocab-file, --merge-file), "
                 "HuggingFaceTokenizer (with --tokenizer-model), PretrainedFromHF (with --tokenizer-name-or-path) or "
                 "NullTokenizer (with --vocab-size)")
    if args.tokenizer_type == "GPT2BPETokenizer" and not (args.vocab_file and args.merge_file):
        fail("--tokenizer-type GPT2BPETokenizer needs --vocab-file (vocab.json) and --merge-file (merges.txt)")
    if args.tokenizer_type == "HuggingFaceTokenizer" and not args.tokenizer_model:
        fail("--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model (a local directory)")
    if args.tokenizer_type == "PretrainedFromHF" and not args.tokenizer_name_or_path:
        fail("--tokenizer-type PretrainedFromHF needs --tokenizer-name-or-path (a local directory)")
    if args.tokenizer_type == "NullTokenizer" and not args.vocab_size:
        fail("--tokenizer-type NullTokenizer needs --vocab-size")
    if args.partial_rotary_factor is not None:
        _partial_rotary(args, fail)
    if args.full_attention_interval is not None or args.no_enable_linear_qkv:
        _check_linear_attention(args, fail)
    if args.rope_scaling_type == "longrope":
        _check_longrope(args, fail)
    if args.squared_relu and args.swiglu:
        fail("--squared-relu with --swiglu: choose one MLP activation (Megatron-LM asserts not both)")
    if args.gelu_tanh and (args.swiglu or args.squared_relu):
        fail(f"--gelu-tanh with {'--swiglu' if args.swiglu else '--squared-relu'}: choose one MLP activation")
    if args.output_logit_softcapping is not None and not args.output_logit_softcapping > 0:
        fail(f"--output-logit-softcapping {args.output_logit_softcapping:g} must be > 0")
    if args.query_pre_attn_scalar is not None and args.query_pre_attn_scalar < 1:
        fail(f"--query-pre-attn-scalar {args.query_pre_attn_scalar} must be >= 1")
    if args.interleave_sliding_window is not None:
        _check_sliding_window(args, fail)
    if args.add_rmsnorm_offset and args.normalization != "RMSNorm":
        fail(f"--add-rmsnorm-offset needs --normalization RMSNorm (got {args.normalization}); a LayerNorm with a "
             "unit offset (Megatron-LM's --apply-layernorm-1p) is not implemented here")
    if args.tokenizer_type == "MagistralTokenizer" and not args.tokenizer_model:
        fail("--tokenizer-type MagistralTokenizer needs --tokenizer-model (Mistral's tekken.json, or its folder)")
    if args.padded_vocab_size is not None and args.padded_vocab_size < 1:
        fail(f"--padded-vocab-size {args.padded_vocab_size} must be >= 1")
    if args.num_workers < 0:
        fail(f"--num-workers {args.num_workers} must be >= 0")
    if args.manual_gc_interval < 0:
        fail(f"--manual-gc-interval {args.manual_gc_interval} must be >= 0 (0: no collection between iterations)")
    if args.enable_hf2mg_convert and not args.load:
        fail("--enable-hf2mg-convert needs --load, the HuggingFace folder to start from")
    if args.mg_save_dir and not args.enable_hf2mg_convert:
        fail("--mg-save-dir is where --enable-hf2mg-convert puts the converted weights; give both, or neither")
    _check_mg2hf(args, fail)
    if args.save:  # a job that cannot write its checkpoints is refused here, not after training to its first save
        from megatron_glue.training.checkpointing import save_refusal

        if (why := save_refusal(args)) is not None:
            fail(why)
    if args.save_interval is not None and not args.save and int(os.environ.get("RANK", "0")) == 0:
        print(" WARNING: --save-interval has no effect without --save; no checkpoints will be written",
              file=sys.stderr)
    if args.lr_decay_iters is None:
        # --train-iters 0 (evaluate only) steps no schedule; megatron-core's scheduler still wants a decay > 0
        args.lr_decay_iters = args.train_iters or 1
    if args.lr_warmup_fraction is not None:
        args.lr_warmup_iters = int(args.lr_warmup_fraction * args.lr_decay_iters)
    if args.lr_warmup_iters >= args.lr_decay_iters and args.lr_warmup_iters > 0:
        # megatron-core's OptimizerParamScheduler asserts it, bare
        fail(f"--lr-warmup-iters {args.lr_warmup_iters} must be below --lr-decay-iters {args.lr_decay_iters} "
             "(default --train-iters); warm up for fewer iterations")

    validate_lora(args, fail)

    mindspeed = [rule for flag, rules in MINDSPEED_FUSIONS.items() if getattr(args, flag) for rule in rules]
    if args.use_ascend_mc2 and args.npu_compile_options.get("mc2", "on") != "on":
        fail(f"--use-ascend-mc2 sets npu_compile option mc2='on', but --npu-compile-options gives mc2="
             f"{args.npu_compile_options['mc2']!r}; drop one of them")
    if args.use_ascend_coc and args.npu_compile_options.get("overlap", True) is False:
        fail("--use-ascend-coc is the backend's overlap scheduler (npu_compile option overlap), but "
             "--npu-compile-options gives overlap=false; drop one of them")
    if args.coc_fused_kernel and args.npu_compile_options.get("mc2", "auto") == "off":
        fail("--coc-fused-kernel is the backend's MC2 ops (npu_compile option mc2), but --npu-compile-options gives "
             "mc2='off'; drop one of them")
    if args.recompute_activation_function:
        validate_recompute_activation_function(args, fail)
    offload = swap_attention_modules(args, fail)
    args.npu_compile_options = compile_options(args.npu_compile_options, mindspeed, args.use_ascend_mc2)
    if args.recompute_activation_function:  # MindSpeed's switch -> the backend's always-recomputed op kinds
        kinds = args.npu_compile_options.get("recompute", [])
        if isinstance(kinds, (list, tuple)):
            args.npu_compile_options["recompute"] = list(dict.fromkeys([*kinds, "activation"]))
    if offload:  # MindSpeed's --swap-attention -> the backend's host offload of those modules' saved activations
        given = args.npu_compile_options.get("offload", [])
        if isinstance(given, (list, tuple)):
            args.npu_compile_options["offload"] = list(dict.fromkeys([*given, *offload]))
    from npu_compile import config as npu_config

    try:  # here, before any model is built or traced (torch.compile checks them only at the first graph)
        options = npu_config.validate(args.npu_compile_options)
    except npu_config.OptionError as e:
        fail(f"--npu-compile-options: {e}")
    if args.moe_grouped_gemm and args.num_experts and not args.npu_compile:
        fail("--moe-grouped-gemm is the backend's grouped_matmul fusion (megatron-core's own grouped GEMM needs a "
             "CUDA package), which --no-npu-compile turns off; drop one of them")
    for flag in ("moe_permute_fusion", "use_fused_moe_token_permute_and_unpermute"):
        if getattr(args, flag) and args.num_experts and not args.npu_compile:
            fail(f"--{flag.replace('_', '-')} is the backend's permute and unpermute fusions (megatron-core's fused "
                 "permute needs Transformer Engine), which --no-npu-compile turns off; drop one of them")
    for flag in ("moe_alltoall_overlap_comm", "moe_permutation_async_comm"):
        if getattr(args, flag) and args.num_experts:
            validate_moe_overlap(args, "--" + flag.replace("_", "-"), fail)
    if args.use_ascend_mc2:  # MC2 is the compiler's, and only the npu targets have its ops: never a silent no-op
        if not args.npu_compile:
            fail("--use-ascend-mc2 is done by the compiler (option mc2='on'), which --no-npu-compile turns off; "
                 "drop one of them")
        if options.target == "reference" or options.target == "auto" and npu_config.resolve_target("auto") != "npu":
            why = "as --npu-compile-options says" if options.target == "reference" else "auto: no usable torch_npu here"
            fail(f"--use-ascend-mc2 makes MC2 ops, which only the npu and npu-sim targets have; this job compiles for "
                 f"target 'reference' ({why}); to run them on the CPU, give --npu-compile-options "
                 "'{\"target\": \"npu-sim\"}'")


def num_layer_list(args: argparse.Namespace, fail) -> list[int]:
    """MindSpeed-LLM's --num-layer-list "a,b,...": the layers of each pipeline stage (its checks:
    mindspeed_llm/features_manager/pipeline_parallel/num_layer_list.py `validate_args`), as a list, or fail. Which
    lists megatron-core can build: `uneven_stages`."""
    text, pp = args.num_layer_list, args.pipeline_model_parallel_size
    try:
        counts = [int(n) for n in text.split(",")]
    except ValueError:
        fail(f"--num-layer-list {text!r}: expected comma-separated layer counts, one per pipeline stage, e.g. 3,5")
    if pp < 2:
        fail(f"--num-layer-list {text} needs --pipeline-model-parallel-size > 1 (got {pp}): it splits the layers "
             "over pipeline stages")
    if len(counts) != pp or min(counts) < 1 or sum(counts) != args.num_layers:
        fail(f"--num-layer-list {text}: needs {pp} stages (--pipeline-model-parallel-size) of at least one layer "
             f"summing to --num-layers {args.num_layers}")
    if args.num_layers_per_virtual_pipeline_stage is not None:
        fail(f"--num-layer-list {text} and --num-layers-per-virtual-pipeline-stage are exclusive (as in "
             "MindSpeed-LLM): uneven stages are not split into virtual stages; drop one of them")
    from megatron_glue.training.versions import uneven_stages

    try:
        uneven_stages(counts)
    except ValueError as e:
        fail(f"--num-layer-list {text}: {e}")
    return counts


def stage_layer_counts(args: argparse.Namespace) -> list[int]:
    """The transformer layers of each pipeline stage: --num-layer-list, or the even split."""
    pp = args.pipeline_model_parallel_size
    return list(args.num_layer_list) if args.num_layer_list else [args.num_layers // pp] * pp


def validate_context_parallel(args: argparse.Namespace, fail) -> None:
    """The sizes each CP algorithm needs (MindSpeed's checks: mindspeed/features_manager/context_parallel/)."""
    cp, tp, algo = args.context_parallel_size, args.tensor_model_parallel_size, args.context_parallel_algo
    if algo == "ulysses_cp_algo" and args.num_attention_heads % (tp * cp):
        fail(f"--num-attention-heads {args.num_attention_heads} is not divisible by --tensor-model-parallel-size "
             f"{tp} x --context-parallel-size {cp} (ulysses_cp_algo gives each CP rank heads / CP of them); use a "
             f"multiple of {tp * cp}, or --context-parallel-algo megatron_cp_algo")
    if args.seq_length % (2 * cp):
        fail(f"--seq-length {args.seq_length} is not divisible by 2 x --context-parallel-size {cp} (megatron-core "
             f"splits the sequence into 2 x CP chunks for causal load balancing); use a multiple of {2 * cp}")


def validate_moe(args: argparse.Namespace, fail) -> None:
    """Megatron-LM's MoE rules (megatron/training/arguments.py validate_args, core_v0.16.1 and core_v0.12.1) and
    MindSpeed-LLM's MoE flags resolved into megatron-core's: --n-shared-experts into
    --moe-shared-expert-intermediate-size, --first-k-dense-replace into --moe-layer-freq's pattern (docs/moe.md)."""
    from megatron_glue.capture.adaptations import megatron_core_in

    if args.num_experts == 0:  # Megatron-LM: 0 experts is a dense model
        args.num_experts = None
    ep, etp = args.expert_model_parallel_size, args.expert_tensor_parallel_size
    if args.num_experts is None:
        if ep > 1:
            fail(f"--expert-model-parallel-size {ep} needs --num-experts (experts to spread over the ranks)")
        args.expert_tensor_parallel_size = args.tensor_model_parallel_size if etp is None else etp
        return
    if args.num_experts < 0:
        fail(f"--num-experts {args.num_experts} must be >= 0 (0: a dense model)")
    if args.moe_tp_extend_ep:
        ep, etp = tp_extended_ep(args, fail)
    args.expert_tensor_parallel_size = etp = args.tensor_model_parallel_size if etp is None else etp
    if ep < 1 or args.num_experts % ep:
        fail(f"--num-experts {args.num_experts} is not divisible by --expert-model-parallel-size {ep}; give an "
             "expert-parallel size that divides the experts")
    group = etp * ep * args.pipeline_model_parallel_size
    if args.world_size % group:
        fail(f"world size {args.world_size} is not divisible by --expert-tensor-parallel-size {etp} x "
             f"--expert-model-parallel-size {ep} x --pipeline-model-parallel-size "
             f"{args.pipeline_model_parallel_size}; use sizes whose product divides {args.world_size}")
    if args.tensor_model_parallel_size > 1 and not args.sequence_parallel:
        # megatron-core's MoELayer.forward raises in training at TP > 1 without SP (transformer/moe/moe_layer.py:379;
        # 0.12.1: moe_layer.py:130-137): its dispatchers take the sequence-parallel shards of the tokens
        fail(f"MoE at --tensor-model-parallel-size {args.tensor_model_parallel_size} needs --sequence-parallel "
             "(megatron-core's MoE layer refuses to train with tensor parallelism without it)")
    if getattr(args, "norm_topk_prob", False) and args.moe_router_topk > 1 and "aux_loss" in \
            args.moe_router_load_balancing_type and (args.moe_router_pre_softmax
                                                     or args.moe_router_topk_scaling_factor is not None):
        fail("--norm-topk-prob with " + ("--moe-router-pre-softmax" if args.moe_router_pre_softmax else
                                         "--moe-router-topk-scaling-factor")
             + ": MindSpeed-LLM's renormalisation of the top-k probabilities (undoing the softmax over all experts "
               "or the scaling) is not implemented here; drop one of them")
    if not 1 <= args.moe_router_topk <= args.num_experts:
        fail(f"--moe-router-topk {args.moe_router_topk} must be between 1 and --num-experts {args.num_experts}")
    if args.add_bias_linear:
        fail("MoE experts with biases are not implemented here: megatron-core 0.16.1 adds an expert's output bias in "
             "place onto the output of a custom autograd function (transformer/mlp.py:247), which autograd refuses; "
             "give --disable-bias-linear (as MoE models and MindSpeed-LLM's MoE scripts do)")
    if args.moe_ffn_hidden_size is None:  # Megatron-LM's default
        args.moe_ffn_hidden_size = args.ffn_hidden_size
    if args.n_shared_experts and args.moe_shared_expert_intermediate_size is None:
        # MindSpeed-LLM (mindspeed_llm/features_manager/moe/shared_expert.py, validate_args)
        args.moe_shared_expert_intermediate_size = args.n_shared_experts * args.moe_ffn_hidden_size
    if args.router_gating_in_fp32:
        # MindSpeed-LLM (mindspeed_llm/core/transformer/moe/router.py:497-515, topk_router_gating_func): the
        # router's linear on float32 copies of its input and weight, the copies recomputed in the backward rather
        # than kept: the logits (and their gradients) of megatron-core's moe_router_dtype fp32 (router.py gating:
        # input.to(float32) @ weight.to(float32)), which keeps them
        if args.moe_router_dtype == "fp64":
            fail("--router-gating-in-fp32 with --moe-router-dtype fp64: one says float32 logits, the other float64; "
                 "give one of them")
        args.moe_router_dtype = "fp32"
    if args.moe_shared_expert_gate and not args.moe_shared_expert_intermediate_size:
        fail("--moe-shared-expert-gate gates the shared experts: give --moe-shared-expert-intermediate-size (or "
             "--n-shared-experts)")
    if args.moe_shared_expert_gate and not megatron_core_in(">=0.16"):
        fail("--moe-shared-expert-gate needs megatron-core 0.16 (TransformerConfig.moe_shared_expert_gate; 0.12 has "
             "no gate on the shared experts)")
    types, coeffs = args.moe_router_load_balancing_type, args.moe_aux_loss_coeff
    if len(types) > 1 and not megatron_core_in(">=0.16"):
        fail(f"--moe-router-load-balancing-type {' '.join(types)}: several balancing losses at once need "
             "megatron-core 0.16 (0.12 takes one); give one")
    if len(coeffs) != len(types):
        fail(f"--moe-aux-loss-coeff gives {len(coeffs)} coefficients for {len(types)} "
             f"--moe-router-load-balancing-type values ({' '.join(types)}); give one per type")
    freq, k = args.moe_layer_freq, args.first_k_dense_replace
    if isinstance(freq, list) and len(freq) != args.num_layers:
        fail(f"--moe-layer-freq gives {len(freq)} layers' pattern for --num-layers {args.num_layers}; give one 0/1 "
             "per layer")
    if isinstance(freq, int) and freq == 0:
        # megatron-core makes layer i an MoE layer when i % freq == 0 (gpt_layer_specs.py, get_gpt_decoder_layer_specs
        # 0.16.1 / get_gpt_decoder_block_spec 0.12.1); a negative N means what N does there (MindSpeed-LLM's MoE
        # scripts pass -1 with --first-k-dense-replace -1: every layer MoE); 0 divides nothing
        fail("--moe-layer-freq 0: layer i is an MoE layer when i % N == 0, which N = 0 cannot decide; give N != 0 "
             "(1 or -1: every layer) or a 0/1 list")
    if k:  # MindSpeed-LLM (mindspeed_llm/core/transformer/transformer_block.py, _transformer_block_build_layers)
        if isinstance(freq, list):
            fail("--first-k-dense-replace takes an integer --moe-layer-freq (MindSpeed-LLM's rule); give the "
                 "pattern as a list alone")
        if args.num_layers <= k:
            fail(f"--first-k-dense-replace {k} must be below --num-layers {args.num_layers} (MindSpeed-LLM's rule)")
        args.moe_layer_freq = [int(i >= k and i % freq == 0) for i in range(args.num_layers)]
    pattern = (args.moe_layer_freq if isinstance(args.moe_layer_freq, list)
               else [int(i % args.moe_layer_freq == 0) for i in range(args.num_layers)])
    per_stage = args.num_layers // args.pipeline_model_parallel_size
    if args.pipeline_model_parallel_size > 1 and any(
            not any(pattern[s:s + per_stage]) for s in range(0, args.num_layers, per_stage)):
        fail(f"--moe-layer-freq / --first-k-dense-replace leave a pipeline stage of {per_stage} layers without an MoE "
             "layer (MindSpeed-LLM refuses it too); give a pattern with MoE layers in every stage")
    if args.moe_token_dispatcher_type == "alltoall_seq" and megatron_core_in(">=0.13"):
        # alltoall_seq (megatron/core/transformer/moe/legacy_a2a_token_dispatcher.py, 0.12.1) was removed in 0.13;
        # it sends the same tokens to the same experts as alltoall, which differs only in where the sequence
        # dimension is gathered (its all-to-all over the TP x EP group); test_moe.py's layouts: both equal one process
        args.moe_token_dispatcher_type = "alltoall"
        if int(os.environ.get("RANK", "0")) == 0:
            print(" WARNING: --moe-token-dispatcher-type alltoall_seq is megatron-core 0.12's (removed in 0.13); "
                  "this megatron-core runs the alltoall dispatcher, which routes the same tokens to the same "
                  "experts", file=sys.stderr)


def tp_extended_ep(args: argparse.Namespace, fail) -> tuple[int, int]:
    """MindSpeed's --moe-tp-extend-ep as megatron-core's layout: (expert-parallel size, expert-tensor-parallel size)
    = (EP x TP, 1), set on args. MindSpeed gives the rank of expert-parallel rank e and tensor-parallel rank t the
    E / (EP x TP) whole experts from (e x TP + t) x that count (mindspeed/core/transformer/moe/moe_feature/overlap/
    moe_layer.py:37-43, its grouped MLP built at expert-TP size 1, mindspeed/core/transformer/moe/experts.py:109-118)
    and exchanges tokens over the expert tensor-and-model-parallel group (mindspeed/core/transformer/moe/
    legacy_a2a_token_dispatcher.py:692-693,785-786), without the sequence-to-hidden all-to-all over TP (:672,819):
    megatron-core's alltoall dispatcher at ETP 1 over an expert-parallel group of those same ranks, in that order
    (its expert ranks run TP fastest: parallel_state.initialize_model_parallel's RankGenerator, order tp-ep-dp-pp)."""
    from megatron_glue.capture.adaptations import megatron_core_in

    tp, ep, etp = args.tensor_model_parallel_size, args.expert_model_parallel_size, args.expert_tensor_parallel_size
    if etp is not None and etp != tp:
        fail(f"--moe-tp-extend-ep spreads the experts over the tensor-parallel ranks instead of splitting each over "
             f"--expert-tensor-parallel-size; {etp} given with --tensor-model-parallel-size {tp}: drop one of them")
    if args.moe_token_dispatcher_type not in ("alltoall", "alltoall_seq"):
        fail(f"--moe-tp-extend-ep exchanges tokens by all-to-all over the tensor x expert-parallel ranks (MindSpeed: "
             f"alltoall_seq only, docs/zh/features/megatron_moe/megatron-moe-tp-extend-ep.md); this job's "
             f"--moe-token-dispatcher-type is {args.moe_token_dispatcher_type!r}: give alltoall or alltoall_seq")
    if args.num_experts % (tp * ep):  # MindSpeed's rule (mindspeed/arguments.py:617-619)
        fail(f"--moe-tp-extend-ep puts whole experts on each of --tensor-model-parallel-size {tp} x "
             f"--expert-model-parallel-size {ep} ranks: --num-experts {args.num_experts} must be divisible by "
             f"{tp * ep}")
    if args.moe_token_dispatcher_type == "alltoall_seq" and not megatron_core_in(">=0.13"):
        # megatron-core 0.12's alltoall_seq takes expert-TP = TP only (transformer/transformer_config.py:948-952);
        # its alltoall dispatcher at ETP 1 is MindSpeed's exchange
        args.moe_token_dispatcher_type = "alltoall"
    args.expert_model_parallel_size, args.expert_tensor_parallel_size = tp * ep, 1
    return tp * ep, 1


def validate_recompute(args: argparse.Namespace, fail) -> None:
    """Megatron-LM's recompute rules (megatron/training/arguments.py validate_args and TransformerConfig's
    __post_init__, core_v0.16.1; docs/recompute.md cites the lines), each broken one a one-line error.
    Afterwards args.recompute_activations is gone, as in Megatron-LM, and recompute_granularity says it all."""
    if args.recompute_activations:  # Megatron-LM: --recompute-activations sets selective, over any granularity
        args.recompute_granularity = "selective"
    del args.recompute_activations
    granularity, method, n = args.recompute_granularity, args.recompute_method, args.recompute_num_layers
    per_stage = min(stage_layer_counts(args))
    per_chunk = per_stage // (args.virtual_pipeline_model_parallel_size or 1)
    if granularity is None:
        if method is not None or n is not None:
            given = "--recompute-method" if method is not None else "--recompute-num-layers"
            fail(f"{given} has no effect without --recompute-granularity full (Megatron-LM ignores it); give "
                 "--recompute-granularity full, or drop it")
        return
    if granularity == "selective":
        fusions = args.npu_compile_options.get("fusions", "all")
        attention_fused = fusions == "all" or (fusions.get("attention", False) if isinstance(fusions, dict)
                                               else "attention" in fusions)
        if args.npu_compile and not attention_fused:
            fail("--recompute-granularity selective (core attention) is done by the fused attention, whose backward "
                 "recomputes the attention probabilities, and --npu-compile-options 'fusions' leaves the attention "
                 "rule out; add \"attention\" to 'fusions', or drop the recompute flag")
        if method is not None:
            fail("--recompute-method is not supported with --recompute-granularity selective (Megatron-LM: "
                 "recompute method is not yet supported for selective recomputing granularity); drop "
                 "--recompute-method, or use --recompute-granularity full")
        if n is not None:
            fail("--recompute-num-layers must be None with --recompute-granularity selective (selective "
                 "recomputes core attention in every layer); drop --recompute-num-layers")
        return
    if method is None:
        fail('--recompute-granularity full needs --recompute-method "block" or "uniform"')
    if n is None or n < 1:
        got = "" if n is None else f" (got {n})"
        fail(f"--recompute-granularity full needs --recompute-num-layers between 1 and the {per_chunk} layers of "
             f"each model chunk{got}")
    if args.npu_compile and (args.hidden_dropout > 0 or args.attention_dropout > 0):
        # the checkpointed forward runs the layer's no-grad graph, the recompute its training graph, and the two
        # draw their dropout seeds in different orders: the backward would use other masks than the forward's
        fail(f"--recompute-granularity full in the compiled job needs --hidden-dropout 0 and --attention-dropout 0 "
             f"(got {args.hidden_dropout} and {args.attention_dropout}): the recomputed layer's graph draws its "
             "dropout masks in another order than the forward's; set both to 0, or run --no-npu-compile")
    vpp = args.virtual_pipeline_model_parallel_size or 1
    uneven = sorted({c // vpp for c in stage_layer_counts(args) if (c // vpp) % n})
    if method == "uniform" and uneven:
        # Megatron's uniform loop steps over chunks of n layers and would index past the last layer
        fail(f"--recompute-method uniform checkpoints chunks of --recompute-num-layers {n} layers, which must "
             f"divide the {uneven[0]} layers of each model chunk; use a divisor of {uneven[0]}")


def validate_recompute_activation_function(args: argparse.Namespace, fail) -> None:
    """--recompute-activation-function: MindSpeed's own rules (mindspeed/arguments.py validate_args), and what the
    compiled job needs to recompute the activation (its fused op)."""
    if args.recompute_granularity == "selective":
        fail("--recompute-activation-function is not compatible with --recompute-granularity selective (MindSpeed "
             "refuses the pair too); drop one of them")
    if args.recompute_method == "uniform":
        fail("--recompute-activation-function is not compatible with --recompute-method uniform (MindSpeed refuses "
             "the pair too: every layer is recomputed whole); drop one of them, or use --recompute-method block")
    if not args.npu_compile:
        fail("--recompute-activation-function is done by the compiler (the fused activation ops recomputed in "
             "every layer graph), which --no-npu-compile turns off; in the eager job it is not implemented here: "
             "drop one of them")
    rule = "swiglu" if args.swiglu else "bias_gelu"
    fusions = args.npu_compile_options.get("fusions", "all")
    if fusions != "all" and not (fusions.get(rule, True) if isinstance(fusions, dict) else rule in fusions):
        fail(f"--recompute-activation-function recomputes the backend's fused activation op, and "
             f"--npu-compile-options 'fusions' leaves its rule \"{rule}\" out; add it, or drop the flag")


def validate_gradient_precision(args: argparse.Namespace, fail) -> None:
    """The gradients' dtype as Megatron-LM sets it (megatron/training/arguments.py `validate_args`, the `if args.bf16`
    branch): under --bf16 accumulated and reduced in fp32 unless --grad-reduce-in-bf16; MindSpeed-LLM's O2 flags on
    top (o2.py)."""
    if args.o2_gradient:
        args.grad_reduce_in_bf16 = True
    for flag in ("o2_gradient", "o2_optimizer", "grad_reduce_in_bf16"):
        if getattr(args, flag) and not args.bf16:  # MindSpeed-LLM's _validate_o2 too
            fail(f"--{flag.replace('_', '-')} keeps bf16 {'Adam moments' if flag == 'o2_optimizer' else 'gradients'}:"
                 f" it needs --bf16")
    if args.o2_optimizer and args.optimizer != "adam":
        fail(f"--o2-optimizer keeps Adam's moments in bf16; --optimizer {args.optimizer} has none: use --optimizer "
             f"adam or drop --o2-optimizer")
    if args.bf16:
        if args.grad_reduce_in_bf16 and args.accumulate_allreduce_grads_in_fp32:
            fail(f"--{'o2-gradient' if args.o2_gradient else 'grad-reduce-in-bf16'} and "
                 f"--accumulate-allreduce-grads-in-fp32 ask for bf16 and fp32 gradients; pick one")
        args.accumulate_allreduce_grads_in_fp32 = not args.grad_reduce_in_bf16


# MindSpeed's --swap-modules default (mindspeed/arguments.py:319, features_manager/memory/swap_attention.py)
SWAP_MODULES_DEFAULT = "input_norm,self_attention,post_attention_norm"
# MindSpeed's names of the legacy layer's norms -> megatron-core TransformerLayer's attributes for them
SWAP_MODULE_NAMES = {"input_norm": "input_layernorm", "post_attention_norm": "pre_mlp_layernorm"}
# what --swap-modules may name: megatron-core's TransformerLayer submodules (local spec) and theirs
SWAP_MODULES_KNOWN = ("input_layernorm", "self_attention", "pre_mlp_layernorm", "mlp", "linear_qkv", "core_attention",
                      "linear_proj", "q_layernorm", "k_layernorm", "linear_fc1", "linear_fc2")


def swap_attention_modules(args: argparse.Namespace, fail) -> list[str]:
    """--swap-attention / --swap-modules: the module names for the backend's option offload ([] without the flag);
    MindSpeed's rules and what the compiled job needs, each a one-line error."""
    if not args.swap_attention:
        if args.swap_modules is not None:
            fail("--swap-modules names the modules --swap-attention offloads, and --swap-attention is not given; "
                 "add it or drop --swap-modules")
        return []
    if not args.npu_compile:
        fail("--swap-attention is done by the compiler (the backend's option offload: host copies in every layer "
             "graph), which --no-npu-compile turns off; in the eager job it is not implemented here: drop one of them")
    if args.recompute_granularity is not None:
        fail(f"--swap-attention with --recompute-granularity {args.recompute_granularity}: MindSpeed pairs its swap "
             "with its own recompute of the layers' MLPs (--recompute-num-layers), not Megatron's checkpointing, "
             "and that pairing is not implemented here; drop one of them")
    names = [n.strip() for n in (args.swap_modules or SWAP_MODULES_DEFAULT).split(",") if n.strip()]
    modules = [SWAP_MODULE_NAMES.get(n, n) for n in names]
    unknown = [n for n, m in zip(names, modules) if m not in SWAP_MODULES_KNOWN]
    if unknown or not modules:
        fail(f"--swap-modules {args.swap_modules!r} names {', '.join(unknown) or 'no module'}; it takes "
             f"comma-separated modules of a transformer layer: {', '.join(SWAP_MODULES_KNOWN)} (or MindSpeed's "
             f"{', '.join(SWAP_MODULE_NAMES)})")
    return list(dict.fromkeys(modules))


def validate_reuse_fp32_param(args: argparse.Namespace, fail) -> None:
    """--reuse-fp32-param (megatron_glue/training/reuse_fp32_param.py): what it is built on, each missing piece a
    one-line error."""
    if not args.bf16:  # MindSpeed's dependency_check(args, 'bf16') too
        fail("--reuse-fp32-param keeps each fp32 master weight as its bf16 weight plus a residual: it needs --bf16")
    if not args.use_distributed_optimizer:
        fail("--reuse-fp32-param is implemented here on megatron-core's distributed optimizer: add "
             "--use-distributed-optimizer")


def default_ffn_hidden_size(hidden_size: int, swiglu: bool) -> int:
    """Megatron-LM's default --ffn-hidden-size (megatron/training/arguments.py, validate_args): 4h, and with
    --swiglu 2/3 of that rounded down to a multiple of 64 (hidden 4096: 10880)."""
    return int((4 * hidden_size * 2 / 3) / 64) * 64 if swiglu else 4 * hidden_size


def validate_moe_overlap(args, flag: str, fail) -> None:
    """MindSpeed's MoE overlap switches are the backend's overlap scheduler planning with the MoE token counts
    (rule moe_token_hints): compiled, overlap on; --moe-alltoall-overlap-comm, as MindSpeed, behind an all-to-all
    dispatcher at EP > 1 (mindspeed/features_manager/moe/moe_alltoall_overlap.py:24-28)."""
    if not args.npu_compile:
        fail(f"{flag} is the backend's overlap scheduler (planning with the MoE token counts: rule moe_token_hints), "
             "which --no-npu-compile turns off; drop one of them")
    if args.npu_compile_options.get("overlap", True) is False:
        fail(f"{flag} is the backend's overlap scheduler (npu_compile option overlap), but --npu-compile-options "
             "gives overlap=false; drop one of them")
    if flag == "--moe-alltoall-overlap-comm":
        if args.moe_token_dispatcher_type not in ("alltoall", "alltoall_seq"):
            fail(f"--moe-alltoall-overlap-comm overlaps the all-to-all dispatcher's token exchange, as MindSpeed's "
                 f"(alltoall or alltoall_seq); this job's --moe-token-dispatcher-type is "
                 f"{args.moe_token_dispatcher_type!r}")
        if args.expert_model_parallel_size == 1:
            fail("--moe-alltoall-overlap-comm overlaps the token all-to-all, which --expert-model-parallel-size 1 "
                 "does not have (MindSpeed refuses it there too); give an expert-parallel size above 1 or drop it")


def compile_options(options: dict, switched_on: list[str], mc2: bool) -> dict:
    """`--npu-compile-options` with MindSpeed's switches applied: each switch turns its fusions on (they are on
    unless `fusions` says otherwise); `--use-ascend-mc2` sets option `mc2` to "on": as MindSpeed's MC2 linears, every
    all-gather + matmul and matmul + reduce-scatter torch_npu takes becomes one MC2 op, whatever the cost model
    would choose (without the flag, `mc2` stays as given, by default "auto": the cost model's choice)."""
    options = dict(options)
    fusions = options.get("fusions", "all")
    if switched_on and fusions != "all":
        if isinstance(fusions, dict):
            fusions = {**fusions, **{rule: True for rule in switched_on}}
        elif isinstance(fusions, list):
            fusions = list(dict.fromkeys([*fusions, *switched_on]))
        options["fusions"] = fusions
    if mc2:
        options["mc2"] = "on"
    return options


def validate_lora(args: argparse.Namespace, fail) -> None:
    """MindSpeed-LLM's --lora-* flags (features_manager/finetune/lora.py: defaults r 16, alpha 32): LoRA is on with
    --lora-target-modules (its is_enable_lora); the other flags without it would be ignored there, and are refused
    here."""
    from megatron_glue.training.lora import TARGETS

    given = [flag for flag, on in (("--lora-r", args.lora_r is not None), ("--lora-alpha", args.lora_alpha is not None),
                                   ("--lora-load", args.lora_load is not None), ("--lora-fusion", args.lora_fusion),
                                   ("--lora-ckpt-filter", args.lora_ckpt_filter)) if on]
    if not args.lora_target_modules:
        if given:
            fail(f"{', '.join(given)} without --lora-target-modules: LoRA is on only with --lora-target-modules "
                 f"(any of {' '.join(TARGETS)}); give it, or drop {', '.join(given)}")
        return
    unknown = [m for m in args.lora_target_modules if m not in TARGETS]
    if unknown:
        fail(f"--lora-target-modules {' '.join(unknown)}: not a linear of this job's layers; choose from "
             f"{' '.join(TARGETS)}")
    args.lora_target_modules = list(dict.fromkeys(args.lora_target_modules))
    args.lora_r = 16 if args.lora_r is None else args.lora_r
    args.lora_alpha = 32 if args.lora_alpha is None else args.lora_alpha
    if args.lora_r <= 0:
        fail(f"--lora-r {args.lora_r}: the adapters' rank must be a positive integer (MindSpeed-LLM's tune scripts "
             "give 8 or 16)")
    if args.num_experts:
        fail("--lora-target-modules with --num-experts: LoRA on MoE layers (MindSpeed-LLM's LoRA experts) is not "
             "implemented here; LoRA adapts dense models")
    if getattr(args, "full_attention_interval", None):
        fail(LINEAR_ATTENTION.format("LoRA (--lora-target-modules)"))
    if args.lora_fusion and not args.npu_compile:
        fail("--lora-fusion is the compiled layer graph (base matmul, collective and adapters together), which "
             "--no-npu-compile turns off; drop one of them")
    if args.ckpt_format != "torch" and (args.save or args.load or args.lora_load):
        fail(f"--lora-target-modules with --ckpt-format {args.ckpt_format}: LoRA checkpoints are written and read in "
             "the torch format here (MindSpeed-LLM's tune scripts give --ckpt-format torch, and its "
             "--lora-ckpt-filter applies to that format only); give --ckpt-format torch")
    from megatron_glue.capture.adaptations import megatron_core_in

    if (args.pipeline_model_parallel_size > 1 and not args.untie_embeddings_and_output_weights
            and not megatron_core_in(">=0.13")):
        fail("--lora-target-modules with tied embeddings over pipeline stages on megatron-core "
             "<0.13: its finalize_model_grads all-reduces the embedding's gradient, which the frozen embedding does "
             "not have (0.12.1: distributed/finalize_model_grads.py:145-151); give "
             "--untie-embeddings-and-output-weights, or use megatron-core 0.16")
