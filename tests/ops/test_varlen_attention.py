"""npu_compile::varlen_attention (packed documents, from their lengths) against eager attention under Megatron's
dense reset mask, gradients included; document_mask against megatron-core's own mask; the conventions'
errors; no s×s allocation."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from npu_compile.ops.varlen_attention import cu_seqlens_from_eod

from .helpers import assert_matches, leaf
from .test_attention import allocation_profile

varlen_attention = torch.ops.npu_compile.varlen_attention
document_mask = torch.ops.npu_compile.document_mask


def dense_reference(q, k, v, mask, layout, scale=None):
    """Megatron's core attention over a [b, 1, s, s] mask: scores filled with -10000, softmax, P·V (GQA by
    repeating k/v heads), in the inputs' layout."""
    to_bnsd = (lambda t: t.permute(1, 2, 0, 3)) if layout == "sbnd" else (lambda t: t.transpose(1, 2))
    q4, k4, v4 = (to_bnsd(t) for t in (q, k, v))
    group = q4.shape[1] // k4.shape[1]
    k4, v4 = k4.repeat_interleave(group, 1), v4.repeat_interleave(group, 1)
    scale = 1 / math.sqrt(q4.shape[-1]) if scale is None else scale
    scores = (q4 @ k4.transpose(-1, -2) * scale).masked_fill(mask, -10000.0)
    out = torch.softmax(scores, -1) @ v4
    return out.permute(2, 0, 1, 3) if layout == "sbnd" else out.transpose(1, 2)


