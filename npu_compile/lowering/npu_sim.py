"""Target ``npu-sim``: the graph target ``npu`` runs, run on the CPU by an emulation of the torch_npu ops.

Lowering is npu.py's table, call for call; only where the calls run differs. The first use registers the
emulator (npu_sim_kernels.py) under the ``npu`` namespace with torch_npu's schemas; it refuses where torch_npu
is installed. The lowered graph then runs op by op like any FX graph: GE and aclgraph need the device, so this
target proves the graph and its numerics, not torchair's compilation of it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from npu_compile.executor import boxed_executor
from npu_compile.lowering import npu, npu_sim_kernels


def lower(gm: torch.fx.GraphModule, opts: Any) -> list[dict[str, str]]:
    npu_sim_kernels.register()
    return npu.lower_fused_ops(gm, opts) + npu.lower_mc2(gm, opts)


def executor(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
    return boxed_executor(gm)
