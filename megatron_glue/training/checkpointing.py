"""Checkpoints in Megatron-LM's layout, written and read by megatron-core.

    <save>/latest_checkpointed_iteration.txt      the iteration to resume from ("release" for converted weights)
    <save>/iter_0000100/                          one iteration, one folder
        torch_dist: megatron-core dist_checkpointing (any TP/PP/DP can load it)
        torch:      mp_rank_XX[_YYY]/model_optim_rng.pt, one file per (TP, PP) rank, as Megatron-LM's legacy format
                    mp_rank_XX[_YYY]/distrib_optim.pt beside it with --use-distributed-optimizer

Each checkpoint holds the model (one entry per virtual-pipeline chunk: `model`, or `model0`, `model1`, ...), the
optimizer, the LR scheduler, the RNG states, the iteration, the consumed samples and the job's arguments (plain
values), as Megatron-LM's `generate_state_dict` does. In the torch format the distributed optimizer's state goes
where Megatron-LM puts it (megatron/training/checkpointing.py of core_v0.16.1 / core_v0.12.1:
get_distributed_optimizer_checkpoint_name at :221 / :157, the save at :563 / :392, the load at :1794-1810 /
:1394-1410): `model_optim_rng.pt` holds its `state_dict()` (param groups, step, grad scaler, no parameter state),
and every rank calls megatron-core's `DistributedOptimizer.save_parameter_state(<mp_rank folder>/distrib_optim.pt)`
(megatron/core/optimizer/distrib_optimizer.py, 0.16.1 :1126, 0.12.1 :1050), which gathers the DP shards of the
main parameters and their Adam moments over the DP group's gloo group to DP rank 0, which writes the one file of
that (TP, PP) rank; after `load_state_dict`, `load_parameter_state` (0.16.1 :2253, 0.12.1 :1822) reads it on DP
rank 0 and scatters each DP rank its shard, for the DP size of the loading job. DP rank 0 of each (TP, PP) rank
writes `model_optim_rng.pt`; the other DP ranks hold the same model.

A save is committed only when complete: every rank writes into `.iter_XXXXXXX.incomplete/`, and when all have
finished rank 0 renames it to `iter_XXXXXXX/` and then replaces the tracker file (written to a temporary name and
renamed). An interrupted save leaves the tracker and every `iter_*` folder as they were (no half-written
`iter_*` folder exists for a loader or a script to pick); its `.incomplete` folder is removed by the next save.
A committed folder of the same iteration (a resumed job that saves the iteration it loaded) is replaced only once
the new one is complete: moved aside to `.iter_XXXXXXX.replaced`, the new one renamed in, the old one removed (a
save that dies between the two renames leaves it aside; the next load or save puts it back).
"""

from __future__ import annotations

import os
import random
import shutil

import numpy as np
import torch
import torch.distributed as dist

from megatron_glue.training import lora, reuse_fp32_param, versions
from megatron_glue.training.log import print_rank0

TRACKER = "latest_checkpointed_iteration.txt"
DISTRIB_OPTIM = "distrib_optim.pt"  # Megatron-LM's name for the distributed optimizer's state (torch format)
INCOMPLETE = ".incomplete"  # the suffix of a folder being saved (.iter_0000100.incomplete)
REPLACED = ".replaced"  # a committed folder moved aside while a new save of its iteration takes its name
CHECKPOINT_VERSION = 3.0
# Architecture flags a checkpoint must agree with (stored with it; `--load` refuses another value).
ARCHITECTURE = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
                "kv_channels", "normalization", "norm_epsilon", "swiglu", "openai_gelu", "position_embedding_type",
                "rotary_base", "rotary_percent", "use_rope_scaling", "rope_scaling_factor", "add_bias_linear",
                "add_qkv_bias", "untie_embeddings_and_output_weights", "orig_vocab_size", "padded_vocab_size")
ARCHITECTURE += ("add_rmsnorm_offset",)  # norm weights stored as gamma - 1 (MindSpeed-LLM's --add-rmsnorm-offset)
ARCHITECTURE += ("squared_relu", "gelu_tanh", "query_pre_attn_scalar", "input_embeds_norm",
                 "output_logit_softcapping")
