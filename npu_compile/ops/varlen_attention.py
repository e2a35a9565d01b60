"""Variable-length (packed-document) attention: `npu_compile::varlen_attention` and its backward, and
`npu_compile::document_mask`, the dense mask it stands for.

Several documents share one row of a batch; each token attends causally to the tokens of its own document
only. Megatron-LM spells this as a dense [b, 1, s, s] mask (`--reset-attention-mask`: megatron-core's
GPTDataset, `_get_ltor_masks_and_position_ids`); the device takes the documents' lengths instead
(npu_fusion_attention, input_layout "TND", `actual_seq_qlen` / `actual_seq_kvlen`). This op takes the lengths.

Conventions:
- query, key, value in one of our 4-D layouts with a batch and a sequence dim ("sbnd", Megatron's [s, b, n, d],
  or "bsnd"); heads and GQA as in `fused_attention` (query head h reads kv head h // (nq // nkv)).
- cu_seqlens: int64 [m], the documents' cumulative end positions over the b·s tokens taken row after row
  (token t of row r is number r·s + t), without a leading 0: the device's `actual_seq_qlen` convention
  ("lengths 2 2 2 → 2 4 6", torch_npu/_op_plugin_docs.py, npu_fusion_attention, actual_seq_qlen). Non-decreasing,
  last entry b·s, and every row end r·s is an entry (a document never crosses rows). A repeated entry is a
  document of length 0, which the device takes too ("[2, 2, 0, 2, 2] → [2, 4, 4, 6, 8]", same entry, constraints):
  padding cu_seqlens with repeats of b·s to a fixed length keeps its shape, and so the compiled graph, the same
  whatever the number of documents in a batch. Query and key/value share it (self-attention).
- causal within each document (query i sees keys j <= i of its own document): what Megatron's reset mask is.
- out in the query's layout, contiguous; softmax_max / softmax_sum fp32 [b, nq, s], the row max of the masked,
  scaled scores and Σ exp(s − max), as `fused_attention` returns them.
- no dropout: Megatron's attention dropout draws over the dense [b, n, s, s] probabilities, which this op never
  forms; the varlen rule leaves calls with dropout to the dense attention rule.

The reference kernels never build an s×s tensor: they run `fused_attention` (and its backward) on each
document's slice, [1, n, len, d], causal, so the largest score tile is one document's (at most QUERY_TILE
rows of it). `document_mask` is the dense mask for comparison and for graphs where the varlen rule does not
fire; it is what Megatron's dataset builds, from the lengths.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from npu_compile.ops.attention import fused_attention, fused_attention_backward
from npu_compile.ops.common import acc_dtype
from npu_compile.ops.layout import layout_shape, to_bnsd

VARLEN_LAYOUTS = ("sbnd", "bsnd")
# The most entries npu_fusion_attention takes in actual_seq_qlen in varlen (torch_npu/_op_plugin_docs.py,
# npu_fusion_attention constraints: "varlen场景下长度最大支持1K"): padding cu_seqlens to this length, not beyond,
# keeps a call the device can take.
DEVICE_MAX_DOCUMENTS = 1024


def _check(query, key, value, cu_seqlens, layout):
    if layout not in VARLEN_LAYOUTS:
        raise ValueError(f"varlen_attention: layout must be one of {VARLEN_LAYOUTS}, got {layout!r}")
    if not (query.dim() == key.dim() == value.dim() == 4):
        raise ValueError("varlen_attention: query, key and value must be 4-D")
    if not (query.dtype == key.dtype == value.dtype):
        raise ValueError(f"varlen_attention: query, key, value dtypes differ: {query.dtype}, {key.dtype}, "
                         f"{value.dtype}")
    b, nq, s, d = to_bnsd(query, layout).shape
    kb, nkv, sk, kd = to_bnsd(key, layout).shape
    vb, vn, vs, _ = to_bnsd(value, layout).shape
    if (kb, vb) != (b, b) or (sk, vs) != (s, s) or kd != d or vn != nkv:
        raise ValueError(f"varlen_attention: shapes do not fit ({layout}, self-attention): query "
                         f"{tuple(query.shape)}, key {tuple(key.shape)}, value {tuple(value.shape)}")
    if nq % nkv != 0:
        raise ValueError(f"varlen_attention: query heads ({nq}) must be a multiple of key/value heads ({nkv})")
    if cu_seqlens.dim() != 1 or cu_seqlens.dtype != torch.int64:
        raise ValueError(f"varlen_attention: cu_seqlens must be 1-D int64 (cumulative document ends), got "
                         f"{cu_seqlens.dim()}-D {cu_seqlens.dtype}")


def documents(cu_seqlens: Tensor, batch: int, seq: int) -> list[tuple[int, int, int]]:
    """(row, start, stop) of every non-empty document, read on the host; ValueError naming what is wrong with
    a cu_seqlens that breaks the conventions (module doc)."""
    ends = [int(e) for e in cu_seqlens.tolist()]
    total = batch * seq
    if not ends or ends[-1] != total:
        raise ValueError(f"cu_seqlens must end at b·s = {total} (every token in a document), got "
                         f"{ends[-1] if ends else 'no entries'}")
    if any(b < a for a, b in zip(ends, ends[1:])) or ends[0] < 0:
        raise ValueError(f"cu_seqlens must be non-decreasing cumulative ends from 0, got {ends}")
    missing = [r * seq for r in range(1, batch) if r * seq not in set(ends)]
    if missing:
        raise ValueError(f"cu_seqlens must hold every row end (multiples of s = {seq}): documents may not cross "
                         f"rows; missing {missing}")
    out, start = [], 0
    for end in ends:
        if end > start:
            row = start // seq
            out.append((row, start - row * seq, end - row * seq))
        start = end
    return out


def _slice(t_bnsd: Tensor, row: int, start: int, stop: int) -> Tensor:
    return t_bnsd[row:row + 1, :, start:stop]


@torch.library.custom_op("npu_compile::varlen_attention", mutates_args=())
def varlen_attention(query: Tensor, key: Tensor, value: Tensor, cu_seqlens: Tensor, *, layout: str = "sbnd",
                     scale: Optional[float] = None) -> tuple[Tensor, Tensor, Tensor]:
    """Returns (out in `layout`, contiguous; softmax_max, softmax_sum: [b, nq, s] fp32)."""
    _check(query, key, value, cu_seqlens, layout)
    q, k, v = (to_bnsd(t, layout) for t in (query, key, value))
    b, nq, s, _ = q.shape
    out = query.new_empty(layout_shape(layout, b, nq, s, value.shape[-1]))
    out_bnsd = to_bnsd(out, layout)
    acc = acc_dtype(query.dtype)
    softmax_max = query.new_zeros((b, nq, s), dtype=acc)
    softmax_sum = torch.zeros_like(softmax_max)
    for row, start, stop in documents(cu_seqlens, b, s):
        o, m, z = fused_attention(_slice(q, row, start, stop), _slice(k, row, start, stop),
                                  _slice(v, row, start, stop), layout="bnsd", scale=scale, causal=True)
        out_bnsd[row:row + 1, :, start:stop] = o
        softmax_max[row:row + 1, :, start:stop] = m
        softmax_sum[row:row + 1, :, start:stop] = z
    return out, softmax_max, softmax_sum


@varlen_attention.register_fake
def _(query, key, value, cu_seqlens, *, layout="sbnd", scale=None):
    _check(query, key, value, cu_seqlens, layout)
    b, nq, s, _ = to_bnsd(query, layout).shape
    acc = acc_dtype(query.dtype)
    out = query.new_empty(layout_shape(layout, b, nq, s, value.shape[-1]))
    return out, query.new_empty((b, nq, s), dtype=acc), query.new_empty((b, nq, s), dtype=acc)


@torch.library.custom_op("npu_compile::varlen_attention_backward", mutates_args=())
def varlen_attention_backward(grad_out: Tensor, query: Tensor, key: Tensor, value: Tensor, out: Tensor,
                              softmax_max: Tensor, softmax_sum: Tensor, cu_seqlens: Tensor, *, layout: str = "sbnd",
                              scale: Optional[float] = None) -> tuple[Tensor, Tensor, Tensor]:
    """Returns (grad_query, grad_key, grad_value), each contiguous in its input's layout."""
    _check(query, key, value, cu_seqlens, layout)
    q, k, v, dy, o = (to_bnsd(t, layout) for t in (query, key, value, grad_out, out))
    b, nq, s, _ = q.shape
    grads = [t.new_zeros(t.shape) for t in (query, key, value)]
    grads_bnsd = [to_bnsd(g, layout) for g in grads]
    for row, start, stop in documents(cu_seqlens, b, s):
        piece = (lambda t: _slice(t, row, start, stop))
        gq, gk, gv, _ = fused_attention_backward(
            piece(dy), piece(q), piece(k), piece(v), piece(o), softmax_max[row:row + 1, :, start:stop],
            softmax_sum[row:row + 1, :, start:stop], layout="bnsd", scale=scale, causal=True)
        for g, part in zip(grads_bnsd, (gq, gk, gv)):
            g[row:row + 1, :, start:stop] = part
    return tuple(grads)


