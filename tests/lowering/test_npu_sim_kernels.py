"""npu-sim's emulator against the documented semantics: published values where torch_npu's docs and tests give
them, else a dense reference written here (gradients by autograd of that reference)."""

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from npu_compile.lowering import npu_sim
from npu_compile.lowering.npu.schemas import MC2

npu_sim.register()
npu = torch.ops.npu
B, N, NKV, SQ, SK, D = 2, 4, 2, 6, 9, 8


def _grad(fn, inputs, grad_out):
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    fn(*leaves).backward(grad_out)
    return [t.grad for t in leaves]


# ---- activations ------------------------------------------------------------------------------------------

def test_fast_gelu_documented_values():
    x = torch.tensor([1.0, 2.0, 3.0, 4.0])
    torch.testing.assert_close(npu.npu_fast_gelu(x), torch.tensor([0.8458, 1.9357, 2.9819, 3.9956]), atol=1e-4, rtol=0)
    # op-plugin's test gradients at x = 1 and 2, with a unit incoming gradient
    grads = npu.npu_fast_gelu_backward(torch.ones(2), torch.tensor([1.0, 2.0]))
    torch.testing.assert_close(grads, torch.tensor([1.0677795, 1.0738151]), atol=1e-6, rtol=0)
    # no overflow where exp(-1.702x) would
    assert torch.isfinite(npu.npu_fast_gelu(torch.tensor([-100.0, 100.0]))).all()


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_is_aten_gelu(approximate):
    x, g = torch.randn(64), torch.randn(64)
    torch.testing.assert_close(npu.npu_gelu(x, approximate=approximate), F.gelu(x, approximate=approximate))
    expected = _grad(lambda t: F.gelu(t, approximate=approximate), [x], g)[0]
    torch.testing.assert_close(npu.npu_gelu_backward(g, x, approximate=approximate), expected)


def test_swiglu_halves_the_dim():
    x = torch.randn(3, 4, 10)
    for dim in (-1, 1):
        y = npu.npu_swiglu(x, dim)
        a, b = x.chunk(2, dim)
        assert y.shape == a.shape
        torch.testing.assert_close(y, F.silu(a) * b)
        g = torch.randn_like(y)
        expected = _grad(lambda t: (lambda a, b: F.silu(a) * b)(*t.chunk(2, dim)), [x], g)[0]
        torch.testing.assert_close(npu.npu_swiglu_backward(g, x, dim), expected)
    with pytest.raises(ValueError, match="contiguous"):
        npu.npu_swiglu(x.transpose(0, 2), -1)


# ---- norms ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_rstd_shape_and_dtype(dtype):
    x = torch.randn(2, 3, 8, dtype=dtype)
    y, rstd = npu.npu_rms_norm(x, torch.ones(8, dtype=dtype))
    assert (y.dtype, rstd.dtype, tuple(rstd.shape)) == (dtype, torch.float32, (2, 3, 1))
    _, rstd2 = npu.npu_rms_norm(x, torch.ones(3, 8, dtype=dtype))  # the last gamma.dim() dims
    assert tuple(rstd2.shape) == (2, 1, 1)
    torch.testing.assert_close(rstd2, torch.rsqrt(x.float().square().mean((1, 2), keepdim=True) + 1e-6))


def test_rms_norm_backward_is_autograd_of_rms_norm():
    x, w, g = torch.randn(5, 16), torch.randn(16), torch.randn(5, 16)
    ref = lambda x, w: x * torch.rsqrt(x.square().mean(-1, keepdim=True) + 1e-6) * w  # noqa: E731
    y, rstd = npu.npu_rms_norm(x, w)
    torch.testing.assert_close(y, ref(x, w))
    dx, dw = npu.npu_rms_norm_backward(g, x, w, rstd)
    torch.testing.assert_close([dx, dw], _grad(ref, [x, w], g))
    assert dw.dtype == torch.float32


def test_add_rms_norm_returns_the_sum():
    x1, x2, w = torch.randn(4, 8), torch.randn(4, 8), torch.randn(8)
    y, rstd, total = npu.npu_add_rms_norm(x1, x2, w)
    torch.testing.assert_close(total, x1 + x2)
    torch.testing.assert_close((y, rstd), npu.npu_rms_norm(x1 + x2, w))


