"""Fusion rules, activations family: bias + GeLU → ``npu_compile::bias_gelu``, SwiGLU → ``npu_compile::swiglu``.

Both ops lower to one Ascend kernel each way (npu_gelu / npu_swiglu and their backward kernels). In training the
rules match the joint graph, so autograd's backward of the matched ops is replaced by the fused backward op.

Rules and the forms they take (each as megatron-core 0.16.1 traces it under Dynamo + aot_autograd):

- ``bias_gelu``
  - ``F.gelu(x + bias)``, approximate "none" and "tanh": Megatron's MLP with bias_activation_fusion=False
    (``mm → add(bias) → gelu``), and any ``gelu(x + b)`` a model writes.
  - Megatron's ``bias_gelu_impl`` (bias_activation_fusion=True): an autograd.Function whose forward is the tanh
    formula ``x·0.5·(1 + tanh(0.79788456·x·(1 + 0.044715·x²)))`` on ``x = bias + y`` and whose backward is its
    hand-written derivative. Both halves appear in the joint graph, and both are taken.
  - the tanh GeLU written out, as HF's NewGELUActivation and GPT-2's gelu_new write it:
    ``0.5·x·(1 + tanh(k·(x + c·x³)))`` with c·x³ as ``c * torch.pow(x, 3.0)``, ``c * x ** 3``,
    ``c * (x * x * x)`` or ``c * x * x * x``, on ``x``
    alone or on ``x + bias``, k and c read from the match (``math.sqrt(2 / math.pi)``, a truncated
    0.7978845608, ...) and taken when they are √(2/π) and 0.044715 to 1e-6 relative: the fused op's tanh form
    (``approximate="tanh"``), forward and backward.
  - ``F.gelu(nn.Linear(bias=True)(x))``: the linear's bias sits inside its ``addmm(bias, x2d, wᵀ)`` (then a
    view back to x's rank), where no add is left for the rule above. The match splits it: ``mm(x2d, wᵀ)``
    and the fused op's bias + GeLU, forward and backward (the bias gradient is the fused backward's). In
    bf16/fp16 this moves a rounding: addmm adds the bias to its fp32 accumulator and rounds once, the split
    rounds the product, then the sum (as an unfused ``mm + bias`` does): x + bias may differ by one ulp.
  - A lone ``gelu(x)`` stays as it is, by choice: npu_gelu is the kernel aten.gelu already runs on the NPU, so
    a bias-less replacement would only rename it. It is not reported as a missed site.
- ``swiglu``
  - ``a, b = chunk(x, 2, -1); silu(a) · (b + offset)``: Megatron's glu, which adds glu_linear_offset (0.0 by
    default); taken when the offset is 0.
  - ``silu(a) · b`` on the two halves of ``x``; Megatron's ``bias_swiglu_impl`` (bias_activation_fusion=True),
    an autograd.Function with a hand-written backward, without and with a bias (``x + bias`` then stays an
    add in front of the fused op: npu_swiglu takes no bias).
  - ``b · silu(a)`` on the two halves: Phi-3's MLP (``up_states * act(gate)`` after its gate_up_proj).
  - ``silu(gate_proj(x)) · up_proj(x)`` with two linears (HF's Llama-style MLPs, with or without biases, either
    factor first): in training the two weights are concatenated and one matmul gives [gate | up]; in inference
    any ``silu(a) · b`` with a and b two tensors of one shape has a and b concatenated (see "two projections"
    below for why each).

Every match must give what the pattern gave: the same dtype (no type promotion inside the pattern; the ops take
one dtype) and the same strides, which replacements keep with ``in_layout_of`` (checked by ``layout_check``).
"""

from __future__ import annotations

import functools
import itertools
import math
import operator

import torch
import torch.nn.functional as F

