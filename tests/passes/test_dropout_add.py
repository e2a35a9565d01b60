"""bias_dropout_add: Megatron's residual + dropout(x + bias) becomes one fused op (training and inference) whose
backward drops exactly what its forward dropped, also when the partitioner recomputes under a memory budget;
megatron-core trains with hidden_dropout > 0 within a band of eager; p = 0 and non-residual dropouts are no sites.

Dropout masks differ from eager's (the fused op draws its own), so results are checked against the mask the
compiled run used: read from the gradient of x (grad_x = grad_out · keep / (1 − p)), then forward and all
gradients must follow from it exactly.
"""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import npu_compile
from megatron_glue.capture.testing import megatron_cpu  # noqa: F401  (fixture)
from npu_compile.debug.report import collect

DTYPES = (torch.float32, torch.bfloat16)
RULES = ("bias_dropout_add",)
# out is computed in fp32 and rounded once; the gradient of x is grad · 1/(1−p), rounded once.
TOLERANCE = {torch.float32: 1e-6, torch.bfloat16: 2**-8}


def bias_dropout_add(residual_first, has_bias):
    """Megatron's _bias_dropout_add_func in training (bias or not), the residual first as it writes it, or last."""
    def fn(x, residual, p, *bias):
        branch = F.dropout(x + bias[0] if has_bias else x, p, training=True)
        return residual + branch if residual_first else branch + residual
    return fn


def compiled_run(fn, x, residual, bias, p, *, no_grad=False, memory_budget=1.0):
    """fn compiled with ascend (bias_dropout_add only) on fresh leaves: (out, grads or None, report, grad_out)."""
    leaves = [t.detach().clone().requires_grad_(t.requires_grad) for t in (x, residual, *bias)]
    torch._dynamo.reset()
    with collect() as reports:
        compiled = torch.compile(fn, backend="ascend", options={"fusions": list(RULES), "memory_budget": memory_budget})
        if no_grad:
            with torch.no_grad():
                out = compiled(leaves[0], leaves[1], p, *leaves[2:])
            grad_out = None
        else:
            out = compiled(leaves[0], leaves[1], p, *leaves[2:])
            grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.dtype)
            out.backward(grad_out)
    torch._dynamo.reset()
    (report,) = reports
    return out, None if no_grad else [t.grad for t in leaves], report, grad_out


def assert_close(actual, expected, dtype, what):
    scale = expected.abs().max().clamp_min(1.0).item()
    torch.testing.assert_close(actual.double(), expected.double(), rtol=TOLERANCE[dtype],
                               atol=TOLERANCE[dtype] * scale, msg=lambda m: f"{what}: {m}")


def check_against_its_mask(x, residual, bias, p, out, grads, grad_out):
    """Forward and gradients follow from one keep mask, the one the backward used (read from grad_x)."""
    dtype = x.dtype
    branch = (x + bias[0] if bias else x).double()  # x + bias rounds to x's dtype first, as eager's add
    if grads is None:  # inference: each element of out − residual is 0 (dropped) or branch / (1 − p) (kept)
        branch_out = out.double() - residual.double()
        keep = (branch_out - branch / (1 - p)).abs() < branch_out.abs()
    else:
        keep = grads[0] != 0
    assert_close(out, residual.double() + torch.where(keep, branch / (1 - p), 0.0), dtype, "out")
    if grads is None:
        return keep
    grad_x, grad_residual, *grad_bias = grads
    want_grad_x = torch.where(keep, grad_out.double() / (1 - p), 0.0)
    assert_close(grad_x, want_grad_x, dtype, "grad x")
    assert_close(grad_residual, grad_out.double(), dtype, "grad residual")
    if bias and bias[0].requires_grad:
        # the exact sum of the kept gradients (the kernel sums them unrounded and rounds once; summing grad_x,
        # rounded element by element to bf16, would differ from it by up to half an ulp per element)
        assert_close(grad_bias[0], want_grad_x.sum_to_size(bias[0].shape), dtype, "grad bias")
    return keep


# ==== properties: random shapes, dtypes, probabilities, with and without bias ================================

