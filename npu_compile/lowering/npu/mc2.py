"""MC2, the npu targets' aten stage: a matmul and the collective next to it become one torch_npu op.

    all_gather → mm        → npu_all_gather_base_mm(shard, w, hcom, world_size)   (and its gather_out)
    mm → reduce_scatter    → npu_mm_reduce_scatter_base(x, w, hcom, world_size)
    mm / addmm → all_reduce → npu_mm_all_reduce_base(x, w, hcom, bias=b)

On the device the fused op pipelines its communication with its matmul (tiles of the matmul go out as they are
done), so the collective hides behind the compute without any scheduling. Sites are found with Inductor's own
matchers (``micro_pipeline_tp.find_all_gather_patterns`` / ``find_reduce_scatter_patterns``); the all-reduce
site is matched here (Inductor has no mm → all-reduce matcher). Each site is taken only within torch_npu's
documented constraints (docs/npu_ops.md, MC2):

- x1 and x2 float16 / bfloat16, the same dtype (the non-quantized path; fp32 is not supported);
- AG / RS: x1 and x2 2-D, k ∈ [256, 65535), world size ∈ {2, 4, 8}, no bias (``bias`` must be None in this
  version), gather on x1 (gather_index 0: the collective's dim 0), x1 not transposed; RS: m % world_size == 0;
- AR: x1 2-D or 3-D, x2 2-D, world size ∈ {1, 2, 4, 8}, reduce_op 'sum', bias 1-D of size n and x1's dtype;
- all MC2 ops of one model use one communication domain (the first group taken; later groups are declined).

Declined sites keep their plain mm + collective, and the reason goes to report.json ``unfused``. The stage
(:func:`mc2_stage`) runs once per graph, after memory ordering and before the overlap scheduler, so that
bucketing cannot merge a collective an MC2 op would take (a merged collective is no MC2 site) and the schedule
is made for the ops that will run.

Sites may also be left plain by choice (``leave``: collective node name → why). Option ``mc2`` says which:
``auto`` (default), with ``overlap`` on, weighs under the device cost model fusing each site against leaving its
collective to the overlap scheduler (:func:`choose_mc2`, which schedules and simulates each candidate with
``comm``'s generic scheduler), and with ``overlap`` off fuses every site (no scheduler would hide a plain one);
``on`` fuses every site torch_npu takes, with no cost check (MindSpeed's ``--use-ascend-mc2``); ``off`` none. A
site left so is reported as ``npu: MC2 not taken: <why>``. Each fused op names its site in ``node.meta["mc2_site"]`` and
declares its collective to the cost model and simulator in ``node.meta[FUSED_COLLECTIVE]``.

``hcom``: each target says what string names a group's communicator (``hcom`` below): torch_npu wants the
HCCL communicator name (``pg._get_backend(npu).get_hccl_comm_name(rank)``, :func:`hccl_comm_name`), resolved at
compile time; npu-sim takes the c10d group name the ``_c10d_functional`` op carried (``"0"`` for the default
group) and its emulation runs the collective over that very process group.

Views: Megatron's 3-D activations reach the mm as ``view(x, [s·b, h]) → mm → view([s, b, n])``. Gathering or
scattering along dim 0 commutes with flattening the leading dims (given s % world_size == 0 for the scatter), so
the fused op takes the 2-D operand and the views are re-applied around it. Megatron gathers into a buffer it
allocated (``_all_gather_base(out, x)``), which functionalizes to ``copy(empty(...), wait)``: a copy into a fresh
tensor of the same shape, dtype and strides, which the rewrite reads through.
"""

from __future__ import annotations

import dataclasses
import logging
import operator
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch.fx import GraphModule, Node

from npu_compile.comm.schedule import MAX_EXTRA_BYTES, copy_module, peak_bytes, schedule_overlap
from npu_compile.config import Options
from npu_compile.device import cost
from npu_compile.device.nodes import FUSED_COLLECTIVE, FusedCollective, resolve_group_size
from npu_compile.device.profile import DeviceProfile, load
from npu_compile.lowering.npu.emit import Emitter, npu_op

log = logging.getLogger("npu_compile")

