"""The transforms of the family tables: HF tensors -> one megatron-core tensor (`to_mcore`) and back (`to_hf`),
each the exact inverse of the other (a round trip is bitwise).

`a` is the architecture (the job's args): num_attention_heads, num_query_groups, kv_channels, orig_vocab_size,
padded_vocab_size. Every result is contiguous.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True)
class Transform:
    to_mcore: Callable  # (list of HF tensors, a) -> tensor
    to_hf: Callable     # (tensor, a) -> list of HF tensors


def _groups(a):
    ng, nh = a.num_query_groups, a.num_attention_heads
    d = a.kv_channels or a.hidden_size // nh  # megatron-core's default head size
    return ng, nh // ng, d


def _qkv_to_mcore(hf, a):
    """[q; k; v] of HF (q: nh*d rows, k and v: ng*d) -> megatron's per-group [q_g (nh/ng heads); k_g; v_g]."""
    q, k, v = hf
    ng, per_group, d = _groups(a)
    rest = q.shape[1:]
    grouped = torch.cat([q.reshape(ng, per_group * d, *rest), k.reshape(ng, d, *rest), v.reshape(ng, d, *rest)],
                        dim=1)
    return grouped.reshape(ng * (per_group + 2) * d, *rest).contiguous()


def _qkv_to_hf(t, a):
    ng, per_group, d = _groups(a)
    rest = t.shape[1:]
    q, k, v = t.reshape(ng, (per_group + 2) * d, *rest).split([per_group * d, d, d], dim=1)
    return [x.reshape(-1, *rest).contiguous() for x in (q, k, v)]


def _fused_qkv_to_mcore(hf, a):
    """GPT-2's c_attn output [q | k | v] (each h wide, heads in order) -> per head [q_h; k_h; v_h]."""
    return _qkv_to_mcore(list(hf[0].chunk(3, dim=0)), a)


def _fused_qkv_to_hf(t, a):
    return [torch.cat(_qkv_to_hf(t, a), dim=0).contiguous()]


def _packed_qkv_to_mcore(hf, a):
    """Phi-3's qkv_proj: [q (nh*d rows); k (ng*d); v (ng*d)] in one tensor -> megatron's per-group layout."""
    ng, per_group, d = _groups(a)
    return _qkv_to_mcore(list(hf[0].split([ng * per_group * d, ng * d, ng * d], dim=0)), a)


def _packed_qkv_to_hf(t, a):
    return [torch.cat(_qkv_to_hf(t, a), dim=0).contiguous()]


def _pad_vocab(hf, a):
    """Rows padded with zeros to the padded vocabulary (Megatron-LM: make-vocab-size-divisible-by x TP)."""
    (t,) = hf
    if t.shape[0] != a.orig_vocab_size:
        raise ValueError(f"the embedding has {t.shape[0]} rows, config.json's vocab_size is {a.orig_vocab_size}")
    pad = a.padded_vocab_size - t.shape[0]
    return torch.cat([t, t.new_zeros(pad, *t.shape[1:])]).contiguous() if pad else t.contiguous()


def _slice_vocab(t, a):
    return [t[: a.orig_vocab_size].contiguous()]


def _gated_qkv_to_mcore(hf, a):
    """Qwen3-Next's full attention: q_proj [per head: q_h (d); gate_h (d)], k_proj, v_proj -> megatron-core's
    linear_qkv with attention_output_gate [per query group: q_g (nh/ng heads); gate_g; k_g; v_g]."""
    q_gate, k, v = hf
    ng, per_group, d = _groups(a)
    rest = q_gate.shape[1:]
    q, gate = q_gate.reshape(ng * per_group, 2, d, *rest).unbind(1)
    grouped = torch.cat([q.reshape(ng, per_group * d, *rest), gate.reshape(ng, per_group * d, *rest),
                         k.reshape(ng, d, *rest), v.reshape(ng, d, *rest)], dim=1)
    return grouped.reshape(ng * (2 * per_group + 2) * d, *rest).contiguous()


def _gated_qkv_to_hf(t, a):
    ng, per_group, d = _groups(a)
    rest = t.shape[1:]
    q, gate, k, v = t.reshape(ng, (2 * per_group + 2) * d, *rest).split(
        [per_group * d, per_group * d, d, d], dim=1)
    q_gate = torch.stack([q.reshape(ng * per_group, d, *rest), gate.reshape(ng * per_group, d, *rest)], dim=1)
    return [x.reshape(-1, *rest).contiguous() for x in (q_gate, k, v)]


