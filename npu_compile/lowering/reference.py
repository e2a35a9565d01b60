"""Target ``reference``: every fused op runs its plain-torch reference kernel (any device torch runs on).

Nothing to prepare, no stage, an empty table: the ``npu_compile`` custom ops already dispatch to their
reference kernels. This is the target the CPU tests and the demo use, and the fallback of every other target's
unsupported nodes.
"""

from __future__ import annotations

from npu_compile.executor import boxed_executor
from npu_compile.lowering import Target

TARGET = Target(
    name="reference",
    lower=lambda gm, opts: [],
    executor=lambda gm, example_inputs, opts: boxed_executor(gm),
)
