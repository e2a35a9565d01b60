"""npu_compile::rotary (and rotary_backward) against Megatron's apply_rotary_pos_emb written out in plain torch."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.library import opcheck

import npu_compile.ops  # noqa: F401  (importing registers the ops)

from .helpers import assert_matches, fuzz_settings, leaf, strided_leaf

rotary = torch.ops.npu_compile.rotary
rotary_backward = torch.ops.npu_compile.rotary_backward


def megatron_rope(t, cos, sin, mode):
    """Megatron's _apply_rotary_pos_emb_bshd with precomputed cos/sin: rotate the first r channels
    (_rotate_half, or the interleaved stack), pass the rest through."""
    r = cos.shape[-1]
    t, t_pass = t[..., :r], t[..., r:]
    if mode == "half":
        x1, x2 = torch.chunk(t, 2, dim=-1)
        rotated = torch.cat((-x2, x1), dim=-1)
    else:
        x1, x2 = t[..., ::2], t[..., 1::2]
        rotated = torch.stack((-x2, x1), dim=-1).flatten(-2)
    return torch.cat((t * cos + rotated * sin, t_pass), dim=-1)


def frequencies(seq, rot_dim, mode, gen):
    """cos/sin [s, 1, 1, r] as Megatron's RotaryEmbedding builds them (cat or pair-repeat of the freqs)."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rot_dim, 2, dtype=torch.float32) / rot_dim))
    positions = torch.arange(seq, dtype=torch.float32) + torch.randint(0, 100, (1,), generator=gen)
    freqs = torch.outer(positions, inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1) if mode == "half" else freqs.repeat_interleave(2, dim=-1)
    return emb.cos()[:, None, None, :], emb.sin()[:, None, None, :]


