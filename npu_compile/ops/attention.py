"""Fused attention: `npu_compile::fused_attention` and its backward, `npu_compile::fused_attention_backward`.

    out = dropout(softmax(mask(scale · Q Kᵀ + bias))) · V

computed the way a flash kernel computes it: in tiles of QUERY_TILE query rows. The forward saves q, k, v,
out, the softmax statistics of every query row (max and sum, fp32) and the dropout seed; the backward
recomputes the probabilities exp(s − max) / sum from them, tile by tile. No Sq×Sk tensor is saved and none
is allocated: the working set is QUERY_TILE × Sk per (batch, head).

Conventions (each chosen so that the lowering to torch_npu.npu_fusion_attention / _grad is direct):
- layout: "sbnd" = [s, b, n, d] (Megatron's core attention; out.view(s, b, n·d) is free; NPU "SBH"),
  "bsnd" (NPU "BSND"), "bnsd" (SDPA; NPU "BNSD"). q, k and v share it; out comes back contiguous in it, with
  v's head dim. softmax_max and softmax_sum are [b, nq, sq] whatever the layout.
- attn_mask: bool, True = masked, broadcastable to [b, nq, sq, sk] (NPU atten_mask, same polarity).
- attn_bias: additive float mask added to the *scaled* scores (SDPA's float mask); NPU's pse is added
  before the scale, so pse = attn_bias / scale.
- causal: top-left aligned, key j is visible to query i iff j <= i (SDPA is_causal, NPU sparse_mode=2).
  It combines with attn_mask by "or".
- fill: None removes masked positions (NPU semantics, a -inf score). A float sets masked scores to that value
  before the softmax, as Megatron's `masked_fill_(mask, -10000.0)` does; rules matching Megatron pass it.
  The two differ only on rows with every key masked (exp(-10000 - max) is 0 in fp32 otherwise); the NPU
  op removes, so a lowering of a filled call must know such rows cannot occur (a causal mask never masks
  a whole row) or handle them.
- dropout_p: probability of dropping (NPU keep_prob = 1 - dropout_p); kept values are scaled by 1/(1-p).
- GQA: nq % nkv == 0, query head h reads kv head h // (nq // nkv).
- softmax_max / softmax_sum: the row max of the masked scores and Σ exp(s − max), NPU's outputs of the same
  names without their ×8 replication ([b, n, sq] instead of [b, n, sq, 8]). Two statistics rather than one
  log-sum-exp because lse = max + log(sum) loses precision where |max| is large: Megatron's fully masked rows
  have max = −10000, where fp32's spacing is 1e-3, and exp(s − lse) would be off by 5e-4 relative.

Fully masked rows: with `fill` every score of the row is `fill`, so the row averages all values uniformly, as
in Megatron. Without `fill` a row with no visible key gets out = 0, softmax_max = 0, softmax_sum = 0 and
zero gradients (the flash convention of an empty row), never NaN; so do rows an attn_bias of -inf hides.

Dropout: the drop mask of query tile i is `rng.drop_mask(seed, i, [b, nq, rows, sk], p)`; forward and
backward both regenerate it, so only the seed is saved: an int64 tensor, 0-dim or the (seed, offset) pair the
attention rules draw (ops/rng.py; the pair is the slot an NPU lowering fills with its device generator's state).
The mask therefore depends on QUERY_TILE, which is read once per call and must not change between a forward and
its backward. With p == 0 no RNG is touched and seed may be None.

Fast path: where the semantics are identical, both kernels call torch's own fused attention instead of the
tiles (on CPU `aten._scaled_dot_product_flash_attention_for_cpu` and its backward, which hold no Sq×Sk tensor
either): dropout_p == 0, CPU tensors of fp32/fp64 (bf16/fp16 stay tiled, see _FAST_DTYPES), v's head dim equal to q's, no bias gradient
(backward), and, with `fill`, no row that every key is masked from (checked on the mask; the filled uniform
row is not what the flash kernel computes, so such calls take the tiles). attn_mask, attn_bias and causal
become the kernel's additive float mask (0 / −inf) and is_causal, an attn_mask that hides exactly the future
keys (Megatron's causal mask; decided once per mask tensor and version) becoming is_causal alone: the kernel then skips the blocks above the diagonal,
the same result bitwise, about 1.7× faster at sequence 1024 and no Sq×Sk mask built; GQA is the kernel's own.
Its forward returns the statistics as (lse, 1), which satisfy p = exp(s − max)/sum as the device's (max, Σexp) do, and rows
with no visible key get out = 0 and (0, 0) as above. Its backward takes either form: lse = max + log(sum)
(0 where sum == 0; those rows' scores are all −inf, so their probabilities and gradients are 0 for any lse).
Everything else (dropout_p > 0 above all: the mask must stay rng.drop_mask's) takes the tiled kernels.
FAST_PATH = False sends every call to the tiles (tests and the benchmark compare the two).
"""