aten = torch.ops.aten
c10d = torch.ops._c10d_functional

MC2_DTYPES = (torch.float16, torch.bfloat16)
MC2_WORLD_SIZES = (2, 4, 8)  # Atlas A2: 2, 4 or 8 ranks over an all-mesh HCCS (A3 adds 16, 32)
MC2_AR_WORLD_SIZES = (1, 2, 4, 8)
K_RANGE = (256, 65535)  # k ∈ [256, 65535)
VIEWS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)
MATMULS = (aten.mm.default, aten.addmm.default)

OP_AG = "npu_all_gather_base_mm"
OP_RS = "npu_mm_reduce_scatter_base"
OP_AR = "npu_mm_all_reduce_base"


def fused_sites(gm: GraphModule) -> dict[str, Node]:
    """The MC2 ops of ``gm`` by the name of the collective node each replaced (its site)."""
    return {n.meta[SITE]: n for n in gm.graph.nodes if SITE in n.meta}


# MC2 op -> (the collective it carries, its matmul operands' schema names)
CARRIES = {OP_AG: ("all_gather", "self", "x2"), OP_RS: ("reduce_scatter", "self", "x2"),
           OP_AR: ("all_reduce", "x1", "x2")}


def declare(node: Node, ranks: int | None = None) -> FusedCollective | None:
    """Declare the collective the MC2 op ``node`` carries to the cost model and simulator
    (``node.meta[FUSED_COLLECTIVE]``); ``ranks`` defaults to its ``world_size`` (mm-all-reduce has none: the
    group its ``hcom`` names when that is a live c10d group, else unknown). None for any other node."""
    target = node.target if node.op == "call_function" else None
    name = target._opname if isinstance(target, torch._ops.OpOverload) and target.namespace == "npu" else None
    if name not in CARRIES:
        return None
    kind, x1, x2 = CARRIES[name]
    bound = dict(zip((a.name for a in target._schema.arguments), node.args)) | dict(node.kwargs)
    if ranks is None:
        ranks = bound.get("world_size") if kind != "all_reduce" else resolve_group_size(bound.get("hcom"))
    carried = FusedCollective(kind, ranks, x1=x1, x2=x2, bias="bias" if bound.get("bias") is not None else None)
    node.meta[FUSED_COLLECTIVE] = carried
    return carried


def declare_all(gm: GraphModule) -> int:
    """:func:`declare` every MC2 op of ``gm`` (ops written into a graph by hand or traced, not by the rewrite)."""
    return sum(declare(n) is not None for n in gm.graph.nodes)


def _val(n: Any) -> Any:
    return n.meta.get("val") if isinstance(n, Node) else None


# ==== constraints (pure functions of shapes, dtypes and the world size: testable without a graph) ==============

def _dtype_problem(x1: torch.Tensor, x2: torch.Tensor) -> str | None:
    if x1.dtype not in MC2_DTYPES:
        return f"x1 must be float16 or bfloat16, got {x1.dtype}"
    if x2.dtype != x1.dtype:
        return f"x2 must have x1's dtype {x1.dtype}, got {x2.dtype}"
    return None


def check_ag_rs(op: str, x1: torch.Tensor, x2: torch.Tensor, world_size: int, bias: Any = None) -> str | None:
    """None if ``op`` (all-gather-mm or mm-reduce-scatter) takes x1 (m, k) @ x2 (k, n) over ``world_size``
    ranks; else why not. For the all-gather, x1 is the local shard."""
    if world_size not in MC2_WORLD_SIZES:
        return f"{op}: world size must be 2, 4 or 8, got {world_size}"
    if x1.dim() != 2 or x2.dim() != 2:
        return f"{op}: x1 and x2 must be 2-D, got {tuple(x1.shape)} and {tuple(x2.shape)}"
    if why := _dtype_problem(x1, x2):
        return f"{op}: {why}"
    k = x1.shape[1]
    if not K_RANGE[0] <= k < K_RANGE[1]:
        return f"{op}: k must be in [{K_RANGE[0]}, {K_RANGE[1]}), got {k}"
    if x2.shape[0] != k:
        return f"{op}: x2 must be (k, n) with k = {k}, got {tuple(x2.shape)}"
    if bias is not None:
        return f"{op}: bias is not supported by torch_npu (must be None)"
    if not x1.is_contiguous():
        return f"{op}: x1 must not be transposed (non-contiguous)"
    if op == OP_RS and x1.shape[0] % world_size:
        return f"{op}: m must be divisible by the world size {world_size}, got m = {x1.shape[0]}"
    return None


