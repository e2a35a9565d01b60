"""The rotary rule: fires on megatron-core's RoPE (q and k of every layer, rotate-half and interleaved, full and
partial) and on the Hugging Face form (rotate_half by chunk or by slicing, cos/sin given or made in the graph
from the positions), training and inference, and the compiled results equal eager; sites left
unfused are reported with reasons.
The 2-layer megatron-core training runs (one compile per model and budget): test_megatron_models.py."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import npu_compile
from npu_compile.debug.report import collect
from megatron_glue.capture.testing import megatron_cpu  # noqa: F401  (fixture)

DTYPES = (torch.float32, torch.bfloat16)
RULES = ("rotary",)


# ==== megatron-core GPTModel, Llama style (its 2-layer training runs: test_megatron_models.py) ================

def llama(**overrides):
    from megatron_glue.capture.models import llama_config

    return lambda: llama_config(hidden_size=64, num_query_groups=2, **overrides)


# ==== properties: random shapes, dtypes and layouts, compiled against eager ===================================

def megatron_rope():
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    return _apply_rotary_pos_emb_bshd


def strided(t: torch.Tensor, layout: str) -> torch.Tensor:
    """t's values in a layout models produce: contiguous, a slice of a wider last dim (Megatron's k and v come
    out of one split), or its first two dims swapped in memory (a transposed view)."""
    if layout == "slice":
        return torch.cat([t, torch.zeros_like(t)], dim=-1)[..., : t.shape[-1]]
    if layout == "swapped":
        return t.transpose(0, 1).contiguous().transpose(0, 1)
    return t


@st.composite
def megatron_cases(draw):
    """Megatron's _apply_rotary_pos_emb_bshd: t [s, b, n, d], freqs [s, 1, 1, r] with an even r ≤ d (partial
    rotary when r < d), rotate-half or interleaved, t in any of three layouts."""
    dtype = draw(st.sampled_from(DTYPES))
    s, b, n = (draw(st.integers(1, 4)) for _ in range(3))
    d = 2 * draw(st.integers(1, 4))
    r = 2 * draw(st.integers(1, d // 2))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    t = strided(torch.randn(s, b, n, d, generator=gen).to(dtype), draw(st.sampled_from(["contiguous", "slice", "swapped"])))
    freqs = torch.rand(s, 1, 1, r, generator=gen) * 6  # angles; fp32 as Megatron keeps them
    return ("megatron", draw(st.booleans())), [t.requires_grad_(), freqs], draw(st.booleans())


@st.composite
def hf_cases(draw):
    """q·cos + rotate_half(q)·sin with q [b, n, s, d], often a transposed view of [b, s, n, d] as HF makes it;
    cos/sin [s, d] or [b, 1, s, d], and needing grad now and then (full rank then, as a learned table would)."""
    dtype = draw(st.sampled_from(DTYPES))
    b, n, s = (draw(st.integers(1, 4)) for _ in range(3))
    d = 2 * draw(st.integers(1, 4))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    q = torch.randn(b, s, n, d, generator=gen).to(dtype).transpose(1, 2)
    if draw(st.booleans()):
        q = q.contiguous()
    cos_grad = draw(st.booleans())
    table = (b, 1, s, d) if cos_grad or draw(st.booleans()) else (s, d)
    angles = torch.rand(table, generator=gen) * 6
    cos, sin = (f(angles).to(dtype).requires_grad_(cos_grad) for f in (torch.cos, torch.sin))
    return (draw(st.sampled_from(list(ROTATE_HALF))), False), [q.requires_grad_(), cos, sin], draw(st.booleans())


def rotate_half(x):
    x1, x2 = torch.chunk(x, 2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotate_half_sliced(x):
    """Hugging Face's rotate_half: the halves by slicing."""
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def rotate_half_sliced_in_place(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


# the spellings of rotate-half on the whole of q: chunk, HF's slices, the slices taken inside the cat
ROTATE_HALF = {"hf": rotate_half, "hf-sliced": rotate_half_sliced, "hf-sliced-in-place": rotate_half_sliced_in_place}


def rope_fn(form):
    name, interleaved = form
    if name in ROTATE_HALF:
        rotate = ROTATE_HALF[name]
        return lambda q, cos, sin: q * cos + rotate(q) * sin
    apply = megatron_rope()
    return lambda t, freqs: apply(t, freqs, rotary_interleaved=interleaved)


def check_rope(case, against_eager):
    form, inputs, no_grad = case
    run = against_eager(rope_fn(form), *inputs, rules=RULES, no_grad=no_grad, fp32_against_float64=True)
    assert run.fusions["rotary"] == 1, run.report.unfused
    assert "aten.neg" not in run.report.lowered_ops


# Derandomized, the first 30 examples hold every form, dtype and mode these draw (each example compiles);
# test_rope_equals_eager_fuzz (make fuzz) draws thousands.
@settings(max_examples=30, deadline=None)
@given(case=megatron_cases())
def test_megatron_rope_equals_eager(case, against_eager):
    check_rope(case, against_eager)


@settings(max_examples=30, deadline=None)
@given(case=hf_cases())
def test_hf_rope_equals_eager(case, against_eager):
    check_rope(case, against_eager)


@pytest.mark.fuzz
@settings(settings.get_profile("fuzz"))
@given(case=st.one_of(megatron_cases(), hf_cases()))
def test_rope_equals_eager_fuzz(case, against_eager):
    check_rope(case, against_eager)


# ==== sites left unfused, and why =============================================================================

def unfused(fn, *args, **options):
    (report,) = npu_compile.explain(fn, *args, options={"fusions": list(RULES), **options}).graphs
    return report.fusions, [(u["op"], u["reason"]) for u in report.unfused]


def megatron_inputs():
    return torch.randn(4, 2, 2, 8, requires_grad=True), torch.rand(4, 1, 1, 8)


def test_switched_off_rule_reports_each_rotation():
    fusions, sites = unfused(rope_fn(("megatron", False)), *megatron_inputs(), fusions={"rotary": False})
    assert "rotary" not in fusions
    assert sites == [("aten.neg.default", "rule 'rotary' is switched off by options['fusions']")]


def test_cos_of_another_dtype_is_declined_with_the_reason():
    q, cos, sin = torch.randn(2, 3, 5, 8), torch.randn(5, 8, dtype=torch.float64), torch.randn(5, 8, dtype=torch.float64)
    with torch.no_grad():
        fusions, sites = unfused(rope_fn(("hf", False)), q, cos, sin)
    assert fusions["rotary"] == 0
    assert sites == [("aten.neg.default", "cos/sin dtype torch.float64 differs from the input's torch.float32 "
                                          "(the product promotes; rotary does not)")]


def test_rotation_spelled_otherwise_is_reported_as_a_miss():
    def rope(q, cos, sin):  # sin times the rotation, not the rotation times sin: a form no rule holds
        return q * cos + sin * rotate_half_sliced(q)

    fusions, sites = unfused(rope, torch.randn(2, 3, 5, 8, requires_grad=True), torch.randn(5, 8), torch.randn(5, 8))
    assert fusions["rotary"] == 0
    assert sites == [("aten.neg.default", "no rotary pattern matched the ops around it")]


def test_llama_inference_is_fused_and_equals_eager(megatron_cpu):
    from megatron_glue.capture.models import build_gpt_model, synthetic_batch

    model = build_gpt_model(llama()(), 128, 32, seed=0).eval()
    batch = synthetic_batch(2, 32, 128)
    del batch["labels"]  # logits out
    torch._dynamo.reset()
    with torch.no_grad(), collect() as reports:
        expected = model(**batch)
        got = torch.compile(model, backend="ascend")(**batch)
    torch._dynamo.reset()
    (report,) = reports
    assert report.graphs == ["inference"] and report.unfused == []
    assert report.fusions["rotary"] == 4 and report.fusions["swiglu"] == 2
    assert ((got - expected).abs().max() / expected.abs().max()).item() < 1e-5


# ==== symbolic shapes: a dynamic sequence dim fuses as a static one ===========================================

@pytest.mark.parametrize("form", [
    pytest.param(("megatron", False), id="megatron-rotate-half"),
    pytest.param(("megatron", True), id="megatron-interleaved"),
    pytest.param(("hf", False), id="hf"),
    pytest.param(("hf-sliced", False), id="hf-sliced"),
])
def test_rotary_fires_on_a_dynamic_sequence_dim(form, static_then_dynamic):
    gen = torch.Generator().manual_seed(0)
    if form[0] == "megatron":  # t [s, b, n, d], freqs [s, 1, 1, r]: partial rotary, r < d
        shapes = [("s", 2, 3, 8), ("s", 1, 1, 4)]
    else:  # q [b, n, s, d], cos/sin [s, d]
        shapes = [(2, 3, "s", 8), ("s", 8), ("s", 8)]

    def make(n):
        return [(torch.rand if i else torch.randn)([n if d == "s" else d for d in shape], generator=gen)
                .requires_grad_(i == 0) for i, shape in enumerate(shapes)]

    dynamic = {i: shape.index("s") for i, shape in enumerate(shapes)}
    static, symbolic = static_then_dynamic(rope_fn(form), make, dynamic=dynamic, rules=RULES)
    assert static == symbolic == {"rotary": 1}


# ==== cos/sin computed in the graph: Hugging Face's rotary embedding ==========================================

def hf_rope_from_positions(layout):
    """HF Llama's RoPE with its tables made in the graph: ``outer(pos, inv_freq)`` → ``cat(freqs, freqs)`` →
    cos/sin in x's dtype, applied by rotate_half to q [b, n, s, d] (tables [s, d]) or [b, s, n, d] (tables
    [s, 1, d])."""

    def rope(q, pos, inv_freq):
        freqs = torch.outer(pos, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(q.dtype), emb.sin().to(q.dtype)
        if layout == "bsnd":
            cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
        return q * cos + rotate_half_sliced(q) * sin

    return rope


def positions(s, d):
    return torch.arange(s, dtype=torch.float32), 1.0 / 10000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d)


@pytest.mark.parametrize("layout", ["bnsd", "bsnd"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
def test_hf_rope_with_tables_made_in_the_graph_equals_eager(layout, dtype, against_eager):
    b, n, s, d = 2, 3, 5, 8
    shape = (b, n, s, d) if layout == "bnsd" else (b, s, n, d)
    q = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(dtype).requires_grad_()
    run = against_eager(hf_rope_from_positions(layout), q, *positions(s, d), rules=RULES, fp32_against_float64=True)
    assert run.fusions["rotary"] == 1 and run.report.unfused == []
    assert "aten.neg" not in run.report.lowered_ops
    assert run.report.lowered_ops["npu_compile.rotary_backward"] == 1


@pytest.mark.parametrize("layout", ["bnsd", "bsnd"])
def test_hf_rope_with_tables_made_in_the_graph_fires_on_a_dynamic_sequence_dim(layout, static_then_dynamic):
    gen = torch.Generator().manual_seed(0)

    def make(s):
        shape = (2, 3, s, 8) if layout == "bnsd" else (2, s, 3, 8)
        return [torch.randn(shape, generator=gen).requires_grad_(), *positions(s, 8)]

    dynamic = {0: 2 if layout == "bnsd" else 1, 1: 0}
    static, symbolic = static_then_dynamic(hf_rope_from_positions(layout), make, dynamic=dynamic, rules=RULES)
    assert static == symbolic == {"rotary": 1}
