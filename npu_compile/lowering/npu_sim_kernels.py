"""npu-sim's emulator: CPU kernels for the torch_npu ops the npu lowering emits, under their real schemas.

:func:`register` defines every schema of npu_schemas.py in the ``npu`` namespace (what torch_npu itself
defines), with a CPU kernel and a fake kernel giving torch_npu's output shapes and dtypes (softmax_max/sum fp32
[B, N, Sq, 8], softmax_out empty [0], rstd fp32 [..., 1], ...). The kernels are written from the documented
semantics (shared/research/anchors.md section C), densely and in fp32, and share no code with the npu_compile
reference kernels: agreeing with them is evidence, not a tautology. Registration happens on first use of
target ``npu-sim``, never at import, and never where torch_npu is installed (its own ``npu`` library would
collide).

Where the documentation is silent, the choice made here is written beside the kernel:
- npu_fusion_attention: a row with no visible key (fully masked) gives out = 0, softmax_max = softmax_sum = 0
  and zero gradients, what inner_precise=2 ("invalid-row computation") is for on the device.
- Dropout bits: the device draws its mask with Philox from (seed, offset); here a torch.Generator seeded from
  the pair stands in. Only the contract is emulated: forward and grad given the same (seed, offset, numels)
  drop the same elements. numels = B·N·Sq·Skv (inferred from the kernel's mask length).
- npu_add_rms_norm / npu_add_layer_norm normalize the fp32 sum x1 + x2 (the x output is that sum rounded to
  x1's dtype); in fp32 both readings agree.
- npu_add_layer_norm_backward returns dgamma/dbeta in fp32 (like npu_rms_norm_backward's documented dgamma).
"""

from __future__ import annotations

import functools
import importlib.util
import math
import sys
from typing import Optional

import torch
from torch import Tensor

from npu_compile.lowering.npu_schemas import EMULATED, MC2, TAGS

_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
_ACC = torch.float32
_library: torch.library.Library | None = None


def torch_npu_installed() -> bool:
    return "torch_npu" in sys.modules or importlib.util.find_spec("torch_npu") is not None


def register() -> None:
    """Define the ``npu`` ops with CPU and fake kernels, once per process."""
    global _library
    if _library is not None:
        return
    if torch_npu_installed():
        raise RuntimeError(
            "target 'npu-sim' emulates torch_npu's ops under their own names and cannot run where torch_npu is "
            "installed; use target='npu' there (or a Python environment without torch-npu)")
    lib = torch.library.Library("npu", "DEF")
    for name, schema in {**EMULATED, **MC2}.items():
        lib.define(schema, tags=TAGS.get(name, ()))
    for name in EMULATED:
        lib.impl(name, _dense_outputs(_KERNELS[name]), "CPU")
        torch.library.register_fake(f"npu::{name}", _FAKES[name], lib=lib)
    for name in MC2:  # MC2: emulated over the c10d process group named by hcom (see _mc2_group)
        lib.impl(name, _MC2_KERNELS[name], "CPU")
        torch.library.register_fake(f"npu::{name}", _MC2_FAKES[name], lib=lib)
    _library = lib


def _dense_outputs(kernel):
    """``kernel`` with its tensor outputs made contiguous, as the device writes them and as the fakes say. An
    elementwise emulation keeps its input's strides: a transposed gradient would come out transposed, and a view
    that the graph was traced with (the fake's contiguous strides) fails on it at run time."""

    @functools.wraps(kernel)
    def dense(*args, **kwargs):
        out = kernel(*args, **kwargs)
        if isinstance(out, Tensor):
            return out.contiguous()
        if isinstance(out, tuple):
            return tuple(o.contiguous() if isinstance(o, Tensor) else o for o in out)
        return out

    return dense


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(f"npu-sim: {message}")


def _unsupported(ok: bool, message: str) -> None:
    """Arguments the device takes but the emulator does not implement (we never emit them)."""
    if not ok:
        raise NotImplementedError(f"npu-sim does not emulate {message}")


def _check_float(**tensors: Tensor) -> None:
    for name, t in tensors.items():
        _check(t.dtype in _FLOATS, f"{name} must be float16, bfloat16 or float32, got {t.dtype}")


