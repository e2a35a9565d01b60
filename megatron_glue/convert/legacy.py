"""Megatron-LM's legacy `--ckpt-format torch` checkpoints: `mp_rank_XX[_PPP]/model_optim_rng.pt`, one file per
(TP, PP) rank, each holding its own shards. Written by hf -> mg `--ckpt-format torch` (one pipeline stage held at a
time), the layout MindSpeed-LLM's converter writes; read for mg -> hf (memory-mapped, one layer merged at a time).
A legacy checkpoint loads only at the TP x PP it was written for."""

from __future__ import annotations

import os
import re

import torch

from megatron_glue.convert.transforms import merge_tp, split_tp

LAYERS = "decoder.layers."
_RANK_DIR = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?$")


class LegacyCheckpointError(ValueError):
    pass


def rank_files(folder: str) -> dict[tuple[int, int], str]:
    """{(tp rank, pp rank): path}."""
    out = {}
    for name in sorted(os.listdir(folder)):
        m = _RANK_DIR.match(name)
        if m and os.path.isfile(os.path.join(folder, name, "model_optim_rng.pt")):
            out[(int(m.group(1)), int(m.group(2) or 0))] = os.path.join(folder, name, "model_optim_rng.pt")
    if not out:
        raise LegacyCheckpointError(f"{folder}: no mp_rank_*/model_optim_rng.pt files")
    tps = {t for t, _ in out}
    pps = {p for _, p in out}
    if set(out) != {(t, p) for t in range(len(tps)) for p in range(len(pps))}:
        raise LegacyCheckpointError(f"{folder}: the mp_rank_* folders do not form a full TP x PP grid "
                                    f"({sorted(out)}); was the save interrupted?")
    return out


def _load(path: str) -> dict:
    return torch.load(path, map_location="cpu", mmap=True, weights_only=False)


def saved_args(folder: str) -> dict:
    files = rank_files(folder)
    args = _load(files[(0, 0)]).get("args", {})
    return args if isinstance(args, dict) else vars(args)


def reader(folder: str, family, args, saved: dict):
    """read(names, layer) -> {name: full tensor}, merging the TP shards of the stage that holds `layer`. The files
    are mapped afresh for each tensor and let go of after it: a mapped file's pages stay resident while it is
    mapped, and a stage's file holds many layers."""
    files = rank_files(folder)
    tp = 1 + max(t for t, _ in files)
    pp = 1 + max(p for _, p in files)
    for path in files.values():
        if "model" not in _load(path):
            raise LegacyCheckpointError(f"{path} has no 'model' (virtual-pipeline checkpoints, model0/model1/..., "
                                        "convert from --ckpt-format torch_dist)")
    try:
        stages = stage_layers(args.num_layers, pp, _layer_list(saved.get("num_layer_list")))
    except LegacyCheckpointError as e:
        raise LegacyCheckpointError(f"{folder}: {e}")
    rows = {r.mcore: r for r in family.tensors}

    def where(layer: int | None, name: str) -> tuple[int, str]:
        if layer is None:
            stage = 0 if name.startswith("embedding.") else pp - 1
            return stage, name
        stage = next(s for s, layers in enumerate(stages) if layer in layers)
        return stage, f"{LAYERS}{layer - stages[stage].start}.{name}"

    def read(names: list[str], layer: int | None) -> dict[str, torch.Tensor]:
        out = {}
        for name in names:
            stage, key = where(layer, name)
            shards = []
            for t in range(tp):
                sd = _load(files[(t, stage)])["model"]  # mapped for this tensor only
                if key not in sd:
                    raise LegacyCheckpointError(f"{files[(t, stage)]} has no {key!r}; is it a {family.name} model?")
                shards.append(sd[key])
                del sd
            merged = merge_tp(shards, rows[name].tp_dim)
            out[name] = merged.clone() if rows[name].tp_dim is None else merged  # not a view of the mapped file
            del shards, merged
        return out

    return read


def _layer_list(value) -> list[int] | None:
    """A recorded --num-layer-list: a list, or MindSpeed-LLM's string "3,5"."""
    if isinstance(value, str):
        return [int(x) for x in value.split(",")] if value.strip() else None
    return list(value) if value else None