@st.composite
def dropout_add_cases(draw):
    """(fn, x, residual, bias, p, no_grad): x of rank 2-4, bias [h] (with or without grad) or none, p in
    (0, 1), fp32 or bf16, residual first or last; run for training or under no_grad (the inference graph)."""
    dtype = draw(st.sampled_from(DTYPES))
    rank = draw(st.integers(2, 4))
    shape = draw(st.lists(st.integers(1, 4), min_size=rank, max_size=rank))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    x = torch.randn(shape, generator=gen).to(dtype).requires_grad_()
    residual = torch.randn(shape, generator=gen).to(dtype).requires_grad_()
    has_bias = draw(st.booleans())
    bias = [torch.randn(shape[-1:], generator=gen).to(dtype).requires_grad_(draw(st.booleans()))] if has_bias else []
    p = draw(st.sampled_from([0.1, 0.25, 0.5, 0.9]))
    return bias_dropout_add(draw(st.booleans()), has_bias), x, residual, bias, p, draw(st.booleans())


def check_dropout_add(case):
    fn, x, residual, bias, p, no_grad = case
    out, grads, report, grad_out = compiled_run(fn, x, residual, bias, p, no_grad=no_grad)
    assert report.fusions == {"bias_dropout_add": 1} and report.unfused == [], (report.fusions, report.unfused)
    assert report.lowered_ops["npu_compile.bias_dropout_add"] == 1
    assert "aten.native_dropout" not in report.lowered_ops
    if not no_grad:
        assert report.lowered_ops["npu_compile.bias_dropout_add_backward"] == 1
    assert out.dtype == x.dtype and out.shape == x.shape
    check_against_its_mask(x.detach(), residual.detach(), [b.detach().requires_grad_(b.requires_grad) for b in bias],
                           p, out.detach(), grads, grad_out)


# Derandomized, the first 10 examples already hold both dtypes, bias or none, training and inference and every
# p; 40 of them pair most of these (each example compiles). The fuzz twin (make fuzz) draws thousands.
@settings(max_examples=40, deadline=None)
@given(case=dropout_add_cases())
def test_bias_dropout_add_drops_one_mask_forward_and_backward(case):
    check_dropout_add(case)


@pytest.mark.fuzz
@settings(settings.get_profile("fuzz"))
@given(case=dropout_add_cases())
def test_bias_dropout_add_drops_one_mask_forward_and_backward_fuzz(case):
    check_dropout_add(case)


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_keep_fraction_is_one_minus_p(p):
    shape = (64, 4, 128)  # 32768 elements: 5 standard deviations of the kept fraction are < 1.5 %
    x, residual, bias = torch.randn(shape, requires_grad=True), torch.randn(shape, requires_grad=True), torch.randn(128)
    out, grads, report, grad_out = compiled_run(bias_dropout_add(True, True), x, residual, [bias], p)
    keep = check_against_its_mask(x.detach(), residual.detach(), [bias], p, out.detach(), grads, grad_out)
    sigma = (p * (1 - p) / keep.numel()) ** 0.5
    assert abs(keep.double().mean().item() - (1 - p)) < 5 * sigma


def test_each_call_draws_a_new_mask():
    fn = bias_dropout_add(True, False)
    x, residual = torch.randn(16, 32), torch.randn(16, 32)
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="ascend", options={"fusions": list(RULES)})
    first, second = compiled(x, residual, 0.5), compiled(x, residual, 0.5)
    torch._dynamo.reset()
    assert not torch.equal(first, second)


def dropout_block(x, residual, w, p):
    return residual + F.dropout(torch.relu(x @ w), p, training=True)


def run_dropout_block(budget):
    """dropout_block compiled with memory_budget=``budget``: (report, s, grad_x, grad_w, inputs, grad_out)."""
    x, residual, w = torch.randn(8, 16, requires_grad=True), torch.randn(8, 16), torch.randn(16, 16, requires_grad=True)
    grad_out = torch.randn(8, 16)
    torch._dynamo.reset()
    with collect() as reports:
        s = torch.compile(dropout_block, backend="ascend",
                          options={"fusions": list(RULES), "memory_budget": budget})(x, residual, w, 0.5)
        s.backward(grad_out)
    torch._dynamo.reset()
    return reports[0], s.detach(), x.grad, w.grad, (x, residual, w), grad_out