def test_add_layer_norm_and_its_backward_returning_dx_twice():
    x1, x2, w, b = torch.randn(4, 8), torch.randn(4, 8), torch.randn(8), torch.randn(8)
    y, mean, rstd, total = npu.npu_add_layer_norm(x1, x2, w, b, 1e-5, True)
    torch.testing.assert_close(y, F.layer_norm(x1 + x2, (8,), w, b, 1e-5))
    assert tuple(mean.shape) == tuple(rstd.shape) == (4, 1) and mean.dtype == torch.float32
    torch.testing.assert_close(total, x1 + x2)
    g, g_sum = torch.randn(4, 8), torch.randn(4, 8)
    dx1, dx2, dw, db = npu.npu_add_layer_norm_backward(g, x1, x2, rstd, mean, w, g_sum)
    leaves = [t.clone().requires_grad_() for t in (x1, x2, w, b)]
    s = leaves[0] + leaves[1]
    (F.layer_norm(s, (8,), leaves[2], leaves[3], 1e-5) * g + s * g_sum).sum().backward()
    torch.testing.assert_close(dx1, leaves[0].grad)
    torch.testing.assert_close(dx2, leaves[1].grad)
    assert dx1.data_ptr() != dx2.data_ptr()
    torch.testing.assert_close((dw, db), (leaves[2].grad, leaves[3].grad))


# ---- rotary -----------------------------------------------------------------------------------------------

def _rotate(x, mode):
    if mode == "half":
        x1, x2 = x.chunk(2, -1)
        return torch.cat([-x2, x1], -1)
    return torch.stack([-x[..., 1::2], x[..., ::2]], -1).flatten(-2)


@pytest.mark.parametrize("mode", ["half", "interleave"])
def test_rotary_mul_both_modes(mode):
    x = torch.randn(5, 2, 3, 8)
    angles = torch.rand(5, 1, 1, 8)
    r1, r2 = angles.cos(), angles.sin()
    ref = lambda x, r1, r2: x * r1 + _rotate(x, mode) * r2  # noqa: E731
    torch.testing.assert_close(npu.npu_rotary_mul(x, r1, r2, mode), ref(x, r1, r2))
    g = torch.randn_like(x)
    dx, dr1, dr2 = npu.npu_rotary_mul_backward(g, x, r1, r2, mode)
    leaves = [t.clone().requires_grad_() for t in (x, r1, r2)]
    ref(*leaves).backward(g)
    torch.testing.assert_close((dx, dr1, dr2), tuple(t.grad for t in leaves))
    assert dr1.shape == r1.shape


def test_rotary_mul_half_mode_example():
    # half mode by hand: x = [1, 2, 3, 4], rot(x) = [-3, -4, 1, 2]
    x = torch.tensor([1.0, 2.0, 3.0, 4.0]).view(1, 1, 1, 4)
    out = npu.npu_rotary_mul(x, torch.full_like(x, 2.0), torch.ones_like(x))
    assert out.flatten().tolist() == [-1.0, 0.0, 7.0, 10.0]
    out = npu.npu_rotary_mul(x, torch.zeros_like(x), torch.ones_like(x), "interleave")
    assert out.flatten().tolist() == [-2.0, 1.0, -4.0, 3.0]


# ---- npu_fusion_attention ---------------------------------------------------------------------------------

def _to_layout(t, layout):
    """[b, n, s, d] -> layout."""
    b, n, s, d = t.shape
    return {"BNSD": t, "BSND": t.transpose(1, 2), "BSH": t.transpose(1, 2).reshape(b, s, n * d),
            "SBH": t.permute(2, 0, 1, 3).reshape(s, b, n * d)}[layout].contiguous()