# ==== npu_fusion_attention and its grad ========================================================================

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
        _unsupported(input_layout in _LAYOUTS, f"input_layout {input_layout!r} (emulated: {_LAYOUTS})")
        _unsupported(padding_mask is None, "padding_mask (the device does not support it either)")
        _unsupported(prefix is None and actual_seq_qlen is None and actual_seq_kvlen is None,
                     "prefix / varlen sequence lists")
        _unsupported(sink is None, "sink")
        _check_float(query=query, key=key, value=value)
        _check(query.dtype == key.dtype == value.dtype, "query, key and value must share a dtype")
        _check(0.0 < keep_prob <= 1.0, f"keep_prob must lie in (0, 1], got {keep_prob}")
        self.layout = input_layout
        self.dtype = query.dtype
        if input_layout in ("BSH", "SBH"):
            _check(query.dim() == key.dim() == value.dim() == 3, f"{input_layout} takes 3-D query, key, value")
            _check(query.shape[-1] % head_num == 0, f"hidden {query.shape[-1]} is not a multiple of head_num")
            d = query.shape[-1] // head_num
            _check(key.shape[-1] % d == 0, f"key hidden {key.shape[-1]} is not a multiple of the head dim {d}")
            nkv = key.shape[-1] // d
            _check(value.shape[-1] % nkv == 0, f"value hidden {value.shape[-1]} does not split into {nkv} heads")
            heads = (head_num, nkv, nkv)
        else:
            _check(query.dim() == key.dim() == value.dim() == 4, f"{input_layout} takes 4-D query, key, value")
            heads = (None, None, None)
        self.q, self.k, self.v = (self.to_bnsd(t, n) for t, n in zip((query, key, value), heads))
        self.b, self.n, self.sq, self.d = self.q.shape
        _, self.nkv, self.sk, dk = self.k.shape
        self.dv = self.v.shape[-1]
        _check(self.n == head_num, f"query has {self.n} heads, head_num is {head_num}")
        _check(dk == self.d and self.dv <= self.d <= _MAX_HEAD_DIM,
               f"head dims must satisfy Dq = Dk >= Dv, D <= {_MAX_HEAD_DIM}: got {self.d}, {dk}, {self.dv}")
        _check(self.k.shape[:3] == self.v.shape[:3], "key and value must have the same batch, heads and length")
        _check(self.n <= _MAX_HEADS and self.n % self.nkv == 0,
               f"Nq must be at most {_MAX_HEADS} and a multiple of Nkv: got {self.n}, {self.nkv}")
        _check(self.sq <= _MAX_SEQ and self.sk <= _MAX_SEQ, "sequence lengths must be at most 1M")
        self.group = self.n // self.nkv
        self.scale = scale
        self.keep_prob = keep_prob
        self.pse = None if pse is None else self._pse(pse)
        self.visible = self._visible(atten_mask, pre_tockens, next_tockens, sparse_mode)

    def to_bnsd(self, t: Tensor, heads: Optional[int]) -> Tensor:
        t = t.to(_ACC)
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
        _check(pse.dtype == self.dtype, f"pse must have the query's dtype {self.dtype}, got {pse.dtype}")
        forms = {(self.b, self.n, self.sq, self.sk): "BNSS", (self.b, self.n, 1, self.sk): "BN1S",
                 (1, self.n, self.sq, self.sk): "1NSS"}
        _check(pse.dim() == 4 and tuple(pse.shape) in forms,
               f"pse {tuple(pse.shape)} must be BNSS, BN1Skv or 1NSS for {(self.b, self.n, self.sq, self.sk)}")
        return pse.to(_ACC)

    def _visible(self, mask, pre, nxt, sparse_mode) -> Optional[Tensor]:
        """Bool, broadcastable to [B, N, Sq, Skv]: True where a key takes part. None: everything does."""
        if mask is None:  # the documented rule: no mask means full attention, sparse_mode and tokens ignored
            return None
        _check(mask.dtype in (torch.bool, torch.uint8), f"atten_mask must be bool or uint8, got {mask.dtype}")
        i = torch.arange(self.sq).unsqueeze(-1)
        j = torch.arange(self.sk)
        if sparse_mode in (2, 3):
            size = COMPRESSED_MASK_SIZE
            _check(tuple(mask.shape) == (size, size) and torch.equal(
                mask.bool(), torch.ones(size, size, dtype=torch.bool).triu(1)),
                f"sparse_mode {sparse_mode} takes the compressed {size}x{size} upper-triangular mask")
            return j <= i if sparse_mode == 2 else j <= i + (self.sk - self.sq)
        _unsupported(sparse_mode in (0, 1), f"sparse_mode {sparse_mode} (emulated: 0, 1, 2, 3)")
        forms = [(self.sq, self.sk), (1, 1, self.sq, self.sk), (self.b, 1, self.sq, self.sk),
                 (self.b, self.n, self.sq, self.sk)]
        _check(tuple(mask.shape) in forms, f"atten_mask {tuple(mask.shape)} must be SS, 11SS, B1SS or BNSS: {forms}")
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
    _unsupported(dropout_mask is None, "an explicit dropout_mask")
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
    _unsupported(softmax_max is not None and softmax_sum is not None and attention_in is not None,
                 "a grad call without softmax_max, softmax_sum and attention_in (torch_npu's autograd passes all)")
    a = _Attention(query, key, value, head_num, input_layout, pse, padding_mask, atten_mask, scale_value,
                   keep_prob, pre_tockens, next_tockens, prefix, actual_seq_qlen, actual_seq_kvlen, sparse_mode,
                   sink)
    stat_shape = (a.b, a.n, a.sq, 8)
    _check(tuple(softmax_max.shape) == stat_shape == tuple(softmax_sum.shape),
           f"softmax_max/softmax_sum must be {stat_shape}, got {tuple(softmax_max.shape)}, "
           f"{tuple(softmax_sum.shape)}")
    if keep_prob < 1.0:
        _check(numels == a.numels, f"numels must be the forward's B·N·Sq·Skv = {a.numels}, got {numels}")
    row_max = softmax_max[..., :1].to(_ACC)
    row_sum = softmax_sum[..., :1].to(_ACC)
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
    _unsupported(input_layout in _LAYOUTS, f"input_layout {input_layout!r} (emulated: {_LAYOUTS})")
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


