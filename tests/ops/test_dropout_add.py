"""npu_compile::bias_dropout_add (and its backward) against Megatron's residual + dropout(x + bias)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.library import opcheck

from npu_compile.ops import dropout_add

from .helpers import assert_matches, fuzz_settings, leaf, strided_leaf

bias_dropout_add = torch.ops.npu_compile.bias_dropout_add
bias_dropout_add_backward = torch.ops.npu_compile.bias_dropout_add_backward


def recover_keep_mask(shape, p, seed):
    """The op's keep mask, read off the op: with x = 1, no bias and residual = 0 the output is keep/(1-p)."""
    out = bias_dropout_add(torch.ones(shape), None, torch.zeros(shape), p, seed)
    return out != 0


def megatron_bias_dropout_add(x, bias, residual, keep, p):
    """Megatron's _bias_dropout_add_func with the dropout's keep mask given."""
    if bias is not None:
        x = x + bias
    dropped = x * keep / (1.0 - p) if p < 1.0 else x * 0.0
    return residual + dropped


@st.composite
def dropout_add_cases(draw):
    return dict(
        shape=draw(st.lists(st.integers(1, 9), min_size=1, max_size=3)),
        dtype=draw(st.sampled_from([torch.float32, torch.bfloat16])),
        residual_fp32=draw(st.booleans()),
        bias=draw(st.sampled_from(["none", "last", "full"])),
        p=draw(st.sampled_from([0.0, 0.1, 0.5, 0.9, 1.0])),
        style=draw(st.sampled_from(["contiguous", "split", "transposed"])),
        block=draw(st.sampled_from([3, 64, dropout_add.DROPOUT_BLOCK])),
        seed=draw(st.integers(0, 2**62)),
    )


class _Block:
    """Small RNG blocks let small shapes cross block boundaries."""

    def __init__(self, elements):
        self.elements = elements

    def __enter__(self):
        self.saved, dropout_add.DROPOUT_BLOCK = dropout_add.DROPOUT_BLOCK, self.elements

    def __exit__(self, *exc):
        dropout_add.DROPOUT_BLOCK = self.saved


def make(shape, style, gen, dtype):
    if style == "split":
        return torch.randn(*shape[:-1], 2 * shape[-1], generator=gen).to(dtype)[..., :shape[-1]]
    if style == "transposed" and len(shape) >= 2:
        return torch.randn(shape[1], shape[0], *shape[2:], generator=gen).to(dtype).transpose(0, 1)
    return torch.randn(*shape, generator=gen).to(dtype)


def check_dropout_add(case):
    gen = torch.Generator().manual_seed(case["seed"] % 2**31)
    shape, dtype, p = case["shape"], case["dtype"], case["p"]
    residual_dtype = torch.float32 if case["residual_fp32"] else dtype
    x = strided_leaf(make(shape, case["style"], gen, dtype))
    residual = strided_leaf(make(shape, "contiguous", gen, residual_dtype))
    bias_shape = {"none": None, "last": shape[-1:], "full": shape}[case["bias"]]
    bias = None if bias_shape is None else leaf(torch.randn(*bias_shape, generator=gen), dtype)
    seed = torch.tensor(case["seed"]) if p > 0 else None
    out_dtype = torch.promote_types(dtype, residual_dtype)
    grad_out = torch.randn(*shape, generator=gen).to(out_dtype)

    with _Block(case["block"]):
        out = bias_dropout_add(x, bias, residual, p, seed)
        inputs = (x, residual) if bias is None else (x, residual, bias)
        grads = torch.autograd.grad(out, inputs, grad_out)
        keep = recover_keep_mask(shape, p, seed) if p > 0 else torch.ones(shape, dtype=torch.bool)
    assert out.dtype == out_dtype and out.is_contiguous() and list(out.shape) == shape

    ref_in = [leaf(t, torch.float32) for t in inputs]
    # Eager rounds x + bias to x's dtype before dropping it; so does the op.
    branch = ref_in[0] if bias is None else (ref_in[0] + ref_in[2]).to(dtype).float()
    ref = megatron_bias_dropout_add(branch, None, ref_in[1], keep, p)
    assert_matches(out, ref, dtype, "out")
    for got, want, t in zip(grads, torch.autograd.grad(ref, ref_in, grad_out.float()), inputs):
        assert got.dtype == t.dtype and got.shape == t.shape
        assert_matches(got, want, dtype, "grad")


@settings(max_examples=130)
@given(dropout_add_cases())
def test_matches_megatron_with_the_same_keep_mask(case):
    check_dropout_add(case)


