"""Fusion rule ``grouped_matmul``: the routed experts' matmuls of an MoE layer become one ``npu_compile.grouped_matmul``.

megatron-core's ``SequentialMLP`` (what runs without its CUDA grouped-GEMM package: ``--moe-grouped-gemm`` off,
``megatron/core/transformer/moe/experts.py``) splits the permuted tokens by the tokens each expert got and runs each
expert's MLP in a Python loop:

    tokens_list = torch.split(permuted_local_hidden_states, tokens_per_expert)     # sizes: .tolist()
    for expert, tokens in zip(self.local_experts, tokens_list): fc1 → activation (× probs) → fc2
    output_local = torch.cat(outputs)

Under Dynamo (``capture_scalar_outputs``) the sizes are unbacked symbols u_0 … u_{E-1} and the loop is unrolled, so
the joint graph holds, per expert, ``mm(x_i, t(W1_i))`` and ``mm(h_i, t(W2_i))`` forward and ``mm(g_i, W2_i)``,
``mm(g'_i, W1_i)`` for the inputs' gradients, each with u_i rows. No fixed pattern states that (the expert count
is the model's, the rows are data-dependent), so this rule is a graph rule (``engine.GraphRule``): it finds each
``split_with_sizes`` over unbacked sizes (a *family*: one MoE layer's experts), takes the matmuls whose rows are
one of the family's sizes and whose other operand is 2-D and static (a weight, or its ``t()``), and groups them by
(family, weight transposed or not, weight shape, dtype), one matmul per expert, in graph order (the k-th of each
expert together: fc1 before fc2 when their weights have one shape). Each group becomes one
``grouped_matmul(x, weights, transpose_weight=...)`` whose outputs replace the matmuls. A site is one group.

Nothing here reads a data-dependent size: sizes are compared as symbols (the same symbol or not), never evaluated,
so no guard is added. Declined with the reason (report.json ``unfused``): a family where the experts do not all
have the matmul (a weight shape one expert lacks), a group where one expert's matmul feeds another's (grouping
would make a cycle), and, by design, the weights' gradients ``mm(t(g_i), x_i)`` (a reduction over the u_i rows:
npu_grouped_matmul groups along m only — group_type -1 and 0 are what A2 takes, torch_npu/_op_plugin_docs.py,
npu_grouped_matmul), which stay one ``mm`` per expert.
"""

from __future__ import annotations

import operator
from collections import defaultdict

import torch
from torch._inductor.pattern_matcher import stable_topological_sort
from torch.fx import Graph, Node

import npu_compile.ops  # noqa: F401  (registers torch.ops.npu_compile.*)
from npu_compile.passes.engine import GraphRule, register_graph_rule
from npu_compile.passes.unbacked_hints import shape_env_of as _shape_env

NAME = "grouped_matmul"
aten = torch.ops.aten


def _unbacked_symbol(size):
    """The sympy symbol of a size that is one unbacked symbol alone, else None (no guard: only its expression is
    looked at)."""
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    if not isinstance(size, torch.SymInt):
        return None
    expr = size.node.expr
    return expr if expr.is_Symbol and free_unbacked_symbols(size) else None


def families(graph: Graph) -> dict:
    """symbol -> (family id, expert index), for each ``split_with_sizes`` whose sizes are distinct unbacked
    symbols: the tokens per expert of one MoE layer (several splits by the same sizes are one family)."""
    found: dict = {}
    for node in graph.find_nodes(op="call_function", target=aten.split_with_sizes.default):
        sizes = node.args[1] if len(node.args) > 1 else node.kwargs.get("split_sizes")
        if not isinstance(sizes, (list, tuple)) or len(sizes) < 2:
            continue
        symbols = [_unbacked_symbol(s.meta.get("val")) if isinstance(s, Node) else None for s in sizes]
        if any(s is None for s in symbols) or len(set(symbols)) != len(symbols) or any(s in found for s in symbols):
            continue
        family = tuple(symbols)
        for i, s in enumerate(symbols):
            found[s] = (family, i)
    return found


def _static_2d(node) -> bool:
    val = node.meta.get("val") if isinstance(node, Node) else None
    return isinstance(val, torch.Tensor) and val.dim() == 2 and all(type(s) is int for s in val.shape)


def _expert_matmul(node: Node, sizes: dict):
    """(family, expert, weight node, transpose_weight) of ``mm(x_i, W)`` / ``mm(x_i, t(W))`` with x_i's rows an
    expert's token count and W static, else None."""
    if len(node.args) != 2 or node.kwargs:
        return None
    a, b = node.args
    val = a.meta.get("val") if isinstance(a, Node) else None
    if not isinstance(val, torch.Tensor) or val.dim() != 2:
        return None
    where = sizes.get(_unbacked_symbol(val.shape[0]))
    if where is None:
        return None
    if isinstance(b, Node) and b.target is aten.t.default and _static_2d(b.args[0]):
        return (*where, b.args[0], True)
    if _static_2d(b):
        return (*where, b, False)
    return None


def _weight_gradient(node: Node, sizes: dict) -> bool:
    """``mm(t(g_i), x_i)``: a sum over an expert's token rows (a weight's gradient)."""
    if len(node.args) != 2:
        return False
    a = node.args[0]
    val = a.meta.get("val") if isinstance(a, Node) else None
    return isinstance(val, torch.Tensor) and val.dim() == 2 and _unbacked_symbol(val.shape[1]) in sizes


def _feeds_another(members: list[Node]) -> bool:
    """Whether a member's output reaches another member (grouping them would make a cycle)."""
    targets, seen, stack = set(members), set(), [u for m in members for u in m.users]
    while stack:
        n = stack.pop()
        if n in targets:
            return True
        if n in seen:
            continue
        seen.add(n)
        stack += list(n.users)
    return False


def _group(graph: Graph, members: list[Node], weights: list[Node], transpose: bool) -> None:
    xs = [m.args[0] for m in members]
    with graph.inserting_before(members[0]):
        call = graph.call_function(torch.ops.npu_compile.grouped_matmul.default, (xs, weights),
                                   {"transpose_weight": transpose})
        call.meta.update({k: members[0].meta[k] for k in ("stack_trace", "nn_module_stack") if k in members[0].meta})
        call.meta["val"] = [m.meta["val"] for m in members]
        for i, m in enumerate(members):
            item = graph.call_function(operator.getitem, (call, i))
            item.meta = {**m.meta}
            m.replace_all_uses_with(item)
    for m in members:
        graph.erase_node(m)