# ==== norms ====================================================================================================

def _norm_dims(x: Tensor, gamma: Tensor) -> tuple[int, ...]:
    g = gamma.dim()
    _check(0 < g <= x.dim() and tuple(x.shape[x.dim() - g:]) == tuple(gamma.shape),
           f"gamma {tuple(gamma.shape)} must match the trailing dims of x {tuple(x.shape)}")
    return tuple(range(x.dim() - g, x.dim()))


def _stat_shape(x: Tensor, gamma: Tensor) -> tuple[int, ...]:
    return (*x.shape[: x.dim() - gamma.dim()], *([1] * gamma.dim()))


def _leading_sum(t: Tensor, gamma: Tensor) -> Tensor:
    """Σ over the dims in front of gamma's: a parameter's gradient, fp32."""
    return t.sum(tuple(range(t.dim() - gamma.dim()))) if t.dim() > gamma.dim() else t


def npu_rms_norm(x, gamma, epsilon=1e-06):
    """rstd = 1/√(mean(x²) + eps) over gamma's dims; y = x·rstd·γ. Returns (y: x.dtype, rstd: fp32)."""
    _check_float(self=x, gamma=gamma)
    dims = _norm_dims(x, gamma)
    xf = x.to(_ACC)
    rstd = torch.rsqrt(xf.square().mean(dims, keepdim=True) + epsilon)
    return (xf * rstd * gamma.to(_ACC)).to(x.dtype), rstd


def npu_rms_norm_backward(dy, x, gamma, rstd):
    """dx = rstd·dy·γ − x·rstd³·mean(dy·γ·x); dγ = Σ dy·x·rstd. Returns (dx: x.dtype, dγ: fp32)."""
    dims = _norm_dims(x, gamma)
    xf, dyf, gf = x.to(_ACC), dy.to(_ACC), gamma.to(_ACC)
    dx = rstd * dyf * gf - xf * rstd.pow(3) * (dyf * gf * xf).mean(dims, keepdim=True)
    return dx.to(x.dtype), _leading_sum(dyf * xf * rstd, gamma)


