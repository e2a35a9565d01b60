"""MindSpeed's --noop-layers: transformer layers that pass their input through, so that a model whose layer count
does not divide the pipeline (Qwen3-235B's 94 layers on 8 stages) is given to megatron-core as --num-layers 96
with layers 94 and 95 empty.

As MindSpeed builds them (mindspeed/core/pipeline_parallel/noop_layers/: `transformer.py` build_layers_impl,
`adaptor.py` NoopTransformerLayer, `calc_flop.py`, `moe_metrics_tracker.py`; the flag's checks in
mindspeed/arguments.py:794-801): the layers whose 0-based global index is listed are built as a module without
parameters that returns a copy of its input and the context; every other layer keeps its number, so checkpoint
keys skip the empty ones (in the torch_dist format the layer axis holds the real layers only: the checkpoint of
the model without them); the FLOPs of --log-throughput count the real layers only; the
MoE losses are averaged over the MoE layers less the empty ones. Here the empty layers are not compiled (there is
nothing to fuse) and the memory plan counts the real layers' activations only.
"""

from __future__ import annotations

from functools import partial

import torch


class NoopTransformerLayer(torch.nn.Module):
    """A transformer layer that returns a copy of its input and the context (MindSpeed's NoopTransformerLayer).
    `layer_number` is its global number (1-based), as megatron-core's TransformerBlock reads it for checkpoint
    keys (`sharded_state_dict`: global_layer_offset = layer.layer_number - 1)."""

    def __init__(self, layer_number: int):
        super().__init__()
        self.layer_number = layer_number

    def forward(self, hidden_states, attention_mask=None, context=None, *args, **kwargs):
        return hidden_states.clone(), context

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata=None) -> dict:
        return {}

    def extra_repr(self) -> str:
        return f"layer_number={self.layer_number}"


def parse(text: str, num_layers: int, fail) -> list[int]:
    """--noop-layers "a,b,...": 0-based global layer indices, each in [0, --num-layers) (MindSpeed's check), sorted
    (a list, not MindSpeed's set: the job's saved arguments keep plain values)."""
    try:
        layers = {int(x) for x in text.split(",")}
    except ValueError:
        fail(f"--noop-layers {text!r}: expected comma-separated layer indices (0-based), e.g. 94,95")
    if bad := sorted(i for i in layers if not 0 <= i < num_layers):
        fail(f"--noop-layers {text}: layer {bad[0]} is not in 0..{num_layers - 1}; each index must be at least 0 "
             f"and smaller than --num-layers {num_layers}")
    if len(layers) == num_layers:
        fail(f"--noop-layers {text}: every layer of --num-layers {num_layers} is empty; leave at least one real layer")
    return sorted(layers)


def replace(model, noop: list[int] | None) -> int:
    """Replace the decoder layers of `model` (one pipeline stage of megatron-core's GPTModel) whose global index is
    in `noop` by NoopTransformerLayer; the number replaced."""
    if not noop:
        return 0
    layers = model.decoder.layers
    replaced = 0
    real = model.config.num_layers - len(noop)
    for i, layer in enumerate(layers):
        if layer.layer_number - 1 in noop:
            layers[i] = NoopTransformerLayer(layer.layer_number)
            replaced += 1
        else:
            index = layer.layer_number - 1 - sum(1 for j in noop if j < layer.layer_number - 1)
            layer.sharded_state_dict = partial(_compact_sharded_state_dict, layer.sharded_state_dict, index, real)
    return replaced


def _compact_sharded_state_dict(original, index: int, real: int, prefix: str = "", sharded_offsets=(),
                                metadata=None):
    """A real layer's torch_dist tensors on a layer axis of the real layers alone: megatron-core's TransformerBlock
    stacks each layer's tensors on an axis of --num-layers entries at the layer's global index
    (transformer_block.py `sharded_state_dict`: (0, layer_number - 1, num_layers)), which the empty layers would
    leave unwritten (dist_checkpointing refuses such an access pattern at save). Here the axis has the real
    layers only, each at its index among them: the checkpoint is that of the model without the empty layers."""
    offsets = list(sharded_offsets)
    if offsets and offsets[0][0] == 0:
        offsets[0] = (0, index, real)
    return original(prefix, tuple(offsets), metadata)


def real_layers(layers) -> list:
    """The layers of a stage that compute (not NoopTransformerLayer)."""
    return [layer for layer in layers if not isinstance(layer, NoopTransformerLayer)]


def moe_mean_scale(args) -> float:
    """The factor from megatron-core's mean of the MoE losses over the MoE layers (track_moe_metrics:
    --moe-layer-freq's MoE layers) to MindSpeed's mean over those less the empty layers
    (noop_layers/moe_metrics_tracker.py `get_mean`: values.sum() / (num_moe_layers - len(noop_layers)))."""
    n = count(args)
    if not n:
        return 1.0
    freq = getattr(args, "moe_layer_freq", 1)
    moe = sum(freq) if isinstance(freq, list) else sum(1 for i in range(args.num_layers) if i % freq == 0)
    return moe / (moe - n) if moe > n else 1.0


def count(args) -> int:
    """The empty layers of the whole model."""
    return len(getattr(args, "noop_layers", None) or ())
