"""npu_compile::linear_cross_entropy (and its backward op) against F.cross_entropy(F.linear(h, w).float(), t):
reductions, ignore_index, label smoothing, chunk sizes, dtypes; the chunked kernel never holds [N, V] fp32. And
npu_compile::vocab_parallel_linear_cross_entropy against megatron-core's vocab_parallel_cross_entropy at TP=1."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.library import opcheck

import npu_compile.ops  # noqa: F401  (importing registers the ops)
from megatron_glue.capture.testing import megatron_cpu  # noqa: F401  (fixture, for the Megatron comparison)
from npu_compile.ops.cross_entropy import chunk_rows

from .helpers import assert_matches, fuzz_settings, leaf

ops = torch.ops.npu_compile


def eager(h, w, t, ignore_index, label_smoothing, reduction):
    vocab = w.shape[0]
    loss = F.cross_entropy(F.linear(h, w).float().reshape(-1, vocab), t.reshape(-1), ignore_index=ignore_index,
                           label_smoothing=label_smoothing, reduction=reduction)
    return loss.view(t.shape) if reduction == "none" else loss


@st.composite
def ce_cases(draw):
    return dict(
        lead=draw(st.lists(st.integers(1, 6), min_size=1, max_size=2)),
        hidden=draw(st.integers(1, 16)),
        vocab=draw(st.integers(2, 40)),
        dtype=draw(st.sampled_from([torch.float32, torch.bfloat16])),
        reduction=draw(st.sampled_from(["mean", "sum", "none"])),
        label_smoothing=draw(st.sampled_from([0.0, 0.1, 0.5])),
        ignore_index=draw(st.sampled_from([-100, -1, 0])),
        ignored=draw(st.floats(0.0, 0.5)),
        chunk_size=draw(st.sampled_from([0, 1, 3, 7])),
        weight_grad=draw(st.booleans()),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


def build(case):
    gen = torch.Generator().manual_seed(case["seed"])
    shape = (*case["lead"], case["hidden"])
    h = torch.randn(shape, generator=gen).to(case["dtype"])
    w = (torch.randn(case["vocab"], case["hidden"], generator=gen) / case["hidden"] ** 0.5).to(case["dtype"])
    t = torch.randint(0, case["vocab"], tuple(case["lead"]), generator=gen)
    t[torch.rand(t.shape, generator=gen) < case["ignored"]] = case["ignore_index"]
    if (t != case["ignore_index"]).sum() == 0:
        t.view(-1)[0] = 1  # "mean" over no tokens is nan on both sides; keep one (vocab >= 2)
    return h, w, t, gen


def check(case):
    h, w, t, gen = build(case)
    args = (case["ignore_index"], case["label_smoothing"], case["reduction"])
    want_h, want_w = leaf(h, torch.float64), leaf(w, torch.float64)
    want = eager(want_h, want_w, t, *args)
    got_h, got_w = leaf(h), w.detach().clone().requires_grad_(case["weight_grad"])
    got, lse = ops.linear_cross_entropy(got_h, got_w, t, *args, case["chunk_size"])
    assert got.dtype == torch.float32 and got.shape == want.shape and lse.shape == t.shape
    assert_matches(got, want, case["dtype"], "loss")
    grad = torch.randn(want.shape, generator=gen, dtype=torch.float64)
    want.backward(grad)
    got.backward(grad.float())
    assert_matches(got_h.grad, want_h.grad, case["dtype"], "grad hidden")
    assert got_h.grad.dtype == h.dtype
    if case["weight_grad"]:
        assert got_w.grad.dtype == w.dtype
        assert_matches(got_w.grad, want_w.grad, case["dtype"], "grad weight")
    else:
        assert got_w.grad is None


@settings(max_examples=25, deadline=None)
@given(ce_cases())
def test_linear_cross_entropy_matches_eager(case):
    check(case)


@pytest.mark.fuzz
@fuzz_settings()
@given(ce_cases())
def test_linear_cross_entropy_matches_eager_fuzz(case):
    check(case)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.2])
def test_fp32_equals_eager_fp32_within_1e5(reduction, label_smoothing):
    """Against eager at the same precision (fp32 matmul, fp32 loss), not only against float64."""
    gen = torch.Generator().manual_seed(1)
    h, w = torch.randn(4, 3, 16, generator=gen), torch.randn(50, 16, generator=gen) / 4
    t = torch.randint(0, 50, (4, 3), generator=gen)
    t[1, :2] = -100
    eh, ew, gh, gw = leaf(h), leaf(w), leaf(h), leaf(w)
    want = eager(eh, ew, t, -100, label_smoothing, reduction)
    got, _ = ops.linear_cross_entropy(gh, gw, t, -100, label_smoothing, reduction, 5)
    grad = torch.randn(want.shape, generator=gen)
    want.backward(grad)
    got.backward(grad)
    for g, e in ((got, want), (gh.grad, eh.grad), (gw.grad, ew.grad)):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5 * e.abs().max().item())


def test_lse_is_the_logsumexp_of_the_fp32_logits():
    h, w = torch.randn(5, 8), torch.randn(7, 8)
    _, lse = ops.linear_cross_entropy(h, w, torch.zeros(5, dtype=torch.long), chunk_size=2)
    torch.testing.assert_close(lse, torch.logsumexp(h @ w.t(), -1))


def test_all_ignored_mean_is_nan_as_in_eager():
    h, w, t = torch.randn(3, 4), torch.randn(5, 4), torch.full((3,), -100)
    assert F.cross_entropy(h @ w.t(), t).isnan()
    assert ops.linear_cross_entropy(h, w, t)[0].isnan()


def test_chunk_rows():
    assert chunk_rows(10, 4, 3) == 3
    assert chunk_rows(10, 4, 0) == 10  # small problems: one chunk
    assert chunk_rows(2**20, 2**16, 0) == 2**6  # 2**22 fp32 logits per chunk
    assert chunk_rows(4, 2**30, 0) == 1


def test_chunked_backward_never_holds_the_full_logits():
    """The backward's largest allocation is one chunk of fp32 logits (plus the outputs), not [N, V]."""
    from torch.utils._python_dispatch import TorchDispatchMode

    n, vocab, hidden, chunk = 64, 512, 8, 8

    class Largest(TorchDispatchMode):
        biggest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for o in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(o, torch.Tensor):
                    Largest.biggest = max(Largest.biggest, o.numel())
            return out

    h, w = leaf(torch.randn(n, hidden)), leaf(torch.randn(vocab, hidden))
    t = torch.randint(0, vocab, (n,))
    with Largest():
        loss, _ = ops.linear_cross_entropy(h, w, t, chunk_size=chunk)
        loss.backward()
    assert Largest.biggest == chunk * vocab < n * vocab


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_opcheck(reduction):
    h, w = torch.randn(4, 8, requires_grad=True), torch.randn(6, 8, requires_grad=True)
    t = torch.tensor([0, 5, -100, 2])
    opcheck(ops.linear_cross_entropy, (h, w, t, -100, 0.1, reduction, 3))
    grad = torch.randn(4) if reduction == "none" else torch.tensor(0.7)
    lse = ops.linear_cross_entropy(h, w, t, -100, 0.1, reduction, 3)[1]
    opcheck(ops.linear_cross_entropy_backward, (grad, h.detach(), w.detach(), t, lse, -100, 0.1, reduction, 3, True))