def npu_add_rms_norm(x1, x2, gamma, epsilon=1e-06):
    """x = x1 + x2; returns (rms_norm(x)·γ, rstd, x in x1.dtype)."""
    _check(x1.shape == x2.shape, f"x1 {tuple(x1.shape)} and x2 {tuple(x2.shape)} must have one shape")
    _check_float(x1=x1, x2=x2, gamma=gamma)
    total = x1.to(_ACC) + x2.to(_ACC)
    y, rstd = npu_rms_norm(total, gamma.to(_ACC), epsilon)
    return y.to(x1.dtype), rstd, total.to(x1.dtype)


def _layer_norm_stats(x1, x2, gamma):
    _check(x1.shape == x2.shape, f"x1 {tuple(x1.shape)} and x2 {tuple(x2.shape)} must have one shape")
    dims = _norm_dims(x1, gamma)
    total = x1.to(_ACC) + x2.to(_ACC)
    mean = total.mean(dims, keepdim=True)
    return dims, total, mean


def npu_add_layer_norm(x1, x2, gamma, beta, epsilon=1e-05, additional_output=False):
    """x = x1 + x2; y = (x − mean)·rstd·γ + β with the biased variance. Returns (y, mean, rstd, x)."""
    _check_float(x1=x1, x2=x2, gamma=gamma, beta=beta)
    dims, total, mean = _layer_norm_stats(x1, x2, gamma)
    rstd = torch.rsqrt((total - mean).square().mean(dims, keepdim=True) + epsilon)
    y = (total - mean) * rstd * gamma.to(_ACC) + beta.to(_ACC)
    return y.to(x1.dtype), mean, rstd, total.to(x1.dtype)


def npu_add_layer_norm_backward(dy_opt, x1, x2, rstd, mean, gamma, dsum_opt):
    """dx = rstd·(g − mean(g) − x̂·mean(g·x̂)) + dsum with g = dy·γ, x̂ = (x − mean)·rstd; returns
    (dx, dx, dγ, dβ): the same gradient for both summands."""
    dims, total, _ = _layer_norm_stats(x1, x2, gamma)
    x_hat = (total - mean) * rstd
    dyf = torch.zeros_like(total) if dy_opt is None else dy_opt.to(_ACC)
    g = dyf * gamma.to(_ACC)
    dx = rstd * (g - g.mean(dims, keepdim=True) - x_hat * (g * x_hat).mean(dims, keepdim=True))
    if dsum_opt is not None:
        dx = dx + dsum_opt.to(_ACC)
    dx = dx.to(x1.dtype)
    return dx, dx.clone(), _leading_sum(dyf * x_hat, gamma), _leading_sum(dyf, gamma)


# ==== activations ==============================================================================================

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_FAST_GELU_K = 1.702


def _check_approximate(approximate: str) -> None:
    _check(approximate in ("none", "tanh"), f"approximate must be 'none' or 'tanh', got {approximate!r}")


def npu_gelu(x, *, approximate="none"):
    """'none': x·Φ(x); 'tanh': 0.5x(1 + tanh(√(2/π)(x + 0.044715x³)))."""
    _check_float(self=x)
    _check_approximate(approximate)
    xf = x.to(_ACC)
    if approximate == "tanh":
        y = 0.5 * xf * (1.0 + torch.tanh(_SQRT_2_OVER_PI * (xf + 0.044715 * xf.pow(3))))
    else:
        y = 0.5 * xf * (1.0 + torch.erf(xf / math.sqrt(2.0)))
    return y.to(x.dtype)


def npu_gelu_backward(grad_output, x, *, approximate="none"):
    _check_approximate(approximate)
    xf = x.to(_ACC)
    if approximate == "tanh":
        t = torch.tanh(_SQRT_2_OVER_PI * (xf + 0.044715 * xf.pow(3)))
        slope = 0.5 * (1.0 + t) + 0.5 * xf * (1.0 - t * t) * _SQRT_2_OVER_PI * (1.0 + 3 * 0.044715 * xf * xf)
    else:
        slope = 0.5 * (1.0 + torch.erf(xf / math.sqrt(2.0))) + xf * torch.exp(-0.5 * xf * xf) / math.sqrt(2 * math.pi)
    return (grad_output.to(_ACC) * slope).to(x.dtype)


