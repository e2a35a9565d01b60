"""npu_grouped_matmul, npu_moe_token_permute_with_routing_map, npu_moe_token_unpermute_with_routing_map,
npu_moe_gating_top_k_softmax_v2 and npu_moe_gating_top_k on the CPU, in the forms the lowering emits (no
quantization, no group_list).

y_i = x_i × weight_i (+ bias_i), in fp32, rounded once to x's dtype (torch_npu/_op_plugin_docs.py,
npu_grouped_matmul: "非量化" y dtype = x dtype, output_dtype None). split_item 0/1 gives one output per group;
2/3 (one output, the groups' rows end to end) and group_type 0 with a group_list are the device's too but are not
emitted, so not emulated.
"""

from __future__ import annotations

import torch

from npu_compile.lowering.npu_sim.common import ACC, check, check_float, unsupported


def _check(x, weight, bias, split_item, group_type, group_list, quantized):
    unsupported(not any(q is not None for q in quantized), "quantized npu_grouped_matmul")
    unsupported(group_list is None and split_item in (0, 1) and group_type in (None, -1),
                f"npu_grouped_matmul with group_list={group_list}, split_item={split_item}, group_type={group_type}")
    check(len(x) == len(weight) and 0 < len(x) <= 128, f"x and weight must be lists of one length in 1..128, got "
          f"{len(x)} and {len(weight)}")
    check(bias is None or len(bias) == len(weight), "bias must have one tensor per weight")
    for i, (a, w) in enumerate(zip(x, weight)):
        check_float(**{f"x[{i}]": a, f"weight[{i}]": w})
        check(w.dim() == 2 and 2 <= a.dim() <= 6 and a.shape[-1] == w.shape[0] and a.dtype == w.dtype,
              f"x[{i}] {tuple(a.shape)} {a.dtype} and weight[{i}] {tuple(w.shape)} {w.dtype} do not multiply")
        check(a.dim() == x[0].dim(), "every x[i] must have one rank")


def npu_grouped_matmul(x, weight, *, bias=None, scale=None, offset=None, antiquant_scale=None, antiquant_offset=None,
                       per_token_scale=None, group_list=None, activation_input=None, activation_quant_scale=None,
                       activation_quant_offset=None, split_item=0, group_type=None, group_list_type=0, act_type=0,
                       tuning_config=None, output_dtype=None, x_dtype=None, weight_dtype=None, scale_dtype=None,
                       per_token_scale_dtype=None):
    _check(x, weight, bias, split_item, group_type, group_list,
           (scale, offset, antiquant_scale, antiquant_offset, per_token_scale, activation_input, output_dtype))
    unsupported(act_type in (0, None), f"npu_grouped_matmul act_type={act_type}")
    out = []
    for i, (a, w) in enumerate(zip(x, weight)):
        y = torch.matmul(a.to(ACC), w.to(ACC))
        if bias is not None:
            y = y + bias[i].to(ACC)
        out.append(y.to(a.dtype).contiguous())
    return out


def _fake(x, weight, *, split_item=0, group_type=None, group_list=None, **kwargs):
    return [a.new_empty((*a.shape[:-1], w.shape[1])) for a, w in zip(x, weight)]


