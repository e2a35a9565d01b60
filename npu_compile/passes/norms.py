"""Fusion rules, norms family: RMSNorm → ``npu_compile::rms_norm``; residual add + RMSNorm →
``npu_compile::add_rms_norm``; residual add + LayerNorm → ``npu_compile::add_layer_norm``.

They lower to npu_rms_norm, npu_add_rms_norm and npu_add_layer_norm (with their backward kernels). In training
the rules match the joint graph, so autograd's backward of the matched ops is replaced by the fused op's.

Rules and the forms they take (each as megatron-core 0.16.1 and hand-written models trace under Dynamo +
aot_autograd, no decompositions):

- ``add_rms_norm``, ``add_layer_norm``: the pre-norm residual stream, ``s = x + residual`` feeding the norm,
  with ``s`` also returned for the next block's residual add (and, for the model's last norm, ``s`` feeding
  the norm alone). In Megatron the add is the last add of its bias-dropout-add: ``residual + (x + bias)`` with
  hidden_dropout 0 (GPT; the bias add stays in front as x) or ``residual + x`` (Llama, no bias). These rules
  come first, so they claim the add before ``rms_norm`` (and bias_dropout_add) could.
- ``rms_norm``, each form with 1..k trailing normalized dims (the weight's dims):
  - ``F.rms_norm`` / ``torch.nn.RMSNorm`` (Megatron's RMSNorm with our CPU adaptations), which traces to
    pow → mean → add(eps) → rsqrt → mul → mul(weight), with fp32 statistics for bf16;
  - the hand-written ``x * rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w``, weight first or last;
  - the same with fp32 statistics, ``w * (xf * rsqrt(...)).to(x.dtype)`` with ``xf = x.float()`` (Llama's).
  A norm whose input also feeds later ops (a block's input is also its residual) gets a gradient from those
  ops before its own; the rules say so (``shared_inputs``) and match that backward too.
- LayerNorm alone has no rule, by choice: ``F.layer_norm`` already is one aten op each way
  (native_layer_norm / native_layer_norm_backward, fp32 statistics), which the NPU runs as one kernel each; a
  rule would only rename it. Only a LayerNorm after a residual add is a missed site.

With dropout before the residual add (hidden_dropout > 0), the add rules decline: bias_dropout_add takes
``residual + dropout(x + bias)`` whole (its backward saves a seed instead of a keep mask), and the norm after
it fuses alone (``rms_norm``; a LayerNorm stays native_layer_norm). The sum is saved either way, so the split
costs one read of the sum and saves the mask and a kernel.

Mixed precision: every form also fires in bf16 and fp16 as they occur in training: ``F.rms_norm`` (and
LayerNorm) with an fp32 weight on bf16/fp16 x (Megatron's torch norms keep fp32 weights when the model is built
with ``params_dtype=torch.bfloat16``; eager casts x up, normalizes in fp32 and rounds y once to x's dtype, as the
fused ops do), and an fp32 residual stream, ``residual.float() + x`` (the sum is fp32, the norm runs on it, and
autograd casts the bf16 summand's gradient back, outside the matched ops, so that add traces as a one-dtype
add does). The fp32-weight variant is traced only for graphs that hold such a norm.

Training graphs: every rule fires whatever subset of its inputs needs grad (a block whose input needs none, a
norm after a frozen embedding, a frozen bias beside a trained weight): each subset is its own joint graph, and
the rules name the inputs whose gradient may be missing (``grad_optional``), which the engine traces each way;
with none needing grad the norm's ops sit in the training graph without a backward and the forward pattern
takes them.

Every match must produce what the fused op produces: the norm over exactly the weight's trailing dims, the
output in x's dtype (no promotion by a weight of another dtype), x and residual of one shape and of one dtype
or a bf16/fp16 and an fp32 one, and contiguous outputs.
"""

from __future__ import annotations

import functools
import inspect
import operator

import torch
import torch.nn.functional as F

import npu_compile.ops  # noqa: F401  (registers torch.ops.npu_compile)
from npu_compile.ops.norms import sum_dtype
from npu_compile.passes.engine import Rule, contiguous_outputs, register_rule

aten = torch.ops.aten
fused = torch.ops.npu_compile