ARCHITECTURE += ("post_norm", "interleave_sliding_window")  # Gemma 2's layer (MindSpeed-LLM's flags)
# Qwen3-Next's Gated DeltaNet layers (docs/linear_attention.md)
ARCHITECTURE += ("full_attention_interval", "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads",
                 "linear_num_value_heads", "mamba_d_conv")
# The distributed optimizer's sharding: reshardable over TP, PP and DP, gathered over the gloo DP group.
DISTOPT_METADATA = {"distrib_optim_sharding_type": "fully_reshardable",
                    "distrib_optim_fully_reshardable_mem_efficient": True,
                    "chained_optim_avoid_prefix": True}


class CheckpointError(RuntimeError):
    pass


# Run on every rank after each save the training loop makes every --save-interval iterations, as (args, iteration):
# the converter's --enable-mg2hf-convert export (megatron_glue.convert.at_save), registered by the job's door
# before it starts (this room does not import the converter). Keyed by who registered it.
AFTER_INTERVAL_SAVE: dict = {}


def iteration_dir(root: str, iteration: int | str) -> str:
    return os.path.join(root, "release" if iteration == "release" else f"iter_{iteration:07d}")


def read_tracker(root: str) -> int | str | None:
    path = os.path.join(root, TRACKER)
    if not os.path.exists(path):
        return None
    text = open(path).read().strip()
    if text == "release":
        return "release"
    try:
        return int(text)
    except ValueError:
        raise CheckpointError(f"{path} holds {text!r}; expected an iteration number or 'release'")


def _write_tracker(root: str, iteration: int) -> None:
    tmp = os.path.join(root, f".{TRACKER}.tmp")
    with open(tmp, "w") as f:
        f.write(str(iteration))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(root, TRACKER))  # atomic: readers see the old or the new iteration


def plain_args(args) -> dict:
    """The job's arguments as plain values (no pickled Namespace: a checkpoint loads without our classes)."""
    keep = (bool, int, float, str, type(None))
    out = {}
    for key, value in vars(args).items():
        if isinstance(value, keep) or (isinstance(value, (list, tuple)) and all(isinstance(v, keep) for v in value)):
            out[key] = value
    return out


