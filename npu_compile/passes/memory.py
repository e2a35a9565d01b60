"""Memory analysis: the buffers of a graph's schedule and their live bytes, from FakeTensor metadata.

A view shares its base's storage, so a buffer is one storage, live from the node that first produces it to the
last node that touches any alias of it (torch's ``GraphAliasTracker`` gives both). Graph inputs are buffers only
when the caller says they die inside the graph: the saved activations of a backward graph do (the executor frees
its arguments as it goes); parameters, user inputs and incoming gradients do not. Graph outputs stay live to
the end. Over forward then backward, each saved activation is one buffer from its forward allocation to its last
backward use.

The live-bytes peak is the lower bound of any allocator for that order; ``arena`` plans offsets in one arena
and its size beside that bound is the fragmentation.
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
import operator
import weakref
from collections.abc import Callable

import torch
from torch._inductor.fx_passes.memory_estimator import GraphAliasTracker
from torch._library import custom_ops
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily
from torch.fx.experimental.symbolic_shapes import optimization_hint
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils import _pytree as pytree
from torch.utils._ordered_set import OrderedSet
from torch.utils._python_dispatch import TorchDispatchMode

from npu_compile import regions

log = logging.getLogger("npu_compile")


@dataclasses.dataclass(frozen=True)
class Buffer:
    """One storage over a schedule: allocated at step ``start``, released after step ``end`` (inclusive)."""

    name: str  # the node that allocates it (the input's name for inputs)
    op: str
    shape: tuple[int, ...]
    dtype: str
    bytes: int
    start: int
    end: int


@dataclasses.dataclass
class Liveness:
    curve: list[int]  # live bytes at each step of the schedule (after the step's allocations, before its frees)
    peak: int
    peak_step: int
    at_peak: list[Buffer]  # the buffers live at the peak, largest first


def _first_tensor(val: object) -> torch.Tensor | None:
    if isinstance(val, torch.Tensor):
        return val
    if isinstance(val, (tuple, list)):
        return next((v for v in val if isinstance(v, torch.Tensor)), None)
    return None


def op_name(node: torch.fx.Node) -> str:
    """What a node runs, as report.json and memory.png name it, the same in every process: an op by its name, a
    region call by its region, a Python function by its module and name (never its address)."""
    sub = regions.subgraph(node)
    if sub is not None:
        return f"region {regions.name(str(node.args[0].target))}"
    target = node.target
    if isinstance(target, (str, torch._ops.OpOverload, torch._ops.OpOverloadPacket, torch._ops.HigherOrderOperator)):
        return str(target)
    return f"{getattr(target, '__module__', '')}.{getattr(target, '__qualname__', type(target).__qualname__)}"


def _buffer(node: torch.fx.Node, storage: torch.UntypedStorage, start: int, end: int) -> Buffer:
    val = _first_tensor(node.meta.get("val"))
    shape = tuple(optimization_hint(s, fallback=0) for s in val.shape) if val is not None else ()
    dtype = str(val.dtype).removeprefix("torch.") if val is not None else "?"
    op = "input" if node.op == "placeholder" else op_name(node)
    return Buffer(node.name, op, shape, dtype, optimization_hint(storage.nbytes(), fallback=0), start, end)


@dataclasses.dataclass
class GraphBuffers:
    steps: list[torch.fx.Node]  # the compute nodes, in schedule order
    buffers: list[Buffer]
    by_output_node: dict[str, Buffer]  # output-producing node name -> the buffer holding its value


HOST_COPIES = ("npu_compile::offload", "npu_compile::prefetch")


def _copy(node: torch.fx.Node, name: str) -> bool:
    return node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload) \
        and node.target._schema.name == name


def in_host_memory(node: torch.fx.Node) -> bool:
    """Whether ``node``'s value lives in host memory (option ``offload``): an offload's output in the forward, the
    saved input of the backward that only prefetches read, and what lowering marks so (``npu_compile_host``: the
    saved inputs passes/offload.py rewrote, the npu targets' host copies). It takes no device memory."""
    if _copy(node, "npu_compile::offload") or node.meta.get("npu_compile_host", False):
        return True
    return node.op == "placeholder" and bool(node.users) \
        and all(_copy(u, "npu_compile::prefetch") for u in node.users)


_STORAGES: "weakref.WeakKeyDictionary[torch.fx.Node, tuple[object, OrderedSet]]" = weakref.WeakKeyDictionary()
# One StorageKey per (storage, device): equal keys are then the same object, and the tracker's dict and set lookups
# stop at identity instead of calling StorageKey.__eq__ (a region call's outputs and their getitems, a view and its
# base: keys of one storage from different nodes). A key holds its storage, so its address is not reused meanwhile.
_KEYS: "weakref.WeakValueDictionary[tuple[int, torch.device], object]" = weakref.WeakValueDictionary()


class AliasTracker(GraphAliasTracker):
    """torch's ``GraphAliasTracker`` with each node's output storages memoised per value (``meta["val"]``, the same
    object). The passes build one several times over the same graph (ordering, the liveness before and after it,
    the report's), and reading the storages of every FakeTensor is most of the cost, which grows with the graph:
    torch 2.13's tracker reads them through ``self._get_output_storages(node)``, a static method
    (torch/_inductor/fx_passes/memory_estimator.py:71, 96-115), which this overrides."""

    @staticmethod
    def _get_output_storages(node: torch.fx.Node) -> OrderedSet:
        val = node.meta.get("val")
        memo = _STORAGES.get(node)
        if memo is None or memo[0] is not val:
            keys = OrderedSet(_KEYS.setdefault((k.storage._cdata, k.device), k)
                              for k in GraphAliasTracker._get_output_storages(node))
            memo = _STORAGES[node] = (val, keys)
        return OrderedSet(memo[1])


def nothing_dies_inside(node: torch.fx.Node) -> bool:
    """The ``dies_inside`` of a graph whose inputs all outlive it (a forward's, an inference graph's)."""
    return False


def _state(graph: torch.fx.Graph, dies_inside: Callable[[torch.fx.Node], bool]) -> tuple[tuple, list]:
    """What :func:`graph_buffers`' storages and lifetimes depend on: the nodes in order, each node's op, target,
    arguments, value (``meta["val"]``) and host mark, and ``dies_inside``; by identity (arguments and values are
    replaced, never changed in place, when a pass rewrites a node), with the objects held so no id is reused."""
    held: list = [dies_inside]
    key = [id(dies_inside)]
    for n in graph.nodes:
        val = n.meta.get("val")
        held += (n.args, n.kwargs, val)
        key.append((n, n.op, n.target, id(n.args), id(n.kwargs), id(val), n.meta.get("npu_compile_host", False)))
    return tuple(key), held


def graph_buffers(
    graph: torch.fx.Graph, dies_inside: Callable[[torch.fx.Node], bool] = nothing_dies_inside
) -> GraphBuffers:
    """The buffers of ``graph`` in its current order; ``dies_inside(placeholder)`` says which inputs count.

    The passes ask again of a graph nothing changed in between (the partition's report, the ordering's before and
    after, each lowered graph's report): the storages and lifetimes are kept on the graph with the state they were
    found in (:func:`_state`) and found again only when it differs. Scratch is measured at every call (a region's
    depends on its own subgraph, lowered in between)."""
    key, held = _state(graph, dies_inside)
    memo = getattr(graph, "_npu_compile_buffers", None)
    if memo is None or memo[0] != key:
        unshare_region_outputs(graph)
        realias_views(graph)
        key, held = _state(graph, dies_inside)  # as analysed: a second call on it finds nothing to remake
        memo = (key, held, _storage_buffers(graph, dies_inside))
        graph._npu_compile_buffers = memo
    steps, buffers, by_output_node = memo[2]
    buffers = list(buffers)
    region_scratch: dict[int, int] = {}  # id(region subgraph) -> its scratch: once per region, not once per call
    for step, node in enumerate(steps):
        sub = regions.subgraph(node)
        if sub is not None and id(sub) not in region_scratch:
            region_scratch[id(sub)] = _region_scratch(sub)
        if scratch := (region_scratch[id(sub)] if sub is not None else workspace_bytes(node)):
            buffers.append(Buffer(f"{node.name}:workspace", op_name(node), (), "scratch", scratch, step, step))
    return GraphBuffers(list(steps), buffers, dict(by_output_node))


def _storage_buffers(
    graph: torch.fx.Graph, dies_inside: Callable[[torch.fx.Node], bool]
) -> tuple[list[torch.fx.Node], list[Buffer], dict[str, Buffer]]:
    """The compute nodes in order, a buffer per storage (allocated where it first appears, freed after its last
    reader) and the buffer of each node the graph outputs."""
    nodes = list(graph.nodes)
    alias = AliasTracker(nodes)
    steps = [n for n in nodes if n.op not in ("placeholder", "get_attr", "output")]
    index = {n: i for i, n in enumerate(steps)}
    last = len(steps) - 1
    (output,) = graph.find_nodes(op="output")
    outputs = alias.get_storage_uses(output)
    started: dict = {}  # storage key -> (allocating node, start step)
    for node in nodes:
        if in_host_memory(node):
            continue
        if node.op == "placeholder" and dies_inside(node):
            for key in alias.get_fresh_allocations(node):
                started[key] = (node, 0)
        elif node in index:
            for key in alias.get_fresh_allocations(node):
                started.setdefault(key, (node, index[node]))
    buffers, by_key = [], {}
    for key, (node, start) in started.items():
        if key in outputs:
            end = last
        else:
            user = alias.storage_to_last_user.get(key)
            end = index.get(user, start)
        by_key[key] = _buffer(node, key.storage, start, max(end, start))
        buffers.append(by_key[key])
    by_output_node = {
        n.name: by_key[k] for n in output.all_input_nodes for k in alias.node_to_output_storages.get(n, ()) if k in by_key
    }
    return steps, buffers, by_output_node


class _LiveStorages(TorchDispatchMode):
    """Live bytes of the storages the ops under it create, and their peak (a storage dies with its last
    tensor, as CPython frees a kernel's temporaries)."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.current = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        opdef = custom_ops._maybe_get_opdef(func._schema.name) if func.namespace == "npu_compile" else None
        if opdef is not None:  # one of our ops called by another's kernel: its kernel's storages count too
            with self:
                out = opdef._init_fn(*args, **(kwargs or {}))
        else:
            out = func(*args, **(kwargs or {}))
        for key, (ref, nbytes) in list(self.live.items()):
            if ref.expired():
                self.current -= nbytes
                del self.live[key]
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                ref = StorageWeakRef(t.untyped_storage())
                if ref.cdata not in self.live and not any(ref.cdata == StorageWeakRef(a.untyped_storage()).cdata
                                                           for a in pytree.tree_leaves((args, kwargs))
                                                           if isinstance(a, torch.Tensor)):
                    nbytes = t.untyped_storage().nbytes()
                    self.live[ref.cdata] = (ref, nbytes)
                    self.current += nbytes
                    self.peak = max(self.peak, self.current)
        return out


def _fake_like(val: object, mode: FakeTensorMode) -> object:
    if not isinstance(val, torch.Tensor):
        return val
    shape = [optimization_hint(s, fallback=1) for s in val.shape]
    if val.dim() == 0 and not val.is_floating_point():
        return torch.zeros((), dtype=val.dtype)  # a seed: real, so that the kernel can read it
    stride = [optimization_hint(s, fallback=1) for s in val.stride()]
    with mode:
        return torch.empty_strided(shape, stride, dtype=val.dtype, device="cpu")


_SCRATCH: dict[tuple[str, str], int] = {}  # (op, signature) -> scratch bytes


# Ops whose kernel reads an input's values to size its work, which FakeTensors do not have: the estimate runs them on
# real values that give the most scratch for the node's shapes. Varlen attention loops over the documents of
# cu_seqlens (npu_compile/ops/varlen_attention.py), each document's attention the scratch of its length: one document
# a row, the longest a batch of that shape can hold, is what the plan takes (the graph cannot know the documents).
def _one_document_a_row(query: torch.Tensor, cu: torch.Tensor, layout: str) -> torch.Tensor:
    s, b = query.shape[:2] if layout == "sbnd" else reversed(query.shape[:2])
    ends = [r * s for r in range(1, b + 1)]
    with unset_fake_temporarily():  # real values, also while a compile's FakeTensorMode is active
        return torch.tensor(ends + [b * s] * max(cu.shape[0] - b, 0), dtype=torch.int64)


_DATA_STAND_INS = {  # op -> (cu_seqlens' index, query's index)
    "npu_compile::varlen_attention": (3, 0),  # query, key, value, cu_seqlens
    "npu_compile::varlen_attention_backward": (7, 1),  # grad_out, query, key, value, out, max, sum, cu_seqlens
}


def _scratch(qualname: str, args: tuple, kwargs: tuple) -> int:
    opdef = custom_ops._maybe_get_opdef(qualname)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fake_args = [_fake_like(a, mode) for a in args]
    if qualname in _DATA_STAND_INS:
        cu, query = _DATA_STAND_INS[qualname]
        fake_args[cu] = _one_document_a_row(fake_args[query], fake_args[cu], dict(kwargs).get("layout", "sbnd"))
    fake_kwargs = {k: _fake_like(v, mode) for k, v in kwargs}
    tracker = _LiveStorages()
    try:
        with mode, tracker:
            out = opdef._init_fn(*fake_args, **fake_kwargs)
            outputs = {StorageWeakRef(t.untyped_storage()).cdata: t.untyped_storage().nbytes()
                       for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)}
    except Exception as e:  # a kernel that needs real data: no estimate
        log.debug("no scratch estimate for %s: %s: %s", qualname, type(e).__name__, e)
        return 0
    return max(tracker.peak - sum(outputs.values()), 0)


def _meta(a: object) -> object:
    return a.meta.get("val") if isinstance(a, torch.fx.Node) else a


def workspace_bytes(node: torch.fx.Node) -> int:
    """Scratch a node's kernel allocates and frees within its own step, beyond its outputs: for our fused ops,
    found by running the op's reference kernel on FakeTensors of the node's shapes while counting the live
    bytes of the storages it creates (memoised per op and signature); for a region call, the live-bytes peak of
    the region's own schedule beyond its outputs. Aten kernels' scratch is not modelled; after lowering to
    ``npu`` the device kernels keep their tiles on chip."""
    sub = regions.subgraph(node)
    if sub is not None:
        return _region_scratch(sub)
    if node.op != "call_function" or getattr(node.target, "namespace", None) != "npu_compile":
        return 0
    args = tuple(_meta(a) for a in node.args)
    kwargs = tuple(sorted((k, _meta(v)) for k, v in node.kwargs.items()))
    if not all(isinstance(a, (torch.Tensor, int, float, bool, str, type(None), list, tuple))
               for a in (*args, *(v for _, v in kwargs))):
        return 0

    def signature(a: object) -> str:
        if isinstance(a, torch.Tensor):
            return f"T{[optimization_hint(s, fallback=1) for s in a.shape]}{a.dtype}" \
                   f"{[optimization_hint(s, fallback=1) for s in a.stride()]}"
        return repr(a)

    qualname = node.target._schema.name
    key = (qualname, "|".join(signature(a) for a in (*args, *(f"{k}={signature(v)}" for k, v in kwargs))))
    if key not in _SCRATCH:
        _SCRATCH[key] = _scratch(qualname, args, kwargs)
    return _SCRATCH[key]


_REGION_SCRATCH: "weakref.WeakKeyDictionary[torch.fx.GraphModule, tuple[tuple, int]]" = weakref.WeakKeyDictionary()


def _region_scratch(sub: torch.fx.GraphModule) -> int:
    """What one call of a region holds at its peak besides what it returns; its inputs stay with the caller
    (the calling graph holds them until the call returns). Memoised per region and its current schedule."""
    order = tuple(n.name for n in sub.graph.nodes)
    memo = _REGION_SCRATCH.get(sub)
    if memo is not None and memo[0] == order:
        return memo[1]
    gb = graph_buffers(sub.graph)
    outputs = {id(b): b.bytes for b in gb.by_output_node.values()}
    scratch = max(liveness(gb.buffers, len(gb.steps)).peak - sum(outputs.values()), 0)
    _REGION_SCRATCH[sub] = (order, scratch)
    return scratch


# Ops whose output shares its first argument's storage (``_unsafe_view`` is a view without autograd's tracking).
_ALIAS_OPS = (torch.ops.aten._unsafe_view.default,)


def _storage(val: object):
    return val.untyped_storage()._cdata if isinstance(val, torch.Tensor) else None


def _returned_inputs(sub: torch.fx.GraphModule) -> set[int]:
    """The outputs of a region's subgraph that are one of its inputs or a view of one (by position)."""
    nodes = list(sub.graph.nodes)
    alias = AliasTracker(nodes)
    inputs = {k for n in nodes if n.op == "placeholder" for k in alias.get_fresh_allocations(n)}
    (output,) = sub.graph.find_nodes(op="output")
    outs = output.args[0] if isinstance(output.args[0], (tuple, list)) else (output.args[0],)
    return {i for i, o in enumerate(outs)
            if isinstance(o, torch.fx.Node) and alias.node_to_output_storages.get(o, OrderedSet()) & inputs}


def unshare_region_outputs(graph: torch.fx.Graph) -> int:
    """Give every region call's fresh outputs values of their own; returns how many were remade.

    In the graphs aot_autograd partitions, every call of one region carries the same output FakeTensors in
    ``meta["val"]``: the partitioned subgraph's own output values, one subgraph for all the calls (torch 2.13
    torch/_functorch/_aot_autograd/graph_compile.py:1090-1109 ``propagate_meta_info``, and 1176-1181 for the saved
    tensors' ``getitem`` nodes), so by storage the later calls' outputs read as
    aliases of the first call's: their bytes (a layer's saved activations) never counted and the ordering saw
    them as free. Those values need not share storage where the subgraph's outputs do either (a layer's q, k and v,
    views of one projection, come as three storages each the size of its view's extent: the projection counted
    three times). So each call's outputs the subgraph makes itself (not an input returned or viewed) get values of
    their own laid out as in the subgraph: one storage, of the subgraph's storage's size, for the outputs that
    share one there, each output at its offset with its strides (:func:`_output_layout`); the ``getitem`` nodes
    reading them take those values (``realias_views`` then remakes the views of them)."""
    layouts: dict[int, dict[int, tuple]] = {}
    remade = 0
    for node in graph.nodes:
        val = node.meta.get("val")
        sub = regions.subgraph(node)
        if sub is None or not isinstance(val, (tuple, list)):
            continue
        if id(sub) not in layouts:  # once per region, not once per call
            layouts[id(sub)] = _output_layout(sub)
        new = _laid_out(val, layouts[id(sub)])
        if new:
            node.meta["val"] = type(val)(new.get(i, t) for i, t in enumerate(val))
            for user in node.users:
                if user.target is operator.getitem and user.args[1] in new:
                    user.meta["val"] = new[user.args[1]]
            remade += len(new)
    return remade


def _output_layout(sub: torch.fx.GraphModule) -> dict[int, tuple]:
    """The outputs a region's subgraph makes itself, by position: (the storage they are on, numbered, its bytes,
    the output's shape, strides and offset on it), as the subgraph's own values have them."""
    returned = _returned_inputs(sub)
    nodes = list(sub.graph.nodes)
    alias = AliasTracker(nodes)
    (output,) = sub.graph.find_nodes(op="output")
    outs = output.args[0] if isinstance(output.args[0], (tuple, list)) else (output.args[0],)
    numbered: dict = {}
    layout = {}
    for i, o in enumerate(outs):
        t = o.meta.get("val") if isinstance(o, torch.fx.Node) else None
        keys = alias.node_to_output_storages.get(o, OrderedSet()) if isinstance(o, torch.fx.Node) else ()
        if i in returned or not isinstance(t, torch.Tensor) or len(keys) != 1:
            continue
        (key,) = keys
        number = numbered.setdefault(key, len(numbered))
        layout[i] = (number, t.untyped_storage().nbytes(), t.dtype, tuple(t.shape), t.stride(), t.storage_offset())
    return layout


def _laid_out(val: tuple | list, layout: dict[int, tuple]) -> dict[int, torch.Tensor]:
    """A call's output values remade per ``layout`` (:func:`_output_layout`) on fresh storages of their own; an
    output whose value is not a FakeTensor of the subgraph's dtype and rank is left as it is (sizes are not
    compared: symbolic ones would put guards on the shape environment)."""
    storages: dict[int, object] = {}
    fresh = {}
    for i, (number, nbytes, dtype, shape, stride, offset) in layout.items():
        t = val[i] if i < len(val) else None
        if (not isinstance(t, torch.Tensor) or getattr(t, "fake_mode", None) is None or t.dtype != dtype
                or t.dim() != len(shape)):
            continue
        with t.fake_mode:
            if number not in storages:
                storages[number] = torch.empty(nbytes // t.element_size(), dtype=dtype, device=t.device
                                               ).untyped_storage()
            # on the storage, not views of a base: a graph's cached copy keeps them as they are
            fresh[i] = torch.empty((0,), dtype=dtype, device=t.device).set_(storages[number], offset, shape, stride)
    return fresh


def realias_views(graph: torch.fx.Graph) -> int:
    """Make every view node's FakeTensor share its base's storage again; returns how many were remade.

    Storage identity comes from ``meta["val"]``, and a rewrite that gives a node a new value (a fusion's
    replacement, the partitioner's placeholders for saved views) leaves the views read from it pointing at the
    old storage, so a view would count as a fresh allocation. Each such view is re-run on its base's value."""
    remade = 0
    for node in graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        if not (node.target.is_view or node.target in _ALIAS_OPS) or not node.args:
            continue
        base, val = node.args[0], node.meta.get("val")
        base_val = base.meta.get("val") if isinstance(base, torch.fx.Node) else None
        if not isinstance(base_val, torch.Tensor) or not isinstance(val, torch.Tensor):
            continue
        if _storage(base_val) == _storage(val) or getattr(base_val, "fake_mode", None) is None:
            continue
        args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda a: a.meta.get("val"))
        try:
            with base_val.fake_mode:
                new = node.target(*args, **kwargs)
        except Exception as e:  # keep the old value: the view then counts as an allocation (an over-estimate)
            log.debug("could not re-run view %s on its base: %s", node.name, e)
            continue
        if isinstance(new, torch.Tensor) and new.shape == val.shape and _storage(new) == _storage(base_val):
            node.meta["val"] = new
            remade += 1
    return remade