import npu_compile.ops  # noqa: F401  (registers torch.ops.npu_compile)
from npu_compile.passes.engine import (INFERENCE, TRAINING, Rule, bias_problem, contiguous_outputs, in_layout_of,
                                      layout_check, register_rule)

aten = torch.ops.aten
fused = torch.ops.npu_compile

# Megatron's tanh-GeLU constants as its fused_bias_gelu.py spells them (patterns match literals exactly).
SQRT_2_OVER_PI = 0.79788456  # √(2/π)
TANH_CUBIC = 0.044715
TANH_CUBIC_SLOPE = 0.1070322243  # 3 · 0.044715 · √(2/π): the cubic term's derivative
# The glu offset the pattern is traced with, so the model's offset is read from the match; unlike any other
# constant in the pattern.
OFFSET = 0.3183098


in_x_layout = layout_check("x")




def _calls(*ops):
    """A ``wanted`` test: the graph calls every op in ``ops`` (rules are traced only for graphs that may use them)."""
    return lambda graph: all(graph.find_nodes(op="call_function", target=op) for op in ops)


# ==== bias + GeLU ===========================================================================================


def bias_gelu(x, bias):
    return F.gelu(x + bias)


def bias_gelu_tanh(x, bias):
    return F.gelu(x + bias, approximate="tanh")


def tanh_gelu(x):
    """Megatron's tanh GeLU, operand for operand."""
    return x * 0.5 * (1.0 + torch.tanh(SQRT_2_OVER_PI * x * (1 + TANH_CUBIC * x * x)))


def tanh_gelu_slope(x):
    """d tanh_gelu / dx, written as Megatron's bias_gelu_back writes it."""
    t = torch.tanh(SQRT_2_OVER_PI * x * (1 + TANH_CUBIC * x * x))
    return 0.5 * x * ((1 - t * t) * (SQRT_2_OVER_PI + TANH_CUBIC_SLOPE * x * x)) + 0.5 * (1 + t)


class MegatronBiasGeLU(torch.autograd.Function):
    """Shaped like Megatron's GeLUFunction: saves (x, bias), recomputes bias + x in the backward and returns one
    gradient for both (autograd then sums the bias's over the broadcast dims)."""

    @staticmethod
    def forward(ctx, x, bias):
        ctx.save_for_backward(x, bias)
        return tanh_gelu(bias + x)

    @staticmethod
    def backward(ctx, grad):
        x, bias = ctx.saved_tensors
        grad_x = tanh_gelu_slope(bias + x) * grad
        return grad_x, grad_x


def megatron_bias_gelu(x, bias):
    return MegatronBiasGeLU.apply(x, bias)


def fused_bias_gelu(x, bias):
    return in_layout_of(fused.bias_gelu(x, bias, "none"), x)


def fused_bias_gelu_tanh(x, bias):
    return in_layout_of(fused.bias_gelu(x, bias, "tanh"), x)


def bias_gelu_examples():
    """One example per distinct joint graph: which of x and bias need a gradient and, when the bias does,
    whether its gradient is a sum over the broadcast dims and a view (bias [h]) or the sum alone (bias of x's
    rank). Ranks and dtypes need no variants: with no decompositions the aten ops carry neither, and each
    match is retraced on its real inputs, which checks shapes, dims and constants exactly."""
    for x_grad, bias_grad in ((True, True), (True, False), (False, True)):
        for bias_shape in ((8,), (1, 1, 8)) if bias_grad else ((8,),):
            yield [torch.empty(2, 4, 8, requires_grad=x_grad), torch.empty(bias_shape, requires_grad=bias_grad)]


def bias_gelu_check(match):
    x, bias = (match.kwargs[k].meta["val"] for k in ("x", "bias"))
    return bias_problem(x, bias) or in_x_layout(match)


# ---- nn.Linear(bias=True) → GeLU: the bias inside addmm -----------------------------------------------


def linear_gelu(x, weight, bias):
    return F.gelu(F.linear(x, weight, bias))


