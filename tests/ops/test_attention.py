"""npu_compile::fused_attention and its backward against eager attention written out in plain torch."""

import contextlib
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.library import opcheck
from torch.profiler import ProfilerActivity, profile

from npu_compile.ops import attention

from .helpers import assert_matches, fuzz_settings, leaf, strided_leaf

fused_attention = torch.ops.npu_compile.fused_attention
fused_attention_backward = torch.ops.npu_compile.fused_attention_backward
LAYOUTS = ("sbnd", "bsnd", "bnsd")


@contextlib.contextmanager
def fast_path(enabled: bool):
    """Whether eligible calls take torch's fused attention kernels (attention.FAST_PATH) or the tiles."""
    saved = attention.FAST_PATH
    attention.FAST_PATH = enabled
    try:
        yield
    finally:
        attention.FAST_PATH = saved


@contextlib.contextmanager
def query_tile(rows: int):
    """Small tiles let small test shapes cross many tile boundaries (and partial last tiles)."""
    saved = attention.QUERY_TILE
    attention.QUERY_TILE = rows
    try:
        yield
    finally:
        attention.QUERY_TILE = saved


# ---- the eager reference, written independently of the op ---------------------------------------------

def ref_to_bnsd(t, layout):
    return {"bnsd": lambda: t, "sbnd": lambda: t.permute(1, 2, 0, 3), "bsnd": lambda: t.permute(0, 2, 1, 3)}[layout]()


def ref_from_bnsd(t, layout):
    return {"bnsd": lambda: t, "sbnd": lambda: t.permute(2, 0, 1, 3), "bsnd": lambda: t.permute(0, 2, 1, 3)}[layout]()


def eager_attention(q, k, v, *, layout="bnsd", attn_mask=None, attn_bias=None, scale=None, causal=False,
                    fill=None, keep=None, p=0.0):
    """softmax(q kᵀ·scale + bias, masked) v, GQA by repeat_interleave; `keep` is a [b, nq, sq, sk] dropout
    keep mask. Rows with nothing visible (fill=None) give 0, as the op documents."""
    q, k, v = (ref_to_bnsd(t, layout) for t in (q, k, v))
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = q @ k.transpose(-1, -2) * scale
    if attn_bias is not None:
        s = s + attn_bias
    masked = torch.zeros(s.shape, dtype=torch.bool)
    if attn_mask is not None:
        masked = masked | attn_mask
    if causal:
        masked = masked | torch.ones(s.shape[-2], s.shape[-1], dtype=torch.bool).triu(1)
    if fill is not None:
        probs = torch.softmax(s.masked_fill(masked, fill), dim=-1)
    else:
        s = s.masked_fill(masked, -math.inf)
        dead = (s == -math.inf).all(dim=-1, keepdim=True)
        probs = torch.softmax(s.masked_fill(dead, 0.0), dim=-1).masked_fill(dead, 0.0)
    if keep is not None:
        probs = probs * keep / (1.0 - p)
    return ref_from_bnsd(probs @ v, layout)


def recover_keep_mask(seed, p, b, nq, sq, sk):
    """The op's dropout keep mask, read off the op itself: with q = k = 0 every probability is 1/sk, and with
    v = I (per head) the output is the dropped probability matrix."""
    q = torch.zeros(b, nq, sq, 1)
    k = torch.zeros(b, nq, sk, 1)
    v = torch.eye(sk).expand(b, nq, sk, sk)
    out, *_ = fused_attention(q, k, v, None, None, seed, layout="bnsd", scale=1.0, dropout_p=p)
    return out > 0


# ---- inputs -------------------------------------------------------------------------------------------

def make(shape_bnsd, layout, style, gen, dtype=torch.float32):
    """A tensor with the layout's shape: contiguous, a split view of a wider buffer (as q/k/v split from a
    fused QKV projection), or a permuted view of a contiguous tensor."""
    b, n, s, d = shape_bnsd
    shape = {"bnsd": (b, n, s, d), "sbnd": (s, b, n, d), "bsnd": (b, s, n, d)}[layout]
    if style == "split":
        return torch.randn(*shape[:-1], 3 * d, generator=gen).to(dtype)[..., d:2 * d]
    if style == "permuted":
        return torch.randn(shape[2], shape[1], shape[0], shape[3], generator=gen).to(dtype).permute(2, 1, 0, 3)
    return torch.randn(*shape, generator=gen).to(dtype)


MASK_KINDS = ("none", "causal", "padding", "bool", "bool2d", "additive", "causal+padding", "bool+additive")


