"""Norm rules: rms_norm, add_rms_norm and add_layer_norm fire on megatron-core's GPT and Llama blocks and on the
forms models write, training and inference, in fp32, bf16 and fp16 (fp32 weights on bf16/fp16, fp32 residual
streams, autocast regions), whatever subset of their inputs needs grad, on dynamic sequence dims, and the compiled results equal eager; declined and
switched-off sites are reported with their reasons, and a LayerNorm with no residual add in front is no site.
The 2-layer megatron-core training runs (one compile per model and budget): test_megatron_models.py."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import npu_compile
from hypothesis_forms import each_form, shifted  # tests/, on sys.path as its conftest's folder
from megatron_glue.capture.testing import megatron_cpu  # noqa: F401  (fixture)

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
RULES = ("add_rms_norm", "add_layer_norm", "rms_norm")


# ==== megatron-core GPTModel configs (their 2-layer training runs: test_megatron_models.py) ===================

def gpt():
    from megatron_glue.capture.models import gpt_config

    return gpt_config(hidden_size=64)


def llama():
    from megatron_glue.capture.models import llama_config

    return llama_config(hidden_size=64, num_query_groups=2)


# ==== properties: random forms, shapes and dtypes, compiled against eager =====================================

def llama_rms_norm(x, weight, eps):
    """The hand-written Llama norm: fp32 statistics, cast back before the weight."""
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rms_norm(form, eps):
    """The norm as a model writes it: ``norm(x, weight)``. The weight is an input, not a captured tensor, so the
    comparison's fp64 reference run converts it too."""
    if form == "module":
        module = torch.nn.RMSNorm(8, eps=eps)
        return lambda x, weight: torch.func.functional_call(module, {"weight": weight}, (x,))
    if form == "llama":
        return lambda x, weight: llama_rms_norm(x, weight, eps)
    if form == "functional":
        return lambda x, weight: F.rms_norm(x, weight.shape, weight, eps)
    if form == "weight_last":
        return lambda x, weight: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight
    if form == "weight_first":
        return lambda x, weight: weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))
    raise ValueError(form)


RMS_FORMS = ("module", "llama", "functional", "weight_last", "weight_first")


def layer_norm(form, eps, has_bias):
    """``norm(x, weight[, bias])``."""
    if form == "module":
        module = torch.nn.LayerNorm(8, eps=eps, bias=has_bias)
        if has_bias:
            return lambda x, weight, bias: torch.func.functional_call(module, {"weight": weight, "bias": bias}, (x,))
        return lambda x, weight: torch.func.functional_call(module, {"weight": weight}, (x,))
    if has_bias:
        return lambda x, weight, bias: F.layer_norm(x, weight.shape, weight, bias, eps)
    return lambda x, weight: F.layer_norm(x, weight.shape, weight, None, eps)


def block(norm, site):
    """Where the norm sits, as ``fn(x, [residual,] *affine)``: ``alone``; ``shared`` (its input also feeds a later
    op, as a block's input is also its residual); after a residual add whose sum feeds the next add too
    (``residual``) or nothing else (``last``: the final norm); after the add of an fp32 residual stream,
    ``residual.float() + x`` or ``x + residual.float()`` (``fp32_stream``, ``fp32_stream_swapped``: the norm
    and the stream in fp32, the block's output cast back to x's dtype)."""
    if site == "fp32_stream":
        def fp32_stream(x, r, *affine):
            s = r.float() + x
            return (norm(s, *affine) * 2 + s).to(x.dtype)
        return fp32_stream
    if site == "fp32_stream_swapped":
        def fp32_stream_swapped(x, r, *affine):
            s = x + r.float()
            return (norm(s, *affine) * 2 + s).to(x.dtype)
        return fp32_stream_swapped
    if site == "alone":
        return lambda x, *affine: norm(x, *affine) * 2
    if site == "shared":
        return lambda x, *affine: norm(x, *affine) + x
    if site == "residual":
        def pre_norm(x, r, *affine):
            s = x + r
            return norm(s, *affine) * 2 + s
        return pre_norm
    return lambda x, r, *affine: norm(x + r, *affine) * 2


# Forms whose weight may be fp32 on a bf16/fp16 x without promoting the output (torch's norms round y to x's
# dtype), as Megatron's torch norms keep it in a bf16 model.
FP32_WEIGHT_FORMS = ("module", "functional")


