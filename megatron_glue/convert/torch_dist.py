"""megatron-core `torch_dist` checkpoints written and read one tensor at a time.

Writing: the template is megatron-core's own `GPTModel.sharded_state_dict()` of a model built on the meta
device (no memory), so keys, global shapes, the GLU fc1's two chunks, `_extra_state` objects and DCP metadata
are exactly what megatron-core writes. `dist_checkpointing.save` runs with a save strategy whose planner
produces each chunk's data when torch.distributed.checkpoint's single-threaded writer asks for it (its
`_SerialCpuLoader` resolves one item, writes it, drops it): the converted model is never in memory.

Reading: `dist_checkpointing.load` of one layer's slices at a time (a ShardedTensor at offset i of the layer
axis), so a checkpoint saved at any TP/PP (its keys are global) is read without holding the model.
"""

from __future__ import annotations

import warnings
from typing import Callable

import torch

LAYERS = "decoder.layers."


def _keys_map(normalization: str) -> dict[str, str]:
    """The local layer spec saves its norms under Transformer Engine's names (`sharded_state_dict_keys_map`:
    input_layernorm.weight -> self_attention.linear_qkv.layer_norm_weight), so that TE and local checkpoints
    interchange."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return dict(get_gpt_layer_local_spec(normalization=normalization).submodules.sharded_state_dict_keys_map)


def numbered_layer(sharded: str) -> tuple[int, str] | None:
    """(layer, the rest) of a key after decoder.layers. that names its layer: megatron-core's block saves each
    layer under its own number, with no layer axis, when its layers differ (transformer_block.py
    `sharded_state_dict`: non_homogeneous_layers, e.g. linear_attention_freq > 1); None for a stacked key."""
    head, dot, rest = sharded.partition(".")
    return (int(head), rest) if dot and head.isdigit() else None


def module_name(sharded: str, normalization: str) -> str:
    """A layer tensor's module name (the family tables' names) from its checkpoint key (after decoder.layers.)."""
    for module, key in _keys_map(normalization).items():
        if sharded.startswith(key):
            return module + sharded[len(key):]
    return sharded


# megatron-core's SequentialMLP saves its local experts' tensors under one key with a global expert axis after the
# layer axis (experts.py, `SequentialMLP.sharded_state_dict`: local_experts.<j> -> experts, offset by the rank's
# first expert): the family tables name them per expert, EXPERT_MODULE with {e}
EXPERT_KEY = "mlp.experts.experts."
EXPERT_MODULE = "mlp.experts.local_experts.{e}."


def expert_name(sharded: str) -> str | None:
    """The family tables' per-expert name template of an expert key (after decoder.layers.), else None."""
    return EXPERT_MODULE + sharded[len(EXPERT_KEY):] if sharded.startswith(EXPERT_KEY) else None


def sharded_name(module: str, normalization: str) -> str:
    if module.startswith(EXPERT_MODULE):
        return EXPERT_KEY + module[len(EXPERT_MODULE):]
    for prefix, key in _keys_map(normalization).items():
        if module.startswith(prefix):
            return key + module[len(prefix):]
    return module


def _strategy(produce: Callable[[str, tuple, tuple], torch.Tensor]):
    from megatron.core.dist_checkpointing.strategies.torch import (
        MCoreSavePlanner, TorchDistSaveShardedStrategy, _replace_state_dict_keys_with_sharded_keys,
        mcore_to_pyt_state_dict)
    from torch.distributed.checkpoint import FileSystemWriter, save as dcp_save
    from torch.distributed.checkpoint.planner import WriteItemType

    class LazyPlanner(MCoreSavePlanner):
        def resolve_data(self, write_item):
            if write_item.type == WriteItemType.BYTE_IO:
                return super().resolve_data(write_item)
            chunk = write_item.tensor_data.chunk
            return produce(write_item.index.fqn, tuple(chunk.offsets), tuple(chunk.sizes))

    class StreamingSave(TorchDistSaveShardedStrategy):
        """torch_dist, version 1, written synchronously by one thread from `produce`."""

        def __init__(self):
            super().__init__("torch_dist", 1, thread_count=1)

        def save(self, sharded_state_dict, checkpoint_dir):
            grouped, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded_state_dict, True)
            pyt_state_dict = mcore_to_pyt_state_dict(grouped, False)
            dcp_save(pyt_state_dict, storage_writer=FileSystemWriter(str(checkpoint_dir), thread_count=1),
                     planner=LazyPlanner(dedup_replicated_tensors=False, flatten_state_dict=False))

    return StreamingSave()