def liveness(buffers: list[Buffer], n_steps: int) -> Liveness:
    """Live bytes per step, the peak, and the buffers that make it."""
    delta = [0] * (n_steps + 1)
    for b in buffers:
        delta[b.start] += b.bytes
        delta[b.end + 1] -= b.bytes
    curve, current = [], 0
    for i in range(n_steps):
        current += delta[i]
        curve.append(current)
    peak = max(curve, default=0)
    step = curve.index(peak) if curve else 0
    at_peak = sorted((b for b in buffers if b.start <= step <= b.end), key=lambda b: -b.bytes)
    return Liveness(curve, peak, step, at_peak)


def graph_liveness(graph: torch.fx.Graph, dies_inside: Callable[[torch.fx.Node], bool] = nothing_dies_inside) -> Liveness:
    """Live bytes after each compute node of ``graph`` in its current order."""
    gb = graph_buffers(graph, dies_inside)
    return liveness(gb.buffers, len(gb.steps))


def is_saved_activation(placeholder: torch.fx.Node) -> bool:
    """In a partitioned backward graph: inputs that are neither parameters/user inputs nor incoming grads."""
    return not placeholder.name.startswith(("primals", "tangents"))


def _saved_bytes(bw: GraphBuffers) -> int:
    return sum(b.bytes for b in bw.buffers if b.op == "input")


