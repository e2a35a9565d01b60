"""Attention rules, the spellings beyond the plain one and the precisions around them: scale on q or by a 0-dim
tensor, additive float masks (-inf, finfo.min) in their broadcasts, torch.where masks, learned biases (their
gradient from the fused op), softmax upcast to fp32 inside bf16/fp16 attention, Megatron's own attention in
bf16/fp16 with and without attention_softmax_in_fp32 and layer scaling; and graphs with a symbolic sequence
length (mark_dynamic, automatic dynamic) keep their attention fused."""

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_glue.capture.testing import megatron_cpu  # noqa: F401  (fixture)
from npu_compile.debug.report import collect

RULES = ("attention",)
UNFUSED_OPS = {"aten._softmax", "aten._softmax_backward_data", "aten._safe_softmax", "aten.bmm", "aten.baddbmm"}
B, N, S, D = 2, 4, 8, 16


def causal(like):
    """The [s, s] causal mask (True = masked) for scores ``like``, from their (maybe symbolic) length."""
    s = like.size(-1)
    return torch.ones(s, s, dtype=torch.bool, device=like.device).triu(1)


def scores_of(q, k):
    return q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5


def scale_on_query(q, k, v):
    return ((q * q.shape[-1] ** -0.5) @ k.transpose(-2, -1)).softmax(dim=-1) @ v


def divided_by_a_0dim_tensor(q, k, v):
    scores = q @ k.transpose(-2, -1) / torch.full([], q.shape[-1] ** 0.5, dtype=q.dtype, device=q.device)
    return scores.softmax(dim=-1) @ v


def additive(broadcast, value):
    """scores + a 0/fill float mask of shape [s, s], [1, 1, s, s] or [b, 1, s, s]."""

    def attention(q, k, v):
        scores = scores_of(q, k)
        fill = torch.finfo(q.dtype).min if value == "finfo.min" else -math.inf
        b, s = q.size(0), q.size(2)
        shape = {"[s,s]": (s, s), "[1,1,s,s]": (1, 1, s, s), "[b,1,s,s]": (b, 1, s, s)}[broadcast]
        mask = torch.zeros(shape, dtype=q.dtype, device=q.device).masked_fill(causal(scores), fill)
        return (scores + mask).softmax(dim=-1) @ v

    return attention


def where(value):
    def attention(q, k, v):
        scores = scores_of(q, k)
        fill = torch.finfo(scores.dtype).min if value == "finfo.min" else -math.inf
        return torch.where(~causal(scores), scores, fill).softmax(dim=-1) @ v

    return attention


def softmax_upcast(q, k, v):
    return scores_of(q, k).float().softmax(-1).to(q.dtype) @ v


def softmax_dtype_fp32(q, k, v):
    scores = scores_of(q, k)
    return F.softmax(scores.masked_fill(causal(scores), -1e4), -1, dtype=torch.float32).to(q.dtype) @ v


def learned_bias(q, k, v, bias):
    """A learned additive bias (relative position bias [1, n, s, s], ALiBi's slopes · distances learned, or one
    [s, s] table for all heads); it needs a gradient, which the fused op returns."""
    return (scores_of(q, k) + bias).softmax(dim=-1) @ v


def bias_of(kind, b, n, s, dtype, generator):
    if kind == "alibi":
        distance = (torch.arange(s)[None, :] - torch.arange(s)[:, None]).clamp(max=0).float()
        slopes = torch.tensor([2.0 ** (-8.0 * (h + 1) / n) for h in range(n)])
        table = (slopes[:, None, None] * distance)[None]
    else:
        table = torch.randn({"[s,s]": (s, s), "[b,n,s,s]": (b, n, s, s)}[kind], generator=generator)
    return table.to(dtype).requires_grad_()


