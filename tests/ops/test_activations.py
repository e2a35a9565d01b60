"""npu_compile::bias_gelu and swiglu (and backward ops) against F.gelu, F.silu and Megatron's formulas."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.library import opcheck

import npu_compile.ops  # noqa: F401  (importing registers the ops)

from .helpers import assert_matches, fuzz_settings, leaf, strided_leaf

ops = torch.ops.npu_compile


def make(shape, style, gen, dtype):
    """Contiguous, a split view of a wider last dim, or a transposed view of the first two dims."""
    if style == "split":
        return torch.randn(*shape[:-1], 2 * shape[-1], generator=gen).to(dtype)[..., shape[-1]:]
    if style == "transposed" and len(shape) >= 2:
        return torch.randn(shape[1], shape[0], *shape[2:], generator=gen).to(dtype).transpose(0, 1)
    return torch.randn(*shape, generator=gen).to(dtype)


def check_grads(got, want, dtype):
    for g, w in zip(got, want):
        assert g.dtype == dtype and g.shape == w.shape
        assert_matches(g, w, dtype, "grad")


# ---- bias_gelu ----------------------------------------------------------------------------------------

@st.composite
def gelu_cases(draw):
    shape = draw(st.lists(st.integers(1, 9), min_size=1, max_size=3))
    return dict(
        shape=shape,
        bias=draw(st.sampled_from(["none", "last", "broadcast"])),
        approximate=draw(st.sampled_from(["none", "tanh"])),
        dtype=draw(st.sampled_from([torch.float32, torch.bfloat16])),
        style=draw(st.sampled_from(["contiguous", "split", "transposed"])),
        scale=draw(st.sampled_from([1.0, 4.0])),  # reach the tails where the tanh form departs from erf
        seed=draw(st.integers(0, 2**31 - 1)),
    )


def check_bias_gelu(case):
    gen = torch.Generator().manual_seed(case["seed"])
    shape, dtype = case["shape"], case["dtype"]
    x = strided_leaf(case["scale"] * make(shape, case["style"], gen, torch.float32).to(dtype))
    bias_shape = {"none": None, "last": shape[-1:], "broadcast": [1] * (len(shape) - 1) + shape[-1:]}[case["bias"]]
    if case["bias"] == "broadcast" and len(shape) > 1:
        bias_shape[0] = shape[0]
    bias = None if bias_shape is None else leaf(torch.randn(*bias_shape, generator=gen), dtype)
    grad_y = torch.randn(*shape, generator=gen).to(dtype)

    y = ops.bias_gelu(x, bias, case["approximate"])
    assert y.dtype == dtype and y.is_contiguous() and y.shape == x.shape
    inputs = (x,) if bias is None else (x, bias)
    ref_in = [leaf(t, torch.float32) for t in inputs]
    # Eager rounds x + bias to the input dtype before the activation; so does the op.
    biased = ref_in[0] if bias is None else (ref_in[0] + ref_in[1]).to(dtype).float()
    ref = F.gelu(biased, approximate=case["approximate"])
    assert_matches(y, ref, dtype, "y")
    check_grads(torch.autograd.grad(y, inputs, grad_y), torch.autograd.grad(ref, ref_in, grad_y.float()), dtype)


@settings(max_examples=110)
@given(gelu_cases())
def test_bias_gelu_matches_f_gelu(case):
    check_bias_gelu(case)


@pytest.mark.fuzz
@fuzz_settings()
@given(gelu_cases())
def test_bias_gelu_fuzz(case):
    check_bias_gelu(case)


def megatron_bias_gelu(bias, y):
    """Megatron's bias_gelu and its hand-written derivative (megatron/core/fusions/fused_bias_gelu.py)."""
    x = bias + y
    return x * 0.5 * (1.0 + torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x)))


def megatron_bias_gelu_back(g, bias, y):
    x = bias + y
    tanh_out = torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x))
    ff = 0.5 * x * ((1 - tanh_out * tanh_out) * (0.79788456 + 0.1070322243 * x * x)) + 0.5 * (1 + tanh_out)
    return ff * g


def test_megatron_bias_gelu_semantics():
    gen = torch.Generator().manual_seed(0)
    x, bias, g = torch.randn(16, 2, 24, generator=gen), torch.randn(24, generator=gen), torch.randn(16, 2, 24,
                                                                                                      generator=gen)
    xl, bl = leaf(x), leaf(bias)
    y = ops.bias_gelu(xl, bl, "tanh")
    assert_matches(y, megatron_bias_gelu(bias, x), torch.float32, "y")
    grad_x, grad_bias = torch.autograd.grad(y, (xl, bl), g)
    want = megatron_bias_gelu_back(g, bias, x)
    assert_matches(grad_x, want, torch.float32, "grad x")
    assert_matches(grad_bias, want.sum(dim=(0, 1)), torch.float32, "grad bias")


