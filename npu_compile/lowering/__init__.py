"""Lowering: map the fused ops of a graph onto one target's calls, one module per target.

Each target module holds a table from fused op to (check, lower): the check says whether this target can take a
given node and, when not, why; such nodes keep their reference kernel and the reason goes to report.json. Each
module also says how its lowered graph runs (:func:`executor`): op by op, or handed to a graph compiler.
Lowering never imports passes.

    reference  plain torch, any device (reference.py)
    npu        torch_npu calls; torchair GE / aclgraph or op by op on the NPU (npu.py)
    npu-sim    the same calls as npu, run on the CPU by an emulation of those ops (npu_sim.py)
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

import torch

# target name -> module under npu_compile.lowering
_MODULES = {"reference": "reference", "npu": "npu", "npu-sim": "npu_sim"}


def _module(target: str) -> ModuleType:
    if target not in _MODULES:
        raise NotImplementedError(
            f"npu_compile target {target!r} has no lowering in this build; available: {', '.join(_MODULES)}"
        )
    return importlib.import_module(f"npu_compile.lowering.{_MODULES[target]}")


def lower(gm: torch.fx.GraphModule, opts: Any) -> list[dict[str, str]]:
    """Rewrite ``gm`` in place for ``opts.target``; returns the nodes left on their reference kernel, with reasons."""
    return _module(opts.target).lower(gm, opts)


def executor(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], opts: Any) -> Callable:
    """The boxed callable that runs the lowered ``gm`` on ``opts.target``."""
    return _module(opts.target).executor(gm, example_inputs)