@varlen_attention_backward.register_fake
def _(grad_out, query, key, value, out, softmax_max, softmax_sum, cu_seqlens, *, layout="sbnd", scale=None):
    _check(query, key, value, cu_seqlens, layout)
    return tuple(t.new_empty(t.shape) for t in (query, key, value))


def _setup_context(ctx, inputs, keyword_only_inputs, output):
    query, key, value, cu_seqlens = inputs
    out, softmax_max, softmax_sum = output
    ctx.save_for_backward(query, key, value, out, softmax_max, softmax_sum, cu_seqlens)
    ctx.options = dict(keyword_only_inputs)
    ctx.mark_non_differentiable(softmax_max, softmax_sum)


def _backward(ctx, grad_out, _grad_max, _grad_sum):
    query, key, value, out, softmax_max, softmax_sum, cu_seqlens = ctx.saved_tensors
    grad_q, grad_k, grad_v = torch.ops.npu_compile.varlen_attention_backward(
        grad_out, query, key, value, out, softmax_max, softmax_sum, cu_seqlens, **ctx.options)
    return grad_q, grad_k, grad_v, None


varlen_attention.register_autograd(_backward, setup_context=_setup_context)


@torch.library.custom_op("npu_compile::document_mask", mutates_args=())
def document_mask(cu_seqlens: Tensor, batch: int, seq: int) -> Tensor:
    """Megatron's reset attention mask for the documents of cu_seqlens: bool [batch, 1, seq, seq], True =
    masked: key j is hidden from query i unless both lie in one document and j <= i. This is the s×s tensor
    varlen_attention does without; the mask megatron-core's GPTDataset builds from end-of-document tokens
    (`_get_ltor_masks_and_position_ids` with reset_attention_mask) is this one for the documents those tokens end."""
    if cu_seqlens.dim() != 1 or cu_seqlens.dtype != torch.int64:
        raise ValueError(f"document_mask: cu_seqlens must be 1-D int64, got {cu_seqlens.dim()}-D {cu_seqlens.dtype}")
    documents(cu_seqlens, batch, seq)  # the conventions, checked
    token = torch.arange(batch * seq, device=cu_seqlens.device).view(batch, seq)
    doc = torch.bucketize(token, cu_seqlens, right=True)
    other = doc.unsqueeze(-1) != doc.unsqueeze(-2)
    future = torch.ones(seq, seq, dtype=torch.bool, device=cu_seqlens.device).triu_(1)
    return (other | future).unsqueeze(1)