def npu_fast_gelu(x):
    """x·σ(1.702x), in the documented form x·e^{0.851(x−|x|)} / (1 + e^{−1.702|x|}) (no overflow)."""
    _check_float(self=x)
    xf = x.to(_ACC)
    y = xf * torch.exp(0.5 * _FAST_GELU_K * (xf - xf.abs())) / (1.0 + torch.exp(-_FAST_GELU_K * xf.abs()))
    return y.to(x.dtype)


def npu_fast_gelu_backward(grad, x):
    """g·(σ + 1.702x·σ(1 − σ)) with σ = σ(1.702x)."""
    xf = x.to(_ACC)
    sig = torch.sigmoid(_FAST_GELU_K * xf)
    return (grad.to(_ACC) * (sig + _FAST_GELU_K * xf * sig * (1.0 - sig))).to(x.dtype)


def _swiglu_halves(x: Tensor, dim: int) -> tuple[Tensor, Tensor]:
    _check_float(self=x)
    _check(x.is_contiguous(), "npu_swiglu takes a contiguous input")
    _check(x.shape[dim] % 2 == 0, f"npu_swiglu needs an even size along dim {dim}, got {tuple(x.shape)}")
    a, b = x.to(_ACC).chunk(2, dim=dim)
    return a, b


def npu_swiglu(x, dim=-1):
    """A, B = chunk(x, 2, dim); A·σ(A)·B, half of x along dim."""
    a, b = _swiglu_halves(x, dim)
    return (a * torch.sigmoid(a) * b).to(x.dtype)


def npu_swiglu_backward(grad_output, x, dim=-1):
    a, b = _swiglu_halves(x, dim)
    g = grad_output.to(_ACC)
    sig = torch.sigmoid(a)
    grad_a = g * b * sig * (1.0 + a * (1.0 - sig))
    return torch.cat([grad_a, g * a * sig], dim=dim).to(x.dtype)


# ==== rotary ===================================================================================================

_MAX_ROTARY_DIM = 896


def _rotate(t: Tensor, mode: str) -> Tensor:
    """half: cat(−x₂, x₁) over the halves of the last dim; interleave: each (x₂ᵢ, x₂ᵢ₊₁) -> (−x₂ᵢ₊₁, x₂ᵢ)."""
    if mode == "half":
        half = t.shape[-1] // 2
        return torch.cat([-t[..., half:], t[..., :half]], dim=-1)
    pairs = t.unflatten(-1, (-1, 2))
    return torch.stack([-pairs[..., 1], pairs[..., 0]], dim=-1).flatten(-2)


def _check_rotary(x: Tensor, r1: Tensor, r2: Tensor, mode: str) -> None:
    _unsupported(mode in ("half", "interleave"), f"rotary_mode {mode!r} (A2/A3 take half and interleave)")
    _check_float(self=x, r1=r1, r2=r2)
    _check(x.dim() == 4, f"npu_rotary_mul takes a 4-D input, got {tuple(x.shape)}")
    d = x.shape[-1]
    _check(d % 2 == 0 and d < _MAX_ROTARY_DIM, f"the last dim must be even and below {_MAX_ROTARY_DIM}, got {d}")
    _check(r1.shape == r2.shape and r1.dim() == 4 and r1.shape[-1] == d
           and torch.broadcast_shapes(r1.shape, x.shape) == x.shape,
           f"r1 {tuple(r1.shape)} and r2 {tuple(r2.shape)} must be 4-D and broadcast to x {tuple(x.shape)}")


def npu_rotary_mul(x, r1, r2, rotary_mode="half", rotate=None):
    """x·r1 + rot(x)·r2; with `rotate` given, rot(x) = x @ rotate."""
    _check_rotary(x, r1, r2, rotary_mode)
    xf = x.to(_ACC)
    rotated = xf @ rotate.to(_ACC) if rotate is not None else _rotate(xf, rotary_mode)
    return (xf * r1.to(_ACC) + rotated * r2.to(_ACC)).to(x.dtype)


