"""MoE on the npu targets: grouped_matmul → npu_grouped_matmul in its list form (x, weight and y lists, one
independent matmul per expert: ``split_item=0``, ``group_type=-1``).

Sources (torch-npu 2.13.0 wheel, docs/npu_ops.md "Mixture of experts"): the schema is the codegen yaml's
``npu_grouped_matmul``; what it computes and its limits are torch_npu/_op_plugin_docs.py, npu_grouped_matmul:
y_i = x_i × weight_i; lists of at most 128 tensors; float16, bfloat16 or float32 (x, weight and y one dtype);
with group_type -1 only split_item 0 or 1, x_i of one rank (2 to 6), weight_i 2-D, group_list None; weights may
be transposed, all or none; x may not; every x_i's and weight_i's last dim below 65536 (the "InnerLimit").

unpermute_tokens → npu_moe_token_unpermute_with_routing_map(permuted_tokens, slots (int32), restore_shape=[tokens,
hidden]), no probs, no routing map (DOCS: "当probs为None时，routing_map不需要传入"), drop_and_pad False. The op reads
the rows through sorted_indices in a slot layout (DOCS, torch_npu/_op_plugin_docs.py:16980-17028): tokens x topK
of them, values in [0, tokens x topK - 1] (rows, not tokens), -1 an empty slot, token t the sum of the rows of slots
t x topK .. t x topK + topK - 1; the layout of npu_moe_token_permute_with_routing_map's own sorted_indices
("permuted_tokens[sorted_indices[i]] = tokens[i//topK]", :16907), which MindSpeed hands it
(mindspeed/te/pytorch/permutation.py:24-34,85-87; both halves swapped in together,
mindspeed/features_manager/fusions/fused_moe_permute.py:77,82). megatron-core's sorted_indices (each row's token)
are not that layout, so ``slots`` are the lowered permute's sorted_indices where the graph holds the permute of the
same map (the forward), else the argsort of megatron-core's (the backward: every token has topk rows, which the
rule showed, so the sort puts each token's rows in its slots; their order among them does not matter without
probs). Only with topk known (a router's top-k map over all experts; not a rank's slice of them) and a static token
count and hidden size (restore_shape is int[]). npu_moe_token_unpermute, the other unpermute, returns
``sorted_indices.size(0) // topK`` rows (its meta function): without probs one per row, no sum. DOCS: permuted_tokens
float16, bfloat16 or float32; sorted_indices int32 1-D; restore_shape of 2 ints; topK <= 512.

permute_tokens → npu_moe_token_permute_with_routing_map(tokens, routing_map, probs=probs, num_out_tokens=tokens x
topk, drop_and_pad=False), its permuted tokens and probs (DOCS: topK = num_out_tokens // tokens, every map row
holding topK experts, topK < 512; the rows sorted by expert, as megatron-core's permute; the meta function's
outToken = topK x tokens). Only where the rule showed the rows each hold topk experts and the token count is static
(num_out_tokens is int?). Its sorted_indices (each token slot's row, DOCS) are not megatron-core's layout: the graph
keeps megatron-core's for its reference ops and gradient, and the unpermute of the same map reads the op's.

topk_softmax → npu_moe_gating_top_k_softmax_v2(logits, k=k, renorm=1): top-k, then softmax over the k (DOCS,
npu_moe_gating_top_k_softmax_v2: renorm 1 "对x做topk操作，后做softmax操作"; x 2-D / 3-D float16, bfloat16 or
float32; 0 < k <= experts, k <= 1024; y in x's dtype, expert_idx int32, both [tokens, k]; the third output is the
softmax only with renorm 0 and output_softmax, else [0] (the wheel's meta function,
torch_npu/op_plugin/meta/_meta_registrations.py:1759-1783)). DOCS say "该接口支持推理场景下使用" (for inference):
the op has no backward of its own, and none is asked of it: the gradient stays aten (the softmax's backward on the
probs, scattered by the indices). Not known for the device: the order of the k experts in a row (taken as
torch.topk's, descending), the softmax's internal precision for 16-bit x (taken as fp32, as megatron-core's).

topk_gating → npu_moe_gating_top_k(logits, k, bias=expert_bias, k_group, group_count, group_select_mode, renorm=0,
norm_type=1 sigmoid / 0 softmax, out_flag=True, routed_scaling_factor=1.0, eps=1e-20) (DOCS, npu_moe_gating_top_k;
the computation: Ascend/op-plugin docs/context/torch_npu-npu_moe_gating_top_k.md, 等价计算逻辑): norm of x, + bias
for the choice only, groups scored by their max (mode 0) or top-2 sum (mode 1) and the k_group best kept, the top
k, y the chosen norms (over their sum + eps for sigmoid) x routed_scaling_factor, normOut the float32 norm (the
meta function's third output, [tokens, experts] float32: _meta_registrations.py:1786-1830). Limits checked (DOCS):
x float16 / bfloat16 / float32 (here float32: see check_topk_gating), experts <= 2048, experts / group_count > 2
and its 32-aligned size x group_count <= 2048, 1 <= k <= k_group x experts / group_count; renorm 0 only. Inference
per DOCS, no backward asked of it (megatron-core's aten backward reads normOut).
"""