import functools
import math
from typing import Optional

import torch
from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary

from npu_compile.ops import rng
from npu_compile.ops.common import acc_dtype, no_grad_placeholder
from npu_compile.ops.layout import LAYOUTS, layout_shape, to_bnsd


# Query rows per tile: big enough that each tile is a few large matmuls, small enough that the tile × Sk
# working set stays a small fraction of Sq × Sk at training sequence lengths.
QUERY_TILE = 256

# Whether calls whose semantics torch's fused attention kernels reproduce exactly use them (module docstring).
FAST_PATH = True

# fp32/fp64 only: for bf16/fp16 the CPU kernel rounds the probabilities to the input dtype before P·V and its
# backward takes rowsum(dO ∘ O) from the rounded O, beyond the one rounding these kernels hold to.
_FAST_DTYPES = (torch.float32, torch.float64)


def resolve_scale(scale: Optional[float], head_dim) -> float:
    return 1.0 / math.sqrt(head_dim) if scale is None else scale


def _check(query, key, value, attn_mask, attn_bias, layout, dropout_p):
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if not (query.dim() == key.dim() == value.dim() == 4):
        raise ValueError("query, key and value must be 4-D")
    if not (query.dtype == key.dtype == value.dtype):
        raise ValueError(f"query, key, value dtypes differ: {query.dtype}, {key.dtype}, {value.dtype}")
    b, nq, _, d = to_bnsd(query, layout).shape
    kb, nkv, sk, kd = to_bnsd(key, layout).shape
    vb, vn, vs, _ = to_bnsd(value, layout).shape
    if (kb, vb) != (b, b) or kd != d or (vn, vs) != (nkv, sk):
        raise ValueError(
            f"shapes do not fit ({layout}): query {tuple(query.shape)}, key {tuple(key.shape)}, "
            f"value {tuple(value.shape)}")
    if nq % nkv != 0:
        raise ValueError(f"query heads ({nq}) must be a multiple of key/value heads ({nkv})")
    if attn_mask is not None and (attn_mask.dtype != torch.bool or attn_mask.dim() > 4):
        raise ValueError(f"attn_mask must be bool with at most 4 dims, got {attn_mask.dtype} {attn_mask.dim()}-D")
    if attn_bias is not None and (not attn_bias.is_floating_point() or attn_bias.dim() > 4):
        raise ValueError("attn_bias must be floating point with at most 4 dims")
    rng.check_p(dropout_p)


def _check_backward(grad_out, query, key, value, out, softmax_max, softmax_sum, attn_mask, attn_bias, layout,
                    dropout_p, bias_grad):
    _check(query, key, value, attn_mask, attn_bias, layout, dropout_p)
    b, nq, sq, _ = to_bnsd(query, layout).shape
    out_shape = layout_shape(layout, b, nq, sq, value.shape[-1])
    if tuple(grad_out.shape) != out_shape or tuple(out.shape) != out_shape:
        raise ValueError(f"grad_out {tuple(grad_out.shape)} and out {tuple(out.shape)} must be {out_shape}")
    if tuple(softmax_max.shape) != (b, nq, sq) or tuple(softmax_sum.shape) != (b, nq, sq):
        raise ValueError(f"softmax_max {tuple(softmax_max.shape)} and softmax_sum {tuple(softmax_sum.shape)} must "
                         f"be {(b, nq, sq)}")
    if bias_grad and attn_bias is None:
        raise ValueError("bias_grad=True needs attn_bias")


