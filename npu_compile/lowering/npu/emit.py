"""How a fused op becomes device calls: the node read by schema (:class:`Call`), the one emitter every rewrite of
the npu targets inserts nodes with (:class:`Emitter`), one table row (:class:`Mapping`), and the loop that applies a
table to a graph (:func:`lower_fused_ops`).

The emitter gives each new node its FakeTensor value (computed by the op's fake kernel: torch_npu's on the NPU,
npu-sim's emulation elsewhere; where an input has none, neither has the new node) and turns symbolic sizes into
graph nodes, so a rewrite written against static shapes works on a dynamic graph.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable, Mapping as MappingType, Sequence
from typing import Any

import torch
from torch.fx import GraphModule, Node
from torch.fx.node import map_arg

import npu_compile.ops  # noqa: F401  (registers torch.ops.npu_compile, the ops lowered from)
from npu_compile.config import Options
from npu_compile.sizes import SizeNodes, hint

aten = torch.ops.aten
fused = torch.ops.npu_compile

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def npu_op(name: str) -> torch._ops.OpOverload:
    """``torch.ops.npu.<name>.default``: torch_npu's op on the NPU, npu-sim's emulation elsewhere."""
    return getattr(torch.ops.npu, name).default


class Call:
    """A fused-op node's arguments by schema name (defaults filled in) and their FakeTensor values."""

    def __init__(self, node: Node):
        self.node = node
        self.args: dict[str, Any] = {}
        for i, arg in enumerate(node.target._schema.arguments):
            if not arg.kwarg_only and i < len(node.args):
                self.args[arg.name] = node.args[i]
            elif arg.name in node.kwargs:
                self.args[arg.name] = node.kwargs[arg.name]
            else:
                self.args[arg.name] = arg.default_value if arg.has_default_value() else None

    def __getitem__(self, name: str) -> Any:
        return self.args[name]

    def val(self, name: str) -> Any:
        """The argument's FakeTensor (tensor arguments) or its value."""
        arg = self.args[name]
        return arg.meta.get("val") if isinstance(arg, Node) else arg

    def missing_metadata(self) -> bool:
        return any(isinstance(a, Node) and not isinstance(a.meta.get("val"), (torch.Tensor, torch.SymInt))
                   for a in self.args.values())  # a size argument's node holds a SymInt


class Emitter:
    """Inserts the replacement of one node in front of it, giving each new node its FakeTensor value.

    Sizes may be SymInts (a graph with dynamic shapes): each one in the arguments becomes a node computing it
    from the graph's inputs (``sizes``, shared by the graph's emitters), so emitters write sizes as they read
    them off FakeTensors."""

    def __init__(self, gm: GraphModule, node: Node, fake_mode: Any, sizes: SizeNodes | None = None,
                 like: Node | None = None):
        self.gm, self.node, self.fake_mode = gm, node, fake_mode
        self.like = like if like is not None else node  # whose stack trace and module path new nodes carry
        self.sizes = sizes if sizes is not None else SizeNodes(gm.graph)
        self.emitted: list[Node] = []
        self.host_values: dict[Node, int] = {}  # stand-ins, for shape propagation only, of ints read on the host

    def __call__(self, target: Callable, *args: Any, **kwargs: Any) -> Node:
        args, kwargs = self.sizes.materialize(args), self.sizes.materialize(kwargs)
        with self.gm.graph.inserting_before(self.node):
            new = self.gm.graph.call_function(target, args, kwargs)
        for key in ("stack_trace", "nn_module_stack", "source_fn_stack", "seq_nr"):
            if key in self.like.meta:
                new.meta[key] = self.like.meta[key]
        val = self._fake(target, args, kwargs)
        if val is not None:
            new.meta["val"] = val
        self.emitted.append(new)
        return new

    def at(self, node: Node, like: Node | None = None) -> "Emitter":
        """An emitter inserting in front of ``node`` (carrying ``like``'s stack trace), sharing this one's sizes."""
        em = Emitter(self.gm, node, self.fake_mode, self.sizes, like)
        em.host_values = self.host_values
        return em

    def _fake(self, target: Callable, args: tuple, kwargs: dict) -> Any:
        if self.fake_mode is None and target is not operator.getitem:
            return None
        missing = []

        def value(n: Node) -> Any:
            if n in self.host_values:
                return self.host_values[n]
            if "val" not in n.meta:
                missing.append(n)
            return n.meta.get("val")

        fake_args, fake_kwargs = map_arg((args, kwargs), value)
        if missing:
            return None
        if target is operator.getitem:
            return target(*fake_args)
        if getattr(target, "namespace", None) == "npu":
            # torch_npu's schemas type sizes such as numels as int, not SymInt: a SymInt there would be
            # specialized (a guard fixing the length); no output shape depends on them, so the hint stands in
            fake_args, fake_kwargs = (tuple(_hinted(a) for a in fake_args),
                                      {k: _hinted(v) for k, v in fake_kwargs.items()})
        with self.fake_mode:
            return target(*fake_args, **fake_kwargs)

    def outputs(self, node: Node, count: int) -> list[Node]:
        return [self(operator.getitem, node, i) for i in range(count)]

    def host_int(self, tensor: Node) -> Node:
        """The Python int inside a 0-dim tensor (a host read: the graph can no longer be captured)."""
        with self.gm.graph.inserting_before(self.node):
            new = self.gm.graph.call_function(aten._local_scalar_dense.default, (tensor,))
        self.host_values[new] = 0
        self.emitted.append(new)
        return new

    def cast(self, node: Node, dtype: torch.dtype) -> Node:
        if node.meta["val"].dtype == dtype:
            return node
        return self(aten._to_copy.default, node, dtype=dtype)

    def where_zero(self, keep: Node, node: Node) -> Node:
        """``node`` where ``keep``, else 0 of its dtype: ``aten.where.self`` against a 0-dim ``new_zeros`` of
        ``node``. Not ``aten.where.ScalarOther``, which torchair has no GE converter for
        (ge_converter/aten/where.py), and no zero made from nothing (``scalar_tensor``, ``full``): torchair's
        aclgraph conversion re-runs each op on its inputs outside the fake mode when it compiles a backward
        (fx2acl_converter.py, parse_node), where such an op makes a real tensor beside fake ones."""
        return self(aten.where.self, keep, node, self(aten.new_zeros.default, node, []))

    def sum_to(self, node: Node, shape: Sequence[int], dtype: torch.dtype) -> Node:
        """``node`` summed (in fp32) down to ``shape``, which broadcasts to it, then cast to ``dtype``."""
        src = tuple(node.meta["val"].shape)
        lead = len(src) - len(shape)
        dims = list(range(lead)) + [lead + i for i, s in enumerate(shape) if s == 1 and src[lead + i] != 1]
        acc = torch.float64 if node.meta["val"].dtype == torch.float64 else torch.float32
        total = self(aten.sum.dim_IntList, node, dims, True, dtype=acc) if dims else self.cast(node, acc)
        if tuple(total.meta["val"].shape) != tuple(shape):
            total = self(aten.view.default, total, list(shape))
        if total is node:  # nothing summed, nothing cast: a gradient must be a tensor of its own
            total = self(aten.clone.default, node)
        return self.cast(total, dtype)

    def drop_unused(self) -> None:
        """Remove emitted nodes nobody reads (e.g. statistics an inference graph never saves)."""
        for n in reversed(self.emitted):
            if not n.users and n.graph is self.gm.graph:
                self.gm.graph.erase_node(n)