def npu_moe_token_unpermute_with_routing_map(permuted_tokens, sorted_indices, restore_shape, *, probs=None,
                                             routing_map=None, drop_and_pad=False):
    """Without drop_and_pad the rows are tokens x topK slots, token by token: sorted_indices[s] is the row of
    slot s (in [0, tokens x topK), -1 an empty slot), and unpermuted[t] is the sum of the rows of slots t x topK ..
    t x topK + topK - 1 (DOCS, npu_moe_token_unpermute_with_routing_map: permuted_tokens and sorted_indices
    (tokens_num * topK_num) long, indices in [0, tokens_num * topK_num - 1], -1 an invalid slot, "根据
    sorted_indices存储的下标，获取permuted_tokens中存储的输入数据 … 最后进行累加求和"; the layout of
    npu_moe_token_permute_with_routing_map's sorted_indices output, which MindSpeed feeds it:
    mindspeed/te/pytorch/permutation.py), topK = the indices // tokens; summed in fp32, rounded once to
    permuted_tokens' dtype. The form the lowering emits only: no probs, no routing map, drop_and_pad False."""
    unsupported(probs is None and routing_map is None and not drop_and_pad,
                "npu_moe_token_unpermute_with_routing_map with probs, a routing map or drop_and_pad")
    check_float(permuted_tokens=permuted_tokens)
    check(permuted_tokens.dim() == 2, f"permuted_tokens must be 2-D, got {tuple(permuted_tokens.shape)}")
    rows = permuted_tokens.shape[0]
    check(sorted_indices.dim() == 1 and sorted_indices.dtype == torch.int32 and sorted_indices.shape[0] == rows,
          f"sorted_indices must be int32 [{rows}], got {tuple(sorted_indices.shape)} {sorted_indices.dtype}")
    check(len(restore_shape) == 2 and restore_shape[1] == permuted_tokens.shape[1],
          f"restore_shape must be [tokens, {permuted_tokens.shape[1]}], got {list(restore_shape)}")
    tokens = restore_shape[0]
    check(rows == 0 if tokens == 0 else rows % tokens == 0 and 0 < rows // tokens <= 512,
          f"the {rows} rows must be tokens x topK slots with 0 < topK <= 512, for {tokens} tokens")
    check(bool(((sorted_indices >= -1) & (sorted_indices < rows)).all()), f"sorted_indices must lie in [-1, {rows})")
    slots = sorted_indices.long()
    taken = permuted_tokens.to(ACC).index_select(0, slots.clamp(min=0)) * (slots >= 0).unsqueeze(1)
    hidden = permuted_tokens.shape[1]
    out = taken.view(tokens, -1, hidden).sum(1) if tokens else taken.new_zeros((0, hidden))
    return out.to(permuted_tokens.dtype).contiguous()


def _fake_unpermute(permuted_tokens, sorted_indices, restore_shape, **kwargs):
    return permuted_tokens.new_empty(tuple(restore_shape))


def npu_moe_token_permute_with_routing_map(tokens, routing_map, *, probs=None, num_out_tokens=None, drop_and_pad=False):
    """Each token copied once per expert its routing-map row names, the copies expert by expert, each expert's in
    token order (DOCS, npu_moe_token_permute_with_routing_map: "根据routing_map将tokens和可选probs广播后排序"; the order
    of megatron-core's permute, which MindSpeed swaps it in for: mindspeed/core/fusions/fused_moe_permute.py);
    without drop_and_pad topK = num_out_tokens // tokens (default: tokens) and every row must hold topK experts
    (DOCS, 约束 5), outToken = topK x tokens; permuted_probs the probs of those entries in the same order ([0]
    without probs); sorted_indices int32, each token slot's row: permuted_tokens[sorted_indices[i]] =
    tokens[i // topK] (DOCS), a token's slots in expert order. The form the lowering emits only: drop_and_pad False."""
    unsupported(not drop_and_pad, "npu_moe_token_permute_with_routing_map with drop_and_pad")
    check_float(tokens=tokens)
    check(tokens.dim() == 2, f"tokens must be 2-D, got {tuple(tokens.shape)}")
    count = tokens.shape[0]
    check(routing_map.dim() == 2 and routing_map.shape[0] == count and routing_map.dtype in (torch.bool, torch.int8),
          f"routing_map must be a bool or int8 [{count}, experts] map, got {tuple(routing_map.shape)} "
          f"{routing_map.dtype}")
    if probs is not None:
        check(tuple(probs.shape) == tuple(routing_map.shape), f"probs must have the routing map's shape "
              f"{tuple(routing_map.shape)}, got {tuple(probs.shape)}")
        check(probs.dtype == tokens.dtype or (probs.dtype == torch.float32 and tokens.dtype == torch.bfloat16),
              f"probs must have the tokens' dtype (or be float32 with bfloat16 tokens), got {probs.dtype}")
    topk = (count if num_out_tokens is None else num_out_tokens) // max(count, 1)
    mask = routing_map.bool()
    per_row = mask.sum(1)
    check(bool((per_row == topk).all()), f"every routing-map row must hold topK = num_out_tokens // tokens = {topk} "
          f"experts, got {sorted(set(per_row.tolist()))}")
    rows = torch.arange(count).unsqueeze(0).expand(mask.shape[1], -1).masked_select(mask.t())  # each copy's token
    permuted = tokens.index_select(0, rows).contiguous()
    permuted_probs = probs.t().masked_select(mask.t()).contiguous() if probs is not None else tokens.new_empty((0,))
    return permuted, permuted_probs, torch.argsort(rows, stable=True).to(torch.int32)