def _reciprocal_or_zero(row_sum: Tensor) -> Tensor:
    """1/sum, and 0 for a row with no visible key (sum 0), whose probabilities are then 0, not NaN."""
    return torch.where(row_sum > 0, row_sum.reciprocal(), 0.0)


def _as_4d(t: Optional[Tensor]) -> Optional[Tensor]:
    return None if t is None else t.reshape((1,) * (4 - t.dim()) + tuple(t.shape))


def _rows(t4: Optional[Tensor], start: int, stop: int) -> Optional[Tensor]:
    """The query rows [start, stop) of a mask or bias broadcast over [b, n, sq, sk]."""
    if t4 is None or t4.shape[2] == 1:
        return t4
    return t4[:, :, start:stop]


class _Problem:
    """One call's tensors in [b, n, s, d] form and what the tiles share."""

    def __init__(self, query, key, value, attn_mask, attn_bias, layout, scale, causal, fill):
        self.q = to_bnsd(query, layout)
        self.q_in, self.k_in, self.v_in = self.q, to_bnsd(key, layout), to_bnsd(value, layout)
        self.acc = acc_dtype(query.dtype)
        self.b, self.nq, self.sq, self.d = self.q.shape
        self.nkv, self.sk = self.k_in.shape[1], self.k_in.shape[2]
        self.group = self.nq // self.nkv
        self.mask4 = _as_4d(attn_mask)
        self.bias4 = _as_4d(attn_bias)
        self.scale = resolve_scale(scale, self.d)
        self.causal = causal
        self.fill = fill

    # k and v are read by every tile: convert them once (O(S·D), not O(S²)); the fast path never does.
    @functools.cached_property
    def k(self) -> Tensor:
        return self.k_in.to(self.acc)

    @functools.cached_property
    def v(self) -> Tensor:
        return self.v_in.to(self.acc)

    def tiles(self):
        for index, start in enumerate(range(0, self.sq, QUERY_TILE)):
            yield index, start, min(start + QUERY_TILE, self.sq)

    def grouped(self, t: Tensor) -> Tensor:
        """[b, nq, rows, x] -> [b, nkv, group·rows, x]: the query heads that share a kv head become rows of
        one matmul, so k and v are never repeated per query head."""
        return t.reshape(self.b, self.nkv, -1, t.shape[-1])

    def ungrouped(self, t: Tensor, rows: int) -> Tensor:
        return t.view(self.b, self.nq, rows, t.shape[-1])

    def scores(self, start: int, stop: int):
        """Masked, scaled scores of query rows [start, stop) in the accumulation dtype, the grouped query
        tile, and the bool mask of removed/filled positions (None when nothing is masked)."""
        rows = stop - start
        q_tile = self.grouped(self.q[:, :, start:stop].to(self.acc))
        s = self.ungrouped(torch.matmul(q_tile, self.k.transpose(-1, -2)), rows)
        s.mul_(self.scale)
        bias = _rows(self.bias4, start, stop)
        if bias is not None:
            s.add_(bias.to(self.acc))
        masked = _rows(self.mask4, start, stop)
        if self.causal:
            query_pos = torch.arange(start, stop, device=s.device).unsqueeze(-1)
            future = torch.arange(self.sk, device=s.device) > query_pos
            masked = future if masked is None else masked | future
        if masked is not None:
            s.masked_fill_(masked, -math.inf if self.fill is None else self.fill)
        return s, q_tile, masked


# ---- fast path: torch's fused attention kernels --------------------------------------------------------

def _fast_eligible(query: Tensor, value_head_dim: int, dropout_p: float) -> bool:
    """What decides the fast path before looking at the mask's values (module docstring)."""
    b, nq, sq, d = query.shape if query.dim() == 4 else (0, 0, 0, 0)
    return (FAST_PATH and dropout_p == 0.0 and query.device.type == "cpu" and query.dtype in _FAST_DTYPES
            and d == value_head_dim and query.numel() > 0)


