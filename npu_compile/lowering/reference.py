"""Target ``reference``: every fused op runs its plain-torch reference kernel (any device torch runs on).

Nothing to rewrite: the ``npu_compile`` custom ops already dispatch to their reference kernels. This is the
target the CPU tests and the demo use, and the fallback of every other target's unsupported nodes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from npu_compile.executor import boxed_executor


def lower(gm: torch.fx.GraphModule, opts: Any) -> list[dict[str, str]]:
    return []


def executor(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
    return boxed_executor(gm)
