"""npu_compile::rms_norm, add_rms_norm, add_layer_norm (and backward ops) against F.rms_norm / F.layer_norm."""

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
    """Contiguous, a split view of a wider last dim, or a transposed view of the two leading dims."""
    if style == "split":
        return torch.randn(*shape[:-1], shape[-1] + 3, generator=gen).to(dtype)[..., 1:shape[-1] + 1]
    if style == "transposed" and len(shape) >= 3:
        return torch.randn(shape[1], shape[0], *shape[2:], generator=gen).to(dtype).transpose(0, 1)
    return torch.randn(*shape, generator=gen).to(dtype)


@st.composite
def norm_cases(draw):
    return dict(
        lead=draw(st.lists(st.integers(1, 5), min_size=1, max_size=3)),
        # At least 8 normalized features: fewer make the variance of random data tiny now and then, and the
        # gradient so ill-conditioned that two fp32 implementations differ beyond 1e-5.
        hidden=draw(st.lists(st.integers(1, 4), max_size=1)) + [draw(st.integers(8, 32))],
        dtype=draw(st.sampled_from([torch.float32, torch.bfloat16])),
        style=draw(st.sampled_from(["contiguous", "split", "transposed"])),
        eps=draw(st.sampled_from([1e-6, 1e-5, 0.1])),
        with_bias=draw(st.booleans()),
        use_sum=draw(st.booleans()),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


def build(case, n_activations):
    gen = torch.Generator().manual_seed(case["seed"])
    shape = tuple(case["lead"]) + tuple(case["hidden"])
    acts = [strided_leaf(make(shape, case["style"], gen, case["dtype"])) for _ in range(n_activations)]
    weight = leaf(1 + 0.5 * torch.randn(*case["hidden"], generator=gen), case["dtype"])
    bias = leaf(0.5 * torch.randn(*case["hidden"], generator=gen), case["dtype"])
    grads = [torch.randn(shape, generator=gen).to(case["dtype"]) for _ in range(2)]
    return acts, weight, bias, grads


def stat_shape(case):
    return tuple(case["lead"]) + (1,) * len(case["hidden"])


def check_grads(got, want, dtype):
    for g, w in zip(got, want):
        assert g.dtype == dtype and g.shape == w.shape
        assert_matches(g, w, dtype, "grad")


def check_rms_norm(case):
    (x,), weight, _, (grad_y, _) = build(case, 1)
    y, rstd = ops.rms_norm(x, weight, case["eps"])
    assert y.dtype == case["dtype"] and y.is_contiguous()
    assert rstd.dtype == torch.float32 and rstd.shape == stat_shape(case)
    ref_in = [leaf(t, torch.float32) for t in (x, weight)]
    ref = F.rms_norm(ref_in[0], case["hidden"], ref_in[1], case["eps"])
    assert_matches(y, ref, case["dtype"], "y")
    check_grads(torch.autograd.grad(y, (x, weight), grad_y), torch.autograd.grad(ref, ref_in, grad_y.float()),
                case["dtype"])


def check_add_rms_norm(case):
    (x, residual), weight, _, (grad_y, grad_sum) = build(case, 2)
    y, rstd, total = ops.add_rms_norm(x, residual, weight, case["eps"])
    assert rstd.dtype == torch.float32 and rstd.shape == stat_shape(case)
    assert y.is_contiguous() and total.is_contiguous() and total.dtype == case["dtype"]
    ref_in = [leaf(t, torch.float32) for t in (x, residual, weight)]
    ref_total = ref_in[0] + ref_in[1]
    ref = F.rms_norm(ref_total, case["hidden"], ref_in[2], case["eps"])
    assert_matches(y, ref, case["dtype"], "y")
    assert_matches(total, ref_total, case["dtype"], "sum")
    outs, ref_outs = ((y, total), (ref, ref_total)) if case["use_sum"] else ((y,), (ref,))
    got = torch.autograd.grad(outs, (x, residual, weight), (grad_y, grad_sum)[:len(outs)])
    want = torch.autograd.grad(ref_outs, ref_in, tuple(g.float() for g in (grad_y, grad_sum)[:len(outs)]))
    check_grads(got, want, case["dtype"])


def check_add_layer_norm(case):
    (x, residual), weight, bias, (grad_y, grad_sum) = build(case, 2)
    bias = bias if case["with_bias"] else None
    y, mean, rstd, total = ops.add_layer_norm(x, residual, weight, bias, case["eps"])
    assert mean.dtype == rstd.dtype == torch.float32 and mean.shape == rstd.shape == stat_shape(case)
    params = (weight,) if bias is None else (weight, bias)
    ref_in = [leaf(t, torch.float32) for t in (x, residual, *params)]
    ref_total = ref_in[0] + ref_in[1]
    ref = F.layer_norm(ref_total, case["hidden"], ref_in[2], ref_in[3] if bias is not None else None, case["eps"])
    assert_matches(y, ref, case["dtype"], "y")
    assert_matches(total, ref_total, case["dtype"], "sum")
    outs, ref_outs = ((y, total), (ref, ref_total)) if case["use_sum"] else ((y,), (ref,))
    got = torch.autograd.grad(outs, (x, residual, *params), (grad_y, grad_sum)[:len(outs)])
    want = torch.autograd.grad(ref_outs, ref_in, tuple(g.float() for g in (grad_y, grad_sum)[:len(outs)]))
    check_grads(got, want, case["dtype"])


# 70 examples each by default: 210 for the family.
@settings(max_examples=70)
@given(norm_cases())
def test_rms_norm_matches(case):
    check_rms_norm(case)


@settings(max_examples=70)
@given(norm_cases())
def test_add_rms_norm_matches(case):
    check_add_rms_norm(case)


@settings(max_examples=70)
@given(norm_cases())
def test_add_layer_norm_matches(case):
    check_add_layer_norm(case)


@pytest.mark.fuzz
@fuzz_settings()
@given(norm_cases(), st.sampled_from([check_rms_norm, check_add_rms_norm, check_add_layer_norm]))
def test_norms_fuzz(case, check):
    check(case)


def test_statistics_are_saved_not_normalized_activations():
    x, residual = torch.randn(4, 8, 32, requires_grad=True), torch.randn(4, 8, 32, requires_grad=True)
    weight, bias = torch.randn(32, requires_grad=True), torch.randn(32, requires_grad=True)
    for op, args in [(ops.rms_norm, (x, weight, 1e-6)), (ops.add_rms_norm, (x, residual, weight, 1e-6)),
                     (ops.add_layer_norm, (x, residual, weight, bias, 1e-5))]:
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            op(*args)
        full_size = [t for t in saved if t.numel() == x.numel()]
        assert len(full_size) == 1, op  # x itself, or the sum for the add ops: never x̂ or y
        assert all(t.dtype == torch.float32 for t in saved if t.shape[-1] == 1), op


def test_add_norms_with_the_same_tensor_as_both_summands():
    x = torch.randn(3, 16, requires_grad=True)
    weight = torch.randn(16, requires_grad=True)
    y, _, _ = ops.add_rms_norm(x, x, weight, 1e-6)
    (got,) = torch.autograd.grad(y.sum(), x)
    ref_x = leaf(x)
    (want,) = torch.autograd.grad(F.rms_norm(ref_x + ref_x, (16,), weight, 1e-6).sum(), ref_x)
    assert_matches(got, want, torch.float32, "grad")


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError):
        ops.rms_norm(torch.randn(3, 8), torch.randn(7))
    with pytest.raises(ValueError):
        ops.add_rms_norm(torch.randn(3, 8), torch.randn(3, 8, dtype=torch.float64), torch.randn(8))