NORM_FORMS = (*(("rms", f) for f in RMS_FORMS), ("layer", "module"), ("layer", "functional"))


@st.composite
def norm_cases(draw, forms=NORM_FORMS, shift=0):
    """(name, fn, inputs, no_grad, expected rule): x of rank 2-4, the norm over the last dim (2-D norms for the
    functional forms), fp32, bf16 or fp16, weight (and bias) in x's dtype or, for torch's norms on bf16/fp16,
    in fp32, with or without grad; the sum of an fp32 residual stream; run for training or under no_grad (the
    inference graph)."""
    shifted(draw, shift)
    dtype = draw(st.sampled_from(DTYPES))
    family, form = draw(st.sampled_from(forms))
    sites = ("alone", "shared", "residual", "last") if family == "rms" else ("residual", "last")
    if dtype != torch.float32:
        sites += ("fp32_stream", "fp32_stream_swapped")
    site = draw(st.sampled_from(sites))
    stream = site.startswith("fp32_stream")
    # in an fp32 stream the norm sees fp32: the hand-written forms then normalize as in fp32 (Llama's alike)
    fp32_weight = stream or (dtype != torch.float32 and form in FP32_WEIGHT_FORMS and draw(st.booleans()))
    affine_dtype = torch.float32 if fp32_weight else dtype
    normalized = 2 if form == "functional" and draw(st.integers(0, 3)) == 0 else 1
    rank = draw(st.integers(normalized + 1, 4))
    shape = draw(st.lists(st.integers(1, 3), min_size=rank - 1, max_size=rank - 1))
    # the last dim: 2+ for RMSNorm (one element traces without the mean's reduction: no model has it), 3+ for
    # LayerNorm (over two elements its output is ±1 whatever the input, its gradient rounding noise)
    shape += [8] if form == "module" else [draw(st.integers(2 if family == "rms" else 3, 12))]
    if normalized == 2:
        shape[-2] = draw(st.integers(2, 3))
    eps = draw(st.sampled_from([1e-5, 1e-6, 1e-3]))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    affine_grad = draw(st.booleans())
    affine = [(1 + 0.5 * torch.randn(shape[-normalized:], generator=gen)).to(affine_dtype).requires_grad_(affine_grad)]
    if family == "rms":
        norm = rms_norm(form, eps)
    else:
        has_bias = draw(st.booleans())
        norm = layer_norm(form, eps, has_bias)
        if has_bias:
            affine.append((0.5 * torch.randn(shape[-normalized:], generator=gen)).to(affine_dtype)
                          .requires_grad_(affine_grad))
    residual_add = site in ("residual", "last") or stream
    xs = [(torch.randn(shape, generator=gen) * 2).to(dtype).requires_grad_() for _ in range(1 + residual_add)]
    expected = {"rms": "add_rms_norm" if residual_add else "rms_norm", "layer": "add_layer_norm"}[family]
    return f"{family} {form} {site}", block(norm, site), (*xs, *affine), draw(st.booleans()), expected


def check_norm(case, against_eager):
    _, fn, inputs, no_grad, rule = case
    # fp32 against float64 as well: eager's fp32 norm gradients are themselves only ~1e-5 near cancellation
    run = against_eager(fn, *inputs, rules=RULES, no_grad=no_grad, fp32_against_float64=True)
    assert run.fusions[rule] == 1 and sum(run.fusions.values()) == 1, (run.fusions, run.report.unfused)
    assert run.report.unfused == []
    assert f"npu_compile.{rule}" in run.report.lowered_ops


@each_form(NORM_FORMS)
@settings(max_examples=5, deadline=None)
@given(data=st.data())
def test_norm_rules_equal_eager(form, shift, data, against_eager):
    check_norm(data.draw(norm_cases((form,), shift)), against_eager)


@pytest.mark.fuzz
@settings(settings.get_profile("fuzz"))
@given(case=norm_cases())
def test_norm_rules_equal_eager_fuzz(case, against_eager):
    check_norm(case, against_eager)


# ==== sites left unfused, and why =============================================================================

def explain(fn, *args, **options):
    (report,) = npu_compile.explain(fn, *args, options={"fusions": list(RULES), **options}).graphs
    return report.fusions, [(u["op"], u["rule"], u["reason"]) for u in report.unfused]


def residual_layer_norm(x, r, w, b):
    s = x + r
    return F.layer_norm(s, (8,), w, b) * 2 + s


