"""Activation rules: bias_gelu and swiglu fire on megatron-core's MLPs and on the forms models write, training
and inference, and the compiled results equal eager; declined and switched-off sites are reported with reasons.
The 2-layer megatron-core training runs (one compile per model and budget): test_megatron_models.py."""

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import npu_compile
from hypothesis_forms import each_form, shifted  # tests/, on sys.path as its conftest's folder

DTYPES = (torch.float32, torch.bfloat16)
RULES = ("bias_gelu", "swiglu")


def megatron_fusions():
    from megatron.core.fusions.fused_bias_gelu import bias_gelu_impl
    from megatron.core.fusions.fused_bias_swiglu import bias_swiglu_impl

    return bias_gelu_impl, bias_swiglu_impl


# ==== properties: random shapes and dtypes, compiled against eager ============================================

@st.composite
def bias_gelu_cases(draw, forms=None, shift=0):
    """(form, x, bias, no_grad): x of rank 1-3, a bias over its last dim ([h] or keepdims), either or both
    needing grad, fp32 or bf16; run for training or under no_grad (the inference graph)."""
    shifted(draw, shift)
    dtype = draw(st.sampled_from(DTYPES))
    form = draw(st.sampled_from(forms or BIAS_GELU_FORMS))
    shape = draw(st.lists(st.integers(1, 5), min_size=1, max_size=3))
    x_grad, bias_grad = draw(st.sampled_from([(True, True), (True, False), (False, True)]))
    bias_shape = [1] * (len(shape) - 1) * draw(st.booleans()) + shape[-1:]
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    x = (torch.randn(shape, generator=gen) * 3).to(dtype).requires_grad_(x_grad)
    bias = torch.randn(bias_shape, generator=gen).to(dtype).requires_grad_(bias_grad)
    return form, x, bias, draw(st.booleans())


# The tanh GeLU written out, as HF's NewGELUActivation, GPT-2's gelu_new and others spell it.
NEW_GELUS = {
    "hf_new_gelu": lambda x: 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0)))),
    "gpt2_gelu_new": lambda x: 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3))),
    "cube": lambda x: 0.5 * x * (1.0 + torch.tanh(0.7978845608 * (x + 0.044715 * (x * x * x)))),
    "cube_left": lambda x: 0.5 * x * (1 + torch.tanh(0.7978845608028654 * (x + 0.044715 * x * x * x))),
}
BIAS_GELU_FORMS = ("gelu", "gelu_tanh", "megatron", *NEW_GELUS, *(f"{f} no bias" for f in NEW_GELUS))


def bias_gelu_fn(form):
    if form.endswith(" no bias"):
        return NEW_GELUS[form.removesuffix(" no bias")]
    if form in NEW_GELUS:
        return lambda x, bias: NEW_GELUS[form](x + bias)
    if form == "megatron":
        bias_gelu_impl = megatron_fusions()[0]
        return lambda x, bias: bias_gelu_impl(x, bias)  # Dynamo takes GeLUFunction.apply when called, not compiled
    approximate = "tanh" if form == "gelu_tanh" else "none"
    return lambda x, bias: F.gelu(x + bias, approximate=approximate)


def check_bias_gelu(case, against_eager):
    form, x, bias, no_grad = case
    inputs = (x,) if form.endswith(" no bias") else (x, bias)
    if not (no_grad or any(t.requires_grad for t in inputs)):
        x.requires_grad_()
    # fp32 against float64: eager's fp32 GeLU is itself off by ~4e-5 relative where x + bias is about -3 to -6
    run = against_eager(bias_gelu_fn(form), *inputs, rules=RULES, no_grad=no_grad, fp32_against_float64=True)
    assert run.fusions["bias_gelu"] == 1, run.report.unfused
    assert "npu_compile.bias_gelu" in run.report.lowered_ops


# Found by Hypothesis: x + bias in [-5.8, -2.7], where eager's fp32 GeLU is 4.2e-5 from float64 and the fused
# kernel 6.7e-6; held to eager alone, the compiled result was 4.6e-5 off.
GELU_LEFT_TAIL = ("gelu", torch.linspace(-5.8, -2.7, 16).reshape(2, 8).requires_grad_(),
                  torch.zeros(8).requires_grad_(), False)