# ---- registration: opcheck and float64 gradcheck ------------------------------------------------------

def opcheck_inputs():
    gen = torch.Generator().manual_seed(0)
    strided = torch.randn(6, 4, 40, generator=gen)[..., 4:36].transpose(0, 1).requires_grad_()  # split + transposed
    contiguous = torch.randn(4, 6, 32, generator=gen, requires_grad=True)
    weight = torch.randn(32, generator=gen, requires_grad=True)
    bias = torch.randn(32, generator=gen, requires_grad=True)
    return strided, contiguous, weight, bias


@pytest.mark.parametrize("strided_first", [True, False])
def test_opcheck(strided_first):
    strided, contiguous, weight, bias = opcheck_inputs()
    x, residual = (strided, contiguous) if strided_first else (contiguous, strided)
    opcheck(ops.rms_norm.default, (x, weight, 1e-6))
    opcheck(ops.rms_norm.default, (x, torch.randn(6, 32, requires_grad=True), 1e-6))  # 2-D weight
    opcheck(ops.add_rms_norm.default, (x, residual, weight, 1e-6))
    opcheck(ops.add_layer_norm.default, (x, residual, weight, bias, 1e-5))
    opcheck(ops.add_layer_norm.default, (x, residual, weight, None, 1e-5))

    x_, r_, w_ = x.detach(), residual.detach(), weight.detach()
    grad = torch.randn(6, 4, 32).transpose(0, 1)  # strided incoming gradient
    _, rstd = ops.rms_norm(x_, w_, 1e-6)
    opcheck(ops.rms_norm_backward.default, (grad, x_, w_, rstd))
    _, rstd, total = ops.add_rms_norm(x_, r_, w_, 1e-6)
    opcheck(ops.add_rms_norm_backward.default, (grad, grad.clone(), total, w_, rstd))
    opcheck(ops.add_rms_norm_backward.default, (grad, None, total, w_, rstd))
    _, mean, rstd, total = ops.add_layer_norm(x_, r_, w_, bias.detach(), 1e-5)
    opcheck(ops.add_layer_norm_backward.default, (grad, grad.clone(), total, mean, rstd, w_, True))
    opcheck(ops.add_layer_norm_backward.default, (grad, None, total, mean, rstd, w_, False))


