"""`npu-compile convert`: HuggingFace <-> Megatron checkpoints, with MindSpeed-LLM's `convert_ckpt_v2.py` flags.

    npu-compile convert --load-model-type hf --save-model-type mg --load-dir HF_DIR --save-dir MG_DIR \\
        [--model-type-hf llama3] [--target-tensor-parallel-size 2] [--target-pipeline-parallel-size 2]
    npu-compile convert --load-model-type mg --save-model-type hf --load-dir MG_DIR --save-dir HF_OUT \\
        [--hf-cfg-dir HF_DIR]
    npu-compile convert --load-model-type tf --save-model-type mg --load-dir GPT2_TF_DIR --save-dir MG_DIR

`--load-model-type tf`: OpenAI's GPT-2 TensorFlow checkpoints (model.ckpt.* + hparams.json), read without
TensorFlow (`tf_bundle`) as the transformers GPT-2 they convert to (`tf_io`), then as hf -> mg.

hf -> mg writes Megatron-LM's layout (`latest_checkpointed_iteration.txt` = release, `release/` in
megatron-core's torch_dist format, which reshards to any TP/PP when loaded; or with `--ckpt-format torch` the legacy
`mp_rank_XX[_PPP]/model_optim_rng.pt` files of the target TP x PP, stages even or by `--num-layer-list`) and
`model_flags.txt`, the architecture flags `megatron_glue.pretrain_gpt --load MG_DIR --finetune` needs. Families:
`families.FAMILIES`, named as MindSpeed-LLM names them (`families.MODEL_TYPES`).

MindSpeed-LLM's conversion scripts (examples/mcore/*/ckpt_convert_*.sh: convert_ckpt_v2.py's flags, and
convert_ckpt.py's on its 2.x branches) run as they are for the dense families: `--model-type GPT`,
`--use-mcore-models`, `--params-dtype`, `--tokenizer-model`, `--add-qkv-bias`, `--post-norm`, `--spec ...qwen3_spec`,
`--num-layer-list`, `--num-layers-per-virtual-pipeline-stage`, `--save-layer-by-layer` are taken (see --help);
the flags of features not converted here (MoE, MTP, MLA, LoRA, noop layers, ...) are refused naming the feature.
"""

from __future__ import annotations

import argparse
import os
import sys

from megatron_glue.convert.families import MODEL_TYPES, ConfigError, model_type_refusal


# MindSpeed-LLM's --params-dtype values (its convert_ckpt.py: fp16 (its default), bf16; fp32)
PARAMS_DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}
# MindSpeed-LLM's --spec modules -> the family whose layer spec they are (megatron-core's local spec with the flag)
SPECS = {"mindspeed_llm.tasks.models.spec.qwen3_spec": "--qk-layernorm"}
# Flags of MindSpeed-LLM's convert_ckpt_v2.py / convert_ckpt.py that this converter refuses:
# flag -> (argparse kind, the value that means "not used" (None: any use), the feature it needs)
_MOE = ("this mixture-of-experts layout (Mixtral, Qwen2-MoE and Qwen3-MoE convert with SequentialMLP experts at "
        "expert-parallel size 1, every layer MoE)")
_LORA = "LoRA weights"
REFUSED = {
    "--noop-layers": (str, None, "noop layers (MindSpeed-LLM's empty layers that pad the pipeline)"),
    "--moe-grouped-gemm": (bool, None, _MOE), "--moe-tp-extend-ep": (bool, None, _MOE),
    "--expert-tensor-parallel-size": (int, None, _MOE),
    "--first-k-dense-replace": (int, None, _MOE),
    "--mtp-num-layers": (int, "0", "multi-token prediction (MTP) layers"),
    "--mla-mm-split": (bool, None, "multi-latent attention (MLA)"),
    "--schedules-method": (str, None, "the DualPipeV schedule's layer placement"),
    "--lora-r": (int, None, _LORA), "--lora-alpha": (int, None, _LORA), "--lora-load": (str, None, _LORA),
    "--lora-target-modules": ("+", None, _LORA), "--save-lora-to-hf": (bool, None, _LORA),
    "--qlora-nf4": (bool, None, "QLoRA's NF4 quantization"),
    "--orm": (bool, None, "outcome reward models (an rm_head)"),
    "--add-dense-bias": (bool, None, "a bias on the attention output projection"),
    "--w-pack": (str, None, "InternLM2's packed wqkv"),
    "--transformer-impl": (str, "local", "Transformer Engine layers (the local layer spec is what is written)"),
}