F32, BF16 = torch.float32, torch.bfloat16
# The eps the patterns are traced with, so the model's eps is read from the match: exact in fp32 (torch.rms_norm
# rounds eps to fp32, so a value that is not would not be found again) and unlike any other constant there.
EPS = 2.0**-20


# ==== RMSNorm: the forms models write =======================================================================


def torch_rms_norm(x, weight, eps):
    return F.rms_norm(x, weight.shape, weight, eps)


def rms_norm_weight_last(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rms_norm_weight_first(x, weight, eps):
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rms_norm_fp32_weight_first(x, weight, eps):
    """Llama's: statistics and normalization in fp32, cast back to x's dtype before the weight."""
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rms_norm_fp32_weight_last(x, weight, eps):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


# Each form with the (x, weight) dtypes whose graphs differ: torch.rms_norm casts to fp32 for bf16, and with an
# fp32 weight casts only x (and only the gradient of x back); the hand-written forms without casts trace alike
# for every dtype; the fp32 forms' casts exist only for a low-precision x (and bf16 stands for fp16 too, the
# first match ignoring dtypes). The eps add tells the forms apart cheaply: torch.rms_norm adds a Scalar, a
# hand-written "+ eps" a Tensor.
RMS_NORMS = (
    (torch_rms_norm, ((F32, F32), (BF16, BF16), (BF16, F32)), aten.add.Scalar),
    (rms_norm_weight_last, ((F32, F32),), aten.add.Tensor),
    (rms_norm_weight_first, ((F32, F32),), aten.add.Tensor),
    # with an fp32 weight the output is fp32, its x̂ rounded to x's dtype first: no fused op gives that, and
    # the variant is traced to say so (the check declines it) rather than to leave a bare miss
    (rms_norm_fp32_weight_first, ((BF16, BF16), (BF16, F32)), aten.add.Tensor),
    (rms_norm_fp32_weight_last, ((BF16, BF16), (BF16, F32)), aten.add.Tensor),
)


def fused_rms_norm(x, weight, eps):
    y, _rstd = fused.rms_norm(x, weight, eps)
    return y


# ==== residual add + norm ===================================================================================


def residual_add_then(norm):
    """``s = x + residual`` into ``norm``; returns (norm(s), s): s goes on to the next block's residual add."""

    def add_norm(x, residual, weight, eps):
        s = x + residual
        return norm(s, weight, eps), s

    add_norm.__name__ = f"add_{norm.__name__}"
    return add_norm


def residual_add_into(norm):
    """``norm(x + residual)`` with the sum used by nothing else: the model's final norm."""

    def add_norm_last(x, residual, weight, eps):
        return norm(x + residual, weight, eps)

    add_norm_last.__name__ = f"add_{norm.__name__}_last"
    return add_norm_last


def fused_add_rms_norm(x, residual, weight, eps):
    y, _rstd, s = fused.add_rms_norm(x, residual, weight, eps)
    return y, s


def fused_add_rms_norm_last(x, residual, weight, eps):
    return fused_add_rms_norm(x, residual, weight, eps)[0]


def add_layer_norm(x, residual, weight, bias, eps):
    s = x + residual
    return F.layer_norm(s, list(weight.shape), weight, bias, eps), s


def add_layer_norm_last(x, residual, weight, bias, eps):
    return F.layer_norm(x + residual, list(weight.shape), weight, bias, eps)


def add_layer_norm_no_bias(x, residual, weight, eps):
    s = x + residual
    return F.layer_norm(s, list(weight.shape), weight, None, eps), s


def add_layer_norm_no_bias_last(x, residual, weight, eps):
    return F.layer_norm(x + residual, list(weight.shape), weight, None, eps)


def fused_add_layer_norm(x, residual, weight, bias, eps):
    y, _mean, _rstd, s = fused.add_layer_norm(x, residual, weight, bias, eps)
    return y, s


def fused_add_layer_norm_last(x, residual, weight, bias, eps):
    return fused_add_layer_norm(x, residual, weight, bias, eps)[0]


def fused_add_layer_norm_no_bias(x, residual, weight, eps):
    return fused_add_layer_norm(x, residual, weight, None, eps)


def fused_add_layer_norm_no_bias_last(x, residual, weight, eps):
    return fused_add_layer_norm(x, residual, weight, None, eps)[0]


# ==== example inputs: one trace per joint-graph shape =======================================================
# Rank does not change the graphs' ops (sizes are re-checked per match), so rank 2 stands for all; a weight
# (and bias) without grad drops its gradient from the graph.


def _t(*shape, dtype=torch.float32, grad=True):
    return torch.empty(shape, dtype=dtype, requires_grad=grad)


def _rms_examples(dtypes):
    def examples():
        for dtype, weight_dtype in dtypes:
            for weight_grad in (True, False):
                yield [_t(2, 8, dtype=dtype), _t(8, dtype=weight_dtype, grad=weight_grad)]

    return examples


# A bf16/fp16 summand and an fp32 one (an fp32 residual stream) trace to the same graph as one dtype: the add
# promotes, and the cast of the narrower summand's gradient is autograd's, outside the matched ops. But then the
# two summands' gradients are one node of the pattern, which the replacement's first gradient (x's) replaces,
# so x must be the wider summand: ``h + residual`` with a bf16 h binds x to h in the traced order and is
# declined, and the same pattern traced with its summands swapped (``residual + x``) takes it.
def summands_swapped(pattern):
    """``pattern`` adding its summands the other way round: the graph's ``a + b`` binds x to b."""

    @functools.wraps(pattern)  # register_replacement reads the argument names from the signature
    def swapped(x, residual, *rest):
        return pattern(residual, x, *rest)

    swapped.__name__ = f"{pattern.__name__}_swapped"
    return swapped


def _add_rms_examples(dtypes):
    def examples():
        for x, weight in _rms_examples(dtypes)():
            yield [x, _t(2, 8, dtype=x.dtype), weight]

    return examples


def _add_layer_norm_examples():
    # native_layer_norm takes every dtype as it is (an fp32 weight on bf16 x too): one dtype traces them all.
    for affine_grad in (True, False):
        yield [_t(2, 8), _t(2, 8), _t(8, grad=affine_grad), _t(8, grad=affine_grad)]


def _add_layer_norm_no_bias_examples():
    for weight_grad in (True, False):
        yield [_t(2, 8), _t(2, 8), _t(8, grad=weight_grad)]


# ==== checks: the match computes what the fused op computes =================================================


def _val(match, name: str):
    node = match.kwargs.get(name)
    return node.meta["val"] if isinstance(node, torch.fx.Node) else None


def _normalized_dims(x, weight) -> str | None:
    k = weight.dim()
    if k == 0 or k > x.dim() or tuple(x.shape[x.dim() - k:]) != tuple(weight.shape):
        return (f"weight {tuple(weight.shape)} is not the trailing shape of the input {tuple(x.shape)} (the fused "
                "norm scales exactly the normalized dims)")
    return None


def _same_dtype_out(match, x) -> str | None:
    y = match.output_nodes()[0].meta["val"]  # the forward output comes first in every pattern
    residual = _val(match, "residual")
    if residual is not None:  # the norm of a sum runs in the sum's dtype
        x = x.new_empty((), dtype=sum_dtype(x.dtype, residual.dtype) or x.dtype)
    if y.dtype != x.dtype:
        return f"the output is {y.dtype}, promoted from the input's {x.dtype} by the weight; the fused norm keeps x's dtype"
    return None


def _rms_dims(match, x, weight) -> str | None:
    """The mean must reduce exactly the weight's trailing dims (a hand-written norm may scale by a weight that
    broadcasts over more dims than it normalizes)."""
    (mean,) = [n for n in match.nodes if n.target == aten.mean.dim]
    reduced = sorted(d % x.dim() for d in mean.args[1])
    if reduced != list(range(x.dim() - weight.dim(), x.dim())):
        return f"the mean reduces dims {reduced} of {tuple(x.shape)}, not the weight's {tuple(weight.shape)}"
    return None


def _summands_in_graph_order(match):
    """The values of x and residual as the graph's add takes them (a rule traced with its summands swapped
    binds them the other way round)."""
    pair = {match.kwargs["x"], match.kwargs["residual"]}
    for node in match.nodes:
        if node.target == aten.add.Tensor and len(node.args) == 2 and set(node.args) == pair:
            return node.args[0].meta["val"], node.args[1].meta["val"]
    return _val(match, "x"), _val(match, "residual")


def _residual(match) -> str | None:
    x, residual = _val(match, "x"), _val(match, "residual")
    if x.shape != residual.shape or sum_dtype(x.dtype, residual.dtype) is None:
        x, residual = _summands_in_graph_order(match)
        return (f"x {tuple(x.shape)} {x.dtype} + residual {tuple(residual.shape)} {residual.dtype}: the fused add "
                "needs one shape and one dtype, or a bf16/fp16 and an fp32 summand (no broadcast, no other "
                "promotion)")
    if _dropped(match.kwargs["x"]) or _dropped(match.kwargs["residual"]):
        return AFTER_DROPOUT
    if x.dtype != sum_dtype(x.dtype, residual.dtype):
        return (f"x {x.dtype} is the narrower summand of x + residual {residual.dtype}: the add rules traced "
                "with the summands swapped take it")
    return None


def _rms_check(match):
    x, weight = _val(match, "x"), _val(match, "weight")
    return (_normalized_dims(x, weight) or _rms_dims(match, x, weight) or _same_dtype_out(match, x)
            or contiguous_outputs(match))


def _add_rms_check(match):
    return _residual(match) or _rms_check(match)


def _add_layer_norm_check(match):
    x, weight, bias = _val(match, "x"), _val(match, "weight"), _val(match, "bias")
    if bias is not None and bias.shape != weight.shape:
        return f"bias {tuple(bias.shape)} differs from the weight's {tuple(weight.shape)}"
    return (_residual(match) or _normalized_dims(x, weight) or _same_dtype_out(match, x)
            or contiguous_outputs(match))


# ==== sites: what an unfused norm means =====================================================================

AFTER_DROPOUT = ("the residual add follows a dropout: bias_dropout_add takes residual + dropout(x + bias) whole "
                 "and the norm after it fuses alone")


def _dropped(node) -> bool:
    """``node`` is the output of a dropout (p > 0 in training)."""
    return (isinstance(node, torch.fx.Node) and node.target is operator.getitem and node.args[1] == 0
            and node.args[0].target == aten.native_dropout.default)


def _residual_add(node) -> bool | str:
    """``node`` adds two tensors of one shape (a residual add, not a bias add); by design when after a dropout."""
    if node is None or node.target != aten.add.Tensor or len(node.args) != 2:
        return False
    a, b = node.args
    if not (isinstance(a, torch.fx.Node) and isinstance(b, torch.fx.Node)):
        return False
    va, vb = a.meta.get("val"), b.meta.get("val")
    if not (isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor) and va.shape == vb.shape):
        return False
    return AFTER_DROPOUT if _dropped(a) or _dropped(b) else True