def inputs(*shapes, dtype=torch.float32):
    return [torch.randn(s, dtype=dtype, requires_grad=True) for s in shapes]


def test_switched_off_rules_report_their_sites():
    fusions, sites = explain(residual_layer_norm, *inputs((4, 8), (4, 8), (8,), (8,)),
                             fusions={"add_layer_norm": False})
    assert "add_layer_norm" not in fusions
    assert sites == [("aten.native_layer_norm.default", "add_layer_norm",
                      "rule 'add_layer_norm' is switched off by options['fusions']")]

    def pre_norm(x, r, w):
        s = x + r
        return F.rms_norm(s, (8,), w) * 2 + s

    # add_rms_norm off: rms_norm takes the norm alone, and the add in front is reported
    fusions, sites = explain(pre_norm, *inputs((4, 8), (4, 8), (8,)), fusions=["rms_norm"])
    assert fusions == {"rms_norm": 1}
    assert sites == [("aten.add.Tensor", "add_rms_norm", "rule 'add_rms_norm' is switched off by options['fusions']")]
    # both off: the add and the rsqrt are reported, each under its rule
    fusions, sites = explain(pre_norm, *inputs((4, 8), (4, 8), (8,)), fusions=[])
    assert fusions == {}
    assert sorted(sites) == [("aten.add.Tensor", "add_rms_norm", "rule 'add_rms_norm' is switched off by options['fusions']"),
                             ("aten.rsqrt.default", "rms_norm", "rule 'rms_norm' is switched off by options['fusions']")]


def test_weight_that_promotes_the_output_is_declined_with_the_reason():
    # (in training the promotion also casts the gradient back to bf16, and no pattern matches at all)
    x, w = torch.randn(4, 8, dtype=torch.bfloat16), torch.randn(8)
    with torch.no_grad():
        fusions, sites = explain(lambda x, w: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w, x, w)
    assert fusions["rms_norm"] == 0
    assert sites == [("aten.rsqrt.default", "rms_norm", "the output is torch.float32, promoted from the input's "
                      "torch.bfloat16 by the weight; the fused norm keeps x's dtype")]


@pytest.mark.parametrize("training", [True, False])
def test_llama_norm_with_an_fp32_weight_on_bf16_is_declined_with_the_reason(training):
    # HF's LlamaRMSNorm with fp32 weights: x̂ rounded to bf16, then scaled in fp32 (an fp32 output)
    x, w = torch.randn(4, 8, dtype=torch.bfloat16, requires_grad=training), torch.randn(8, requires_grad=training)
    fusions, sites = explain(lambda x, w: llama_rms_norm(x, w, 1e-6), x, w)
    assert fusions["rms_norm"] == 0
    assert sites == [("aten.rsqrt.default", "rms_norm", "the output is torch.float32, promoted from the input's "
                      "torch.bfloat16 by the weight; the fused norm keeps x's dtype")]


def test_weight_that_broadcasts_over_more_dims_than_normalized_is_declined_with_the_reason():
    # a [s, h] weight scaling a norm over h alone: the fused op would normalize over both dims
    fusions, sites = explain(lambda x, w: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w,
                             *inputs((2, 4, 8), (4, 8)))
    assert fusions["rms_norm"] == 0
    assert sites == [("aten.rsqrt.default", "rms_norm", "the mean reduces dims [2] of (2, 4, 8), not the weight's (4, 8)")]


def test_residual_of_another_dtype_is_declined_with_the_reason():
    x, r = torch.randn(4, 8), torch.randn(4, 8, dtype=torch.float64)
    w, b = torch.randn(8, dtype=torch.float64), torch.randn(8, dtype=torch.float64)
    with torch.no_grad():
        fusions, sites = explain(residual_layer_norm, x, r, w, b)
    assert fusions["add_layer_norm"] == 0
    [(op, rule, reason)] = sites
    assert (op, rule) == ("aten.native_layer_norm.default", "add_layer_norm")
    assert reason.startswith("x (4, 8) torch.float32 + residual (4, 8) torch.float64: the fused add needs one shape")