def _dense(q, k, v, scale, visible, pse=None, keep=None, keep_prob=1.0):
    """softmax(scale·(QKᵀ + pse)) over the visible keys, V-weighted; [b, n, s, d] in and out, GQA by grouping."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = q @ k.transpose(-1, -2)
    if pse is not None:
        s = s + pse
    s = (s * scale).masked_fill(~visible, float("-inf"))
    p = torch.nan_to_num(s.softmax(-1), nan=0.0)  # a fully masked row: zeros
    if keep is not None:
        p = p * keep / keep_prob
    return p @ v


def _sim(layout, q, k, v, **kw):
    return npu.npu_fusion_attention(*(_to_layout(t, layout) for t in (q, k, v)), N, layout, **kw)


def _sim_grad(layout, q, k, v, g, fwd, **kw):
    out, smax, ssum, *_ = fwd
    grad_kw = {("scale_value" if k_ == "scale" else k_): val for k_, val in kw.items()}
    return npu.npu_fusion_attention_grad(
        *(_to_layout(t, layout) for t in (q, k, v, g)), N, layout, softmax_max=smax, softmax_sum=ssum,
        attention_in=out, **grad_kw)


def _check_against_dense(layout, kw, visible, pse=None, keep=None):
    torch.manual_seed(0)
    q, k, v = torch.randn(B, N, SQ, D), torch.randn(B, NKV, SK, D), torch.randn(B, NKV, SK, D - 2)
    scale = kw["scale"]
    fwd = _sim(layout, q, k, v, **kw)
    expected = _dense(q, k, v, scale, visible, pse, keep, kw.get("keep_prob", 1.0))
    torch.testing.assert_close(fwd[0], _to_layout(expected, layout), rtol=1e-5, atol=1e-6)
    g = torch.randn(B, N, SQ, D - 2)
    grads = _sim_grad(layout, q, k, v, g, fwd, **kw)
    expected_grads = _grad(lambda q, k, v: _dense(q, k, v, scale, visible, pse, keep, kw.get("keep_prob", 1.0)),
                           [q, k, v], g)
    for got, want in zip(grads[:3], expected_grads):
        torch.testing.assert_close(got, _to_layout(want, layout), rtol=1e-5, atol=1e-5)
    return fwd, grads


def _mask(*shape):
    return torch.rand(*shape) < 0.3


@pytest.mark.parametrize("layout", ["BNSD", "BSND", "BSH", "SBH"])
def test_sparse_mode_0_explicit_mask(layout):
    mask = _mask(B, 1, SQ, SK)  # B1SS, True = masked
    _check_against_dense(layout, dict(scale=0.4, atten_mask=mask, sparse_mode=0), ~mask)


def test_sparse_mode_0_band_tokens_and_mask_forms():
    i, j = torch.arange(SQ).unsqueeze(-1), torch.arange(SK)
    mask = _mask(SQ, SK)  # SS
    band = (j >= i - 2) & (j <= i + 1)
    _check_against_dense("BNSD", dict(scale=0.3, atten_mask=mask, sparse_mode=0, pre_tockens=2, next_tockens=1),
                         ~mask & band)
    full = _mask(B, N, SQ, SK)  # BNSS
    _check_against_dense("BNSD", dict(scale=0.3, atten_mask=full, sparse_mode=1), ~full)


@pytest.mark.parametrize("mode", [2, 3])
def test_causal_sparse_modes_with_the_compressed_mask(mode):
    compressed = torch.ones(2048, 2048, dtype=torch.bool).triu(1)
    i, j = torch.arange(SQ).unsqueeze(-1), torch.arange(SK)
    visible = j <= i if mode == 2 else j <= i + (SK - SQ)
    _check_against_dense("SBH", dict(scale=0.35, atten_mask=compressed, sparse_mode=mode), visible)
    with pytest.raises(ValueError, match="compressed"):
        _sim("BNSD", torch.randn(B, N, SQ, D), torch.randn(B, N, SK, D), torch.randn(B, N, SK, D),
             atten_mask=torch.ones(SQ, SK, dtype=torch.bool).triu(1), sparse_mode=mode)


def test_no_mask_is_full_attention_whatever_the_sparse_mode():
    _check_against_dense("BSH", dict(scale=0.5, sparse_mode=2), torch.ones(SQ, SK, dtype=torch.bool))


def test_pse_is_added_before_the_scale():
    pse = torch.randn(1, N, SQ, SK)
    mask = _mask(SQ, SK)
    _, grads = _check_against_dense("BNSD", dict(scale=0.25, atten_mask=mask, pse=pse), ~mask, pse=pse)
    assert grads[3].shape == pse.shape


def test_dropout_forward_and_grad_agree_given_seed_and_offset():
    keep = npu_sim.attention.dropout_keep_mask(5, 11, (B, N, SQ, SK), 0.75)
    assert 0.6 < keep.float().mean() < 0.9
    q, k, v = torch.randn(B, N, SQ, D), torch.randn(B, NKV, SK, D), torch.randn(B, NKV, SK, D)
    out, smax, ssum, _, seed, offset, numels = _sim("BNSD", q, k, v, scale=0.3, keep_prob=0.75, seed=5, offset=11)
    assert (seed, offset, numels) == (5, 11, B * N * SQ * SK)
    visible = torch.ones(SQ, SK, dtype=torch.bool)
    torch.testing.assert_close(out, _dense(q, k, v, 0.3, visible, keep=keep, keep_prob=0.75))
    g = torch.randn_like(out)
    grads = npu.npu_fusion_attention_grad(q, k, v, g, N, "BNSD", softmax_max=smax, softmax_sum=ssum,
                                          attention_in=out, scale_value=0.3, keep_prob=0.75, seed=5, offset=11,
                                          numels=numels)
    expected = _grad(lambda q, k, v: _dense(q, k, v, 0.3, visible, keep=keep, keep_prob=0.75), [q, k, v], g)
    for got, want in zip(grads[:3], expected):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="numels"):
        npu.npu_fusion_attention_grad(q, k, v, g, N, "BNSD", softmax_max=smax, softmax_sum=ssum, attention_in=out,
                                      scale_value=0.3, keep_prob=0.75, seed=5, offset=11, numels=0)


def test_attention_outputs_have_torch_npus_shapes():
    q, k, v = torch.randn(SQ, B, N * D), torch.randn(SK, B, NKV * D), torch.randn(SK, B, NKV * (D - 2))
    out, smax, ssum, softmax_out, *ints = npu.npu_fusion_attention(q, k, v, N, "SBH", scale=0.3)
    assert tuple(out.shape) == (SQ, B, N * (D - 2))
    assert smax.dtype == ssum.dtype == torch.float32 and tuple(smax.shape) == tuple(ssum.shape) == (B, N, SQ, 8)
    assert (smax == smax[..., :1]).all()  # one value, repeated 8 times
    assert tuple(softmax_out.shape) == (0,) and all(isinstance(i, int) for i in ints)
    with torch._subclasses.FakeTensorMode() as mode:
        fake = npu.npu_fusion_attention(*(mode.from_tensor(t) for t in (q, k, v)), N, "SBH", scale=0.3)
    assert [tuple(t.shape) for t in fake[:4]] == [tuple(t.shape) for t in (out, smax, ssum, softmax_out)]


def test_fully_masked_rows_give_zeros():
    mask = torch.zeros(SQ, SK, dtype=torch.bool)
    mask[2] = True
    q, k, v = torch.randn(B, N, SQ, D), torch.randn(B, N, SK, D), torch.randn(B, N, SK, D)
    out, smax, ssum, *_ = npu.npu_fusion_attention(q, k, v, N, "BNSD", atten_mask=mask, scale=0.3, inner_precise=2)
    assert (out[:, :, 2] == 0).all() and (ssum[:, :, 2] == 0).all()
    grads = npu.npu_fusion_attention_grad(q, k, v, torch.randn_like(out), N, "BNSD", atten_mask=mask,
                                          softmax_max=smax, softmax_sum=ssum, attention_in=out, scale_value=0.3)
    assert all(torch.isfinite(g).all() for g in grads[:3]) and (grads[0][:, :, 2] == 0).all()


# ---- registration -----------------------------------------------------------------------------------------

def test_mc2_ops_need_the_process_group_hcom_names():
    for name in MC2:
        assert getattr(npu, name).default._schema.name == f"npu::{name}"
    with pytest.raises(NotImplementedError, match="over the c10d process group named by hcom; 'group' names none"):
        npu.npu_mm_all_reduce_base(torch.randn(2, 4), torch.randn(4, 3), "group")


def test_refuses_where_torch_npu_is_installed(monkeypatch):
    monkeypatch.setattr(npu_sim, "_library", None)
    monkeypatch.setattr(npu_sim, "torch_npu_installed", lambda: True)
    with pytest.raises(RuntimeError, match="cannot run where torch_npu is installed"):
        npu_sim.register()


def test_nothing_registers_at_import():
    code = ("import torch, npu_compile, npu_compile.backend, npu_compile.lowering.npu_sim; "
            "print(hasattr(torch.ops.npu, 'npu_rms_norm'))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                            env={"TORCH_DEVICE_BACKEND_AUTOLOAD": "0", "PATH": ""})
    assert result.stdout.strip() == "False", result.stderr[-2000:]



def test_outputs_have_the_fakes_strides_for_strided_inputs():
    """The device writes dense outputs and the fakes say so; an emulation that kept a transposed input's strides
    broke a later view in the lowered graph at run time ("view size is not compatible ...")."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    x = torch.randn(4, 2, 3, 16).transpose(0, 1)  # [2, 4, 3, 16], not contiguous
    grad = torch.randn(4, 2, 3, 16).transpose(0, 1)
    cos, sin = torch.randn(1, 1, 3, 16), torch.randn(1, 1, 3, 16)
    calls = [
        (npu.npu_rotary_mul_backward, (grad, x, cos, sin)),
        (npu.npu_rotary_mul, (x, cos, sin)),
        (npu.npu_gelu, (x,)),
        (npu.npu_rms_norm, (x, torch.ones(16))),
    ]
    mode = FakeTensorMode()
    for op, args in calls:
        real = op(*args)
        with mode:
            fake = op(*(mode.from_tensor(a) for a in args))
        real, fake = (r if isinstance(r, tuple) else (r,) for r in (real, fake))
        for r, f in zip(real, fake):
            assert r.shape == f.shape and r.stride() == f.stride(), (op, r.stride(), f.stride())


