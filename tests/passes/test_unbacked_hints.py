"""Size hints for data-dependent sizes (npu_compile/passes/unbacked_hints.py): an MoE layer's routed rows weigh
what they hold in the memory analysis, instead of nothing."""

from __future__ import annotations

import pytest
import torch

from npu_compile.debug.report import collect

T, H, E, K = 12, 16, 4, 2  # tokens, hidden, experts, top-k


def _moe(x, router, experts):
    """megatron-core's dropless routing in plain torch: a top-k mask by scatter into zeros, the routed tokens by
    masked_select, each expert's rows by the mask's per-expert counts (.tolist()), one matmul per expert."""
    logits = x @ router
    top = torch.topk(logits, K, dim=1).indices
    mask = torch.zeros_like(logits, dtype=torch.int32).scatter(1, top, 1).bool()
    tokens = torch.arange(x.shape[0]).unsqueeze(0).expand(E, -1).masked_select(mask.t().contiguous())
    counts = mask.sum(dim=0).tolist()
    rows = x.index_select(0, tokens).split(counts)
    out = torch.cat([torch.tanh(r @ w) for r, w in zip(rows, experts)])
    return torch.zeros_like(x).index_add(0, tokens, out)


def _compiled(fn, *args):
    with torch._dynamo.config.patch(capture_scalar_outputs=True, capture_dynamic_output_shape_ops=True), \
            collect() as reports:
        out = torch.compile(fn, backend="ascend", options={"target": "reference", "cache": False})(*args)
        out.sum().backward()
    return out, reports


@pytest.fixture
def inputs():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(T, H, generator=g, requires_grad=True)
    router = torch.randn(H, E, generator=g, requires_grad=True)
    experts = [torch.randn(H, H, generator=g, requires_grad=True) for _ in range(E)]
    return x, router, experts


def test_routed_rows_are_tokens_times_topk_and_experts_share_them(fresh_dynamo, inputs):
    """The masked_select over the top-k mask: T x K rows (exact, whatever the routing); the experts' split sizes,
    tied to it by torch's Eq(u_a + ... , u_rows): T x K / E each. The planned saved activations then hold the
    experts' inputs and outputs at their real total: every routed row once in, once out (hidden floats each),
    equal to the bytes the compiled step really saves."""
    x, router, experts = inputs
    want = _moe(x, router, experts)
    got, (report,) = _compiled(_moe, x, router, experts)
    torch.testing.assert_close(got, want)
    hints = report.memory["unbacked_hints"]
    assert sorted(hints.values()) == sorted([T * K] + [T * K // E] * E), hints
    # what the step really saves besides its inputs: measured with autograd's pack hook
    saved: dict[int, int] = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    compiled = torch.compile(_moe, backend="ascend", options={"target": "reference", "cache": False})
    with torch._dynamo.config.patch(capture_scalar_outputs=True, capture_dynamic_output_shape_ops=True), \
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        compiled(x, router, experts)
    inputs_ = {t.untyped_storage().data_ptr() for t in (x, router, *experts)}
    real = sum(n for ptr, n in saved.items() if ptr not in inputs_)
    assert report.memory["saved_activation_bytes"] == real


def test_without_a_top_k_mask_no_hint_is_made(fresh_dynamo, inputs):
    """A mask that is not a top-k scatter (a threshold): its true count is the data's, and no hint is invented."""
    x = inputs[0]

    def positive_rows(x):
        return x.masked_select(x > 0).sum()

    _, (report,) = _compiled(positive_rows, x)
    assert "unbacked_hints" not in report.memory
