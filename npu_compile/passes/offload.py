"""Host offload of saved activations (option ``offload``): a third choice of the memory plan, beside saving an
activation on the device and recomputing it.

MindSpeed's ``--swap-attention`` copies the activations saved by chosen modules (``--swap-modules``) to pinned host
memory after their forward and prefetches them back before their backward, on a side stream, overlapping with
compute (docs/offload.md). Here the same trade is made on the partitioned graphs, after the min-cut has chosen
what is saved:

- **which**: a saved activation (a forward output the backward reads) computed inside a module named in
  ``offload`` (its node's ``nn_module_stack``; a node a fusion rule made has no stack of its own and belongs to
  the modules all its tensor inputs were computed in; a graph input belongs to none). Only tensors that own their
  storage outright are taken: dense, not a view of a larger buffer, sharing storage with no other output or input
  of the forward — otherwise the device buffer would stay (a parameter's view, an output the caller keeps) and the
  copy would only cost.
- **forward**: ``npu_compile.offload(x)`` (device → host) right after ``x`` is made; the forward returns the host
  copy in ``x``'s place among the saved values, so ``x``'s device buffer dies at its last forward use.
- **backward**: ``npu_compile.prefetch(host, device)`` (host → device) replaces every read of the saved value,
  issued ahead of its first use by as much compute as its copy takes on the host link (the cost model's
  ``host_link_bytes_per_s``): early enough to hide the copy, no earlier, since a prefetched buffer holds device
  memory from its issue on (:func:`place_prefetches`, run again after memory ordering).
- **accounting**: host values take no device memory (``memory.in_host_memory``), so the planner's live bytes,
  saved bytes and ``memory_budget="auto"`` fit all see the offloaded bytes leave the device peak and the
  prefetched ones come back at their issue step; :class:`Offload` gives report.json's figures.
"""

from __future__ import annotations

import copy
import dataclasses
import re

import torch
from torch._prims_common import is_non_overlapping_and_dense_or_false
from torch.fx import GraphModule, Node

from npu_compile.device import cost
from npu_compile.device.profile import DeviceProfile, load
from npu_compile.passes.memory import is_saved_activation, nothing_dies_inside, realias_views, training_liveness
from npu_compile.passes.reorder import reorder_for_peak

_ops = torch.ops.npu_compile
aten = torch.ops.aten


@dataclasses.dataclass
class Offload:
    """What option ``offload`` did to one partition (report.json ``memory.offload``)."""

    modules: tuple[str, ...]
    tensors: list[dict]  # per offloaded value: name, module, shape, dtype, bytes
    bytes: int  # device bytes the saved values no longer hold between forward and backward
    d2h_us: float  # the copies' time on the host link, each way (cost model)
    h2d_us: float
    exposed_d2h_us: float  # copy time no compute hides: the forward's end waiting for its last copies
    exposed_h2d_us: float  # the backward waiting for prefetches
    # planned live-bytes peak of forward + backward, each in the order the aten stages give it (memory ordering, then
    # the prefetches issued early): without the offload, and with it
    peak_bytes_without: int
    peak_bytes_with: int

    def to_json(self) -> dict:
        return dataclasses.asdict(self) | {"modules": list(self.modules)}


def _tensors(val: object) -> list[torch.Tensor]:
    if isinstance(val, torch.Tensor):
        return [val]
    return [v for v in val if isinstance(v, torch.Tensor)] if isinstance(val, (tuple, list)) else []


def _names(path: str) -> set[str]:
    return set(re.findall(r"[A-Za-z_]\w*", path))


def module_names(node: Node, memo: dict[Node, frozenset[str]]) -> frozenset[str]:
    """The attribute names on the module path ``node`` was computed in (see the module doc)."""
    if node in memo:
        return memo[node]
    stack = node.meta.get("nn_module_stack")
    if stack:
        names = frozenset(_names(list(stack.values())[-1][0]))
    elif node.op != "call_function":
        names = frozenset()
    else:
        # its activations' inputs (a seed or a mask says nothing of where it runs; a fused op's tuple does)
        tensors = [a for a in node.all_input_nodes
                   if any(t.is_floating_point() for t in _tensors(a.meta.get("val")))]
        sets = [module_names(a, memo) for a in tensors]
        names = frozenset.intersection(*sets) if sets else frozenset()
    memo[node] = names
    return names


def _storage(val: torch.Tensor):
    return val.untyped_storage()._cdata