def linear_gelu_tanh(x, weight, bias):
    return F.gelu(F.linear(x, weight, bias), approximate="tanh")


def fused_linear_gelu(x, weight, bias):
    return fused.bias_gelu(F.linear(x, weight), bias, "none")


def fused_linear_gelu_tanh(x, weight, bias):
    return fused.bias_gelu(F.linear(x, weight), bias, "tanh")


def linear_gelu_examples():
    """x of rank 2 (addmm alone) and 3 (addmm between views); x with or without grad (a first layer's input
    has none), weight and bias trained or frozen."""
    for shape in ((4, 8), (2, 4, 8)):
        for x_grad, params_grad in ((True, True), (False, True), (True, False)):
            yield [torch.empty(shape, requires_grad=x_grad), torch.empty(16, 8, requires_grad=params_grad),
                   torch.empty(16, requires_grad=params_grad)]


def linear_gelu_check(match):
    x, bias = match.kwargs["x"].meta["val"], match.kwargs["bias"].meta["val"]
    if bias.dtype != x.dtype:
        return f"bias dtype {bias.dtype} differs from the input's {x.dtype} (addmm promotes; the fused op does not)"
    return contiguous_outputs(match)


# ---- the tanh GeLU written out ---------------------------------------------------------------------------
# The constants the written-out forms are traced with, so that a model's k and c are read from the match;
# unlike any other constant in the patterns.
K_TRACED, C_TRACED = 0.8120433, 0.0417291


def new_gelu_pow(x, k, c):
    """HF's NewGELUActivation, GPT-2's gelu_new: ``torch.pow(x, 3.0)`` (``x ** 3`` traces alike)."""
    return 0.5 * x * (1.0 + torch.tanh(k * (x + c * torch.pow(x, 3.0))))


def new_gelu_cube(x, k, c):
    return 0.5 * x * (1.0 + torch.tanh(k * (x + c * (x * x * x))))


def new_gelu_cube_left(x, k, c):
    """... with ``c * x * x * x`` multiplied out from the left."""
    return 0.5 * x * (1.0 + torch.tanh(k * (x + c * x * x * x)))


def biased(form):
    """``form`` on ``x + bias``."""

    def bias_form(x, bias, k, c):
        return form(x + bias, k, c)

    bias_form.__name__ = f"bias_{form.__name__}"
    return bias_form


def fused_tanh_gelu(x, k, c):
    return in_layout_of(fused.bias_gelu(x, None, "tanh"), x)


def fused_bias_tanh_gelu(x, bias, k, c):
    return in_layout_of(fused.bias_gelu(x, bias, "tanh"), x)


def tanh_gelu_examples():
    yield [torch.empty(2, 4, 8, requires_grad=True), K_TRACED, C_TRACED]


def bias_tanh_gelu_examples():
    for x, bias in bias_gelu_examples():
        yield [x, bias, K_TRACED, C_TRACED]


def tanh_constants_check(match) -> bool | str:
    """k and c of a written-out tanh GeLU are the fused op's √(2/π) and 0.044715 (to 1e-6 relative)."""
    for name, want in (("k", math.sqrt(2.0 / math.pi)), ("c", TANH_CUBIC)):
        got = match.kwargs[name]
        if not isinstance(got, (int, float)) or abs(got / want - 1.0) > 1e-6:
            return (f"the tanh GeLU's constant {got!r} is not {want:.10g} (to 1e-6): the fused tanh GeLU "
                    "computes 0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))")
    return True


def tanh_gelu_check(match):
    verdict = tanh_constants_check(match)
    if verdict is not True:
        return verdict
    return bias_gelu_check(match) if "bias" in match.kwargs else in_x_layout(match)