def saved_activation_bytes(bw: torch.fx.Graph, fw: torch.fx.Graph | None = None) -> int:
    """Bytes of the distinct storages the forward saves for this backward; given the forward ``fw``, the
    backward reads its values and what is on the forward's inputs does not count (:func:`_saved_by`)."""
    if fw is None:
        return _saved_bytes(graph_buffers(bw, is_saved_activation))
    _saved_values_from_forward(fw, bw)
    return _saved_bytes(graph_buffers(bw, _saved_by(fw)))


def _saved_by(fw: torch.fx.Graph) -> Callable[[torch.fx.Node], bool]:
    """Which backward inputs are activations ``fw`` saved and holds: not a value on one of ``fw``'s own inputs'
    storages (a parameter a region call returns for its backward), which is the caller's memory, as the forward's
    inputs are, not the step's."""
    inputs = frozenset(_storage(n.meta.get("val")) for n in fw.find_nodes(op="placeholder")) - {None}
    memo = getattr(fw, "_npu_compile_saved_by", None)
    if memo is not None and memo[0] == inputs:
        return memo[1]  # the same function: graph_buffers' memo of the backward is keyed by it

    def saved(n: torch.fx.Node) -> bool:
        return is_saved_activation(n) and _storage(n.meta.get("val")) not in inputs

    fw._npu_compile_saved_by = (inputs, saved)
    return saved