def _rng_state():
    from megatron.core import tensor_parallel

    state = {"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
             "torch_rng_state": torch.get_rng_state(),
             "rng_tracker_states": tensor_parallel.get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda_rng_state"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state) -> None:
    from megatron.core import tensor_parallel

    random.setstate(state["random_rng_state"])
    np.random.set_state(state["np_rng_state"])
    torch.set_rng_state(state["torch_rng_state"])
    if "cuda_rng_state" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda_rng_state"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["rng_tracker_states"])


def _parallel_ranks():
    from megatron.core import parallel_state as ps

    return (ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_world_size(),
            ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size(),
            ps.get_data_parallel_rank())


def _sharded_rng():
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    pp_rank, pp, tp_rank, tp, dp_rank = _parallel_ranks()
    return ShardedObject("rng_state", [_rng_state()], (pp, tp), (pp_rank, tp_rank), replica_id=dp_rank)


def _model_key(chunks, i):
    return "model" if len(chunks) == 1 else f"model{i}"


def _common(args, iteration, consumed) -> dict:
    return {"checkpoint_version": CHECKPOINT_VERSION, "iteration": iteration,
            "consumed_train_samples": consumed[0], "consumed_valid_samples": consumed[1], "args": plain_args(args)}


def _sharded_state_dict(args, chunks, optimizer, scheduler, iteration, consumed, *, loading, with_optim, with_rng):
    state = _common(args, iteration, consumed)
    metadata = dict(DISTOPT_METADATA)
    for i, chunk in versions.model_chunks(chunks):
        state[_model_key(chunks, i)] = chunk.sharded_state_dict(metadata=metadata)
    if with_optim and optimizer is not None:
        state["optimizer"] = versions.optimizer_sharded_state_dict(optimizer, state, loading=loading,
                                                                   metadata=metadata)
        state["opt_param_scheduler"] = scheduler.state_dict()
    if with_rng:
        state["rng_state"] = _sharded_rng()
    return state


def save_refusal(args) -> str | None:
    """Why this job could not write its checkpoints to --save (None: it can), asked by the argument check: a job
    that cannot save is refused before it trains, never at its first save. Every rank asks (each writes its part)."""
    return folder_refusal(args.save, "--save", "--save names the folder the checkpoints go in")


def folder_refusal(path: str, flag: str, a_folder: str, writes: str = "") -> str | None:
    """Why `flag path` could not be a folder this process writes into (None: it can): a file there (`a_folder` says
    what goes in the folder), a file on the way to it, or the nearest existing folder not writable (`writes`: what
    could not be written, after a comma)."""
    existing = os.path.abspath(path)
    if os.path.exists(existing) and not os.path.isdir(existing):
        return f"{flag} {path} is a file; {a_folder}"
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        return f"{flag} {path} lies under {existing}, which is a file; give a folder path"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"{flag} {path}: {existing} is not writable by this process{writes}; give a folder it can write"
    return None


def _aside(root: str, iteration: int | str, suffix: str) -> str:
    return os.path.join(root, "." + os.path.basename(iteration_dir(root, iteration)) + suffix)


def _restore_replaced(root: str) -> None:
    """Rank 0: a committed folder moved aside by a save that died before the new one took its name goes back."""
    for name in sorted(os.listdir(root)):
        committed = os.path.join(root, name[1:-len(REPLACED)])
        if name.startswith(".iter_") and name.endswith(REPLACED) and not os.path.lexists(committed):
            os.rename(os.path.join(root, name), committed)
            print(f" {committed} restored from {name}, where a save of its iteration that died had moved it",
                  flush=True)


def _clear_interrupted(root: str) -> None:
    """Rank 0, before a save: what interrupted saves left is removed, a committed folder they moved aside restored."""
    _restore_replaced(root)
    for name in os.listdir(root):
        if name.startswith(".iter_") and name.endswith((INCOMPLETE, REPLACED)):
            shutil.rmtree(os.path.join(root, name))


def save_checkpoint(args, iteration: int, chunks, optimizer, scheduler, consumed_train: int,
                    consumed_valid: int = 0) -> str:
    """Write iteration `iteration` under args.save and commit it in the tracker; returns the folder."""
    from megatron.core import dist_checkpointing

    root = args.save
    folder, partial = iteration_dir(root, iteration), _aside(root, iteration, INCOMPLETE)
    rank = dist.get_rank()
    if rank == 0:
        os.makedirs(root, exist_ok=True)
        _clear_interrupted(root)
        os.makedirs(partial)
    dist.barrier()
    with_optim, with_rng = not args.no_save_optim, not args.no_save_rng
    consumed = (consumed_train, consumed_valid)
    if getattr(args, "overlap_param_gather", False):
        # the step's parameter all-gather is deferred into the next forward: gather now, as Megatron-LM's save does
        # (disable_forward_pre_hook(param_sync=True), megatron/training/training.py), or the weights other DP ranks
        # updated would be saved as they were before the step
        for chunk in chunks:
            chunk.start_param_sync(force_sync=True)
    with reuse_fp32_param.master_weights_materialized(optimizer if with_optim else None):
        if args.ckpt_format == "torch_dist":
            state = _sharded_state_dict(args, chunks, optimizer, scheduler, iteration, consumed, loading=False,
                                        with_optim=with_optim, with_rng=with_rng)
            dist_checkpointing.save(state, partial, **versions.checkpoint_save_kwargs(DISTOPT_METADATA))
        else:
            _save_torch(args, partial, chunks, optimizer, scheduler, iteration, consumed, with_optim, with_rng)
    dist.barrier()  # every rank's part is on disk before the folder gets its name and the tracker moves
    if rank == 0:
        replaced = None
        if os.path.lexists(folder):  # this iteration saved before (a resumed job saving what it loaded)
            replaced = _aside(root, iteration, REPLACED)
            os.rename(folder, replaced)
        os.rename(partial, folder)
        _write_tracker(root, iteration)
        if replaced:
            shutil.rmtree(replaced)
    dist.barrier()
    pp_rank, pp, tp_rank, tp, _ = _parallel_ranks()
    print_rank0(f" successfully saved checkpoint from iteration {iteration:7d} to {root} "
                f"[ t {tp_rank + 1}/{tp}, p {pp_rank + 1}/{pp} ]")
    return folder


def _torch_file(folder: str) -> str:
    pp_rank, pp, tp_rank, _, _ = _parallel_ranks()
    name = f"mp_rank_{tp_rank:02d}" if pp == 1 else f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"
    return os.path.join(folder, name, "model_optim_rng.pt")


def _distrib_optim_file(model_file: str) -> str:
    """Megatron-LM's get_distributed_optimizer_checkpoint_name: beside the model file of the (TP, PP) rank."""
    return os.path.join(os.path.dirname(model_file), DISTRIB_OPTIM)


def _save_torch(args, folder, chunks, optimizer, scheduler, iteration, consumed, with_optim, with_rng):
    from megatron.core import parallel_state as ps

    path = _torch_file(folder)
    first = ps.get_data_parallel_rank() == 0  # DP replicas hold the same model; DP rank 0 writes the folder
    if first:
        os.makedirs(os.path.dirname(path), exist_ok=True)
    if with_optim and optimizer is not None and args.use_distributed_optimizer:
        optimizer.save_parameter_state(_distrib_optim_file(path))  # every DP rank: a gather to DP rank 0
    if not first:
        return
    state = _common(args, iteration, consumed)
    for i, chunk in versions.model_chunks(chunks):
        state[_model_key(chunks, i)] = chunk.state_dict_for_save_checkpoint()
        if getattr(args, "lora_ckpt_filter", False):  # the adapters alone (MindSpeed-LLM's filter_lora_keys)
            state[_model_key(chunks, i)] = lora.adapters_of(state[_model_key(chunks, i)])
    if with_optim and optimizer is not None:
        state["optimizer"] = optimizer.state_dict()
        state["opt_param_scheduler"] = scheduler.state_dict()
    if with_rng:
        state["rng_state"] = [_rng_state()]
    torch.save(state, path)


def resolved_architecture(values: dict) -> dict:
    """`values` (a checkpoint's saved arguments, or a job's) with the architecture defaults resolved as
    Megatron-LM's validate_args resolves them: kv_channels hidden / heads, ffn_hidden_size 4 x hidden (--swiglu:
    arguments.default_ffn_hidden_size), num_query_groups the heads without --group-query-attention. Checkpoints
    saved before the job resolved kv_channels hold None there, which means the head size: compared resolved, a
    default and the same value given as a flag agree."""
    from megatron_glue.training.arguments import default_ffn_hidden_size

    out = dict(values)
    hidden, heads = out.get("hidden_size"), out.get("num_attention_heads")
    if not hidden or not heads:
        return out
    if out.get("kv_channels") is None:
        out["kv_channels"] = hidden // heads
    if out.get("ffn_hidden_size") is None:
        out["ffn_hidden_size"] = default_ffn_hidden_size(hidden, bool(out.get("swiglu")))
    if out.get("num_query_groups") is None or out.get("group_query_attention") is False:
        out["num_query_groups"] = heads
    return out


def check_architecture(args, saved: dict, where: str, reshards: bool = False) -> None:
    """Refuse a checkpoint whose architecture flags differ from this job's, naming both values (each resolved:
    resolved_architecture). `reshards` (torch_dist): the vocabulary's padding rows may differ (another TP size or
    --make-vocab-size-divisible-by) when the vocabulary itself is the same; megatron-core loads the embedding and
    output layer across it."""
    saved = resolved_architecture(saved)
    ours = resolved_architecture({k: getattr(args, k, None) for k in (*ARCHITECTURE, "group_query_attention",
                                                                      "noop_layers")})
    saved_noop, our_noop = set(saved.get("noop_layers") or ()), set(ours.get("noop_layers") or ())
    if reshards:  # torch_dist: the layer axis holds the real layers alone (noop_layers._compact_sharded_state_dict)
        if saved.get("num_layers") is not None:
            saved["num_layers"] -= len(saved_noop)
        ours["num_layers"] -= len(our_noop)
    elif saved_noop != our_noop:  # torch: each rank's file keys the layers by their place in its stage
        raise CheckpointError(f"the checkpoint at {where} was saved with --noop-layers "
                              f"{','.join(map(str, sorted(saved_noop))) or '(none)'}, this job has "
                              f"{','.join(map(str, sorted(our_noop))) or '(none)'}; use the checkpoint's value (or "
                              "save and load in the torch_dist format, where only the real layers count)")
    for key in ARCHITECTURE:
        if key == "padded_vocab_size" and reshards and saved.get("orig_vocab_size") is not None \
                and saved.get("orig_vocab_size") == ours["orig_vocab_size"]:
            continue
        if key == "orig_vocab_size" and key in saved and ours[key] != saved[key]:
            if _vocabulary_of_the_rows(args, saved):
                args.orig_vocab_size = saved[key]
                continue
            raise CheckpointError(_vocabulary_refusal(args, saved[key], where))
        if key in saved and ours[key] != saved[key]:
            flag = "--" + key.replace("_", "-")
            raise CheckpointError(f"the checkpoint at {where} was saved with {flag} {saved[key]!r}, this job has "
                                  f"{ours[key]!r}; use the checkpoint's value")


def _vocabulary_of_the_rows(args, saved: dict) -> bool:
    """--padded-vocab-size given as the checkpoint's embedding rows, and a tokenizer whose ids all have a row the
    checkpoint trained: the job's model vocabulary is the checkpoint's (MindSpeed-LLM's scripts give Qwen's
    --padded-vocab-size 152064, the HF embedding's rows, for a tokenizer of 151665 ids, and no --vocab-size).
    Megatron-LM loads such a checkpoint by the embedding's shape alone; the job takes the checkpoint's vocabulary
    (what `npu-compile convert` writes back to HF)."""
    tokens = getattr(getattr(args, "tokenizer", None), "vocab_size", None)
    return bool(getattr(args, "padded_vocab_size_given", False) and getattr(args, "vocab_size", None) is None
                and getattr(args, "tokenizer_type", None) != "NullTokenizer" and tokens is not None
                and saved.get("padded_vocab_size") == args.padded_vocab_size
                and tokens <= saved["orig_vocab_size"] <= args.padded_vocab_size)


def _vocabulary_refusal(args, saved: int, where: str) -> str:
    """Why this job's model vocabulary (its tokenizer's, or --vocab-size's) is not the checkpoint's `saved`, and
    the flag that would make it so where one can."""
    model = getattr(args, "orig_vocab_size", None)
    tokens = getattr(getattr(args, "tokenizer", None), "vocab_size", model)
    head = f"the checkpoint at {where} has a vocabulary of {saved} tokens"
    if getattr(args, "tokenizer_type", None) == "NullTokenizer":  # its vocab_size counts the eod it adds
        return (f"{head}, this job's NullTokenizer --vocab-size {args.vocab_size} gives {model}; use "
                f"--vocab-size {saved - 1}")
    if model != tokens:  # --vocab-size made the model's vocabulary larger than the tokenizer's
        if saved >= tokens:
            return f"{head}, this job's --vocab-size gives {model}; use --vocab-size {saved}"
        return f"{head}, fewer than the {tokens} tokens of this job's tokenizer; use the checkpoint's tokenizer"
    if tokens > saved:
        return (f"{head}, this job's tokenizer gives {tokens}, ids the checkpoint has no embedding for; use the "
                "checkpoint's tokenizer")
    return (f"{head}, this job's tokenizer gives {tokens}; use the checkpoint's tokenizer, or --vocab-size {saved} "
            "where the model's embedding is larger than the tokenizer")


def _stages(num_layer_list, num_layers: int, pp: int) -> list[int]:
    """Layers per pipeline stage: a --num-layer-list (a list, or MindSpeed-LLM's string "3,5"), or the even split."""
    if isinstance(num_layer_list, str):
        num_layer_list = [int(n) for n in num_layer_list.split(",")]
    return list(num_layer_list) if num_layer_list else [num_layers // pp] * pp


def _legacy_layout_refusal(folder: str, saved: tuple | None = None) -> str:
    """A --ckpt-format torch checkpoint holds one file per (TP, PP) rank of the layout it was saved at."""
    import re

    _, pp, _, tp, _ = _parallel_ranks()
    if saved is None:  # this rank's file is missing: read the layout off the folders there
        ranks = [re.match(r"^mp_rank_(\d{2})(?:_(\d{3}))?$", n) for n in os.listdir(folder)]
        ranks = [(int(m.group(1)), int(m.group(2) or 0)) for m in ranks if m]
        if not ranks:
            return f"{folder} holds no mp_rank_* folders; is it a --ckpt-format torch checkpoint?"
        saved = (1 + max(t for t, _ in ranks), 1 + max(p for _, p in ranks))
    return (f"{folder} is a --ckpt-format torch checkpoint saved at TP={saved[0]}, PP={saved[1]}; this job runs at "
            f"TP={tp}, PP={pp}. It loads only at its own layout: run at TP={saved[0]}, PP={saved[1]}, or take it "
            "through `npu-compile convert` to hf and back to a torch_dist checkpoint, which reshards")


def _check_legacy_optimizer(args, saved_args: dict, folder: str, model_file: str) -> None:
    """A torch-format optimizer state loads only into the optimizer kind that saved it: the distributed
    optimizer's is its `state_dict()` plus distrib_optim.pt, the other's a whole optimizer state dict."""
    saved = bool(saved_args.get("use_distributed_optimizer"))
    if saved != bool(args.use_distributed_optimizer):
        said, ours = ("with", "without") if saved else ("without", "with")
        raise CheckpointError(f"{folder} was saved {said} --use-distributed-optimizer, this job runs {ours} it: "
                              f"the optimizer state is in the other's form; run {said} --use-distributed-optimizer, "
                              "or load the weights alone with --no-load-optim")
    optim_file = _distrib_optim_file(model_file)
    if saved and not os.path.isfile(optim_file):  # checked on every rank: only DP rank 0 reads it, the rest wait
        raise CheckpointError(f"{optim_file} is missing: a --use-distributed-optimizer checkpoint in the torch "
                              "format keeps its optimizer state there; load with --no-load-optim to take the "
                              "weights alone")


def load_checkpoint(args, chunks, optimizer, scheduler) -> tuple[int, int, int]:
    """Load from args.load as Megatron-LM does; returns (iteration, consumed train samples, consumed validation
    samples), zeros when there is nothing to load. --finetune loads only the model and restarts at 0. With
    --lora-load (MindSpeed-LLM's _load_base_checkpoint_wrapper, training/checkpointing.py:96-104): the base model's
    weights from --load, then the adapters, and what a resume takes (iteration, optimizer, RNG), from --lora-load."""
    if lora.enabled(args) and args.lora_load:
        if args.load:
            _load(args, args.load, chunks, optimizer, scheduler, "--load", weights_only=True)
        return _load(args, args.lora_load, chunks, optimizer, scheduler, "--lora-load")
    return _load(args, args.load, chunks, optimizer, scheduler, "--load")


def _load(args, root, chunks, optimizer, scheduler, flag: str, weights_only: bool = False) -> tuple[int, int, int]:
    """Load the checkpoint under `root` (given by `flag`); `weights_only`: the model alone."""
    from megatron.core import dist_checkpointing

    if not root:
        return 0, 0, 0
    tracker = read_tracker(root)
    if tracker is None:
        if os.path.isdir(root) and os.listdir(root) and not args.save == root:
            raise CheckpointError(f"{flag} {root}: no {TRACKER} there; expected a Megatron checkpoint directory")
        print_rank0(f" WARNING: could not find the metadata file {os.path.join(root, TRACKER)}; "
                    "will not load any checkpoints and will start from random")
        return 0, 0, 0
    folder = iteration_dir(root, tracker)
    if dist.get_rank() == 0:
        _restore_replaced(root)
    dist.barrier()
    if not os.path.isdir(folder):
        raise CheckpointError(f"{os.path.join(root, TRACKER)} names iteration {tracker}, but {folder} is missing")
    release = tracker == "release"
    finetune = args.finetune or release or weights_only
    if args.ckpt_format == "torch_dist":
        if not dist_checkpointing.check_is_distributed_checkpoint(folder):
            raise CheckpointError(f"{folder} is not a torch_dist checkpoint (no metadata); was it saved with "
                                  "--ckpt-format torch?")
        common = dist_checkpointing.load_common_state_dict(folder)
    else:
        path = _torch_file(folder)
        if not os.path.isfile(path):
            raise CheckpointError(_legacy_layout_refusal(folder))
        common = torch.load(path, map_location="cpu", weights_only=False)
    saved_args = common.get("args", {})
    pp_rank, pp, tp_rank, tp, _ = _parallel_ranks()
    saved_layout = (saved_args.get("tensor_model_parallel_size", tp), saved_args.get("pipeline_model_parallel_size", pp))
    if args.ckpt_format == "torch" and saved_layout != (tp, pp):  # before the architecture: its padding is TP's
        raise CheckpointError(_legacy_layout_refusal(folder, saved_layout))
    check_architecture(args, saved_args, folder, reshards=args.ckpt_format == "torch_dist")
    if args.ckpt_format == "torch":  # a legacy checkpoint's files follow its stages: the job's must be the same
        saved_stages = _stages(saved_args.get("num_layer_list"), args.num_layers, pp)
        stages = _stages(getattr(args, "num_layer_list", None), args.num_layers, pp)
        if saved_stages != stages:
            raise CheckpointError(f"{folder} holds pipeline stages of {','.join(map(str, saved_stages))} layers, this "
                                  f"job builds {','.join(map(str, stages))}; give --num-layer-list "
                                  f"{','.join(map(str, saved_stages))}, or convert for this job's stages")
    same_layout = saved_layout == (tp, pp)
    with_optim = not (finetune or args.no_load_optim)
    with_rng = not (finetune or args.no_load_rng)
    if with_rng and not same_layout:
        print_rank0(f" (TP, PP) mismatch after resume ({(tp, pp)} vs {(saved_args.get('tensor_model_parallel_size'), saved_args.get('pipeline_model_parallel_size'))} "
                    "from checkpoint): RNG state will be ignored")
        with_rng = False
    if with_optim and saved_args.get("no_save_optim"):
        raise CheckpointError(f"{folder} was saved without optimizer state (--no-save-optim); load with --no-load-optim")
    distributed_optim = with_optim and args.ckpt_format == "torch" and args.use_distributed_optimizer
    if with_optim and args.ckpt_format == "torch":
        _check_legacy_optimizer(args, saved_args, folder, path)

    # the master weights as the optimizer reads and writes them (--reuse-fp32-param keeps them split)
    reload_masters = not with_optim and (args.bf16 or args.fp16)
    with reuse_fp32_param.master_weights_materialized(optimizer if with_optim else None):
        if args.ckpt_format == "torch_dist":
            template = _sharded_state_dict(args, chunks, optimizer, scheduler, 0, (0, 0), loading=True,
                                           with_optim=with_optim, with_rng=with_rng)
            try:
                state = dist_checkpointing.load(template, folder)
            except KeyError as e:
                if with_optim and "optimizer" in str(e):
                    raise CheckpointError(f"{folder} has no optimizer state for this model (saved before the first "
                                          f"step, or by a converter); load with --no-load-optim or --finetune ({e})")
                raise
        else:
            state = common
        for i, chunk in versions.model_chunks(chunks):
            if lora.enabled(args):
                held = lora.load_model_state(chunk, state[_model_key(chunks, i)], args, where=f"{flag} {folder}")
                if held == "adapters" and flag == "--load":
                    raise CheckpointError(f"--load {folder} holds only LoRA adapters (saved with --lora-ckpt-filter): "
                                          "give it as --lora-load, and the base model's checkpoint as --load")
                if held == "base" and flag == "--lora-load":
                    raise CheckpointError(f"--lora-load {folder} holds no LoRA adapters; give the folder a LoRA job "
                                          "saved to (the base model goes to --load)")
            else:
                chunk.load_state_dict(state[_model_key(chunks, i)], strict=True)
        if with_optim:
            optimizer.load_state_dict(state["optimizer"])
            if distributed_optim:  # after load_state_dict, as Megatron-LM: it allocates the state this fills
                optimizer.load_parameter_state(_distrib_optim_file(path))
            scheduler.load_state_dict(state["opt_param_scheduler"])
        elif reload_masters and optimizer is not None:
            # the fp32 master weights were copied from the model at the optimizer's construction, before this load:
            # copy the loaded weights into them, or the first step writes the initial weights back (Megatron-LM's
            # load_checkpoint does the same when it loads no optimizer state; --reuse-fp32-param's reload takes the
            # loaded bf16 weights with zero residuals)
            optimizer.reload_model_params()
    if with_rng:
        rng = state["rng_state"]
        _set_rng_state(rng[0] if isinstance(rng, list) else rng)
    iteration = 0 if finetune else int(state.get("iteration", common.get("iteration", 0)))
    consumed = (0, 0) if finetune else (int(common.get("consumed_train_samples", 0)),
                                         int(common.get("consumed_valid_samples", 0)))
    dist.barrier()
    print_rank0(f"  successfully loaded checkpoint from {root} [ t {tp_rank + 1}/{tp}, p {pp_rank + 1}/{pp} ] "
                f"at iteration {iteration}")
    return iteration, *consumed