def build_parser() -> argparse.ArgumentParser:
    from megatron_glue.training.arguments import ArgumentParser

    p = ArgumentParser(prog="npu-compile convert", allow_abbrev=False,
                       description="Convert HuggingFace <-> Megatron (megatron-core GPTModel) checkpoints, "
                                   "streamed layer by layer. Takes the flags of MindSpeed-LLM's convert_ckpt_v2.py "
                                   "and convert_ckpt.py scripts for the dense families.")
    p.add_argument("--load-model-type", choices=["hf", "mg", "tf"], required=True,
                   help="hf: a transformers folder; mg: a Megatron checkpoint; tf: OpenAI's GPT-2 TensorFlow "
                        "checkpoint (model.ckpt.index, model.ckpt.data-*, hparams.json), to mg")
    p.add_argument("--save-model-type", choices=["hf", "mg"], required=True)
    p.add_argument("--load-dir", required=True)
    p.add_argument("--save-dir", required=True)
    p.add_argument("--model-type-hf", default=None,
                   help=f"the HF family, by MindSpeed-LLM's name: {', '.join(MODEL_TYPES)} (llama2 also takes "
                        "Qwen2-layout checkpoints, as MindSpeed-LLM's convert_ckpt.py scripts use it); default: "
                        "config.json's model_type")
    p.add_argument("--model-type", default="GPT", help="GPT (MindSpeed-LLM's convert_ckpt.py: GPT or BERT)")
    p.add_argument("--use-mcore-models", action="store_true",
                   help="no effect: the Megatron side is always megatron-core's GPTModel (no legacy model)")
    p.add_argument("--params-dtype", choices=sorted(PARAMS_DTYPES), default=None,
                   help="the dtype of the weights written (hf -> mg: the checkpoint's; mg -> hf: the HF "
                        "weights'); default: the source's")
    p.add_argument("--tokenizer-model", default=None,
                   help="hf -> mg: the tokenizer file or folder, recorded in the checkpoint's args as "
                        "MindSpeed-LLM's convert_ckpt.py does (the vocabulary comes from config.json)")
    p.add_argument("--add-qkv-bias", action="store_true",
                   help="says the model has q/k/v biases (MindSpeed-LLM's convert_ckpt.py for Qwen): checked "
                        "against config.json's family, which decides")
    p.add_argument("--post-norm", action="store_true",
                   help="says the model has post-attention and post-MLP norms (MindSpeed-LLM's, Gemma 2): checked "
                        "against config.json's family, which decides")
    p.add_argument("--spec", nargs="*", default=None,
                   help=f"MindSpeed-LLM's layer spec module: {', '.join(SPECS)} (qwen3's q/k norms), checked "
                        "against the family")
    p.add_argument("--target-tensor-parallel-size", type=int, default=1,
                   help="hf -> mg: the TP size the vocabulary is padded for and checked against (the torch_dist "
                        "checkpoint itself loads at any TP)")
    p.add_argument("--target-pipeline-parallel-size", type=int, default=1)
    p.add_argument("--target-expert-parallel-size", type=int, default=1,
                   help="hf -> mg, an MoE model: checked to divide the experts; no effect on the torch_dist "
                        "checkpoint, whose expert axis is global (the job's --expert-model-parallel-size splits it "
                        "when it loads)")
    p.add_argument("--num-layer-list", default=None,
                   help="uneven PP, layers per stage, e.g. 3,5: with --ckpt-format torch the files' stages; a "
                        "torch_dist checkpoint is layout-free (checked against the model, no effect on it)")
    p.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None,
                   help="VPP: checked against the model; no effect on a torch_dist checkpoint, which the job "
                        "splits into virtual stages when it loads (--ckpt-format torch with VPP is refused)")
    p.add_argument("--ckpt-format", choices=["torch_dist", "torch"], default=None,
                   help="hf -> mg: torch_dist (default; loads at any TP/PP) or torch, Megatron-LM's legacy "
                        "mp_rank_XX[_PPP]/model_optim_rng.pt files split for --target-tensor-parallel-size x "
                        "--target-pipeline-parallel-size (loads only at that layout); mg -> hf detects the format")
    p.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    p.add_argument("--hf-cfg-dir", default=None, help="mg -> hf: the HF folder whose config.json (and tokenizer "
                                                      "files) the output gets")
    p.add_argument("--save-layer-by-layer", action="store_true",
                   help="no effect: this converter always writes one layer at a time")
    for flag, (kind, _, _) in REFUSED.items():
        if kind is bool:
            p.add_argument(flag, action="store_true", default=None, help=argparse.SUPPRESS)
        else:
            p.add_argument(flag, nargs="+" if kind == "+" else None, type=None if kind == "+" else kind,
                           default=None, help=argparse.SUPPRESS)
    return p


