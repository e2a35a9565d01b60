"""npu_fusion_attention and npu_fusion_attention_grad (and their graph-mode versions, ``_v3``) on the CPU, from
their documented semantics.

Where the documentation is silent, the choice made here:
- a row with no visible key (fully masked) gives out = 0, softmax_max = softmax_sum = 0 and zero gradients,
  what inner_precise=2 ("invalid-row computation") is for on the device.
- Dropout bits: the device draws its mask with Philox from (seed, offset); here a torch.Generator seeded from
  the pair stands in. Only the contract is emulated: forward and grad given the same (seed, offset, numels)
  drop the same elements. numels = B·N·Sq·Skv (inferred from the kernel's mask length).
- ``npu_fusion_attention_v3`` takes no seed: it returns the Philox (seed, offset) the device drew, as tensors
  (torch_npu/_op_plugin_docs.py, npu_fusion_attention_v3, outputs 5 and 6; their shape is not documented: here
  int64 [1]). The emulated device draws the seed from torch's default generator, offset 0, and only when
  keep_prob < 1 (no dropout draws nothing, so the global random stream is left alone); with keep_prob 1 both
  are 0. ``npu_fusion_attention_grad_v3`` given those tensors drops what the forward dropped: the same mask as
  npu_fusion_attention / _grad for that (seed, offset).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from npu_compile.lowering.npu_sim.common import ACC, check, check_float, unsupported


_LAYOUTS = ("BSH", "SBH", "BSND", "BNSD")
# The compressed mask of sparse modes 2 and 3: the kernel reads the causal structure from a fixed 2048×2048
# upper-triangular (True = masked) tile, whatever the sequence lengths.
COMPRESSED_MASK_SIZE = 2048
_MAX_HEAD_DIM, _MAX_HEADS, _MAX_SEQ = 768, 256, 1 << 20


class _Attention:
    """One call's problem in [B, N, S, D] fp32 form, with the visible-position mask."""

    def __init__(self, query, key, value, head_num, input_layout, pse, padding_mask, atten_mask, scale,
                 keep_prob, pre_tockens, next_tockens, prefix, actual_seq_qlen, actual_seq_kvlen, sparse_mode,
                 sink):
        unsupported(input_layout in _LAYOUTS, f"input_layout {input_layout!r} (emulated: {_LAYOUTS})")
        unsupported(padding_mask is None, "padding_mask (the device does not support it either)")
        unsupported(prefix is None and actual_seq_qlen is None and actual_seq_kvlen is None,
                     "prefix / varlen sequence lists")
        unsupported(sink is None, "sink")
        check_float(query=query, key=key, value=value)
        check(query.dtype == key.dtype == value.dtype, "query, key and value must share a dtype")
        check(0.0 < keep_prob <= 1.0, f"keep_prob must lie in (0, 1], got {keep_prob}")
        self.layout = input_layout
        self.dtype = query.dtype
        if input_layout in ("BSH", "SBH"):
            check(query.dim() == key.dim() == value.dim() == 3, f"{input_layout} takes 3-D query, key, value")
            check(query.shape[-1] % head_num == 0, f"hidden {query.shape[-1]} is not a multiple of head_num")
            d = query.shape[-1] // head_num
            check(key.shape[-1] % d == 0, f"key hidden {key.shape[-1]} is not a multiple of the head dim {d}")
            nkv = key.shape[-1] // d
            check(value.shape[-1] % nkv == 0, f"value hidden {value.shape[-1]} does not split into {nkv} heads")
            heads = (head_num, nkv, nkv)
        else:
            check(query.dim() == key.dim() == value.dim() == 4, f"{input_layout} takes 4-D query, key, value")
            heads = (None, None, None)
        self.q, self.k, self.v = (self.to_bnsd(t, n) for t, n in zip((query, key, value), heads))
        self.b, self.n, self.sq, self.d = self.q.shape
        _, self.nkv, self.sk, dk = self.k.shape
        self.dv = self.v.shape[-1]
        check(self.n == head_num, f"query has {self.n} heads, head_num is {head_num}")
        check(dk == self.d and self.dv <= self.d <= _MAX_HEAD_DIM,
               f"head dims must satisfy Dq = Dk >= Dv, D <= {_MAX_HEAD_DIM}: got {self.d}, {dk}, {self.dv}")
        check(self.k.shape[:3] == self.v.shape[:3], "key and value must have the same batch, heads and length")
        check(self.n <= _MAX_HEADS and self.n % self.nkv == 0,
               f"Nq must be at most {_MAX_HEADS} and a multiple of Nkv: got {self.n}, {self.nkv}")
        check(self.sq <= _MAX_SEQ and self.sk <= _MAX_SEQ, "sequence lengths must be at most 1M")
        self.group = self.n // self.nkv
        self.scale = scale
        self.keep_prob = keep_prob
        self.pse = None if pse is None else self._pse(pse)
        self.visible = self._visible(atten_mask, pre_tockens, next_tockens, sparse_mode)

    def to_bnsd(self, t: Tensor, heads: Optional[int]) -> Tensor:
        t = t.to(ACC)
        if self.layout == "BNSD":
            return t
        if self.layout == "BSND":
            return t.transpose(1, 2)
        if self.layout == "BSH":
            b, s, h = t.shape
            return t.reshape(b, s, heads, h // heads).transpose(1, 2)
        s, b, h = t.shape
        return t.reshape(s, b, heads, h // heads).permute(1, 2, 0, 3)

    def from_bnsd(self, t: Tensor) -> Tensor:
        """A [B, N, S, D] result, contiguous in the call's layout and dtype."""
        b, n, s, d = t.shape
        if self.layout == "BSND":
            t = t.transpose(1, 2)
        elif self.layout == "BSH":
            t = t.transpose(1, 2).reshape(b, s, n * d)
        elif self.layout == "SBH":
            t = t.permute(2, 0, 1, 3).reshape(s, b, n * d)
        return t.to(self.dtype).contiguous()

    def _pse(self, pse: Tensor) -> Tensor:
        check(pse.dtype == self.dtype, f"pse must have the query's dtype {self.dtype}, got {pse.dtype}")
        forms = {(self.b, self.n, self.sq, self.sk): "BNSS", (self.b, self.n, 1, self.sk): "BN1S",
                 (1, self.n, self.sq, self.sk): "1NSS"}
        check(pse.dim() == 4 and tuple(pse.shape) in forms,
               f"pse {tuple(pse.shape)} must be BNSS, BN1Skv or 1NSS for {(self.b, self.n, self.sq, self.sk)}")
        return pse.to(ACC)

    def _visible(self, mask, pre, nxt, sparse_mode) -> Optional[Tensor]:
        """Bool, broadcastable to [B, N, Sq, Skv]: True where a key takes part. None: everything does."""
        if mask is None:  # the documented rule: no mask means full attention, sparse_mode and tokens ignored
            return None
        check(mask.dtype in (torch.bool, torch.uint8), f"atten_mask must be bool or uint8, got {mask.dtype}")
        i = torch.arange(self.sq).unsqueeze(-1)
        j = torch.arange(self.sk)
        if sparse_mode in (2, 3):
            size = COMPRESSED_MASK_SIZE
            check(tuple(mask.shape) == (size, size) and torch.equal(
                mask.bool(), torch.ones(size, size, dtype=torch.bool).triu(1)),
                f"sparse_mode {sparse_mode} takes the compressed {size}x{size} upper-triangular mask")
            return j <= i if sparse_mode == 2 else j <= i + (self.sk - self.sq)
        unsupported(sparse_mode in (0, 1), f"sparse_mode {sparse_mode} (emulated: 0, 1, 2, 3)")
        forms = [(self.sq, self.sk), (1, 1, self.sq, self.sk), (self.b, 1, self.sq, self.sk),
                 (self.b, self.n, self.sq, self.sk)]
        check(tuple(mask.shape) in forms, f"atten_mask {tuple(mask.shape)} must be SS, 11SS, B1SS or BNSS: {forms}")
        keep = ~mask.bool()
        if sparse_mode == 0:  # the band i - pre <= j <= i + next, and the mask
            keep = keep & (j >= i - pre) & (j <= i + nxt)
        return keep

    def kv_heads(self, t: Tensor) -> Tensor:
        """[B, Nkv, S, D] -> [B, Nq, S, D]: query head h reads kv head h // (Nq / Nkv)."""
        return t.repeat_interleave(self.group, dim=1)

    def per_kv_head(self, t: Tensor) -> Tensor:
        """[B, Nq, S, D] -> [B, Nkv, S, D]: the gradients of the query heads sharing a kv head, summed."""
        return t.unflatten(1, (self.nkv, self.group)).sum(2)

    def scores(self) -> Tensor:
        """S = scale · (Q Kᵀ + pse), with removed positions at -inf."""
        s = self.q @ self.kv_heads(self.k).transpose(-1, -2)
        if self.pse is not None:
            s = s + self.pse
        s = s * self.scale
        if self.visible is not None:
            s = s.masked_fill(~self.visible, -math.inf)
        return s

    def keep_mask(self, seed: int, offset: int) -> Optional[Tensor]:
        """The dropout keep mask [B, N, Sq, Skv] for (seed, offset); None when nothing is dropped."""
        if self.keep_prob == 1.0:
            return None
        return dropout_keep_mask(seed, offset, (self.b, self.n, self.sq, self.sk), self.keep_prob)

    @property
    def numels(self) -> int:
        return self.b * self.n * self.sq * self.sk


def dropout_keep_mask(seed: int, offset: int, shape: tuple[int, ...], keep_prob: float) -> Tensor:
    """npu-sim's stand-in for the device's Philox stream: True = kept, P(kept) = keep_prob."""
    generator = torch.Generator().manual_seed((seed * 0x9E3779B97F4A7C15 + offset) % (1 << 63))
    return torch.rand(shape, generator=generator) < keep_prob


def _stat(rows: Tensor) -> Tensor:
    """A [B, N, Sq] statistic as the device stores it: fp32 [B, N, Sq, 8], the value repeated."""
    return rows.unsqueeze(-1).expand(*rows.shape, 8).contiguous()


def npu_fusion_attention(query, key, value, head_num, input_layout, pse=None, padding_mask=None, atten_mask=None,
                         scale=1.0, keep_prob=1.0, pre_tockens=2147483647, next_tockens=2147483647, inner_precise=0,
                         prefix=None, actual_seq_qlen=None, actual_seq_kvlen=None, sparse_mode=0,
                         gen_mask_parallel=True, sync=False, softmax_layout="", sink=None, dropout_mask=None,
                         seed=0, offset=0):
    unsupported(dropout_mask is None, "an explicit dropout_mask")
    if input_layout == "TND":
        return _tnd_forward(query, key, value, head_num, pse, padding_mask, atten_mask, scale, keep_prob,
                            inner_precise, prefix, actual_seq_qlen, actual_seq_kvlen, sparse_mode, softmax_layout,
                            sink, seed, offset)
    a = _Attention(query, key, value, head_num, input_layout, pse, padding_mask, atten_mask, scale, keep_prob,
                   pre_tockens, next_tockens, prefix, actual_seq_qlen, actual_seq_kvlen, sparse_mode, sink)
    s = a.scores()
    row_max = s.amax(-1, keepdim=True)
    row_max = torch.where(torch.isinf(row_max), 0.0, row_max)  # a fully masked row: nothing visible
    e = torch.exp(s - row_max)
    row_sum = e.sum(-1, keepdim=True)
    p = torch.where(row_sum > 0, e / row_sum, 0.0)
    keep = a.keep_mask(seed, offset)
    if keep is not None:
        p = p * keep / keep_prob
    out = p @ a.kv_heads(a.v)
    softmax_out = query.new_empty((0,))
    return (a.from_bnsd(out), _stat(row_max.squeeze(-1)), _stat(row_sum.squeeze(-1)), softmax_out,
            seed, offset, a.numels)


def npu_fusion_attention_grad(query, key, value, dy, head_num, input_layout, *, pse=None, padding_mask=None,
                              atten_mask=None, softmax_max=None, softmax_sum=None, softmax_in=None,
                              attention_in=None, scale_value=1.0, keep_prob=1.0, pre_tockens=2147483647,
                              next_tockens=2147483647, inner_precise=0, seed=0, offset=0, numels=0, prefix=None,
                              actual_seq_qlen=None, actual_seq_kvlen=None, sparse_mode=0, gen_mask_parallel=True,
                              sync=False, softmax_layout="", sink=None):
    """The flash backward from the forward's statistics: P = exp(S − max) / sum, D = rowsum(dO ∘ O)."""
    unsupported(softmax_max is not None and softmax_sum is not None and attention_in is not None,
                 "a grad call without softmax_max, softmax_sum and attention_in (torch_npu's autograd passes all)")
    if input_layout == "TND":
        return _tnd_grad(query, key, value, dy, head_num, pse, padding_mask, atten_mask, softmax_max, softmax_sum,
                         attention_in, scale_value, keep_prob, inner_precise, prefix, actual_seq_qlen,
                         actual_seq_kvlen, sparse_mode, softmax_layout, sink)
    a = _Attention(query, key, value, head_num, input_layout, pse, padding_mask, atten_mask, scale_value,
                   keep_prob, pre_tockens, next_tockens, prefix, actual_seq_qlen, actual_seq_kvlen, sparse_mode,
                   sink)
    stat_shape = (a.b, a.n, a.sq, 8)
    check(tuple(softmax_max.shape) == stat_shape == tuple(softmax_sum.shape),
           f"softmax_max/softmax_sum must be {stat_shape}, got {tuple(softmax_max.shape)}, "
           f"{tuple(softmax_sum.shape)}")
    if keep_prob < 1.0:
        check(numels == a.numels, f"numels must be the forward's B·N·Sq·Skv = {a.numels}, got {numels}")
    row_max = softmax_max[..., :1].to(ACC)
    row_sum = softmax_sum[..., :1].to(ACC)
    s = a.scores()
    p = torch.exp(s - row_max) / row_sum
    if a.visible is not None:
        p = torch.where(a.visible, p, 0.0)  # a fully masked row has sum 0: its 0/0 is never used
    grad_out = a.to_bnsd(dy, a.n)
    out = a.to_bnsd(attention_in, a.n)
    v = a.kv_heads(a.v)
    keep = a.keep_mask(seed, offset)
    dropped = p if keep is None else p * keep / keep_prob
    grad_v = a.per_kv_head(dropped.transpose(-1, -2) @ grad_out)
    grad_p = grad_out @ v.transpose(-1, -2)
    if keep is not None:
        grad_p = grad_p * keep / keep_prob
    delta = (grad_out * out).sum(-1, keepdim=True)
    grad_s = p * (grad_p - delta)
    grad_q = (grad_s @ a.kv_heads(a.k)) * a.scale
    grad_k = a.per_kv_head(grad_s.transpose(-1, -2) @ a.q) * a.scale
    if pse is None:
        grad_pse = query.new_empty((0,))
    else:
        grad_pse = (grad_s * a.scale).sum_to_size(pse.shape).to(pse.dtype).contiguous()
    return (a.from_bnsd(grad_q), a.from_bnsd(grad_k), a.from_bnsd(grad_v), grad_pse, query.new_empty((0,)))


def _attention_batch_heads_seq(query, head_num, input_layout) -> tuple[int, int, int]:
    if input_layout == "BNSD":
        return query.shape[0], head_num, query.shape[2]
    if input_layout == "SBH":
        return query.shape[1], head_num, query.shape[0]
    return query.shape[0], head_num, query.shape[1]  # BSH, BSND


def _value_out_shape(query, key, value, head_num, input_layout) -> tuple[int, ...]:
    """attention_out's shape: the query's layout with the value's head dim."""
    if input_layout in ("BSH", "SBH"):
        d = query.shape[-1] // head_num
        dv = value.shape[-1] // (key.shape[-1] // d)
        return (*query.shape[:2], head_num * dv)
    return (*query.shape[:3], value.shape[-1])


def _npu_fusion_attention_fake(query, key, value, head_num, input_layout, pse=None, padding_mask=None,
                               atten_mask=None, scale=1.0, keep_prob=1.0, pre_tockens=2147483647,
                               next_tockens=2147483647, inner_precise=0, prefix=None, actual_seq_qlen=None,
                               actual_seq_kvlen=None, sparse_mode=0, gen_mask_parallel=True, sync=False,
                               softmax_layout="", sink=None, dropout_mask=None, seed=0, offset=0):
    if input_layout == "TND":  # META (npu_fusion_attention_forward): out [T, N, Dv], statistics [T, N, 8]
        stat = query.new_empty((query.shape[0], head_num, 8), dtype=torch.float32)
        return (query.new_empty((*query.shape[:2], value.shape[-1])), stat, torch.empty_like(stat),
                query.new_empty((0,)), seed, offset, 0)
    unsupported(input_layout in _LAYOUTS, f"input_layout {input_layout!r} (emulated: {_LAYOUTS})")
    b, n, sq = _attention_batch_heads_seq(query, head_num, input_layout)
    sk = key.shape[2] if input_layout == "BNSD" else key.shape[0] if input_layout == "SBH" else key.shape[1]
    stat = query.new_empty((b, n, sq, 8), dtype=torch.float32)
    numels = b * n * sq * sk
    if isinstance(numels, torch.SymInt):
        # An int output cannot carry a symbolic size without a guard on it (which would fix the length);
        # torch_npu's own meta kernel returns 0 here at any size (op_plugin/meta/_meta_registrations.py,
        # npu_fusion_attention_forward). Lowering computes numels itself (npu.py, emit_attention_backward).
        numels = 0
    return (query.new_empty(_value_out_shape(query, key, value, head_num, input_layout)), stat,
            torch.empty_like(stat), query.new_empty((0,)), seed, offset, numels)


def _npu_fusion_attention_grad_fake(query, key, value, dy, head_num, input_layout, **kwargs):
    pse = kwargs.get("pse")
    grad_pse = query.new_empty((0,)) if pse is None else torch.empty_like(pse)
    return (torch.empty_like(query, memory_format=torch.contiguous_format),
            torch.empty_like(key, memory_format=torch.contiguous_format),
            torch.empty_like(value, memory_format=torch.contiguous_format), grad_pse, query.new_empty((0,)))


def _numels(query, key, head_num, input_layout) -> int:
    if input_layout == "TND":
        return 0  # no dropout in TND here (_tnd_documents)
    b, n, sq = _attention_batch_heads_seq(query, head_num, input_layout)
    sk = key.shape[2] if input_layout == "BNSD" else key.shape[0] if input_layout == "SBH" else key.shape[1]
    return b * n * sq * sk


def _philox_pair(tensor: Optional[Tensor], name: str) -> int:
    if tensor is None:
        return 0
    check(tensor.numel() == 1, f"{name} must hold one value, got shape {tuple(tensor.shape)}")
    return int(tensor.reshape(-1)[0])


def npu_fusion_attention_v3(query, key, value, head_num, input_layout, pse=None, padding_mask=None, atten_mask=None,
                            scale=1.0, keep_prob=1.0, pre_tockens=2147483647, next_tockens=2147483647,
                            inner_precise=0, prefix=None, actual_seq_qlen=None, actual_seq_kvlen=None,
                            sparse_mode=0, gen_mask_parallel=True, sync=False, softmax_layout="", sink=None):
    """npu_fusion_attention with the device's own dropout seed, returned as tensors (see the module doc)."""
    seed = int(torch.randint(0, 1 << 62, ())) if keep_prob < 1.0 else 0
    out, softmax_max, softmax_sum, softmax_out, *_ = npu_fusion_attention(
        query, key, value, head_num, input_layout, pse, padding_mask, atten_mask, scale, keep_prob, pre_tockens,
        next_tockens, inner_precise, prefix, actual_seq_qlen, actual_seq_kvlen, sparse_mode, gen_mask_parallel,
        sync, softmax_layout, sink, None, seed, 0)
    pair = (torch.tensor([seed], dtype=torch.int64), torch.tensor([0], dtype=torch.int64))
    return (out, softmax_max, softmax_sum, softmax_out, *pair)


def npu_fusion_attention_grad_v3(query, key, value, dy, head_num, input_layout, *, pse=None, padding_mask=None,
                                 atten_mask=None, softmax_max=None, softmax_sum=None, softmax_in=None,
                                 attention_in=None, scale_value=1.0, keep_prob=1.0, pre_tockens=2147483647,
                                 next_tockens=2147483647, inner_precise=0, seed=None, offset=None, prefix=None,
                                 actual_seq_qlen=None, actual_seq_kvlen=None, sparse_mode=0, gen_mask_parallel=True,
                                 sync=False, softmax_layout="", sink=None):
    """npu_fusion_attention_grad with the forward's (seed, offset) tensors; numels is implied by the shapes."""
    if keep_prob < 1.0:
        check(seed is not None and offset is not None,
              "keep_prob < 1 needs the seed and offset tensors npu_fusion_attention_v3 returned")
    return npu_fusion_attention_grad(
        query, key, value, dy, head_num, input_layout, pse=pse, padding_mask=padding_mask, atten_mask=atten_mask,
        softmax_max=softmax_max, softmax_sum=softmax_sum, softmax_in=softmax_in, attention_in=attention_in,
        scale_value=scale_value, keep_prob=keep_prob, pre_tockens=pre_tockens, next_tockens=next_tockens,
        inner_precise=inner_precise, seed=_philox_pair(seed, "seed"), offset=_philox_pair(offset, "offset"),
        numels=_numels(query, key, head_num, input_layout), prefix=prefix, actual_seq_qlen=actual_seq_qlen,
        actual_seq_kvlen=actual_seq_kvlen, sparse_mode=sparse_mode, gen_mask_parallel=gen_mask_parallel, sync=sync,
        softmax_layout=softmax_layout, sink=sink)


def _npu_fusion_attention_v3_fake(query, key, value, head_num, input_layout, *args, **kwargs):
    out, softmax_max, softmax_sum, softmax_out, *_ = _npu_fusion_attention_fake(
        query, key, value, head_num, input_layout)
    pair = (query.new_empty((1,), dtype=torch.int64), query.new_empty((1,), dtype=torch.int64))
    return (out, softmax_max, softmax_sum, softmax_out, *pair)


# ---- TND: variable-length documents -------------------------------------------------------------------------
# query/key/value [T, N, D]; actual_seq_qlen / actual_seq_kvlen the documents' cumulative ends (a list, or for
# the _v3 pair an int64 tensor): "lengths 2 2 2 2 2 → 2 4 6 8 10"; a repeated end is an empty document; trailing
# zeros end the list ("[2, 5, 9, 0, 0]": the last two do not take part) (torch_npu/_op_plugin_docs.py,
# npu_fusion_attention: actual_seq_qlen, and the constraints). Each document is one attention of its own, run here
# as the BNSD kernel above on [1, N, len, D] with the call's mask arguments; the causal modes 2 and 3 (with the
# compressed mask) are the only masks taken, and they coincide where a document's query and key lengths agree.
# The statistics are [T, N, 8] (META, npu_fusion_attention_forward, TND); softmax_layout "TND" asks for that
# order (DOCS, softmax_layout), the default "" (NTD in DOCS) is refused here rather than guessed.


def _ends(lengths, name: str) -> list[int]:
    check(lengths is not None, f"input_layout TND needs {name}")
    values = [int(v) for v in (lengths.tolist() if isinstance(lengths, Tensor) else lengths)]
    check(1 <= len(values) <= 1024, f"{name} must hold 1 to 1024 entries in varlen, got {len(values)}")
    return values


def _tnd_documents(query, key, value, head_num, pse, padding_mask, atten_mask, keep_prob, prefix, actual_seq_qlen,
                   actual_seq_kvlen, sparse_mode, softmax_layout, sink):
    """[(q slice, kv slice)] of the documents that take part (empty ones left out), after the argument checks."""
    unsupported(pse is None and padding_mask is None and prefix is None and sink is None,
                "pse, padding_mask, prefix or sink in TND")
    unsupported(keep_prob == 1.0, "dropout in TND")
    unsupported(softmax_layout == "TND", f"softmax_layout {softmax_layout!r} in TND (emulated: 'TND')")
    unsupported(atten_mask is None or sparse_mode in (2, 3),
                f"sparse_mode {sparse_mode} in TND (emulated: 2 and 3, causal per document, or no mask)")
    check(query.dim() == key.dim() == value.dim() == 3, "TND takes 3-D query, key, value")
    check(query.shape[1] == head_num, f"query has {query.shape[1]} heads, head_num is {head_num}")
    qs, ks = _ends(actual_seq_qlen, "actual_seq_qlen"), _ends(actual_seq_kvlen, "actual_seq_kvlen")
    check(len(qs) == len(ks), f"actual_seq_qlen and actual_seq_kvlen differ in length: {len(qs)}, {len(ks)}")
    pieces, q0, k0 = [], 0, 0
    for i, (q1, k1) in enumerate(zip(qs, ks)):
        if q1 < q0 or k1 < k0:  # trailing zeros: the documents from here on do not take part
            check(all(v == 0 for v in qs[i:] + ks[i:]), f"actual_seq_qlen / actual_seq_kvlen must not decrease "
                  f"(except to trailing zeros): {qs}, {ks}")
            break
        check(q1 <= query.shape[0] and k1 <= key.shape[0],
              f"actual_seq_qlen / actual_seq_kvlen end past T ({query.shape[0]}, {key.shape[0]}): {qs}, {ks}")
        if q1 > q0:
            check(k1 > k0, f"a document with {q1 - q0} queries has no keys")
            pieces.append((slice(q0, q1), slice(k0, k1)))
        q0, k0 = q1, k1
    return pieces


def _bnsd(t: Tensor, piece: slice) -> Tensor:
    return t[piece].transpose(0, 1).unsqueeze(0)


def _tnd(t: Tensor) -> Tensor:
    return t.squeeze(0).transpose(0, 1)


def _tnd_forward(query, key, value, head_num, pse, padding_mask, atten_mask, scale, keep_prob, inner_precise,
                 prefix, actual_seq_qlen, actual_seq_kvlen, sparse_mode, softmax_layout, sink, seed, offset):
    pieces = _tnd_documents(query, key, value, head_num, pse, padding_mask, atten_mask, keep_prob, prefix,
                            actual_seq_qlen, actual_seq_kvlen, sparse_mode, softmax_layout, sink)
    out = query.new_zeros((*query.shape[:2], value.shape[-1]))
    softmax_max = query.new_zeros((query.shape[0], head_num, 8), dtype=torch.float32)
    softmax_sum = torch.zeros_like(softmax_max)
    for qp, kp in pieces:
        o, m, z, *_ = npu_fusion_attention(_bnsd(query, qp), _bnsd(key, kp), _bnsd(value, kp), head_num, "BNSD",
                                           atten_mask=atten_mask, scale=scale, sparse_mode=sparse_mode,
                                           inner_precise=inner_precise)
        out[qp] = _tnd(o)
        softmax_max[qp] = m.squeeze(0).transpose(0, 1)
        softmax_sum[qp] = z.squeeze(0).transpose(0, 1)
    return out, softmax_max, softmax_sum, query.new_empty((0,)), seed, offset, 0


def _tnd_grad(query, key, value, dy, head_num, pse, padding_mask, atten_mask, softmax_max, softmax_sum,
              attention_in, scale_value, keep_prob, inner_precise, prefix, actual_seq_qlen, actual_seq_kvlen,
              sparse_mode, softmax_layout, sink):
    pieces = _tnd_documents(query, key, value, head_num, pse, padding_mask, atten_mask, keep_prob, prefix,
                            actual_seq_qlen, actual_seq_kvlen, sparse_mode, softmax_layout, sink)
    stat_shape = (query.shape[0], head_num, 8)
    check(tuple(softmax_max.shape) == stat_shape == tuple(softmax_sum.shape),
          f"softmax_max/softmax_sum must be {stat_shape} in TND, got {tuple(softmax_max.shape)}, "
          f"{tuple(softmax_sum.shape)}")
    grads = [torch.zeros(t.shape, dtype=t.dtype) for t in (query, key, value)]
    for qp, kp in pieces:
        stats = [t[qp].transpose(0, 1).unsqueeze(0) for t in (softmax_max, softmax_sum)]
        gq, gk, gv, *_ = npu_fusion_attention_grad(
            _bnsd(query, qp), _bnsd(key, kp), _bnsd(value, kp), _bnsd(dy, qp), head_num, "BNSD",
            atten_mask=atten_mask, softmax_max=stats[0], softmax_sum=stats[1], attention_in=_bnsd(attention_in, qp),
            scale_value=scale_value, sparse_mode=sparse_mode, inner_precise=inner_precise)
        grads[0][qp] = _tnd(gq)
        grads[1][kp] = _tnd(gk)
        grads[2][kp] = _tnd(gv)
    return (*grads, query.new_empty((0,)), query.new_empty((0,)))


KERNELS = {  # op name -> (CPU kernel, fake kernel giving torch_npu's output shapes and dtypes)
    "npu_fusion_attention": (npu_fusion_attention, _npu_fusion_attention_fake),
    "npu_fusion_attention_grad": (npu_fusion_attention_grad, _npu_fusion_attention_grad_fake),
    "npu_fusion_attention_v3": (npu_fusion_attention_v3, _npu_fusion_attention_v3_fake),
    "npu_fusion_attention_grad_v3": (npu_fusion_attention_grad_v3, _npu_fusion_attention_grad_fake),
}