def _is_rms_statistic(node) -> bool:
    """rsqrt(mean(...) + eps): the statistic of an RMS norm (a hand-written LayerNorm's comes from a variance)."""
    arg = node.args[0]
    return (isinstance(arg, torch.fx.Node) and arg.target in (aten.add.Scalar, aten.add.Tensor)
            and isinstance(arg.args[0], torch.fx.Node) and arg.args[0].target == aten.mean.dim)


def _starts_rms_norm(user, node) -> bool:
    """``user`` begins an RMS norm of ``node``: the fused op, or pow(·, 2) (after an fp32 cast, perhaps)."""
    if user.target == fused.rms_norm.default:
        return user.args[0] is node
    if user.target == aten._to_copy.default:
        return any(_starts_rms_norm(u, user) for u in user.users)
    return user.target == aten.pow.Tensor_Scalar and user.args[1] == 2


def _add_rms_norm_site(node) -> bool | str:
    """A residual add whose sum is RMS-normalized (by the plain fused op or by unfused ops)."""
    if not any(_starts_rms_norm(u, node) for u in node.users):
        return False
    return _residual_add(node)


def _add_layer_norm_site(node) -> bool | str:
    """A LayerNorm of a residual sum; a LayerNorm of anything else is no site (it is one op already)."""
    arg = node.args[0]
    return _residual_add(arg) if isinstance(arg, torch.fx.Node) else False


