"""Size hints for a graph's data-dependent sizes, so that the memory analysis counts what they hold.

An MoE layer's token permutation has sizes only the data decides (Dynamo's unbacked symbols: the rows routed to
the experts, each expert's share, the all-to-all's split sizes). Without a hint torch sizes such a tensor by a
fallback (``optimization_hint``); the memory analysis (passes/memory.py) used 0, so the experts' activations and
the dispatcher's buffers weighed nothing in the planned peak and in ``memory_budget="auto"``'s choice.

What the graph itself says, and nothing else:

- **Rows of a top-k mask.** A mask made by scattering a nonzero value into zeros at the indices of a ``topk``
  along the same dimension (megatron-core's router: ``topk_softmax_with_capacity``, routing_map =
  zeros.scatter(1, top_indices, 1).bool()) has exactly k true values per row: ``masked_select`` / ``nonzero`` over
  it (and views, transposes, copies of it) yield rows x k elements, the tokens times top-k, whatever the routing.
- **Equalities torch recorded.** The deferred runtime asserts tie the sizes together (``Eq(u2 + u3 + u4 + u5, u0)``:
  the experts' split sizes sum to the permuted rows; the all-to-all's output splits to its input's). A sum of sizes
  without a hint equal to a known value is spread evenly over its terms: each expert's share of a balanced routing
  (what the load-balancing loss aims at). Totals stay exact, so every sum the experts' activations make (saved
  activations, the permuted buffers) is the real one; a single expert's transient buffer is its mean share.

The hints go into the ShapeEnv's ``var_to_hint_override``, which ``optimization_hint`` reads (torch 2.13:
torch/fx/experimental/_size_hinting.py ``_optimization_hint_base``); they are optimization hints only: no guard is
added, no compiled code depends on them. Sizes neither rule reaches keep torch's fallback, and are listed.
"""

from __future__ import annotations

import logging
import operator

import sympy
import torch
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols, optimization_hint

import npu_compile.ops  # noqa: F401  (registers torch.ops.npu_compile.topk_softmax, a top-k the rules make)

log = logging.getLogger(__name__)
aten = torch.ops.aten

# ops whose output holds the same true values as their first argument (a view, a copy, a transpose)
_SAME_VALUES = {aten.clone.default, aten.permute.default, aten.t.default, aten.transpose.int, aten.alias.default,
                aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten._to_copy.default,
                aten.contiguous.default, aten.detach.default, torch.ops.prims.convert_element_type.default}
_ZEROS = {aten.zeros_like.default, aten.zeros.default, aten.new_zeros.default}


def shape_env_of(graph: torch.fx.Graph):
    """The ShapeEnv of the graph's symbolic sizes, or None."""
    for node in graph.nodes:
        val = node.meta.get("val")
        for v in val if isinstance(val, (tuple, list)) else (val,):
            sizes = v.shape if isinstance(v, torch.Tensor) else (v,) if isinstance(v, torch.SymInt) else ()
            for s in sizes:
                if isinstance(s, torch.SymInt):
                    return s.node.shape_env
    return None


def _is_zeros(node) -> bool:
    while isinstance(node, torch.fx.Node) and node.target in _SAME_VALUES:
        node = node.args[0]
    if not isinstance(node, torch.fx.Node):
        return False
    if node.target in _ZEROS:
        return True
    return node.target in (aten.full.default, aten.full_like.default) and node.args[1] == 0


_TOPKS = (aten.topk.default, torch.ops.npu_compile.topk_softmax.default, torch.ops.npu_compile.topk_gating.default)


def topk_mask_count(node) -> int | None:
    """The true values of a mask made by scattering a nonzero value into zeros at a top-k's indices along the
    top-k's dimension, seen through views, transposes and copies; None for any other mask. They are the index
    tensor's elements: k distinct indices per row, each set once."""
    while isinstance(node, torch.fx.Node) and node.target in _SAME_VALUES:
        node = node.args[0]
    if not isinstance(node, torch.fx.Node) or node.target is not aten.scatter.value:
        return None  # (scatter.src: the scattered values may be zero)
    base, dim, index, value = node.args[:4]
    if value == 0 or not _is_zeros(base) or not isinstance(index, torch.fx.Node) \
            or index.target is not operator.getitem:
        return None
    topk, which = index.args
    if which != 1 or not isinstance(topk, torch.fx.Node) or topk.target not in _TOPKS:
        return None
    ndim = index.meta["val"].dim()
    # npu_compile.topk_softmax / topk_gating (rules topk_softmax, topk_gating, passes/moe.py): the router's top-k
    # along the last dim
    topk_dim = -1 if topk.target is not aten.topk.default else \
        topk.args[2] if len(topk.args) > 2 else topk.kwargs.get("dim", -1)
    if topk_dim % ndim != dim % ndim:
        return None
    count = 1
    for s in index.meta["val"].shape:
        count *= optimization_hint(s, fallback=1)
    return count


