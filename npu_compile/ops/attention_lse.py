"""Attention that returns its log-sum-exp as a differentiable output: `npu_compile::attention_with_lse` and its
backward, `npu_compile::attention_with_lse_backward`. Ring attention's per-step attention (context parallelism,
docs/context_parallel.md): each step attends to one block of keys and the steps are merged by their statistics,
so the merge's gradient reaches every step through its lse as well as through its output.

    out = softmax(mask(scale · Q Kᵀ)) · V,   lse_i = log Σ_j exp(s_ij)   (−inf for a row with no visible key)

Forward: `fused_attention`'s kernels (tiles of QUERY_TILE query rows, or torch's flash kernel where it computes
the same), lse = softmax_max + log(softmax_sum). Backward: recomputed tile by tile from q, k, v and lse, the
gradient of both outputs:

    P = exp(S − lse),  dV = Pᵀ dO,  dP = dO Vᵀ,  dS = P ∘ (dP − D),  D_i = rowsum(dO ∘ O)_i − dlse_i

(∂lse_i/∂s_ij = P_ij, so dlse enters as a shift of D). rowsum(dO ∘ O) is taken as rowsum(dP ∘ P) from the fp32
tile, equal in exact arithmetic and free of O's rounding (as fused_attention_backward does). No Sq × Sk tensor is
saved or allocated: the working set is QUERY_TILE × Sk per (batch, head), the saved tensors q, k, v, out, lse.

Conventions are fused_attention's (ops/attention.py): layouts sbnd / bsnd / bnsd, attn_mask bool True = hidden,
broadcastable to [b, nq, sq, sk], causal top-left and or-ed with the mask, GQA. No dropout, no bias: the ring
refuses attention dropout (a dropout over partial softmaxes is not the full softmax's). Rows that see no key get
out 0, lse −inf and zero gradients (a merge gives them weight 0).
"""

import math
from typing import Optional

import torch
from torch import Tensor

from npu_compile.ops.attention import _check, _Problem, fused_attention
from npu_compile.ops.layout import layout_shape, to_bnsd


def _check_lse(query, key, value, attn_mask, layout, lse=None, name="lse"):
    _check(query, key, value, attn_mask, None, layout, 0.0)
    if lse is not None:
        b, nq, sq, _ = to_bnsd(query, layout).shape
        if tuple(lse.shape) != (b, nq, sq):
            raise ValueError(f"{name} must be [b, nq, sq] = {[b, nq, sq]}, got {list(lse.shape)}")


@torch.library.custom_op("npu_compile::attention_with_lse", mutates_args=())
def attention_with_lse(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Optional[Tensor] = None,
    *,
    layout: str = "sbnd",
    scale: Optional[float] = None,
    causal: bool = False,
) -> tuple[Tensor, Tensor]:
    """Returns (out in `layout`, contiguous, query's dtype; lse [b, nq, sq] in fp32, fp64 for fp64 inputs)."""
    _check_lse(query, key, value, attn_mask, layout)
    out, softmax_max, softmax_sum = fused_attention(query, key, value, attn_mask, layout=layout, scale=scale,
                                                    causal=causal)
    lse = torch.where(softmax_sum > 0, softmax_max + softmax_sum.log(), -math.inf)
    return out, lse.contiguous()  # the flash kernel's statistics come [b, s, n]-strided


@attention_with_lse.register_fake
def _(query, key, value, attn_mask=None, *, layout="sbnd", scale=None, causal=False):
    _check_lse(query, key, value, attn_mask, layout)
    b, nq, sq, _ = to_bnsd(query, layout).shape
    acc = torch.float64 if query.dtype == torch.float64 else torch.float32
    return query.new_empty(layout_shape(layout, b, nq, sq, value.shape[-1])), query.new_empty((b, nq, sq), dtype=acc)


