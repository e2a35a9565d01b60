"""HF weights at save: MindSpeed-LLM's `--enable-mg2hf-convert`, the opposite of `at_start`'s `--enable-hf2mg-convert`.

MindSpeed-LLM (mindspeed_llm/training/training.py:827-840, checkpointing.py:502-524; its last save after the loop: training.py:548-551): after each checkpoint its
training loop saves every `--save-interval` iterations (not the last save after the loop, which it makes only when
`--save-interval` does not divide the iteration count), rank 0 converts that iteration into
`<--hf-save-dir, default --save>/mg2hf_iteration{N}` while every other rank waits at a barrier;
`--only-convert-last-checkpoint` converts only the one at iteration `--train-iters`. The folder gets the
config files of `--hf-cfg-dir` (with `--enable-hf2mg-convert`, `--load`: convert_checkpoint.py:153-154).

Here: `check(args)`, run by the door before any process group starts (`at_start.before_start`), refuses an
`--hf-cfg-dir` that is not an HF config folder, a config.json of a family the converter does not have (or not the
one `--model-type-hf` names), one that describes another architecture or vocabulary than the job's flags and
tokenizer, and a target folder this process cannot write; then `export` is registered with the job's checkpointing
(`checkpointing.AFTER_INTERVAL_SAVE`). After such a save rank 0 converts the iteration folder with the converter
(`core.mg_to_hf`, in its process: one layer in memory at a time) into `mg2hf_iteration{N}.partial`, renamed to
`mg2hf_iteration{N}` once complete (an earlier export of the same iteration, by a resumed job, is replaced); every
rank then gets rank 0's outcome, and a failed export stops every rank with its one line.
"""

from __future__ import annotations

import json
import os
import shutil
import time

from megatron_glue.convert.at_start import converter_name
from megatron_glue.convert.families import ConfigError, family_for
from megatron_glue.training import checkpointing
from megatron_glue.training.checkpointing import CheckpointError
from megatron_glue.training.log import print_rank0

PARTIAL = ".partial"


def target_dir(args, iteration: int) -> str:
    """MindSpeed-LLM's folder for iteration `iteration` (checkpointing.py:510-511)."""
    return os.path.join(args.hf_save_dir or args.save, f"mg2hf_iteration{iteration}")


def _writable_refusal(base: str, flag: str) -> str | None:
    from megatron_glue.training.checkpointing import folder_refusal

    return folder_refusal(base, flag, "the mg2hf_iteration<N> folders of --enable-mg2hf-convert go in a folder",
                          ", so --enable-mg2hf-convert could not write its mg2hf_iteration<N> folders there")


def check(args) -> None:
    """Everything the export needs, before the job starts: one line naming what is wrong."""
    from megatron_glue.convert.core import ConvertError, check_job_architecture

    cfg_dir = args.hf_cfg_dir
    where = "--hf-cfg-dir" if not (args.enable_hf2mg_convert and cfg_dir == args.load) else "--load"
    config = os.path.join(cfg_dir, "config.json")
    if not os.path.isfile(config):
        raise CheckpointError(f"{where} {cfg_dir}: no config.json there; --enable-mg2hf-convert gives the exported "
                              "folders the config files of an HF folder of this model")
    try:
        with open(config) as f:
            cfg = json.load(f)
        family = family_for(converter_name(args.model_type_hf), cfg)
        check_job_architecture(args, family, cfg, f"{where} {cfg_dir}")
    except (ConfigError, ConvertError) as e:
        raise CheckpointError(f"--enable-mg2hf-convert: {where} {cfg_dir}: {e}") from None
    vocab = _job_vocabulary(args)
    if vocab != cfg.get("vocab_size"):
        raise CheckpointError(f"--enable-mg2hf-convert: {where} {cfg_dir}: its config.json gives vocab_size "
                              f"{cfg.get('vocab_size')}; the job's vocabulary has {vocab} tokens (its tokenizer, "
                              "or --vocab-size where the model's embedding is larger): it describes another model")
    if args.hf_save_dir:
        line = _writable_refusal(args.hf_save_dir, "--hf-save-dir")
        if line:
            raise CheckpointError(line)
    # --save itself is checked by the argument check (checkpointing.save_refusal)


def _job_vocabulary(args) -> int:
    """The model vocabulary the job will have (its tokenizer's, or --vocab-size), as the job sets it after the door."""
    import copy

    from megatron_glue.training.gpt import set_vocabulary

    probe = copy.copy(args)
    set_vocabulary(probe)
    return probe.orig_vocab_size


def before_start(args) -> None:
    """With --enable-mg2hf-convert: check, then have the job's saves call `export`."""
    if not getattr(args, "enable_mg2hf_convert", False):
        checkpointing.AFTER_INTERVAL_SAVE.pop("enable_mg2hf_convert", None)
        return
    check(args)
    checkpointing.AFTER_INTERVAL_SAVE["enable_mg2hf_convert"] = export


def export(args, iteration: int) -> None:
    """On every rank, after the save of `iteration`: rank 0 converts it, the others wait for its outcome."""
    import torch.distributed as dist

    if args.only_convert_last_checkpoint and iteration != args.train_iters:
        return
    target = target_dir(args, iteration)
    outcome = [None]
    if dist.get_rank() == 0:
        source = checkpointing.iteration_dir(args.save, iteration)
        print_rank0(f" --enable-mg2hf-convert: converting {source} into {target} ...")
        start = time.monotonic()
        try:
            convert(args, source, target)
        except Exception as e:  # every rank stops with rank 0's line, none waits for a conversion that failed
            outcome[0] = f"--enable-mg2hf-convert: converting {source} into {target} failed: {e}"
        else:
            print_rank0(f" --enable-mg2hf-convert: wrote {target} ({time.monotonic() - start:.1f} s)")
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(outcome, src=0)
    if outcome[0] is not None:
        raise CheckpointError(outcome[0])


def convert(args, source: str, target: str) -> None:
    """The checkpoint folder `source` as an HF folder `target`, complete or not there at all."""
    from megatron_glue.convert import core

    partial = target + PARTIAL
    if os.path.lexists(partial):
        shutil.rmtree(partial)
    core.mg_to_hf(source, partial, args.hf_cfg_dir, converter_name(args.model_type_hf))
    if os.path.lexists(target):  # this iteration exported before (a resumed job saving it again)
        shutil.rmtree(target)
    os.rename(partial, target)