@st.composite
def attention_cases(draw, dropout=False):
    nkv = draw(st.integers(1, 2))
    case = dict(
        dtype=draw(st.sampled_from([torch.float32, torch.bfloat16])),
        layout=draw(st.sampled_from(LAYOUTS)),
        style=draw(st.sampled_from(["contiguous", "split", "permuted"])),
        b=draw(st.integers(1, 2)), nkv=nkv, nq=nkv * draw(st.sampled_from([1, 2, 3])),
        sq=draw(st.integers(1, 17)), sk=draw(st.integers(1, 17)),
        d=draw(st.sampled_from([4, 8])), dv=draw(st.sampled_from([4, 6, 8])),
        mask=draw(st.sampled_from(MASK_KINDS)),
        mask_b=draw(st.booleans()), mask_n=draw(st.booleans()), mask_rows=draw(st.booleans()),
        bias_grad=draw(st.booleans()),
        fill=draw(st.sampled_from([None, -10000.0])),
        scale=draw(st.sampled_from([None, 0.3, 1.0])),
        tile=draw(st.sampled_from([1, 4, 7, 256])),
        fast=draw(st.booleans()),
        p=draw(st.sampled_from([0.1, 0.5, 0.9])) if dropout else 0.0,
        seed=draw(st.integers(0, 2**40)),
    )
    return case


def build(case):
    gen = torch.Generator().manual_seed(case["seed"] % 2**31)
    b, nq, nkv, sq, sk = case["b"], case["nq"], case["nkv"], case["sq"], case["sk"]
    q = make((b, nq, sq, case["d"]), case["layout"], case["style"], gen, case["dtype"])
    k = make((b, nkv, sk, case["d"]), case["layout"], case["style"], gen, case["dtype"])
    v = make((b, nkv, sk, case["dv"]), case["layout"], case["style"], gen, case["dtype"])
    kind = case["mask"]
    mask_shape = (b if case["mask_b"] else 1, nq if case["mask_n"] else 1, sq if case["mask_rows"] else 1, sk)
    attn_mask = attn_bias = None
    if "padding" in kind:
        attn_mask = torch.rand(b, 1, 1, sk, generator=gen) < 0.3
    if kind.startswith("bool"):
        attn_mask = torch.rand(*mask_shape, generator=gen) < 0.3
    if kind == "bool2d":
        attn_mask = torch.rand(sq, sk, generator=gen) < 0.3
    if "additive" in kind:
        attn_bias = (2 * torch.randn(*mask_shape, generator=gen)).to(case["dtype"])
    seed = torch.tensor(case["seed"], dtype=torch.int64) if case["p"] > 0 else None
    grad_out_shape = {"bnsd": (b, nq, sq, case["dv"]), "sbnd": (sq, b, nq, case["dv"]),
                      "bsnd": (b, sq, nq, case["dv"])}[case["layout"]]
    grad_out = torch.randn(*grad_out_shape, generator=gen).to(case["dtype"])
    return q, k, v, attn_mask, attn_bias, seed, grad_out


def check_against_eager(case):
    q, k, v, attn_mask, attn_bias, seed, grad_out = build(case)
    dtype, layout, p = case["dtype"], case["layout"], case["p"]
    options = dict(layout=layout, scale=case["scale"], dropout_p=p, causal="causal" in case["mask"], fill=case["fill"])
    with_bias_grad = attn_bias is not None and case["bias_grad"]
    inputs = [strided_leaf(q), strided_leaf(k), strided_leaf(v)] + ([leaf(attn_bias)] if with_bias_grad else [])
    bias = inputs[3] if with_bias_grad else attn_bias
    with query_tile(case["tile"]), fast_path(case["fast"]):
        out, softmax_max, softmax_sum = fused_attention(*inputs[:3], attn_mask, bias, seed, **options)
        grads = torch.autograd.grad(out, inputs, grad_out)
        keep = recover_keep_mask(seed, p, case["b"], case["nq"], case["sq"], case["sk"]) if p > 0 else None

    ref_inputs = [leaf(t, torch.float32) for t in inputs]
    ref_bias = ref_inputs[3] if with_bias_grad else (None if attn_bias is None else attn_bias.float())
    ref_options = dict(options, p=options.pop("dropout_p"))
    ref = eager_attention(*ref_inputs[:3], attn_mask=attn_mask, attn_bias=ref_bias, keep=keep, **ref_options)
    ref_grads = torch.autograd.grad(ref, ref_inputs, grad_out.float())

    assert out.dtype == dtype and out.is_contiguous() and out.shape == ref.shape
    for stat in (softmax_max, softmax_sum):
        assert stat.dtype == torch.float32 and stat.shape == (case["b"], case["nq"], case["sq"])
    assert not out.isnan().any() and not any(g.isnan().any() for g in grads)
    assert_matches(out, ref, dtype, "out")
    for name, got, want in zip(["dq", "dk", "dv", "dbias"], grads, ref_grads):
        assert got.shape == want.shape
        assert_matches(got, want, dtype, name)


@settings(max_examples=200)
@given(attention_cases())
def test_matches_eager(case):
    check_against_eager(case)