from __future__ import annotations

import operator

import torch
from torch.fx import Node

from npu_compile.lowering.npu.emit import Call, Emitter, Mapping, Outputs, aten, dtype_problem, fused, npu_op
from npu_compile.config import Options

MAX_GROUPS = 128
INNER_LIMIT = 65536


def check_grouped_matmul(c: Call) -> str | None:
    xs, ws = c["x"], c["weight"]
    if len(xs) > MAX_GROUPS:
        return f"npu_grouped_matmul takes at most {MAX_GROUPS} tensors per list, got {len(xs)} experts"
    vals = [n.meta.get("val") for n in (*xs, *ws)]
    dtype = vals[0].dtype
    if problem := dtype_problem("npu_grouped_matmul", dtype):
        return problem
    if any(v.dtype != dtype for v in vals):
        return "npu_grouped_matmul takes x and weight of one dtype"
    for v in vals[:len(xs)]:
        if not v.is_contiguous():
            return f"npu_grouped_matmul takes no transposed x; an input has strides {tuple(v.stride())}"
    w = vals[len(xs)]
    inner = [w.shape[0] if c["transpose_weight"] else w.shape[1], vals[0].shape[-1]]
    if any(type(s) is int and s >= INNER_LIMIT for s in inner):
        return f"npu_grouped_matmul needs every last dim below {INNER_LIMIT}, got {inner}"
    return None


def emit_grouped_matmul(em: Emitter, c: Call, opts: Options) -> Outputs:
    ws = [em(aten.t.default, w) for w in c["weight"]] if c["transpose_weight"] else list(c["weight"])
    return (em(npu_op("npu_grouped_matmul"), list(c["x"]), ws, split_item=0, group_type=-1),)


def _weight_grad_operands(c: Call) -> tuple[list, list]:
    """(a, b) with each weight's gradient a_iᵀ @ b_i."""
    return (list(c["grad_y"]), list(c["x"])) if c["transpose_weight"] else (list(c["x"]), list(c["grad_y"]))


def check_weight_grad(c: Call) -> str | None:
    a, b = _weight_grad_operands(c)
    if len(a) > MAX_GROUPS:
        return f"npu_grouped_matmul takes at most {MAX_GROUPS} tensors per list, got {len(a)} experts"
    vals = [n.meta.get("val") for n in (*a, *b)]
    if problem := dtype_problem("npu_grouped_matmul", vals[0].dtype):
        return problem
    if any(v.dtype != vals[0].dtype for v in vals):
        return "npu_grouped_matmul takes x and weight of one dtype"
    return None


def emit_weight_grad(em: Emitter, c: Call, opts: Options) -> Outputs:
    """g_i = a_iᵀ @ b_i as npu_grouped_matmul's independent matmuls, a_iᵀ made contiguous (it takes no transposed
    x); each group's k is that expert's token count (the documented example's groups differ in k too)."""
    a, b = _weight_grad_operands(c)
    xs = [em(aten.clone.default, em(aten.t.default, t), memory_format=torch.contiguous_format) for t in a]
    return (em(npu_op("npu_grouped_matmul"), xs, b, split_item=0, group_type=-1),)