def backward_with_the_forward_mask(s, inputs, grad_out, p=0.5):
    """Eager gradients of dropout_block with the mask the forward used (read from s)."""
    x, residual, w = (t.detach().clone().requires_grad_() for t in inputs)
    h = torch.relu(x @ w)
    keep = (s - residual) != 0
    (residual + torch.where(keep, h / (1 - p), 0.0)).backward(grad_out)
    return x.grad, w.grad


@pytest.mark.parametrize("budget", [
    0.0, 0.01, 0.3,  # at exactly 0 torch's min-cut would ignore MUST_SAVE: the backend keeps the budget above 0
])
def test_seed_is_saved_not_redrawn_when_the_partitioner_recomputes(budget):
    """Under a memory budget the partitioner recomputes cheap forward nodes in the backward, and drawing the seed
    costs nothing; a redrawn seed would drop other elements in the backward than in the forward."""
    report, s, grad_x, grad_w, inputs, grad_out = run_dropout_block(budget)
    assert report.fusions == {"bias_dropout_add": 1}
    assert report.lowered_ops["aten.randint"] == 1  # drawn once, in the forward, and saved
    want_x, want_w = backward_with_the_forward_mask(s, inputs, grad_out)
    torch.testing.assert_close(grad_x, want_x, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad_w, want_w, rtol=1e-5, atol=1e-5)


def test_without_the_guard_the_partitioner_redraws_the_seed(monkeypatch):
    """What the MUST_SAVE mark prevents (engine.save_random_values): under a budget the seed is drawn again in
    the backward, and the gradients no longer match the forward's mask."""
    from npu_compile.passes import engine

    monkeypatch.setattr(engine, "save_random_values", lambda graph: None)
    report, s, grad_x, grad_w, inputs, grad_out = run_dropout_block(0.3)
    assert report.lowered_ops["aten.randint"] == 2
    want_x, _ = backward_with_the_forward_mask(s, inputs, grad_out)
    assert not torch.allclose(grad_x, want_x)


# ==== megatron-core with hidden_dropout > 0 ===================================================================

def gpt():
    from megatron_glue.capture.models import gpt_config

    return gpt_config(hidden_size=64, hidden_dropout=0.1)


def llama():
    from megatron_glue.capture.models import llama_config

    return llama_config(hidden_size=64, num_query_groups=2, hidden_dropout=0.1)


# Different masks give different losses: two eager runs with different seeds differ by up to 0.5 % per step on
# these models (measured); the compiled model must stay within 2 % of eager at every step.
LOSS_BAND = 0.02


@pytest.mark.parametrize("make_config, norms", [(gpt, {}), (llama, {"rms_norm": 5})], ids=["gpt", "llama"])
def test_megatron_trains_with_hidden_dropout_within_a_band_of_eager(make_config, norms, megatron_cpu):
    from megatron_glue.capture.models import build_gpt_model, synthetic_batch

    batch = synthetic_batch(2, 32, 128, seed=0)

    def train(model, steps=5):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        losses = []
        for _ in range(steps):
            opt.zero_grad(set_to_none=True)
            loss = model(**batch).mean()  # one batch throughout: the loss must fall
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses

    torch._dynamo.reset()
    torch.manual_seed(0)
    with torch._dynamo.config.patch(disable=True):
        eager = train(build_gpt_model(make_config(), 128, 32, seed=0))
    with collect() as reports:
        compiled = train(torch.compile(build_gpt_model(make_config(), 128, 32, seed=0), backend="ascend"))
    torch._dynamo.reset()
    (report,) = reports
    # two residual adds per layer, each after a dropout: bias_dropout_add takes them, the norm after each fuses
    # alone (RMSNorm) or stays native_layer_norm (LayerNorm); the first norm reads the embedding dropout
    assert report.fusions["bias_dropout_add"] == 4
    assert report.fusions["add_rms_norm"] == 0 and report.fusions["add_layer_norm"] == 0
    assert {k: report.fusions[k] for k in norms} == norms
    assert [u for u in report.unfused if u["rule"] in ("bias_dropout_add", "add_rms_norm", "add_layer_norm", "rms_norm")] == []
    assert report.lowered_ops["aten.randint"] == 4
    assert compiled[-1] < compiled[0] - 0.1, compiled  # it trains
    worst = max(abs(c - e) / e for c, e in zip(compiled, eager))
    assert worst < LOSS_BAND, (eager, compiled)


# ==== sites left unfused, and why =============================================================================