def _refusals(a) -> None:
    """One line for the first flag of the command line this converter does not implement."""
    from megatron_glue.training.arguments import ArgumentError

    if a.model_type_hf is not None and a.model_type_hf not in MODEL_TYPES:
        raise ArgumentError(f"npu-compile convert: error: {model_type_refusal(a.model_type_hf)}")
    if a.model_type != "GPT":
        raise ArgumentError(f"npu-compile convert: error: --model-type {a.model_type}: converts GPT models only")
    for flag, (_, harmless, feature) in REFUSED.items():
        value = getattr(a, flag[2:].replace("-", "_"))
        if value is not None and not (harmless is not None and str(value) == harmless):
            raise ArgumentError(f"npu-compile convert: error: {flag} is not implemented here: this converter "
                                f"does not convert {feature}")
    if a.spec is not None and (not a.spec or a.spec[0] not in SPECS or len(a.spec) > 2):
        raise ArgumentError(f"npu-compile convert: error: --spec {' '.join(a.spec)}: the spec modules converted "
                            f"here: {', '.join(SPECS)} (megatron-core's local layer spec with q/k norms)")


def _expected(a) -> dict[str, str]:
    """{pretrain_gpt architecture flag: the words of the command line that said the model has it}."""
    out = {}
    if a.add_qkv_bias:
        out["--add-qkv-bias"] = "--add-qkv-bias"
    if a.post_norm:
        out["--post-norm"] = "--post-norm"
    if a.spec:
        out[SPECS[a.spec[0]]] = f"--spec {' '.join(a.spec)}"
    return out


def _freed_memory_back_to_the_os() -> None:
    """glibc: allocations of 1 MiB and more straight from mmap, so that a tensor the converter lets go of is
    returned to the OS at once. By default glibc raises this threshold to the size of each large block freed (up
    to 32 MiB) and keeps freed heap memory: the resident set would grow by layers the converter no longer holds."""
    import ctypes

    try:
        ctypes.CDLL(None).mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):  # not glibc
        pass


