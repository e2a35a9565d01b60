"""Mixture of experts, in namespace npu_compile: ``grouped_matmul``, the routed experts' matmuls as one op,
``unpermute_tokens``, the token unpermutation (the experts' output rows summed back into their tokens), and the
router's top-k (``topk_softmax``, ``topk_gating``) and token permutation (``permute_tokens``), below.

    grouped_matmul(x, weight, *, transpose_weight)   y_i = x_i @ weight_i   (weight_iᵀ when transpose_weight)
                                                   ~ npu_grouped_matmul(x, weight, split_item=0, group_type=-1)
    grouped_matmul_weight_grad(x, grad_y, *, transpose_weight)
                                                   g_i = x_iᵀ @ grad_y_i     (its transpose when transpose_weight)

Lists in, list out: one matmul per expert, each x_i [m_i, k] with its own row count m_i (the tokens routed to
expert i: a data-dependent size under Dynamo), every weight_i of one shape ([k, n], or [n, k] when
``transpose_weight``), one dtype. This is npu_grouped_matmul's "multi-multi-multi" form (x, weight and y all lists,
group_type -1: torch_npu/_op_plugin_docs.py, npu_grouped_matmul), so a graph's per-expert matmuls become one call
with no concatenation and no copies.

Reference kernel: one ``torch.mm`` per expert, each into an output of its own. That is what torch's grouped
matmul runs on a CPU (``torch._grouped_mm``, what ``F.grouped_mm`` calls: torch 2.13
include/ATen/native/GroupedMMUtils.h:124-170, ``_grouped_mm_fallback``, one ``mm_out`` per group into a slice of
one output), so the values are its values; calling it would take the experts' weights stacked into one [E, k, n]
tensor, their rows concatenated, and each output copied apart (a custom op's outputs may not share storage:
torch/_library/utils.py:442, ``_c_check_aliasing_constraint``): three copies a call, which made the reference
slower than eager's per-expert matmuls (docs/moe.md, "Where the time goes at seq 128"). On the NPU the op is one
``npu_grouped_matmul`` over the weight list (npu_compile/lowering/npu/moe.py), no copies either.

The backward ops are the same matmuls, grads flowing back: grad_x = grouped_matmul(grad_y, weight, not transpose),
grad_weight = grouped_matmul_weight_grad. ``transpose_weight`` is keyword-only: torch 2.13's autograd wrapper for
ops taking tensor lists mis-counts a trailing positional non-tensor argument (torch/_library/autograd.py, the
backward's "same structure as the inputs" check), so the backward could not return its None.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _check(x: list[Tensor], weight: list[Tensor], transpose_weight: bool) -> None:
    if len(x) != len(weight) or not x:
        raise ValueError(f"grouped_matmul takes one weight per input: {len(x)} inputs, {len(weight)} weights")
    shape, dtype = tuple(weight[0].shape), weight[0].dtype
    if len(shape) != 2:
        raise ValueError(f"grouped_matmul takes 2-D weights, got {shape}")
    k = shape[1] if transpose_weight else shape[0]
    for i, (a, w) in enumerate(zip(x, weight)):
        if tuple(w.shape) != shape or w.dtype != dtype:
            raise ValueError(f"grouped_matmul takes weights of one shape and dtype: weight[{i}] is "
                             f"{tuple(w.shape)} {w.dtype}, weight[0] {shape} {dtype}")
        if a.dim() != 2 or a.dtype != dtype or a.shape[1] != k:
            raise ValueError(f"grouped_matmul: x[{i}] {tuple(a.shape)} {a.dtype} must be [rows, {k}] {dtype} "
                             f"(weight {shape}, transpose_weight={transpose_weight})")


def _grouped(x: list[Tensor], weight: list[Tensor], transpose_weight: bool) -> list[Tensor]:
    """One mm per expert, each into an output of its own: the matmuls torch's CPU grouped matmul runs per group
    (module docstring), without stacking the weights, concatenating the rows or copying the outputs apart."""
    return [torch.mm(a, b.t() if transpose_weight else b) for a, b in zip(x, weight)]


@torch.library.custom_op("npu_compile::grouped_matmul", mutates_args=())
def grouped_matmul(x: list[Tensor], weight: list[Tensor], *, transpose_weight: bool = False) -> list[Tensor]:
    """[x_i @ weight_i] (weight_iᵀ with transpose_weight), each [m_i, n] in the inputs' dtype."""
    _check(x, weight, transpose_weight)
    return _grouped(x, weight, transpose_weight)