def _saved_values_from_forward(fw: torch.fx.Graph, bw: torch.fx.Graph) -> int:
    """Give the backward's saved-activation inputs the forward's values of the same nodes; returns how many changed.

    The partitioner names a saved input after the forward node it holds and copies that node's ``meta["val"]``
    before the forward is analysed, so behind region calls every call's saved tensors are the first call's
    FakeTensors (see :func:`unshare_region_outputs`) and by storage the backward reads one layer's activations at
    any depth. Once the forward's analysis gave each call's outputs values of their own, the backward takes them."""
    by_name = {n.name: n for n in fw.nodes}
    changed = 0
    for node in bw.find_nodes(op="placeholder"):
        source = by_name.get(node.name)
        new, old = (source.meta.get("val") if source is not None else None), node.meta.get("val")
        if (is_saved_activation(node) and isinstance(new, torch.Tensor) and isinstance(old, torch.Tensor)
                and new is not old and getattr(new, "fake_mode", None) is getattr(old, "fake_mode", False)
                and (new.shape, new.stride(), new.dtype) == (old.shape, old.stride(), old.dtype)):
            node.meta["val"] = new
            changed += 1
    return changed


@dataclasses.dataclass
class TrainingMemory:
    buffers: list[Buffer]  # over the forward then the backward schedule
    steps: int
    saved_bytes: int  # :func:`saved_activation_bytes` of the backward, from the same analysis