def check_ar(x1: torch.Tensor, x2: torch.Tensor, world_size: int, reduce_op: str = "sum",
             bias: torch.Tensor | None = None) -> str | None:
    """None if npu_mm_all_reduce_base takes x1 (m, k) or (s, m, k) @ x2 (k, n) [+ bias] over ``world_size``."""
    op = OP_AR
    if world_size not in MC2_AR_WORLD_SIZES:
        return f"{op}: world size must be 1, 2, 4 or 8, got {world_size}"
    if reduce_op != "sum":
        return f"{op}: reduce_op must be 'sum', got {reduce_op!r}"
    if x1.dim() not in (2, 3) or x2.dim() != 2:
        return f"{op}: x1 must be 2-D or 3-D and x2 2-D, got {tuple(x1.shape)} and {tuple(x2.shape)}"
    if why := _dtype_problem(x1, x2):
        return f"{op}: {why}"
    if x2.shape[0] != x1.shape[-1]:
        return f"{op}: x2 must be (k, n) with k = {x1.shape[-1]}, got {tuple(x2.shape)}"
    if not x1.is_contiguous():
        return f"{op}: x1 must not be transposed (non-contiguous)"
    if bias is not None:
        if bias.dim() != 1 or bias.shape[0] != x2.shape[1]:
            return f"{op}: bias must be 1-D of size n = {x2.shape[1]}, got {tuple(bias.shape)}"
        if bias.dtype != x1.dtype:
            return f"{op}: bias must have x1's dtype {x1.dtype}, got {bias.dtype}"
    return None


# ==== hcom ===================================================================================================