class _FastMask:
    """attn_mask, attn_bias and causal as the flash kernel takes them: one additive float mask (None when
    there is no tensor to add) plus is_causal, and the [b?, n?, sq] rows that no key is visible to."""

    def __init__(self, pb: "_Problem"):
        self.causal = pb.causal
        mask_dtype = pb.q.dtype
        add = None if pb.bias4 is None else pb.bias4.to(mask_dtype)
        mask4 = pb.mask4
        if mask4 is not None and _is_causal_mask(mask4, pb.sq, pb.sk):
            # Megatron passes its causal mask as a tensor: as is_causal the kernel skips the blocks above the
            # diagonal (the same result, bitwise) and no Sq×Sk float mask is built.
            self.causal, mask4 = True, None
        if mask4 is not None:
            add = torch.where(mask4, -math.inf, torch.zeros((), dtype=mask_dtype) if add is None else add)
        self.add = add
        self.dead = None
        if add is not None:
            removed = add == -math.inf
            if not self.causal:
                dead = removed.all(dim=-1)
            else:
                # Causal: row i sees keys 0..min(i, sk-1); it is dead iff none of those is left visible.
                seen = (~removed).cumsum(dim=-1, dtype=torch.int32)
                last = torch.arange(pb.sq, device=add.device).clamp_(max=pb.sk - 1)
                if seen.shape[2] == 1:
                    dead = seen[:, :, 0, last] == 0
                else:
                    dead = seen.gather(-1, last.view(1, 1, -1, 1).expand(*seen.shape[:2], -1, 1)).squeeze(-1) == 0
            self.dead = dead  # [mb, mn, sq or 1], broadcasts over [b, nq, sq]


def _is_causal_mask(mask4: Tensor, sq: int, sk: int) -> bool:
    """Whether a bool [b?, n?, sq, sk] mask hides exactly what is_causal hides (key j from query i iff j > i,
    top-left), in every batch and head. Decided once per distinct mask (:func:`_causal_memo`): Megatron passes one
    mask tensor to every layer at every step, and building the Sq×Sk pattern to compare it with at each call
    costs about 2 % of a sequence-128 step. The pattern itself is never kept: a call under a fake mode (the
    memory planner runs kernels so) would leave a fake tensor behind."""
    if tuple(mask4.shape[2:]) != (sq, sk):
        return False
    key = _causal_memo_key(mask4)
    if key is not None:
        root, state = key
        hit = _CAUSAL_MEMO.get(root)
        if hit is not None and hit[0] == state:
            return hit[1]
    pattern = torch.ones(sq, sk, dtype=torch.bool, device=mask4.device).triu_(1)
    causal = torch.equal(mask4, pattern.expand(mask4.shape))
    if key is not None:
        _CAUSAL_MEMO[root] = (state, causal)
    return causal


# The storage a mask views (its base tensor, weakly held: an entry dies with the mask) -> (everything that shapes
# the mask's values as this call reads them, the answer).
_CAUSAL_MEMO = WeakIdKeyDictionary()


def _causal_memo_key(mask4: Tensor):
    """(the tensor to key the memo by, the state the answer holds for), or None where no answer may be kept.

    The state is the version counter, which every in-place write bumps (views share their base's), and the
    view's geometry: data_ptr (storage and offset), shape, stride, dtype, device. A mask changed in place is
    therefore checked again, so is the same storage read through another view. Writes that bypass the version
    counter (through ``.data``, or by other processes) are not seen, as autograd does not see them either. Only
    plain tensors with a version counter are kept: fake and meta tensors (the memory planner's) and inference-mode
    tensors are checked every call."""
    root = mask4 if mask4._base is None else mask4._base
    if type(root) is not Tensor or type(mask4) is not Tensor or mask4.is_meta or mask4.is_inference():
        return None
    state = (mask4._version, mask4.data_ptr(), tuple(mask4.shape), mask4.stride(), mask4.dtype, mask4.device)
    return root, state


def _fast_mask(pb: "_Problem") -> Optional[_FastMask]:
    """The kernel's mask, or None where the call must take the tiles (a filled row with no visible key)."""
    fm = _FastMask(pb)
    if pb.fill is not None and fm.dead is not None and bool(fm.dead.any()):
        return None
    return fm


def _fast_inputs(pb: "_Problem"):
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (pb.q_in, pb.k_in, pb.v_in))
    return q, k, v