def test_errors():
    h, w, t = torch.randn(4, 8), torch.randn(6, 8), torch.zeros(4, dtype=torch.long)
    with pytest.raises(ValueError, match=r"reduction must be one of \('none', 'mean', 'sum'\), got 'avg'"):
        ops.linear_cross_entropy(h, w, t, reduction="avg")
    with pytest.raises(ValueError, match=r"target \(3,\) torch.int64 must be int64 shaped like hidden's leading "
                                         r"dims \(4,\)"):
        ops.linear_cross_entropy(h, w, t[:3])
    with pytest.raises(ValueError, match=r"hidden \(4, 8\) torch.float32 and weight \(6, 8\) torch.bfloat16 "):
        ops.linear_cross_entropy(h, w.bfloat16(), t)


# ==== vocab_parallel_linear_cross_entropy: Megatron's loss, one rank ========================================

@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("chunk_size", [0, 5])
def test_vocab_parallel_equals_megatron_at_tp1(megatron_cpu, smoothing, chunk_size):
    """Against megatron-core's vocab_parallel_cross_entropy(α) at TP=1 (ε = α·V/(V − 1)), labels out of the
    vocabulary included (logit counted 0, as Megatron), chunked or not: loss and both gradients."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    gen = torch.Generator().manual_seed(0)
    s, b, hidden, vocab = 4, 3, 8, 24
    h = torch.randn(s, b, hidden, generator=gen, requires_grad=True)
    w = (torch.randn(vocab, hidden, generator=gen) / hidden**0.5).requires_grad_()
    t = torch.randint(0, vocab, (s, b), generator=gen)
    t.view(-1)[::4] = -100
    seed = torch.randn(s, b, generator=gen)
    group = parallel_state.get_tensor_model_parallel_group().group_name
    eps = smoothing * vocab / (vocab - 1)
    loss, lse = torch.ops.npu_compile.vocab_parallel_linear_cross_entropy(h, w, t, 0, eps, group, chunk_size)
    grads = torch.autograd.grad(loss, (h, w), seed)
    h2, w2 = h.detach().requires_grad_(), w.detach().requires_grad_()
    expected = vocab_parallel_cross_entropy((h2 @ w2.t()).float(), t, smoothing)
    expected_grads = torch.autograd.grad(expected, (h2, w2), seed)
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse, torch.logsumexp(h.detach() @ w.detach().t(), -1), rtol=1e-5, atol=1e-6)
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_vocab_parallel_issues_no_collective_over_one_process(megatron_cpu, monkeypatch):
    """A group of one process reduces to the tensor itself: no functional all-reduce is issued at TP=1 (three
    collectives and their waits a step otherwise); the loss is unchanged. TP=2's all-reduces:
    tests/passes/test_megatron_cross_entropy.py."""
    from megatron.core import parallel_state

    gen = torch.Generator().manual_seed(0)
    h, w = torch.randn(4, 3, 8, generator=gen), torch.randn(24, 8, generator=gen)
    t = torch.randint(0, 24, (4, 3), generator=gen)
    group = parallel_state.get_tensor_model_parallel_group().group_name
    issued = []
    real = torch.ops._c10d_functional.all_reduce
    monkeypatch.setattr(torch.ops._c10d_functional, "all_reduce", lambda *a: issued.append(a[1:]) or real(*a))
    loss, _lse = torch.ops.npu_compile.vocab_parallel_linear_cross_entropy(h, w, t, 0, 0.0, group)
    assert issued == []
    torch.testing.assert_close(loss, torch.nn.functional.cross_entropy(h.view(12, 8) @ w.t(), t.view(12),
                                                                       reduction="none").view(4, 3))


@pytest.mark.parametrize("chunk_size", [0, 5])
def test_vocab_parallel_bf16_logits_grad_equals_megatron_fused_at_tp1(megatron_cpu, chunk_size):
    """logits_grad_dtype=bf16 against megatron-core's fused_vocab_parallel_cross_entropy at TP=1, which returns
    the logits' gradient in bf16 (fp32 model): loss and both gradients, chunked or not."""
    from megatron.core import parallel_state
    from megatron.core.fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy

    gen = torch.Generator().manual_seed(0)
    s, b, hidden, vocab = 4, 3, 8, 24
    h = torch.randn(s, b, hidden, generator=gen, requires_grad=True)
    w = (torch.randn(vocab, hidden, generator=gen) / hidden**0.5).requires_grad_()
    t = torch.randint(0, vocab, (s, b), generator=gen)
    t.view(-1)[::4] = -100
    seed = torch.randn(s, b, generator=gen)
    group = parallel_state.get_tensor_model_parallel_group()
    loss, _lse = torch.ops.npu_compile.vocab_parallel_linear_cross_entropy(h, w, t, 0, 0.0, group.group_name,
                                                                           chunk_size, torch.bfloat16)
    grads = torch.autograd.grad(loss, (h, w), seed)
    h2, w2 = h.detach().requires_grad_(), w.detach().requires_grad_()
    with torch.compiler.set_stance("force_eager"):  # Megatron's jit_fuser helpers (torch.compile) as plain ops
        expected = fused_vocab_parallel_cross_entropy(h2 @ w2.t(), t, group)
        expected_grads = torch.autograd.grad(expected, (h2, w2), seed)
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