def _world_size(group_name: Any) -> int | None:
    """The size of the group a collective names; None when this process cannot resolve it."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    if isinstance(group_name, torch.distributed.ProcessGroup):
        return group_name.size()
    try:
        return _resolve_process_group(group_name).size()
    except (ValueError, RuntimeError, KeyError):
        return None


Hcom = Callable[[torch.distributed.ProcessGroup], str]  # a group → the ``hcom`` string a target's MC2 ops take


def hccl_comm_name(pg: torch.distributed.ProcessGroup) -> str:
    """Target npu's ``hcom``: the group's HCCL communicator name; raises ValueError when it has none."""
    try:
        backend = pg._get_backend(torch.device("npu"))
        return backend.get_hccl_comm_name(torch.distributed.get_rank(pg))
    except Exception as e:  # no torch_npu / no HCCL backend on this group
        raise ValueError(f"no HCCL communicator name for group {pg.group_name!r} ({type(e).__name__}: {e})") from e


# ==== graph helpers ==========================================================================================

class _Matmul:
    """A 2-D matmul node (mm, or addmm with a bias), possibly behind a view of its output."""

    def __init__(self, mm: Node, out_view: Node | None = None):
        self.mm, self.out_view = mm, out_view
        if mm.target is aten.addmm.default:
            self.bias, self.x1, self.x2 = mm.args[0], mm.args[1], mm.args[2]
            self.plain = len(mm.args) == 3 and not mm.kwargs  # beta = alpha = 1
        else:
            self.bias, (self.x1, self.x2) = None, mm.args[:2]
            self.plain = True

    @property
    def result(self) -> Node:
        return self.out_view if self.out_view is not None else self.mm


def _producer_matmul(n: Node) -> _Matmul | None:
    """The matmul producing ``n`` (directly, or through one view of a 2-D result)."""
    if n.op == "call_function" and n.target in MATMULS:
        return _Matmul(n)
    if n.op == "call_function" and n.target in VIEWS and isinstance(n.args[0], Node):
        mm = n.args[0]
        if mm.op == "call_function" and mm.target in MATMULS and len(mm.users) == 1:
            return _Matmul(mm, n)
    return None


def _identity_copy(copy: Node, src: Node) -> bool:
    """``copy(empty(...), src)`` into a fresh tensor of ``src``'s shape, dtype and strides: ``src``'s values."""
    if copy.op != "call_function" or copy.target is not aten.copy.default or len(copy.args) != 2 or copy.kwargs:
        return False
    dst, arg = copy.args
    if arg is not src or not isinstance(dst, Node) or dst.target is not aten.empty.memory_format or len(dst.users) != 1:
        return False
    a, b = _val(dst), _val(src)
    return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
            and a.dtype == b.dtype and a.stride() == b.stride() and a.device == b.device)


def _x1_reader(src: Node, user: Node) -> tuple[Node | None, Node] | None:
    """(None, mm) when ``user`` is a matmul taking ``src`` as x1; (view, mm) when ``user`` is a 2-D view of ``src``
    that a matmul takes as x1; else None."""
    def takes_x1(mm: Node, x: Node) -> bool:
        return (mm.op == "call_function" and mm.target in MATMULS
                and mm.args[1 if mm.target is aten.addmm.default else 0] is x)

    if user.op != "call_function":
        return None
    if takes_x1(user, src):
        return None, user
    if user.target in VIEWS and len(_val(user).shape) == 2:
        mms = [u for u in user.users if takes_x1(u, user)]
        if mms:
            return user, mms[0]
    return None


SITE = "mc2_site"  # node.meta key of a fused op: the name of the collective node it replaced


class _Rewriter:
    """One rewrite of one graph: the communication domain its MC2 ops share, the sites it fuses, and the sites it
    declines or leaves (collective node name → report.json ``unfused`` entry, in the order met)."""

    def __init__(self, gm: GraphModule, hcom: Hcom, leave: Mapping[str, str] | str):
        from torch._guards import detect_fake_mode

        self.gm, self.hcom_of, self.leave = gm, hcom, leave
        self.domain: str | None = None  # the one group all MC2 ops of this graph use
        self.fused: list[str] = []
        self.declined: dict[str, dict[str, str]] = {}
        fake_mode = detect_fake_mode([n.meta.get("val") for n in gm.graph.nodes])
        # one emitter, re-aimed per insertion point: symbolic sizes in arguments become nodes once per graph
        self.em = Emitter(gm, next(iter(gm.graph.nodes)), fake_mode)

    def decline(self, op: str, why: str, site: Node) -> None:
        self.declined.setdefault(site.name, {"op": f"npu.{op}", "reason": f"npu: MC2 declined: {why}"})

    def left(self, op: str, site: Node) -> bool:
        """Whether ``site`` is to stay plain by choice (then reported with the choice's reason)."""
        why = self.leave if isinstance(self.leave, str) else self.leave.get(site.name)
        if why is not None:
            self.declined.setdefault(site.name, {"op": f"npu.{op}", "reason": f"npu: MC2 not taken: {why}"})
        return why is not None

    def hcom(self, op: str, group_name: Any, site: Node) -> str | None:
        name = group_name.group_name if isinstance(group_name, torch.distributed.ProcessGroup) else str(group_name)
        domain = self.domain
        if domain is not None and name != domain:
            self.decline(op, f"MC2 ops of one model must share one communication domain ({domain!r}), "
                             f"this site is on {name!r}", site)
            return None
        from torch.distributed.distributed_c10d import _resolve_process_group

        try:
            pg = group_name if isinstance(group_name, torch.distributed.ProcessGroup) else _resolve_process_group(
                group_name)
            hcom = self.hcom_of(pg)
        except (ValueError, RuntimeError, KeyError) as e:
            self.decline(op, str(e), site)
            return None
        self.domain = name
        return hcom

    def emit(self, before: Node, like: Node, target: Callable, *args: Any, **kwargs: Any) -> Node:
        return self.em.at(before, like)(target, *args, **kwargs)

    def fuse(self, op: str, node: Node, site: Node, ranks: int) -> None:
        """Mark ``node`` as the MC2 op that took ``site`` and declare the collective it carries."""
        node.meta[SITE] = site.name
        declare(node, ranks)
        self.fused.append(op)

    # ---- all-gather → mm --------------------------------------------------------------------------------------
    def all_gather(self, match: Any) -> None:
        ag, res, shard = match.ag_node, match.res_node, match.shard_node
        if match.gather_dim != 0 or res.target is not c10d.wait_tensor.default or len(ag.users) != 1:
            return self.decline(OP_AG, "only a dim-0 all-gather read by its wait alone is fused (gather_index 0)", ag)
        for copy in [u for u in res.users if _identity_copy(u, res)]:  # Megatron's gather into its own buffer
            if any(_x1_reader(copy, user) for user in copy.users):
                dst = copy.args[0]
                copy.replace_all_uses_with(res)
                self.gm.graph.erase_node(copy)
                self.gm.graph.erase_node(dst)
        consumer = next(filter(None, (_x1_reader(res, user) for user in res.users)), None)
        if consumer is None:
            return  # no matmul reads the gathered tensor: not an MC2 site
        view, mm_node = consumer
        mm = _Matmul(mm_node)
        shard_val, full_val = _val(shard), _val(res)
        ws = _world_size(match.group_name)
        if ws is None:
            return self.decline(OP_AG, f"cannot resolve process group {match.group_name!r}", ag)
        if shard_val is None or _val(mm.x2) is None:
            return self.decline(OP_AG, "no FakeTensor metadata on its inputs", ag)
        x1_val = shard_val if view is None else shard_val.reshape(-1, full_val.shape[-1])
        if view is not None and (shard_val.dim() < 2 or list(_val(view).shape) != [full_val.numel() // full_val.shape[-1],
                                                                                 full_val.shape[-1]]):
            return self.decline(OP_AG, "the gathered tensor is viewed other than by flattening its leading dims", ag)
        if not shard_val.is_contiguous():
            return self.decline(OP_AG, "x1 must not be transposed (the shard is non-contiguous)", ag)
        why = check_ag_rs(OP_AG, x1_val, _val(mm.x2), ws, mm.bias)
        if why:
            return self.decline(OP_AG, why, ag)
        if self.left(OP_AG, ag):  # read through the copy either way: the choice weighs MC2 against overlap alone
            return
        hcom = self.hcom(OP_AG, match.group_name, ag)
        if hcom is None:
            return
        x1 = shard if view is None else self.emit(mm_node, view, aten.view.default, shard, list(x1_val.shape))
        others = [u for u in res.users if u is not (view if view is not None else mm_node)]
        if view is not None:
            others += [u for u in view.users if u is not mm_node]
        fused = self.emit(mm_node, mm_node, npu_op(OP_AG), x1, mm.x2, hcom, ws, gather_output=bool(others))
        self.fuse(OP_AG, fused, ag, ws)
        out = self.emit(mm_node, mm_node, operator.getitem, fused, 0)
        mm_node.replace_all_uses_with(out)
        self.gm.graph.erase_node(mm_node)
        if others:
            gathered = self.emit(out, res, operator.getitem, fused, 1)
            # gather_out is x1 gathered: 2-D when x1 was a flattened view; readers of the wait see its own shape.
            full = gathered if view is None else self.emit(out, res, aten.view.default, gathered, list(full_val.shape))
            if view is not None:
                view.replace_all_uses_with(self.emit(out, view, aten.view.default, gathered, list(_val(view).shape)))
            res.replace_all_uses_with(full)
        for n in (view, res, ag):
            if n is not None and not n.users:
                self.gm.graph.erase_node(n)

    # ---- mm → reduce-scatter -------------------------------------------------------------------------------------
    def reduce_scatter(self, match: Any) -> None:
        rs, wait = match.reduce_scatter_node, match.wait_tensor_node
        mm = _producer_matmul(match.input_node)
        if mm is None:
            return  # not an MC2 site
        ws = _world_size(match.group_name)
        if ws is None:
            return self.decline(OP_RS, f"cannot resolve process group {match.group_name!r}", rs)
        if match.reduce_op != "sum":
            return self.decline(OP_RS, f"reduce_op must be 'sum', got {match.reduce_op!r}", rs)
        if match.scatter_dim != 0 or len(rs.users) != 1 or len(mm.result.users) != 1:
            return self.decline(OP_RS, "only a dim-0 reduce-scatter that alone reads the matmul is fused", rs)
        x1v, x2v = _val(mm.x1), _val(mm.x2)
        if x1v is None or x2v is None:
            return self.decline(OP_RS, "no FakeTensor metadata on its inputs", rs)
        if mm.out_view is not None:
            shape = list(_val(mm.out_view).shape)
            if shape[-1] != x2v.shape[-1] or shape[0] % ws:
                return self.decline(OP_RS, f"the matmul's result is viewed as {shape}, whose dim 0 the world size "
                                           f"{ws} does not divide", rs)
        why = check_ag_rs(OP_RS, x1v, x2v, ws, mm.bias)
        if why:
            return self.decline(OP_RS, why, rs)
        if self.left(OP_RS, rs):
            return
        hcom = self.hcom(OP_RS, match.group_name, rs)
        if hcom is None:
            return
        out = self.emit(wait, wait, npu_op(OP_RS), mm.x1, mm.x2, hcom, ws)
        self.fuse(OP_RS, out, rs, ws)
        if mm.out_view is not None:
            shape = list(_val(mm.out_view).shape)
            out = self.emit(wait, wait, aten.view.default, out, [shape[0] // ws, *shape[1:]])
        wait.replace_all_uses_with(out)
        for n in (wait, rs, mm.out_view, mm.mm):
            if n is not None and not n.users:
                self.gm.graph.erase_node(n)

    # ---- mm → all-reduce -------------------------------------------------------------------------------------------
    def all_reduce(self, ar: Node) -> None:
        waits = list(ar.users)
        if len(waits) != 1 or waits[0].target is not c10d.wait_tensor.default:
            return
        wait = waits[0]
        mm = _producer_matmul(ar.args[0])
        if mm is None:
            return
        reduce_op, group_name = ar.args[1], ar.args[2]
        ws = _world_size(group_name)
        if ws is None:
            return self.decline(OP_AR, f"cannot resolve process group {group_name!r}", ar)
        if len(mm.result.users) != 1:
            return self.decline(OP_AR, "the matmul's result has readers besides the all-reduce", ar)
        if not mm.plain:
            return self.decline(OP_AR, "addmm with beta/alpha other than 1", ar)
        x1v, x2v = _val(mm.x1), _val(mm.x2)
        if x1v is None or x2v is None:
            return self.decline(OP_AR, "no FakeTensor metadata on its inputs", ar)
        why = check_ar(x1v, x2v, ws, reduce_op, _val(mm.bias) if mm.bias is not None else None)
        if why:
            return self.decline(OP_AR, why, ar)
        if self.left(OP_AR, ar):
            return
        hcom = self.hcom(OP_AR, group_name, ar)
        if hcom is None:
            return
        kwargs = {"reduce_op": reduce_op} | ({"bias": mm.bias} if mm.bias is not None else {})
        out = self.emit(wait, wait, npu_op(OP_AR), mm.x1, mm.x2, hcom, **kwargs)
        self.fuse(OP_AR, out, ar, ws)
        if mm.out_view is not None:
            out = self.emit(wait, wait, aten.view.default, out, list(_val(mm.out_view).shape))
        wait.replace_all_uses_with(out)
        for n in (wait, ar, mm.out_view, mm.mm):
            if n is not None and not n.users:
                self.gm.graph.erase_node(n)


def rewrite_mc2(gm: GraphModule, hcom: Hcom, *, leave: Mapping[str, str] | str | None = None) -> list[dict[str, str]]:
    """Fuse the MC2 sites of ``gm`` in place, naming communicators with ``hcom``; returns report.json ``unfused``
    entries for the sites declined or left plain. ``leave``: sites to keep plain, by the name of their collective
    node, each with why (reported as "npu: MC2 not taken: <why>"; a site outside torch_npu's constraints is
    declined for that instead); a string: every site, for that reason. The ``npu`` ops must be defined (torch_npu,
    or npu-sim's registration)."""
    from torch._inductor.fx_passes.micro_pipeline_tp import find_all_gather_patterns, find_reduce_scatter_patterns

    graph = gm.graph
    if not any(n.op == "call_function" and getattr(n.target, "namespace", None) == "_c10d_functional"
               for n in graph.nodes):
        return []
    rw = _Rewriter(gm, hcom, leave if isinstance(leave, str) else dict(leave or {}))
    for match in find_all_gather_patterns(graph):
        if match.ag_node.graph is graph and match.ag_node in graph.nodes:
            rw.all_gather(match)
    for match in find_reduce_scatter_patterns(graph):
        if match.reduce_scatter_node in graph.nodes:
            rw.reduce_scatter(match)
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target is c10d.all_reduce.default and node in graph.nodes:
            rw.all_reduce(node)
    if rw.fused:
        from torch._inductor.pattern_matcher import stable_topological_sort

        stable_topological_sort(graph)  # a reader of the gathered tensor may precede the matmul it now follows
        graph.lint()
        gm.recompile()
    return list(rw.declined.values())


# ==== which sites to fuse: the cost model weighs MC2 against the overlap scheduler =============================

MAX_MC2_EVALUATIONS = 16  # candidate graphs the MC2 choice may simulate beyond its first three
# report.json ``unfused`` reason of a site left plain by choice (after "npu: MC2 not taken: "); the graph's figures
NOT_TAKEN = ("the cost model finds the graph faster with this collective left to the overlap scheduler "
             "(exposed {mc2:.1f} µs as MC2 vs {plain:.1f} µs scheduled)")
SWITCHED_OFF = "switched off by options['mc2']"  # the same, for every site under mc2="off"


@dataclasses.dataclass(frozen=True)
class MC2Candidate:
    """One way to rewrite a graph: the MC2 sites left plain, and the graph's simulated figures after the MC2
    rewrite and :func:`schedule_overlap`."""

    label: str
    left: frozenset[str]  # sites (collective node names) left plain
    total_us: float
    exposed_comm_us: float
    comm_us: float
    peak_bytes: int
    fits: bool  # peak within the scheduler's memory cap over the original graph's peak

    def key(self) -> tuple:
        """Least simulated time, then least exposed comm, then the most sites fused; within the cap first."""
        return not self.fits, round(self.total_us, 6), round(self.exposed_comm_us, 6), len(self.left)


@dataclasses.dataclass
class MC2Choice:
    sites: dict[str, cost.MC2Cost]  # every site the rewrite fuses, by collective node name, in graph order
    comm_bound: list[str]  # sites whose matmul is shorter than their collective
    candidates: list[MC2Candidate]  # in the order tried
    chosen: MC2Candidate
    reasons: dict[str, str]  # the chosen candidate's left sites → why (report.json ``unfused``)


def _describe(left: frozenset[str], sites: Sequence[str], comm_bound: Sequence[str]) -> str:
    if not left:
        return "all MC2"
    if left == set(sites):
        return "no MC2"
    if left == set(comm_bound):
        return "MC2 but the comm-bound sites"
    return "MC2 but " + ", ".join(s for s in sites if s in left)


def choose_mc2(
    gm: torch.fx.GraphModule,
    hcom: Hcom,
    profile: DeviceProfile | dict | None = None,
    *,
    max_extra_bytes: int = MAX_EXTRA_BYTES,
    max_evaluations: int = MAX_MC2_EVALUATIONS,
) -> MC2Choice | None:
    """Which MC2 sites of ``gm`` to fuse, by the cost model; ``gm`` is not changed (None: no site to fuse).

    Each candidate is a copy of ``gm`` rewritten with some sites left plain (:func:`rewrite_mc2` ``leave``), then
    scheduled (:func:`schedule_overlap`), then simulated. Tried first: (a) MC2 on every site, (b) no MC2, (c) MC2
    on all but the comm-bound sites (matmul shorter than the collective, :func:`cost.mc2_cost`); then, greedily,
    the best so far with one site's choice flipped (comm-bound sites first), while that improves it and at most
    ``max_evaluations`` more. The least simulated total time wins (tie: least exposed comm, then the most sites
    fused) among candidates whose peak live bytes stay within ``max_extra_bytes`` of the original order's.

    A site left plain gets as its reason the graph's exposed comm of the best candidate tried that fuses it
    against the chosen one's."""
    profile = load(profile)

    def rewritten(left: frozenset[str]) -> torch.fx.GraphModule:
        copy = copy_module(gm)
        rewrite_mc2(copy, hcom, leave={site: "" for site in left})
        return copy

    full = rewritten(frozenset())
    parts = {site: cost.mc2_cost(node, profile) for site, node in fused_sites(full).items()}
    if not parts:
        return None
    sites = list(parts)
    comm_bound = [s for s in sites if parts[s].matmul_us < parts[s].comm_us]
    cap = peak_bytes(gm.graph, gm.graph.nodes) + max_extra_bytes
    tried: dict[frozenset[str], MC2Candidate] = {}

    def evaluate(left: frozenset[str]) -> MC2Candidate:
        if left not in tried:
            candidate = full if not left else rewritten(left)
            timeline = schedule_overlap(candidate, profile, max_extra_bytes=max_extra_bytes).after
            peak = peak_bytes(candidate.graph, candidate.graph.nodes)
            tried[left] = MC2Candidate(_describe(left, sites, comm_bound), left, timeline.total_us,
                                       timeline.exposed_comm_us, timeline.comm_us, peak, peak <= cap)
            log.debug("MC2 candidate %s: total %.1f µs, exposed comm %.1f µs, peak %d B", tried[left].label,
                      timeline.total_us, timeline.exposed_comm_us, peak)
        return tried[left]

    for left in (frozenset(), frozenset(sites), frozenset(comm_bound)):
        evaluate(left)
    best = min(tried.values(), key=MC2Candidate.key)
    flips = comm_bound + [s for s in sites if s not in comm_bound]
    budget = max_evaluations
    improved = True
    while improved and budget > 0:
        improved = False
        for site in flips:
            left = best.left ^ {site}
            if left in tried:
                continue
            if budget == 0:
                break
            budget -= 1
            if evaluate(left).key() < best.key():
                best, improved = tried[left], True
    reasons = {}
    for site in sorted(best.left, key=sites.index):
        fused = min((c for c in tried.values() if site not in c.left), key=MC2Candidate.key)
        reasons[site] = NOT_TAKEN.format(mc2=fused.exposed_comm_us, plain=best.exposed_comm_us)
    return MC2Choice(parts, comm_bound, list(tried.values()), best, reasons)


def mc2_stage(gm: GraphModule, opts: Options, kind: str, *, hcom: Hcom,
              profile: DeviceProfile | dict | None = None) -> list[dict[str, str]]:
    """The npu targets' aten stage (any ``kind`` of graph): fuse the MC2 sites of ``gm``; returns report.json
    ``unfused`` entries for the sites declined or left plain.

    ``opts.mc2``: "auto" with ``opts.overlap``: the sites fused are chosen by the cost model (:func:`choose_mc2`):
    a site whose collective the scheduler hides better (e.g. a comm-bound one with independent compute beside it)
    stays a plain matmul + collective for the overlap stage after this one; "auto" without ``overlap``, and "on":
    every site within torch_npu's constraints is fused; "off": none, each reported. ``profile``: the device
    profile the choice costs with (default: ``device.profile.DEFAULT``)."""
    if opts.mc2 == "off":
        return rewrite_mc2(gm, hcom, leave=SWITCHED_OFF)
    choice = None
    if opts.mc2 == "auto" and opts.overlap:
        try:
            choice = choose_mc2(gm, hcom, profile)
        except Exception:
            log.warning("npu_compile: the MC2 choice for the %s graph failed; every site is fused", kind,
                        exc_info=True)
    unfused = rewrite_mc2(gm, hcom, leave=choice.reasons if choice else None)
    if choice is not None:
        log.info(
            "MC2 for the %s graph: %s (%d of %d sites fused): total %.1f µs, exposed comm %.1f µs; tried %s",
            kind, choice.chosen.label, len(choice.sites) - len(choice.chosen.left), len(choice.sites),
            choice.chosen.total_us, choice.chosen.exposed_comm_us,
            "; ".join(f"{c.label}: {c.total_us:.1f} / {c.exposed_comm_us:.1f} µs"
                      + ("" if c.fits else " (over the memory cap)") for c in choice.candidates),
        )
    return unfused