@grouped_matmul.register_fake
def _(x, weight, *, transpose_weight=False):
    _check(x, weight, transpose_weight)
    n = weight[0].shape[0] if transpose_weight else weight[0].shape[1]
    return [a.new_empty((a.shape[0], n)) for a in x]


@torch.library.custom_op("npu_compile::grouped_matmul_weight_grad", mutates_args=())
def grouped_matmul_weight_grad(x: list[Tensor], grad_y: list[Tensor], *,
                               transpose_weight: bool = False) -> list[Tensor]:
    """Each weight's gradient: x_iᵀ @ grad_y_i [k, n], or grad_y_iᵀ @ x_i [n, k] with transpose_weight; a sum over
    the expert's rows (an expert without tokens gets zeros)."""
    if len(x) != len(grad_y) or not x:
        raise ValueError(f"grouped_matmul_weight_grad: {len(x)} inputs, {len(grad_y)} gradients")
    a, b = (grad_y, x) if transpose_weight else (x, grad_y)
    return [torch.mm(p.t(), q) for p, q in zip(a, b)]


@grouped_matmul_weight_grad.register_fake
def _(x, grad_y, *, transpose_weight=False):
    a, b = (grad_y, x) if transpose_weight else (x, grad_y)
    return [p.new_empty((p.shape[1], q.shape[1])) for p, q in zip(a, b)]


def _setup_context(ctx, inputs, keyword_only_inputs, output):
    x, weight = inputs
    transpose_weight = keyword_only_inputs.get("transpose_weight", False)
    ctx.save_for_backward(*x, *weight)
    ctx.experts, ctx.transpose_weight = len(x), transpose_weight


def _backward(ctx, grad_y):
    grad_y = list(grad_y)
    saved = ctx.saved_tensors
    x, weight = list(saved[:ctx.experts]), list(saved[ctx.experts:])
    grad_y = [g if g is not None else a.new_zeros((a.shape[0], w.shape[0] if ctx.transpose_weight else w.shape[1]))
              for g, a, w in zip(grad_y, x, weight)]
    needs_x, needs_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    grad_x = grad_w = None
    if any(needs_x):
        grad_x = torch.ops.npu_compile.grouped_matmul(grad_y, weight, transpose_weight=not ctx.transpose_weight)
    if any(needs_w):
        grad_w = torch.ops.npu_compile.grouped_matmul_weight_grad(x, grad_y, transpose_weight=ctx.transpose_weight)
    return grad_x, grad_w


grouped_matmul.register_autograd(_backward, setup_context=_setup_context)


# -- unpermute_tokens ---------------------------------------------------------------------------------------------
#
#     unpermute_tokens(permuted_tokens, sorted_indices, num_tokens, topk=0)
#                                                                out[sorted_indices[i]] += permuted_tokens[i]
#                          ~ npu_moe_token_unpermute_with_routing_map(permuted_tokens, slots, [num_tokens, hidden])
#                            slots: each token's topk rows, token by token (the op's slot layout; npu lowering)
#
# megatron-core's ``unpermute`` without probs (``moe_utils.py``: zeros of ``restore_shape``, then ``scatter_add_``
# of the rows along dim 0 by ``sorted_indices`` broadcast over the hidden dim, or ``index_add_`` when deterministic
# algorithms are on, 0.16.1): permuted_tokens [N, hidden] (N the routed copies: a data-dependent size under Dynamo),
# sorted_indices [N] (int64 or int32; the token of each row), out [num_tokens, hidden] in permuted_tokens' dtype, a
# static shape. Reference kernel: ``index_add`` into zeros. Its gradient is each row's token's gradient,
# ``grad_out.index_select(0, sorted_indices)`` (plain aten: no fused op is needed for a row gather); sorted_indices
# get none. ``topk``: every token has exactly topk rows (the rows of a router's top-k map: rule ``unpermute`` shows
# it), 0 where not known; the reference checks it, the npu lowering needs it (torch_npu's op takes the rows as
# tokens x topK slots, docs/moe.md).