def _hinted(value: Any) -> Any:
    return hint(value) if isinstance(value, torch.SymInt) else value


Outputs = Sequence[Node | None]  # one per fused-op output; None: an empty [0] placeholder (a grad not asked for)


@dataclasses.dataclass(frozen=True)
class Mapping:
    """One fused op on the NPU: the torch_npu ops it becomes, when it can, and how."""

    calls: tuple[str, ...]
    check: Callable[[Call], str | None]  # None: take it; else why not
    emit: Callable[[Emitter, Call, Options], Outputs]  # (emitter, call, options) -> the op's outputs
    note: Callable[[Call], str | None] = lambda c: None  # said in report.json even when taken


def dtype_problem(name: str, dtype: torch.dtype) -> str | None:
    if dtype not in FLOAT_DTYPES:
        return f"{name} takes float16, bfloat16 or float32, got {dtype}"
    return None


TableType = MappingType[Any, Mapping]


def op_name(target: Any) -> str:
    return target._schema.name.replace("::", ".")


def _replace(em: Emitter, node: Node, outputs: Outputs) -> None:
    """Point every reader of ``node``'s outputs at their replacements, then drop ``node``."""
    if len(node.target._schema.returns) == 1:
        node.replace_all_uses_with(outputs[0])
    else:
        for user in list(node.users):
            index = user.args[1]
            new = outputs[index]
            if new is None:  # an empty gradient placeholder, made only where something reads it
                val = node.meta["val"][index]
                new = em(aten.empty.memory_format, list(val.shape), dtype=val.dtype, device=val.device)
            user.replace_all_uses_with(new)
            em.gm.graph.erase_node(user)
    em.gm.graph.erase_node(node)
    em.drop_unused()


def lower_fused_ops(gm: GraphModule, table: TableType, opts: Options) -> list[dict[str, str]]:
    """Rewrite every fused op ``gm`` holds into the calls ``table`` maps it to, where its check lets it; returns
    report.json ``unfused`` entries for the nodes left on their reference kernel (and for notes on taken ones)."""
    from torch._guards import detect_fake_mode

    fake_mode = detect_fake_mode([n.meta.get("val") for n in gm.graph.nodes])
    sizes = SizeNodes(gm.graph)
    unfused: list[dict[str, str]] = []
    for node in list(gm.graph.nodes):
        mapping = table.get(node.target) if node.op == "call_function" else None
        if mapping is None:
            continue
        call = Call(node)
        why_not = "no FakeTensor metadata on its inputs" if call.missing_metadata() else mapping.check(call)
        if why_not is not None:
            unfused.append({"op": op_name(node.target), "reason": f"npu: {why_not}"})
            continue
        if note := mapping.note(call):
            unfused.append({"op": op_name(node.target), "reason": f"npu: {note}"})
        em = Emitter(gm, node, fake_mode, sizes)
        _replace(em, node, mapping.emit(em, call, opts))
    return unfused