@torch.library.custom_op("npu_compile::attention_with_lse_backward", mutates_args=())
def attention_with_lse_backward(
    grad_out: Tensor,
    grad_lse: Tensor,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    out: Tensor,
    lse: Tensor,
    attn_mask: Optional[Tensor] = None,
    *,
    layout: str = "sbnd",
    scale: Optional[float] = None,
    causal: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:
    """Returns (grad_query, grad_key, grad_value), each contiguous in its input's shape. `out` is
    npu_fusion_attention_grad's attention_in; this kernel checks its shape only (rowsum(dO ∘ O) from the tile)."""
    _check_lse(query, key, value, attn_mask, layout, lse)
    _check_lse(query, key, value, attn_mask, layout, grad_lse, "grad_lse")
    if grad_out.shape != out.shape:
        raise ValueError(f"grad_out {list(grad_out.shape)} and out {list(out.shape)} must have the same shape")
    pb = _Problem(query, key, value, attn_mask, None, layout, scale, causal, None)
    # a row with no visible key has lse -inf and every score -inf: exp(-inf - 0) = 0, no NaN
    lse0 = torch.where(torch.isinf(lse), 0.0, lse).to(pb.acc).unsqueeze(-1)
    d_lse = grad_lse.to(pb.acc).unsqueeze(-1)
    grad_out_bnsd = to_bnsd(grad_out, layout)
    grad_q = query.new_empty(query.shape)
    grad_q_bnsd = to_bnsd(grad_q, layout)
    grad_k = torch.zeros_like(pb.k)
    grad_v = torch.zeros_like(pb.v)
    for _, start, stop in pb.tiles():
        rows = stop - start
        s, q_tile, _ = pb.scores(start, stop)
        probs = s.sub_(lse0[:, :, start:stop]).exp_()
        d_out = pb.grouped(grad_out_bnsd[:, :, start:stop].to(pb.acc))
        grad_v += pb.grouped(probs).transpose(-1, -2) @ d_out
        d_probs = pb.ungrouped(torch.matmul(d_out, pb.v.transpose(-1, -2)), rows)
        delta = torch.einsum("...k,...k->...", d_probs, probs).unsqueeze(-1) - d_lse[:, :, start:stop]
        d_scores = pb.grouped(d_probs.sub_(delta).mul_(probs))
        del probs, s
        grad_q_bnsd[:, :, start:stop] = pb.ungrouped(torch.matmul(d_scores, pb.k), rows) * pb.scale
        grad_k += (d_scores.transpose(-1, -2) @ q_tile) * pb.scale
        del d_probs, d_scores
    grad_key = key.new_empty(key.shape)
    to_bnsd(grad_key, layout).copy_(grad_k)
    grad_value = value.new_empty(value.shape)
    to_bnsd(grad_value, layout).copy_(grad_v)
    return grad_q, grad_key, grad_value


@attention_with_lse_backward.register_fake
def _(grad_out, grad_lse, query, key, value, out, lse, attn_mask=None, *, layout="sbnd", scale=None, causal=False):
    _check_lse(query, key, value, attn_mask, layout, lse)
    return query.new_empty(query.shape), key.new_empty(key.shape), value.new_empty(value.shape)


def _setup_context(ctx, inputs, keyword_only_inputs, output):
    query, key, value, attn_mask = inputs
    out, lse = output
    ctx.save_for_backward(query, key, value, out, lse, attn_mask)
    ctx.options = dict(keyword_only_inputs)


def _backward(ctx, grad_out, grad_lse):
    query, key, value, out, lse, attn_mask = ctx.saved_tensors
    grad_out = torch.zeros_like(out) if grad_out is None else grad_out
    grad_lse = torch.zeros_like(lse) if grad_lse is None else grad_lse
    grad_q, grad_k, grad_v = torch.ops.npu_compile.attention_with_lse_backward(
        grad_out, grad_lse, query, key, value, out, lse, attn_mask, **ctx.options)
    return grad_q, grad_k, grad_v, None


attention_with_lse.register_autograd(_backward, setup_context=_setup_context)