def _seed(graph: torch.fx.Graph) -> dict[sympy.Symbol, int]:
    """Hints from the graph's ops: the size of masked_select / nonzero over a top-k mask."""
    seeds: dict[sympy.Symbol, int] = {}
    for node in graph.nodes:
        if node.target is aten.masked_select.default:
            mask, size_dim = node.args[1], 0
        elif node.target in (aten.nonzero.default, aten.argwhere.default):
            mask, size_dim = node.args[0], 0
        else:
            continue
        count = topk_mask_count(mask)
        val = node.meta.get("val")
        if count is None or not isinstance(val, torch.Tensor):
            continue
        size = val.shape[size_dim]
        if isinstance(size, torch.SymInt) and isinstance(size.node.expr, sympy.Symbol):
            seeds[size.node.expr] = count
    return seeds


def _value(expr, hints: dict, shape_env) -> int | None:
    expr = sympy.sympify(expr).xreplace(shape_env.replacements)
    expr = expr.xreplace({s: sympy.Integer(v) for s, v in hints.items()})
    expr = expr.xreplace({s: sympy.Integer(v) for s, v in shape_env.backed_var_to_val.items()
                          if isinstance(v, (int, sympy.Integer))})
    return int(expr) if expr.is_number else None


def _spread(expr, total: int, hints: dict, shape_env) -> dict:
    """Hints for the unhinted unbacked symbols of `expr` (a sum of symbols with coefficient 1, some hinted) so that
    it equals `total`: the rest spread evenly, the remainder to the first."""
    expr = sympy.sympify(expr).xreplace(shape_env.replacements)
    terms = sympy.Add.make_args(expr)
    unknown = [t for t in terms if isinstance(t, sympy.Symbol) and t not in hints and t in free_unbacked_symbols(t)]
    known = [t for t in terms if t not in unknown]
    if not unknown or any(free_unbacked_symbols(t) - set(hints) for t in known):
        return {}
    rest = total - sum(_value(t, hints, shape_env) or 0 for t in known)
    if rest < 0:
        return {}
    share, extra = divmod(rest, len(unknown))
    return {s: share + (1 if i < extra else 0) for i, s in enumerate(sorted(unknown, key=str))}


def seed(graph: torch.fx.Graph) -> dict[str, int]:
    """Set optimization hints for the graph's unbacked sizes (module docstring); {symbol: hint} of those set,
    also recorded on the ShapeEnv. Hints set before (by the user, or an earlier graph of the same ShapeEnv) win."""
    shape_env = shape_env_of(graph)
    if shape_env is None or not any(free_unbacked_symbols(v) for v in _vals(graph)):
        return {}
    hints = dict(shape_env.var_to_hint_override)
    new = {s: v for s, v in _seed(graph).items() if s not in hints}
    hints.update(new)
    equalities = [a.expr for asserts in shape_env.deferred_runtime_asserts.values() for a in asserts
                  if isinstance(a.expr, sympy.Equality)]
    changed = True
    while changed:
        changed = False
        for eq in equalities:
            for known, other in ((eq.lhs, eq.rhs), (eq.rhs, eq.lhs)):
                total = _value(known, hints, shape_env)
                if total is None:
                    continue
                spread = _spread(other, total, hints, shape_env)
                if spread:
                    hints.update(spread)
                    new.update(spread)
                    changed = True
    shape_env.var_to_hint_override.update(new)
    if new:
        log.debug("unbacked size hints: %s", {str(s): v for s, v in new.items()})
    return {str(s): v for s, v in sorted(new.items(), key=lambda kv: str(kv[0]))}


def _vals(graph: torch.fx.Graph):
    for node in graph.nodes:
        val = node.meta.get("val")
        for v in val if isinstance(val, (tuple, list)) else (val,):
            if isinstance(v, torch.Tensor):
                yield from (s for s in v.shape if isinstance(s, torch.SymInt))
            elif isinstance(v, torch.SymInt):
                yield v