def apply(graph: Graph, mode: str) -> tuple[int, list[dict[str, str]]]:
    sizes = families(graph)
    if not sizes:
        return 0, []
    groups: dict = defaultdict(lambda: defaultdict(list))  # (family, transpose, shape, dtype) -> expert -> [(mm, W)]
    declined: list[dict[str, str]] = []
    weight_grads: dict = defaultdict(int)
    for node in graph.find_nodes(op="call_function", target=aten.mm.default):
        hit = _expert_matmul(node, sizes)
        if hit is None:
            if _weight_gradient(node, sizes):
                weight_grads[sizes[_unbacked_symbol(node.args[0].meta["val"].shape[1])][0]] += 1
            continue
        family, expert, weight, transpose = hit
        w = weight.meta["val"]
        groups[(family, transpose, tuple(w.shape), w.dtype)][expert].append((node, weight))
    count = 0
    for (family, transpose, shape, dtype), by_expert in groups.items():
        names = ", ".join(str(s) for s in family)
        counts = [len(by_expert.get(e, ())) for e in range(len(family))]
        if len(set(counts)) != 1:
            for e in by_expert.values():
                for node, _ in e:
                    declined.append({"op": str(node.target), "node": node.name, "reason": (
                        f"the experts of ({names}) do not all have a matmul with a {list(shape)} weight "
                        f"(per expert: {counts}); left one mm per expert")})
            continue
        for k in range(counts[0]):
            members = [by_expert[e][k][0] for e in range(len(family))]
            weights = [by_expert[e][k][1] for e in range(len(family))]
            if _feeds_another(members):
                declined += [{"op": str(m.target), "node": m.name, "reason": (
                    f"one expert's matmul feeds another's among ({names}): grouping them would make a cycle")}
                    for m in members]
                continue
            _group(graph, members, weights, transpose)
            count += 1
    for family, n in weight_grads.items():
        declined.append({"op": "aten.mm.default", "node": "", "reason": (
            f"{n} weight-gradient matmuls of the experts ({', '.join(map(str, family))}) sum over each expert's "
            "tokens: npu_grouped_matmul groups along m only (group_type -1 or 0 on A2); left one mm per expert")})
    return count, declined


register_graph_rule(GraphRule(NAME, apply))


# -- unpermute ----------------------------------------------------------------------------------------------------
#
# Fusion rule ``unpermute``: megatron-core's token unpermutation (``moe_utils.unpermute`` without probs, what every
# dispatcher of both lines calls: the probs are applied by the experts) becomes one ``npu_compile.unpermute_tokens``:
#
#     output = torch.zeros(restore_shape); output.scatter_add_(0, sorted_indices.unsqueeze(1).expand(-1, hidden), x)
#     (0.16.1 with deterministic algorithms: output.index_add_(0, sorted_indices, x))
#
# In the joint graph: ``scatter_add(zeros([T, H]), 0, expand(unsqueeze(idx, 1), [-1, H]), x)`` or
# ``index_add(zeros([T, H]), 0, idx, x)``; the second form is also the permute's input gradient (the gradient of
# ``index_select(tokens, 0, idx)``), which is the same sum of rows into tokens and is fused too. The output is
# [T, H], a static shape; x's rows (the routed copies) are a data-dependent size, compared as a symbol, never
# evaluated. A site that accumulates along dim 0 into a 2-D tensor but is not that form is declined with the reason.
# The op's ``topk`` (each token's row count, which the npu lowering needs) is K where idx is megatron-core's
# ``masked_select`` of the token numbers by the transpose of a router's top-k scatter over all experts [T, E] with
# K per row (``unbacked_hints.topk_mask_count``), else 0.

UNPERMUTE = "unpermute"
_ZEROS = (aten.zeros.default, aten.new_zeros.default, aten.zeros_like.default, aten.full.default,
          aten.new_full.default)


def _val(node):
    return node.meta.get("val") if isinstance(node, Node) else None


def _token_count(graph: Graph, zeros: Node, before: Node):
    """The zeros' row count as an argument of the new op: an int, or the node that holds the symbol."""
    if zeros.target is aten.zeros_like.default:
        rows = _val(zeros.args[0]).shape[0]
        if type(rows) is int:
            return rows
        with graph.inserting_before(before):
            return graph.call_function(aten.sym_size.int, (zeros.args[0], 0))
    size = zeros.args[1] if zeros.target in (aten.new_zeros.default, aten.new_full.default) else zeros.args[0]
    return size[0]


def _fresh_zeros(node) -> str | None:
    """None if ``node`` is a zeros tensor only the site reads, else what it is."""
    if not isinstance(node, Node) or node.target not in _ZEROS:
        return f"{getattr(node, 'name', node)} is not a fresh zeros tensor"
    if node.target in (aten.full.default, aten.new_full.default):
        fill = node.args[2] if node.target is aten.new_full.default else node.args[1]
        if fill != 0:
            return f"{node.name} is filled with {fill}, not zeros"
    if len(node.users) != 1:
        return f"{node.name} (the zeros) is read elsewhere too"
    return None


def _same_size(a, b) -> bool:
    """Whether two sizes are known equal without a guard: the same int, or symbols the shape environment proves
    equal (its runtime asserts included: the experts' rows concatenated are u_0 + … + u_{E-1}, which
    ``split_with_sizes`` asserted equal to the permuted row count)."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    if type(a) is int and type(b) is int:
        return a == b
    return bool(statically_known_true(a == b))


def _row_index(index: Node, src_val) -> tuple[Node | None, str | None]:
    """The 1-D token index of ``expand(unsqueeze(idx, 1), [-1, H])`` (or of ``idx.view(-1, 1)`` expanded), with
    the expanded shape the source's, else (None, why)."""
    ival = _val(index)
    if not (isinstance(index, Node) and index.target is aten.expand.default and isinstance(ival, torch.Tensor)):
        return None, "the index is not one row index broadcast over the hidden dim"
    inner = index.args[0]
    if not (isinstance(inner, Node) and (inner.target is aten.unsqueeze.default and inner.args[1] in (1, -1)
                                         or inner.target is aten.view.default)):
        return None, "the index is not one row index broadcast over the hidden dim"
    idx = inner.args[0]
    v, iv = _val(idx), _val(inner)
    if not (isinstance(v, torch.Tensor) and v.dim() == 1 and iv.dim() == 2 and _same_size(iv.shape[1], 1)):
        return None, "the index is not one row index broadcast over the hidden dim"
    if not all(_same_size(a, b) for a, b in zip(ival.shape, src_val.shape)):
        return None, (f"the index's shape {tuple(ival.shape)} and the rows' {tuple(src_val.shape)} cannot be shown "
                      "equal (every row summed); declined")
    if not _same_size(v.shape[0], ival.shape[0]):
        return None, f"the index has {v.shape[0]} entries for {ival.shape[0]} rows"
    return idx, None