@each_form(BIAS_GELU_FORMS)
@settings(max_examples=3, deadline=None)
@given(data=st.data())
def test_bias_gelu_equals_eager(form, shift, data, against_eager):
    check_bias_gelu(data.draw(bias_gelu_cases((form,), shift)), against_eager)


def test_bias_gelu_left_tail_equals_eager(against_eager):
    check_bias_gelu(GELU_LEFT_TAIL, against_eager)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape, approximate", [((5, 8), "none"), ((3, 5, 8), "tanh")],
                         ids=["addmm", "addmm-in-views-tanh"])
@pytest.mark.parametrize("grads", ["all", "frozen-params", "input-without-grad", "no_grad"])
def test_linear_with_bias_then_gelu_splits_the_addmm(dtype, shape, approximate, grads, against_eager):
    """nn.Linear(bias=True) → GeLU: the bias sits inside addmm; the match leaves mm and takes bias + GeLU."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=gen).to(dtype).requires_grad_(grads != "input-without-grad")
    weight = (0.5 * torch.randn(16, 8, generator=gen)).to(dtype).requires_grad_(grads != "frozen-params")
    bias = torch.randn(16, generator=gen).to(dtype).requires_grad_(grads != "frozen-params")
    run = against_eager(lambda x, w, b: F.gelu(F.linear(x, w, b), approximate=approximate) * 2, x, weight, bias,
                        rules=RULES, no_grad=grads == "no_grad", fp32_against_float64=True)
    assert run.fusions["bias_gelu"] == 1 and run.report.unfused == []
    ops = run.report.lowered_ops
    assert "aten.addmm" not in ops and "aten.gelu" not in ops and "aten.gelu_backward" not in ops
    assert ops["aten.mm"] == (1 if grads == "no_grad" else 1 + (grads != "input-without-grad") + (grads != "frozen-params"))
    assert ops.get("npu_compile.bias_gelu_backward", 0) == (grads != "no_grad")


SWIGLU_FORMS = ("chunk", "megatron_glu", "megatron", "megatron_bias")


@st.composite
def swiglu_cases(draw, forms=SWIGLU_FORMS, shift=0):
    """(form, inputs, no_grad): x of rank 1-3 (Megatron's bias_swiglu_impl: 2-3) with an even last dim."""
    shifted(draw, shift)
    dtype = draw(st.sampled_from(DTYPES))
    form = draw(st.sampled_from(forms))
    rank = draw(st.integers(2, 3) if form in ("megatron", "megatron_bias") else st.integers(1, 3))
    shape = draw(st.lists(st.integers(1, 4), min_size=rank - 1, max_size=rank - 1)) + [2 * draw(st.integers(1, 4))]
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    x = (torch.randn(shape, generator=gen) * 3).to(dtype).requires_grad_()
    inputs = [x]
    if form == "megatron_bias":
        inputs.append(torch.randn(shape[-1:], generator=gen).to(dtype).requires_grad_(draw(st.booleans())))
    return form, inputs, draw(st.booleans())


def megatron_glu(x):
    """Megatron's MLP glu with bias_activation_fusion=False (mlp.py), glu_linear_offset at its default 0.0."""
    x_glu, x_linear = torch.chunk(x, 2, dim=-1)
    return F.silu(x_glu) * (x_linear + 0.0)


def swiglu_fn(form):
    if form == "chunk":
        return lambda x: (lambda a, b: F.silu(a) * b)(*torch.chunk(x, 2, dim=-1))
    if form == "megatron_glu":
        return megatron_glu
    bias_swiglu_impl = megatron_fusions()[1]
    if form == "megatron":
        return lambda x: bias_swiglu_impl(x, None)
    return lambda x, bias: bias_swiglu_impl(x, bias)


def check_swiglu(case, against_eager):
    form, inputs, no_grad = case
    run = against_eager(swiglu_fn(form), *inputs, rules=RULES, no_grad=no_grad, fp32_against_float64=True)
    assert run.fusions["swiglu"] == 1, run.report.unfused
    assert "npu_compile.swiglu" in run.report.lowered_ops


@each_form(SWIGLU_FORMS)
@settings(max_examples=4, deadline=None)
@given(data=st.data())
def test_swiglu_equals_eager(form, shift, data, against_eager):
    check_swiglu(data.draw(swiglu_cases((form,), shift)), against_eager)


# ---- SwiGLU of two projections (HF's Llama-style MLPs) and up · silu(gate) (Phi-3) -----------------------

TWO_PROJECTION_FORMS = ("linears", "linears_up_first", "linears_bias", "phi3", "pair")


@st.composite
def two_projection_cases(draw, forms=TWO_PROJECTION_FORMS, shift=0):
    """(fn, inputs, no_grad, form): ``silu(gate(x)) · up(x)`` with two linears (either factor first, with or
    without biases; x of rank 2 or 3; x, weights and biases with or without grad, or no_grad), Phi-3's
    ``up · silu(gate)`` on the halves of one projection, or (inference) ``silu(a) · b`` of any two tensors."""
    shifted(draw, shift)
    dtype = draw(st.sampled_from(DTYPES))
    form = draw(st.sampled_from(forms))
    lead = draw(st.lists(st.integers(1, 4), min_size=1, max_size=2))
    # at least 2 features in and out: a projection to or from one feature is no model's MLP, and with one row
    # its [1, 1] products trace other views than the rule's examples
    h, i = draw(st.integers(2, 8)), draw(st.integers(2, 8))
    grads = draw(st.sampled_from(["all", "frozen-weights", "input-without-grad", "no_grad"]))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))

    def t(*shape, grad):
        return (torch.randn(shape, generator=gen) / max(shape[-1], 1) ** 0.5).to(dtype).requires_grad_(grad)

    x_grad, w_grad = grads not in ("input-without-grad", "no_grad"), grads not in ("frozen-weights", "no_grad")
    if form == "pair":  # any two tensors: fused in inference (their outputs concatenated), not in training
        return (lambda a, b: F.silu(a) * b), [t(*lead, i, grad=False), t(*lead, i, grad=False)], True, form
    if form == "phi3":
        return (lambda x, w: (lambda g, u: u * F.silu(g))(*F.linear(x, w).chunk(2, -1))), \
            [t(*lead, h, grad=x_grad), t(2 * i, h, grad=w_grad)], grads == "no_grad", form
    inputs = [t(*lead, h, grad=x_grad), t(i, h, grad=w_grad), t(i, h, grad=w_grad)]
    if form == "linears_bias":
        inputs += [t(i, grad=w_grad), t(i, grad=w_grad)]
    up_first, gate_computed_first = form == "linears_up_first", draw(st.booleans())

    def mlp(x, w_gate, w_up, *biases):
        if gate_computed_first:  # the order of the two gradients autograd sums into x's
            gate, up = F.linear(x, w_gate, *biases[:1]), F.linear(x, w_up, *biases[1:])
        else:
            up, gate = F.linear(x, w_up, *biases[1:]), F.linear(x, w_gate, *biases[:1])
        return up * F.silu(gate) if up_first else F.silu(gate) * up

    return mlp, inputs, grads == "no_grad", form