@pytest.mark.fuzz
@fuzz_settings()
@given(dropout_add_cases())
def test_dropout_add_fuzz(case):
    check_dropout_add(case)


@settings(max_examples=80)
@given(st.sampled_from([0.05, 0.1, 0.3, 0.5, 0.8]), st.integers(0, 2**62), st.sampled_from([1000, 1 << 20]))
def test_keeps_one_minus_p_and_preserves_the_mean(p, seed, block):
    """20000 draws: the kept fraction has sd <= 0.0036 and the mean of keep/(1-p) sd <= 0.014; 6 sd bounds."""
    shape = (100, 200)
    with _Block(block):
        keep = recover_keep_mask(shape, p, torch.tensor(seed))
        out = bias_dropout_add(torch.ones(shape), None, torch.zeros(shape), p, torch.tensor(seed))
    n = keep.numel()
    assert abs(keep.float().mean().item() - (1 - p)) < 6 * (p * (1 - p) / n) ** 0.5
    assert abs(out.mean().item() - 1.0) < 6 * (p / (1 - p) / n) ** 0.5


def test_seeds_and_blocks_give_independent_masks():
    shape = (2 * dropout_add.DROPOUT_BLOCK + 5,)
    a = recover_keep_mask(shape, 0.5, torch.tensor(1))
    assert torch.equal(a, recover_keep_mask(shape, 0.5, torch.tensor(1)))
    assert not torch.equal(a, recover_keep_mask(shape, 0.5, torch.tensor(2)))
    block = dropout_add.DROPOUT_BLOCK
    assert not torch.equal(a[:block], a[block:2 * block])


def test_saves_only_the_seed_and_the_bias():
    x, residual = torch.randn(8, 2, 16, requires_grad=True), torch.randn(8, 2, 16, requires_grad=True)
    bias, seed = torch.randn(16, requires_grad=True), torch.tensor(3)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        bias_dropout_add(x, bias, residual, 0.1, seed)
    assert len(saved) == 2 and saved[0] is bias and saved[1] is seed


def test_p_zero_needs_no_seed_and_touches_no_rng():
    x = torch.randn(4, 4)
    state = torch.get_rng_state()
    assert torch.equal(bias_dropout_add(x, None, x, 0.0, None), x + x)
    assert torch.equal(state, torch.get_rng_state())
    with pytest.raises(ValueError, match="seed"):
        bias_dropout_add(x, None, x, 0.1, None)


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError):
        bias_dropout_add(torch.randn(2, 3), None, torch.randn(3, 2), 0.0)
    with pytest.raises(ValueError):
        bias_dropout_add(torch.randn(2, 3), None, torch.randn(2, 3), 1.5, torch.tensor(0))


# ---- registration: opcheck and float64 gradcheck ------------------------------------------------------

def test_opcheck():
    gen = torch.Generator().manual_seed(0)
    strided = torch.randn(4, 3, 32, generator=gen)[..., 8:24].transpose(0, 1).requires_grad_()
    residual = torch.randn(3, 4, 16, generator=gen, requires_grad=True)
    bias = torch.randn(16, generator=gen, requires_grad=True)
    seed = torch.tensor(7)
    with _Block(5):
        opcheck(bias_dropout_add.default, (strided, bias, residual, 0.3, seed))
        opcheck(bias_dropout_add.default, (residual, None, strided, 0.0, None))
        opcheck(bias_dropout_add.default, (strided.detach().bfloat16().requires_grad_(), bias.detach().bfloat16(),
                                           residual, 0.5, seed))
        grad = torch.randn(4, 3, 16, generator=gen).transpose(0, 1)
        opcheck(bias_dropout_add_backward.default, (grad, bias.detach(), seed, 0.3, torch.float32, True))
        opcheck(bias_dropout_add_backward.default, (grad, None, seed, 0.3, torch.bfloat16, False))
        opcheck(bias_dropout_add_backward.default, (grad, None, None, 0.0, torch.float32, False))


@pytest.mark.parametrize("p", [0.0, 0.4])
def test_gradcheck_float64(p):
    gen = torch.Generator().manual_seed(1)
    x, residual = (torch.randn(3, 4, 5, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(2))
    bias = torch.randn(5, generator=gen, dtype=torch.float64, requires_grad=True)
    seed = torch.tensor(11)
    with _Block(7):
        assert torch.autograd.gradcheck(lambda x, b, r: bias_dropout_add(x, b, r, p, seed), (x, bias, residual))