# ---- npu_fusion_attention_v3 / _grad_v3 (the graph-mode versions) -------------------------------------------

def test_v3_returns_its_seed_and_offset_and_its_grad_drops_what_the_forward_dropped():
    """v3 draws its own dropout seed and returns (seed, offset) as int64 tensors; given them, grad_v3 equals
    npu_fusion_attention / _grad run with the same pair as ints, values and gradients."""
    torch.manual_seed(0)
    q, k, v = torch.randn(B, N, SQ, D), torch.randn(B, NKV, SK, D), torch.randn(B, NKV, SK, D)
    g = torch.randn(B, N, SQ, D)
    out, smax, ssum, _, seed, offset = npu.npu_fusion_attention_v3(q, k, v, N, "BNSD", scale=0.3, keep_prob=0.8)
    assert seed.dtype == offset.dtype == torch.int64 and seed.shape == offset.shape == (1,)
    want = npu.npu_fusion_attention(q, k, v, N, "BNSD", scale=0.3, keep_prob=0.8, seed=int(seed), offset=int(offset))
    for got, expected in zip((out, smax, ssum), want[:3]):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
    grads = npu.npu_fusion_attention_grad_v3(q, k, v, g, N, "BNSD", softmax_max=smax, softmax_sum=ssum,
                                             attention_in=out, scale_value=0.3, keep_prob=0.8, seed=seed,
                                             offset=offset)
    expected = npu.npu_fusion_attention_grad(q, k, v, g, N, "BNSD", softmax_max=smax, softmax_sum=ssum,
                                             attention_in=out, scale_value=0.3, keep_prob=0.8, seed=int(seed),
                                             offset=int(offset), numels=B * N * SQ * SK)
    for got, want_ in zip(grads[:3], expected[:3]):
        torch.testing.assert_close(got, want_, rtol=0, atol=0)
    # without dropout nothing is drawn: the pair is 0, and the global random stream is left alone
    state = torch.get_rng_state()
    *_, seed0, offset0 = npu.npu_fusion_attention_v3(q, k, v, N, "BNSD", scale=0.3)
    assert (int(seed0), int(offset0)) == (0, 0) and torch.equal(torch.get_rng_state(), state)
    with pytest.raises(ValueError, match="^npu-sim: keep_prob < 1 needs the seed and offset tensors "
                                         "npu_fusion_attention_v3 returned$"):
        npu.npu_fusion_attention_grad_v3(q, k, v, g, N, "BNSD", softmax_max=smax, softmax_sum=ssum,
                                         attention_in=out, keep_prob=0.8)