def _has(op):
    """A rule is traced only for graphs that may hold its sites (a LayerNorm needs a native_layer_norm)."""
    return lambda graph: bool(graph.find_nodes(op="call_function", target=op))


def _has_rms_norm(eps_add):
    """... and an RMS norm form only for graphs with its rsqrt(mean + eps), eps added as that form adds it."""

    def wanted(graph):
        return any(isinstance(n.args[0], torch.fx.Node) and n.args[0].target == eps_add
                   for n in graph.find_nodes(op="call_function", target=aten.rsqrt.default))

    return wanted


def _mixed_add(graph) -> bool:
    """The graph adds a bf16/fp16 tensor and an fp32 one (an fp32 residual stream)."""
    for node in graph.find_nodes(op="call_function", target=aten.add.Tensor):
        vals = [a.meta.get("val") for a in node.args[:2] if isinstance(a, torch.fx.Node)]
        if (len(vals) == 2 and all(isinstance(v, torch.Tensor) for v in vals) and vals[0].dtype != vals[1].dtype
                and sum_dtype(vals[0].dtype, vals[1].dtype) is not None):
            return True
    return False


def _signature(fn) -> tuple[str, ...]:
    return tuple(inspect.signature(fn).parameters)


def _both(*wants):
    return lambda graph: all(want(graph) for want in wants)