def _fast_forward(pb: "_Problem", fm: _FastMask, query: Tensor, layout: str):
    q, k, v = _fast_inputs(pb)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, fm.causal, attn_mask=fm.add, scale=pb.scale)
    lse = lse.to(pb.acc)
    softmax_sum = torch.ones_like(lse)
    if fm.dead is not None:
        out = out.masked_fill(fm.dead.unsqueeze(-1), 0.0)
        lse = lse.masked_fill(fm.dead, 0.0)
        softmax_sum.masked_fill_(fm.dead, 0.0)
    result = query.new_empty(layout_shape(layout, pb.b, pb.nq, pb.sq, pb.d))
    to_bnsd(result, layout).copy_(out)
    return result, lse, softmax_sum


def _fast_backward(pb: "_Problem", fm: _FastMask, grad_out, query, key, value, out, softmax_max, softmax_sum,
                   layout: str):
    q, k, v = _fast_inputs(pb)
    acc = pb.acc
    row_sum = softmax_sum.to(acc)
    lse = torch.where(row_sum > 0, softmax_max.to(acc) + row_sum.log(), 0.0)
    grad_q, grad_k, grad_v = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        to_bnsd(grad_out, layout), q, k, v, to_bnsd(out, layout), lse, 0.0, fm.causal, attn_mask=fm.add,
        scale=pb.scale)
    results = []
    for grad, like in ((grad_q, query), (grad_k, key), (grad_v, value)):
        r = like.new_empty(like.shape)
        to_bnsd(r, layout).copy_(grad)
        results.append(r)
    return results


