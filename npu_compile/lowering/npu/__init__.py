"""Target ``npu``: every fused op becomes the torch_npu call Ascend runs, and torchair runs the graph.

    emit         the node being lowered (Call), the one emitter (Emitter), a table row (Mapping), the table's loop
    attention    fused_attention → npu_fusion_attention or its graph-mode _v3 (per graph mode), and its backward
    norms        rms_norm, add_rms_norm, add_layer_norm → the npu norm kernels
    activations  bias_gelu → npu_gelu / npu_fast_gelu, swiglu → npu_swiglu
    rotary       rotary → npu_rotary_mul
    dropout_add  bias_dropout_add → aten adds (no torch_npu kernel)
    offload      offload / prefetch (option offload) → aten._to_copy to pinned host memory and back, non_blocking
    cross_entropy  linear_cross_entropy → per chunk, mm + npu_cross_entropy_loss (+ backward);
                   vocab_parallel_linear_cross_entropy → per chunk, aten ops + functional all-reduces
    moe          grouped_matmul → npu_grouped_matmul (lists: one matmul per expert);
                 permute_tokens → npu_moe_token_permute_with_routing_map;
                 unpermute_tokens → npu_moe_token_unpermute_with_routing_map;
                 topk_softmax → npu_moe_gating_top_k_softmax_v2 (renorm 1);
                 topk_gating → npu_moe_gating_top_k (sigmoid / softmax, expert bias, groups)
    mc2          the aten stage fusing a matmul with its collective (npu_all_gather_base_mm & co.)
    graph_modes  how the lowered graph runs: torchair GE, aclgraph, or op by op
    ge_converters  the GE converters this target registers with torchair (npu_fusion_attention_grad's dsink)
    torchair_check  torchair's own conversion of the lowered graphs, run on a CPU from the pinned wheel
    schemas      the torch_npu 2.13.0 schemas of every op emitted

:data:`TABLE` maps each ``npu_compile`` op to one row (a check: can the NPU take this node? if not, why; and an
emitter: the ``torch.ops.npu`` calls, plus the views and casts that fit them to the op's outputs), each family's
rows registered beside their emitters. A node whose check fails keeps its reference kernel, which is plain torch
and runs on the NPU too; the reason goes to report.json ``unfused``. npu-sim lowers with this very table and
stage, so the graph proven on the CPU is the graph the NPU runs. What the torch_npu ops compute, with its
sources: docs/npu_ops.md.
"""

from __future__ import annotations

import functools
import importlib

from torch.fx import GraphModule

from npu_compile.config import Options
from npu_compile.lowering import Target
from npu_compile.lowering.npu import activations, attention, dropout_add, graph_modes, mc2, norms, rotary
from npu_compile.lowering.npu import cross_entropy, ge_converters, moe, offload
from npu_compile.lowering.npu.emit import lower_fused_ops  # noqa: F401  (npu-sim lowers with it too)

TABLE = {**attention.ROWS, **norms.ROWS, **activations.ROWS, **rotary.ROWS, **dropout_add.ROWS, **cross_entropy.ROWS,
         **moe.ROWS, **offload.ROWS}


def lower_table(gm: GraphModule, opts: Options) -> list[dict[str, str]]:
    """Rewrite ``gm``'s fused ops for ``opts.graph_mode`` (npu and npu-sim alike); report.json ``unfused``
    entries: the nodes left on their reference kernel, and which attention op the graph mode got and why."""
    return lower_fused_ops(gm, TABLE, opts) + attention.mode_notes(gm)


def lower(gm: GraphModule, opts: Options) -> list[dict[str, str]]:
    """Rewrite ``gm``'s fused ops for the NPU and plan how it runs; report.json ``unfused`` entries."""
    unfused = lower_table(gm, opts)
    plan = graph_modes.plan_graph(gm, opts.graph_mode)
    gm.meta[graph_modes.PLAN_META] = plan
    return unfused + [{"op": op, "reason": f"npu: {why}"} for op, why in plan.reasons]


def prepare() -> None:
    """torch_npu defines torch.ops.npu (config checked it imports); torchair, which comes with it, gets the GE
    converters this target needs (ge_converters: npu_fusion_attention_grad's fifth output)."""
    importlib.import_module("torch_npu")
    ge_converters.register(importlib.import_module("torchair"))


TARGET = Target(
    name="npu",
    prepare=prepare,
    stages=(("mc2", functools.partial(mc2.mc2_stage, hcom=mc2.hccl_comm_name)),),
    communicator=mc2.hccl_comm_name,
    table=TABLE,
    lower=lower,
    executor=graph_modes.executor,
    describe=graph_modes.describe,
)