# -- writing (hf -> mg --ckpt-format torch) ----------------------------------------------------------------------

MODEL_FILE = "model_optim_rng.pt"


def rank_dir(tp_rank: int, pp_rank: int, pp: int) -> str:
    """Megatron-LM's name of a rank's folder: mp_rank_XX at PP=1, mp_rank_XX_PPP otherwise."""
    return f"mp_rank_{tp_rank:02d}" if pp == 1 else f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"


def stage_layers(num_layers: int, pp: int, num_layer_list: list[int] | None) -> list[range]:
    """The global layers of each pipeline stage: `num_layer_list`, or an even split."""
    counts = num_layer_list or [num_layers // pp] * pp
    if len(counts) != pp or sum(counts) != num_layers or min(counts) < 1:
        raise LegacyCheckpointError(f"{pp} pipeline stages cannot hold {num_layers} layers as "
                                    f"{','.join(map(str, counts))}")
    starts = [sum(counts[:s]) for s in range(pp)]
    return [range(start, start + n) for start, n in zip(starts, counts)]


def _stage_template(args, dtype, num_layers: int, first: bool, last: bool) -> dict:
    """megatron-core's own `state_dict_for_save_checkpoint()` of one stage's GPTModel (local spec, built on the meta
    device at TP=1): its keys, in its order, the layer index local to the stage, and its non-tensor entries
    (the linear layers' `_extra_state`)."""
    from megatron_glue.convert.core import meta_model

    model = meta_model(args, dtype, num_layers, pre_process=first, post_process=last)
    return model.state_dict_for_save_checkpoint()


def save(folder: str, args, dtype: torch.dtype, recorded: dict, rows, convert, num_layer_list=None,
         on_layer=lambda: None) -> None:
    """Write Megatron-LM's legacy checkpoint into the iteration folder `folder`: per (TP, PP) rank
    mp_rank_XX[_PPP]/model_optim_rng.pt = {"model": that rank's GPTModel state dict, "args": `recorded`,
    "checkpoint_version": 3.0, "iteration": 0, ...}. `convert(name, layer)` gives a tensor of the full
    (unsplit) model, `layer` global or None; rows: the family table's rows of this model. One stage's shards are
    held at a time."""
    from megatron_glue.training.checkpointing import CHECKPOINT_VERSION

    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    stages = stage_layers(args.num_layers, pp, num_layer_list)
    by_name = {(r.mcore, r.layer): r for r in rows}
    tied = not args.untie_embeddings_and_output_weights
    for stage, layers in enumerate(stages):
        template = _stage_template(args, dtype, len(layers), stage == 0, stage == pp - 1)
        models: list[dict] = [{} for _ in range(tp)]
        done = None
        for key, like in template.items():
            if not isinstance(like, torch.Tensor):
                for m in models:
                    m[key] = like  # as megatron-core saves it (the local spec's _extra_state: None)
                continue
            layer, name = None, key
            if key.startswith(LAYERS):
                local, name = key[len(LAYERS):].split(".", 1)
                layer = layers[int(local)]
            if tied and name == "output_layer.weight":
                # the last stage's copy of the tied embedding, as Megatron-LM keeps it at PP > 1
                name = "embedding.word_embeddings.weight"
            row = by_name.get((name, layer is not None))
            if row is None:
                raise LegacyCheckpointError(f"megatron-core's model has a tensor {key!r} that the family table "
                                            "does not produce; add a row for it")
            full = convert(name, layer)
            if tuple(full.shape) != tuple(like.shape):
                raise LegacyCheckpointError(f"{key}: the family table gives shape {tuple(full.shape)}, "
                                            f"megatron-core expects {tuple(like.shape)}")
            for m, shard in zip(models, split_tp(full, row.tp_dim, tp)):
                m[key] = shard
            if layer is not None and layer != done:
                done = layer
                on_layer()
        for t in range(tp):
            path = os.path.join(folder, rank_dir(t, stage, pp), MODEL_FILE)
            os.makedirs(os.path.dirname(path))
            torch.save({"model": models[t], "args": recorded, "checkpoint_version": CHECKPOINT_VERSION,
                        "iteration": 0, "consumed_train_samples": 0, "consumed_valid_samples": 0}, path)
        del models