# ---- npu_fusion_attention in TND (variable-length documents) ------------------------------------------------

def _dense_documents(q, k, v, ends, scale):
    """Dense attention over [T, N, D] with one causal block per document (ends: cumulative, trailing zeros cut)."""
    t = q.shape[0]
    doc = torch.full((t,), -1)
    start = 0
    for i, end in enumerate(ends):
        if end < start:
            break
        doc[start:end] = i
        start = end
    pos = torch.arange(t)
    visible = (doc[:, None] == doc[None, :]) & (pos[None, :] <= pos[:, None]) & (doc[:, None] >= 0)
    group = q.shape[1] // k.shape[1]
    qh, kh, vh = q.transpose(0, 1), k.repeat_interleave(group, 1).transpose(0, 1), v.repeat_interleave(group, 1).transpose(0, 1)
    s = (qh @ kh.transpose(-1, -2) * scale).masked_fill(~visible, -float("inf"))
    p = torch.nan_to_num(torch.softmax(s, -1))  # tokens in no document: 0
    return (p @ vh).transpose(0, 1)


@pytest.mark.parametrize("ends", [[3, 7, 7, 12], [5, 9, 0, 0]], ids=["empty_document", "trailing_zeros"])
def test_tnd_is_causal_attention_per_document(ends):
    torch.manual_seed(0)
    t = 12
    q, k, v = torch.randn(t, N, D), torch.randn(t, NKV, D), torch.randn(t, NKV, D)
    mask = torch.ones(2048, 2048, dtype=torch.bool).triu(1)
    cu = torch.tensor(ends)
    out, softmax_max, softmax_sum, *_ = npu.npu_fusion_attention_v3(
        q, k, v, N, "TND", atten_mask=mask, scale=0.3, sparse_mode=2, actual_seq_qlen=cu, actual_seq_kvlen=cu,
        softmax_layout="TND")
    torch.testing.assert_close(out, _dense_documents(q, k, v, ends, 0.3), rtol=1e-5, atol=1e-5)
    assert softmax_max.shape == softmax_sum.shape == (t, N, 8)
    grad_out = torch.randn_like(out)
    grads = npu.npu_fusion_attention_grad_v3(
        q, k, v, grad_out, N, "TND", atten_mask=mask, softmax_max=softmax_max, softmax_sum=softmax_sum,
        attention_in=out, scale_value=0.3, sparse_mode=2, actual_seq_qlen=cu, actual_seq_kvlen=cu,
        softmax_layout="TND")[:3]
    want = _grad(lambda a, b, c: _dense_documents(a, b, c, ends, 0.3), (q, k, v), grad_out)
    for got, w in zip(grads, want):
        torch.testing.assert_close(got, w, rtol=1e-5, atol=1e-5)