def test_residual_add_after_a_dropout_is_left_to_bias_dropout_add():
    def block(x, r, w):
        s = r + F.dropout(x, 0.1, training=True)
        return F.rms_norm(s, (8,), w) * 2 + s

    fusions, sites = explain(block, *inputs((4, 8), (4, 8), (8,)))
    assert fusions == {"add_rms_norm": 0, "add_layer_norm": 0, "rms_norm": 1}
    [(op, rule, reason)] = [site for site in sites if site[1] != "bias_dropout_add"]  # that one is switched off
    assert (op, rule) == ("aten.add.Tensor", "add_rms_norm") and reason.startswith("the residual add follows a dropout")
    fusions, sites = explain(block, *inputs((4, 8), (4, 8), (8,)), fusions=[*RULES, "bias_dropout_add"])
    assert fusions == {"add_rms_norm": 0, "add_layer_norm": 0, "rms_norm": 1, "bias_dropout_add": 1} and sites == []


def test_layer_norm_without_a_residual_add_is_no_site():
    fusions, sites = explain(lambda x, w, b: F.layer_norm(x + b, (8,), w), *inputs((4, 8), (8,), (8,)))
    assert fusions["add_layer_norm"] == 0 and sites == []


def test_megatron_inference_graphs_fuse_the_same_sites(megatron_cpu):
    from megatron_glue.capture.models import build_gpt_model, synthetic_batch
    from npu_compile.debug.report import collect

    batch = synthetic_batch(2, 32, 128)
    for make_config, expected in ((gpt, {"add_layer_norm": 4}), (llama, {"add_rms_norm": 4, "rms_norm": 1})):
        model = build_gpt_model(make_config(), 128, 32).eval()
        torch._dynamo.reset()
        with torch.no_grad():
            with torch._dynamo.config.patch(disable=True):
                want = model(**batch)
            with collect() as reports:
                got = torch.compile(model, backend="ascend", options={"fusions": list(RULES)})(**batch)
        torch._dynamo.reset()
        (report,) = reports
        assert report.graphs == ["inference"]
        assert {k: v for k, v in report.fusions.items() if v} == expected
        assert [u for u in report.unfused if u["rule"] in RULES] == []
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


# ==== mixed precision: megatron-core models in bf16 and fp16 fuse what they fuse in fp32 ======================

# What the norm, activation and rotary rules take in the fp32 models (their training runs: test_megatron_models.py):
# a 2-layer GPT (4 LayerNorms after residual adds, 2 MLPs with bias + GeLU) and Llama (4 RMSNorms after residual
# adds and the first alone, 2 SwiGLUs, RoPE on q and k per layer).
FP32_FUSIONS = {
    "gpt": {"add_layer_norm": 4, "add_rms_norm": 0, "rms_norm": 0, "bias_gelu": 2, "swiglu": 0, "rotary": 0},
    "llama": {"add_layer_norm": 0, "add_rms_norm": 4, "rms_norm": 1, "bias_gelu": 0, "swiglu": 2, "rotary": 4},
}
# The compiled bf16/fp16 run is held to an fp32 run of the same model: no further from it than the eager run in
# that dtype is, plus four ulps of the dtype (eager rounds after every op, the fused ops once from fp32: their
# roundings differ, and over two layers and a step they add up to a few ulps).
BAND = {torch.bfloat16: 4 * 2.0**-8, torch.float16: 4 * 2.0**-11}


def mixed_precision_model(kind, dtype, how):
    """A 2-layer megatron-core model in ``dtype``: built with ``params_dtype`` (megatron-core's torch norms then
    keep fp32 weights, and Llama's RMSNorms see bf16/fp16 x with an fp32 weight) or cast whole afterwards, as
    Megatron's Float16Module does (GPT only so: its learned position embeddings stay fp32 with params_dtype, and
    megatron-core's attention then fails eagerly without Float16Module)."""
    from megatron_glue.capture.models import build_gpt_model

    base = gpt if kind == "gpt" else llama
    if how == "params_dtype":
        config = base()
        for key, value in dict(params_dtype=dtype, bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16).items():
            setattr(config, key, value)
        return build_gpt_model(config, 128, 32, seed=0)
    return build_gpt_model(base(), 128, 32, seed=0).to(dtype)


def train_two_steps(model):
    from megatron_glue.capture.models import synthetic_batch

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    history = []
    for step in range(2):
        opt.zero_grad(set_to_none=True)
        loss = model(**synthetic_batch(2, 32, 128, seed=step))
        loss.float().mean().backward()
        history.append((loss.detach().float(),
                        {n.removeprefix("_orig_mod."): p.grad.float() for n, p in model.named_parameters()}))
        opt.step()
    return history