def _why_not(base: Node) -> str | None:
    """Why the buffer ``base`` allocates cannot go to host memory as it is, or None."""
    val = base.meta.get("val")
    if not isinstance(val, torch.Tensor) or not val.is_floating_point() or val.numel() == 0:
        return "not a floating-point tensor"
    if not is_non_overlapping_and_dense_or_false(val):
        return "not dense"
    if val.untyped_storage().nbytes() != val.numel() * val.element_size():
        return "not the whole of its buffer"
    return None


HOST_META = "npu_compile_host"  # on a backward input that holds a host copy (memory.in_host_memory)


def offload_saved(fw: GraphModule, bw: GraphModule, modules: tuple[str, ...],
                  profile: DeviceProfile | None = None) -> Offload:
    """Rewrite the partition ``fw`` / ``bw`` so that the saved values computed in ``modules`` go to host memory
    between them (module doc); returns the figures. A no-op (zero figures) when nothing matches.

    The unit is a device buffer: the saved values that are views of one buffer (attention's q, k, v as views of
    the qkv projection's output) are offloaded as that one buffer, copied once each way, and the backward makes
    each view again over the prefetched copy (``as_strided``, the view's own sizes, strides and offset)."""
    profile = load(profile)
    realias_views(fw.graph)
    before = planned_peak(fw, bw, profile)
    (output,) = fw.graph.find_nodes(op="output")
    outs = list(output.args[0])
    by_name = {n.name: n for n in fw.graph.nodes}
    memo: dict[Node, frozenset[str]] = {}
    wanted = set(modules)
    # the saved values by the buffer they live in: (forward node, its index among the outputs, backward input)
    by_buffer: dict[int, list[tuple[Node, int, Node]]] = {}
    for p in bw.graph.find_nodes(op="placeholder"):
        x = by_name.get(p.name)
        if not is_saved_activation(p) or not p.users or x is None or x not in outs \
                or not isinstance(x.meta.get("val"), torch.Tensor):
            continue
        index = len(outs) - 1 - outs[::-1].index(x)  # the saved value: after any user output of the same node
        by_buffer.setdefault(_storage(x.meta["val"]), []).append((x, index, p))
    saved_at = {i for group in by_buffer.values() for _, i, _ in group}
    held = {}  # buffer -> what else holds it through the step: a forward input, an output the caller keeps
    for n in fw.graph.find_nodes(op="placeholder"):
        if isinstance(n.meta.get("val"), torch.Tensor):
            held[_storage(n.meta["val"])] = n
    for i, o in enumerate(outs):
        if i not in saved_at and isinstance(o, Node) and isinstance(o.meta.get("val"), torch.Tensor):
            held[_storage(o.meta["val"])] = o
    allocated = {}  # buffer -> the forward node that allocates it (the first whose value lives in it)
    for n in fw.graph.nodes:
        if n.op == "call_function" and isinstance(n.meta.get("val"), torch.Tensor):
            allocated.setdefault(_storage(n.meta["val"]), n)
    tensors, total, d2h, h2d = [], 0, 0.0, 0.0
    for key, group in by_buffer.items():
        names = [sorted(module_names(x, memo) & wanted) for x, _, _ in group]
        base = allocated.get(key)
        if not all(names) or key in held or base is None or _why_not(base) is not None:
            continue
        val = base.meta["val"]
        with fw.graph.inserting_after(base):
            host = fw.graph.call_function(_ops.offload.default, (base,))
        host.name = f"offload_{base.name}"
        host.meta["val"] = _fake(_ops.offload.default, val)
        for _, index, _ in group:
            outs[index] = host
        first = group[0][2]
        with bw.graph.inserting_after(first):
            back = bw.graph.call_function(_ops.prefetch.default, (first, val.device))
        back.name = f"prefetch_{base.name}"
        back.meta["val"] = _fake(_ops.prefetch.default, host.meta["val"], val.device)
        for x, _, p in group:
            v = x.meta["val"]
            same = tuple(v.shape) == tuple(val.shape) and v.stride() == val.stride() \
                and v.storage_offset() == val.storage_offset()
            if same:
                again = back
            else:
                with bw.graph.inserting_after(back):
                    again = bw.graph.call_function(
                        aten.as_strided.default, (back, list(v.shape), list(v.stride()), v.storage_offset()))
                again.meta["val"] = _fake(aten.as_strided.default, back.meta["val"], list(v.shape),
                                          list(v.stride()), v.storage_offset())
            p.replace_all_uses_with(again, delete_user_cb=lambda u: u is not back)
            p.meta["val"] = host.meta["val"]
            p.meta[HOST_META] = True
        nbytes = val.numel() * val.element_size()
        tensors.append({"name": base.name, "module": names[0][0], "shape": list(val.shape),
                        "dtype": str(val.dtype).removeprefix("torch."), "bytes": nbytes,
                        "saved_values": [x.name for x, _, _ in group]})
        total += nbytes
        d2h += cost.host_copy_us(host, profile)
        h2d += cost.host_copy_us(back, profile)
    if not tensors:
        return Offload(tuple(modules), [], 0, 0.0, 0.0, 0.0, 0.0, before, before)
    output.args = (tuple(outs),)
    for gm in (fw, bw):
        gm.graph.lint()
        gm.recompile()
    place_prefetches(bw, profile)
    after = planned_peak(fw, bw, profile)
    return Offload(tuple(modules), tensors, total, round(d2h, 3), round(h2d, 3), exposed_d2h_us(fw, profile),
                   exposed_h2d_us(bw, profile), before, after)