def bias_gelu_site(node: torch.fx.Node) -> bool:
    """gelu(x + b) or gelu(addmm(b, ...)) (through a view), or the tanh of a tanh GeLU spelled with √(2/π);
    a gelu with no bias in front is no site."""
    if node.target == aten.gelu.default:
        add = node.args[0]
        if _call_to(add, aten.view.default) or _call_to(add, aten._unsafe_view.default):
            add = add.args[0]
        if _call_to(add, aten.addmm.default):
            return True
        return _call_to(add, aten.add.Tensor) and all(isinstance(a, torch.fx.Node) for a in add.args)
    # within 1e-4: a truncated √(2/π) (0.79788) is a tanh GeLU too, whose constant the check then names
    return _mentions(node.args[0], SQRT_2_OVER_PI, depth=3, tolerance=1e-4)


for _pattern, _replacement, _wanted in (
    (bias_gelu, fused_bias_gelu, _calls(aten.gelu.default)),
    (bias_gelu_tanh, fused_bias_gelu_tanh, _calls(aten.gelu.default)),
    (megatron_bias_gelu, fused_bias_gelu_tanh, _calls(aten.tanh.default)),
):
    register_rule(Rule(
        name="bias_gelu",
        pattern=_pattern,
        replacement=_replacement,
        example_inputs=bias_gelu_examples,
        extra_check=bias_gelu_check,
        anchors=(aten.gelu.default, aten.tanh.default),
        site=bias_gelu_site,
        wanted=_wanted,
    ))

for _pattern, _replacement in ((linear_gelu, fused_linear_gelu), (linear_gelu_tanh, fused_linear_gelu_tanh)):
    register_rule(Rule(
        name="bias_gelu",
        pattern=_pattern,
        replacement=_replacement,
        example_inputs=linear_gelu_examples,
        extra_check=linear_gelu_check,
        anchors=(aten.gelu.default, aten.tanh.default),
        site=bias_gelu_site,
        wanted=_calls(aten.gelu.default, aten.addmm.default),
    ))

# the written-out forms: with a bias first (it claims the add), then on x alone
for _form, _wanted in ((new_gelu_pow, _calls(aten.tanh.default, aten.pow.Tensor_Scalar)),
                       (new_gelu_cube, _calls(aten.tanh.default)),
                       (new_gelu_cube_left, _calls(aten.tanh.default))):
    for _pattern, _replacement, _examples in ((biased(_form), fused_bias_tanh_gelu, bias_tanh_gelu_examples),
                                              (_form, fused_tanh_gelu, tanh_gelu_examples)):
        register_rule(Rule(
            name="bias_gelu",
            pattern=_pattern,
            replacement=_replacement,
            example_inputs=_examples,
            scalars={"k": K_TRACED, "c": C_TRACED},
            extra_check=tanh_gelu_check,
            anchors=(aten.gelu.default, aten.tanh.default),
            site=bias_gelu_site,
            wanted=_wanted,
        ))


# ==== SwiGLU ================================================================================================


def swiglu(x):
    a, b = torch.chunk(x, 2, dim=-1)
    return F.silu(a) * b


def swiglu_offset(x, offset):
    """Megatron's glu: silu(a) · (b + glu_linear_offset)."""
    a, b = torch.chunk(x, 2, dim=-1)
    return F.silu(a) * (b + offset)


def swiglu_grad(grad, x):
    """The gradient of silu(a)·b with respect to [a | b], written as Megatron's swiglu_back writes it."""
    a, b = torch.chunk(x, 2, -1)
    return torch.cat((grad * torch.sigmoid(a) * (1 + a * (1 - torch.sigmoid(a))) * b, grad * F.silu(a)), -1)


class MegatronSwiGLU(torch.autograd.Function):
    """Shaped like Megatron's SwiGLUFunction: saves x, hand-written backward."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return swiglu(x)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return swiglu_grad(grad, x)


class MegatronBiasSwiGLU(torch.autograd.Function):
    """Shaped like Megatron's BiasSwiGLUFunction: SwiGLU of x + bias, one gradient for both."""

    @staticmethod
    def forward(ctx, x, bias):
        ctx.save_for_backward(x, bias)
        return swiglu(x + bias)

    @staticmethod
    def backward(ctx, grad):
        x, bias = ctx.saved_tensors
        grad_x = swiglu_grad(grad, x + bias)
        return grad_x, grad_x