def main(argv: list[str] | None = None) -> int:
    from megatron_glue.training.arguments import ArgumentError
    from megatron_glue.convert import core, hf_io, legacy
    from megatron_glue.convert.tf_bundle import TFCheckpointError

    _freed_memory_back_to_the_os()
    try:
        a = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
        _refusals(a)
        if (a.load_model_type, a.save_model_type) not in (("hf", "mg"), ("mg", "hf"), ("tf", "mg")):
            raise ArgumentError(f"npu-compile convert: error: --load-model-type {a.load_model_type} --save-model-type "
                                f"{a.save_model_type}: converts hf -> mg, mg -> hf or tf -> mg")
        if a.load_model_type == "tf" and a.model_type_hf not in (None, "gpt2"):
            raise ArgumentError(f"npu-compile convert: error: --load-model-type tf --model-type-hf {a.model_type_hf}: "
                                "TensorFlow checkpoints are read in OpenAI's GPT-2 layout only; give "
                                "--model-type-hf gpt2 or leave it out")
        layer_list = None
        if a.num_layer_list is not None:
            try:
                layer_list = [int(x) for x in a.num_layer_list.split(",")]
            except ValueError:
                raise ArgumentError(f"npu-compile convert: error: --num-layer-list {a.num_layer_list!r}: expected "
                                    "comma-separated layer counts, e.g. 3,5")
        import torch

        dtype = getattr(torch, PARAMS_DTYPES[a.params_dtype]) if a.params_dtype else None
        if a.load_model_type in ("hf", "tf"):
            if a.hf_cfg_dir is not None:
                raise ArgumentError(f"npu-compile convert: error: --hf-cfg-dir is for mg -> hf; {a.load_model_type} "
                                    f"-> mg reads --load-dir's {'config' if a.load_model_type == 'hf' else 'hparams'}"
                                    ".json")
            fmt = a.ckpt_format or "torch_dist"
            vpp = a.num_layers_per_virtual_pipeline_stage
            if vpp is not None:
                _check_vpp(a, vpp, layer_list, fmt)
            if a.tokenizer_model is not None and not os.path.exists(a.tokenizer_model):
                raise core.ConvertError(f"--tokenizer-model {a.tokenizer_model}: no such file or folder")
            args = core.hf_to_mg(a.load_dir, a.save_dir, a.model_type_hf, a.target_tensor_parallel_size,
                                 a.target_pipeline_parallel_size, layer_list, a.make_vocab_size_divisible_by, fmt,
                                 dtype, _expected(a),
                                 os.path.abspath(a.tokenizer_model) if a.tokenizer_model else None,
                                 a.target_expert_parallel_size, a.load_model_type)
            if fmt == "torch_dist":
                ep = a.target_expert_parallel_size
                for flag, value in (("--target-expert-parallel-size", ep if ep != 1 else None),
                                    ("--num-layer-list", a.num_layer_list),
                                    ("--num-layers-per-virtual-pipeline-stage", vpp)):
                    if value is not None:
                        print(f"npu-compile convert: note: {flag} {value} leaves a torch_dist checkpoint as it is "
                              "(layout-free: the job splits it when it loads, with its own flag)", file=sys.stderr)
            layout = "torch_dist" if fmt == "torch_dist" else (
                f"torch, for --ckpt-format torch --tensor-model-parallel-size {a.target_tensor_parallel_size} "
                f"--pipeline-model-parallel-size {a.target_pipeline_parallel_size}")
            print(f"npu-compile convert: wrote {a.save_dir} (release, {layout}); pretrain_gpt flags: "
                  f"{open(f'{a.save_dir}/{core.FLAGS_FILE}').read().strip()}", file=sys.stderr)
            del args
        else:
            for flag, value, default in (("--target-tensor-parallel-size", a.target_tensor_parallel_size, 1),
                                         ("--target-pipeline-parallel-size", a.target_pipeline_parallel_size, 1),
                                         ("--target-expert-parallel-size", a.target_expert_parallel_size, 1),
                                         ("--num-layer-list", a.num_layer_list, None),
                                         ("--num-layers-per-virtual-pipeline-stage",
                                          a.num_layers_per_virtual_pipeline_stage, None),
                                         ("--make-vocab-size-divisible-by", a.make_vocab_size_divisible_by, 128),
                                         ("--ckpt-format", a.ckpt_format, None),
                                         ("--tokenizer-model", a.tokenizer_model, None)):
                if value != default:
                    raise ArgumentError(f"npu-compile convert: error: {flag} is for hf -> mg; mg -> hf reads the "
                                        "checkpoint's own layout and format")
            core.mg_to_hf(a.load_dir, a.save_dir, a.hf_cfg_dir, a.model_type_hf, dtype, _expected(a))
            print(f"npu-compile convert: wrote {a.save_dir} (safetensors + config.json)", file=sys.stderr)
    except ArgumentError as e:
        print(e.message, file=sys.stderr)
        return 2
    except (core.ConvertError, ConfigError, hf_io.HFCheckpointError, legacy.LegacyCheckpointError,
            TFCheckpointError) as e:
        print(f"npu-compile convert: error: {e}", file=sys.stderr)
        return 1
    return 0


def _check_vpp(a, vpp: int, layer_list, fmt: str) -> None:
    """Megatron-LM's rules for --num-layers-per-virtual-pipeline-stage, on the model's layer count."""
    from megatron_glue.convert import core, hf_io
    from megatron_glue.convert.families import family_for
    from megatron_glue.training.arguments import ArgumentError

    flag = f"--num-layers-per-virtual-pipeline-stage {vpp}"
    if fmt == "torch":
        raise ArgumentError(f"npu-compile convert: error: {flag} with --ckpt-format torch is not implemented here: "
                            "virtual-pipeline legacy files (model0, model1, ... per rank) are not written; leave "
                            "--ckpt-format out for a torch_dist checkpoint, which the job loads at any VPP")
    if layer_list is not None:
        raise ArgumentError(f"npu-compile convert: error: {flag} and --num-layer-list: give one of them "
                            "(Megatron-LM splits virtual stages evenly)")
    pp = a.target_pipeline_parallel_size
    if a.load_model_type == "tf":
        from megatron_glue.convert import tf_io

        cfg = tf_io.gpt2_config(a.load_dir)
    else:
        cfg = hf_io.read_config(a.load_dir)
    family = family_for(a.model_type_hf, cfg)
    flags = core.architecture_flags(family, cfg)
    num_layers = int(flags[flags.index("--num-layers") + 1])
    if vpp < 1 or pp < 2 or num_layers % pp or (num_layers // pp) % vpp:
        raise core.ConvertError(f"{flag}: with --target-pipeline-parallel-size {pp} the model's {num_layers} layers "
                                "need PP > 1 and layers per stage divisible by it (Megatron-LM's virtual pipeline)")