def planned_peak(fw: GraphModule, bw: GraphModule, profile: DeviceProfile | None = None) -> int:
    """The live-bytes peak of forward + backward in the order the aten stages will give them (memory ordering, then
    the prefetches issued early), found on copies: the graphs themselves keep their order."""
    fw2, bw2 = (GraphModule(gm, copy.deepcopy(gm.graph)) for gm in (fw, bw))
    reorder_for_peak(fw2, nothing_dies_inside)
    reorder_for_peak(bw2, is_saved_activation)
    place_prefetches(bw2, profile)
    return training_liveness(fw2.graph, bw2.graph).peak


def _fake(op, *args):
    with next(a for a in args if isinstance(a, torch.Tensor)).fake_mode:
        return op(*args)


def _is(node: Node, name: str) -> bool:
    return cost.is_host_copy(node) and node.target._schema.name == f"npu_compile::{name}"


def _steps(graph: torch.fx.Graph) -> list[Node]:
    return [n for n in graph.nodes if n.op not in ("placeholder", "get_attr", "output")]


def place_prefetches(gm: GraphModule, profile: DeviceProfile | None = None) -> int:
    """Move each prefetch of ``gm`` (a backward) to where the compute before its first use covers its copy on the
    host link, walking back from that use; at the graph's start when there is not that much compute before it.
    Returns how many prefetches the graph holds."""
    profile = load(profile)
    prefetches = [n for n in _steps(gm.graph) if _is(n, "prefetch")]
    if not prefetches:
        return 0
    first_output = next(iter(gm.graph.find_nodes(op="output")))
    for p in prefetches:
        views = [u for u in p.users if u.target is aten.as_strided.default]
        order = [n for n in _steps(gm.graph) if n is not p and n not in views]
        readers = [r for u in p.users for r in (u.users if u in views else (u,))]
        at = min(order.index(r) if r is not first_output else len(order) for r in readers)
        need, covered = cost.host_copy_us(p, profile), 0.0
        while at > 0 and covered < need:
            if _is(order[at - 1], "prefetch"):
                break  # keep the prefetches in the order of their first uses (the link is one queue)
            at -= 1
            covered += cost.node_us(order[at], profile)
        anchor = order[at] if at < len(order) else first_output
        for n in (p, *views):
            anchor.prepend(n)
    gm.graph.lint()
    gm.recompile()
    return len(prefetches)


def exposed_h2d_us(gm: GraphModule, profile: DeviceProfile | None = None) -> float:
    """The time ``gm``'s compute waits for prefetches, in its current order: copies run one after another on the
    host link, each from its issue (or the previous copy's end), beside the compute stream."""
    profile = load(profile)
    now = link = waited = 0.0
    done: dict[Node, float] = {}
    for n in _steps(gm.graph):
        if _is(n, "prefetch"):
            link = max(now, link) + cost.host_copy_us(n, profile)
            done[n] = link
            continue
        if n.target is aten.as_strided.default and n.args[0] in done:  # a view of a prefetch: ready with it
            done[n] = done[n.args[0]]
            continue
        ready = max((done[a] for a in n.all_input_nodes if a in done), default=0.0)
        if ready > now:
            waited += ready - now
            now = ready
        now += cost.node_us(n, profile)
    return round(waited, 3)


def exposed_d2h_us(gm: GraphModule, profile: DeviceProfile | None = None) -> float:
    """The copy time to host ``gm``'s compute does not hide: copies run one after another on the link from their
    issue; what is still copying when the forward's compute ends."""
    profile = load(profile)
    now = link = 0.0
    for n in _steps(gm.graph):
        if _is(n, "offload"):
            link = max(now, link) + cost.host_copy_us(n, profile)
        else:
            now += cost.node_us(n, profile)
    return round(max(link - now, 0.0), 3)