def megatron_swiglu(x):
    return MegatronSwiGLU.apply(x)


def megatron_bias_swiglu(x, bias):
    return MegatronBiasSwiGLU.apply(x, bias)


def fused_swiglu(x):
    return in_layout_of(fused.swiglu(x, -1), x)


def fused_swiglu_offset(x, offset):
    return fused_swiglu(x)  # swiglu_check took offset 0 only


def fused_bias_swiglu(x, bias):
    return fused_swiglu(x + bias)


def swiglu_examples():
    # rank 1 traces apart: the gradient's cat over the halves then leaves out its dim (the default, 0)
    for shape in ((2, 4, 16), (16,)):
        yield [torch.empty(shape, requires_grad=True)]


def swiglu_offset_examples():
    for (x,) in swiglu_examples():
        yield [x, OFFSET]


def megatron_swiglu_examples():
    yield [torch.empty(8, 16, requires_grad=True)]  # bias_swiglu_impl flattens to 2-D first


def megatron_bias_swiglu_examples():
    for bias_grad in (True, False):
        yield [torch.empty(8, 16, requires_grad=True), torch.empty(16, requires_grad=bias_grad)]


def swiglu_up_first(x):
    """b · silu(a): Phi-3's MLP (``up_states * act(gate)`` on the halves of its gate_up_proj)."""
    a, b = torch.chunk(x, 2, dim=-1)
    return b * F.silu(a)


# ---- two projections: silu(gate(x)) · up(x) ------------------------------------------------------------
# HF's Llama-style MLPs (Llama, Mistral, Qwen2/3, ...) write ``down_proj(act_fn(gate_proj(x)) * up_proj(x))``
# with two nn.Linear. npu_swiglu takes [gate | up] as one tensor along the last dim, so one of two things is
# concatenated:
# - training: the weights, [W_gate; W_up] (2·I·H elements), and one matmul gives [gate | up]; the backward
#   gives both weight gradients as contiguous halves of one [2I, H] product (ProjectedSwiGLU), and no
#   activation is copied. Concatenating the outputs instead would copy 2·T·I elements forward and again
#   backward, to give the halves' gradients the layout the graph was traced with; with T (tokens) of the order
#   of H or more, as in training, that is more.
# - inference: the outputs, [gate | up] (2·T·I): a decode step has T = batch, and copying the weights every
#   step would move more than the matmuls read. Any two tensors a, b of one shape take this form.


def two_projection_swiglu(gate_first: bool, silu_left: bool, bias: bool):
    """``silu(gate_proj(x)) · up_proj(x)`` as a pattern: the projection computed first (it orders the two
    gradients autograd sums into x's) and the factor written first (aten's mul keeps it) each trace their own
    graph; with or without biases."""

    def body(x, w_gate, w_up, b_gate=None, b_up=None):
        if gate_first:
            gate, up = F.linear(x, w_gate, b_gate), F.linear(x, w_up, b_up)
        else:
            up, gate = F.linear(x, w_up, b_up), F.linear(x, w_gate, b_gate)
        return F.silu(gate) * up if silu_left else up * F.silu(gate)

    if bias:
        def pattern(x, w_gate, w_up, b_gate, b_up):
            return body(x, w_gate, w_up, b_gate, b_up)
    else:
        def pattern(x, w_gate, w_up):
            return body(x, w_gate, w_up)
    pattern.__name__ = pattern.__qualname__ = (
        f"two_projection_swiglu(gate_first={gate_first}, silu_left={silu_left}, bias={bias})")
    return pattern


