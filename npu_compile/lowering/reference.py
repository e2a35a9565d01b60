"""Target ``reference``: every fused op runs its plain-torch reference kernel (any device torch runs on).

Nothing to rewrite: the ``npu_compile`` custom ops already dispatch to their reference kernels. This is the
target the CPU tests and the demo use, and the fallback of every other target's unsupported nodes.
"""

from __future__ import annotations

import torch


def lower(gm: torch.fx.GraphModule) -> list[dict[str, str]]:
    return []