def _gdn(a):
    nk, nv = a.linear_num_key_heads, a.linear_num_value_heads
    return nk, nv // nk, a.linear_key_head_dim, a.linear_value_head_dim


def _gdn_in_proj_to_mcore(hf, a):
    """Qwen3-Next's in_proj_qkvz [per key head g: q_g (dk); k_g (dk); v_g (r x dv); z_g (r x dv)], r = value heads
    per key head, and in_proj_ba [per key head g: b_g (r); a_g (r)] -> GatedDeltaNet's in_proj [q (nk x dk); k;
    v (nv x dv); z; beta (nv); alpha (nv)], each part in head order."""
    qkvz, ba = hf
    nk, r, dk, dv = _gdn(a)
    rest = qkvz.shape[1:]
    q, k, v, z = qkvz.reshape(nk, 2 * dk + 2 * r * dv, *rest).split([dk, dk, r * dv, r * dv], dim=1)
    beta, alpha = ba.reshape(nk, 2 * r, *rest).split([r, r], dim=1)
    return torch.cat([x.reshape(-1, *rest) for x in (q, k, v, z, beta, alpha)]).contiguous()


def _gdn_in_proj_to_hf(t, a):
    nk, r, dk, dv = _gdn(a)
    rest = t.shape[1:]
    q, k, v, z, beta, alpha = t.split([nk * dk, nk * dk, nk * r * dv, nk * r * dv, nk * r, nk * r])
    qkvz = torch.cat([q.reshape(nk, dk, *rest), k.reshape(nk, dk, *rest), v.reshape(nk, r * dv, *rest),
                      z.reshape(nk, r * dv, *rest)], dim=1)
    ba = torch.cat([beta.reshape(nk, r, *rest), alpha.reshape(nk, r, *rest)], dim=1)
    return [qkvz.reshape(-1, *rest).contiguous(), ba.reshape(-1, *rest).contiguous()]


TRANSFORMS: dict[str, Transform] = {
    "copy": Transform(lambda hf, a: hf[0].contiguous(), lambda t, a: [t.contiguous()]),
    "qkv": Transform(_qkv_to_mcore, _qkv_to_hf),
    "fused_qkv": Transform(_fused_qkv_to_mcore, _fused_qkv_to_hf),
    "packed_qkv": Transform(_packed_qkv_to_mcore, _packed_qkv_to_hf),
    # Conv1D ([in, out]) -> Linear ([out, in])
    "conv1d": Transform(lambda hf, a: hf[0].t().contiguous(), lambda t, a: [t.t().contiguous()]),
    "fused_qkv_conv1d": Transform(lambda hf, a: _fused_qkv_to_mcore([hf[0].t()], a),
                                  lambda t, a: [_fused_qkv_to_hf(t, a)[0].t().contiguous()]),
    "gate_up": Transform(lambda hf, a: torch.cat(hf, dim=0).contiguous(),
                         lambda t, a: [x.contiguous() for x in t.chunk(2, dim=0)]),
    "vocab": Transform(_pad_vocab, _slice_vocab),
    "gated_qkv": Transform(_gated_qkv_to_mcore, _gated_qkv_to_hf),
    "gdn_in_proj": Transform(_gdn_in_proj_to_mcore, _gdn_in_proj_to_hf),
    # a norm weight w applied as w by HF and as 1 + w by megatron-core's zero-centered norm: stored as w - 1
    "unit_offset": Transform(lambda hf, a: (hf[0] - 1).contiguous(), lambda t, a: [(t + 1).contiguous()]),
}


def merge_tp(shards: list[torch.Tensor], tp_dim) -> torch.Tensor:
    """One tensor from its TP shards (rank order), by the table's split."""
    if tp_dim is None:
        return shards[0]
    if tp_dim == "glu":  # rank r holds [gate_r; up_r]
        halves = [s.chunk(2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(shards, dim=tp_dim)


def split_tp(t: torch.Tensor, tp_dim, tp: int) -> list[torch.Tensor]:
    """The TP shards of a full tensor (the inverse of merge_tp); contiguous (gloo and torch.save need it)."""
    if tp_dim is None:
        return [t.contiguous() for _ in range(tp)]
    if tp_dim == "glu":
        gate, up = t.chunk(2, dim=0)
        return [torch.cat([g, u], dim=0).contiguous() for g, u in zip(gate.chunk(tp), up.chunk(tp))]
    return [s.contiguous() for s in t.chunk(tp, dim=tp_dim)]