def _check_unpermute(permuted_tokens: Tensor, sorted_indices: Tensor, num_tokens, topk: int) -> None:
    if permuted_tokens.dim() != 2 or not permuted_tokens.is_floating_point():
        raise ValueError(f"unpermute_tokens: permuted_tokens must be a 2-D float tensor [rows, hidden], got "
                         f"{tuple(permuted_tokens.shape)} {permuted_tokens.dtype}")
    if sorted_indices.dim() != 1 or sorted_indices.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"unpermute_tokens: sorted_indices must be a 1-D int64 or int32 tensor [rows], got "
                         f"{tuple(sorted_indices.shape)} {sorted_indices.dtype}")
    torch._check(sorted_indices.shape[0] == permuted_tokens.shape[0], lambda: (
        f"unpermute_tokens: one index per row: {sorted_indices.shape[0]} indices, {permuted_tokens.shape[0]} rows"))
    torch._check(num_tokens >= 0, lambda: f"unpermute_tokens: num_tokens must be >= 0, got {num_tokens}")
    if topk < 0:
        raise ValueError(f"unpermute_tokens: topk must be >= 0 (0: rows per token not known), got {topk}")


@torch.library.custom_op("npu_compile::unpermute_tokens", mutates_args=())
def unpermute_tokens(permuted_tokens: Tensor, sorted_indices: Tensor, num_tokens: int, topk: int = 0) -> Tensor:
    """[num_tokens, hidden]: each token the sum of its rows of permuted_tokens (sorted_indices: each row's token;
    topk > 0: every token has exactly topk rows)."""
    _check_unpermute(permuted_tokens, sorted_indices, num_tokens, topk)
    if topk:
        per_token = torch.bincount(sorted_indices, minlength=num_tokens)
        if per_token.shape[0] != num_tokens or not bool((per_token == topk).all()):
            raise ValueError(f"unpermute_tokens: every one of the {num_tokens} tokens must have topk={topk} rows, got "
                             f"{sorted(set(per_token.tolist()))} (or an index past the tokens)")
    out = permuted_tokens.new_zeros((num_tokens, permuted_tokens.shape[1]))
    return out.index_add_(0, sorted_indices, permuted_tokens)


@unpermute_tokens.register_fake
def _(permuted_tokens, sorted_indices, num_tokens, topk=0):
    _check_unpermute(permuted_tokens, sorted_indices, num_tokens, topk)
    return permuted_tokens.new_empty((num_tokens, permuted_tokens.shape[1]))


def _unpermute_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[1])


def _unpermute_backward(ctx, grad):
    (sorted_indices,) = ctx.saved_tensors
    return grad.index_select(0, sorted_indices), None, None, None


unpermute_tokens.register_autograd(_unpermute_backward, setup_context=_unpermute_setup)


# -- topk_softmax -------------------------------------------------------------------------------------------------
#
#     topk_softmax(logits, k) -> (probs, indices)      values, indices = topk(logits, k, dim=-1)
#                                                      probs = softmax(values, dim=-1, dtype=float32).type_as(logits)
#                          ~ npu_moe_gating_top_k_softmax_v2(logits, k=k, renorm=1)  (top-k first, then softmax)
#
# megatron-core's router with its default score function (softmax after the top-k: ``--moe-router-score-function
# softmax`` without ``--moe-router-pre-softmax``; ``topk_routing_with_score_function``, 0.16.1 moe_utils.py:709-715,
# 0.12.1 ``topk_softmax_with_capacity``, moe_utils.py:535-543): logits [tokens, experts] float, probs [tokens, k] in
# logits' dtype (the softmax in fp32; in fp64 for fp64 logits), indices [tokens, k] int64, the experts in descending logit order. Gradient:
# the softmax's backward on the k probabilities, scattered back to their experts' columns (plain aten); the
# indices get none.