MAX_UNPERMUTE_TOPK = 512  # DOCS: topK_num <= 512


def check_unpermute(c: Call) -> str | None:
    name = "npu_moe_token_unpermute_with_routing_map"
    val = c.val("permuted_tokens")
    if problem := dtype_problem(name, val.dtype):
        return problem
    tokens, hidden = c.val("num_tokens"), val.shape[1]
    if type(tokens) is not int or type(hidden) is not int:
        return (f"{name} takes restore_shape as int[]: the token count and hidden size must be static, got "
                f"[{tokens}, {hidden}]")
    if not c["topk"]:
        return (f"{name} without drop_and_pad takes the rows as tokens x topK slots (sorted_indices: each slot's "
                "row, DOCS), and these rows are not known to be topK per token (not a router's top-k map over all "
                "experts: a rank's slice of the experts, or another index)")
    if c["topk"] > MAX_UNPERMUTE_TOPK:
        return f"{name} takes topK <= {MAX_UNPERMUTE_TOPK}, got {c['topk']}"
    return None


def _lowered_permute(c: Call) -> Node | None:
    """The lowered npu_moe_token_permute_with_routing_map whose rows these are, where the graph holds it:
    megatron-core's row tokens are the masked_select of the token numbers by the transposed map that permute took
    (the rule's proof, passes/moe.py), with the same token count and topK. None elsewhere (a backward graph: the
    permute is in the forward)."""
    from npu_compile.passes.moe import _map_source

    index = c["sorted_indices"]
    if not (isinstance(index, Node) and index.target is aten.masked_select.default):
        return None
    mask = index.args[1]
    tokens, topk = c["num_tokens"], c["topk"]
    for permute in c.node.graph.find_nodes(op="call_function",
                                           target=npu_op("npu_moe_token_permute_with_routing_map")):
        routing_map = permute.args[1]
        same_map = routing_map is _map_source(mask) or (
            routing_map.target is aten.t.default and routing_map.args[0] is mask)
        if same_map and permute.args[0].meta["val"].shape[0] == tokens \
                and permute.kwargs.get("num_out_tokens") == tokens * topk \
                and not permute.kwargs.get("drop_and_pad", False):
            return permute
    return None


def _slots(em: Emitter, c: Call) -> Node:
    """Each token's topK rows, token by token: the argsort of megatron-core's row tokens (every token has topK
    rows: the rule showed it), int32. Which of a token's slots a row takes does not matter without probs (the op
    sums them), so the sort need not be stable (aten.sort.stable has no GE converter: torchair
    ge_converter/aten/sort.py)."""
    _, order = em.outputs(em(aten.sort.default, c["sorted_indices"]), 2)
    return em.cast(order, torch.int32)


def emit_unpermute(em: Emitter, c: Call, opts: Options) -> Outputs:
    """The op sums, for token t, the rows of slots t x topK .. t x topK + topK - 1 (DOCS); the slots are the
    graph's lowered permute's sorted_indices where it has that permute, else computed from megatron-core's."""
    hidden = c["permuted_tokens"].meta["val"].shape[1]
    permute = _lowered_permute(c)
    slots = em(operator.getitem, permute, 2) if permute is not None else _slots(em, c)
    return (em(npu_op("npu_moe_token_unpermute_with_routing_map"), c["permuted_tokens"], slots,
               [c["num_tokens"], hidden], drop_and_pad=False),)


MAX_PERMUTE_TOPK = 512  # DOCS: topK = num_out_tokens // tokens_num below 512 (UB)
MAX_PERMUTE_SIZE = 16777215  # DOCS: tokens_num, experts_num and topK x tokens_num below it (float-exact ints)