class ProjectedSwiGLU(torch.autograd.Function):
    """swiglu(x·[W_gate; W_up]ᵀ + [b_gate; b_up]) that keeps x, the weights and the projection for its
    backward, not the concatenated weights. Left to autograd, x's gradient would be grad_h·[W_gate; W_up] and
    the partitioner would keep that [2I, H] copy alive from forward to backward, a weight's worth of memory per
    MLP (concatenated again in the backward, the graph's CSE merges it with the forward's). So x's gradient is
    taken half by half, as autograd takes it for two linears; both weights' gradients are one matmul, whose
    halves are the two gradients."""

    @staticmethod
    def forward(ctx, x, w_gate, w_up, b_gate=None, b_up=None):
        h = F.linear(x, torch.cat((w_gate, w_up)), None if b_gate is None else torch.cat((b_gate, b_up)))
        ctx.save_for_backward(x, w_gate, w_up, h)
        return fused.swiglu(h, -1)

    @staticmethod
    def backward(ctx, grad):
        x, w_gate, w_up, h = ctx.saved_tensors
        grad_h = fused.swiglu_backward(grad, h, -1)
        needs = ctx.needs_input_grad
        grads = [None] * 5
        if needs[0]:
            grad_gate, grad_up = grad_h.chunk(2, -1)
            grads[0] = grad_gate @ w_gate + grad_up @ w_up
        flat = grad_h.reshape(-1, grad_h.size(-1))
        if needs[1] or needs[2]:
            grad_w = flat.t() @ x.reshape(-1, x.size(-1))
            grads[1], grads[2] = grad_w[: w_gate.size(0)], grad_w[w_gate.size(0):]
        if needs[3] or needs[4]:
            grad_b = flat.sum(0)
            grads[3], grads[4] = grad_b[: w_gate.size(0)], grad_b[w_gate.size(0):]
        return tuple(g if need else None for g, need in zip(grads, needs))


def fused_linear_swiglu(x, w_gate, w_up, b_gate=None, b_up=None):
    return ProjectedSwiGLU.apply(x, w_gate, w_up, b_gate, b_up)


def linear_swiglu_examples(bias: bool = False):
    """x of rank 2 (one mm) and 3 (mm between views); x, weights and biases with and without grad
    (grad_optional), fp32 (each match is re-traced in its dtype; a bf16 linear traces the same ops)."""
    for shape in ((4, 8), (2, 4, 8)):
        example = [torch.empty(shape, requires_grad=True), torch.empty(6, 8, requires_grad=True),
                   torch.empty(6, 8, requires_grad=True)]
        yield example + ([torch.empty(6, requires_grad=True), torch.empty(6, requires_grad=True)] if bias else [])


def linear_swiglu_check(match):
    """The two projections share x and their shapes; everything in one dtype (linear does not promote)."""
    vals = {k: n.meta["val"] for k, n in match.kwargs.items() if isinstance(n, torch.fx.Node)}
    if vals["w_gate"].shape != vals["w_up"].shape:
        return (f"gate and up weights of shapes {tuple(vals['w_gate'].shape)} and {tuple(vals['w_up'].shape)}: "
                "npu_swiglu takes two halves of one size")
    if "b_gate" in vals and vals["b_gate"].shape != vals["b_up"].shape:
        return "gate and up biases differ in shape"
    dtypes = {k: v.dtype for k, v in vals.items()}
    if len(set(dtypes.values())) > 1:
        return f"dtypes differ ({dtypes}): the concatenated projection takes one"
    return contiguous_outputs(match)


def pair_swiglu(a, b):
    return F.silu(a) * b


def pair_swiglu_up_first(a, b):
    return b * F.silu(a)


def fused_pair_swiglu(a, b):
    return in_layout_of(fused.swiglu(torch.cat((a, b), -1), -1), a)


def pair_swiglu_examples():
    for shape in ((2, 4, 8), (8,)):
        yield [torch.empty(shape), torch.empty(shape)]


