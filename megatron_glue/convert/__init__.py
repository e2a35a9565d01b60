"""`npu-compile convert`: HuggingFace <-> Megatron checkpoints, with MindSpeed-LLM's `convert_ckpt_v2.py` flags.

    npu-compile convert --load-model-type hf --save-model-type mg --load-dir HF_DIR --save-dir MG_DIR \\
        [--model-type-hf llama3] [--target-tensor-parallel-size 2] [--target-pipeline-parallel-size 2]
    npu-compile convert --load-model-type mg --save-model-type hf --load-dir MG_DIR --save-dir HF_OUT \\
        [--hf-cfg-dir HF_DIR]

hf -> mg writes Megatron-LM's layout (`latest_checkpointed_iteration.txt` = release, `release/` in
megatron-core's torch_dist format, which reshards to any TP/PP when loaded; or with `--ckpt-format torch` the legacy
`mp_rank_XX[_PPP]/model_optim_rng.pt` files of the target TP x PP, stages even or by `--num-layer-list`) and
`model_flags.txt`, the architecture flags `megatron_glue.pretrain_gpt --load MG_DIR --finetune` needs. Families:
`families.FAMILIES`.
"""

from __future__ import annotations

import argparse
import sys

from megatron_glue.convert.families import MODEL_TYPES, ConfigError


def build_parser() -> argparse.ArgumentParser:
    from megatron_glue.training.arguments import ArgumentParser

    p = ArgumentParser(prog="npu-compile convert", allow_abbrev=False,
                       description="Convert HuggingFace <-> Megatron (megatron-core GPTModel) checkpoints, "
                                   "streamed layer by layer.")
    p.add_argument("--load-model-type", choices=["hf", "mg"], required=True)
    p.add_argument("--save-model-type", choices=["hf", "mg"], required=True)
    p.add_argument("--load-dir", required=True)
    p.add_argument("--save-dir", required=True)
    p.add_argument("--model-type-hf", choices=sorted(MODEL_TYPES), default=None,
                   help="the HF family; default: config.json's model_type")
    p.add_argument("--target-tensor-parallel-size", type=int, default=1,
                   help="hf -> mg: the TP size the vocabulary is padded for and checked against (the torch_dist "
                        "checkpoint itself loads at any TP)")
    p.add_argument("--target-pipeline-parallel-size", type=int, default=1)
    p.add_argument("--num-layer-list", default=None, help="--ckpt-format torch, uneven PP: layers per stage, "
                                                          "e.g. 3,5")
    p.add_argument("--ckpt-format", choices=["torch_dist", "torch"], default=None,
                   help="hf -> mg: torch_dist (default; loads at any TP/PP) or torch, Megatron-LM's legacy "
                        "mp_rank_XX[_PPP]/model_optim_rng.pt files split for --target-tensor-parallel-size x "
                        "--target-pipeline-parallel-size (loads only at that layout); mg -> hf detects the format")
    p.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    p.add_argument("--hf-cfg-dir", default=None, help="mg -> hf: the HF folder whose config.json (and tokenizer "
                                                      "files) the output gets")
    return p


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

    _freed_memory_back_to_the_os()
    try:
        a = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
        if (a.load_model_type, a.save_model_type) not in (("hf", "mg"), ("mg", "hf")):
            raise ArgumentError(f"npu-compile convert: error: --load-model-type {a.load_model_type} --save-model-type "
                                f"{a.save_model_type}: converts hf -> mg or mg -> hf")
        layer_list = None
        if a.num_layer_list is not None:
            try:
                layer_list = [int(x) for x in a.num_layer_list.split(",")]
            except ValueError:
                raise ArgumentError(f"npu-compile convert: error: --num-layer-list {a.num_layer_list!r}: expected "
                                    "comma-separated layer counts, e.g. 3,5")
        if a.load_model_type == "hf":
            if a.hf_cfg_dir is not None:
                raise ArgumentError("npu-compile convert: error: --hf-cfg-dir is for mg -> hf; hf -> mg reads "
                                    "--load-dir's config.json")
            fmt = a.ckpt_format or "torch_dist"
            if layer_list is not None and fmt == "torch_dist":
                raise ArgumentError("npu-compile convert: error: --num-layer-list is for --ckpt-format torch: a "
                                    "torch_dist checkpoint is layout-free (the job picks the pipeline split when "
                                    "it loads); leave it out, or add --ckpt-format torch")
            core.hf_to_mg(a.load_dir, a.save_dir, a.model_type_hf, a.target_tensor_parallel_size,
                          a.target_pipeline_parallel_size, layer_list, a.make_vocab_size_divisible_by, fmt)
            layout = "torch_dist" if fmt == "torch_dist" else (
                f"torch, for --ckpt-format torch --tensor-model-parallel-size {a.target_tensor_parallel_size} "
                f"--pipeline-model-parallel-size {a.target_pipeline_parallel_size}")
            print(f"npu-compile convert: wrote {a.save_dir} (release, {layout}); pretrain_gpt flags: "
                  f"{open(f'{a.save_dir}/{core.FLAGS_FILE}').read().strip()}", file=sys.stderr)
        else:
            for flag, value, default in (("--target-tensor-parallel-size", a.target_tensor_parallel_size, 1),
                                         ("--target-pipeline-parallel-size", a.target_pipeline_parallel_size, 1),
                                         ("--num-layer-list", a.num_layer_list, None),
                                         ("--make-vocab-size-divisible-by", a.make_vocab_size_divisible_by, 128),
                                         ("--ckpt-format", a.ckpt_format, None)):
                if value != default:
                    raise ArgumentError(f"npu-compile convert: error: {flag} is for hf -> mg; mg -> hf reads the "
                                        "checkpoint's own layout and format")
            core.mg_to_hf(a.load_dir, a.save_dir, a.hf_cfg_dir, a.model_type_hf)
            print(f"npu-compile convert: wrote {a.save_dir} (safetensors + config.json)", file=sys.stderr)
    except ArgumentError as e:
        print(e.message, file=sys.stderr)
        return 2
    except (core.ConvertError, ConfigError, hf_io.HFCheckpointError, legacy.LegacyCheckpointError) as e:
        print(f"npu-compile convert: error: {e}", file=sys.stderr)
        return 1
    return 0
