"""HF weights as the job's starting point: MindSpeed-LLM's `--enable-hf2mg-convert --model-type-hf NAME`.

With it, `--load` names a HuggingFace folder (config.json and model weights, as `save_pretrained` writes them).
`before_start(args)`, which the door `megatron_glue.pretrain_gpt` hands the job to run after the argument check and
before any process group starts, refuses a `--model-type-hf` the converter does not have, a folder that is not an
HF model, or one whose config.json is not the family named (without a name, no family the converter has); then
rank 0 converts the folder with `npu-compile convert` into `<load>/megatron_cache_tp{TP}pp{PP}_{fmt}` (MindSpeed-LLM
keeps its cache in the same place, `<load>/megatron_cache_tp{TP}pp{PP}ep{EP}`, mindspeed_llm/training/initialize.py),
in the job's `--ckpt-format` and layout, while the other ranks wait for its tracker file (the converter writes it
last) or its error, within `--distributed-timeout-minutes`; then `--load` is that folder, a release checkpoint,
which the job loads as weights only (iteration 0). A cache whose tracker file is there is used as it is.
`--mg-save-dir` names another cache folder (MindSpeed-LLM's, initialize.py: args.mg_save_dir). With
`--enable-mg2hf-convert`, `before_start` also runs `at_save`'s check and has the job's saves export to HF.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from megatron_glue.convert.families import MODEL_TYPES, ConfigError, family_for
from megatron_glue.training.arguments import HF_MODEL_TYPE_ALIASES
from megatron_glue.training.checkpointing import TRACKER, CheckpointError
from megatron_glue.training.log import print_rank0

WEIGHT_SUFFIXES = (".safetensors", ".bin")
FAILED = ".hf2mg_failed"  # rank 0's one-line error, for the ranks waiting on it


def converter_name(model_type_hf: str | None) -> str | None:
    return HF_MODEL_TYPE_ALIASES.get(model_type_hf, model_type_hf) if model_type_hf else None


def refusal(args) -> str | None:
    """The argument check's line for a --model-type-hf the converter lacks (None: it has it, or none is named)."""
    if not args.model_type_hf or converter_name(args.model_type_hf) in MODEL_TYPES:
        return None
    families = ", ".join(sorted({*MODEL_TYPES, *HF_MODEL_TYPE_ALIASES}))
    if args.enable_hf2mg_convert:
        return (f"--model-type-hf {args.model_type_hf}: converting {args.model_type_hf} weights at start is not "
                f"implemented here (the converter's families: {families}); start from a Megatron checkpoint without "
                "--enable-hf2mg-convert")
    if getattr(args, "enable_mg2hf_convert", False):
        return (f"--model-type-hf {args.model_type_hf}: converting {args.model_type_hf} checkpoints to HF at save "
                f"is not implemented here (the converter's families: {families}); drop --enable-mg2hf-convert")
    return None


def cache_dir(args) -> str:
    if getattr(args, "mg_save_dir", None):  # MindSpeed-LLM's --mg-save-dir (initialize.py: args.mg_save_dir)
        return args.mg_save_dir
    return os.path.join(args.load, f"megatron_cache_tp{args.tensor_model_parallel_size}"
                                   f"pp{args.pipeline_model_parallel_size}_{args.ckpt_format}")


def check(args) -> None:
    """--load is an HF folder of a family the converter has (the one --model-type-hf names): one line otherwise."""
    from megatron_glue.training.arguments import ArgumentError

    line = refusal(args)
    if line:
        raise ArgumentError(f"python -m megatron_glue.pretrain_gpt: error: {line}")
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


def before_start(args) -> None:
    """With --enable-hf2mg-convert: check, convert on rank 0 (others wait), --load becomes the cache. With
    --enable-mg2hf-convert: its check, and the job's saves export (`at_save`)."""
    from megatron_glue.convert import at_save

    at_save.before_start(args)  # before --load becomes the cache: its --hf-cfg-dir may be the HF folder
    if not getattr(args, "enable_hf2mg_convert", False):
        return
    check(args)
    cache = cache_dir(args)
    tracker, failed = os.path.join(cache, TRACKER), os.path.join(cache, FAILED)
    if int(os.environ.get("RANK", "0")) == 0:
        if os.path.isfile(tracker):
            print_rank0(f" --enable-hf2mg-convert: using the converted weights in {cache}")
        else:
            print_rank0(f" --enable-hf2mg-convert: converting {args.load} into {cache} ...")
            os.makedirs(cache, exist_ok=True)
            if os.path.exists(failed):
                os.remove(failed)
            error = _run_converter(args, cache)
            if error:
                with open(failed, "w") as f:
                    f.write(error)
                raise CheckpointError(error)
    else:
        deadline = time.monotonic() + 60 * args.distributed_timeout_minutes
        while not os.path.isfile(tracker):
            if os.path.isfile(failed) and os.path.getmtime(failed) >= _started():
                raise CheckpointError(open(failed).read())
            if time.monotonic() > deadline:
                raise CheckpointError(f"--enable-hf2mg-convert: rank 0 did not finish converting {args.load} into "
                                      f"{cache} within --distributed-timeout-minutes {args.distributed_timeout_minutes}")
            time.sleep(1.0)
    args.load = cache


_START = time.time()


def _started() -> float:
    return _START - 5.0  # an error file written by this job's rank 0, not left by an earlier job


def _run_converter(args, cache: str) -> str | None:
    """`npu-compile convert` hf -> mg in a process of its own; its one-line error, or None."""
    command = [sys.executable, "-m", "npu_compile", "convert", "--load-model-type", "hf", "--save-model-type", "mg",
               "--load-dir", args.load, "--save-dir", cache, "--ckpt-format", args.ckpt_format,
               "--target-tensor-parallel-size", str(args.tensor_model_parallel_size),
               "--target-pipeline-parallel-size", str(args.pipeline_model_parallel_size),
               "--make-vocab-size-divisible-by", str(args.make_vocab_size_divisible_by)]
    if getattr(args, "num_layer_list", None):  # the job's uneven stages: the legacy files follow them
        command += ["--num-layer-list", ",".join(map(str, args.num_layer_list))]
    name = converter_name(args.model_type_hf)
    if name:
        command += ["--model-type-hf", name]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode == 0:
        return None
    lines = [line for line in done.stderr.splitlines() if "error" in line.lower()] or done.stderr.splitlines()[-1:]
    return f"--enable-hf2mg-convert: converting {args.load} failed: {lines[-1] if lines else done.returncode}"