@pytest.mark.parametrize("kind, dtype, how", [
    pytest.param("llama", torch.bfloat16, "params_dtype", id="llama-bf16-params_dtype"),
    pytest.param("llama", torch.float16, "params_dtype", id="llama-fp16-params_dtype"),
    pytest.param("llama", torch.bfloat16, "cast", id="llama-bf16-cast"),
    pytest.param("gpt", torch.bfloat16, "cast", id="gpt-bf16-cast"),
    pytest.param("gpt", torch.float16, "cast", id="gpt-fp16-cast"),
])
def test_megatron_models_in_bf16_and_fp16_fuse_as_in_fp32(kind, dtype, how, megatron_cpu, rel_error):
    from npu_compile.debug.report import collect

    torch._dynamo.reset()
    with torch._dynamo.config.patch(disable=True):
        expected = train_two_steps(mixed_precision_model(kind, dtype, how))
        fp32 = train_two_steps(mixed_precision_model(kind, torch.float32, "cast"))
    with collect() as reports:
        got = train_two_steps(torch.compile(mixed_precision_model(kind, dtype, how), backend="ascend"))
    torch._dynamo.reset()
    (report,) = reports
    assert {rule: report.fusions.get(rule, 0) for rule in FP32_FUSIONS[kind]} == FP32_FUSIONS[kind]
    assert [u for u in report.unfused if u["rule"] in FP32_FUSIONS[kind]] == []
    for step, ((loss0, grads0), (loss1, grads1), (loss32, grads32)) in enumerate(zip(expected, got, fp32)):
        values = {"loss": (loss0, loss1, loss32), **{n: (grads0[n], grads1[n], grads32[n]) for n in grads0}}
        errors = {n: (rel_error(compiled, exact), rel_error(eager, exact)) for n, (eager, compiled, exact) in values.items()}
        bad = {n: f"{c:.2e} vs eager's {e:.2e}" for n, (c, e) in errors.items() if c > e + BAND[dtype]}
        assert not bad, f"step {step}, relative errors against fp32: {bad}"


# ==== symbolic shapes: a dynamic sequence dim fuses as a static one ===========================================

def _pre_norm(norm):
    def block(x, r, *affine):
        s = x + r
        return norm(s, *affine) * 2 + s
    return block


DYNAMIC_CASES = {  # name: (fn, input shapes with the sequence dim as "s", the rule)
    "add_rms_norm": (_pre_norm(lambda s, w: F.rms_norm(s, (16,), w, 1e-6)), [("s", 2, 16), ("s", 2, 16), (16,)]),
    "add_layer_norm": (_pre_norm(lambda s, w, b: F.layer_norm(s, (16,), w, b)),
                       [("s", 2, 16), ("s", 2, 16), (16,), (16,)]),
    "rms_norm": (lambda x, w: llama_rms_norm(x, w, 1e-6) + x, [("s", 2, 16), (16,)]),
    "rms_norm 2-D weight": (lambda x, w: F.rms_norm(x, (4, 16), w, 1e-5) * 2, [(2, "s", 4, 16), (4, 16)]),
}


@pytest.mark.parametrize("name", DYNAMIC_CASES)
def test_norm_rules_fire_on_a_dynamic_sequence_dim(name, static_then_dynamic):
    fn, shapes = DYNAMIC_CASES[name]
    gen = torch.Generator().manual_seed(0)

    def make(n):
        return [torch.randn([n if d == "s" else d for d in shape], generator=gen, requires_grad=True) for shape in shapes]

    dynamic = {i: shape.index("s") for i, shape in enumerate(shapes) if "s" in shape}
    static, symbolic = static_then_dynamic(fn, make, dynamic=dynamic, rules=RULES)
    assert static == symbolic == {name.split()[0]: 1}


def autocast_block(norm):
    """A linear, the residual add and the norm under CPU autocast: the linear runs in bf16, the add promotes to
    the fp32 residual (an fp32 residual stream), the norm runs in fp32."""
    def block(x, r, w, *affine):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            s = F.linear(x, w) + r
            return norm(s, *affine) * 2 + s
    return block