@st.composite
def packed_cases(draw):
    b = draw(st.integers(1, 3))
    s = draw(st.integers(1, 24))
    heads = draw(st.sampled_from([(1, 1), (2, 2), (4, 2), (4, 1)]))
    d = draw(st.sampled_from([4, 8]))
    dv = draw(st.sampled_from([d, d // 2]))
    layout = draw(st.sampled_from(["sbnd", "bsnd"]))
    dtype = draw(st.sampled_from([torch.float32, torch.float64]))
    eod_rate = draw(st.sampled_from([0.0, 0.1, 0.4]))
    scale = draw(st.sampled_from([None, 0.3]))
    pad = draw(st.booleans())
    seed = draw(st.integers(0, 2**31 - 1))
    return dict(b=b, s=s, heads=heads, d=d, dv=dv, layout=layout, dtype=dtype, eod_rate=eod_rate, scale=scale,
                pad=pad, seed=seed)


def check_case(case):
    g = torch.Generator().manual_seed(case["seed"])
    b, s, (nq, nkv), d, dv, layout = case["b"], case["s"], case["heads"], case["d"], case["dv"], case["layout"]
    shape = (lambda n, dd: (s, b, n, dd)) if layout == "sbnd" else (lambda n, dd: (b, s, n, dd))
    q, k, v = (torch.randn(*shape(n, dd), generator=g, dtype=case["dtype"]) for n, dd in ((nq, d), (nkv, d), (nkv, dv)))
    tokens = torch.where(torch.rand(b, s, generator=g) < case["eod_rate"], 0, 1)
    cu = cu_seqlens_from_eod(tokens, 0, pad_to=b * s if case["pad"] else None)
    mask = document_mask(cu, b, s)
    ours = [leaf(t) for t in (q, k, v)]
    ref = [leaf(t, torch.float64) for t in (q, k, v)]
    out, softmax_max, softmax_sum = varlen_attention(*ours, cu, layout=layout, scale=case["scale"])
    want = dense_reference(*ref, mask, layout, case["scale"])
    assert out.shape == want.shape and out.is_contiguous()
    assert softmax_max.shape == softmax_sum.shape == (b, nq, s) and softmax_max.dtype == torch.float32 or (
        case["dtype"] == torch.float64)
    assert_matches(out, want, case["dtype"], "out")
    grad = torch.randn(out.shape, generator=g, dtype=case["dtype"])
    got_grads = torch.autograd.grad(out, ours, grad)
    want_grads = torch.autograd.grad(want, ref, grad.double())
    for name, got_g, want_g in zip("qkv", got_grads, want_grads):
        assert_matches(got_g, want_g, case["dtype"], f"grad {name}")


@settings(max_examples=40)
@given(packed_cases())
def test_matches_dense_megatron_mask_with_gradients(case):
    check_case(case)


def test_document_mask_is_megatron_cores_reset_mask():
    """The mask megatron-core's GPTDataset builds with reset_attention_mask, row by row, from the same tokens."""
    from megatron.core.datasets.gpt_dataset import _get_ltor_masks_and_position_ids

    torch.manual_seed(0)
    eod = 7
    tokens = torch.randint(0, 9, (4, 33))
    tokens[0, -1] = eod  # a document ending on the last token
    tokens[1] = 1  # a row of one document
    cu = cu_seqlens_from_eod(tokens, eod, pad_to=4 * 33)
    mask = document_mask(cu, 4, 33)
    for row in range(4):
        megatron, _, _ = _get_ltor_masks_and_position_ids(tokens[row], eod, False, True, False, True)
        assert torch.equal(mask[row, 0], megatron[0]), row


def test_padding_changes_nothing_and_keeps_one_shape():
    torch.manual_seed(1)
    q, k, v = (torch.randn(12, 2, 2, 8) for _ in range(3))
    tokens = torch.tensor([[1, 0, 1, 1, 0, 1, 1, 1, 1, 1, 0, 1], [1] * 12])
    short = cu_seqlens_from_eod(tokens, 0)
    padded = cu_seqlens_from_eod(tokens, 0, pad_to=24)
    assert short.tolist() == [2, 5, 11, 12, 24] and padded.shape == (24,) and padded[5:].eq(24).all()
    torch.testing.assert_close(varlen_attention(q, k, v, short)[0], varlen_attention(q, k, v, padded)[0],
                               rtol=0, atol=0)


@pytest.mark.parametrize("cu, message", [
    ([4, 8, 20], "cu_seqlens must end at b·s = 24 (every token in a document), got 20"),
    ([4, 14, 24], "cu_seqlens must hold every row end (multiples of s = 12): documents may not cross rows; "
                  "missing [12]"),
    ([12, 4, 24], "cu_seqlens must be non-decreasing cumulative ends from 0, got [12, 4, 24]"),
])
def test_bad_lengths_are_refused_naming_the_convention(cu, message):
    q = torch.randn(12, 2, 2, 8)
    with pytest.raises(ValueError) as raised:
        varlen_attention(q, q, q, torch.tensor(cu))
    assert str(raised.value) == message


def test_bad_arguments():
    q = torch.randn(12, 2, 2, 8)
    with pytest.raises(ValueError, match=r"cu_seqlens must be 1-D int64 \(cumulative document ends\), got 1-D "
                                         r"torch.int32"):
        varlen_attention(q, q, q, torch.tensor([12, 24], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"layout must be one of \('sbnd', 'bsnd'\), got 'bnsd'"):
        varlen_attention(q, q, q, torch.tensor([12, 24]), layout="bnsd")
    with pytest.raises(ValueError, match="pad_to=1 is fewer than the 2 documents"):
        cu_seqlens_from_eod(torch.tensor([[1, 0, 1, 1]]), 0, pad_to=1)


def test_no_s_by_s_allocation():
    """Documents of 64 tokens in a row of 2048: the op's largest allocation is a document's, far below one s×s
    score matrix; the dense reference allocates at least that."""
    b, n, s, d = 1, 2, 2048, 16
    full = b * n * s * s * 4
    q, k, v = (torch.randn(s, b, n, d, requires_grad=True) for _ in range(3))
    tokens = torch.ones(b, s, dtype=torch.int64)
    tokens[:, 63::64] = 0
    cu = cu_seqlens_from_eod(tokens, 0, pad_to=b * s)
    result = {}

    def forward():
        result["out"], *_ = varlen_attention(q, k, v, cu)

    forward_peak, forward_largest = allocation_profile(forward)
    grad = torch.randn_like(result["out"])
    backward_peak, backward_largest = allocation_profile(lambda: torch.autograd.grad(result["out"], (q, k, v), grad))
    assert max(forward_peak, backward_peak) < full / 32, (forward_peak / full, backward_peak / full)
    # the check can fail: the dense mask alone is s×s
    mask_peak, mask_largest = allocation_profile(lambda: document_mask(cu, b, s))
    assert mask_largest >= s * s