def _unpermute_site(node: Node):
    """(zeros, idx, src) of an unpermute site, (None, why) for a dim-0 accumulation into a 2-D tensor that is not
    one, or None for anything else."""
    if node.target is aten.scatter_add.default:
        base, dim, index, src = node.args[:4]
    elif node.target is aten.index_add.default:
        base, dim, index, src = node.args[:4]
        alpha = node.args[4] if len(node.args) > 4 else node.kwargs.get("alpha", 1)
        if alpha != 1:
            return None, f"index_add with alpha={alpha}"
    else:
        return None
    out, sval = _val(node), _val(src)
    if dim != 0 or not isinstance(out, torch.Tensor) or out.dim() != 2:
        return None
    if not isinstance(sval, torch.Tensor) or sval.dim() != 2 or not sval.is_floating_point():
        return None, "the rows are not a 2-D float tensor"
    if sval.dtype != out.dtype or not _same_size(sval.shape[1], out.shape[1]):
        return None, f"the rows {tuple(sval.shape)} {sval.dtype} do not match the output {tuple(out.shape)} {out.dtype}"
    if problem := _fresh_zeros(base):
        return None, f"the rows are summed into an existing tensor: {problem}"
    if node.target is aten.scatter_add.default:
        idx, problem = _row_index(index, sval)
        if idx is None:
            return None, problem
    else:
        idx, iv = index, _val(index)
        if not (isinstance(iv, torch.Tensor) and iv.dim() == 1 and _same_size(iv.shape[0], sval.shape[0])):
            return None, "the index is not one entry per row"
    if _val(idx).dtype not in (torch.int64, torch.int32):
        return None, f"the index is {_val(idx).dtype}, not int64 or int32"
    return base, idx, src


def _rows_per_token(idx: Node, tokens) -> int:
    """K where ``idx`` holds each of the ``tokens`` tokens' number exactly K times (see above), else 0."""
    from npu_compile.passes.unbacked_hints import _SAME_VALUES, topk_mask_count

    if not _is(idx, aten.masked_select.default) or type(tokens) is not int or tokens <= 0:
        return 0
    values, mask = idx.args
    node, mval = _map_source(mask), _val(mask)
    if node is None or _token_numbers(values, tokens) is not None or not isinstance(mval, torch.Tensor) \
            or mval.dim() != 2:
        return 0
    shape = (tokens, mval.shape[0])

    def is_map(n) -> bool:
        return isinstance(_val(n), torch.Tensor) and tuple(_val(n).shape) == shape

    # copies, casts, same-shape views: the map's own values, its rows still the tokens (no transpose: T may be E)
    while _is(node, *(_SAME_VALUES - set(_TRANSPOSES))) and is_map(node):
        node = node.args[0]
    # the scatter into [T, E] along the experts: each token's row holds the top-k's k indices
    if not (_is(node, aten.scatter.value) and is_map(node) and node.args[1] % 2 == 1):
        return 0
    count = topk_mask_count(node)
    return count // tokens if count and count % tokens == 0 else 0


def apply_unpermute(graph: Graph, mode: str) -> tuple[int, list[dict[str, str]]]:
    count, declined = 0, []
    for node in [*graph.find_nodes(op="call_function", target=aten.scatter_add.default),
                 *graph.find_nodes(op="call_function", target=aten.index_add.default)]:
        site = _unpermute_site(node)
        if site is None:
            continue
        if site[0] is None:
            declined.append({"op": str(node.target), "node": node.name, "reason": (
                f"not megatron-core's unpermute (rows summed into zeros by one token index): {site[1]}")})
            continue
        zeros, idx, src = site
        rows = _token_count(graph, zeros, node)
        with graph.inserting_before(node):
            call = graph.call_function(torch.ops.npu_compile.unpermute_tokens.default,
                                       (src, idx, rows, _rows_per_token(idx, rows)))
        call.meta = {**node.meta}
        node.replace_all_uses_with(call)
        graph.erase_node(node)
        if not zeros.users:
            graph.erase_node(zeros)
        count += 1
    return count, declined


register_graph_rule(GraphRule(UNPERMUTE, apply_unpermute))


# -- token counts for the cost model ------------------------------------------------------------------------------
#
# An MoE layer's token counts are data-dependent (unbacked symbols): the permuted row count (``masked_select`` by the
# routing map), the all-to-all's split sizes and the tokens per expert (``.tolist()``). The cost model takes sizes at
# their optimization hints, and an unbacked symbol without one is 0 (``device.cost._hint``): the token all-to-alls
# cost their latency alone and the experts' grouped matmuls nothing, so the overlap scheduler plans as if there were
# no token traffic to hide. ``token_hints`` gives those symbols the hints of balanced routing, without a guard
# (``ShapeEnv.var_to_hint_override``, read by ``optimization_hint`` only; nothing that decides a shape reads it):
#
#   permuted rows  = routing-map entries x k / E           (dropless top-k: exactly tokens x k with the whole map)
#   all-to-all     = each split 1/n of the rows sent; the rows received equal the rows sent
#   split sizes    = equal shares of the rows split (the tokens per expert, the chunks per rank)
#
# k / E from the router's top-k (the ``topk`` over the widest last dim: group-limited routing's group top-k is over
# fewer columns); routers of different k / E in one graph: no hints (the reason is returned).

TOKEN_HINTS = "moe_token_hints"
c10d = torch.ops._c10d_functional