# ---- swiglu -------------------------------------------------------------------------------------------

@st.composite
def swiglu_cases(draw):
    shape = draw(st.lists(st.integers(1, 7), min_size=1, max_size=3))
    dim = draw(st.integers(-len(shape), len(shape) - 1))
    shape[dim] *= 2
    return dict(shape=shape, dim=dim,
                dtype=draw(st.sampled_from([torch.float32, torch.bfloat16])),
                style=draw(st.sampled_from(["contiguous", "split", "transposed"])),
                seed=draw(st.integers(0, 2**31 - 1)))


def check_swiglu(case):
    gen = torch.Generator().manual_seed(case["seed"])
    dtype, dim = case["dtype"], case["dim"]
    x = strided_leaf(make(case["shape"], case["style"], gen, dtype))
    y = ops.swiglu(x, dim)
    out_shape = list(case["shape"])
    out_shape[dim] //= 2
    assert y.dtype == dtype and y.is_contiguous() and list(y.shape) == out_shape
    grad_y = torch.randn(*out_shape, generator=gen).to(dtype)
    ref_x = leaf(x, torch.float32)
    a, b = torch.chunk(ref_x, 2, dim=dim)  # Megatron's swiglu: silu of the first half times the second
    ref = F.silu(a) * b
    assert_matches(y, ref, dtype, "y")
    check_grads(torch.autograd.grad(y, x, grad_y), torch.autograd.grad(ref, ref_x, grad_y.float()), dtype)


@settings(max_examples=100)
@given(swiglu_cases())
def test_swiglu_matches_silu_times_gate(case):
    check_swiglu(case)


@pytest.mark.fuzz
@fuzz_settings()
@given(swiglu_cases())
def test_swiglu_fuzz(case):
    check_swiglu(case)


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError):
        ops.swiglu(torch.randn(3, 5))
    with pytest.raises(ValueError):
        ops.bias_gelu(torch.randn(3, 5), None, "erf")
    with pytest.raises(ValueError):
        ops.bias_gelu(torch.randn(3, 5), torch.randn(4, 3, 5))


def test_saved_tensors_are_the_inputs():
    x, bias = torch.randn(4, 8, requires_grad=True), torch.randn(8, requires_grad=True)
    for op, args in [(ops.bias_gelu, (x, bias, "tanh")), (ops.swiglu, (x, -1))]:
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            op(*args)
        assert [t for t in saved if t.numel() == x.numel()] == [x]


# ---- registration: opcheck and float64 gradcheck ------------------------------------------------------

def test_opcheck():
    gen = torch.Generator().manual_seed(1)
    strided = torch.randn(5, 3, 24, generator=gen)[..., 4:20].transpose(0, 1).requires_grad_()
    contiguous = torch.randn(3, 5, 16, generator=gen, requires_grad=True)
    bias = torch.randn(16, generator=gen, requires_grad=True)
    grad = torch.randn(5, 3, 16, generator=gen).transpose(0, 1)
    for x in (strided, contiguous):
        for approximate in ("none", "tanh"):
            opcheck(ops.bias_gelu.default, (x, bias, approximate))
        opcheck(ops.bias_gelu.default, (x, None, "none"))
        opcheck(ops.bias_gelu_backward.default, (grad, x.detach(), bias.detach(), "tanh", True))
        opcheck(ops.bias_gelu_backward.default, (grad, x.detach(), None, "none", False))
        opcheck(ops.swiglu.default, (x, -1))
        opcheck(ops.swiglu.default, (x.detach()[:2].requires_grad_(), 0))
        opcheck(ops.swiglu_backward.default, (grad[..., :8], x.detach(), -1))
        opcheck(ops.swiglu_backward.default, (grad[:, :2].contiguous(), x.detach()[:, :4], 1))


def test_gradcheck_float64():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(3, 4, 6, generator=gen, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(6, generator=gen, dtype=torch.float64, requires_grad=True)
    for approximate in ("none", "tanh"):
        assert torch.autograd.gradcheck(lambda x, b: ops.bias_gelu(x, b, approximate), (x, bias))
    assert torch.autograd.gradcheck(lambda x: ops.bias_gelu(x, None, "none"), (x,))
    for dim in (-1, 1):
        assert torch.autograd.gradcheck(lambda x: ops.swiglu(x, dim), (x,))
    even_rows = torch.randn(2, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x: ops.swiglu(x, 0), (even_rows,))