def check_two_projection_swiglu(case, against_eager):
    fn, inputs, no_grad, form = case
    if not (no_grad or any(t.requires_grad for t in inputs)):
        inputs[0].requires_grad_()
    run = against_eager(fn, *inputs, rules=RULES, no_grad=no_grad, fp32_against_float64=True)
    assert run.fusions["swiglu"] == 1 and run.report.unfused == [], run.report.unfused
    ops = run.report.lowered_ops
    assert "aten.silu" not in ops and "aten.silu_backward" not in ops and "npu_compile.swiglu" in ops
    if form.startswith("linears"):
        # training: the weights concatenated, one matmul for both projections; inference: the two outputs
        assert ops["aten.cat"] == (1 if no_grad else 1 + (form == "linears_bias"))


@each_form(TWO_PROJECTION_FORMS)
@settings(max_examples=5, deadline=None)
@given(data=st.data())
def test_two_projection_swiglu_equals_eager(form, shift, data, against_eager):
    check_two_projection_swiglu(data.draw(two_projection_cases((form,), shift)), against_eager)


@pytest.mark.fuzz
@settings(settings.get_profile("fuzz"))
@given(case=two_projection_cases())
def test_two_projection_swiglu_equals_eager_fuzz(case, against_eager):
    check_two_projection_swiglu(case, against_eager)