@settings(max_examples=100)
@given(attention_cases(dropout=True))
def test_dropout_matches_eager_with_the_same_keep_mask(case):
    check_against_eager(case)


@settings(max_examples=60)
@given(attention_cases(), st.sampled_from(LAYOUTS))
def test_layouts_agree(case, other_layout):
    """The same problem in two layouts gives the same numbers, laid out differently."""
    case = dict(case, dtype=torch.float32)
    q, k, v, attn_mask, attn_bias, seed, grad_out = build(case)
    options = dict(scale=case["scale"], causal="causal" in case["mask"], fill=case["fill"])
    layout = case["layout"]

    def moved(t):
        return ref_from_bnsd(ref_to_bnsd(t, layout), other_layout).detach().requires_grad_()

    with query_tile(case["tile"]), fast_path(case["fast"]):
        a_in = [strided_leaf(t) for t in (q, k, v)]
        a_out, *a_stats = fused_attention(*a_in, attn_mask, attn_bias, seed, layout=layout, **options)
        a_grads = torch.autograd.grad(a_out, a_in, grad_out)
        b_in = [moved(t) for t in (q, k, v)]
        b_out, *b_stats = fused_attention(*b_in, attn_mask, attn_bias, seed, layout=other_layout, **options)
        b_grads = torch.autograd.grad(b_out, b_in, ref_from_bnsd(ref_to_bnsd(grad_out, layout), other_layout))
    assert b_out.is_contiguous()
    assert_matches(ref_to_bnsd(b_out, other_layout), ref_to_bnsd(a_out, layout), torch.float32, "out")
    for got, want in zip(b_stats, a_stats):
        assert_matches(got, want, torch.float32, "softmax statistics")
    for got, want in zip(b_grads, a_grads):
        assert_matches(ref_to_bnsd(got, other_layout), ref_to_bnsd(want, layout), torch.float32, "grad")


@pytest.mark.fuzz
@fuzz_settings()
@given(attention_cases())
def test_matches_eager_fuzz(case):
    check_against_eager(case)


@pytest.mark.fuzz
@fuzz_settings()
@given(attention_cases(dropout=True))
def test_dropout_matches_eager_fuzz(case):
    check_against_eager(case)


# ---- anchors: the semantics of the code the op replaces -----------------------------------------------

def test_megatron_core_attention_semantics():
    """Megatron's DotProductAttention: baddbmm(alpha=scale), masked_fill_(mask, -10000.0), softmax, bmm,
    permute to [s, b, h]. fused_attention(layout="sbnd", fill=-10000.0) then view(s, b, h) is the same."""
    gen = torch.Generator().manual_seed(0)
    s, b, n, d = 12, 2, 4, 8
    qkv = torch.randn(s, b, n, 3 * d, generator=gen)
    q, k, v = (leaf(t) for t in qkv.split(d, dim=-1))
    mask = torch.ones(s, s, dtype=torch.bool).triu(1).view(1, 1, s, s)
    scale = 1.0 / math.sqrt(d)

    scores = torch.baddbmm(torch.empty(b * n, s, s), q.reshape(s, b * n, d).transpose(0, 1),
                           k.reshape(s, b * n, d).transpose(0, 1).transpose(1, 2), beta=0.0, alpha=scale)
    scores = scores.view(b, n, s, s).masked_fill(mask, -10000.0)
    probs = torch.softmax(scores, dim=-1)
    context = torch.bmm(probs.view(b * n, s, s), v.reshape(s, b * n, d).transpose(0, 1))
    megatron = context.view(b, n, s, d).permute(2, 0, 1, 3).contiguous().view(s, b, n * d)

    out, *_ = fused_attention(q, k, v, mask, None, None, layout="sbnd", scale=scale, fill=-10000.0)
    fused = out.view(s, b, n * d)  # free: out is contiguous in sbnd
    assert_matches(fused, megatron, torch.float32, "out")
    grad = torch.randn(s, b, n * d, generator=gen)
    for got, want in zip(torch.autograd.grad(fused, (q, k, v), grad), torch.autograd.grad(megatron, (q, k, v), grad)):
        assert_matches(got, want, torch.float32, "grad")


@pytest.mark.parametrize("mask_kind", ["bool", "float", "causal"])
def test_sdpa_semantics(mask_kind):
    """SDPA's bool mask means "take part" and its float mask is added after the scale; GQA via enable_gqa."""
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(2, 4, 9, 8, generator=gen)
    k, v = torch.randn(2, 2, 11, 8, generator=gen), torch.randn(2, 2, 11, 8, generator=gen)
    masked = torch.rand(2, 1, 9, 11, generator=gen) < 0.3
    masked[..., 0] = False  # SDPA gives NaN on rows with nothing visible
    bias = torch.randn(1, 4, 9, 11, generator=gen)
    if mask_kind == "bool":
        want = F.scaled_dot_product_attention(q, k, v, attn_mask=~masked, scale=0.2, enable_gqa=True)
        got, *_ = fused_attention(q, k, v, masked, None, None, scale=0.2)
    elif mask_kind == "float":
        want = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=0.2, enable_gqa=True)
        got, *_ = fused_attention(q, k, v, None, bias, None, scale=0.2)
    else:
        want = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        got, *_ = fused_attention(q, k, v, causal=True)
    assert_matches(got, want, torch.float32, "out")