def check_permute(c: Call) -> str | None:
    tokens, routing_map, probs, topk = c.val("tokens"), c.val("routing_map"), c.val("probs"), c["topk"]
    name = "npu_moe_token_permute_with_routing_map"
    if problem := dtype_problem(name, tokens.dtype):
        return problem
    if probs is not None and probs.dtype != tokens.dtype and not (
            probs.dtype == torch.float32 and tokens.dtype == torch.bfloat16):
        return (f"{name} takes probs of the tokens' dtype (or float32 probs with bfloat16 tokens), got "
                f"{probs.dtype} probs, {tokens.dtype} tokens")
    count, experts = routing_map.shape
    if type(count) is not int or type(experts) is not int:
        return f"{name} takes num_out_tokens as int: the token count must be static, got {count}"
    if not topk:
        return (f"{name} without drop_and_pad needs every routing-map row to hold the same number of experts "
                "(topK = num_out_tokens // tokens, DOCS), and this map is not known to (not a router's top-k "
                "scatter over all experts: a rank's slice of the experts, or gathered from other ranks)")
    if topk >= MAX_PERMUTE_TOPK or max(count, experts, count * topk) >= MAX_PERMUTE_SIZE:
        return (f"{name} needs topK < {MAX_PERMUTE_TOPK} and tokens, experts, tokens x topK < {MAX_PERMUTE_SIZE}, "
                f"got topK {topk}, {count} tokens, {experts} experts")
    return None


def emit_permute(em: Emitter, c: Call, opts: Options) -> Outputs:
    """num_out_tokens = tokens x topK (the map's rows each hold topK experts: the rule proved it), so the output
    holds every routed copy; its sorted_indices (each token slot's row, DOCS) are read by the unpermute of the
    same map (emit_unpermute), the op's other readers keep megatron-core's (each row's token)."""
    tokens = c.val("tokens")
    call = em(npu_op("npu_moe_token_permute_with_routing_map"), c["tokens"], c["routing_map"], probs=c["probs"],
              num_out_tokens=tokens.shape[0] * c["topk"], drop_and_pad=False)
    permuted, permuted_probs, _ = em.outputs(call, 3)
    # torch_npu's meta gives tokens x topK rows, a static size; at run time it is the row count the graph's
    # masked_select binds (every row holds topK experts), the symbol the readers were traced with: they keep it
    # (a static size beside it would make later passes compare the two, a guard on the data-dependent symbol)
    for new, old in zip((permuted, permuted_probs), c.node.meta["val"]):
        new.meta["val"] = old
    return (permuted, permuted_probs if c["probs"] is not None else None)


MAX_TOPK = 1024


def check_topk_softmax(c: Call) -> str | None:
    val, k = c.val("logits"), c["k"]
    if problem := dtype_problem("npu_moe_gating_top_k_softmax_v2", val.dtype):
        return problem
    if k > MAX_TOPK:
        return f"npu_moe_gating_top_k_softmax_v2 takes k <= {MAX_TOPK}, got {k}"
    return None


def emit_topk_softmax(em: Emitter, c: Call, opts: Options) -> Outputs:
    """renorm 1: the top-k first, then the softmax over it (DOCS: "当renorm参数设置为1时，对x做topk操作，后做softmax
    操作"), megatron-core's default router; expert_idx int32, widened to the int64 megatron-core scatters with."""
    call = em(npu_op("npu_moe_gating_top_k_softmax_v2"), c["logits"], k=c["k"], renorm=1, output_softmax=False)
    y, expert_idx, _ = em.outputs(call, 3)
    return (y, em.cast(expert_idx, torch.int64))


MAX_GATING_EXPERTS = 2048  # DOCS: x's last dim (the experts) at most 2048
# megatron-core's group score sums the group's topk // group_topk best; the device's group_select_mode sums the top
# 2 (mode 1) or takes the max (mode 0, the top 1): DOCS
GROUP_SELECT_MODE = {1: 0, 2: 1}