def npu_rotary_mul_backward(grad, x, r1, r2, rotary_mode="half"):
    """rot is a signed permutation with rotᵀ = −rot: dx = g·r1 − rot(g·r2); dr1 = Σ g·x, dr2 = Σ g·rot(x),
    reduced to r1's shape. Returns (dx, dr1, dr2) in x's dtype."""
    _check_rotary(x, r1, r2, rotary_mode)
    g, xf = grad.to(_ACC), x.to(_ACC)
    dx = g * r1.to(_ACC) - _rotate(g * r2.to(_ACC), rotary_mode)
    dr1 = (g * xf).sum_to_size(r1.shape)
    dr2 = (g * _rotate(xf, rotary_mode)).sum_to_size(r2.shape)
    return dx.to(x.dtype), dr1.to(x.dtype).contiguous(), dr2.to(x.dtype).contiguous()


# ==== fakes: torch_npu's output shapes and dtypes ==============================================================

def _like(t: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    return t.new_empty(t.shape, dtype=dtype or t.dtype)


def _rms_norm_fake(x, gamma, epsilon=1e-06):
    return _like(x), x.new_empty(_stat_shape(x, gamma), dtype=torch.float32)


def _add_layer_norm_fake(x1, x2, gamma, beta, epsilon=1e-05, additional_output=False):
    stat = x1.new_empty(_stat_shape(x1, gamma), dtype=torch.float32)
    return _like(x1), stat, torch.empty_like(stat), _like(x1)


def _swiglu_fake(x, dim=-1):
    shape = list(x.shape)
    _check(shape[dim] % 2 == 0, f"npu_swiglu needs an even size along dim {dim}, got {tuple(x.shape)}")
    shape[dim] //= 2
    return x.new_empty(shape)


_KERNELS = {
    "npu_fusion_attention": npu_fusion_attention,
    "npu_fusion_attention_grad": npu_fusion_attention_grad,
    "npu_rms_norm": npu_rms_norm,
    "npu_rms_norm_backward": npu_rms_norm_backward,
    "npu_add_rms_norm": npu_add_rms_norm,
    "npu_add_layer_norm": npu_add_layer_norm,
    "npu_add_layer_norm_backward": npu_add_layer_norm_backward,
    "npu_gelu": npu_gelu,
    "npu_gelu_backward": npu_gelu_backward,
    "npu_fast_gelu": npu_fast_gelu,
    "npu_fast_gelu_backward": npu_fast_gelu_backward,
    "npu_swiglu": npu_swiglu,
    "npu_swiglu_backward": npu_swiglu_backward,
    "npu_rotary_mul": npu_rotary_mul,
    "npu_rotary_mul_backward": npu_rotary_mul_backward,
}

_FAKES = {
    "npu_fusion_attention": _npu_fusion_attention_fake,
    "npu_fusion_attention_grad": _npu_fusion_attention_grad_fake,
    "npu_rms_norm": _rms_norm_fake,
    "npu_rms_norm_backward": lambda dy, x, gamma, rstd: (_like(x), _like(gamma, torch.float32)),
    "npu_add_rms_norm": lambda x1, x2, gamma, epsilon=1e-06: (*_rms_norm_fake(x1, gamma), _like(x1)),
    "npu_add_layer_norm": _add_layer_norm_fake,
    "npu_add_layer_norm_backward": lambda dy, x1, x2, rstd, mean, gamma, dsum: (
        _like(x1), _like(x1), _like(gamma, torch.float32), _like(gamma, torch.float32)),
    "npu_gelu": lambda x, *, approximate="none": _like(x),
    "npu_gelu_backward": lambda grad_output, x, *, approximate="none": _like(x),
    "npu_fast_gelu": lambda x: _like(x),
    "npu_fast_gelu_backward": lambda grad, x: _like(x),
    "npu_swiglu": _swiglu_fake,
    "npu_swiglu_backward": lambda grad_output, x, dim=-1: _like(x),
    "npu_rotary_mul": lambda x, r1, r2, rotary_mode="half", rotate=None: _like(x),
    "npu_rotary_mul_backward": lambda grad, x, r1, r2, rotary_mode="half": (
        _like(x), _like(r1, x.dtype), _like(r2, x.dtype)),
}


# ---- MC2: matmul fused with a collective, emulated over a real process group -----------------------------------
# On npu-sim, ``hcom`` is the c10d group name (what ``_c10d_functional`` ops carry; "0" for the default group),
# not an HCCL communicator name. The collective runs synchronously over that group (gloo on the CPU); the math is
# the documented one: AllGather₀(x1) @ x2 (+ bias), ReduceScatter₀(x1 @ x2 + bias), AllReduce(x1 @ x2 + bias + x3).
# The device's constraints are enforced, so a lowering that breaks them fails here as it would on the NPU.

_MC2_DTYPES = (torch.float16, torch.bfloat16)


def _mc2_group(hcom: str, world_size: Optional[int] = None):
    from torch.distributed.distributed_c10d import _resolve_process_group

    try:
        group = _resolve_process_group(hcom)
    except Exception as e:
        # Only a c10d group can stand in for an HCCL communicator on the CPU: without one nothing is emulated.
        raise NotImplementedError(
            f"npu-sim emulates MC2 ops over the c10d process group named by hcom; {hcom!r} names none ({e})") from e
    _check(world_size is None or world_size == group.size(),
           f"world_size {world_size} differs from the size {group.size()} of group {hcom!r}")
    return group


def _mc2_operands(op: str, x1: Tensor, x2: Tensor, two_d: bool = True) -> None:
    _check(x1.dtype in _MC2_DTYPES and x2.dtype == x1.dtype,
           f"{op}: x1 and x2 must be float16 or bfloat16 of one dtype, got {x1.dtype} and {x2.dtype}")
    _check(x2.dim() == 2 and (x1.dim() == 2 if two_d else x1.dim() in (2, 3)),
           f"{op}: bad ranks x1 {tuple(x1.shape)}, x2 {tuple(x2.shape)}")
    _check(x1.shape[-1] == x2.shape[0], f"{op}: k mismatch {tuple(x1.shape)} @ {tuple(x2.shape)}")


def _mc2_ag_rs_limits(op: str, x1: Tensor, world_size: int, bias, comm_turn: int, scales) -> None:
    _check(world_size in (2, 4, 8), f"{op}: world_size must be 2, 4 or 8, got {world_size}")
    _check(256 <= x1.shape[1] < 65535, f"{op}: k must be in [256, 65535), got {x1.shape[1]}")
    _check(bias is None, f"{op}: bias is not supported (must be None)")
    _check(comm_turn == 0, f"{op}: comm_turn must be 0")
    _unsupported(all(s is None for s in scales), f"{op}: the quantized path (x1_scale / x2_scale)")


def npu_all_gather_base_mm(x1, x2, hcom, world_size, *, bias=None, x1_scale=None, x2_scale=None, gather_index=0,
                           gather_output=True, comm_turn=0, output_dtype=None, comm_mode=None):
    op = "npu_all_gather_base_mm"
    _mc2_operands(op, x1, x2)
    _mc2_ag_rs_limits(op, x1, world_size, bias, comm_turn, (x1_scale, x2_scale))
    _check(gather_index == 0, f"{op}: gather_index must be 0")
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
    _check(reduce_op == "sum", f"{op}: reduce_op must be 'sum'")
    _check(x1.shape[0] % world_size == 0, f"{op}: m = {x1.shape[0]} not divisible by world_size {world_size}")
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
    _check(group.size() in (1, 2, 4, 8), f"{op}: 1, 2, 4 or 8 ranks, got {group.size()}")
    _check(reduce_op == "sum", f"{op}: reduce_op must be 'sum'")
    _check(comm_turn == 0, f"{op}: comm_turn must be 0")
    _unsupported(all(t is None for t in (antiquant_scale, antiquant_offset, dequant_scale, pertoken_scale,
                                         comm_quant_scale_1, comm_quant_scale_2)), f"{op}: the quantized path")
    if bias is not None:
        _check(bias.dim() == 1 and bias.shape[0] == x2.shape[1], f"{op}: bias must be 1-D of size n")
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


_MC2_KERNELS = {
    "npu_all_gather_base_mm": npu_all_gather_base_mm,
    "npu_mm_reduce_scatter_base": npu_mm_reduce_scatter_base,
    "npu_mm_all_reduce_base": npu_mm_all_reduce_base,
}

_MC2_FAKES = {
    "npu_all_gather_base_mm": _all_gather_base_mm_fake,
    "npu_mm_reduce_scatter_base": _mm_reduce_scatter_base_fake,
    "npu_mm_all_reduce_base": _mm_all_reduce_base_fake,
}