def _fake_permute(tokens, routing_map, *, probs=None, num_out_tokens=None, drop_and_pad=False):
    """The wheel's meta function (torch_npu/op_plugin/meta/_meta_registrations.py:6064-6081): outToken rows."""
    count = tokens.shape[0] if num_out_tokens is None else num_out_tokens
    dim = routing_map.shape[1 if drop_and_pad else 0]
    out = count // dim * dim
    return (tokens.new_empty((out, tokens.shape[1])),
            probs.new_empty((out,)) if probs is not None else tokens.new_empty((0,)),
            tokens.new_empty((out,), dtype=torch.int32))


def npu_moe_gating_top_k_softmax_v2(x, *, k=1, finished=None, renorm=0, output_softmax=False):
    """renorm 1: softmax over x's k largest along the last dim; renorm 0: the k largest of softmax(x) (DOCS,
    npu_moe_gating_top_k_softmax_v2), in fp32, y rounded once to x's dtype; expert_idx int32 in descending order
    (torch.topk's); the softmax as third output with renorm 0 and output_softmax, else [0] (the wheel's meta
    function). ``finished`` (rows left out) is not emulated."""
    unsupported(finished is None, "npu_moe_gating_top_k_softmax_v2 with finished")
    check_float(x=x)
    check(x.dim() in (2, 3), f"x must be 2-D or 3-D, got {tuple(x.shape)}")
    check(0 < k <= x.shape[-1] and k <= 1024, f"k must be in 1..min({x.shape[-1]}, 1024), got {k}")
    check(renorm in (0, 1), f"renorm must be 0 or 1, got {renorm}")
    if renorm == 1:
        values, idx = torch.topk(x.to(ACC), k, dim=-1)
        y, soft = torch.softmax(values, dim=-1), None
    else:
        soft = torch.softmax(x.to(ACC), dim=-1)
        y, idx = torch.topk(soft, k, dim=-1)
    third = soft.to(torch.float32) if renorm == 0 and output_softmax else x.new_empty((0,))
    return y.to(x.dtype), idx.to(torch.int32), third


def _fake_gating(x, *, k=1, renorm=0, output_softmax=False, **kwargs):
    shape = (*x.shape[:-1], k)
    third = x.new_empty(tuple(x.shape), dtype=torch.float32) if renorm == 0 and output_softmax else x.new_empty((0,))
    return x.new_empty(shape), x.new_empty(shape, dtype=torch.int32), third