@torch.library.custom_op("npu_compile::fused_attention", mutates_args=())
def fused_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Optional[Tensor] = None,
    attn_bias: Optional[Tensor] = None,
    seed: Optional[Tensor] = None,
    *,
    layout: str = "bnsd",
    scale: Optional[float] = None,
    dropout_p: float = 0.0,
    causal: bool = False,
    fill: Optional[float] = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Returns (out in `layout`, contiguous; softmax_max, softmax_sum: [b, nq, sq] in fp32)."""
    _check(query, key, value, attn_mask, attn_bias, layout, dropout_p)
    pb = _Problem(query, key, value, attn_mask, attn_bias, layout, scale, causal, fill)
    seed_int = rng.seed_value(seed, dropout_p)
    if _fast_eligible(pb.q, value.shape[-1], dropout_p):
        fm = _fast_mask(pb)
        if fm is not None:
            return _fast_forward(pb, fm, query, layout)
    dv = pb.v.shape[-1]
    out = query.new_empty(layout_shape(layout, pb.b, pb.nq, pb.sq, dv))
    out_bnsd = to_bnsd(out, layout)
    softmax_max = query.new_empty((pb.b, pb.nq, pb.sq), dtype=pb.acc)
    softmax_sum = torch.empty_like(softmax_max)
    for index, start, stop in pb.tiles():
        s, _, _ = pb.scores(start, stop)
        # Softmax in place in the score tile, so the tile is the only Sk-wide buffer alive.
        row_max = s.amax(dim=-1, keepdim=True)
        row_max.masked_fill_(row_max == -math.inf, 0.0)
        probs = s.sub_(row_max).exp_()
        row_sum = probs.sum(dim=-1, keepdim=True)
        probs.mul_(_reciprocal_or_zero(row_sum))
        if dropout_p > 0.0:
            probs.masked_fill_(rng.drop_mask(seed_int, index, tuple(probs.shape), dropout_p, probs.device), 0.0)
            probs.mul_(rng.keep_scale(dropout_p))
        out_bnsd[:, :, start:stop] = pb.ungrouped(torch.matmul(pb.grouped(probs), pb.v), stop - start)
        softmax_max[:, :, start:stop] = row_max.squeeze(-1)
        softmax_sum[:, :, start:stop] = row_sum.squeeze(-1)
        # Free this tile before the next one is allocated.
        del s, probs
    return out, softmax_max, softmax_sum


@fused_attention.register_fake
def _(query, key, value, attn_mask=None, attn_bias=None, seed=None, *, layout="bnsd", scale=None,
      dropout_p=0.0, causal=False, fill=None):
    _check(query, key, value, attn_mask, attn_bias, layout, dropout_p)
    b, nq, sq, _ = to_bnsd(query, layout).shape
    dv = value.shape[-1]
    out = query.new_empty(layout_shape(layout, b, nq, sq, dv))
    stats = (b, nq, sq)
    acc = acc_dtype(query.dtype)
    return out, query.new_empty(stats, dtype=acc), query.new_empty(stats, dtype=acc)


@torch.library.custom_op("npu_compile::fused_attention_backward", mutates_args=())
def fused_attention_backward(
    grad_out: Tensor,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    out: Tensor,
    softmax_max: Tensor,
    softmax_sum: Tensor,
    attn_mask: Optional[Tensor] = None,
    attn_bias: Optional[Tensor] = None,
    seed: Optional[Tensor] = None,
    *,
    layout: str = "bnsd",
    scale: Optional[float] = None,
    dropout_p: float = 0.0,
    causal: bool = False,
    fill: Optional[float] = None,
    bias_grad: bool = False,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Returns (grad_query, grad_key, grad_value, grad_bias), each contiguous in its input's layout/shape;
    grad_bias is an empty [0] tensor unless bias_grad.

    `out` is npu_fusion_attention_grad's attention_in; this kernel checks its shape only and takes the
    softmax row sums from the fp32 tile (see below). Saving it costs nothing extra in a transformer: it is
    the input of the output projection, which saves it anyway."""
    _check_backward(grad_out, query, key, value, out, softmax_max, softmax_sum, attn_mask, attn_bias, layout,
                    dropout_p, bias_grad)
    pb = _Problem(query, key, value, attn_mask, attn_bias, layout, scale, causal, fill)
    seed_int = rng.seed_value(seed, dropout_p)
    if not bias_grad and _fast_eligible(pb.q, value.shape[-1], dropout_p):
        fm = _fast_mask(pb)
        if fm is not None:
            grad_q, grad_key, grad_value = _fast_backward(pb, fm, grad_out, query, key, value, out, softmax_max,
                                                          softmax_sum, layout)
            return grad_q, grad_key, grad_value, no_grad_placeholder(query)
    grad_out_bnsd = to_bnsd(grad_out, layout)
    grad_q = query.new_empty(query.shape)
    grad_q_bnsd = to_bnsd(grad_q, layout)
    grad_k = torch.zeros_like(pb.k)
    grad_v = torch.zeros_like(pb.v)
    grad_bias4 = None
    if bias_grad:
        grad_bias4 = torch.zeros(pb.bias4.shape, dtype=pb.acc, device=query.device)
    for index, start, stop in pb.tiles():
        rows = stop - start
        s, q_tile, masked = pb.scores(start, stop)
        probs = s.sub_(softmax_max[:, :, start:stop].unsqueeze(-1)).exp_()
        probs.mul_(_reciprocal_or_zero(softmax_sum[:, :, start:stop].unsqueeze(-1)))
        d_out = pb.grouped(grad_out_bnsd[:, :, start:stop].to(pb.acc))
        # dV first, so that the dropped probabilities are freed before dP is allocated (peak: 2 tiles).
        if dropout_p > 0.0:
            drop = rng.drop_mask(seed_int, index, tuple(probs.shape), dropout_p, probs.device)
            dropped = probs.masked_fill(drop, 0.0)
            dropped.mul_(rng.keep_scale(dropout_p))
            grad_v += pb.grouped(dropped).transpose(-1, -2) @ d_out
            del dropped
        else:
            grad_v += pb.grouped(probs).transpose(-1, -2) @ d_out
        d_probs = pb.ungrouped(torch.matmul(d_out, pb.v.transpose(-1, -2)), rows)
        if dropout_p > 0.0:
            d_probs.masked_fill_(drop, 0.0).mul_(rng.keep_scale(dropout_p))
            del drop
        # Softmax backward: dS = P ∘ (dP − rowsum(dP ∘ P)). Flash kernels take the row sums as rowsum(dO ∘ O),
        # equal in exact arithmetic (dropout included), but O is stored rounded to bf16 and the difference is
        # amplified by 1/(1-p); the fp32 tile is at hand here, so use it (einsum: no tile-sized temporary).
        delta = torch.einsum("...k,...k->...", d_probs, probs).unsqueeze(-1)
        d_scores = d_probs.sub_(delta).mul_(probs)
        del probs, s
        if masked is not None:
            # Filled or removed scores do not depend on q, k or the bias.
            d_scores.masked_fill_(masked, 0.0)
        if grad_bias4 is not None:
            if grad_bias4.shape[2] == 1:
                grad_bias4 += d_scores.sum_to_size(grad_bias4.shape)
            else:
                b_, n_, _, k_ = grad_bias4.shape
                grad_bias4[:, :, start:stop] = d_scores.sum_to_size((b_, n_, rows, k_))
        d_scores_grouped = pb.grouped(d_scores)
        grad_q_bnsd[:, :, start:stop] = pb.ungrouped(torch.matmul(d_scores_grouped, pb.k), rows) * pb.scale
        grad_k += (d_scores_grouped.transpose(-1, -2) @ q_tile) * pb.scale
        del d_probs, d_scores, d_scores_grouped, masked
    grad_key = key.new_empty(key.shape)
    to_bnsd(grad_key, layout).copy_(grad_k)
    grad_value = value.new_empty(value.shape)
    to_bnsd(grad_value, layout).copy_(grad_v)
    if grad_bias4 is None:
        grad_bias = no_grad_placeholder(query)
    else:
        grad_bias = grad_bias4.to(attn_bias.dtype).reshape(attn_bias.shape)
    return grad_q, grad_key, grad_value, grad_bias