def test_tnd_refusals():
    q = torch.randn(8, N, D)
    k = torch.randn(8, NKV, D)
    with pytest.raises(ValueError, match="input_layout TND needs actual_seq_qlen"):
        npu.npu_fusion_attention(q, k, k, N, "TND", softmax_layout="TND")
    with pytest.raises(NotImplementedError, match="softmax_layout '' in TND"):
        npu.npu_fusion_attention(q, k, k, N, "TND", actual_seq_qlen=[8], actual_seq_kvlen=[8])


# ---- grouped matmul ---------------------------------------------------------------------------------------

def test_grouped_matmul_list_form_is_one_matmul_per_group():
    """The documented example's shapes (DOCS, npu_grouped_matmul: three groups of different k and n, with bias),
    scaled down: y_i = x_i × weight_i + bias_i, shaped as META gives (x_i's rows, weight_i's n), in x's dtype."""
    gen = torch.Generator().manual_seed(0)
    shapes = [((4, 4), (4, 4)), ((16, 4), (4, 16)), ((8, 16), (16, 2))]
    x = [torch.randn(*a, generator=gen, dtype=torch.bfloat16) for a, _ in shapes]
    w = [torch.randn(*b, generator=gen, dtype=torch.bfloat16) for _, b in shapes]
    bias = [torch.randn(b[1], generator=gen, dtype=torch.bfloat16) for _, b in shapes]
    ys = npu.npu_grouped_matmul(x, w, bias=bias, split_item=0, group_type=-1)
    for y, a, b, c in zip(ys, x, w, bias):
        assert y.dtype == torch.bfloat16 and y.shape == (a.shape[0], b.shape[1])
        torch.testing.assert_close(y.float(), (a.double() @ b.double() + c.double()).float(), rtol=2e-2, atol=2e-2)
    # a transposed weight (a view) is taken as its values
    wt = [torch.randn(b[1], b[0], generator=gen).t() for _, b in shapes]
    xs = [a.float() for a in x]
    for y, a, b in zip(npu.npu_grouped_matmul(xs, wt, group_type=-1), xs, wt):
        torch.testing.assert_close(y, a @ b)


