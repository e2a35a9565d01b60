"""Megatron-LM's legacy `--ckpt-format torch` checkpoints: `mp_rank_XX[_PPP]/model_optim_rng.pt`, one file per
(TP, PP) rank, each holding its own shards. Read for mg -> hf (memory-mapped, one layer merged at a time)."""

from __future__ import annotations

import os
import re

import torch

from megatron_glue.convert.transforms import merge_tp

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
    """read(names, layer) -> {name: full tensor}, merging the TP shards of the stage that holds `layer`."""
    files = rank_files(folder)
    tp = 1 + max(t for t, _ in files)
    pp = 1 + max(p for _, p in files)
    models = {}
    for key, path in files.items():
        state = _load(path)
        if "model" not in state:
            raise LegacyCheckpointError(f"{path} has no 'model' (virtual-pipeline checkpoints, model0/model1/..., "
                                        "convert from --ckpt-format torch_dist)")
        models[key] = state["model"]
    counts = saved.get("num_layer_list") or [args.num_layers // pp] * pp
    if sum(counts) != args.num_layers or len(counts) != pp:
        raise LegacyCheckpointError(f"{folder}: {pp} stages cannot hold {args.num_layers} layers as {counts}")
    starts = [sum(counts[:s]) for s in range(pp)]
    rows = {r.mcore: r for r in family.tensors}

    def where(layer: int | None, name: str) -> tuple[int, str]:
        if layer is None:
            stage = 0 if name.startswith("embedding.") else pp - 1
            return stage, name
        stage = max(s for s in range(pp) if starts[s] <= layer)
        return stage, f"decoder.layers.{layer - starts[stage]}.{name}"

    def read(names: list[str], layer: int | None) -> dict[str, torch.Tensor]:
        out = {}
        for name in names:
            stage, key = where(layer, name)
            shards = []
            for t in range(tp):
                sd = models[(t, stage)]
                if key not in sd:
                    raise LegacyCheckpointError(f"{files[(t, stage)]} has no {key!r}; is it a {family.name} model?")
                shards.append(sd[key])
            out[name] = merge_tp(shards, rows[name].tp_dim).clone()
        return out

    return read