def test_gradcheck_float64():
    gen = torch.Generator().manual_seed(1)
    x, residual = (torch.randn(3, 4, 6, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(2))
    weight, bias = (torch.randn(6, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(2))
    weight2d = torch.randn(4, 6, generator=gen, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, w: ops.rms_norm(x, w, 1e-5)[0], (x, weight))
    assert torch.autograd.gradcheck(lambda x, w: ops.rms_norm(x, w, 1e-5)[0], (x, weight2d))
    assert torch.autograd.gradcheck(lambda x, r, w: ops.add_rms_norm(x, r, w, 1e-5)[::2], (x, residual, weight))
    assert torch.autograd.gradcheck(lambda x, r, w, b: ops.add_layer_norm(x, r, w, b, 1e-5)[::3],
                                    (x, residual, weight, bias))
    assert torch.autograd.gradcheck(lambda x, r, w: ops.add_layer_norm(x, r, w, None, 1e-5)[0], (x, residual, weight))


@pytest.mark.parametrize("low", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("narrow_first", [True, False])
def test_add_norms_of_an_fp32_residual_stream(low, narrow_first):
    """A bf16/fp16 summand and an fp32 one: the sum is eager's promoted fp32 add, exactly; the norm runs on it in
    fp32 and each summand's gradient comes back in its own dtype, as eager's."""
    gen = torch.Generator().manual_seed(0)
    narrow = torch.randn(4, 16, generator=gen).to(low).requires_grad_()
    wide = torch.randn(4, 16, generator=gen, requires_grad=True)
    weight, bias = torch.randn(16, generator=gen, requires_grad=True), torch.randn(16, generator=gen, requires_grad=True)
    x, residual = (narrow, wide) if narrow_first else (wide, narrow)
    grad_y, grad_sum = torch.randn(4, 16, generator=gen), torch.randn(4, 16, generator=gen)
    for op, args, ref in [
        (ops.add_rms_norm, (weight, 1e-6), lambda s: F.rms_norm(s, (16,), weight, 1e-6)),
        (ops.add_layer_norm, (weight, bias, 1e-5), lambda s: F.layer_norm(s, (16,), weight, bias, 1e-5)),
    ]:
        y, *_, total = op(x, residual, *args)
        assert y.dtype == total.dtype == torch.float32
        want_total = x + residual
        torch.testing.assert_close(total, want_total, rtol=0, atol=0)
        assert_matches(y, ref(want_total), torch.float32, "y")
        inputs = (x, residual, weight)
        got = torch.autograd.grad((y, total), inputs, (grad_y, grad_sum))
        want = torch.autograd.grad((ref(want_total), want_total), inputs, (grad_y, grad_sum))
        for g, w, t in zip(got, want, inputs):
            assert g.dtype == t.dtype
            assert_matches(g, w, t.dtype, "grad")
    with pytest.raises(ValueError, match="or be a bf16/fp16 tensor and an fp32 one"):
        ops.add_rms_norm(narrow, wide.double(), weight, 1e-6)


@pytest.mark.parametrize("bias_grad", [True, False])
def test_fp32_add_layer_norm_backward_is_torchs_kernel(bias_grad):
    """In fp32 the backward is aten's layer-norm backward (one pass; the weight stands in as grad_bias's
    template), plus grad_sum; gradients as the float64 formula gives them."""
    from torch.profiler import ProfilerActivity, profile

    gen = torch.Generator().manual_seed(3)
    x, residual, grad_y, grad_sum = (torch.randn(6, 2, 32, generator=gen) for _ in range(4))
    weight, bias = torch.randn(32, generator=gen), torch.randn(32, generator=gen)
    _, mean, rstd, total = ops.add_layer_norm(x, residual, weight, bias)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        got = ops.add_layer_norm_backward(grad_y, grad_sum, total, mean, rstd, weight, bias_grad)
    ran = [e.name for e in prof.events()]
    assert "aten::native_layer_norm_backward" in ran and "aten::mean" not in ran, ran

    ref = [leaf(t.double()) for t in (x, residual, weight, bias)]
    total_ref = ref[0] + ref[1]
    y = F.layer_norm(total_ref, (32,), ref[2], ref[3])
    want = torch.autograd.grad((y * grad_y.double()).sum() + (total_ref * grad_sum.double()).sum(), ref)
    assert_matches(got[0], want[0].float(), torch.float32, "grad_x")
    assert_matches(got[1], want[2].float(), torch.float32, "grad_weight")
    if bias_grad:
        assert_matches(got[2], want[3].float(), torch.float32, "grad_bias")
    else:
        assert got[2].shape == (0,)
