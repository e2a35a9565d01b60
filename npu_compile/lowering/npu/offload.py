"""Host offload on the npu targets: ``offload`` / ``prefetch`` (option ``offload``) become torch's own copies.

    offload(x)             -> aten._to_copy(x, device=cpu, pin_memory=True, non_blocking=True)
    prefetch(host, device) -> aten._to_copy(host, device=device, non_blocking=True)

Pinned host memory makes the device → host copy asynchronous (torch_npu's copy to a pinned tensor is an
aclrtMemcpyAsync, as MindSpeed's swap relies on: mindspeed/core/memory/swap_attention/prefetch.py allocates its
host buffers with ``pin_memory=True`` and copies with ``non_blocking=True``). No torch_npu op is needed, so no
schema of the wheel is bound here. ``_to_copy`` keeps a dense tensor's strides (its default memory format is
``preserve_format``), as the reference kernels do.

Both copies run on the stream that issues them, in the order the graph issues them (lowering adds no side stream);
the graph modes that cannot take them are said in graph_modes.py (torchair's GE converter of ``_to_copy``
ignores ``device``; a captured graph would replay the host address of its capture).
"""

from __future__ import annotations

import torch

from npu_compile.config import Options
from npu_compile.lowering.npu.emit import Call, Emitter, Mapping, Outputs, fused

aten = torch.ops.aten
HOST = torch.device("cpu")
HOST_META = "npu_compile_host"  # the value lives in host memory: not in the device's live bytes (passes/memory.py)
COPY_META = "npu_compile_host_copy"  # a copy between device and host memory (graph_modes.py plans around it)


def check_copy(c: Call) -> str | None:
    return None


def emit_offload(em: Emitter, c: Call, opts: Options) -> Outputs:
    # inserted by hand: the fake mode cannot run _to_copy with pin_memory (torch's decomposition asserts it is not
    # True); the node's value is the offload's own, a host tensor of x's shape, strides and dtype
    with em.gm.graph.inserting_before(em.node):
        host = em.gm.graph.call_function(aten._to_copy.default, (c["x"],),
                                         {"device": HOST, "pin_memory": True, "non_blocking": True})
    host.meta.update({k: em.node.meta[k] for k in ("val", "stack_trace", "nn_module_stack") if k in em.node.meta})
    host.meta[HOST_META] = host.meta[COPY_META] = True
    em.emitted.append(host)
    return (host,)


def emit_prefetch(em: Emitter, c: Call, opts: Options) -> Outputs:
    back = em(aten._to_copy.default, c["host"], device=c["device"], non_blocking=True)
    back.meta[COPY_META] = True
    return (back,)


ROWS = {
    fused.offload.default: Mapping((), check_copy, emit_offload),
    fused.prefetch.default: Mapping((), check_copy, emit_prefetch),
}