def npu_moe_gating_top_k(x, k, *, bias=None, input_ids=None, tid2eid=None, k_group=1, group_count=1,
                         group_select_mode=0, renorm=0, norm_type=0, out_flag=False, routed_scaling_factor=1.0,
                         eps=1e-20):
    """The equivalent computation of the op's documentation (Ascend/op-plugin docs/context/
    torch_npu-npu_moe_gating_top_k.md, 等价计算逻辑), in fp32: norm = softmax (norm_type 0) or sigmoid (1) of x;
    choice = norm + bias; with group_count > 1 the experts in group_count groups, each scored by its max (mode 0)
    or its top-2 sum (mode 1), the k_group best kept, the rest -inf; expertIdxOut = the top k of choice (int32);
    yOut = norm at those experts, divided by their sum + eps for sigmoid, times routed_scaling_factor, in x's
    dtype; normOut = norm (float32; of x's shape whatever out_flag, as the wheel's meta function: what it holds
    without out_flag is not documented, and the lowering sets it). Hash routing (input_ids / tid2eid) is not
    emulated."""
    unsupported(input_ids is None and tid2eid is None, "npu_moe_gating_top_k hash routing (input_ids, tid2eid)")
    check_float(x=x)
    check(x.dim() == 2 and x.shape[-1] <= 2048, f"x must be 2-D with at most 2048 experts, got {tuple(x.shape)}")
    experts = x.shape[-1]
    check(bias is None or (bias.dim() == 1 and bias.shape[0] == experts and bias.dtype == x.dtype),
          f"bias must be 1-D [{experts}] of x's dtype, got {None if bias is None else (tuple(bias.shape), bias.dtype)}")
    check(group_count > 0 and experts % group_count == 0 and experts // group_count > 2,
          f"group_count must divide the experts ({experts}) into groups of more than 2, got {group_count}")
    check(1 <= k_group <= group_count and 1 <= k <= experts // group_count * k_group,
          f"need 1 <= k_group <= group_count and 1 <= k <= experts / group_count x k_group, got k={k}, "
          f"k_group={k_group}, group_count={group_count}")
    check(group_select_mode in (0, 1) and renorm == 0 and norm_type in (0, 1),
          f"group_select_mode 0/1, renorm 0, norm_type 0/1, got {group_select_mode}, {renorm}, {norm_type}")
    norm = torch.softmax(x.to(ACC), dim=-1) if norm_type == 0 else torch.sigmoid(x.to(ACC))
    choice = norm + bias.to(ACC) if bias is not None else norm
    if group_count > 1:
        grouped = choice.view(x.shape[0], group_count, -1)
        group_score = grouped.amax(-1) if group_select_mode == 0 else grouped.topk(2, dim=-1).values.sum(-1)
        kept = torch.zeros_like(group_score, dtype=torch.bool).scatter(1, group_score.topk(k_group, dim=-1)[1], True)
        choice = grouped.masked_fill(~kept.unsqueeze(-1), float("-inf")).view(x.shape[0], experts)
    idx = torch.topk(choice, k, dim=-1)[1]
    y = torch.gather(norm, 1, idx)
    if norm_type == 1:
        y = y / (y.sum(-1, keepdim=True) + eps)
    y = y * routed_scaling_factor
    return y.to(x.dtype), idx.to(torch.int32), norm.to(torch.float32)


def _fake_gating_top_k(x, k, *, out_flag=False, **kwargs):
    """The wheel's meta function (torch_npu/op_plugin/meta/_meta_registrations.py:1786-1830): normOut [tokens,
    experts] float32 whatever out_flag."""
    return (x.new_empty((x.shape[0], k)), x.new_empty((x.shape[0], k), dtype=torch.int32),
            x.new_empty(tuple(x.shape), dtype=torch.float32))


KERNELS = {"npu_grouped_matmul": (npu_grouped_matmul, _fake),
           "npu_moe_token_unpermute_with_routing_map": (npu_moe_token_unpermute_with_routing_map, _fake_unpermute),
           "npu_moe_gating_top_k_softmax_v2": (npu_moe_gating_top_k_softmax_v2, _fake_gating),
           "npu_moe_token_permute_with_routing_map": (npu_moe_token_permute_with_routing_map, _fake_permute),
           "npu_moe_gating_top_k": (npu_moe_gating_top_k, _fake_gating_top_k)}