@pytest.mark.fuzz
@settings(settings.get_profile("fuzz"))
@given(case=bias_gelu_cases())
def test_bias_gelu_equals_eager_fuzz(case, against_eager):
    check_bias_gelu(case, against_eager)


@pytest.mark.fuzz
@settings(settings.get_profile("fuzz"))
@given(case=swiglu_cases())
def test_swiglu_equals_eager_fuzz(case, against_eager):
    check_swiglu(case, against_eager)


# ==== sites left unfused, and why =============================================================================

def unfused(fn, *args, **options):
    (report,) = npu_compile.explain(fn, *args, options={"fusions": list(RULES), **options}).graphs
    return report.fusions, [(u["op"], u["reason"]) for u in report.unfused]


def test_switched_off_rule_reports_its_site():
    fusions, sites = unfused(lambda x, b: F.gelu(x + b), torch.randn(4, 8, requires_grad=True), torch.randn(8),
                             fusions={"bias_gelu": False})
    assert "bias_gelu" not in fusions
    assert sites == [("aten.gelu.default", "rule 'bias_gelu' is switched off by options['fusions']")]


def test_bias_of_another_dtype_is_declined_with_the_reason():
    x, bias = torch.randn(4, 8, dtype=torch.bfloat16, requires_grad=True), torch.randn(8, requires_grad=True)
    fusions, sites = unfused(lambda x, b: F.gelu(x + b), x, bias)
    assert fusions["bias_gelu"] == 0
    assert sites == [("aten.gelu.default",
                      "bias dtype torch.float32 differs from the input's torch.bfloat16 (the add promotes; "
                      "the fused op does not)")]


def test_a_layout_the_fused_op_cannot_give_is_declined_with_the_reason():
    # x transposed: the forward keeps x's layout (in_layout_of), but autograd's gradient follows it too,
    # while the fused backward writes a contiguous one
    fusions, sites = unfused(lambda x, b: F.gelu(x.t() + b), torch.randn(8, 4, requires_grad=True), torch.randn(8))
    assert fusions["bias_gelu"] == 0
    [(op, reason)] = sites
    assert op == "aten.gelu.default" and reason.startswith("gelu_backward has strides (1, 4)")


def test_transposed_input_is_fused_in_its_layout_for_inference():
    x = torch.randn(8, 4)
    with torch.no_grad():
        fusions, sites = unfused(lambda x, b: F.gelu(x.t() + b) * 2, x, torch.randn(8))
    assert fusions["bias_gelu"] == 1 and sites == []


def test_swiglu_of_two_tensors_in_training_without_projections_is_reported():
    # silu(a)·b of two tensors that are not two projections of one x: in training only two linears are taken
    # (their weights concatenated); inference takes any two tensors
    fusions, sites = unfused(lambda a, b: F.silu(a) * b, torch.randn(4, 8, requires_grad=True),
                             torch.randn(4, 8, requires_grad=True))
    assert fusions["swiglu"] == 0
    assert sites == [("aten.silu.default", "no swiglu pattern matched the ops around it")]
    with torch.no_grad():
        fusions, sites = unfused(lambda a, b: F.silu(a) * b, torch.randn(4, 8), torch.randn(4, 8))
    assert fusions["swiglu"] == 1 and sites == []


def test_glu_offset_other_than_zero_is_declined_with_the_reason():
    def glu(x):
        a, b = torch.chunk(x, 2, dim=-1)
        return F.silu(a) * (b + 0.5)

    fusions, sites = unfused(glu, torch.randn(4, 8, requires_grad=True))
    assert fusions["swiglu"] == 0
    assert sites == [("aten.silu.default",
                      "glu_linear_offset 0.5 is not 0: npu_swiglu computes silu(a)·b with nothing added to b")]