# ---- edge cases ---------------------------------------------------------------------------------------

def test_fully_masked_rows_give_zero_without_fill_and_uniform_with_megatron_fill():
    gen = torch.Generator().manual_seed(2)
    q, k, v = (leaf(torch.randn(1, 2, 5, 4, generator=gen)) for _ in range(3))
    mask = torch.zeros(1, 1, 5, 5, dtype=torch.bool)
    mask[..., 2, :] = True  # query row 2 sees nothing
    out, softmax_max, softmax_sum = fused_attention(q, k, v, mask, None, None)
    grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    assert torch.equal(out[:, :, 2], torch.zeros_like(out[:, :, 2]))
    assert (softmax_sum[:, :, 2] == 0).all() and (softmax_max[:, :, 2] == 0).all()
    assert torch.equal(grads[0][:, :, 2], torch.zeros_like(grads[0][:, :, 2]))
    assert all(torch.isfinite(g).all() for g in grads)

    out_megatron, *_ = fused_attention(q, k, v, mask, None, None, fill=-10000.0)
    assert_matches(out_megatron[:, :, 2], v.mean(dim=2), torch.float32, "uniform row")


def test_rows_hidden_by_an_infinite_bias_give_zero():
    gen = torch.Generator().manual_seed(3)
    q, k, v = (leaf(torch.randn(1, 1, 4, 4, generator=gen)) for _ in range(3))
    bias = torch.zeros(1, 1, 4, 4)
    bias[..., 1, :] = -math.inf
    bias[..., 3, 1:] = -math.inf
    out, *_ = fused_attention(q, k, v, None, bias, None)
    grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    assert torch.equal(out[0, 0, 1], torch.zeros(4))
    assert_matches(out[0, 0, 3], v[0, 0, 0], torch.float32, "single visible key")
    assert all(torch.isfinite(g).all() for g in grads)


def test_keep_mask_helper_is_the_ops_mask():
    seed = torch.tensor(99)
    with query_tile(5):
        recovered = recover_keep_mask(seed, 0.4, 2, 3, 13, 6)
        helper = attention.attention_dropout_keep_mask(seed, 0.4, 2, 3, 13, 6)
    assert helper.dtype == torch.bool and torch.equal(helper, recovered)


def test_dropout_keeps_one_minus_p_and_preserves_the_mean():
    """q = k = 0 makes every probability 1/sk; with v = 1 the output row is the mean of keep/(1-p)."""
    p, b, n, s = 0.3, 2, 4, 256
    keep = recover_keep_mask(torch.tensor(5), p, b, n, s, s)
    assert abs(keep.float().mean().item() - (1 - p)) < 0.01  # 524288 draws: sd 6e-4
    out, *_ = fused_attention(torch.zeros(b, n, s, 4), torch.zeros(b, n, s, 4), torch.ones(b, n, s, 4), None, None,
                             torch.tensor(6), dropout_p=p)
    assert abs(out.mean().item() - 1.0) < 0.01


def test_different_seeds_drop_differently_and_the_same_seed_repeats():
    a = recover_keep_mask(torch.tensor(1), 0.5, 1, 2, 8, 8)
    assert torch.equal(a, recover_keep_mask(torch.tensor(1), 0.5, 1, 2, 8, 8))
    assert not torch.equal(a, recover_keep_mask(torch.tensor(2), 0.5, 1, 2, 8, 8))


def test_p_zero_needs_no_seed_and_touches_no_rng():
    q = torch.randn(1, 2, 4, 4)
    state = torch.get_rng_state()
    fused_attention(q, q, q)
    assert torch.equal(state, torch.get_rng_state())
    with pytest.raises(ValueError, match="seed"):
        fused_attention(q, q, q, dropout_p=0.1)


@pytest.mark.parametrize("bad", [
    dict(layout="bhsd"),
    dict(key_heads=3),
    dict(mask_dtype=torch.float32),
    dict(dropout_p=1.5),
])
def test_bad_arguments_are_refused(bad):
    q = torch.randn(1, 4, 3, 8)
    k = torch.randn(1, bad.get("key_heads", 2), 3, 8)
    mask = torch.zeros(3, 3, dtype=bad.get("mask_dtype", torch.bool))
    with pytest.raises(ValueError):
        fused_attention(q, k, k, mask, None, torch.tensor(0), layout=bad.get("layout", "bnsd"),
                        dropout_p=bad.get("dropout_p", 0.0))