SPELLINGS = {
    "scale_on_query": (scale_on_query, None),
    "divided_by_a_0dim_tensor": (divided_by_a_0dim_tensor, None),
    "additive_-inf_[s,s]": (additive("[s,s]", "-inf"), None),
    "additive_finfo.min_[1,1,s,s]": (additive("[1,1,s,s]", "finfo.min"), None),
    "additive_finfo.min_[b,1,s,s]": (additive("[b,1,s,s]", "finfo.min"), None),
    "where_finfo.min": (where("finfo.min"), None),
    "where_-inf": (where("-inf"), None),
    "softmax_upcast": (softmax_upcast, None),
    "F.softmax_dtype_fp32": (softmax_dtype_fp32, None),
    "learned_bias_alibi": (learned_bias, "alibi"),
    "learned_bias_[s,s]": (learned_bias, "[s,s]"),
    "learned_bias_[b,n,s,s]": (learned_bias, "[b,n,s,s]"),
}

# bf16 (2 ulps of the tensor's scale beyond eager's own error against float64) as in tests/passes/conftest.py
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2 * 2.0**-8}


def _relative(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


def _pairwise():
    """Each spelling in two of its four (dtype, mode) pairs, alternating which two: every spelling in both dtypes and
    both modes, every (dtype, mode) pair for half the spellings; the fuzz twin takes all four."""
    pairs = [((torch.float32, True), (torch.bfloat16, False)), ((torch.bfloat16, True), (torch.float32, False))]
    return [pytest.param(spelling, dtype, training,
                         id=f"{spelling}-{'fp32' if dtype == torch.float32 else 'bf16'}-"
                            f"{'training' if training else 'inference'}")
            for i, spelling in enumerate(SPELLINGS) for dtype, training in pairs[i % 2]]


@pytest.mark.parametrize("spelling, dtype, training", _pairwise())
def test_spelling_fuses_and_equals_eager(spelling, dtype, training):
    """One compile with a symbolic sequence length (mark_dynamic), then EXAMPLES lengths and seeds drawn by
    Hypothesis: every example is fused and equals eager, output and the gradients of q, k, v and a learned
    bias, held to float64 (no further from it than eager is, plus the dtype's tolerance)."""
    check_spelling(spelling, dtype, training, settings(max_examples=EXAMPLES, deadline=None), longest=24)


@pytest.mark.fuzz
@pytest.mark.parametrize("training", [True, False], ids=["training", "inference"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("spelling", SPELLINGS)
def test_spelling_fuses_and_equals_eager_fuzz(spelling, dtype, training):
    check_spelling(spelling, dtype, training, settings(settings.get_profile("fuzz"), max_examples=300, deadline=None),
                   longest=300)


def check_spelling(spelling, dtype, training, hypothesis_settings, longest):
    fn, bias_kind = SPELLINGS[spelling]

    def self_attention(q, k, v, *bias):
        # one length for q and k/v, as self-attention has (mark_dynamic alone gives each input its own)
        torch._check(k.size(2) == q.size(2))
        torch._check(v.size(2) == q.size(2))
        return fn(q, k, v, *bias)

    compiled = torch.compile(self_attention, backend="ascend", options={"fusions": list(RULES)})
    b, n, d = 2, 4, 16

    def inputs(s, seed, dt, dynamic=False):
        g = torch.Generator().manual_seed(seed)
        xs = [torch.randn(b, n, s, d, generator=g).to(dt).requires_grad_() for _ in range(3)]
        if bias_kind:
            xs.append(bias_of(bias_kind, b, n, s, dt, g))
        if dynamic:  # the sequence dims: q, k, v's third, a bias's last two
            for x in xs[:3]:
                torch._dynamo.mark_dynamic(x, 2)
            for x in xs[3:]:
                torch._dynamo.mark_dynamic(x, x.dim() - 1)
                torch._dynamo.mark_dynamic(x, x.dim() - 2)
        return xs

    def run(f, xs):
        with torch.set_grad_enabled(training):
            out = f(*xs)
            if not training:
                return [out]
            seed = torch.randn(out.shape, generator=torch.Generator().manual_seed(0))
            out.backward(seed.to(out.dtype))
        return [out, *(x.grad for x in xs)]

    @hypothesis_settings
    @given(s=st.integers(2, longest), seed=st.integers(0, 2**16))
    def equals_eager(s, seed):
        got = run(compiled, inputs(s, seed, dtype, dynamic=True))
        with torch._dynamo.config.patch(disable=True):
            eager = run(fn, inputs(s, seed, dtype))
            exact = run(fn, inputs(s, seed, torch.float64))
        for name, g, e, x in zip(["out", "grad q", "grad k", "grad v", "grad bias"], got, eager, exact):
            assert g.dtype == e.dtype and g.shape == e.shape, name
            allowed = TOLERANCE[dtype] + _relative(e, x)
            assert _relative(g, x) <= allowed, (name, s, _relative(g, x), allowed)

    torch._dynamo.reset()
    with collect() as reports:
        equals_eager()
    torch._dynamo.reset()
    (report,) = reports  # one symbolic graph took every length
    unfused = [u for u in report.unfused if u["rule"] == "attention"]
    assert report.fusions == {"attention": 1}, unfused
    assert not UNFUSED_OPS & set(report.lowered_ops) and unfused == []


EXAMPLES = 16  # per spelling, dtype and mode: 12 spellings · 2 of the 4 pairs · 16 = 384 examples


# ==== Megatron's DotProductAttention in bf16 / fp16 ==========================================================

@pytest.mark.parametrize("training", [True, False], ids=["training", "inference"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("softmax_in_fp32, layer_scaling", [(True, False), (True, True), (False, False)],
                         ids=["softmax_in_fp32", "layer_scaling", "softmax_in_dtype"])
def test_megatron_half_precision_attention_fuses(dtype, softmax_in_fp32, layer_scaling, training, megatron_cpu):
    """Each of the three forms Megatron's attention takes in a half-precision model fuses, forward and backward;
    compiled and eager are both held to the float64 result, compiled no further from it than twice eager's
    error plus an ulp of the dtype."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron_glue.capture.models import gpt_config

    def module(half):
        kw = dict(bf16=half == torch.bfloat16, fp16=half == torch.float16, params_dtype=half) if half else {}
        config = gpt_config(hidden_size=N * D, num_attention_heads=N, attention_softmax_in_fp32=softmax_in_fp32,
                            apply_query_key_layer_scaling=layer_scaling, **kw)
        return DotProductAttention(config, layer_number=3, attn_mask_type=AttnMaskType.causal, attention_type="self")

    g = torch.Generator().manual_seed(0)
    base = [torch.randn(S, B, N, D, generator=g) for _ in range(3)]
    grad = torch.randn(S, B, N * D, generator=g)
    mask = torch.ones(S, S, dtype=torch.bool).triu(1)[None, None]

    def run(fn, dt):
        inputs = [t.to(dt).requires_grad_() for t in base]
        if not training:
            with torch.no_grad():
                return [fn(*inputs, mask)]
        out = fn(*inputs, mask)
        out.backward(grad.to(dt))
        return [out, *(t.grad for t in inputs)]

    torch._dynamo.reset()
    with torch._dynamo.config.patch(disable=True):
        exact = run(module(None), torch.float64)
        eager = run(module(dtype), dtype)
    with collect() as reports:
        compiled = run(torch.compile(module(dtype), backend="ascend", options={"fusions": list(RULES)}), dtype)
    torch._dynamo.reset()
    (report,) = reports
    assert report.fusions == {"attention": 1}, report.unfused
    assert not UNFUSED_OPS & set(report.lowered_ops)
    ulp = torch.finfo(dtype).eps
    for name, got, want, x in zip(["out", "grad q", "grad k", "grad v"], compiled, eager, exact):
        assert got.dtype == dtype
        assert _relative(got, x) <= 2 * _relative(want, x) + ulp, name


# ==== symbolic sequence lengths ==============================================================================

LENGTHS = (16, 9, 24, 13, 32, 7, 20, 11, 28, 5)


class CausalSelfAttention(torch.nn.Module):
    """GPT-2 style: fused qkv projection, [b, s, n, d] heads transposed in, causal masked_fill, heads merged."""

    def __init__(self, hidden=32, heads=4):
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(hidden, 3 * hidden)
        self.proj = torch.nn.Linear(hidden, hidden)

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, h // self.heads).unbind(2)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))
        mask = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1)
        probs = scores.masked_fill(mask, float("-inf")).softmax(dim=-1)
        return self.proj((probs @ v).transpose(1, 2).contiguous().view(b, s, h))


def heads_first_causal_attention(q, k, v):
    """[b, n, s, d] throughout, the causal mask built in the graph from the symbolic length."""
    s = q.size(2)
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))
    mask = torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1)
    return scores.masked_fill(mask, float("-inf")).softmax(dim=-1) @ v


@pytest.mark.parametrize("dynamic", ["mark_dynamic", "automatic"])
@pytest.mark.parametrize("model", ["gpt2_style_module", "heads_first_function"])
def test_symbolic_sequence_length_keeps_attention_fused(model, dynamic):
    """Ten sequence lengths, one symbolic graph (after the first static one, with automatic dynamic shapes):
    each graph fuses its attention as the static graph does, and every length equals eager, output and
    gradients (of the weights, or of q, k and v)."""
    torch.manual_seed(0)
    if model == "gpt2_style_module":
        eager, compiled_model = CausalSelfAttention(), CausalSelfAttention()
        compiled_model.load_state_dict(eager.state_dict())
        shape, dim = (lambda s: [(2, s, 32)]), 1
    else:
        eager = compiled_model = heads_first_causal_attention
        shape, dim = (lambda s: [(2, 4, s, 8)] * 3), 2
    compiled = torch.compile(compiled_model, backend="ascend", options={"fusions": list(RULES)})

    def inputs_of(s):
        g = torch.Generator().manual_seed(100 + s)
        xs = [torch.randn(*size, generator=g, requires_grad=model != "gpt2_style_module") for size in shape(s)]
        return xs

    def grads(fn, xs):
        if isinstance(fn, torch.nn.Module):
            out = [p.grad.clone() for p in fn.parameters()]
            fn.zero_grad()
            return out
        return [x.grad for x in xs]

    torch._dynamo.reset()
    with collect() as reports:
        for s in LENGTHS:
            xs, ys = inputs_of(s), inputs_of(s)
            if dynamic == "mark_dynamic":
                for x in xs:
                    torch._dynamo.mark_dynamic(x, dim)
            got, want = compiled(*xs), eager(*ys)
            seed = torch.randn(want.shape, generator=torch.Generator().manual_seed(s))
            got.backward(seed), want.backward(seed)
            assert _relative(got, want) < 1e-5, s
            for a, b in zip(grads(compiled_model, xs), grads(eager, ys), strict=True):
                assert _relative(a, b) < 1e-5, s
    torch._dynamo.reset()
    assert len(reports) == (1 if dynamic == "mark_dynamic" else 2)
    for report in reports:
        assert report.fusions == {"attention": 1}, report.unfused
        assert not UNFUSED_OPS & set(report.lowered_ops)


def test_megatron_gpt_with_symbolic_sequence_length_keeps_attention_fused(megatron_cpu):
    """megatron-core GPTModel (2 layers), ten sequence lengths: the static graph and the automatic-dynamic one
    fuse both layers' attention, and losses and gradients equal eager at every length."""
    from megatron_glue.capture.models import build_gpt_model, gpt_config, synthetic_batch

    def config():
        return gpt_config(hidden_size=64)

    eager = build_gpt_model(config(), 128, 32)
    compiled = torch.compile(build_gpt_model(config(), 128, 32), backend="ascend", options={"fusions": list(RULES)})

    def grads_of(m):
        grads = [p.grad.clone() for p in m.parameters()]
        m.zero_grad()
        return grads

    torch._dynamo.reset()
    with collect() as reports, torch._dynamo.config.patch(disable=False):
        for s in LENGTHS:
            batch = synthetic_batch(2, s, 128, seed=s)
            got = compiled(**batch)
            with torch._dynamo.config.patch(disable=True):  # Megatron's jit_fuser is torch.compile
                want = eager(**batch)
            got.mean().backward(), want.mean().backward()
            assert _relative(got, want) < 1e-5, s
            for a, b in zip(grads_of(compiled), grads_of(eager)):
                assert _relative(a, b) < 1e-5, s
    torch._dynamo.reset()
    assert len(reports) == 2
    for report in reports:
        assert report.fusions == {"attention": 2}, report.unfused
        assert not UNFUSED_OPS & set(report.lowered_ops)
