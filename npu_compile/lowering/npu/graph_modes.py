"""How target npu runs a lowered graph: torchair GE, torchair aclgraph (npugraph_ex), or op by op.

:func:`plan_graph` takes the requested ``graph_mode`` and demotes it, ge → aclgraph → eager, where the graph
holds what the mode cannot run (an op torchair has no GE converter for, a host read); each demotion names its
op and reason in report.json ``unfused``. The plan rides on the graph (``gm.meta[PLAN_META]``) to
:func:`executor`, which hands the graph to torchair or runs it op by op.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.fx import GraphModule, Node

from npu_compile.config import Options
from npu_compile.executor import boxed_executor
from npu_compile.lowering.npu.emit import Call, op_name
from npu_compile.lowering.npu.offload import COPY_META

aten = torch.ops.aten
log = logging.getLogger("npu_compile")

PLAN_META = "npu_compile_graph_plan"

# torch_npu ops with a GE converter in torchair 2.13 (torch_npu/dynamo/torchair/_ge_concrete_graph/ge_converter/
# custom/); npu_add_layer_norm and its backward have none. tests/lowering/test_torchair.py checks this table
# against the wheel's converters: every op here has one, every other npu op we emit has none.
GE_CONVERTERS = frozenset({
    "npu_fusion_attention", "npu_fusion_attention_grad", "npu_rms_norm", "npu_rms_norm_backward",
    "npu_add_rms_norm", "npu_gelu", "npu_gelu_backward", "npu_fast_gelu", "npu_fast_gelu_backward",
    "npu_swiglu", "npu_swiglu_backward", "npu_rotary_mul", "npu_rotary_mul_backward",
    "npu_grouped_matmul",  # custom/grouped_matmul.py
    "npu_moe_gating_top_k_softmax_v2",  # custom/npu_moe_gating_top_k_softmax_v2.py (GE MoeGatingTopKSoftmax)
    "npu_moe_gating_top_k",  # custom/npu_moe_gating_top_k.py (GE MoeGatingTopK)
    # MC2: torchair 2.13 registers GE converters for all three (ge_converter/custom/all_gather_matmul.py,
    # matmul_reduce_scatter.py, matmul_all_reduce.py).
    "npu_all_gather_base_mm", "npu_mm_reduce_scatter_base", "npu_mm_all_reduce_base",
})
GE_ATTENTION_LAYOUTS = ("BSH", "BNSD")
# aten ops whose torchair 2.13 converter raises whatever its arguments (ge_converter/aten/<op>.py); checked by
# running the converters (tests/lowering/test_torchair.py).
GE_REJECTED_ATEN = {
    aten.randint.low: "torchair's GE converter for aten.randint.low is 'not supported' (the dropout seed draw)",
    aten.where.ScalarOther: "torchair's GE converter for aten.where.ScalarOther is 'not supported'",
    aten.amax.default: "torchair's GE converter for aten.amax is 'not implemented'",
    aten.index_put.default: "torchair's GE converter for aten.index_put is 'not implemented'",
}
# Reductions GE's collectives take (torchair/_ge_concrete_graph/utils.py, normalize_reduceop_type).
GE_REDUCE_OPS = ("sum", "min", "max", "product")
ROTARY_GRAD_MAX_BROADCAST = 1024  # custom/npu_rotary_mul_backward.py: the product of r1's broadcast dims
TORCHAIR_MODES = {"ge": "max-autotune", "aclgraph": "npugraph_ex"}


@dataclasses.dataclass(frozen=True)
class GraphPlan:
    """How target npu runs one lowered graph: the graph mode after demotions, and why it was demoted."""

    requested: str
    graph_mode: str
    reasons: tuple[tuple[str, str], ...] = ()  # (op, why this graph left the requested mode)
    device: str = "npu"
    collectives: str = "hccl"  # functional collectives: HcomAllReduce & co. in GE, the HCCL process group otherwise

    def torchair_settings(self) -> dict[str, Any]:
        """torchair CompilerConfig fields (dotted names) for this plan; empty when the graph runs op by op."""
        if self.graph_mode == "eager":
            return {}
        return {"mode": TORCHAIR_MODES[self.graph_mode]}


def _static(*tensors: Any) -> bool:
    return all(isinstance(s, int) for t in tensors for s in t.shape)


def _rotary_blockers(name: str, call: dict[str, Any]) -> list[str]:
    """torchair's rotary converters on Atlas A2/A3 (custom/npu_rotary_mul.py, npu_rotary_mul_backward.py)."""
    problems = []
    if call.get("rotary_mode", "half") != "half":
        problems.append(f"torchair's GE converter builds RotaryMul, which rotates halves, whatever rotary_mode "
                        f"says (got {call['rotary_mode']!r})")
    if name == "npu_rotary_mul_backward":
        x, r1 = call["self"].meta["val"], call["r1"].meta["val"]
        if x.dim() != 4 or r1.dim() != 4:
            problems.append(f"torchair's GE converter for npu_rotary_mul_backward takes rank-4 x and r1, got "
                            f"{x.dim()} and {r1.dim()}")
        elif not _static(*(call[k].meta["val"] for k in ("grad", "self", "r1", "r2"))):
            problems.append("torchair's GE converter for npu_rotary_mul_backward takes static shapes only")
        else:
            broadcast = math.prod(s for s, r in zip(x.shape, r1.shape) if s != r)
            if x.shape[3] % 64 or broadcast > ROTARY_GRAD_MAX_BROADCAST:
                problems.append(
                    f"torchair's GE converter for npu_rotary_mul_backward takes a last dim that is a multiple of 64 "
                    f"and broadcast dims of product <= {ROTARY_GRAD_MAX_BROADCAST}, got {x.shape[3]} and "
                    f"{broadcast}")
    return problems