def _routing_ratio(graph: Graph):
    """(k, E) of the router's top-k, or (None, why)."""
    found = {}
    for node in graph.find_nodes(op="call_function", target=aten.topk.default):
        val = _val(node.args[0])
        if not isinstance(val, torch.Tensor) or type(val.shape[-1]) is not int or type(node.args[1]) is not int:
            continue
        found.setdefault(val.shape[-1], set()).add(node.args[1])
    if not found:
        return None, "no router top-k in the graph"
    experts = max(found)
    if len(found[experts]) != 1:
        return None, f"top-k over {experts} columns with k = {sorted(found[experts])}: routers of different k"
    return (next(iter(found[experts])), experts), None


class _Hints:
    def __init__(self, env):
        self.env = env
        self.set: dict = {}

    def _expr(self, size):
        if type(size) is int:
            return size
        if isinstance(size, Node):
            size = _val(size)
        if not isinstance(size, torch.SymInt):
            return None
        return size.node.expr.xreplace(self.env.replacements)

    def _open(self, expr):
        """The free unbacked symbols of ``expr`` without a hint."""
        from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

        return [s for s in free_unbacked_symbols(expr) if s not in self.env.var_to_hint_override]

    def value(self, size) -> int | None:
        """``size`` at the hints, or None while it has an unbacked symbol without one."""
        expr = self._expr(size)
        if expr is None:
            return None
        if type(expr) is int:
            return expr
        if self._open(expr):
            return None
        return int(self.env.optimization_hint(expr, fallback=0))

    def assign(self, size, value: int) -> bool:
        """Give ``size`` (a symbol, or a sum of symbols: ``u0 + u1`` after the shape environment's replacements) the
        hint ``value``, spread evenly over its symbols without one. Whether anything was set."""
        import sympy

        expr = self._expr(size)
        if expr is None or type(expr) is int or not isinstance(expr, sympy.Expr):
            return False
        open_ = self._open(expr)
        if not open_:
            return False
        if not (expr.is_Symbol or (expr.is_Add and all(a.is_Symbol for a in expr.args))):
            return False
        known = sum(int(self.env.optimization_hint(a, fallback=0)) for a in expr.args if a not in open_) \
            if expr.is_Add else 0
        share = max(value - known, 0) // len(open_)
        for s in open_:
            self.env.var_to_hint_override[s] = share
            self.set[s] = share
        return True


