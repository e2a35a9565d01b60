"""npu_grouped_matmul on the CPU, in the forms the lowering emits (no quantization, no group_list).

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


KERNELS = {"npu_grouped_matmul": (npu_grouped_matmul, _fake)}