# A copy between device and host memory (option offload): the aten._to_copy nodes lowering/npu/offload.py marks.
HOST_COPY_GE = ("torchair's GE converter for aten._to_copy ignores device (it builds a TensorMove on the device, "
                "ge_converter/aten/_to_copy.py): a copy to or from host memory cannot run in a GE graph")
HOST_COPY_CAPTURE = ("a copy to or from host memory (option offload) cannot be captured: the graph would replay "
                     "the host buffer of its capture, and the pinned host buffer is allocated at each call")


def _host_copy(node: Node) -> bool:
    return node.meta.get(COPY_META, False)


def _ge_blockers(node: Node) -> list[str]:
    target = node.target
    if not isinstance(target, torch._ops.OpOverload):
        return []
    if _host_copy(node):
        return [HOST_COPY_GE]
    if target in GE_REJECTED_ATEN:
        return [GE_REJECTED_ATEN[target]]
    ns, name = target.namespace, target._schema.name.split("::")[-1]
    call = dict(zip((a.name for a in target._schema.arguments), node.args)) | dict(node.kwargs)
    if ns == "_c10d_functional":
        op = call.get("reduceOp", call.get("reduce_op"))
        if isinstance(op, str) and op.lower() not in GE_REDUCE_OPS:
            return [f"GE's collectives reduce by {', '.join(GE_REDUCE_OPS)} only, got {op!r} "
                    f"(torchair: 'ge unsupported reduce type')"]
        return []
    if ns == "npu_compile":
        # torchair would ask CANN's registry for an AscendIR named after the op (fx2ge_converter.py,
        # _get_converter_context: rms_norm -> RmsNorm) and bind our op's arguments to it: not our kernel
        camel = "".join(word.capitalize() for word in name.split("_"))
        return [f"a reference kernel (Python custom op) has no GE converter (torchair would bind it to whatever "
                f"AscendIR CANN registers as {camel})"]
    if ns != "npu":
        return []
    if name not in GE_CONVERTERS:
        return [f"torchair has no GE converter for {name}"]
    if name == "npu_moe_gating_top_k_softmax_v2":
        # custom/npu_moe_gating_top_k_softmax_v2.py passes renorm to ge.MoeGatingTopKSoftmax, whose builder takes
        # no renorm: the form emitted here (renorm 1) fails to convert (tests/lowering/test_torchair.py, topk_softmax*)
        return ["torchair 2.13's GE converter for npu_moe_gating_top_k_softmax_v2 passes renorm to "
                "ge.MoeGatingTopKSoftmax, which takes none (TypeError)"]
    if name.startswith("npu_rotary_mul"):
        return _rotary_blockers(name, call)
    if name.startswith("npu_fusion_attention"):
        problems = []
        if call.get("input_layout") not in GE_ATTENTION_LAYOUTS:
            problems.append(
                f"torchair's GE converter takes input_layout BSH or BNSD only, got {call['input_layout']!r}")
        if call.get("keep_prob", 1.0) != 1.0:
            problems.append(f"torchair's GE converter takes keep_prob == 1 only, got {call['keep_prob']}")
        if call.get("pse") is not None:
            problems.append("torchair's GE converter drops pse")
        return problems
    return []


_V3_ATTENTION = ("npu::npu_fusion_attention_v3", "npu::npu_fusion_attention_grad_v3")


def _capture_blockers(node: Node) -> list[str]:
    target = node.target
    if _host_copy(node):
        return [HOST_COPY_CAPTURE]
    if target is aten._local_scalar_dense.default:
        return ["a host read of the dropout seed cannot be captured"]
    if getattr(target, "namespace", None) == "npu" and target._schema.name in _V3_ATTENTION:
        call = dict(zip((a.name for a in target._schema.arguments), node.args)) | dict(node.kwargs)
        if call.get("input_layout") == "TND":
            return ["npu_fusion_attention_v3's aclgraph is documented for input_layout BNSD only "
                    "(torch_npu/_op_plugin_docs.py, npu_fusion_attention_v3), not TND (varlen_attention)"]
    if getattr(target, "namespace", None) == "npu_compile":
        call = Call(node)
        if call.args.get("dropout_p", 0.0) > 0.0 or call.args.get("p", 0.0) > 0.0:
            return ["a reference kernel with dropout reads its seed on the host"]
    return []


