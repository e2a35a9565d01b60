"""Per-node cost in microseconds on a :class:`~npu_compile.device.profile.DeviceProfile`.

- Matmul-class ops (mm, addmm, bmm, baddbmm, ``npu_compile.fused_attention`` and its backward,
  ``npu_compile.grouped_matmul`` and its weight gradient, anything in
  torch's flop registry): FLOPs counted from the shapes in ``node.meta["val"]`` over the cube rate, against
  the bytes they move over HBM bandwidth; the larger wins (roofline).
- Everything else that computes: bytes moved over HBM bandwidth against one vector op per output element.
- Views, ``getitem``, ``wait_tensor``: free.
- Collectives: the profile's algorithm for that kind of collective (:func:`collective_us`).
- A matmul fused with a collective (Ascend's MC2 kernels; :func:`nodes.fused_collective`): its pipelined time
  (:func:`mc2_cost`), on the compute stream; the simulator also holds the link for it.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from collections.abc import Callable

import torch
from torch.fx.experimental.symbolic_shapes import optimization_hint
from torch.utils.flop_counter import flop_registry

from npu_compile import regions
from npu_compile.device import nodes
from npu_compile.device.profile import DeviceProfile, load
from npu_compile.ops.layout import BNSD_DIMS

aten = torch.ops.aten


def collective_us(kind: str, nbytes: int, ranks: int, profile: DeviceProfile) -> float:
    """Time of one collective of size S = ``nbytes`` over ``ranks`` ranks (S: the gathered output of an
    all-gather, the unreduced input of a reduce-scatter / all-reduce / all-to-all).

    ring:       n-1 steps, each moving S/n over one link:          (n-1)·α + (n-1)/n · S / B
    full_mesh:  one step, S/n to each of n-1 peers on n-1 links:   α + (n-1)/n · S / ((n-1)·B)
    An all-reduce is a reduce-scatter then an all-gather: twice either.
    """
    n = ranks
    if n <= 1 or nbytes == 0:
        return 0.0
    alpha, bw = profile.link_latency_us, profile.link_bytes_per_s
    if profile.algorithm(kind) == "full_mesh":
        steps, seconds = 1, (n - 1) / n * nbytes / ((n - 1) * bw)
    else:
        steps, seconds = n - 1, (n - 1) / n * nbytes / bw
    one_pass = steps * alpha + seconds * 1e6
    return 2 * one_pass if kind == "all_reduce" else one_pass


def _hint(x) -> int:
    return optimization_hint(x, fallback=0)


def _shape(arg) -> tuple[int, ...]:
    val = arg.meta.get("val") if isinstance(arg, torch.fx.Node) else arg
    return tuple(_hint(s) for s in val.shape) if isinstance(val, torch.Tensor) else ()


def _attention_flops(node: torch.fx.Node, backward: bool) -> int:
    """QKᵀ and PV: 2·b·n·sq·sk·(d + dv); the backward recomputes QKᵀ and makes dV, dP, dQ, dK:
    2·b·n·sq·sk·(3d + 2dv). A causal mask skips about half of the score tiles."""
    q_at, k_at, v_at = (1, 2, 3) if backward else (0, 1, 2)
    q, k, v = (_shape(node.args[i]) for i in (q_at, k_at, v_at))
    if not (len(q) == len(k) == len(v) == 4):
        return 0
    bi, ni, si, di = BNSD_DIMS.get(node.kwargs.get("layout", "bnsd"), BNSD_DIMS["bnsd"])
    b, n, sq, d = q[bi], q[ni], q[si], q[di]
    sk, dv = k[si], v[di]
    flops = 2 * b * n * sq * sk * ((3 * d + 2 * dv) if backward else (d + dv))
    return flops // 2 if node.kwargs.get("causal", False) else flops


# matmul op -> positions of its two operands
_MATMULS = {aten.mm.default: (0, 1), aten.addmm.default: (1, 2), aten.bmm.default: (0, 1), aten.baddbmm.default: (1, 2)}


def _region_total(sub: torch.fx.GraphModule, per_region: dict | None, part: Callable[[torch.fx.Node], float]) -> float:
    """A region call's figure, the sum of ``part`` over its subgraph's calls: once per pass where ``per_region``
    (id(subgraph) -> figure) is given."""
    if per_region is not None and id(sub) in per_region:
        return per_region[id(sub)]
    total = sum(part(n) for n in sub.graph.nodes if n.op == "call_function")
    if per_region is not None:
        per_region[id(sub)] = total
    return total


def flops(node: torch.fx.Node, per_region: dict[int, int] | None = None) -> int:
    """Matrix FLOPs of a node (0 for ops that do not use the cube, and for nodes without shapes); a region call's
    are its subgraph's. ``per_region`` (id(subgraph) -> FLOPs, filled as met): a pass over a graph whose regions
    do not change meanwhile counts each region once, not once per call."""
    sub = regions.subgraph(node)
    if sub is not None:
        return _region_total(sub, per_region, lambda n: flops(n, per_region))
    target = node.target
    if target in _MATMULS:
        a, b = (_shape(node.args[i]) for i in _MATMULS[target])
        if not a or not b:
            return 0
        batch = a[0] if len(a) == 3 else 1  # bmm / baddbmm: [B, M, K] @ [B, K, N]
        return 2 * batch * a[-2] * a[-1] * b[-1]
    if isinstance(target, torch._ops.OpOverload) and target.namespace == "npu_compile":
        if target._opname == "fused_attention":
            return _attention_flops(node, backward=False)
        if target._opname == "fused_attention_backward":
            return _attention_flops(node, backward=True)
        if target._opname in ("grouped_matmul", "grouped_matmul_weight_grad"):
            return _grouped_matmul_flops(node)
        return 0
    # Anything else torch knows the FLOPs of (convolution, SDPA, ...): its own formula, on the fake values.
    key = getattr(target, "overloadpacket", None)
    if key in flop_registry:
        args, kwargs = torch.utils._pytree.tree_map_only(
            torch.fx.Node, lambda a: a.meta.get("val"), (node.args, node.kwargs)
        )
        try:
            return _hint(flop_registry[key](*args, **kwargs, out_val=node.meta.get("val")))
        except Exception:  # a formula that wants arguments this node lacks: treat as elementwise
            return 0
    return 0


def _grouped_matmul_flops(node: torch.fx.Node) -> int:
    """One matmul per expert: 2·m_i·k·n each (grouped_matmul: x_i [m_i, k] → [m_i, n]; its weight gradient:
    x_i [m_i, k], grad_y_i [m_i, n] → [k, n] either way round). Data-dependent token counts by their hints."""
    x, other = (node.args[0], node.args[1]) if len(node.args) > 1 else ([], [])
    outs = node.meta.get("val")
    if not isinstance(outs, (list, tuple)):
        return 0
    total = 0
    for a, out in zip(x, outs):
        shape = _shape(a)
        if not shape or not isinstance(out, torch.Tensor):
            return 0
        if node.target._opname == "grouped_matmul":
            total += 2 * shape[0] * shape[1] * _hint(out.shape[1])
        else:
            total += 2 * shape[0] * _hint(out.shape[0]) * _hint(out.shape[1])
    return total


def bytes_moved(node: torch.fx.Node) -> int:
    """Bytes a kernel reads and writes: its tensor inputs and outputs, each counted once."""
    return sum(nodes.nbytes(a.meta.get("val")) for a in set(node.all_input_nodes)) + nodes.nbytes(node.meta.get("val"))


# Allocations without a fill launch no kernel.
_ALLOCATIONS = {aten.empty.memory_format, aten.empty_strided.default, aten.empty_like.default}
# Views whose schema does not say so (``_unsafe_view`` returns a view without the autograd view relation).
_UNMARKED_VIEWS = {aten._unsafe_view.default}


def is_free(node: torch.fx.Node) -> bool:
    """Nodes that launch no kernel: graph plumbing, views, ``getitem``, ``wait_tensor``, bare allocations, and
    the host arithmetic of symbolic sizes (``sym_size``, ``s0 * 2``)."""
    if node.op != "call_function":
        return True
    if isinstance(node.meta.get("val"), (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return True
    if node.target is operator.getitem or nodes.is_wait(node) or node.target in _ALLOCATIONS | _UNMARKED_VIEWS:
        return True
    return isinstance(node.target, torch._ops.OpOverload) and node.target.is_view


# Copies between device and host memory (option ``offload``): they run on the host link, not on the compute units.
HOST_COPIES = ("npu_compile::offload", "npu_compile::prefetch")


def is_host_copy(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload) \
        and node.target._schema.name in HOST_COPIES


def host_copy_us(node: torch.fx.Node, profile: DeviceProfile | None = None) -> float:
    """Time of a host copy on the link: its bytes over ``host_link_bytes_per_s``."""
    return nodes.nbytes(node.meta.get("val")) / load(profile).host_link_bytes_per_s * 1e6


def _dtype(node: torch.fx.Node) -> torch.dtype:
    outs = nodes.tensors(node.meta.get("val"))
    if outs:
        return outs[0].dtype
    ins = [t for a in node.all_input_nodes for t in nodes.tensors(a.meta.get("val"))]
    return ins[0].dtype if ins else torch.float32


def compute_us(node: torch.fx.Node, profile: DeviceProfile, per_region: dict[int, float] | None = None) -> float:
    """Roofline time of a compute node: max(FLOPs / rate, bytes / HBM bandwidth); an MC2 node's fused time.
    ``per_region`` as for :func:`flops`: each region's time computed once in a pass, not once per call."""
    if is_free(node) or nodes.is_collective(node) or is_host_copy(node):  # host copies: the link's time
        return 0.0
    sub = regions.subgraph(node)
    if sub is not None:  # its nodes one after another (a collective inside, too: the call holds the stream)
        return _region_total(sub, per_region, lambda n: node_us(n, profile, per_region))
    if nodes.fused_collective(node) is not None:
        return mc2_cost(node, profile).fused_us
    dtype = _dtype(node)
    memory_s = bytes_moved(node) / profile.hbm_bytes_per_s
    matrix = flops(node)
    if matrix:
        return max(matrix / profile.matrix_rate(dtype), memory_s) * 1e6
    elements = sum(_hint(t.numel()) for t in nodes.tensors(node.meta.get("val")))
    return max(elements / profile.vector_rate(dtype), memory_s) * 1e6


