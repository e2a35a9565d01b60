"""OpenAI's GPT-2 TensorFlow checkpoints (the gpt-2 release's `model.ckpt.*` + `hparams.json`), presented as the
transformers GPT-2 checkpoint they convert to: its config.json and its tensors by transformers' names, so that
`--load-model-type tf` runs the gpt2 family table as `--load-model-type hf` does.

The correspondence is transformers 4.x's `load_tf_weights_in_gpt2` (transformers/models/gpt2/modeling_gpt2.py:57-110,
4.57.6; removed in 5): drop `model/`, `h<i>` is layer i, `w` and `g` are `weight`, `b` is `bias`, `wte` / `wpe` are
the embeddings' `weight`, and every array squeezed (a Conv1D `w` is [1, nx, nf] in TensorFlow, [nx, nf] in
transformers). The config: OpenAI's gpt-2 src/model.py builds LayerNorm with epsilon 1e-5, the tanh GeLU
(transformers' gelu_new), attention scaled by 1/sqrt(head size), an MLP of 4 x n_embd and logits from wte
(tied): transformers' GPT2Config defaults, with n_vocab, n_ctx, n_embd, n_head, n_layer from hparams.json.
"""

from __future__ import annotations

import json
import os
import re

import torch

from megatron_glue.convert.tf_bundle import BundleReader, TFCheckpointError

HPARAMS = ("n_vocab", "n_ctx", "n_embd", "n_head", "n_layer")


def checkpoint_prefix(folder: str) -> str:
    """The checkpoint in `folder`: the one its `checkpoint` file names (as tf.train.latest_checkpoint reads it),
    else its only `*.index`."""
    state = os.path.join(folder, "checkpoint")
    if os.path.isfile(state):
        with open(state) as f:
            m = re.search(r'^model_checkpoint_path:\s*"(.*)"\s*$', f.read(), re.M)
        if m is None:
            raise TFCheckpointError(f"{state}: no model_checkpoint_path line; expected the file tf.train.Saver writes")
        return os.path.join(folder, m.group(1))  # a relative path is relative to the folder
    indexes = sorted(n[:-len(".index")] for n in os.listdir(folder) if n.endswith(".index"))
    if len(indexes) != 1:
        raise TFCheckpointError(f"{folder}: {'no' if not indexes else len(indexes)} *.index files and no "
                                "`checkpoint` file; expected OpenAI's gpt-2 layout (model.ckpt.index, "
                                "model.ckpt.data-00000-of-00001, checkpoint, hparams.json)")
    return os.path.join(folder, indexes[0])


def gpt2_config(folder: str) -> dict:
    """The transformers config.json of the GPT-2 whose hparams.json is in `folder`."""
    path = os.path.join(folder, "hparams.json")
    if not os.path.isfile(path):
        raise TFCheckpointError(f"{folder}: no hparams.json; OpenAI's gpt-2 checkpoints give the model's sizes "
                                f"there ({', '.join(HPARAMS)})")
    with open(path) as f:
        try:
            h = json.load(f)
        except json.JSONDecodeError as e:
            raise TFCheckpointError(f"{path} is not JSON ({e.msg} at line {e.lineno})")
    missing = [k for k in HPARAMS if not isinstance(h, dict) or not isinstance(h.get(k), int)]
    if missing:
        raise TFCheckpointError(f"{path}: no integer {missing[0]!r}; OpenAI's hparams.json gives "
                                f"{', '.join(HPARAMS)}")
    return {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "vocab_size": h["n_vocab"],
            "n_positions": h["n_ctx"], "n_embd": h["n_embd"], "n_head": h["n_head"], "n_layer": h["n_layer"],
            "n_inner": None, "layer_norm_epsilon": 1e-5, "activation_function": "gelu_new",
            "scale_attn_weights": True, "tie_word_embeddings": True, "dtype": "float32"}


def transformers_name(tf_name: str) -> str:
    """transformers' GPT-2 name of an OpenAI TensorFlow variable (load_tf_weights_in_gpt2's walk); a name outside
    `model/` is returned as it is."""
    if not tf_name.startswith("model/"):
        return tf_name
    out = ["transformer"]
    for part in tf_name[len("model/"):].split("/"):
        m = re.fullmatch(r"([A-Za-z]+)(\d+)", part)
        if m:
            out += [m.group(1), m.group(2)]
        elif part in ("w", "g"):
            out.append("weight")
        elif part == "b":
            out.append("bias")
        elif part in ("wte", "wpe"):
            out += [part, "weight"]
        else:
            out.append(part)
    return ".".join(out)


def tf_name(name: str) -> str:
    """The OpenAI TensorFlow variable of a transformers GPT-2 name: `transformers_name`'s inverse."""
    if not name.startswith("transformer."):
        return name
    out: list[str] = []
    for part in name[len("transformer."):].split("."):
        if part.isdigit() and out:
            out[-1] += part  # h.3 -> h3
        else:
            out.append(part)
    if out[-1] == "bias":
        out[-1] = "b"
    elif out[-1] == "weight" and len(out) > 1:  # the embeddings' weight is the variable itself; a norm's is g
        out[-1:] = [] if out[-2] in ("wte", "wpe") else ["g" if out[-2].startswith("ln_") else "w"]
    return "model/" + "/".join(out)


class TFGPT2Reader:
    """hf_io.HFReader's interface over OpenAI's GPT-2 TensorFlow checkpoint: transformers' names, its shapes."""

    missing_hint = "is it a complete GPT-2 checkpoint (OpenAI's gpt-2 layout)?"

    def __init__(self, folder: str):
        self.folder = folder
        self.prefix = checkpoint_prefix(folder)
        self.bundle = BundleReader(self.prefix)
        self._tf = {transformers_name(n): n for n in self.bundle.names()}

    def source_name(self, name: str) -> str:
        """The checkpoint's own name of a transformers name (this checkpoint's, or the one it would have)."""
        return self._tf.get(name) or tf_name(name)

    def names(self) -> list[str]:
        return list(self._tf)

    def __contains__(self, name: str) -> bool:
        return name in self._tf

    def get(self, name: str) -> torch.Tensor:
        if name not in self._tf:
            raise TFCheckpointError(f"{self.prefix}: the checkpoint has no tensor {self.source_name(name)!r}")
        t = self.bundle.read(self._tf[name])
        # a Conv1D's w is [1, nx, nf] (OpenAI's conv1d); transformers squeezes it to [nx, nf]
        return t[0] if t.dim() == 3 and t.shape[0] == 1 else t