# ==== the rules, in the order they apply ====================================================================

# Each add rule twice: as traced, then with its summands swapped for an fp32 residual stream whose narrower
# summand comes first (traced only for graphs with such an add).
for _swapped in (False, True):
    for _norm, _dtypes, _eps_add in RMS_NORMS:
        if _swapped and not any(x_dtype == F32 for x_dtype, _ in _dtypes):
            continue  # a sum with an fp32 summand is fp32: only the forms traced in fp32 normalize it
        for _pattern, _replacement in ((residual_add_then(_norm), fused_add_rms_norm),
                                       (residual_add_into(_norm), fused_add_rms_norm_last)):
            register_rule(Rule(
                name="add_rms_norm",
                pattern=summands_swapped(_pattern) if _swapped else _pattern,
                replacement=_replacement,
                example_inputs=_add_rms_examples(_dtypes),
                scalars={"eps": EPS},
                extra_check=_add_rms_check,
                anchors=(aten.add.Tensor,),
                site=_add_rms_norm_site,
                wanted=_both(_has_rms_norm(_eps_add), _mixed_add) if _swapped else _has_rms_norm(_eps_add),
                grad_optional=("x", "residual", "weight"),
            ))

for _swapped in (False, True):
    for _pattern, _replacement, _examples in (
        (add_layer_norm, fused_add_layer_norm, _add_layer_norm_examples),
        (add_layer_norm_last, fused_add_layer_norm_last, _add_layer_norm_examples),
        (add_layer_norm_no_bias, fused_add_layer_norm_no_bias, _add_layer_norm_no_bias_examples),
        (add_layer_norm_no_bias_last, fused_add_layer_norm_no_bias_last, _add_layer_norm_no_bias_examples),
    ):
        _layer_norm = _has(aten.native_layer_norm.default)
        register_rule(Rule(
            name="add_layer_norm",
            pattern=summands_swapped(_pattern) if _swapped else _pattern,
            replacement=_replacement,
            example_inputs=_examples,
            scalars={"eps": EPS},
            extra_check=_add_layer_norm_check,
            anchors=(aten.native_layer_norm.default,),
            site=_add_layer_norm_site,
            wanted=_both(_layer_norm, _mixed_add) if _swapped else _layer_norm,
            grad_optional=("x", "residual", "weight", "bias") if "bias" in _signature(_pattern) else
                          ("x", "residual", "weight"),
        ))

for _norm, _dtypes, _eps_add in RMS_NORMS:
    register_rule(Rule(
        name="rms_norm",
        pattern=_norm,
        replacement=fused_rms_norm,
        example_inputs=_rms_examples(_dtypes),
        scalars={"eps": EPS},
        extra_check=_rms_check,
        anchors=(aten.rsqrt.default,),
        site=_is_rms_statistic,
        wanted=_has_rms_norm(_eps_add),
        shared_inputs=("x",),  # a block's input is also its residual
        grad_optional=("x", "weight"),
    ))