def test_grouped_matmul_forms_not_emulated_are_refused():
    x, w = [torch.randn(3, 4)], [torch.randn(4, 5)]
    with pytest.raises(NotImplementedError, match="npu-sim does not emulate npu_grouped_matmul with group_list"):
        npu.npu_grouped_matmul(x, w, group_list=torch.tensor([3]), split_item=3, group_type=0)
    with pytest.raises(NotImplementedError, match="npu-sim does not emulate quantized npu_grouped_matmul"):
        npu.npu_grouped_matmul(x, w, scale=[torch.ones(5, dtype=torch.int64)])
    with pytest.raises(ValueError, match=r"npu-sim: x\[0\] \(3, 4\) torch.float32 and weight\[0\] \(5, 4\)"):
        npu.npu_grouped_matmul(x, [torch.randn(5, 4)])


# ---- token unpermute --------------------------------------------------------------------------------------

def test_moe_token_unpermute_with_routing_map_sums_each_tokens_slots():
    """The documented example's inputs without its probs (DOCS, npu_moe_token_unpermute_with_routing_map: rows
    [1,1,1,1] and [2,2,2,2], sorted_indices [0, 1], restore_shape [2, 4]: topK 1), then 3 tokens x topK 2 slots in
    fp16: token t sums the rows sorted_indices[2t] and sorted_indices[2t + 1] name, -1 an empty slot (DOCS)."""
    rows = torch.tensor([[1, 1, 1, 1], [2, 2, 2, 2]], dtype=torch.float16)
    out = npu.npu_moe_token_unpermute_with_routing_map(rows, torch.tensor([0, 1], dtype=torch.int32), [2, 4])
    assert out.dtype == torch.float16 and torch.equal(out, rows)
    rows = torch.arange(18, dtype=torch.float16).view(6, 3)
    out = npu.npu_moe_token_unpermute_with_routing_map(rows, torch.tensor([4, 0, 5, -1, 1, 2], dtype=torch.int32),
                                                       [3, 3])
    torch.testing.assert_close(out, torch.stack([rows[4] + rows[0], rows[5], rows[1] + rows[2]]))


def test_moe_token_unpermute_with_routing_map_undoes_the_permute_by_its_sorted_indices():
    """MindSpeed's pairing (mindspeed/te/pytorch/permutation.py: the permute's sorted_indices fed to the unpermute):
    each token comes back as the sum of its topK copies; megatron-core's row tokens (each row's token, what the
    reference unpermute takes) would not."""
    tokens = torch.randn(5, 4)
    routing_map = torch.zeros(5, 4, dtype=torch.bool).scatter(1, torch.rand(5, 4).argsort(1)[:, :2], True)
    permuted, _, sorted_indices = npu.npu_moe_token_permute_with_routing_map(tokens, routing_map, num_out_tokens=10)
    out = npu.npu_moe_token_unpermute_with_routing_map(permuted, sorted_indices, [5, 4])
    torch.testing.assert_close(out, 2 * tokens)
    row_tokens = torch.arange(5).expand(4, -1).masked_select(routing_map.t()).int()
    assert not torch.allclose(npu.npu_moe_token_unpermute_with_routing_map(permuted, row_tokens, [5, 4]), 2 * tokens)