@st.composite
def rotary_cases(draw):
    d = 2 * draw(st.integers(1, 8))
    return dict(
        s=draw(st.integers(1, 9)), b=draw(st.integers(1, 3)), n=draw(st.integers(1, 3)), d=d,
        rot_dim=2 * draw(st.integers(1, d // 2)),
        mode=draw(st.sampled_from(["half", "interleave"])),
        dtype=draw(st.sampled_from([torch.float32, torch.bfloat16])),
        cos_dtype=draw(st.sampled_from(["x", "fp32"])),
        broadcast=draw(st.sampled_from(["s11r", "sb1r", "full"])),
        cos_sin_grad=draw(st.booleans()),
        style=draw(st.sampled_from(["contiguous", "split", "bnsd-view"])),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


def check_rotary(case):
    gen = torch.Generator().manual_seed(case["seed"])
    s, b, n, d, r, dtype = case["s"], case["b"], case["n"], case["d"], case["rot_dim"], case["dtype"]
    if case["style"] == "split":  # q out of a fused qkv projection
        x = torch.randn(s, b, n, 3 * d, generator=gen).to(dtype)[..., d:2 * d]
    elif case["style"] == "bnsd-view":
        x = torch.randn(b, n, s, d, generator=gen).to(dtype).permute(2, 0, 1, 3)
    else:
        x = torch.randn(s, b, n, d, generator=gen).to(dtype)
    x = strided_leaf(x)
    cos, sin = frequencies(s, r, case["mode"], gen)
    if case["broadcast"] != "s11r":
        cos, sin = (t.expand(s, b, n if case["broadcast"] == "full" else 1, r) * (1 + 0.1 * torch.randn(
            s, b, n if case["broadcast"] == "full" else 1, r, generator=gen)) for t in (cos, sin))
    cos_dtype = dtype if case["cos_dtype"] == "x" else torch.float32
    cos, sin = (t.to(cos_dtype).requires_grad_(case["cos_sin_grad"]) for t in (cos, sin))
    grad_out = torch.randn(s, b, n, d, generator=gen).to(dtype)

    out = rotary(x, cos, sin, case["mode"])
    assert out.dtype == dtype and out.is_contiguous() and out.shape == x.shape
    inputs = (x, cos, sin) if case["cos_sin_grad"] else (x,)
    ref_in = [leaf(t, torch.float32) for t in inputs]
    ref_cos, ref_sin = (ref_in[1], ref_in[2]) if case["cos_sin_grad"] else (cos.float(), sin.float())
    ref = megatron_rope(ref_in[0], ref_cos, ref_sin, case["mode"])
    assert_matches(out, ref, dtype, "out")
    assert torch.equal(out[..., r:], x[..., r:]), "the unrotated channels pass through bit for bit"
    for got, want, t in zip(torch.autograd.grad(out, inputs, grad_out),
                            torch.autograd.grad(ref, ref_in, grad_out.float()), inputs):
        assert got.dtype == t.dtype and got.shape == t.shape
        assert_matches(got, want, dtype, "grad")


@settings(max_examples=210)
@given(rotary_cases())
def test_matches_megatron_rope(case):
    check_rotary(case)


@pytest.mark.fuzz
@fuzz_settings()
@given(rotary_cases())
def test_rotary_fuzz(case):
    check_rotary(case)


def test_interleave_is_complex_multiplication():
    """Interleaved RoPE is x·e^{iθ} with the pairs as complex numbers: an anchor independent of Megatron."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 2, 3, 8, generator=gen)
    theta = torch.randn(5, 1, 1, 4, generator=gen)
    want = torch.view_as_real(torch.view_as_complex(x.unflatten(-1, (4, 2))) * torch.polar(torch.ones_like(theta),
                                                                                               theta)).flatten(-2)
    got = rotary(x, theta.cos().repeat_interleave(2, -1), theta.sin().repeat_interleave(2, -1), "interleave")
    assert_matches(got, want, torch.float32, "out")


def test_x_is_saved_only_when_cos_sin_need_grad():
    x = torch.randn(4, 2, 2, 8, requires_grad=True)
    cos, sin = torch.randn(4, 1, 1, 8), torch.randn(4, 1, 1, 8)
    for needs_grad in (False, True):
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            rotary(x, cos.requires_grad_(needs_grad), sin, "half")
        assert any(t is x for t in saved) == needs_grad


def test_bad_arguments_are_refused():
    x = torch.randn(3, 1, 2, 8)
    with pytest.raises(ValueError):
        rotary(x, torch.randn(3, 1, 1, 3), torch.randn(3, 1, 1, 3))  # odd rotated width
    with pytest.raises(ValueError):
        rotary(x, torch.randn(3, 1, 1, 10), torch.randn(3, 1, 1, 10))  # wider than x
    with pytest.raises(ValueError):
        rotary(x, torch.randn(3, 1, 1, 8), torch.randn(3, 1, 1, 8), "rotate")


# ---- registration: opcheck and float64 gradcheck ------------------------------------------------------

@pytest.mark.parametrize("mode", ["half", "interleave"])
def test_opcheck(mode):
    gen = torch.Generator().manual_seed(1)
    strided = torch.randn(6, 2, 3, 24, generator=gen)[..., 8:16].requires_grad_()
    permuted = torch.randn(2, 3, 6, 8, generator=gen).permute(2, 0, 1, 3).requires_grad_()
    cos, sin = torch.randn(6, 1, 1, 8, generator=gen), torch.randn(6, 1, 1, 8, generator=gen)
    partial_cos, partial_sin = cos[..., :4], sin[..., :4]
    grad = torch.randn(2, 3, 6, 8, generator=gen).permute(2, 0, 1, 3)
    for x in (strided, permuted):
        opcheck(rotary.default, (x, cos, sin, mode))
        opcheck(rotary.default, (x, partial_cos, partial_sin, mode))
        opcheck(rotary.default, (x, cos.clone().requires_grad_(), sin.clone().requires_grad_(), mode))
        opcheck(rotary_backward.default, (grad, x.detach(), cos, sin, mode, True))
        opcheck(rotary_backward.default, (grad, None, partial_cos, partial_sin, mode, False))


@pytest.mark.parametrize("mode", ["half", "interleave"])
def test_gradcheck_float64(mode):
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(3, 2, 2, 6, generator=gen, dtype=torch.float64, requires_grad=True)
    cos, sin = (torch.randn(3, 1, 1, 4, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(2))
    assert torch.autograd.gradcheck(lambda x, c, s: rotary(x, c, s, mode), (x, cos, sin))
    assert torch.autograd.gradcheck(lambda x: rotary(x, cos.detach(), sin.detach(), mode), (x,))