def save_streaming(state: dict, folder: str, produce: Callable[[str, tuple, tuple], torch.Tensor]) -> None:
    """Save `state` (a sharded state dict whose tensors may be meta) with every tensor chunk's data from
    `produce(key, global offsets, sizes)`."""
    from megatron.core import dist_checkpointing
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        dist_checkpointing.save(state, folder, sharded_strategy=_strategy(produce))
    except CheckpointException as e:  # a BaseException wrapping what `produce` raised: raise that itself
        raised = [exc for exc, _ in e.failures.values() if isinstance(exc, ValueError)]
        if raised:
            raise raised[0] from None
        raise


def tensor_metadata(folder: str) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Global shape and dtype of every tensor key in a torch_dist checkpoint folder."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = FileSystemReader(folder).read_metadata()
    return {key: (tuple(md.size), md.properties.dtype) for key, md in metadata.state_dict_metadata.items()
            if isinstance(md, TensorStorageMetadata)}


def load_slices(folder: str, wanted: dict[str, int | tuple[int, ...] | None], metadata: dict
                ) -> dict[str, torch.Tensor]:
    """{key: tensor}: for a layer key (`decoder.layers.*`) the slice `wanted[key]` of its layer axis (a tuple: of
    its leading axes, e.g. (layer, expert) for an MoE layer's experts), for the others the whole tensor. Read with
    torch.distributed.checkpoint's own reader: the chunks of the checkpoint that overlap each slice (however TP/PP
    split it when saving) land in their place."""
    from torch.distributed.checkpoint import FileSystemReader, load as dcp_load
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
    from torch.distributed.checkpoint.planner import LoadPlan
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

    targets = {}
    for key, layer in wanted.items():
        shape, dtype = metadata[key]
        if layer is None:
            targets[key] = ((0,) * len(shape), torch.empty(shape, dtype=dtype))
        else:
            lead = layer if isinstance(layer, tuple) else (layer,)
            targets[key] = (lead + (0,) * (len(shape) - len(lead)),
                            torch.empty((1,) * len(lead) + tuple(shape[len(lead):]), dtype=dtype))

    class SlicePlanner(DefaultLoadPlanner):
        def create_local_plan(self):
            items = []
            for key, (offsets, t) in targets.items():
                chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=t.shape)
                items += create_read_items_for_chunk_list(key, self.metadata.state_dict_metadata[key], [chunk])
            return LoadPlan(items)

        def resolve_tensor(self, read_item):
            t = targets[read_item.dest_index.fqn][1]
            for dim, (o, n) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
                t = t.narrow(dim, o, n)
            return t

        def commit_tensor(self, read_item, tensor):
            pass

    with warnings.catch_warnings():  # "torch.distributed is disabled ...": one process reads, by design
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        dcp_load({}, storage_reader=FileSystemReader(folder), planner=SlicePlanner(), no_dist=True)
    out = {}
    for key, (_, t) in targets.items():
        lead = wanted[key]
        out[key] = t if lead is None else t.reshape(t.shape[len(lead) if isinstance(lead, tuple) else 1:])
    # SlicePlanner, a class, lives in a reference cycle until the garbage collector runs: emptied, its closure no
    # longer holds this layer's tensors once the caller lets go of them (else a few layers pile up in memory)
    targets.clear()
    return out