def explain(fn, *args, **options):
    (report,) = npu_compile.explain(fn, *args, options={"fusions": list(RULES), **options}).graphs
    return report.fusions, [(u["op"], u["reason"]) for u in report.unfused if u["rule"] in RULES]


def test_switched_off_rule_reports_its_site():
    fusions, sites = explain(bias_dropout_add(True, True), torch.randn(4, 8, requires_grad=True),
                             torch.randn(4, 8, requires_grad=True), 0.1, torch.randn(8, requires_grad=True),
                             fusions={"bias_dropout_add": False})
    assert "bias_dropout_add" not in fusions
    assert sites == [("aten.native_dropout.default", "rule 'bias_dropout_add' is switched off by options['fusions']")]


def test_plain_dropout_is_not_redrawn_under_a_budget_either():
    """The same guard covers torch's own dropout (here with the rule off): its mask is saved, not redrawn."""
    def block(x, w):
        return F.dropout(torch.relu(x @ w), 0.5, training=True)

    x, w = torch.randn(8, 16, requires_grad=True), torch.randn(16, 16)
    torch._dynamo.reset()
    with collect() as reports:
        out = torch.compile(block, backend="ascend", options={"fusions": [], "memory_budget": 0.3})(x, w)
        out.backward(torch.ones_like(out))
    torch._dynamo.reset()
    assert reports[0].lowered_ops["aten.native_dropout"] == 1
    x2 = x.detach().clone().requires_grad_()
    torch.where(out.detach() != 0, torch.relu(x2 @ w) * 2, 0.0).backward(torch.ones_like(out))
    torch.testing.assert_close(x.grad, x2.grad)


def test_bias_the_op_cannot_take_stays_an_add_in_front():
    """A bias of another dtype (x + bias promotes): the bias form declines, and the bias-less form takes the
    dropout and residual add of the promoted sum."""
    x, residual = torch.randn(4, 8, dtype=torch.bfloat16), torch.randn(4, 8, dtype=torch.bfloat16)
    with torch.no_grad():
        (report,) = npu_compile.explain(bias_dropout_add(True, True), x, residual, 0.1, torch.randn(8),
                                        options={"fusions": list(RULES)}).graphs
    assert report.fusions == {"bias_dropout_add": 1} and report.unfused == []
    assert report.lowered_ops["aten.add"] == 1  # x + bias, in fp32


def test_p_zero_and_dropouts_that_feed_no_residual_add_are_no_sites():
    x, residual = torch.randn(4, 8, requires_grad=True), torch.randn(4, 8, requires_grad=True)
    fusions, sites = explain(bias_dropout_add(True, False), x, residual, 0.0)  # dropout(p=0) is no op at all
    assert fusions == {"bias_dropout_add": 0} and sites == []
    fusions, sites = explain(lambda x, w: F.dropout(x, 0.1, training=True) @ w, x, torch.randn(8, 8))
    assert fusions == {"bias_dropout_add": 0} and sites == []


# ==== symbolic shapes: a dynamic sequence dim fuses as a static one ===========================================

@pytest.mark.parametrize("has_bias", [True, False])
def test_bias_dropout_add_fires_on_a_dynamic_sequence_dim(has_bias):
    fn = bias_dropout_add(True, has_bias)
    gen = torch.Generator().manual_seed(0)
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="ascend", options={"fusions": list(RULES)})
    with collect() as reports:
        for s in (12, 7):  # one graph serves both: the sequence dim is a symbol
            x, residual = (torch.randn(s, 2, 16, generator=gen, requires_grad=True) for _ in range(2))
            bias = [torch.randn(16, generator=gen, requires_grad=True)] if has_bias else []
            leaves = [t.detach().clone().requires_grad_() for t in (x, residual, *bias)]
            for t in leaves[:2]:
                torch._dynamo.mark_dynamic(t, 0)
            out = compiled(leaves[0], leaves[1], 0.25, *leaves[2:])
            grad_out = torch.randn(out.shape, generator=gen)
            out.backward(grad_out)
            check_against_its_mask(x.detach(), residual.detach(), bias, 0.25, out.detach(),
                                   [t.grad for t in leaves], grad_out)
    torch._dynamo.reset()
    (report,) = reports
    assert report.fusions == {"bias_dropout_add": 1} and report.unfused == []
