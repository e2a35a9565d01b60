"""Run a lowered FX graph, freeing each input as soon as the graph is done with it.

aot_autograd calls compiled graphs with the boxed convention: one list of arguments, which the callee may
clear. ``make_boxed_func(gm)`` keeps that list alive for the whole call, so every saved activation lives to
the end of the backward; here the generated code itself unpacks and clears the list, and the code FX generates
drops every value (inputs included) after its last use.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.fx.graph import _BoxedCodeGen

from npu_compile import regions


def boxed_executor(gm: torch.fx.GraphModule) -> Callable[[list], object]:
    """A boxed callable running ``gm`` that releases its arguments as it goes; a region call runs the region's
    compiled subgraph."""
    regions.run_compiled(gm)
    gm.graph.set_codegen(_BoxedCodeGen())
    gm.recompile()

    def run(args: list) -> object:
        return gm(args)

    run._boxed_call = True  # type: ignore[attr-defined]
    return run