@fused_attention_backward.register_fake
def _(grad_out, query, key, value, out, softmax_max, softmax_sum, attn_mask=None, attn_bias=None, seed=None, *,
      layout="bnsd", scale=None, dropout_p=0.0, causal=False, fill=None, bias_grad=False):
    _check_backward(grad_out, query, key, value, out, softmax_max, softmax_sum, attn_mask, attn_bias, layout,
                    dropout_p, bias_grad)
    grad_bias = attn_bias.new_empty(attn_bias.shape) if bias_grad else no_grad_placeholder(query)
    return query.new_empty(query.shape), key.new_empty(key.shape), value.new_empty(value.shape), grad_bias


def _setup_context(ctx, inputs, keyword_only_inputs, output):
    query, key, value, attn_mask, attn_bias, seed = inputs
    out, softmax_max, softmax_sum = output
    ctx.save_for_backward(query, key, value, out, softmax_max, softmax_sum, attn_mask, attn_bias, seed)
    ctx.options = dict(keyword_only_inputs)
    ctx.mark_non_differentiable(softmax_max, softmax_sum)


def _backward(ctx, grad_out, _grad_max, _grad_sum):
    query, key, value, out, softmax_max, softmax_sum, attn_mask, attn_bias, seed = ctx.saved_tensors
    bias_grad = attn_bias is not None and ctx.needs_input_grad[4]
    grad_q, grad_k, grad_v, grad_bias = torch.ops.npu_compile.fused_attention_backward(
        grad_out, query, key, value, out, softmax_max, softmax_sum, attn_mask, attn_bias, seed, **ctx.options,
        bias_grad=bias_grad)
    return grad_q, grad_k, grad_v, None, grad_bias if bias_grad else None, None


fused_attention.register_autograd(_backward, setup_context=_setup_context)


def attention_dropout_keep_mask(seed: Tensor, dropout_p: float, batch: int, heads: int, seq_q: int, seq_k: int,
                                device: torch.device | str = "cpu") -> Tensor:
    """The [b, nq, sq, sk] keep mask (True = kept) fused_attention uses for this seed, p and shape: for
    comparing against eager attention with the same dropout, never for the op itself (it is S×S)."""
    seed_int = rng.seed_value(seed, dropout_p)
    tiles = [
        rng.drop_mask(seed_int, index, (batch, heads, min(start + QUERY_TILE, seq_q) - start, seq_k),
                      dropout_p, torch.device(device))
        for index, start in enumerate(range(0, seq_q, QUERY_TILE))
    ]
    return ~torch.cat(tiles, dim=2)