def test_tanh_gelu_written_out_with_other_constants_is_left_alone():
    # 0.79 is no √(2/π): another function, not a site; a constant off in the 5th digit is a site, declined
    fusions, sites = unfused(lambda x: 0.5 * x * (1 + torch.tanh(0.79 * (x + 0.044715 * x ** 3))),
                             torch.randn(4, 8, requires_grad=True))
    assert fusions["bias_gelu"] == 0 and sites == []
    fusions, sites = unfused(lambda x: 0.5 * x * (1 + torch.tanh(0.79788 * (x + 0.044715 * x ** 3))),
                             torch.randn(4, 8, requires_grad=True))
    assert fusions["bias_gelu"] == 0
    assert sites == [("aten.tanh.default", "the tanh GeLU's constant 0.79788 is not 0.7978845608 (to 1e-6): the "
                      "fused tanh GeLU computes 0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))")]


def test_lone_gelu_and_silu_are_not_sites():
    fusions, sites = unfused(lambda x: F.gelu(F.silu(x)), torch.randn(4, 8, requires_grad=True))
    assert fusions == {"bias_gelu": 0, "swiglu": 0} and sites == []


# ==== symbolic shapes: a dynamic sequence dim fuses as a static one ===========================================

DYNAMIC_CASES = {  # name: (fn, input shapes with the sequence dim as "s", the rule)
    "bias_gelu": (lambda x, b: F.gelu(x + b), [("s", 2, 16), (16,)], "bias_gelu"),
    "bias_gelu megatron": (lambda x, b: megatron_fusions()[0](x, b), [("s", 2, 16), (16,)], "bias_gelu"),
    "bias_gelu linear": (lambda x, w, b: F.gelu(F.linear(x, w, b), approximate="tanh"),
                         [("s", 2, 8), (16, 8), (16,)], "bias_gelu"),
    "bias_gelu written out": (lambda x: NEW_GELUS["hf_new_gelu"](x), [("s", 2, 16)], "bias_gelu"),
    "swiglu": (lambda x: swiglu_fn("chunk")(x), [("s", 2, 16)], "swiglu"),
    "swiglu megatron": (lambda x, b: swiglu_fn("megatron_bias")(x, b), [("s", 16), (16,)], "swiglu"),
}


@pytest.mark.parametrize("name", DYNAMIC_CASES)
def test_activation_rules_fire_on_a_dynamic_sequence_dim(name, static_then_dynamic):
    fn, shapes, rule = DYNAMIC_CASES[name]
    gen = torch.Generator().manual_seed(0)

    def make(n):
        return [torch.randn([n if d == "s" else d for d in shape], generator=gen, requires_grad=True) for shape in shapes]

    dynamic = {i: shape.index("s") for i, shape in enumerate(shapes) if "s" in shape}
    static, symbolic = static_then_dynamic(fn, make, dynamic=dynamic, rules=RULES)
    assert static == symbolic == {rule: 1}


def _autocast(fn):
    def run(x, w, b):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return fn(F.linear(x, w, b))
    return run


@pytest.mark.parametrize("fn, rule", [
    (_autocast(F.gelu), "bias_gelu"),  # the linear's addmm in bf16, then GeLU: the split addmm
    (_autocast(lambda h: (lambda a, b: F.silu(a) * b)(*h.chunk(2, -1))), "swiglu"),
], ids=["linear-gelu", "linear-swiglu"])
def test_activations_in_an_autocast_region_fuse(fn, rule, against_eager):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 4, 8, generator=gen, requires_grad=True)
    w, b = (0.3 * torch.randn(16, 8, generator=gen)).requires_grad_(), torch.randn(16, generator=gen).requires_grad_()
    run = against_eager(fn, x, w, b, rules=RULES, fp32_against_float64=True)
    assert run.fusions == {**dict.fromkeys(RULES, 0), rule: 1} and run.report.unfused == []