def _check_topk_softmax(logits: Tensor, k: int) -> None:
    if logits.dim() != 2 or not logits.is_floating_point():
        raise ValueError(f"topk_softmax: logits must be a 2-D float tensor [tokens, experts], got "
                         f"{tuple(logits.shape)} {logits.dtype}")
    if not 0 < k <= logits.shape[1]:
        raise ValueError(f"topk_softmax: k must be in 1..experts ({logits.shape[1]}), got {k}")


@torch.library.custom_op("npu_compile::topk_softmax", mutates_args=())
def topk_softmax(logits: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """(probs, indices): the softmax over each row's k largest logits, and those experts."""
    _check_topk_softmax(logits, k)
    values, indices = torch.topk(logits, k, dim=-1)
    acc = torch.promote_types(logits.dtype, torch.float32)  # float32, as megatron-core's (float64 stays float64)
    return torch.softmax(values, dim=-1, dtype=acc).to(logits.dtype), indices


@topk_softmax.register_fake
def _(logits, k):
    _check_topk_softmax(logits, k)
    return logits.new_empty((logits.shape[0], k)), logits.new_empty((logits.shape[0], k), dtype=torch.int64)


def _topk_softmax_setup(ctx, inputs, output):
    probs, indices = output
    ctx.save_for_backward(probs, indices)
    ctx.shape = inputs[0].shape


def _topk_softmax_backward(ctx, grad_probs, grad_indices):
    probs, indices = ctx.saved_tensors
    acc = torch.promote_types(probs.dtype, torch.float32)
    p, g = probs.to(acc), grad_probs.to(acc)
    grad_values = p * (g - (g * p).sum(-1, keepdim=True))
    grad = grad_values.new_zeros(ctx.shape).scatter(1, indices, grad_values)
    return grad.to(grad_probs.dtype), None


topk_softmax.register_autograd(_topk_softmax_backward, setup_context=_topk_softmax_setup)


# -- topk_gating ---------------------------------------------------------------------------------------------------
#
#     topk_gating(logits, k, expert_bias, score_function, num_groups, group_topk, group_values)
#         -> (probs [tokens, k], indices [tokens, k] int64, scores [tokens, experts])
#                          ~ npu_moe_gating_top_k(logits, k, bias=expert_bias, k_group=group_topk,
#                                                 group_count=num_groups, group_select_mode=group_values - 1,
#                                                 norm_type=1 (sigmoid) or 0 (softmax), out_flag=True)
#
# megatron-core's router with the score function before the top-k (``topk_routing_with_score_function``, 0.16.1
# moe_utils.py:709-725; 0.12.1 ``topk_softmax_with_capacity``, moe_utils.py:536-551; group-limited routing
# ``group_limited_topk``, 0.16.1 moe_utils.py:515-563, 0.12.1 moe_utils.py:420-475):
#
#     scores = sigmoid(logits.float()).type_as(logits)          score_function "sigmoid"
#            = softmax(logits, -1, dtype=float32).type_as(logits)   "softmax" (--moe-router-pre-softmax)
#     choice = scores + expert_bias (sigmoid only; the bias chooses, it never weighs)
#     with groups: the experts in num_groups groups, each scored by the sum of its group_values largest choice
#                  values (megatron-core: topk // group_topk of them), the group_topk best kept, the rest -inf
#     indices = topk(choice, k); probs = scores at indices
#     sigmoid: probs / (probs.sum(-1) + 1e-20) where k > 1
#
# ``num_groups`` 0: no groups. ``scores`` is what megatron-core's backward reads (the score of every expert).
# --moe-router-topk-scaling-factor stays a multiplication after the op. Gradient: through the scores of the
# chosen experts only, as megatron-core's (the bias and the group choice are discrete choices: no gradient).

_SCORE_FUNCTIONS = ("sigmoid", "softmax")


def _check_topk_gating(logits: Tensor, k: int, expert_bias: Tensor | None, score_function: str, num_groups: int,
                       group_topk: int, group_values: int) -> None:
    if logits.dim() != 2 or not logits.is_floating_point():
        raise ValueError(f"topk_gating: logits must be a 2-D float tensor [tokens, experts], got "
                         f"{tuple(logits.shape)} {logits.dtype}")
    experts = logits.shape[1]
    if not 0 < k <= experts:
        raise ValueError(f"topk_gating: k must be in 1..experts ({experts}), got {k}")
    if score_function not in _SCORE_FUNCTIONS:
        raise ValueError(f"topk_gating: score_function must be one of {_SCORE_FUNCTIONS}, got {score_function!r}")
    if expert_bias is not None and (expert_bias.shape != (experts,) or not expert_bias.is_floating_point()):
        raise ValueError(f"topk_gating: expert_bias must be a float tensor [{experts}], got "
                         f"{tuple(expert_bias.shape)} {expert_bias.dtype}")
    if expert_bias is not None and score_function != "sigmoid":
        raise ValueError("topk_gating: expert_bias is megatron-core's for the sigmoid score function only")
    if num_groups:
        if experts % num_groups or not 0 < group_topk <= num_groups:
            raise ValueError(f"topk_gating: num_groups must divide the experts ({experts}) and group_topk be in "
                             f"1..num_groups, got num_groups={num_groups}, group_topk={group_topk}")
        if not 0 < group_values <= experts // num_groups:
            raise ValueError(f"topk_gating: group_values must be in 1..experts per group ({experts // num_groups}), "
                             f"got {group_values}")


def _gating_scores(logits: Tensor, score_function: str) -> Tensor:
    """megatron-core's scores: computed in float32 (float64 stays float64), rounded to the logits' dtype."""
    acc = torch.promote_types(logits.dtype, torch.float32)
    if score_function == "sigmoid":
        return torch.sigmoid(logits.to(acc)).type_as(logits)
    return torch.softmax(logits, dim=-1, dtype=acc).type_as(logits)


@torch.library.custom_op("npu_compile::topk_gating", mutates_args=())
def topk_gating(logits: Tensor, k: int, expert_bias: Tensor | None, score_function: str, num_groups: int,
                group_topk: int, group_values: int) -> tuple[Tensor, Tensor, Tensor]:
    """(probs, indices, scores): each token's k experts chosen by score (+ expert_bias) within its best groups,
    their scores (normalized for sigmoid, k > 1), and every expert's score."""
    _check_topk_gating(logits, k, expert_bias, score_function, num_groups, group_topk, group_values)
    scores = _gating_scores(logits, score_function)
    choice = scores + expert_bias if expert_bias is not None else scores
    tokens, experts = logits.shape
    if num_groups:
        group_scores = choice.view(tokens, num_groups, -1).topk(group_values, dim=-1)[0].sum(dim=-1)
        groups = torch.topk(group_scores, k=group_topk, dim=-1, sorted=False)[1]
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter(1, groups, True)
        keep = keep.unsqueeze(-1).expand(tokens, num_groups, experts // num_groups).reshape(tokens, experts)
        choice = choice.masked_fill(~keep, float("-inf"))
    indices = torch.topk(choice, k=k, dim=-1)[1]
    probs = torch.gather(scores, 1, indices)
    if score_function == "sigmoid" and k > 1:
        probs = probs / (probs.sum(dim=-1, keepdim=True) + 1e-20)
    return probs, indices, scores.clone()


@topk_gating.register_fake
def _(logits, k, expert_bias, score_function, num_groups, group_topk, group_values):
    _check_topk_gating(logits, k, expert_bias, score_function, num_groups, group_topk, group_values)
    tokens = logits.shape[0]
    return (logits.new_empty((tokens, k)), logits.new_empty((tokens, k), dtype=torch.int64),
            logits.new_empty(logits.shape))


def _topk_gating_setup(ctx, inputs, output):
    probs, indices, scores = output
    ctx.save_for_backward(indices, scores)
    ctx.score_function, ctx.k = inputs[3], inputs[1]


def _topk_gating_backward(ctx, grad_probs, grad_indices, grad_scores):
    indices, scores = ctx.saved_tensors
    acc = torch.promote_types(scores.dtype, torch.float32)
    s = scores.to(acc)
    grad = grad_scores.to(acc) if grad_scores is not None else torch.zeros_like(s)
    if grad_probs is not None:
        g, chosen = grad_probs.to(acc), torch.gather(s, 1, indices)
        if ctx.score_function == "sigmoid" and ctx.k > 1:  # p = c / (Σc + eps)
            total = chosen.sum(dim=-1, keepdim=True) + 1e-20
            g = (g - (g * chosen / total).sum(dim=-1, keepdim=True)) / total
        grad = grad.scatter_add(1, indices, g)
    if ctx.score_function == "sigmoid":
        grad = grad * s * (1 - s)
    else:
        grad = s * (grad - (grad * s).sum(dim=-1, keepdim=True))
    return grad.to(scores.dtype), None, None, None, None, None, None


topk_gating.register_autograd(_topk_gating_backward, setup_context=_topk_gating_setup)


# -- permute_tokens -----------------------------------------------------------------------------------------------
#
#     permute_tokens(tokens, routing_map, num_out_tokens, probs=None, topk=0) -> (permuted_tokens, permuted_probs)
#                          ~ npu_moe_token_permute_with_routing_map(tokens, routing_map, probs=probs,
#                                                                   num_out_tokens=tokens x topk)[:2]
#
# megatron-core's ``permute`` without a capacity (0.16.1 moe_utils.py:361-376, 0.12.1 moe_utils.py:288-303):
#
#     sorted_indices = arange(T).unsqueeze(0).expand(E, -1).masked_select(routing_map.bool().T.contiguous())
#     permuted_input = tokens.index_select(0, sorted_indices)
#     permuted_probs = probs.T.contiguous().masked_select(routing_map.T)          (where the caller passes probs)
#
# tokens [T, H] float, routing_map [T, E] bool / int8 (1 where a token goes to an expert), probs [T, E] or None:
# the rows expert by expert, each expert's tokens in token order; permuted_tokens [num_out_tokens, H],
# permuted_probs [num_out_tokens] in probs' dtype ([0] without probs). ``num_out_tokens`` is the number of true
# entries of the map, which under Dynamo is the unbacked symbol megatron-core's ``masked_select`` bound: the op
# takes it rather than making it, so its fake kernel makes no new symbol inside a graph pass (docs/moe.md).
# ``topk``: each row of the map holds exactly topk true entries (a router's top-k scatter), 0 where not known; the
# reference checks it, the npu lowering needs it (torch_npu's op takes num_out_tokens = tokens x topk).
# sorted_indices (each row's token) are not an output: the graph keeps megatron-core's masked_select for them
# (it binds the row count; torch_npu's sorted_indices are another layout, each token slot's row, DOCS, which the
# npu lowering hands to the unpermute of the same map: lowering/npu/moe.py).
# Gradient: the tokens' is the rows' gradients summed into their tokens (``unpermute_tokens`` with the op's topk,
# which the forward checked), the probs' the
# rows' probs gradients scattered back into the map's true entries; the map gets none.


def _check_permute(tokens: Tensor, routing_map: Tensor, probs: Tensor | None, topk: int) -> None:
    if tokens.dim() != 2 or not tokens.is_floating_point():
        raise ValueError(f"permute_tokens: tokens must be a 2-D float tensor [tokens, hidden], got "
                         f"{tuple(tokens.shape)} {tokens.dtype}")
    if routing_map.dim() != 2 or routing_map.dtype not in (torch.bool, torch.int8) \
            or routing_map.shape[0] != tokens.shape[0]:
        raise ValueError(f"permute_tokens: routing_map must be a bool or int8 [{tokens.shape[0]}, experts] map, "
                         f"got {tuple(routing_map.shape)} {routing_map.dtype}")
    if probs is not None and (tuple(probs.shape) != tuple(routing_map.shape) or not probs.is_floating_point()):
        raise ValueError(f"permute_tokens: probs must be a float tensor of the routing map's shape "
                         f"{tuple(routing_map.shape)}, got {tuple(probs.shape)} {probs.dtype}")
    if not 0 <= topk <= routing_map.shape[1]:
        raise ValueError(f"permute_tokens: topk must be in 0..experts ({routing_map.shape[1]}), got {topk}")


def _sorted_indices(routing_map: Tensor) -> Tensor:
    """megatron-core's sorted_indices: the token of each permuted row, expert by expert."""
    mask = routing_map.bool().t().contiguous()
    tokens = torch.arange(routing_map.shape[0], device=routing_map.device)
    return tokens.unsqueeze(0).expand(mask.shape[0], -1).masked_select(mask)


@torch.library.custom_op("npu_compile::permute_tokens", mutates_args=())
def permute_tokens(tokens: Tensor, routing_map: Tensor, num_out_tokens: int, probs: Tensor | None = None,
                   topk: int = 0) -> tuple[Tensor, Tensor]:
    """(permuted_tokens [num_out_tokens, hidden], permuted_probs [num_out_tokens] or [0]): the routed copies of
    the tokens (and their probs) expert by expert, as megatron-core's permute."""
    _check_permute(tokens, routing_map, probs, topk)
    if topk:
        per_row = routing_map.bool().sum(1)
        if not bool((per_row == topk).all()):
            raise ValueError(f"permute_tokens: every routing-map row must route to topk={topk} experts, got "
                             f"{sorted(set(per_row.tolist()))}")
    idx = _sorted_indices(routing_map)
    if idx.shape[0] != num_out_tokens:
        raise ValueError(f"permute_tokens: num_out_tokens={num_out_tokens}, but the routing map routes "
                         f"{idx.shape[0]} copies")
    out = tokens.index_select(0, idx)
    if probs is None:
        return out, tokens.new_empty((0,))
    return out, probs.t().contiguous().masked_select(routing_map.bool().t())


@permute_tokens.register_fake
def _(tokens, routing_map, num_out_tokens, probs=None, topk=0):
    _check_permute(tokens, routing_map, probs, topk)
    torch._check(num_out_tokens >= 0, lambda: f"permute_tokens: num_out_tokens must be >= 0, got {num_out_tokens}")
    out = tokens.new_empty((num_out_tokens, tokens.shape[1]))
    return out, probs.new_empty((num_out_tokens,)) if probs is not None else tokens.new_empty((0,))


def _permute_setup(ctx, inputs, output):
    tokens, routing_map, num_out_tokens, probs, topk = inputs
    ctx.save_for_backward(routing_map)
    ctx.num_tokens, ctx.num_out_tokens, ctx.with_probs = tokens.shape[0], num_out_tokens, probs is not None
    ctx.topk = topk


def _permute_backward(ctx, grad_tokens, grad_probs):
    (routing_map,) = ctx.saved_tensors
    # the same indices without a data-dependent shape (masked_select's would need Dynamo's
    # capture_dynamic_output_shape_ops in the backward of every graph calling the op): the map's true entries,
    # expert by expert, as positions e x T + t of its transpose, num_out_tokens of them
    flat = routing_map.bool().t().reshape(-1)
    idx = torch.nonzero_static(flat, size=ctx.num_out_tokens).reshape(-1) % ctx.num_tokens
    grad_in = torch.ops.npu_compile.unpermute_tokens(grad_tokens, idx, ctx.num_tokens, ctx.topk)
    grad_p = None
    if ctx.with_probs and grad_probs is not None and ctx.needs_input_grad[3]:
        mask = routing_map.bool().t()
        grad_p = grad_probs.new_zeros(mask.shape).masked_scatter(mask, grad_probs).t()
    return grad_in, None, None, grad_p, None


permute_tokens.register_autograd(_permute_backward, setup_context=_permute_setup)
