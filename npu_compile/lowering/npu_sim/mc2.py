"""The MC2 ops (a matmul fused with a collective) on the CPU, over a real process group.

On npu-sim, ``hcom`` is the c10d group name (what ``_c10d_functional`` ops carry; "0" for the default group),
not an HCCL communicator name. The collective runs synchronously over that group (gloo on the CPU); the math is
the documented one: AllGather₀(x1) @ x2 (+ bias), ReduceScatter₀(x1 @ x2 + bias), AllReduce(x1 @ x2 + bias + x3).
The device's constraints are enforced, so a lowering that breaks them fails here as it would on the NPU.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from npu_compile.lowering.npu_sim.common import check, unsupported


_MC2_DTYPES = (torch.float16, torch.bfloat16)


def _mc2_group(hcom: str, world_size: Optional[int] = None):
    from torch.distributed.distributed_c10d import _resolve_process_group

    try:
        group = _resolve_process_group(hcom)
    except Exception as e:
        # Only a c10d group can stand in for an HCCL communicator on the CPU: without one nothing is emulated.
        raise NotImplementedError(
            f"npu-sim emulates MC2 ops over the c10d process group named by hcom; {hcom!r} names none ({e})") from e
    check(world_size is None or world_size == group.size(),
           f"world_size {world_size} differs from the size {group.size()} of group {hcom!r}")
    return group


def _mc2_operands(op: str, x1: Tensor, x2: Tensor, two_d: bool = True) -> None:
    check(x1.dtype in _MC2_DTYPES and x2.dtype == x1.dtype,
           f"{op}: x1 and x2 must be float16 or bfloat16 of one dtype, got {x1.dtype} and {x2.dtype}")
    check(x2.dim() == 2 and (x1.dim() == 2 if two_d else x1.dim() in (2, 3)),
           f"{op}: bad ranks x1 {tuple(x1.shape)}, x2 {tuple(x2.shape)}")
    check(x1.shape[-1] == x2.shape[0], f"{op}: k mismatch {tuple(x1.shape)} @ {tuple(x2.shape)}")


def _mc2_ag_rs_limits(op: str, x1: Tensor, world_size: int, bias, comm_turn: int, scales) -> None:
    check(world_size in (2, 4, 8), f"{op}: world_size must be 2, 4 or 8, got {world_size}")
    check(256 <= x1.shape[1] < 65535, f"{op}: k must be in [256, 65535), got {x1.shape[1]}")
    check(bias is None, f"{op}: bias is not supported (must be None)")
    check(comm_turn == 0, f"{op}: comm_turn must be 0")
    unsupported(all(s is None for s in scales), f"{op}: the quantized path (x1_scale / x2_scale)")


def npu_all_gather_base_mm(x1, x2, hcom, world_size, *, bias=None, x1_scale=None, x2_scale=None, gather_index=0,
                           gather_output=True, comm_turn=0, output_dtype=None, comm_mode=None):
    op = "npu_all_gather_base_mm"
    _mc2_operands(op, x1, x2)
    _mc2_ag_rs_limits(op, x1, world_size, bias, comm_turn, (x1_scale, x2_scale))
    check(gather_index == 0, f"{op}: gather_index must be 0")
    group = _mc2_group(hcom, world_size)
    gathered = x1.new_empty((x1.shape[0] * world_size, x1.shape[1]))
    torch.distributed.all_gather_into_tensor(gathered, x1.contiguous(), group=group)
    out = gathered @ x2
    if output_dtype is not None:
        out = out.to(output_dtype)
    return out, gathered if gather_output else x1.new_empty((0,))


def npu_mm_reduce_scatter_base(x1, x2, hcom, world_size, *, reduce_op="sum", bias=None, x1_scale=None,
                               x2_scale=None, comm_turn=0, output_dtype=None, comm_mode=None):
    op = "npu_mm_reduce_scatter_base"
    _mc2_operands(op, x1, x2)
    _mc2_ag_rs_limits(op, x1, world_size, bias, comm_turn, (x1_scale, x2_scale))
    check(reduce_op == "sum", f"{op}: reduce_op must be 'sum'")
    check(x1.shape[0] % world_size == 0, f"{op}: m = {x1.shape[0]} not divisible by world_size {world_size}")
    group = _mc2_group(hcom, world_size)
    full = (x1 @ x2).contiguous()
    out = full.new_empty((full.shape[0] // world_size, full.shape[1]))
    torch.distributed.reduce_scatter_tensor(out, full, op=torch.distributed.ReduceOp.SUM, group=group)
    return out if output_dtype is None else out.to(output_dtype)


def npu_mm_all_reduce_base(x1, x2, hcom, *, reduce_op="sum", bias=None, antiquant_scale=None,
                           antiquant_offset=None, x3=None, dequant_scale=None, pertoken_scale=None,
                           comm_quant_scale_1=None, comm_quant_scale_2=None, antiquant_group_size=0, comm_turn=0,
                           group_sizes=None, y_dtype=None, x1_dtype=None, x2_dtype=None, dequant_scale_dtype=None,
                           pertoken_scale_dtype=None, comm_quant_mode=0, comm_mode=None):
    op = "npu_mm_all_reduce_base"
    group = _mc2_group(hcom)
    _mc2_operands(op, x1, x2, two_d=False)
    check(group.size() in (1, 2, 4, 8), f"{op}: 1, 2, 4 or 8 ranks, got {group.size()}")
    check(reduce_op == "sum", f"{op}: reduce_op must be 'sum'")
    check(comm_turn == 0, f"{op}: comm_turn must be 0")
    unsupported(all(t is None for t in (antiquant_scale, antiquant_offset, dequant_scale, pertoken_scale,
                                         comm_quant_scale_1, comm_quant_scale_2)), f"{op}: the quantized path")
    if bias is not None:
        check(bias.dim() == 1 and bias.shape[0] == x2.shape[1], f"{op}: bias must be 1-D of size n")
    lead = x1.shape[:-1]
    flat = x1.reshape(-1, x1.shape[-1])
    out = torch.addmm(bias, flat, x2) if bias is not None else flat @ x2
    out = out.reshape(*lead, x2.shape[1])
    if x3 is not None:
        out = out + x3
    out = out.contiguous()
    torch.distributed.all_reduce(out, op=torch.distributed.ReduceOp.SUM, group=group)
    return out


def _all_gather_base_mm_fake(x1, x2, hcom, world_size, *, gather_output=True, output_dtype=None, **kwargs):
    m = x1.shape[0] * world_size
    out = x1.new_empty((m, x2.shape[1]), dtype=output_dtype or x1.dtype)
    return out, x1.new_empty((m, x1.shape[1])) if gather_output else x1.new_empty((0,))


def _mm_reduce_scatter_base_fake(x1, x2, hcom, world_size, *, output_dtype=None, **kwargs):
    return x1.new_empty((x1.shape[0] // world_size, x2.shape[1]), dtype=output_dtype or x1.dtype)


def _mm_all_reduce_base_fake(x1, x2, hcom, **kwargs):
    return x1.new_empty((*x1.shape[:-1], x2.shape[1]))


KERNELS = {  # op name -> (CPU kernel, fake kernel giving torch_npu's output shapes and dtypes)
    "npu_all_gather_base_mm": (npu_all_gather_base_mm, _all_gather_base_mm_fake),
    "npu_mm_reduce_scatter_base": (npu_mm_reduce_scatter_base, _mm_reduce_scatter_base_fake),
    "npu_mm_all_reduce_base": (npu_mm_all_reduce_base, _mm_all_reduce_base_fake),
}
