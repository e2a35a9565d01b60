"""HF weights as the job's starting point: MindSpeed-LLM's `--enable-hf2mg-convert --model-type-hf NAME`.

With it, `--load` names a HuggingFace folder (config.json and model weights, as `save_pretrained` writes them).
`check(args)`, before any process group starts, refuses a folder that is not one, or whose config.json is not the
family `--model-type-hf` names (or, without it, no family the converter has). `convert(args)`, once the process
group is up, converts the folder on rank 0 with `npu-compile convert` into `<load>/megatron_cache_tp{TP}pp{PP}_{fmt}`
(MindSpeed-LLM keeps its cache in the same place, `<load>/megatron_cache_tp{TP}pp{PP}ep{EP}`,
mindspeed_llm/training/initialize.py), in the job's `--ckpt-format` and layout; every rank waits for it; then
`--load` is that folder, a release checkpoint, which the job loads as weights only (iteration 0). A cache whose
tracker file is there is complete (the converter writes the tracker last) and is used as it is.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch.distributed as dist

from megatron_glue.arguments import HF_MODEL_TYPE_ALIASES
from megatron_glue.checkpointing import TRACKER, CheckpointError

WEIGHT_SUFFIXES = (".safetensors", ".bin")


def converter_name(model_type_hf: str | None) -> str | None:
    return HF_MODEL_TYPE_ALIASES.get(model_type_hf, model_type_hf) if model_type_hf else None


def cache_dir(args) -> str:
    return os.path.join(args.load, f"megatron_cache_tp{args.tensor_model_parallel_size}"
                                   f"pp{args.pipeline_model_parallel_size}_{args.ckpt_format}")


def check(args) -> None:
    """--load is an HF folder of a family the converter has (the one --model-type-hf names): one line otherwise."""
    from megatron_glue.convert.families import ConfigError, family_for

    folder = args.load
    if not os.path.isdir(folder):
        raise CheckpointError(f"--load {folder}: no such directory (--enable-hf2mg-convert converts the HF folder "
                              "--load names)")
    files = os.listdir(folder)
    if "config.json" not in files or not any(f.endswith(WEIGHT_SUFFIXES) for f in files):
        raise CheckpointError(f"--load {folder}: not a HuggingFace model folder (--enable-hf2mg-convert needs its "
                              "config.json and *.safetensors or pytorch_model*.bin weights)")
    try:
        with open(os.path.join(folder, "config.json")) as f:
            cfg = json.load(f)
        family_for(converter_name(args.model_type_hf), cfg)
    except (ConfigError, ValueError) as e:
        raise CheckpointError(f"--load {folder}: {e}") from None


def convert(args) -> None:
    """Rank 0 converts --load into the cache (unless it is there), every rank waits, --load becomes the cache."""
    from megatron_glue.training_log import print_rank0

    cache = cache_dir(args)
    error = None
    if dist.get_rank() == 0:
        if os.path.isfile(os.path.join(cache, TRACKER)):
            print_rank0(f" --enable-hf2mg-convert: using the converted weights in {cache}")
        else:
            print_rank0(f" --enable-hf2mg-convert: converting {args.load} into {cache} ...")
            error = _run_converter(args, cache)
    box = [error]
    dist.broadcast_object_list(box, src=0)  # the others wait here for rank 0's conversion
    if box[0] is not None:
        raise CheckpointError(box[0])
    args.load = cache


def _run_converter(args, cache: str) -> str | None:
    """`npu-compile convert` hf -> mg in a process of its own (the converter runs outside any process group);
    its one-line error, or None."""
    command = [sys.executable, "-m", "npu_compile", "convert", "--load-model-type", "hf", "--save-model-type", "mg",
               "--load-dir", args.load, "--save-dir", cache, "--ckpt-format", args.ckpt_format,
               "--target-tensor-parallel-size", str(args.tensor_model_parallel_size),
               "--target-pipeline-parallel-size", str(args.pipeline_model_parallel_size),
               "--make-vocab-size-divisible-by", str(args.make_vocab_size_divisible_by)]
    name = converter_name(args.model_type_hf)
    if name:
        command += ["--model-type-hf", name]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode == 0:
        return None
    lines = [line for line in done.stderr.splitlines() if "error" in line.lower()] or done.stderr.splitlines()[-1:]
    return f"--enable-hf2mg-convert: converting {args.load} failed: {lines[-1] if lines else done.returncode}"