def plan_graph(gm: GraphModule, graph_mode: str) -> GraphPlan:
    """``graph_mode`` for ``gm``, demoted ge → aclgraph → eager where the graph holds what the mode cannot run."""
    reasons: list[tuple[str, str]] = []
    mode = graph_mode
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    if mode == "ge":
        found = [(op_name(n.target), why) for n in nodes for why in _ge_blockers(n)]
        if found:
            reasons += [(op, f"graph_mode 'ge' -> 'aclgraph': {why}") for op, why in dict.fromkeys(found)]
            mode = "aclgraph"
    if mode == "aclgraph":
        found = [(op_name(n.target), why) for n in nodes for why in _capture_blockers(n)]
        if found:
            reasons += [(op, f"graph_mode 'aclgraph' -> 'eager': {why}") for op, why in dict.fromkeys(found)]
            mode = "eager"
    return GraphPlan(requested=graph_mode, graph_mode=mode, reasons=tuple(reasons))


def torchair_compile(gm: GraphModule, example_inputs: Sequence[Any], plan: GraphPlan,
                     settings: dict[str, Any] | None = None) -> Callable:
    """Hand ``gm`` to torchair's per-graph compiler (the one torchair's own backend gives aot_autograd), with
    the plan's CompilerConfig fields and ``settings`` (dotted names) over them.

    An aclgraph conversion runs under the example inputs' fake mode. aot_autograd compiles a forward with that
    mode active but a backward lazily, at the first ``.backward()``, without it; torchair's aclgraph conversion
    re-runs each op on the fake inputs outside its own fake pass (torchair/_acl_concrete_graph/
    fx2acl_converter.py, ``parse_node``), so there an op that makes a tensor from sizes alone (the backward's
    ``aten.zeros``) would make a real one beside fake ones, which torch refuses."""
    import torchair  # installed by torch_npu; only the npu target (and torchair_check's child) gets here
    from torch._guards import detect_fake_mode

    config = torchair.CompilerConfig()
    for dotted, value in {**plan.torchair_settings(), **(settings or {})}.items():
        *path, leaf = dotted.split(".")
        owner = config
        for part in path:
            owner = getattr(owner, part)
        setattr(owner, leaf, value)
    fake_mode = detect_fake_mode(example_inputs) if plan.graph_mode == "aclgraph" else None
    with fake_mode if fake_mode is not None else contextlib.nullcontext():
        return torchair.get_compiler(config)(gm, list(example_inputs))


def executor(gm: GraphModule, example_inputs: Sequence[Any], opts: Options) -> Callable:
    """Target npu: the graph as its plan says, torchair's GE or aclgraph, or op by op. A graph torchair refuses
    to convert is demoted (ge → aclgraph → eager) with torchair's message, logged, rather than failing the job."""
    plan: GraphPlan | None = gm.meta.get(PLAN_META)
    while plan is not None and plan.graph_mode != "eager":
        try:
            return torchair_compile(gm, example_inputs, plan)
        except Exception as e:  # noqa: BLE001  (torchair's converters raise anything)
            lower = "aclgraph" if plan.graph_mode == "ge" else "eager"
            why = f"graph_mode {plan.graph_mode!r} -> {lower!r}: torchair refused the graph: {type(e).__name__}: {e}"
            log.warning("npu_compile: %s", why)
            plan = dataclasses.replace(plan, graph_mode=lower, reasons=(*plan.reasons, ("torchair", why)))
            gm.meta[PLAN_META] = plan
    return boxed_executor(gm)


def describe(gm: GraphModule, example_inputs: Sequence[Any], opts: Options) -> dict[str, Any]:
    """Target npu's plan for ``gm`` (recorded by its ``lower``, or made here for npu-sim, which lowers alike) and,
    with option ``torchair_check``, torchair's own conversion of it on the CPU (torchair_check): report.json
    ``graph_modes`` entry, and the GE graph text (or aclgraph's generated module) as dump-dir artifacts."""
    from npu_compile.lowering.npu import torchair_check

    plan = gm.meta.get(PLAN_META) or plan_graph(gm, opts.graph_mode)
    info: dict[str, Any] = {"graph_mode": plan.graph_mode}
    if plan.reasons:
        info["demoted"] = [f"{op}: {why}" for op, why in plan.reasons]
    if plan.graph_mode == "eager":
        return {**info, "torchair_check": torchair_check.CHECKED, "reason": "op by op: no torchair conversion"}
    if not opts.torchair_check:
        return {**info, "torchair_check": torchair_check.UNCHECKED, "reason": "option torchair_check is off"}
    start = time.perf_counter()
    (verdict,) = torchair_check.check([torchair_check.Graph.at_executor("", gm, example_inputs, plan.graph_mode)])
    info.update(verdict.to_json())
    if verdict.status != torchair_check.UNCHECKED:
        info["check_s"] = round(time.perf_counter() - start, 3)
    artifacts = {}
    if verdict.ge_text is not None:
        artifacts["ge_graph.txt"] = verdict.ge_summary
        artifacts["ge_graph.pbtxt"] = verdict.ge_text
    if verdict.aclgraph_code is not None:
        artifacts["aclgraph_module.py"] = verdict.aclgraph_code
    return {**info, "artifacts": artifacts} if artifacts else info