@document_mask.register_fake
def _(cu_seqlens, batch, seq):
    return cu_seqlens.new_empty((batch, 1, seq, seq), dtype=torch.bool)


def cu_seqlens_from_eod(tokens: Tensor, eod: int, pad_to: Optional[int] = None) -> Tensor:
    """The documents of a [b, s] batch of token ids as cu_seqlens (module doc), as Megatron-LM's
    `--reset-attention-mask` cuts them: a document ends after each end-of-document token (megatron-core
    gpt_dataset.py, `_get_ltor_masks_and_position_ids`: `attention_mask[0, (i + 1):, :(i + 1)] = 0` for each EOD
    position i), and at each row's end. With `pad_to`, repeats of b·s (empty documents) fill it to that length,
    so every batch gives one shape; pad_to must be at least the number of ends (b·s always is)."""
    if tokens.dim() != 2:
        raise ValueError(f"cu_seqlens_from_eod: tokens must be [b, s], got {tuple(tokens.shape)}")
    b, s = tokens.shape
    is_end = tokens == eod
    is_end[:, -1] = True
    ends = (is_end.reshape(-1).nonzero().squeeze(-1) + 1).to(torch.int64)
    if pad_to is not None:
        if pad_to < ends.numel():
            raise ValueError(f"cu_seqlens_from_eod: pad_to={pad_to} is fewer than the {ends.numel()} documents")
        ends = torch.cat([ends, ends.new_full((pad_to - ends.numel(),), b * s)])
    return ends
