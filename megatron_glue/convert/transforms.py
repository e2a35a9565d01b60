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