# ---- registration: opcheck and float64 gradcheck ------------------------------------------------------

def opcheck_cases():
    gen = torch.Generator().manual_seed(4)
    # Megatron: q/k/v split views of one fused projection, [s, b, n, d], with its mask, fill and dropout.
    fused = torch.randn(6, 2, 4, 3 * 8, generator=gen, requires_grad=True)
    q, k, v = fused.split(8, dim=-1)
    yield "sbnd-split-megatron", (q, k, v, torch.ones(1, 1, 6, 6, dtype=torch.bool).triu(1), None,
                                  torch.tensor(11)), dict(layout="sbnd", scale=0.35, dropout_p=0.2, fill=-10000.0)
    # SDPA: bnsd views of bsnd tensors (permuted), GQA, causal and a learnable additive bias.
    q = torch.randn(2, 5, 4, 8, generator=gen).transpose(1, 2).requires_grad_()
    k = torch.randn(2, 7, 2, 8, generator=gen).transpose(1, 2).requires_grad_()
    v = torch.randn(2, 7, 2, 6, generator=gen).transpose(1, 2).requires_grad_()
    yield "bnsd-permuted-gqa-bias", (q, k, v, None, torch.randn(1, 4, 5, 7, generator=gen, requires_grad=True),
                                     None), dict(layout="bnsd", causal=True)
    q = torch.randn(1, 9, 6, 4, generator=gen, requires_grad=True)
    k = torch.randn(1, 3, 2, 4, generator=gen, requires_grad=True)
    yield "bsnd-contiguous-padding", (q, k, k.detach().clone().requires_grad_(),
                                      torch.tensor([[[[False, False, True]]]]), None, torch.tensor(3)), dict(
        layout="bsnd", dropout_p=0.5)


@pytest.mark.parametrize("name,args,kwargs", list(opcheck_cases()), ids=lambda x: x if isinstance(x, str) else "")
def test_opcheck(name, args, kwargs):
    with query_tile(4):
        opcheck(fused_attention.default, args, kwargs)
        out, softmax_max, softmax_sum = fused_attention(*args, **kwargs)
        grad_out = torch.randn(out.shape).transpose(0, 1).contiguous().transpose(0, 1)  # a strided gradient
        detached = [None if t is None else t.detach() for t in args]
        opcheck(fused_attention_backward.default,
                (grad_out, *detached[:3], out.detach(), softmax_max, softmax_sum, *detached[3:]),
                dict(kwargs, bias_grad=args[4] is not None))


