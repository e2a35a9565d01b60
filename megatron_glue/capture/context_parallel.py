"""Context parallelism without Transformer Engine: the core attention of a layer whose sequence is split over the
context-parallel (CP) ranks (docs/context_parallel.md).

megatron-core splits the batch (`utils.get_batch_on_this_cp_rank`: the sequence cut in 2 x CP chunks, rank r holding
chunks r and 2CP-1-r), the rotary embedding (`get_pos_emb_on_this_cp_rank`) and the gradient reduction (DDP over
data x context parallel); its CP attention exists only in `TEDotProductAttention` (the local `DotProductAttention`
asserts CP == 1). These modules take its place in the layer spec (`cp_layer_spec`), with its signature:

- `UlyssesAttention` (MindSpeed's `ulysses_cp_algo`): an all-to-all from sequence-sharded to head-sharded tensors,
  megatron-core's own `DotProductAttention` over the whole sequence with H/CP heads (the attention the backend fuses),
  and the all-to-all back.
- `RingAttention` (MindSpeed's `megatron_cp_algo`): K/V passed around the CP ring, each step's partial attention
  the fused `npu_compile::attention_with_lse` (its fp32 log-sum-exp a differentiable output, its backward
  recomputing the step from q, k, v, out and lse: no step keeps its score block) and merged exactly
  (`ring_attention_update`, the merge of `npu_ring_attention_update`); causal masking per pair of chunks.

The collectives are torch's functional collectives with autograd (`all_to_all_single_autograd`): under Dynamo they
are `_c10d_functional` ops in the captured graph (the backend's comm scheduling and cost model see them), eagerly
they are asynchronous (waited on where their result is used).
"""

from __future__ import annotations

import copy
import dataclasses
import math

import torch
from megatron.core.transformer.module import MegatronModule

ALGORITHMS = ("ulysses_cp_algo", "megatron_cp_algo")


# -- the ring's arithmetic (no process group: unit-tested against full attention) ----------------------------------

