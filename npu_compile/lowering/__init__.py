"""Targets: where a compiled graph runs, each one package that declares what it adds to the pipeline.

A :class:`Target` says how to get ready (``prepare``: import torch_npu, register npu-sim's emulation), which
aten-level stages it runs before lowering (the npu targets' MC2 rewrite), its op table (fused op → the calls it
becomes, :class:`npu_compile.lowering.npu.emit.Mapping`), how it rewrites a graph with that table (``lower``),
and how the lowered graph runs (``executor``: op by op, or handed to a graph compiler). The backend asks
:func:`target` for the one its options name and composes; it knows no target by name.

    reference  plain torch, any device (reference.py)
    npu        torch_npu calls; torchair GE / aclgraph or op by op on the NPU (npu/)
    npu-sim    the same calls as npu, run on the CPU by an emulation of those ops (npu_sim/)

A new target is one new package here exporting ``TARGET``, and its name in ``config.TargetName``. Lowering
imports no pass.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from npu_compile.config import Options

# One aten-level stage: (graph, options, graph kind) -> report.json ``unfused`` entries (or None).
Stage = Callable[[torch.fx.GraphModule, Options, str], "list[dict[str, str]] | None"]


@dataclasses.dataclass(frozen=True)
class Target:
    """What one target adds to the pipeline (module doc)."""

    name: str
    lower: Callable[[torch.fx.GraphModule, Options], list[dict[str, str]]]  # -> ``unfused`` entries
    executor: Callable[[torch.fx.GraphModule, Sequence[Any], Options], Callable]
    prepare: Callable[[], None] = lambda: None
    stages: tuple[tuple[str, Stage], ...] = ()  # run after memory ordering, before overlap scheduling
    table: Mapping[Any, Any] = dataclasses.field(default_factory=dict)  # fused op -> Mapping
    # The string this target's graphs name a process group's communicator with, baked in at compile time (npu's
    # MC2 ops take the HCCL communicator name): part of the compile cache's key. None: the target bakes none.
    communicator: Callable[[torch.distributed.ProcessGroup], str] | None = None
    # What the target's graph compiler will make of a lowered graph, before it runs: (gm, example inputs, options)
    # -> {"graph_mode": ..., "torchair_check": ..., "reason": ...} for report.json ``graph_modes``, plus
    # "artifacts": {file name: text} for the dump dir (npu's GE graph text). None: the target runs graphs op by op.
    describe: Callable[[torch.fx.GraphModule, Sequence[Any], Options], dict[str, Any]] | None = None
    # Op kinds (option ``recompute``'s: "activation") whose outputs the partition saves rather than recomputes in
    # the backward when memory allows (memory_budget 1.0). torch's min-cut counts recomputing an elementwise op
    # free, true where it is one pass at memory bandwidth beside the matmuls (an NPU's vector unit) but not where
    # it is compute (a CPU's GeLU tanh / SwiGLU exp). A budget below 1.0 may still recompute them, weighed by the
    # cost model; option ``recompute`` still forces it.
    saved_at_full_budget: tuple[str, ...] = ()


def _package(name: str) -> str:
    return "npu_compile.lowering." + name.replace("-", "_")


def target(name: str) -> Target:
    """The :class:`Target` called ``name`` (``npu-sim`` lives in package ``npu_sim``)."""
    try:
        module = importlib.import_module(_package(name))
    except ModuleNotFoundError as e:
        if e.name != _package(name):
            raise
        raise NotImplementedError(f"npu_compile target {name!r} has no lowering in this build") from None
    return module.TARGET
