"""Symbolic sizes in FX graphs: the nodes that compute them, and their hints.

A graph Dynamo captured with a dynamic dimension carries SymInts (``s0``, ``2*s0``, ``s0**2``) in its nodes'
FakeTensor values. A pass that writes a new node whose arguments hold such a size must pass a node computing it
(a SymInt itself is no value at run time), and a pass that weighs sizes (memory planning, the cost model) must
read a number without adding a guard: :func:`hint` is the ShapeEnv's optimization hint, the size of the example
the graph was traced with, which never guards or specializes.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable
from typing import Any

import sympy
import torch
from torch.fx.experimental.symbolic_shapes import optimization_hint
from torch.utils._sympy.functions import FloorDiv


def hint(value: Any) -> int:
    """An int for a size: itself, or a SymInt's hint (no guard)."""
    if isinstance(value, torch.SymInt):
        return optimization_hint(value)
    return int(value)


def numel_hint(shape: Iterable[Any]) -> int:
    n = 1
    for s in shape:
        n *= hint(s)
    return n


def is_static(value: Any) -> bool:
    return not isinstance(value, torch.SymInt) or value.node.expr.is_number


class SizeNodes:
    """Nodes computing the symbolic sizes of ``graph`` from its inputs, made on demand at the top of the graph
    (after the placeholders), so that they come before every node that may read them.

    Sources, in order: placeholders whose value is a SymInt (Dynamo passes each dynamic size as one), then
    ``sym_size`` of an input tensor holding the symbol. Products, sums, integer powers and floor divisions of
    those are spelled with ``operator`` calls, as Dynamo spells them."""

    def __init__(self, graph: torch.fx.Graph):
        self.graph = graph
        self.by_expr: dict[Any, torch.fx.Node | tuple[torch.fx.Node, int]] = {}
        placeholders = [n for n in graph.nodes if n.op == "placeholder"]
        for n in placeholders:
            val = n.meta.get("val")
            if isinstance(val, torch.SymInt):
                self.by_expr.setdefault(val.node.expr, n)
        for n in placeholders:
            val = n.meta.get("val")
            if isinstance(val, torch.Tensor):
                for d, size in enumerate(val.shape):
                    if isinstance(size, torch.SymInt) and size.node.expr.is_Symbol:
                        self.by_expr.setdefault(size.node.expr, (n, d))
        # made nodes go after the placeholders, each after the one made before (it may read it); never before
        # a node a pass may erase later
        self.last = placeholders[-1] if placeholders else None

    def symbols(self) -> set:
        return {e for e in self.by_expr if getattr(e, "is_Symbol", False)}

    def get(self, value: Any) -> int | torch.fx.Node | None:
        """An int (static sizes) or a node computing ``value``; None when its expression cannot be spelled."""
        if not isinstance(value, torch.SymInt):
            return int(value)
        return self._build(value.node.expr)

    def _insert(self, target: Any, args: tuple, val: Any) -> torch.fx.Node:
        first = next(iter(self.graph.nodes), None)
        if self.last is not None:
            where = self.graph.inserting_after(self.last)
        else:
            where = self.graph.inserting_before(first)
        with where:
            node = self.graph.call_function(target, args)
        node.meta["val"] = val
        self.last = node
        return node

    def _build(self, expr: Any) -> int | torch.fx.Node | None:
        if expr.is_Integer:
            return int(expr)
        found = self.by_expr.get(expr)
        if isinstance(found, tuple):
            tensor, dim = found
            found = self._insert(torch.ops.aten.sym_size.int, (tensor, dim), tensor.meta["val"].shape[dim])
            self.by_expr[expr] = found
        if found is not None:
            return found
        if isinstance(expr, sympy.Pow) and expr.exp.is_Integer and int(expr.exp) > 1:
            op, parts = operator.mul, [expr.base] * int(expr.exp)
        elif isinstance(expr, sympy.Mul):
            op, parts = operator.mul, list(expr.args)
        elif isinstance(expr, sympy.Add):
            op, parts = operator.add, list(expr.args)
        elif isinstance(expr, FloorDiv):
            op, parts = operator.floordiv, list(expr.args)
        else:
            return None
        built = [self._build(a) for a in parts]
        if any(b is None for b in built):
            return None
        value = built[0]
        for b in built[1:]:
            a_val = value.meta["val"] if isinstance(value, torch.fx.Node) else value
            b_val = b.meta["val"] if isinstance(b, torch.fx.Node) else b
            value = self._insert(op, (value, b), op(a_val, b_val))
        if isinstance(value, torch.fx.Node):
            self.by_expr[expr] = value
        return value

    def materialize(self, args: Any) -> Any:
        """``args`` (nested lists/tuples/dicts) with every SymInt replaced by :meth:`get`'s node or int."""
        if isinstance(args, torch.SymInt):
            made = self.get(args)
            if made is None:
                raise NotImplementedError(f"cannot spell the symbolic size {args} as graph nodes")
            return made
        if isinstance(args, (list, tuple)):
            return type(args)(self.materialize(a) for a in args)
        if isinstance(args, dict):
            return {k: self.materialize(v) for k, v in args.items()}
        return args