def attention_with_statistics(query, key, value, scale: float, causal: bool, hidden=None):
    """The written-out form of a ring step (the reference `fused_step` is tested against; autograd through it saves the
    step's [b, n, sq, sk] weights). Softmax attention of `query` [sq, b, n, d] over `key` / `value` [sk, b, g, d] (GQA:
    query head h reads key head h // (n / g)), `causal`: query i sees keys <= i (sq == sk); `hidden`, when given: a bool
    mask broadcast to [b, n, sq, sk], True where a query does not see a key (packed documents). Returns (out [sq, b, n,
    d], softmax_max [b, n, sq], softmax_sum [b, n, sq]), all in fp32 (fp64 for fp64 inputs): out = exp(s - max) v / sum,
    so that partial results over disjoint key blocks merge exactly (ring_attention_update). A query row that sees no key
    of the block (a document that began after the block's keys) gets out 0, sum 0 and max -inf: the merge gives it
    weight 0."""
    n, g = query.size(2), key.size(2)
    if g != n:
        key = key.repeat_interleave(n // g, dim=2)
        value = value.repeat_interleave(n // g, dim=2)
    dtype = torch.promote_types(query.dtype, torch.float32)  # fp32 at least (fp64 stays fp64)
    scores = torch.einsum("sbnd,tbnd->bnst", query.to(dtype), key.to(dtype)) * scale
    if causal:
        sq, sk = scores.shape[-2:]
        later = torch.ones(sq, sk, dtype=torch.bool, device=scores.device).triu(1)
        scores = scores.masked_fill(later, float("-inf"))
    if hidden is None:
        softmax_max = scores.amax(dim=-1)
        weights = torch.exp(scores - softmax_max.unsqueeze(-1))
        softmax_sum = weights.sum(dim=-1)
        out = torch.einsum("bnst,tbnd->sbnd", weights, value.to(dtype))
        return out / softmax_sum.permute(2, 0, 1).unsqueeze(-1), softmax_max, softmax_sum
    scores = scores.masked_fill(hidden, float("-inf"))
    row_max = scores.amax(dim=-1)
    empty = torch.isinf(row_max)  # every key of the block hidden from this query
    weights = torch.exp(scores - torch.where(empty, 0.0, row_max).unsqueeze(-1))  # exp(-inf) = 0 where hidden
    softmax_sum = weights.sum(dim=-1)
    out = torch.einsum("bnst,tbnd->sbnd", weights, value.to(dtype))
    out = out / torch.where(empty, 1.0, softmax_sum).permute(2, 0, 1).unsqueeze(-1)
    return out, torch.where(empty, float("-inf"), row_max), softmax_sum


def fused_step(query, key, value, scale: float, causal: bool, hidden=None):
    """A ring step as attention_with_statistics returns it, computed by the fused `npu_compile::attention_with_lse`
    (its backward recomputes the step from q, k, v, out and lse, so no [b, n, sq, sk] block is kept for the
    backward): (out [sq, b, n, d] in fp32, lse as the row max, 1 as the row sum), the same merge weights
    exp(lse − max) as (max, sum). A row that sees no key: out 0, lse −inf, weight 0 in the merge."""
    import npu_compile.ops  # noqa: F401  (registers torch.ops.npu_compile)

    out, lse = torch.ops.npu_compile.attention_with_lse(query, key, value, hidden, layout="sbnd", scale=scale,
                                                        causal=causal)
    return out.to(torch.promote_types(query.dtype, torch.float32)), lse, torch.ones_like(lse)


def ring_attention_update(prev_out, prev_max, prev_sum, cur_out, cur_max, cur_sum):
    """Two partial attentions of the same queries over disjoint keys merged into the attention over both: out
    [s, b, n, d], statistics [b, n, s], all fp32 (torch_npu's npu_ring_attention_update, docs/context_parallel.md).
    max = max(m1, m2); each part weighted by exp(m_i - max) x sum_i; sum = the weights' sum; out = Σ out_i x
    weight_i / sum."""
    softmax_max = torch.maximum(prev_max, cur_max)
    prev_weight = torch.exp(prev_max - softmax_max) * prev_sum
    cur_weight = torch.exp(cur_max - softmax_max) * cur_sum
    softmax_sum = prev_weight + cur_weight

    def per_row(w):  # [b, n, s] -> [s, b, n, 1]
        return (w / softmax_sum).permute(2, 0, 1).unsqueeze(-1)

    return prev_out * per_row(prev_weight) + cur_out * per_row(cur_weight), softmax_max, softmax_sum


def ring_steps(rank: int, size: int):
    """(step, source rank, which queries, which keys) of the load-balanced causal ring: at step t this rank holds the
    K/V of rank j = (rank - t) mod size, whose chunks are j and 2·size-1-j, as its queries are rank and
    2·size-1-rank. t = 0: its own chunks, causal; j < rank: every query sees key chunk j and none sees chunk
    2·size-1-j; j > rank: query chunk `rank` sees neither, query chunk 2·size-1-rank sees both. So no block but
    the first is masked, and no query row of a block is masked whole."""
    for step in range(size):
        source = (rank - step) % size
        if step == 0:
            yield step, source, "all", "all"
        elif source < rank:
            yield step, source, "all", "first"
        else:
            yield step, source, "second", "all"


def ring_attention_local(query, key, value, scale: float, rank: int, size: int, exchange, hidden=None,
                         attend=fused_step):
    """Causal attention of this rank's queries over the whole sequence, the sequence split as
    get_batch_on_this_cp_rank splits it (chunks rank and 2·size-1-rank of 2·size, concatenated). `exchange(kv)`
    returns the previous rank's tensor (the ring); `query` [2c, b, n, d], `key`/`value` [2c, b, g, d]. Returns out
    [2c, b, n, d] in fp32. `hidden(query_chunks, key_chunks)`, when given (packed documents): the bool mask
    [b, 1, len_q, len_k] (True = not seen) of the queries in those chunks (global chunk numbers, in that order)
    against the keys in those; it must hide every later key (a document mask is causal), so that the blocks the
    causal plan skips stay skipped, and show each query itself (every row of step 0 sees a key). `attend`: each
    step's attention, `fused_step` or the written-out `attention_with_statistics` (same arguments; results that
    merge alike)."""
    c = query.size(0) // 2
    own = (rank, 2 * size - 1 - rank)
    kv = torch.cat([key, value], dim=-1)
    d = key.size(-1)
    out = softmax_max = softmax_sum = None
    for step, source, queries, keys in ring_steps(rank, size):
        if step > 0:
            kv = incoming
        if step + 1 < size:
            incoming = exchange(kv)  # issued before this step's attention, so that they overlap
        k, v = kv[..., :d], kv[..., d:]
        held = (source, 2 * size - 1 - source)
        if step == 0:
            mask = None if hidden is None else hidden(own, own)
            out, softmax_max, softmax_sum = attend(query, k, v, scale, causal=hidden is None, hidden=mask)
            continue
        if keys == "first":
            k, v, held = k[:c], v[:c], held[:1]
        if queries == "all":
            mask = None if hidden is None else hidden(own, held)
            cur = attend(query, k, v, scale, causal=False, hidden=mask)
            out, softmax_max, softmax_sum = ring_attention_update(out, softmax_max, softmax_sum, *cur)
        else:
            mask = None if hidden is None else hidden(own[1:], held)
            cur = attend(query[c:], k, v, scale, causal=False, hidden=mask)
            second = ring_attention_update(out[c:], softmax_max[..., c:], softmax_sum[..., c:], *cur)
            out = torch.cat([out[:c], second[0]])
            softmax_max = torch.cat([softmax_max[..., :c], second[1]], dim=-1)
            softmax_sum = torch.cat([softmax_sum[..., :c], second[2]], dim=-1)
    return out


# -- the collectives ---------------------------------------------------------------------------------------------

def ring_exchange(tensor, group, rank: int, size: int):
    """`tensor` sent to the next CP rank, the previous rank's received: one all-to-all whose only non-empty split
    goes to rank + 1 (a differentiable functional collective: the gradient goes back the other way)."""
    from torch.distributed._functional_collectives import all_to_all_single_autograd

    rows = tensor.size(0)
    send = [rows if r == (rank + 1) % size else 0 for r in range(size)]
    receive = [rows if r == (rank - 1) % size else 0 for r in range(size)]
    return all_to_all_single_autograd(tensor.contiguous(), receive, send, group)


def _all_to_all(tensor, group):
    from torch.distributed._functional_collectives import all_to_all_single_autograd

    return all_to_all_single_autograd(tensor.contiguous(), None, None, group)


def _chunk_order(size: int) -> list[int]:
    """The sequence chunks (of 2·size) in the order the CP ranks hold them, rank after rank."""
    return [chunk for r in range(size) for chunk in (r, 2 * size - 1 - r)]


def sequence_to_heads(x, group, size: int):
    """[s/CP, b, h, d] (this rank's chunks) -> [s, b, h/CP, d] (the whole sequence in order, this rank's heads)."""
    sl, b, h, d = x.shape
    parts = _all_to_all(x.view(sl, b, size, h // size, d).permute(2, 0, 1, 3, 4), group)
    gathered = parts.reshape(size * sl, b, h // size, d)
    c = sl // 2
    slot = {chunk: i for i, chunk in enumerate(_chunk_order(size))}
    return torch.cat([gathered[slot[g] * c:(slot[g] + 1) * c] for g in range(2 * size)])


def heads_to_sequence(x, group, size: int, head_dim: int):
    """The inverse of sequence_to_heads, on the attention's output: [s, b, h/CP · d] -> [s/CP, b, h · d]. Taken as
    the attention returns it (a view of it first would hide the attention's output from the backend's rule)."""
    s, b, _ = x.shape
    c = s // (2 * size)
    ranked = torch.cat([x[g * c:(g + 1) * c] for g in _chunk_order(size)])
    parts = _all_to_all(ranked.view(size, 2 * c, b, -1, head_dim), group)
    return parts.permute(1, 2, 0, 3, 4).reshape(2 * c, b, -1)


# -- the modules -------------------------------------------------------------------------------------------------

def _cp_group():
    from megatron.core import parallel_state

    return (parallel_state.get_context_parallel_group(), parallel_state.get_context_parallel_rank(),
            parallel_state.get_context_parallel_world_size())


def _check_inputs(query, attention_mask, packed_seq_params, attention_bias, algorithm: str, size: int):
    """Packed documents come as megatron-core's PackedSeqParams in qkv_format 'sbhd' (the compiled job's lengths,
    cu_seqlens over the whole rows: gpt.packed_documents, sft.collate) or as the dense mask of the whole rows
    (eager; the batch split leaves it whole: gpt.on_this_cp_rank), never both."""
    if attention_bias is not None:
        raise NotImplementedError(f"{algorithm}: an attention bias under context parallelism is not implemented here")
    if packed_seq_params is not None:
        if packed_seq_params.qkv_format != "sbhd":
            raise NotImplementedError(
                f"{algorithm}: packed_seq_params in qkv_format {packed_seq_params.qkv_format!r} (Transformer "
                "Engine's THD) under context parallelism is not implemented here; the job passes 'sbhd' (lengths "
                "over whole rows)")
        if attention_mask is not None:
            raise ValueError(f"{algorithm}: packed documents come either as lengths (packed_seq_params) or as a "
                             "mask, not both")
    whole = query.size(0) * size
    if attention_mask is not None and tuple(attention_mask.shape[-2:]) != (whole, whole):
        raise ValueError(f"{algorithm}: the attention mask must cover whole rows ([..., {whole}, {whole}]: this "
                         f"rank's {query.size(0)} tokens x {size} CP ranks), got {tuple(attention_mask.shape)}; "
                         "the batch split leaves it whole (megatron_glue.training.gpt.on_this_cp_rank)")


def document_ids(cu_seqlens, batch: int, seq: int):
    """[batch, seq] int64: the document each token of the whole rows belongs to (documents numbered over the
    batch), from cumulative ends without a leading 0 (npu_compile.ops.varlen_attention's convention)."""
    flat = torch.arange(batch * seq, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    return torch.searchsorted(cu_seqlens, flat, right=True).view(batch, seq)


def _chunk_positions(chunks, c: int, device):
    return torch.cat([torch.arange(chunk * c, (chunk + 1) * c, device=device) for chunk in chunks])


def documents_hidden(documents, c: int):
    """ring_attention_local's `hidden` for packed documents given as document ids [b, s] of the whole rows, the
    sequence in chunks of c tokens: a query sees the keys of its own document up to itself."""
    def hidden(query_chunks, key_chunks):
        q = _chunk_positions(query_chunks, c, documents.device)
        k = _chunk_positions(key_chunks, c, documents.device)
        other = documents[:, q, None] != documents[:, None, k]
        return (other | (k[None, :] > q[:, None])).unsqueeze(1)

    return hidden


def mask_hidden(mask, c: int):
    """ring_attention_local's `hidden` from a dense mask of the whole rows ([b, 1, s, s], True = hidden:
    Megatron's reset mask, causal within each document), its blocks taken by global position."""
    def hidden(query_chunks, key_chunks):
        q = _chunk_positions(query_chunks, c, mask.device)
        k = _chunk_positions(key_chunks, c, mask.device)
        return mask.index_select(-2, q).index_select(-1, k)

    return hidden


class UlyssesAttention(MegatronModule):
    """MindSpeed's ulysses_cp_algo in place of DotProductAttention: all-to-all from sequence to heads,
    megatron-core's DotProductAttention over the whole sequence with this rank's H/CP heads, all-to-all back. Key /
    value heads per TP rank not divisible by CP are repeated to the query heads first."""

    def __init__(self, config, *args, **kwargs):
        from megatron.core.transformer.dot_product_attention import DotProductAttention

        super().__init__(config)
        self.group, self.rank, self.size = _cp_group()
        cp, tp = self.size, config.tensor_model_parallel_size
        groups = config.num_query_groups or config.num_attention_heads
        self.repeat_kv = (groups // tp) % cp != 0
        inner = copy.copy(config)  # the attention of one CP rank: H/CP heads over the whole sequence
        inner.context_parallel_size = 1
        inner.num_attention_heads = config.num_attention_heads // cp
        inner.num_query_groups = inner.num_attention_heads if self.repeat_kv else groups // cp
        self.attention = DotProductAttention(inner, *args, **kwargs)

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        _check_inputs(query, attention_mask, packed_seq_params, attention_bias, "ulysses_cp_algo", self.size)
        if self.repeat_kv:
            key = key.repeat_interleave(query.size(2) // key.size(2), dim=2)
            value = value.repeat_interleave(query.size(2) // value.size(2), dim=2)
        q, k, v = (sequence_to_heads(t, self.group, self.size) for t in (query, key, value))
        # the whole rows in order: packed documents' mask or lengths are those of the unsplit batch, as at CP 1
        context = self.attention(q, k, v, attention_mask, attn_mask_type=attn_mask_type,
                                 packed_seq_params=packed_seq_params)
        return heads_to_sequence(context, self.group, self.size, q.size(3))


class RingAttention(MegatronModule):
    """MindSpeed's megatron_cp_algo in place of DotProductAttention: causal ring attention over the CP ranks with
    Megatron's load-balanced chunks (ring_attention_local), K/V passed by ring_exchange. No attention dropout
    (the door refuses it: dropout over partial softmaxes is not the dropout of the full one)."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                 softmax_scale=None, **kwargs):
        super().__init__(config)
        self.group, self.rank, self.size = _cp_group()
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout:
            raise NotImplementedError("megatron_cp_algo: attention dropout under ring attention is not implemented "
                                      "here; give --attention-dropout 0")
        if getattr(config, "window_size", None) is not None:
            raise NotImplementedError("megatron_cp_algo: sliding-window attention under ring attention is not "
                                      "implemented here")
        head = config.kv_channels
        if softmax_scale is None:
            softmax_scale = config.softmax_scale if getattr(config, "softmax_scale", None) else 1.0 / math.sqrt(head)
        self.softmax_scale = softmax_scale

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        _check_inputs(query, attention_mask, packed_seq_params, attention_bias, "megatron_cp_algo", self.size)
        c, hidden = query.size(0) // 2, None
        if packed_seq_params is not None:  # packed documents, compiled: their lengths over the whole rows
            hidden = documents_hidden(document_ids(packed_seq_params.cu_seqlens_q, query.size(1),
                                                   query.size(0) * self.size), c)
        elif attention_mask is not None:  # eager: Megatron's dense reset mask of the whole rows
            hidden = mask_hidden(attention_mask, c)
        out = ring_attention_local(query, key, value, self.softmax_scale, self.rank, self.size,
                                   lambda kv: ring_exchange(kv, self.group, self.rank, self.size), hidden=hidden)
        return out.to(query.dtype).reshape(query.size(0), query.size(1), -1)


MODULES = {"ulysses_cp_algo": UlyssesAttention, "megatron_cp_algo": RingAttention}


def cp_layer_spec(spec, algorithm: str):
    """A copy of a layer spec (or a block spec's layers) whose self-attention's core attention is the CP module of
    `algorithm`; other modules unchanged."""
    module = MODULES[algorithm]
    if hasattr(spec, "layer_specs"):  # TransformerBlockSubmodules (the MoE block spec)
        return dataclasses.replace(spec, layer_specs=[cp_layer_spec(s, algorithm) for s in spec.layer_specs])
    attention = spec.submodules.self_attention
    inner = dataclasses.replace(attention.submodules, core_attention=module)
    return dataclasses.replace(spec, submodules=dataclasses.replace(
        spec.submodules, self_attention=dataclasses.replace(attention, submodules=inner)))