@pytest.mark.parametrize("layout,causal,fill,p,gqa,with_bias", [
    ("sbnd", False, -10000.0, 0.0, False, False),
    ("bnsd", True, None, 0.3, True, True),
    ("bsnd", False, None, 0.5, True, False),
])
def test_gradcheck_float64(layout, causal, fill, p, gqa, with_bias):
    gen = torch.Generator().manual_seed(5)
    b, nq, nkv, sq, sk, d = 2, 2, 1 if gqa else 2, 5, 4, 3
    shape = lambda n, s: {"bnsd": (b, n, s, d), "sbnd": (s, b, n, d), "bsnd": (b, s, n, d)}[layout]  # noqa: E731
    q = torch.randn(*shape(nq, sq), generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(*shape(nkv, sk), generator=gen, dtype=torch.float64, requires_grad=True)
    v = torch.randn(*shape(nkv, sk), generator=gen, dtype=torch.float64, requires_grad=True)
    mask = torch.rand(b, 1, sq, sk, generator=gen) < 0.3
    bias = torch.randn(1, nq, sq, sk, generator=gen, dtype=torch.float64, requires_grad=True)
    seed = torch.tensor(21)

    def fn(q, k, v, bias):
        return fused_attention(q, k, v, mask, bias if with_bias else None, seed, layout=layout, scale=0.7,
                               dropout_p=p, causal=causal, fill=fill)[0]

    with query_tile(2):
        assert torch.autograd.gradcheck(fn, (q, k, v, bias))


# ---- memory: flash-like saved tensors and a tile-bounded working set ---------------------------------

def test_saved_tensors_hold_no_seq_by_seq_tensor():
    s = 256
    q, k, v = (torch.randn(1, 2, s, 16, requires_grad=True) for _ in range(3))
    mask = torch.ones(1, 1, s, s, dtype=torch.bool).triu(1)

    def saved_by(fn):
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            fn()
        return saved

    fused_saved = saved_by(lambda: fused_attention(q, k, v, mask, None, torch.tensor(1), dropout_p=0.1))
    big = [t for t in fused_saved if t.numel() >= s * s and t is not mask]
    assert not big, [tuple(t.shape) for t in big]
    assert {tuple(t.shape) for t in fused_saved} >= {(1, 2, s, 16), (1, 2, s), ()}  # q/k/v/out, lse, seed
    # The check can fail: eager attention saves S×S probabilities.
    eager_saved = saved_by(lambda: F.dropout(torch.softmax((q @ k.transpose(-1, -2)).masked_fill(mask, -1e4), -1),
                                             0.1) @ v)
    assert any(t.numel() >= s * s and t is not mask for t in eager_saved)


def allocation_profile(step):
    """(peak bytes allocated above the level at the start, largest single allocation) on CPU."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = sorted((e for e in prof.profiler.kineto_results.events()
                     if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU),
                    key=lambda e: e.start_ns())
    current = peak = largest = 0
    for e in events:
        current += e.nbytes()
        peak, largest = max(peak, current), max(largest, e.nbytes())
    return peak, largest


def test_working_memory_is_tile_bounded_at_seq_2048():
    b, n, s, d = 1, 4, 2048, 16
    full = b * n * s * s * 4  # one fp32 score matrix: 64 MiB
    q, k, v = (torch.randn(b, n, s, d, requires_grad=True) for _ in range(3))
    assert attention.QUERY_TILE * 8 <= s  # a tile is at most 1/8 of the score matrix

    result = {}

    def forward():
        result["out"], *_ = fused_attention(q, k, v, None, None, torch.tensor(3), causal=True, dropout_p=0.1)

    forward_peak, forward_largest = allocation_profile(forward)
    grad_out = torch.randn_like(result["out"])
    backward_peak, backward_largest = allocation_profile(
        lambda: torch.autograd.grad(result["out"], (q, k, v), grad_out))
    assert forward_largest < full / 4 and backward_largest < full / 4
    assert forward_peak < full / 4, forward_peak / full
    assert backward_peak < full / 2, backward_peak / full

    # The check can fail: eager attention allocates (at least) the whole score matrix.
    eager_peak, eager_largest = allocation_profile(lambda: torch.softmax(q @ k.transpose(-1, -2), dim=-1) @ v)
    assert eager_largest >= full and eager_peak >= full


def test_aot_autograd_sees_one_opaque_node_each_way():
    """In the joint graph the op is one node forward and its backward op one node backward, with only
    flash-sized tensors between them."""
    from torch._functorch.aot_autograd import aot_function, make_boxed_func

    graphs = {}

    def capture(name):
        def compiler(gm, example_inputs):
            graphs[name] = gm
            return make_boxed_func(gm)
        return compiler

    def megatron_like(qkv, seed):
        q, k, v = qkv.split(8, dim=-1)
        out, *_ = fused_attention(q, k, v, None, None, seed, layout="sbnd", dropout_p=0.1, causal=True,
                                  fill=-10000.0)
        return out.view(out.shape[0], out.shape[1], -1)

    s, b, n = 32, 2, 2
    qkv = torch.randn(s, b, n, 24, requires_grad=True)
    seed = torch.tensor(5)
    compiled = aot_function(megatron_like, fw_compiler=capture("forward"), bw_compiler=capture("backward"))
    out = compiled(qkv, seed)
    grad = torch.randn_like(out)
    (got,) = torch.autograd.grad(out, qkv, grad)
    (want,) = torch.autograd.grad(megatron_like(qkv, seed), qkv, grad)
    assert_matches(got, want, torch.float32, "grad")

    def targets(name):
        return [node.target for node in graphs[name].graph.nodes if node.op == "call_function"]

    assert targets("forward").count(fused_attention.default) == 1
    assert targets("backward").count(fused_attention_backward.default) == 1
    assert fused_attention.default not in targets("backward")
    crossing = [node.meta["val"] for node in graphs["backward"].graph.find_nodes(op="placeholder")
                if isinstance(node.meta.get("val"), torch.Tensor)]
    assert all(t.numel() < s * s * b * n for t in crossing)


# ---- the fast path: torch's fused attention kernels where the semantics are the same -------------------

def aten_ops_run(fn):
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return {e.name for e in prof.events()}


FLASH = "aten::_scaled_dot_product_flash_attention_for_cpu"
FLASH_BACKWARD = "aten::_scaled_dot_product_flash_attention_for_cpu_backward"


@pytest.mark.parametrize("kwargs,fast", [
    (dict(causal=True), True),
    (dict(causal=True, fill=-10000.0), True),  # Megatron's causal call: no row is fully masked
    (dict(mask="padding"), True),
    (dict(mask="dead_row"), True),  # removed rows give 0 on the fast path too
    (dict(mask="dead_row", fill=-10000.0), False),  # a filled fully masked row averages v: the tiles
    (dict(causal=True, dropout_p=0.1), False),  # the drop mask is rng.drop_mask's, per tile
    (dict(value_dim=6), False),  # the flash kernel needs v's head dim = q's
    (dict(causal=True, dtype=torch.bfloat16), False),  # its bf16 kernel rounds P before P·V
])
def test_which_calls_take_the_fast_path(kwargs, fast):
    kwargs = dict(kwargs)
    gen = torch.Generator().manual_seed(7)
    b, n, s, d = 2, 2, 6, 4
    dtype = kwargs.pop("dtype", torch.float32)
    q, k = (leaf(torch.randn(b, n, s, d, generator=gen), dtype) for _ in range(2))
    v = leaf(torch.randn(b, n, s, kwargs.pop("value_dim", d), generator=gen), dtype)
    mask_kind = kwargs.pop("mask", None)
    mask = None
    if mask_kind == "padding":
        mask = torch.zeros(b, 1, 1, s, dtype=torch.bool)
        mask[..., -2:] = True
    elif mask_kind == "dead_row":
        mask = torch.zeros(1, 1, s, s, dtype=torch.bool)
        mask[..., 3, :] = True
    seed = torch.tensor(1) if kwargs.get("dropout_p") else None
    result = {}

    def forward():
        result["out"], *_ = fused_attention(q, k, v, mask, None, seed, **kwargs)

    ran = aten_ops_run(forward)
    assert (FLASH in ran) == fast, ran
    ran = aten_ops_run(lambda: torch.autograd.grad(result["out"], (q, k, v), torch.ones_like(result["out"])))
    assert (FLASH_BACKWARD in ran) == fast, ran


def test_a_learnable_bias_takes_the_tiled_backward_from_fast_forward_statistics():
    """bias_grad: the forward is fast and returns (lse, 1); the tiled backward recomputes p = exp(s − lse)."""
    gen = torch.Generator().manual_seed(8)
    q, k, v = (leaf(torch.randn(1, 2, 5, 4, generator=gen)) for _ in range(3))
    bias = leaf(torch.randn(1, 2, 5, 5, generator=gen))
    out, softmax_max, softmax_sum = fused_attention(q, k, v, None, bias, None, causal=True)
    assert torch.equal(softmax_sum, torch.ones_like(softmax_sum))
    grads = torch.autograd.grad(out, (q, k, v, bias), torch.ones_like(out))
    ref_in = [leaf(t) for t in (q, k, v, bias)]
    ref = eager_attention(*ref_in[:3], attn_bias=ref_in[3], causal=True)
    for got, want in zip(grads, torch.autograd.grad(ref, ref_in, torch.ones_like(ref))):
        assert_matches(got, want, torch.float32, "grad")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_fast_backward_takes_the_devices_max_and_sum(dtype):
    """The statistics of the tiled forward (the device's definitions: row max, Σexp(s − max)), Megatron's
    −10000 rows included, give the fast backward the gradients they give the tiled one."""
    gen = torch.Generator().manual_seed(9)
    q, k, v, g = (torch.randn(2, 4, 33, 8, generator=gen).to(dtype) for _ in range(4))
    k, v = k[:, :2], v[:, :2]  # GQA
    mask = torch.rand(2, 1, 33, 33, generator=gen) < 0.3
    mask[..., 0] = False
    bias = (3 * torch.randn(1, 4, 33, 33, generator=gen)).to(dtype)
    with fast_path(False):
        out, smax, ssum = fused_attention(q, k, v, mask, bias, None, scale=0.4)
        want = fused_attention_backward(g, q, k, v, out, smax, ssum, mask, bias, None, scale=0.4)
    assert not torch.equal(ssum, torch.ones_like(ssum))
    ran = {}

    def backward():
        ran["grads"] = fused_attention_backward(g, q, k, v, out, smax, ssum, mask, bias, None, scale=0.4)

    assert FLASH_BACKWARD in aten_ops_run(backward)
    for got, ref in zip(ran["grads"][:3], want[:3]):
        assert_matches(got, ref.float(), dtype, "grad")


def test_fast_path_working_memory_at_seq_2048():
    """torch's flash kernel holds no S×S tensor either, forward or backward."""
    b, n, s, d = 1, 4, 2048, 16
    full = b * n * s * s * 4
    q, k, v = (torch.randn(b, n, s, d, requires_grad=True) for _ in range(3))
    result = {}

    def forward():
        result["out"], *_ = fused_attention(q, k, v, causal=True)

    forward_peak, forward_largest = allocation_profile(forward)
    grad_out = torch.randn_like(result["out"])
    backward_peak, backward_largest = allocation_profile(
        lambda: torch.autograd.grad(result["out"], (q, k, v), grad_out))
    assert max(forward_peak, backward_peak, forward_largest, backward_largest) < full / 8


def flash_mask_shapes(fn):
    """The attn_mask shape each call of torch's flash kernels (forward, backward) received: [] for none."""
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        fn()
    found = {}
    for e in prof.events():
        if e.name in (FLASH, FLASH_BACKWARD):
            # forward: (q, k, v, dropout_p, is_causal, attn_mask, scale); backward: (grad_out, q, k, v, out,
            # logsumexp, dropout_p, is_causal, attn_mask, scale)
            found[e.name] = e.input_shapes[5 if e.name == FLASH else 8]
    return found


@pytest.mark.parametrize("sq,sk", [(64, 64), (40, 72)])
def test_a_causal_mask_tensor_runs_as_is_causal(sq, sk):
    """Megatron's causal mask, given as a tensor, runs as the kernel's is_causal (no float mask built, the blocks
    above the diagonal skipped), bitwise what causal=True computes; a mask one position off stays a mask."""
    gen = torch.Generator().manual_seed(11)
    b, n, d = 2, 4, 16
    q = leaf(torch.randn(sq, b, n, d, generator=gen))
    k, v = (leaf(torch.randn(sk, b, n, d, generator=gen)) for _ in range(2))
    g = torch.randn(sq, b, n, d, generator=gen)
    mask = torch.ones(1, 1, sq, sk, dtype=torch.bool).triu(1)
    result = {}

    def run(m, causal):
        out, *_ = fused_attention(q, k, v, m, layout="sbnd", causal=causal, fill=-10000.0)
        result[(m is None, causal)] = (out, *torch.autograd.grad(out, (q, k, v), g))

    assert flash_mask_shapes(lambda: run(mask, False)) == {FLASH: [], FLASH_BACKWARD: []}
    run(None, True)
    for got, want in zip(result[(False, False)], result[(True, True)]):
        assert torch.equal(got, want)

    off = mask.clone()
    off[0, 0, sq // 2, 0] = True  # one more hidden key: not the causal pattern
    assert flash_mask_shapes(lambda: run(off, False)) == {FLASH: [1, 1, sq, sk], FLASH_BACKWARD: [1, 1, sq, sk]}
    ref_in = [leaf(t) for t in (q, k, v)]
    ref = eager_attention(*ref_in, layout="sbnd", attn_mask=off, fill=-10000.0)
    assert_matches(result[(False, False)][0], ref, torch.float32, "out")
    for got, want in zip(result[(False, False)][1:], torch.autograd.grad(ref, ref_in, g)):
        assert_matches(got, want, torch.float32, "grad")


def triu_calls(fn) -> int:
    """How many times ``fn`` built a triangular pattern (aten::triu_)."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return sum(1 for e in prof.events() if e.name == "aten::triu_")


def test_a_causal_mask_is_checked_once_and_again_when_written():
    """The causal check runs once per mask tensor, not at every call (Megatron passes one mask to every layer at
    every step), through views of it too; a mask written in place is checked again and taken as the mask it now
    is, forward and backward; a new tensor of the same values is checked on its own."""
    gen = torch.Generator().manual_seed(12)
    s, b, n, d = 48, 2, 2, 8
    q, k, v = (leaf(torch.randn(s, b, n, d, generator=gen)) for _ in range(3))
    g = torch.randn(s, b, n, d, generator=gen)
    mask = torch.ones(1, 1, s, s, dtype=torch.bool).triu(1)

    def run(m):
        out, *_ = fused_attention(q, k, v, m, layout="sbnd", fill=-10000.0)
        return (out, *torch.autograd.grad(out, (q, k, v), g))

    assert triu_calls(lambda: run(mask)) == 1  # forward checks, the backward's call finds the answer
    assert triu_calls(lambda: run(mask)) == 0
    assert triu_calls(lambda: run(mask.view(s, s))) == 0  # a view read as [1, 1, s, s] again: the same state
    assert triu_calls(lambda: run(mask.expand(b, 1, s, s))) == 1  # another geometry: checked once
    assert triu_calls(lambda: run(mask.expand(b, 1, s, s))) == 0
    want = run(mask)

    mask[0, 0, s // 2, 0] = True  # in place: no longer the causal pattern
    assert flash_mask_shapes(lambda: run(mask)) == {FLASH: [1, 1, s, s], FLASH_BACKWARD: [1, 1, s, s]}
    got = run(mask)
    ref_in = [leaf(t) for t in (q, k, v)]
    ref = eager_attention(*ref_in, layout="sbnd", attn_mask=mask, fill=-10000.0)
    assert_matches(got[0], ref, torch.float32, "out")
    for grad, ref_grad in zip(got[1:], torch.autograd.grad(ref, ref_in, g)):
        assert_matches(grad, ref_grad, torch.float32, "grad")
    assert not torch.equal(got[0], want[0])

    mask[0, 0, s // 2, 0] = False  # written back: causal again, checked again
    assert flash_mask_shapes(lambda: run(mask)) == {FLASH: [], FLASH_BACKWARD: []}
    fresh = torch.ones(1, 1, s, s, dtype=torch.bool).triu(1)
    assert triu_calls(lambda: run(fresh)) == 1