def pair_swiglu_check(match):
    a, b = (match.kwargs[k].meta["val"] for k in ("a", "b"))
    if a.shape != b.shape or a.dtype != b.dtype:
        return (f"silu(a)·b with a {tuple(a.shape)} {a.dtype} and b {tuple(b.shape)} {b.dtype}: npu_swiglu takes "
                "two halves of one shape and dtype")
    return layout_check("a")(match)


def swiglu_check(match):
    offset = match.kwargs.get("offset", 0.0)
    if offset != 0.0:
        return f"glu_linear_offset {offset} is not 0: npu_swiglu computes silu(a)·b with nothing added to b"
    x = match.kwargs["x"].meta["val"]
    if "bias" in match.kwargs and match.kwargs["bias"].meta["val"].dtype != x.dtype:
        return "bias dtype differs from the input's (the add promotes; swiglu does not)"
    return in_x_layout(match)


def swiglu_site(node: torch.fx.Node) -> bool:
    """silu(a)·b (or b·silu(a)) is a site, a and b halves of one tensor or two tensors."""
    return any(u.target == aten.mul.Tensor for u in node.users)  # a plain SiLU activation: nothing to fuse with


for _pattern, _replacement, _examples, _scalars in (
    (swiglu_offset, fused_swiglu_offset, swiglu_offset_examples, {"offset": OFFSET}),
    (swiglu, fused_swiglu, swiglu_examples, {}),
    (swiglu_up_first, fused_swiglu, swiglu_examples, {}),
    (megatron_swiglu, fused_swiglu, megatron_swiglu_examples, {}),
    (megatron_bias_swiglu, fused_bias_swiglu, megatron_bias_swiglu_examples, {}),
):
    register_rule(Rule(
        name="swiglu",
        pattern=_pattern,
        replacement=_replacement,
        example_inputs=_examples,
        scalars=_scalars,
        extra_check=swiglu_check,
        anchors=(aten.silu.default,),
        site=swiglu_site,
        wanted=_calls(aten.silu.default),
    ))

# two projections: in training their weights are concatenated, in inference their outputs (see above)
# HF's Llama-style MLP first: gate computed first, silu(gate) · up
for _bias, _gate_first, _silu_left in itertools.product((False, True), (True, False), (True, False)):
    register_rule(Rule(
        name="swiglu",
        pattern=two_projection_swiglu(_gate_first, _silu_left, _bias),
        replacement=fused_linear_swiglu,
        example_inputs=functools.partial(linear_swiglu_examples, _bias),
        extra_check=linear_swiglu_check,
        modes=(TRAINING,),
        anchors=(aten.silu.default,),
        site=swiglu_site,
        wanted=_calls(aten.silu.default, aten.addmm.default if _bias else aten.mm.default),
        grad_optional=("x", "w_gate", "w_up", *(("b_gate", "b_up") if _bias else ())),
    ))
for _pattern in (pair_swiglu, pair_swiglu_up_first):
    register_rule(Rule(
        name="swiglu",
        pattern=_pattern,
        replacement=fused_pair_swiglu,
        example_inputs=pair_swiglu_examples,
        extra_check=pair_swiglu_check,
        modes=(INFERENCE,),
        anchors=(aten.silu.default,),
        site=swiglu_site,
        wanted=_calls(aten.silu.default),
    ))


# ==== helpers for the site tests ============================================================================


def _call_to(node, target) -> bool:
    return isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target == target


def _mentions(node, value: float, depth: int, tolerance: float = 1e-6) -> bool:
    """Whether the constant ``value`` (to ``tolerance``) is an argument of ``node`` or of its inputs up to
    ``depth`` levels up."""
    if not isinstance(node, torch.fx.Node) or depth == 0:
        return False
    return any((isinstance(a, float) and abs(a - value) < tolerance) or _mentions(a, value, depth - 1, tolerance)
               for a in node.args)
