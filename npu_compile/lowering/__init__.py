"""Lowering: map the fused ops of a graph onto one target's calls, one module per target.

Each target module holds a table from fused op to (check, lower): the check says whether this target can take a
given node and, when not, why; such nodes keep their reference kernel and the reason goes to report.json.
Lowering never imports passes.
"""

from __future__ import annotations

import importlib

import torch

# target name -> module under npu_compile.lowering
_MODULES = {"reference": "reference"}


def lower(gm: torch.fx.GraphModule, target: str) -> list[dict[str, str]]:
    """Rewrite ``gm`` in place for ``target``; returns the nodes left on their reference kernel, with reasons."""
    if target not in _MODULES:
        raise NotImplementedError(
            f"npu_compile target {target!r} has no lowering in this build; available: {', '.join(_MODULES)}"
        )
    return importlib.import_module(f"npu_compile.lowering.{_MODULES[target]}").lower(gm)
