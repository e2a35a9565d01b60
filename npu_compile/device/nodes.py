"""What a node is to the cost model: a collective (and which), the wait that completes one, its bytes and group.

Collectives are functional collectives (``_c10d_functional``) as Dynamo and aot_autograd emit them: the op
returns at once and ``wait_tensor`` on its result completes it. A compute op that carries a collective (a
matmul fused with one: Ascend's MC2 kernels) is not a collective here: it completes on the compute stream and
holds the link while it runs. Whatever stage emits such an op declares it in ``node.meta[FUSED_COLLECTIVE]``
(:class:`FusedCollective`); :func:`fused_collective` reads it back. The cost model and the simulator need
nothing else from it, so they know no target.
"""

from __future__ import annotations

import dataclasses
import operator

import torch
from torch.fx.experimental.symbolic_shapes import optimization_hint

_C10D = "_c10d_functional"

# op name (without overload) -> collective kind, as the cost model knows them
KINDS = {
    "all_reduce": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather",
    "all_gather_into_tensor_out": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "all_to_all_single": "all_to_all",
    "broadcast": "all_gather",  # one rank's buffer to all: the bytes of an all-gather's output
}


FUSED_COLLECTIVE = "fused_collective"  # node.meta key of a compute op that carries a collective


@dataclasses.dataclass(frozen=True)
class FusedCollective:
    """A matmul fused with the collective next to it, as its emitter declares it (``node.meta[FUSED_COLLECTIVE]``).

    The operands are named by the op's schema arguments, so that the cost model reads their shapes off the node
    itself (a copied graph keeps them right)."""

    kind: str  # all_gather | reduce_scatter | all_reduce: the collective it carries
    ranks: int | None  # the collective's group size (None: unknown, the profile's ``ranks_per_node``)
    x1: str  # schema argument name of the matmul's left operand (for an all-gather: the local shard)
    x2: str  # ... and of its right operand
    bias: str | None = None  # ... and of a bias added to the product, if the op takes one


def _opname(node: torch.fx.Node) -> str | None:
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return None
    if node.target.namespace != _C10D:
        return None
    return node.target._opname


def is_collective(node: torch.fx.Node) -> bool:
    name = _opname(node)
    return name is not None and name != "wait_tensor"


def is_wait(node: torch.fx.Node) -> bool:
    return _opname(node) == "wait_tensor"


def fused_collective(node: torch.fx.Node) -> FusedCollective | None:
    """The collective a compute node carries (a matmul fused with it), as its emitter declared it; else None."""
    if node.op != "call_function":
        return None
    value = node.meta.get(FUSED_COLLECTIVE)
    return value if isinstance(value, FusedCollective) else None


def kind(node: torch.fx.Node) -> str:
    """all_gather | reduce_scatter | all_reduce | all_to_all (unknown collectives cost like an all-gather)."""
    return KINDS.get(_opname(node) or "", "all_gather")


def collective_of(wait: torch.fx.Node) -> torch.fx.Node | None:
    """The collective a ``wait_tensor`` completes (through the ``getitem`` of a coalesced collective)."""
    arg = wait.args[0]
    while isinstance(arg, torch.fx.Node) and arg.op == "call_function" and arg.target is operator.getitem:
        arg = arg.args[0]
    return arg if isinstance(arg, torch.fx.Node) and is_collective(arg) else None


def collectives(*graphs: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """The collective nodes of ``graphs`` in order."""
    return [n for gm in graphs for n in gm.graph.nodes if is_collective(n)]


def tensors(value: object) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in tensors(v)]
    return []


def nbytes(value: object) -> int:
    """Bytes of the tensors in a node's ``meta["val"]`` (or any value), shapes taken at their hints."""
    return sum(optimization_hint(t.numel(), fallback=0) * t.element_size() for t in tensors(value))


def comm_bytes(node: torch.fx.Node) -> int:
    """The size S of a collective in the cost formulas: the gathered output for an all-gather (and broadcast),
    the unreduced input otherwise."""
    if kind(node) == "all_gather":
        return nbytes(node.meta.get("val"))
    first = node.args[0]
    return nbytes(first.meta.get("val") if isinstance(first, torch.fx.Node) else first)


def group_name(node: torch.fx.Node) -> str | None:
    """The process group a collective runs on, by name (Dynamo passes names; compile-on-one-rank passes a node)."""
    schema_args = node.target._schema.arguments
    for i, arg in enumerate(schema_args):
        if arg.name == "group_name":
            value = node.args[i] if i < len(node.args) else node.kwargs.get("group_name")
            if isinstance(value, torch.fx.Node):
                pg = value.meta.get("val")
                return getattr(pg, "group_name", None)
            return value if isinstance(value, str) else None
    return None


def group_size(node: torch.fx.Node) -> int | None:
    """Ranks in the collective's group: from its ``group_size`` argument, else from the live process group."""
    schema_args = node.target._schema.arguments
    for i, arg in enumerate(schema_args):
        if arg.name == "group_size":
            value = node.args[i] if i < len(node.args) else node.kwargs.get("group_size")
            if isinstance(value, int):
                return value
    return resolve_group_size(group_name(node))


def resolve_group_size(name: str | None) -> int | None:
    """Ranks in the live process group called ``name``; None without one (no group, or not a c10d name)."""
    if name is None or not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return None
    try:
        return torch.distributed.distributed_c10d._resolve_process_group(name).size()
    except (KeyError, ValueError, RuntimeError):
        return None