def training_memory(fw: torch.fx.Graph, bw: torch.fx.Graph) -> TrainingMemory:
    """:func:`training_buffers` and the saved activations' bytes, each graph analysed once."""
    f = graph_buffers(fw)
    _saved_values_from_forward(fw, bw)
    b = graph_buffers(bw, _saved_by(fw))
    n_f = len(f.steps)
    saved_end: dict[str, int] = {}  # forward buffer name -> last backward step that reads it
    bw_buffers = []
    for buf in b.buffers:
        fw_buf = f.by_output_node.get(buf.name) if buf.op == "input" else None
        if fw_buf is not None:
            saved_end[fw_buf.name] = max(saved_end.get(fw_buf.name, 0), n_f + buf.end)
        else:
            bw_buffers.append(dataclasses.replace(buf, start=n_f + buf.start, end=n_f + buf.end))
    fw_buffers = [dataclasses.replace(x, end=saved_end[x.name]) if x.name in saved_end else x for x in f.buffers]
    return TrainingMemory(fw_buffers + bw_buffers, n_f + len(b.steps), _saved_bytes(b))


def training_buffers(fw: torch.fx.Graph, bw: torch.fx.Graph) -> tuple[list[Buffer], int]:
    """Buffers over the forward then the backward schedule, one per saved activation across the boundary."""
    t = training_memory(fw, bw)
    return t.buffers, t.steps


