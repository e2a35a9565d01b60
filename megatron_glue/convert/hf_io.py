"""HF checkpoints on disk, one tensor at a time: read from `model.safetensors`, a sharded
`model.safetensors.index.json` or `pytorch_model*.bin` (memory-mapped); written as one safetensors file per layer
plus the index `from_pretrained` reads."""

from __future__ import annotations

import json
import os
import shutil

import torch

SAFE_INDEX = "model.safetensors.index.json"
BIN_INDEX = "pytorch_model.bin.index.json"
# Files of an HF model folder that are not weights, carried from --hf-cfg-dir to the written model.
CARRIED = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
           "special_tokens_map.json", "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json",
           "chat_template.jinja")


class HFCheckpointError(ValueError):
    pass


def read_config(folder: str) -> dict:
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        raise HFCheckpointError(f"{folder}: no config.json; expected a folder written by save_pretrained")
    try:
        with open(path) as f:
            cfg = json.load(f)
    except json.JSONDecodeError as e:
        raise HFCheckpointError(f"{path} is not JSON ({e.msg} at line {e.lineno})")
    if not isinstance(cfg, dict):
        raise HFCheckpointError(f"{path} holds a JSON {type(cfg).__name__}, not an object; expected the config "
                                "save_pretrained writes")
    return cfg


class HFReader:
    """Tensors of an HF model folder by name, each read from disk when asked (nothing held between calls)."""

    def __init__(self, folder: str):
        self.folder = folder
        self._where: dict[str, str] = {}
        if os.path.isfile(os.path.join(folder, SAFE_INDEX)):
            self._index(SAFE_INDEX)
        elif os.path.isfile(os.path.join(folder, "model.safetensors")):
            self._scan_safetensors("model.safetensors")
        elif os.path.isfile(os.path.join(folder, BIN_INDEX)):
            self._index(BIN_INDEX)
        elif os.path.isfile(os.path.join(folder, "pytorch_model.bin")):
            self._where = {name: "pytorch_model.bin" for name in self._bin("pytorch_model.bin")}
        else:
            raise HFCheckpointError(f"{folder}: no model.safetensors, {SAFE_INDEX}, pytorch_model.bin or "
                                    f"{BIN_INDEX}; expected a folder written by save_pretrained")
        self._bins: dict[str, dict] = {}

    def _index(self, name: str) -> None:
        with open(os.path.join(self.folder, name)) as f:
            self._where = dict(json.load(f)["weight_map"])
        for file in set(self._where.values()):
            if not os.path.isfile(os.path.join(self.folder, file)):
                raise HFCheckpointError(f"{os.path.join(self.folder, name)} names {file}, which is missing")

    def _scan_safetensors(self, file: str) -> None:
        from safetensors import safe_open

        with safe_open(os.path.join(self.folder, file), framework="pt") as f:
            self._where.update({name: file for name in f.keys()})

    def _bin(self, file: str) -> dict:
        # mmap: the file's pages are read when a tensor is touched, not all at load
        return torch.load(os.path.join(self.folder, file), map_location="cpu", mmap=True, weights_only=True)

    def names(self) -> list[str]:
        return list(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def get(self, name: str) -> torch.Tensor:
        if name not in self._where:
            raise HFCheckpointError(f"{self.folder}: the checkpoint has no tensor {name!r}")
        file = self._where[name]
        if file.endswith(".safetensors"):
            from safetensors import safe_open

            with safe_open(os.path.join(self.folder, file), framework="pt") as f:
                return f.get_tensor(name)
        if file not in self._bins:
            self._bins = {file: self._bin(file)}  # one .bin mapped at a time
        return self._bins[file][name].clone()


class HFWriter:
    """Writes tensors group by group (one safetensors file each), then the index; `close()` commits."""

    def __init__(self, folder: str, n_files: int):
        self.folder, self.n_files = folder, n_files
        os.makedirs(folder, exist_ok=True)
        self.weight_map: dict[str, str] = {}
        self.total_size = 0
        self._written = 0

    def write(self, tensors: dict[str, torch.Tensor]) -> None:
        from safetensors.torch import save_file

        self._written += 1
        file = f"model-{self._written:05d}-of-{self.n_files:05d}.safetensors"
        save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(self.folder, file),
                  metadata={"format": "pt"})
        for name, t in tensors.items():
            self.weight_map[name] = file
            self.total_size += t.numel() * t.element_size()

    def close(self) -> None:
        if self._written != self.n_files:
            raise RuntimeError(f"wrote {self._written} of {self.n_files} weight files")
        index = {"metadata": {"total_size": self.total_size}, "weight_map": dict(sorted(self.weight_map.items()))}
        tmp = os.path.join(self.folder, f".{SAFE_INDEX}.tmp")
        with open(tmp, "w") as f:
            json.dump(index, f, indent=2)
        os.replace(tmp, os.path.join(self.folder, SAFE_INDEX))


def carry_files(src: str, dst: str) -> list[str]:
    """The non-weight files of an HF folder (config, tokenizer) copied; returns their names."""
    out = []
    for name in CARRIED:
        if os.path.isfile(os.path.join(src, name)):
            shutil.copyfile(os.path.join(src, name), os.path.join(dst, name))
            out.append(name)
    return out