def check_topk_gating(c: Call) -> str | None:
    val, k, function = c.val("logits"), c["k"], c["score_function"]
    name = "npu_moe_gating_top_k"
    if val.dtype != torch.float32:
        return (f"{name} chooses on float32 scores; the op's {val.dtype} reference rounds them to the logits' dtype "
                "first (megatron-core's type_as)")
    experts = val.shape[1]
    groups = c["num_groups"] or 1
    k_group = c["group_topk"] if c["num_groups"] else 1
    if type(experts) is not int or experts > MAX_GATING_EXPERTS:
        return f"{name} takes at most {MAX_GATING_EXPERTS} experts (x's last dim), got {experts}"
    per_group = experts // groups
    if per_group <= 2 or -(-per_group // 32) * 32 * groups > MAX_GATING_EXPERTS:
        return (f"{name} needs experts / group_count > 2 and that quotient, rounded up to 32, times group_count "
                f"<= {MAX_GATING_EXPERTS}: {experts} experts in {groups} groups")
    if k > k_group * per_group:
        return f"{name} takes k <= k_group x experts per group ({k_group} x {per_group}), got {k}"
    if c["num_groups"] and c["group_values"] not in GROUP_SELECT_MODE:
        return (f"{name} scores a group by its best expert or the sum of its best 2 (group_select_mode 0 / 1); "
                f"megatron-core sums its topk // group_topk = {c['group_values']} best")
    if function == "sigmoid" and k == 1:
        return (f"{name} divides the chosen sigmoid scores by their sum + eps for every k (norm_type 1); "
                "megatron-core leaves a single expert's score as it is (k = 1)")
    return None


def emit_topk_gating(em: Emitter, c: Call, opts: Options) -> Outputs:
    """norm_type 1 (sigmoid) or 0 (softmax), the bias added for the choice only, groups by group_select_mode,
    renorm 0 (the score before the top-k), out_flag so normOut (every expert's float32 score: what the backward
    reads) comes back; routed_scaling_factor 1 (megatron-core's scaling stays a multiplication after the op), eps
    1e-20 (megatron-core's); expertIdxOut int32, widened to int64."""
    grouped = bool(c["num_groups"])
    call = em(npu_op("npu_moe_gating_top_k"), c["logits"], c["k"], bias=c["expert_bias"],
              k_group=c["group_topk"] if grouped else 1, group_count=c["num_groups"] if grouped else 1,
              group_select_mode=GROUP_SELECT_MODE[c["group_values"]] if grouped else 0, renorm=0,
              norm_type=1 if c["score_function"] == "sigmoid" else 0, out_flag=True, routed_scaling_factor=1.0,
              eps=1e-20)
    y, expert_idx, norm = em.outputs(call, 3)
    return (y, em.cast(expert_idx, torch.int64), norm)


ROWS = {
    fused.grouped_matmul.default: Mapping(("npu_grouped_matmul",), check_grouped_matmul, emit_grouped_matmul),
    fused.grouped_matmul_weight_grad.default: Mapping(
        ("npu_grouped_matmul",), check_weight_grad, emit_weight_grad,
        note=lambda c: "grouped_matmul_weight_grad: each expert's x transposed by a copy (npu_grouped_matmul takes "
                       "no transposed x)"),
    fused.unpermute_tokens.default: Mapping(
        ("npu_moe_token_unpermute_with_routing_map",), check_unpermute, emit_unpermute,
        note=lambda c: "unpermute_tokens: sorted_indices in npu_moe_token_unpermute_with_routing_map's slot layout "
                       "(int32): " + ("the graph's npu_moe_token_permute_with_routing_map's"
                                      if _lowered_permute(c) is not None else "a sort of megatron-core's row tokens")),
    fused.permute_tokens.default: Mapping(("npu_moe_token_permute_with_routing_map",), check_permute, emit_permute),
    fused.topk_softmax.default: Mapping(
        ("npu_moe_gating_top_k_softmax_v2",), check_topk_softmax, emit_topk_softmax,
        note=lambda c: "topk_softmax: expert indices widened from int32 (npu_moe_gating_top_k_softmax_v2's) to "
                       "int64"),
    fused.topk_gating.default: Mapping(
        ("npu_moe_gating_top_k",), check_topk_gating, emit_topk_gating,
        note=lambda c: "topk_gating: expert indices widened from int32 (npu_moe_gating_top_k's) to int64"),
}