def token_hints(graph: Graph) -> tuple[dict, str | None]:
    """Give the MoE layers' data-dependent token counts in ``graph`` the hints of balanced routing (above); returns
    ({symbol: hint} set, None) or ({}, why none were)."""
    env = _shape_env(graph)
    if env is None:
        return {}, "no symbolic sizes in the graph"
    ratio, why = _routing_ratio(graph)
    if ratio is None:
        return {}, why
    k, experts = ratio
    hints = _Hints(env)
    rows = lambda node: hints.value(_val(node).shape[0]) if isinstance(_val(node), torch.Tensor) else None  # noqa: E731
    changed = True
    while changed:
        changed = False
        for node in graph.find_nodes(op="call_function", target=aten.masked_select.default):
            mask = _val(node.args[1])
            numel = hints.value(mask.numel()) if isinstance(mask, torch.Tensor) else None
            if numel is not None:
                changed |= hints.assign(_val(node).shape[0], numel * k // experts)
        for node in graph.find_nodes(op="call_function", target=c10d.all_to_all_single.default):
            sent = rows(node.args[0])
            if sent is None:
                continue
            out_splits, in_splits = node.args[1], node.args[2]
            for splits in (in_splits, out_splits):
                for s in splits:
                    changed |= hints.assign(s, sent // len(splits))
        for node in graph.find_nodes(op="call_function", target=aten.split_with_sizes.default):
            sizes, dim = node.args[1], node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)
            total = hints.value(_val(node.args[0]).shape[dim]) if isinstance(_val(node.args[0]), torch.Tensor) \
                else None
            if total is None:
                continue
            values = [hints.value(s) for s in sizes]
            open_ = [s for s, v in zip(sizes, values) if v is None]
            if open_:
                rest = max(total - sum(v for v in values if v is not None), 0)
                for s in open_:
                    changed |= hints.assign(s, rest // len(open_))
    return hints.set, None if hints.set else "no data-dependent token counts in the graph"


def apply_token_hints(graph: Graph, mode: str) -> tuple[int, list[dict[str, str]]]:
    """The graph rule: sites are the token permutations (``masked_select`` by a routing map) now priced; a graph
    with a token all-to-all or permutation that got no hint says why in ``unfused``. The graph is not changed."""
    _, why = token_hints(graph)
    dispatch = [*graph.find_nodes(op="call_function", target=aten.masked_select.default),
                *graph.find_nodes(op="call_function", target=c10d.all_to_all_single.default)]
    dispatch = [n for n in dispatch if isinstance(_val(n), torch.Tensor) and _unbacked_rows(_val(n))]
    if not dispatch:
        return 0, []
    values = _Hints(_shape_env(graph))
    unpriced = [n for n in dispatch if values.value(_val(n).shape[0]) is None]
    why = why or "no relation to a priced size"
    declined = [{"op": str(n.target), "node": n.name, "reason": (
        f"the token count is data-dependent and no balanced-routing hint could be given ({why}); the cost model "
        "prices it at 0 rows")} for n in unpriced]
    return sum(n.target is aten.masked_select.default for n in dispatch if n not in unpriced), declined


def _unbacked_rows(val) -> bool:
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    return val.dim() > 0 and bool(free_unbacked_symbols(val.shape[0]))


register_graph_rule(GraphRule(TOKEN_HINTS, apply_token_hints))


# -- topk_gating --------------------------------------------------------------------------------------------------
#
# Fusion rule ``topk_gating``: megatron-core's router with the score function before the top-k
# (``topk_routing_with_score_function``, 0.16.1 moe_utils.py:709-725; 0.12.1 ``topk_softmax_with_capacity``,
# moe_utils.py:536-551) becomes one ``npu_compile.topk_gating`` (npu: ``npu_moe_gating_top_k``):
#
#     --moe-router-score-function sigmoid      scores = sigmoid(logits); [choice = scores + expert_bias]
#                                              indices = topk(choice, k); probs = scores at indices / (Σ + 1e-20)
#     --moe-router-pre-softmax (softmax)       scores = softmax(logits); probs, indices = topk(scores, k)
#     either, with --moe-router-num-groups / --moe-router-group-topk: the top-k over ``masked_fill(choice,
#     ~group_mask, -inf)``, the mask from the groups' sums of their topk // group_topk best (``group_limited_topk``)
#
# In the joint graph (float32 logits): ``topk`` over ``sigmoid(logits)`` / ``sigmoid(logits) + bias`` /
# ``_softmax(logits)``, or over ``masked_fill`` of one by the group mask (``bitwise_not`` of the ``scatter`` of the
# groups' ``topk`` indices, expanded over each group's experts); probs are the top-k values (softmax), or the
# scores' ``gather`` at the indices (with a bias) or the values (without) divided by ``sum + 1e-20`` (sigmoid,
# k > 1). The op's three outputs replace the probs, the indices and the scores (what the backward reads: the
# gradient stays megatron-core's aten, through the chosen experts' scores); --moe-router-topk-scaling-factor's
# multiplication stays after it. Declined with the reason: 16-bit logits (megatron-core rounds the scores to the
# logits' dtype before choosing, ``type_as``; the device op chooses on float32 scores), float64 logits, the
# softmax after a group-limited top-k (torch_npu's gating op normalizes before the top-k only: renorm 0).

TOPK_GATING = "topk_gating"
_MASK_VIEWS = (aten._to_copy.default, aten._unsafe_view.default, aten.view.default, aten.reshape.default,
               aten.clone.default, aten.expand.default, aten.unsqueeze.default)


def _group_mask(masked: Node):
    """(num_groups, group_topk, group_values) of megatron-core's group-limited ``masked_fill(choice, ~mask,
    -inf)``, else None."""
    choice, mask, fill = masked.args[:3]
    if fill != float("-inf") or not _is(mask, aten.bitwise_not.default):
        return None
    node, seen = mask.args[0], set()
    while _is(node, *_MASK_VIEWS):
        seen.add(node.target)
        if node.target is aten.expand.default:
            expand_shape = list(node.args[1])
        node = node.args[0]
    if aten.expand.default not in seen or aten.unsqueeze.default not in seen or not _is(node, aten.scatter.value) \
            or node.args[1] != 1 or node.args[3] != 1 or not _is(node.args[0], aten.zeros_like.default):
        return None
    group_scores, index = node.args[0].args[0], node.args[2]
    if not (_is(index, operator.getitem) and index.args[1] == 1 and _is(index.args[0], aten.topk.default)
            and index.args[0].args[0] is group_scores):
        return None
    group_topk = index.args[0].args[1]
    if not (_is(group_scores, aten.sum.dim_IntList) and list(group_scores.args[1]) in ([-1], [2])):
        return None
    values = group_scores.args[0]
    if not (_is(values, operator.getitem) and values.args[1] == 0 and _is(values.args[0], aten.topk.default)):
        return None
    inner = values.args[0]
    view = inner.args[0]
    if not (_is(view, aten.view.default, aten.reshape.default) and view.args[0] is choice):
        return None
    tokens, experts = _val(choice).shape
    grouped = _val(view).shape
    if len(grouped) != 3 or grouped[0] != tokens or expand_shape[:2] != [tokens, grouped[1]]:
        return None
    return grouped[1], group_topk, inner.args[1]


def _normalized(g: Node) -> Node | None:
    """megatron-core's sigmoid probs ``g / (g.sum(-1, keepdim=True) + 1e-20)``, the div node, else None."""
    for user in g.users:
        if _is(user, aten.div.Tensor) and user.args[0] is g:
            total = user.args[1]
            if _is(total, aten.add.Tensor) and total.args[1] == 1e-20 and _is(total.args[0], aten.sum.dim_IntList) \
                    and total.args[0].args[0] is g and list(total.args[0].args[1]) in ([-1], [1]) \
                    and total.args[0].args[2:3] == (True,):
                return user
    return None


def _score_function(scores: Node) -> str | None:
    if _is(scores, aten.sigmoid.default):
        return "sigmoid"
    if _is(scores, aten._softmax.default) and scores.args[1] in (-1, 1) and not scores.args[2]:
        return "softmax"
    return None


def _topk_gating_site(node: Node):
    """(logits, k, bias, score function, groups, probs node, scores node) of a site, (None, why) for a router
    form this rule declines, or None for any other top-k."""
    x, k = node.args[0], node.args[1]
    dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", -1)
    largest = node.args[3] if len(node.args) > 3 else node.kwargs.get("largest", True)
    xval = _val(x)
    if not (isinstance(xval, torch.Tensor) and xval.dim() == 2 and xval.is_floating_point()) \
            or dim not in (-1, 1) or not largest:
        return None
    groups, choice = (0, 0, 0), x
    if _is(x, aten.masked_fill.Scalar):
        groups = _group_mask(x)
        if groups is None:
            return None
        choice = x.args[0]
    bias, scores = None, choice
    if _is(choice, aten.add.Tensor) and isinstance(choice.args[1], Node):
        b = _val(choice.args[1])
        if isinstance(b, torch.Tensor) and b.dim() == 1 and b.is_floating_point() and b.shape[0] == xval.shape[1]:
            scores, bias = choice.args[0], choice.args[1]
    function = _score_function(scores)
    if function is None:
        if _is(scores, aten._to_copy.default) and _score_function(scores.args[0]):
            return None, (f"{_val(scores).dtype} logits: megatron-core rounds its float32 scores to the logits' "
                          "dtype before the top-k (type_as); npu_moe_gating_top_k chooses on float32 scores")
        if groups[0] and bias is None:
            return None, ("group-limited routing with the softmax after the top-k: npu_moe_gating_top_k normalizes "
                          "before the top-k only (renorm 0, torch_npu/_op_plugin_docs.py)")
        return None
    logits = scores.args[0]
    if function == "softmax" and bias is not None:
        return None
    if _val(logits).dtype != torch.float32:
        return None, (f"{_val(logits).dtype} logits (megatron-core scores in float32 there; the fused op's "
                      "scores in the logits' dtype)")
    items = _getitems(node)
    values = [v for v in items.get(0, []) if v.users]
    if function == "softmax" or bias is None:
        if len(values) != 1:
            return None  # only the indices read: the aux loss's routing map (topk_softmax reports it)
        probs = values[0]
    else:
        gathers = [u for i in items.get(1, []) for u in i.users
                   if _is(u, aten.gather.default) and u.args[0] is scores and u.args[1] in (1, -1)]
        if len(gathers) != 1 or values:
            return None, "the biased sigmoid scores' top-k is not followed by one gather of the scores"
        probs = gathers[0]
    if function == "sigmoid" and k > 1:
        probs = _normalized(probs)
        if probs is None:
            return None, "the chosen sigmoid scores are not divided by their sum + 1e-20 (megatron-core's probs)"
    return logits, k, bias, function, groups, probs, scores


def _drop_mask_gradient(mask: Node, indices: Node) -> None:
    """The group mask's backward, ``masked_fill(g, ~group_mask, 0)`` of a gradient ``g`` scattered into zeros at
    the chosen experts, is ``g`` itself where the k chosen experts lie in the kept groups (k <= group_topk x experts
    per group): the fill writes zeros over zeros. Without it the group choice is computed for the backward alone."""
    for user in list(mask.users):
        if not (_is(user, aten.masked_fill.Scalar) and user.args[1] is mask and user.args[2] == 0):
            continue
        src = user.args[0]
        if _is(src, aten.scatter.src, aten.scatter_add.default) and src.args[1] in (1, -1) \
                and src.args[2] is indices and _is(src.args[0], *_ZEROS) \
                and src.args[0].target not in (aten.full.default, aten.new_full.default):
            user.replace_all_uses_with(src)
            user.graph.erase_node(user)


def apply_topk_gating(graph: Graph, mode: str) -> tuple[int, list[dict[str, str]]]:
    count, declined = 0, []
    for node in list(graph.find_nodes(op="call_function", target=aten.topk.default)):
        if node._erased:  # a group-limited site's own top-k, gone with its site
            continue
        site = _topk_gating_site(node)
        if site is None:
            continue
        if site[0] is None:
            declined.append({"op": str(node.target), "node": node.name, "reason": (
                f"not megatron-core's router with the score before the top-k: {site[1]}")})
            continue
        logits, k, bias, function, (groups, group_topk, group_values), probs, scores = site
        masked = node.args[0] if groups else None
        if groups and group_topk == groups:  # every group kept (MindSpeed-LLM's --moe-router-num-groups 1
            groups = group_topk = group_values = 0  # --moe-router-group-topk 1): the mask fills nothing
        indices = _getitems(node).get(1, [])
        with graph.inserting_before(node):
            call = graph.call_function(torch.ops.npu_compile.topk_gating.default,
                                       (logits, k, bias, function, groups, group_topk, group_values))
            outs = [graph.call_function(operator.getitem, (call, i)) for i in range(3)]
        vals = (_val(probs), _val(node)[1], _val(scores))
        call.meta = {**node.meta, "val": vals}
        for out, val in zip(outs, vals):
            out.meta = {"val": val}
        probs.replace_all_uses_with(outs[0])
        for i in indices:
            i.replace_all_uses_with(outs[1])
        scores.replace_all_uses_with(outs[2])
        values = [v for v in _getitems(node).get(0, []) if v.users]
        if values:  # the top-k values the backward reads (sigmoid without a bias): the chosen scores
            with graph.inserting_before(node):
                chosen = graph.call_function(aten.gather.default, (outs[2], 1, outs[1]))
            chosen.meta = {"val": _val(values[0])}
            for v in values:
                v.replace_all_uses_with(chosen)
        experts = _val(logits).shape[1]
        if masked is not None and k <= (group_topk * (experts // groups) if groups else experts):
            _drop_mask_gradient(masked.args[1], outs[1])  # the chosen experts all lie in kept groups
        _erase_dead_chain(graph, [probs, scores, *indices, *values])  # the old chain back to the scores
        count += 1
    if count:
        stable_topological_sort(graph)  # the scores' readers (the backward's detach) may precede the op
    return count, declined


register_graph_rule(GraphRule(TOPK_GATING, apply_topk_gating))


# -- topk_softmax -------------------------------------------------------------------------------------------------
#
# Fusion rule ``topk_softmax``: megatron-core's router with its default score function, the softmax over each
# token's k largest logits (``topk_routing_with_score_function``, 0.16.1 moe_utils.py:713-715; 0.12.1
# ``topk_softmax_with_capacity``, moe_utils.py:542-543):
#
#     scores, top_indices = torch.topk(logits, k, dim=1)
#     probs = torch.softmax(scores, dim=-1, dtype=torch.float32).type_as(logits)
#
# becomes one ``npu_compile.topk_softmax(logits, k)`` (npu: ``npu_moe_gating_top_k_softmax_v2`` with renorm 1, top-k
# then softmax). In the joint graph: ``topk(x, k)`` whose values are read by one ``_softmax`` along the last dim (fp32
# logits), or by ``_to_copy`` to fp32 → ``_softmax`` → ``_to_copy`` back (bf16 / fp16 logits). The backward keeps
# reading the fp32 softmax; with fp32 logits it is the fused op's probs, with 16-bit logits it is not (probs are
# rounded), so those sites are fused only where nothing else reads the fp32 softmax (inference). Declined with the
# reason: a top-k whose values nothing reads (the aux loss's routing map), softmax before the top-k
# (``--moe-router-pre-softmax``), the sigmoid score function, group-limited routing, float64 logits.

TOPK_SOFTMAX = "topk_softmax"


def _is(node, *targets) -> bool:
    return isinstance(node, Node) and node.op == "call_function" and node.target in targets


def _erase_dead_chain(graph: Graph, nodes: list[Node]) -> None:
    """Erase ``nodes`` and, transitively, the inputs left without users: a replaced chain back to its sources."""
    dead, erased = list(nodes), set()
    while dead:
        n = dead.pop()
        if n in erased or n.users or n.op != "call_function":
            continue
        inputs = list(n.all_input_nodes)
        graph.erase_node(n)
        erased.add(n)
        dead += inputs


def _getitems(node: Node) -> dict[int, list[Node]]:
    out: dict[int, list[Node]] = defaultdict(list)
    for user in node.users:
        if user.target is operator.getitem:
            out[user.args[1]].append(user)
    return out


def _router_form(x: Node) -> str:
    """Why a top-k over ``x`` is not the softmax-after-top-k router, by what computes ``x``."""
    if _is(x, aten._softmax.default):
        return "softmax before the top-k (--moe-router-pre-softmax, or the aux loss's scores)"
    if _is(x, aten.sigmoid.default) or _is(x, aten.add.Tensor) and any(_is(a, aten.sigmoid.default) for a in x.args) \
            or _is(x, aten._to_copy.default) and _is(x.args[0], aten.sigmoid.default):
        return "the sigmoid score function (npu_moe_gating_top_k_softmax takes softmax scores)"
    if _is(x, aten.masked_fill.Scalar, aten.where.self, aten.where.ScalarOther):
        return "group-limited routing (a top-k over the experts of the selected groups)"
    return "the top-k values are not softmaxed alone along the experts"


def _topk_softmax_site(node: Node):
    """(logits, k, the probs node to replace, indices getitems) of a site, or (None, why)."""
    x, k = node.args[0], node.args[1]
    dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", -1)
    largest = node.args[3] if len(node.args) > 3 else node.kwargs.get("largest", True)
    xval = _val(x)
    if not (isinstance(xval, torch.Tensor) and xval.dim() == 2 and xval.is_floating_point()):
        return None
    if dim not in (-1, 1) or not largest:
        return None, f"a top-k along dim {dim} (largest={largest}), not each token's largest experts"
    if _is(x, aten.masked_fill.Scalar, aten.where.self, aten.where.ScalarOther):
        return None, _router_form(x)  # group-limited: npu_moe_gating_top_k's k_group / group_count, not this op's
    if xval.dtype == torch.float64:
        return None, "float64 logits (megatron-core's softmax is float32 there; the fused op's is float64)"
    items = _getitems(node)
    values = items.get(0, [])
    if not values or all(not v.users for v in values):
        return None, "only the top-k's indices are read (the aux loss's routing map, or " + _router_form(x) + ")"
    if len(values) != 1 or len(values[0].users) != 1:
        return None, _router_form(x)
    (user,) = values[0].users
    cast_in = None
    if _is(user, aten._to_copy.default) and user.kwargs.get("dtype") == torch.float32 and len(user.users) == 1:
        cast_in, user = user, next(iter(user.users))
    if not (_is(user, aten._softmax.default) and user.args[1] in (-1, 1) and _val(user).dtype == torch.float32):
        return None, _router_form(x)
    if xval.dtype == torch.float32:
        return x, k, user, items.get(1, [])
    out = [u for u in user.users if _is(u, aten._to_copy.default) and u.kwargs.get("dtype") == xval.dtype]
    if cast_in is None or len(out) != 1 or len(user.users) != 1:
        return None, (f"{xval.dtype} logits whose float32 softmax is read beside its cast back (the backward): the "
                      "fused op's probs are rounded to the logits' dtype")
    return x, k, out[0], items.get(1, [])


def apply_topk_softmax(graph: Graph, mode: str) -> tuple[int, list[dict[str, str]]]:
    count, declined = 0, []
    for node in list(graph.find_nodes(op="call_function", target=aten.topk.default)):
        site = _topk_softmax_site(node)
        if site is None:
            continue
        if site[0] is None:
            declined.append({"op": str(node.target), "node": node.name, "reason": (
                f"not megatron-core's softmax-after-top-k router: {site[1]}")})
            continue
        x, k, probs, indices = site
        with graph.inserting_before(node):
            call = graph.call_function(torch.ops.npu_compile.topk_softmax.default, (x, k))
            new_probs = graph.call_function(operator.getitem, (call, 0))
            new_indices = graph.call_function(operator.getitem, (call, 1))
        pv, iv = _val(probs), _val(node)[1]
        call.meta = {**node.meta, "val": (pv, iv)}
        new_probs.meta = {**probs.meta}
        new_indices.meta = {**indices[0].meta} if indices else {"val": iv}
        probs.replace_all_uses_with(new_probs)
        for i in indices:
            i.replace_all_uses_with(new_indices)
        # the old chain (probs back to the top-k) is dead now
        for i in indices:
            graph.erase_node(i)
        _erase_dead_chain(graph, [probs])
        count += 1
    return count, declined


register_graph_rule(GraphRule(TOPK_SOFTMAX, apply_topk_softmax))


# -- permute ------------------------------------------------------------------------------------------------------
#
# Fusion rule ``permute``: megatron-core's token permutation (``moe_utils.permute`` without a capacity, what every
# dispatcher of both lines calls: 0.16.1 token_dispatcher.py:297,637, 0.12.1 token_dispatcher.py:197,499,
# legacy_a2a_token_dispatcher.py:230) becomes one ``npu_compile.permute_tokens``:
#
#     sorted_indices = arange(T).unsqueeze(0).expand(E, -1).masked_select(routing_map.bool().T.contiguous())
#     permuted = tokens.index_select(0, sorted_indices)
#     permuted_probs = probs.T.contiguous().masked_select(routing_map.T)      (alltoall; allgather does it itself)
#
# In the joint graph: ``index_select(tokens, 0, idx)`` with ``idx = masked_select(expand(unsqueeze(arange(T), 0),
# [E, -1]), M)`` and M a bool [E, T] map. The permuted row count is the unbacked symbol that masked_select binds:
# the masked_select stays (it binds the symbol; the unpermute and the permute's gradient read its indices) and the
# op takes the count from it (``sym_size``). A ``masked_select(P, M')`` of a float [E, T] by the same map (M' the
# same node, or the transpose of the same [T, E] map: as many rows by construction) is the probs' permutation,
# folded into the op (its node stays while a size check reads the symbol it binds). ``topk`` is the map's per-row
# count where the map is a router's top-k scatter along the experts (``_rows_per_token``, as the unpermute's; a
# top-k along the tokens gives uneven rows), else 0: the npu lowering needs it. Declined with the reason: an
# ``index_select`` by a masked_select whose values are not each token's number, a map that is not [E, T], tokens
# that are not a 2-D float [T, H].

PERMUTE = "permute"
_TRANSPOSES = (aten.permute.default, aten.t.default, aten.transpose.int)
_COPIES = (aten.clone.default, aten.contiguous.default, aten.alias.default)


def _strip(node, targets):
    while _is(node, *targets):
        node = node.args[0]
    return node


def _map_source(mask: Node):
    """The [T, E] tensor ``mask`` [E, T] is the transpose of (through copies), or None."""
    node = _strip(mask, _COPIES)
    if not _is(node, *_TRANSPOSES):
        return None
    if node.target is aten.permute.default and list(node.args[1]) != [1, 0]:
        return None
    if node.target is aten.transpose.int and sorted(d % 2 for d in node.args[1:3]) != [0, 1]:
        return None
    return node.args[0]


def _token_numbers(values: Node, tokens: int) -> str | None:
    """None if ``values`` [E, T] holds each column's token number (``arange(T)`` broadcast over the experts)."""
    node = values
    if _is(node, aten.expand.default):
        node = node.args[0]
    if _is(node, aten.unsqueeze.default) and node.args[1] == 0 or \
            _is(node, aten.view.default, aten.reshape.default) and len(node.args[1]) == 2:
        node = node.args[0]
    if _is(node, aten.arange.default):
        start, end, step = 0, node.args[0], 1
    elif _is(node, aten.arange.start):
        start, end, step = node.args[0], node.args[1], 1
    elif _is(node, aten.arange.start_step):
        start, end, step = node.args[:3]
    else:
        return f"the masked values ({values.name}) are not each token's number (arange broadcast over the experts)"
    if start != 0 or step != 1 or not _same_size(end, tokens):
        return f"the masked values are arange({start}, {end}, {step}), not the {tokens} tokens' numbers"
    return None


def _permute_site(node: Node):
    """(tokens, idx, mask) of megatron-core's permute at ``index_select`` ``node``, (None, why) for an
    index_select by a masked_select that is not one, None for anything else."""
    tokens, dim, idx = node.args[:3]
    if not _is(idx, aten.masked_select.default):
        return None
    values, mask = idx.args
    tval, vval, mval = _val(tokens), _val(values), _val(mask)
    if not all(isinstance(v, torch.Tensor) for v in (tval, vval, mval)):
        return None, "no FakeTensor metadata on the inputs"
    if dim != 0 or tval.dim() != 2 or not tval.is_floating_point():
        return None, f"the gathered tensor {tuple(tval.shape)} {tval.dtype} along dim {dim} is not 2-D float tokens"
    if mval.dim() != 2 or mval.dtype != torch.bool or tuple(vval.shape) != tuple(mval.shape) \
            or not _same_size(mval.shape[1], tval.shape[0]):
        return None, (f"the routing map {tuple(mval.shape)} {mval.dtype} is not a bool [experts, tokens] mask "
                      f"over the {tval.shape[0]} tokens")
    if problem := _token_numbers(values, tval.shape[0]):
        return None, problem
    return tokens, idx, mask


def _same_map(a: Node, b: Node) -> bool:
    """Whether two [E, T] masks hold the same values: one node, or transposes of one [T, E] map."""
    return a is b or (_map_source(a) is not None and _map_source(a) is _map_source(b))


def _probs_site(idx: Node, mask: Node, graph: Graph):
    """The ``masked_select(P, M')`` permuting a float [E, T] by the same map, or None. It has as many rows as the
    index by construction (one per true entry of the same map, neither side broadcast), whatever symbols the two
    counts got (Dynamo binds one per masked_select; its asserts tie each to the experts' split sizes, not to each
    other)."""
    for other in graph.find_nodes(op="call_function", target=aten.masked_select.default):
        src, m = other.args
        sval = _val(src)
        if other is not idx and _same_map(m, mask) and isinstance(sval, torch.Tensor) and sval.is_floating_point() \
                and tuple(sval.shape) == tuple(_val(mask).shape) == tuple(_val(m).shape):
            return other
    return None


def _insert_transpose(graph: Graph, node: Node, before: Node) -> Node:
    """``node`` [E, T] as the [T, E] tensor it transposes, or a ``t()`` view of it inserted before ``before``."""
    source = _map_source(node)
    if source is not None:
        return source
    with graph.inserting_before(before):
        view = graph.call_function(aten.t.default, (node,))
    view.meta["val"] = _val(node).t()
    return view


def apply_permute(graph: Graph, mode: str) -> tuple[int, list[dict[str, str]]]:
    count, declined = 0, []
    for node in list(graph.find_nodes(op="call_function", target=aten.index_select.default)):
        site = _permute_site(node)
        if site is None:
            continue
        if site[0] is None:
            declined.append({"op": str(node.target), "node": node.name, "reason": (
                f"not megatron-core's permute (tokens gathered by a routing map's masked_select): {site[1]}")})
            continue
        tokens, idx, mask = site
        probs_select = _probs_site(idx, mask, graph)
        # the op goes where both of its outputs are first needed; stable_topological_sort (after the rules) moves
        # anything earlier that reads them
        before = node if probs_select is None else max(node, probs_select, key=lambda n: _order(graph)[n])
        routing_map = _insert_transpose(graph, mask, before)
        probs = _insert_transpose(graph, probs_select.args[0], before) if probs_select is not None else None
        topk = _rows_per_token(idx, _val(tokens).shape[0])  # a top-k along the experts, not the tokens
        with graph.inserting_before(before):
            rows = graph.call_function(aten.sym_size.int, (idx, 0))
            call = graph.call_function(torch.ops.npu_compile.permute_tokens.default,
                                       (tokens, routing_map, rows, probs, topk))
            out = graph.call_function(operator.getitem, (call, 0))
            out_probs = graph.call_function(operator.getitem, (call, 1))
        rows.meta["val"] = _val(idx).shape[0]
        pval = _val(probs_select) if probs_select is not None else _val(tokens).new_empty((0,))
        call.meta = {**node.meta, "val": (_val(node), pval)}
        out.meta = {**node.meta}
        out_probs.meta = {**(probs_select.meta if probs_select is not None else {}), "val": pval}
        node.replace_all_uses_with(out)
        graph.erase_node(node)
        if probs_select is not None:  # its node stays for what reads the symbol it binds (the size checks)
            for user in list(probs_select.users):
                if not _is(user, aten.sym_size.int):
                    user.replace_input_with(probs_select, out_probs)
        count += 1
    return count, declined


def _order(graph: Graph) -> dict:
    return {n: i for i, n in enumerate(graph.nodes)}


register_graph_rule(GraphRule(PERMUTE, apply_permute))
