"""Target ``reference``: every fused op runs its plain-torch reference kernel (any device torch runs on).

Nothing to prepare, no stage, an empty lowering: the graph keeps the ``npu_compile`` custom ops, and the
executor calls each one's reference kernel directly (``kernels()``), the function the op was defined from,
rather than through ``torch.ops`` (the dispatcher, the autograd wrapper and Dynamo's disable guard around every
call: tens of µs each, most of a small kernel's time). The compiled graphs run with no autograd recording, so
nothing of the op's registration is needed there. This is the target the CPU tests and the demo use, and the
fallback of every other target's unsupported nodes.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch._library import custom_ops

from npu_compile.executor import boxed_executor
from npu_compile.lowering import Target


@functools.cache
def kernels() -> dict[torch._ops.OpOverload, Callable]:
    """Each ``npu_compile`` op's ``.default`` overload -> the Python function it was defined from."""
    import npu_compile.ops  # noqa: F401  (registers the ops)

    table = {}
    for name in torch.ops.npu_compile:
        opdef = custom_ops._maybe_get_opdef(f"npu_compile::{name}")
        if opdef is not None:
            table[getattr(torch.ops.npu_compile, name).default] = opdef._init_fn
    return table


TARGET = Target(
    name="reference",
    lower=lambda gm, opts: [],
    executor=lambda gm, example_inputs, opts: boxed_executor(gm, kernels()),
    # A CPU computes a GeLU's tanh or a SwiGLU's exp at a fraction of its memory bandwidth: recomputing one in the
    # backward cost ~5 % of a sequence-128 megatron-core GPT step, saving its output costs what eager holds.
    saved_at_full_budget=("activation",),
)