@pytest.mark.parametrize("name, fn, n_affine, rule", [
    ("rms", autocast_block(lambda s, w: F.rms_norm(s, (16,), w, 1e-6)), 1, "add_rms_norm"),
    ("llama", autocast_block(lambda s, w: llama_rms_norm(s, w, 1e-6)), 1, "add_rms_norm"),
    ("layer", autocast_block(lambda s, w, b: F.layer_norm(s, (16,), w, b)), 2, "add_layer_norm"),
], ids=lambda v: v if isinstance(v, str) else "")
def test_norms_in_an_autocast_region_fuse(name, fn, n_affine, rule, against_eager):
    gen = torch.Generator().manual_seed(0)
    x, r = (torch.randn(4, 3, 16, generator=gen, requires_grad=True) for _ in range(2))
    w = (0.3 * torch.randn(16, 16, generator=gen)).requires_grad_()
    affine = [(1 + 0.5 * torch.randn(16, generator=gen)).requires_grad_() for _ in range(n_affine)]
    run = against_eager(fn, x, r, w, *affine, rules=RULES, fp32_against_float64=True)
    assert run.fusions[rule] == 1 and sum(run.fusions.values()) == 1 and run.report.unfused == []


# ==== training graphs: whatever subset of the norm's inputs needs grad ========================================

def scaled(norm, site):
    """``block(norm, site)`` followed by a product with a trained scale ``p`` (the last input), so the graph is a
    training graph even where none of the norm's own inputs needs grad (a norm of a frozen embedding's output)."""
    inner = block(norm, site)
    return lambda *args: inner(*args[:-1]) * args[-1]


GRAD_CASES = {  # name: (fn of (*inputs, p), the inputs' names, the rule)
    "rms_norm": (scaled(rms_norm("functional", 1e-5), "alone"), ("x", "weight"), "rms_norm"),
    "rms_norm llama": (scaled(rms_norm("llama", 1e-5), "alone"), ("x", "weight"), "rms_norm"),
    "rms_norm shared": (scaled(rms_norm("functional", 1e-5), "shared"), ("x", "weight"), "rms_norm"),
    "add_rms_norm": (scaled(rms_norm("functional", 1e-5), "residual"), ("x", "residual", "weight"), "add_rms_norm"),
    "add_rms_norm last": (scaled(rms_norm("functional", 1e-5), "last"), ("x", "residual", "weight"), "add_rms_norm"),
    "add_layer_norm": (scaled(layer_norm("functional", 1e-5, True), "residual"), ("x", "residual", "weight", "bias"),
                       "add_layer_norm"),
    "add_layer_norm last": (scaled(layer_norm("functional", 1e-5, True), "last"),
                            ("x", "residual", "weight", "bias"), "add_layer_norm"),
    "add_layer_norm no bias": (scaled(layer_norm("functional", 1e-5, False), "residual"),
                               ("x", "residual", "weight"), "add_layer_norm"),
}


BF16_GRAD_CASES = ("rms_norm llama", "add_rms_norm")  # bf16 for a hand-written and a torch form (fp32 statistics, casts)


def _grad_subsets():
    for name, (_, names, _) in GRAD_CASES.items():
        for mask in range(2 ** len(names)):
            grads = tuple(bool(mask >> i & 1) for i in range(len(names)))
            label = ",".join(n for n, g in zip(names, grads) if g) or "none"
            for dtype in (torch.float32, torch.bfloat16) if name in BF16_GRAD_CASES else (torch.float32,):
                yield pytest.param(name, grads, dtype, id=f"{name}-grad[{label}]-{str(dtype)[6:]}")


@pytest.mark.parametrize("name, grads, dtype", list(_grad_subsets()))
def test_norm_rules_fire_whatever_inputs_need_grad(name, grads, dtype, against_eager):
    fn, names, rule = GRAD_CASES[name]
    gen = torch.Generator().manual_seed(0)
    values = {"x": torch.randn(3, 2, 8, generator=gen) * 2, "residual": torch.randn(3, 2, 8, generator=gen) * 2,
              "weight": 1 + 0.5 * torch.randn(8, generator=gen), "bias": 0.5 * torch.randn(8, generator=gen)}
    inputs = [values[n].to(dtype).requires_grad_(g) for n, g in zip(names, grads)]
    p = (1 + torch.rand(8, generator=gen)).to(dtype).requires_grad_()
    run = against_eager(fn, *inputs, p, rules=RULES, fp32_against_float64=True)
    assert run.report.graphs == ["forward", "backward"]  # a training graph
    assert run.fusions[rule] == 1 and sum(run.fusions.values()) == 1, (run.fusions, run.report.unfused)
    assert run.report.unfused == []
    assert f"npu_compile.{rule}" in run.report.lowered_ops