def training_liveness(fw: torch.fx.Graph, bw: torch.fx.Graph) -> Liveness:
    """Live bytes over the forward then the backward schedule, saved activations live across the boundary."""
    return liveness(*training_buffers(fw, bw))


def arena(buffers: list[Buffer]) -> tuple[dict[int, int], int]:
    """Offsets of every buffer in one arena (greedy by size, best fit in time); returns (offsets, arena bytes).

    Buffers are placed largest first; each takes the lowest gap, among the buffers already placed that overlap it
    in time, where it fits. The result is never below the live-bytes peak; the gap to it is fragmentation.
    The placed buffers are kept sorted by offset, so that each placement is one pass over them (no sort per
    buffer): quadratic in buffers, with a small constant.
    """
    order = sorted(range(len(buffers)), key=lambda i: (-buffers[i].bytes, buffers[i].start))
    placed: list[tuple[int, int, int, int]] = []  # (offset, end offset, start step, end step), sorted
    offsets: dict[int, int] = {}
    size = 0
    for i in order:
        b = buffers[i]
        start, end, need = b.start, b.end, b.bytes
        best, best_gap, cursor = None, None, 0
        for lo, hi, first, last in placed:
            if first <= end and start <= last:  # overlaps in time: its bytes are taken
                gap = lo - cursor
                if gap >= need and (best_gap is None or gap < best_gap):
                    best, best_gap = cursor, gap
                if hi > cursor:
                    cursor = hi
        offsets[i] = best if best is not None else cursor
        bisect.insort(placed, (offsets[i], offsets[i] + need, start, end))
        size = max(size, offsets[i] + need)
    return offsets, size