def _roofline_us(matrix_flops: int, nbytes: int, dtype: torch.dtype, profile: DeviceProfile) -> float:
    return max(matrix_flops / profile.matrix_rate(dtype), nbytes / profile.hbm_bytes_per_s) * 1e6


@dataclasses.dataclass(frozen=True)
class MC2Cost:
    """An MC2 node's parts, in µs."""

    matmul_us: float  # roofline of the whole matmul the op does
    comm_us: float  # the collective it carries, as the plain collective would cost (:func:`collective_us`)
    fused_us: float  # the op's time on the compute stream: its chunks of comm pipelined with its chunks of matmul
    chunks: int  # T, the pipeline's depth
    kind: str  # all_gather | reduce_scatter | all_reduce
    ranks: int
    chunk_comm_us: float  # c₁, one chunk's collective

    @property
    def comm_bound(self) -> bool:
        """A chunk's collective outlasts its matmul: comm shows through every stage, not just the fill."""
        return self.chunk_comm_us > self.matmul_us / self.chunks


def _bound(node: torch.fx.Node) -> dict:
    """The node's arguments by schema name (defaults left out)."""
    names = [a.name for a in node.target._schema.arguments]
    return dict(zip(names, node.args)) | dict(node.kwargs)


def mc2_cost(node: torch.fx.Node, profile: DeviceProfile | None = None) -> MC2Cost:
    """The parts of a matmul fused with a collective (:func:`nodes.fused_collective`: an MC2 op). An *estimate*:
    torch_npu documents no timing model.

    matmul m: the roofline of the whole matmul — for all-gather-mm the gathered one, x1's rows × world size;
    for mm-reduce-scatter the full product before the scatter; for mm-all-reduce x1 (2-D or 3-D) @ x2 [+ bias].
    comm c: :func:`collective_us` of the collective it carries — all-gather of the gathered x1, reduce-scatter /
    all-reduce of the matmul's output — over the ranks its emitter declared (the collective's group size; the
    profile's ``ranks_per_node`` where it could not say).

    The op splits its work into T chunks (``profile.mc2_chunks``, 0 = one per rank; see the profile), and runs
    chunk i's matmul beside chunk i+1's communication (all-gather: receive, then multiply; reduce-scatter /
    all-reduce: multiply, then send). With c₁ the time of one chunk's collective — :func:`collective_us` of S/T
    bytes, so each chunk pays the link latency again — and m₁ = m / T:

        fused = c₁ + m₁ + (T − 1) · max(c₁, m₁)

    The pipeline's fill (the first chunk's comm, or the last chunk's for a scatter) is never hidden, and comm
    longer than compute shows through every stage: fused − m is the op's exposed communication. T = 1 gives
    c + m (nothing hidden). Left out, both ways: the local shard of an all-gather needs no transfer (the op could
    start on it at once), a full mesh moves all peers' blocks at the same time rather than one after another, and
    the kernel may tile finer than per rank; the matmul chunks are taken as m / T (x2 is read once per chunk on
    the device, which this ignores).
    """
    profile = load(profile)
    fc = nodes.fused_collective(node)
    call = _bound(node)
    x1_node = call[fc.x1]
    x1, x2 = _shape(x1_node), _shape(call[fc.x2])
    dtype = x1_node.meta["val"].dtype
    size = torch.empty((), dtype=dtype).element_size()
    kind, ranks = fc.kind, fc.ranks or profile.ranks_per_node
    k, n = x2[0], x2[1]
    if kind == "all_reduce":
        rows = math.prod(x1[:-1])
        bias = call.get(fc.bias) if fc.bias else None
        extra = nodes.nbytes(bias.meta.get("val")) if isinstance(bias, torch.fx.Node) else 0
    else:
        rows = x1[0] * ranks if kind == "all_gather" else x1[0]
        extra = 0
    matrix = 2 * rows * k * n
    # bytes over HBM: x1 (for the all-gather: as gathered), x2, the product, a bias
    matmul = _roofline_us(matrix, (rows * k + k * n + rows * n) * size + extra, dtype, profile)
    comm_bytes = rows * (k if kind == "all_gather" else n) * size
    comm = collective_us(kind, comm_bytes, ranks, profile)
    chunks = max(1, profile.mc2_chunks or ranks)
    c1, m1 = collective_us(kind, comm_bytes / chunks, ranks, profile), matmul / chunks
    fused = c1 + m1 + (chunks - 1) * max(c1, m1)
    return MC2Cost(matmul, comm, fused, chunks, kind, ranks, c1)


def comm_us(node: torch.fx.Node, profile: DeviceProfile, nbytes: int | None = None) -> float:
    """Time of a collective node (``nbytes`` overrides its size, as Inductor's estimator interface asks)."""
    ranks = nodes.group_size(node) or profile.ranks_per_node
    size = nodes.comm_bytes(node) if nbytes is None else nbytes
    return collective_us(nodes.kind(node), size, ranks, profile)


def node_us(node: torch.fx.Node, profile: DeviceProfile | None = None,
            per_region: dict[int, float] | None = None) -> float:
    """Cost of any node: its collective time for collectives, its compute time otherwise (for an MC2 node its
    fused time, the time it holds the compute stream). ``per_region`` as for :func:`compute_us`."""
    profile = load(profile)
    return comm_us(node, profile) if nodes.is_collective(node) else compute_us(node, profile, per_region)


def costs(graph: torch.fx.Graph, profile: DeviceProfile | None = None) -> dict[torch.fx.Node, float]:
    profile = load(profile)
    per_region: dict[int, float] = {}
    return {n: node_us(n, profile, per_region) for n in graph.nodes}