def test_moe_token_unpermute_forms_not_emulated_are_refused():
    rows, index = torch.randn(2, 4), torch.tensor([0, 1], dtype=torch.int32)
    with pytest.raises(NotImplementedError, match="npu-sim does not emulate npu_moe_token_unpermute_with_routing_map "
                                                  "with probs, a routing map or drop_and_pad"):
        npu.npu_moe_token_unpermute_with_routing_map(rows, index, [2, 4], probs=torch.ones(2, 2),
                                                     routing_map=torch.eye(2, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"sorted_indices must be int32 \[2\], got \(2,\) torch.int64"):
        npu.npu_moe_token_unpermute_with_routing_map(rows, index.long(), [2, 4])
    with pytest.raises(ValueError, match=r"the 2 rows must be tokens x topK slots with 0 < topK <= 512, for 3 "
                                         r"tokens"):
        npu.npu_moe_token_unpermute_with_routing_map(rows, index, [3, 4])
    with pytest.raises(ValueError, match=r"sorted_indices must lie in \[-1, 2\)"):
        npu.npu_moe_token_unpermute_with_routing_map(rows, index + 1, [1, 4])


# ---- token permute ----------------------------------------------------------------------------------------

def test_moe_token_permute_with_routing_map_is_the_documented_example():
    """DOCS, npu_moe_token_permute_with_routing_map: tokens rows 0.1, 0.2, 0.3 (fp16), routing map all ones over 2
    experts (int8), num_out_tokens 6: each expert's tokens in order, and sorted_indices the slot layout
    (permuted_tokens[sorted_indices[i]] = tokens[i // topK])."""
    tokens = torch.tensor([[0.1] * 4, [0.2] * 4, [0.3] * 4], dtype=torch.float16)
    permuted, probs, sorted_indices = npu.npu_moe_token_permute_with_routing_map(
        tokens, torch.ones(3, 2, dtype=torch.int8), num_out_tokens=6, drop_and_pad=False)
    assert permuted.dtype == torch.float16 and torch.equal(permuted, tokens[[0, 1, 2, 0, 1, 2]])
    assert probs.shape == (0,)
    assert sorted_indices.dtype == torch.int32 and sorted_indices.tolist() == [0, 3, 1, 4, 2, 5]
    assert torch.equal(permuted[sorted_indices.long()], tokens.repeat_interleave(2, dim=0))


def test_moe_token_permute_with_routing_map_permutes_probs_and_checks_the_rows():
    tokens, probs = torch.randn(3, 4, dtype=torch.bfloat16), torch.rand(3, 3)  # float32 probs, bf16 tokens: DOCS
    routing_map = torch.tensor([[True, False, True], [False, True, True], [True, True, False]])
    permuted, permuted_probs, sorted_indices = npu.npu_moe_token_permute_with_routing_map(
        tokens, routing_map, probs=probs, num_out_tokens=6)
    assert torch.equal(permuted, tokens[[0, 2, 1, 2, 0, 1]])  # expert 0: tokens 0, 2; expert 1: 1, 2; expert 2: 0, 1
    assert torch.equal(permuted_probs, probs.t()[routing_map.t()]) and permuted_probs.dtype == torch.float32
    assert sorted_indices.tolist() == [0, 4, 2, 5, 1, 3]
    with pytest.raises(ValueError, match=r"every routing-map row must hold topK = num_out_tokens // tokens = 1 "
                                         r"experts, got \[2\]"):
        npu.npu_moe_token_permute_with_routing_map(tokens, routing_map, num_out_tokens=5)
    with pytest.raises(ValueError, match=r"probs must have the tokens' dtype \(or be float32 with bfloat16 tokens\), "
                                         r"got torch.float16"):
        npu.npu_moe_token_permute_with_routing_map(tokens, routing_map, probs=probs.half(), num_out_tokens=6)
    with pytest.raises(NotImplementedError, match="npu-sim does not emulate npu_moe_token_permute_with_routing_map "
                                                  "with drop_and_pad"):
        npu.npu_moe_token_permute_with_routing_map(tokens, routing_map, num_out_tokens=6, drop_and_pad=True)
