"""The rule engine: the README's worked example, switches, counts, unfused reasons, training and inference."""

import pytest
import torch

import npu_compile
from npu_compile import passes


# --- the README's worked example: a hand-written SiLU becomes aten.silu (whose backward is one op too) ---
def silu_pattern(x):
    return x * torch.sigmoid(x)


def silu_replacement(x):
    return torch.nn.functional.silu(x)


SILU = passes.Rule(
    name="handwritten_silu",
    pattern=silu_pattern,
    replacement=silu_replacement,
    example_inputs=lambda: [[torch.empty(8, 16, requires_grad=True)]],
    anchors=(torch.ops.aten.sigmoid.default,),
)


@pytest.fixture
def silu_rule():
    passes.register_rule(SILU)
    yield SILU
    passes.unregister_rule(SILU.name)


class Mlp(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(16, 16)

    def forward(self, x):
        h = self.fc(x)
        return h * torch.sigmoid(h)


def test_worked_example_fuses_forward_and_backward(silu_rule, tmp_path):
    m = Mlp()
    x = torch.randn(4, 16)
    exp = npu_compile.explain(m, x)
    (r,) = exp.graphs
    assert r.fusions["handwritten_silu"] == 1
    assert r.lowered_ops["aten.silu"] == 1 and r.lowered_ops["aten.silu_backward"] == 1
    assert "aten.sigmoid" not in r.lowered_ops and not [u for u in r.unfused if u["rule"] == "handwritten_silu"]
    # numerics: forward and grads against eager
    twin = Mlp()
    twin.load_state_dict(m.state_dict())
    cm = torch.compile(twin, backend="ascend")
    y0, y1 = m(x), cm(x)
    torch.testing.assert_close(y1, y0, rtol=1e-6, atol=1e-6)
    y0.sum().backward()
    y1.sum().backward()
    torch.testing.assert_close(twin.fc.weight.grad, m.fc.weight.grad, rtol=1e-5, atol=1e-6)


def test_worked_example_in_inference(silu_rule):
    with torch.no_grad():
        (r,) = npu_compile.explain(Mlp(), torch.randn(4, 16)).graphs
    assert r.graphs == ["inference"] and r.fusions["handwritten_silu"] == 1
    assert r.lowered_ops["aten.silu"] == 1


def test_switched_off_rule_reports_site_unfused(silu_rule):
    (r,) = npu_compile.explain(Mlp(), torch.randn(4, 16), options={"fusions": {"handwritten_silu": False}}).graphs
    assert "handwritten_silu" not in r.fusions
    assert [u for u in r.unfused if u["rule"] == "handwritten_silu"] == [
        {"op": "aten.sigmoid.default", "node": "sigmoid", "rule": "handwritten_silu",
         "reason": "rule 'handwritten_silu' is switched off by options['fusions']"}
    ]


def test_declined_match_reports_the_reason(silu_rule):
    passes.unregister_rule(SILU.name)
    passes.register_rule(
        passes.Rule(**{**SILU.__dict__, "extra_check": lambda match: "rows shorter than 32 stay unfused"})
    )
    (r,) = npu_compile.explain(Mlp(), torch.randn(4, 16)).graphs
    assert r.fusions["handwritten_silu"] == 0
    assert [u["reason"] for u in r.unfused if u["rule"] == "handwritten_silu"] == ["rows shorter than 32 stay unfused"]


def test_a_check_that_a_data_dependent_size_decides_declines_the_site(silu_rule):
    """An MoE expert's rows are a data-dependent size (an unbacked symbol): a rule's check that compares it
    cannot add a guard Dynamo would keep, so the site is declined with the reason; the compile goes on, and the
    graph (forward and backward, partitioned with the unbacked size) computes what eager does."""
    from npu_compile.passes.engine import stride_order

    passes.unregister_rule(SILU.name)
    passes.register_rule(passes.Rule(**{**SILU.__dict__, "extra_check": lambda match: bool(stride_order(
        match.output_nodes()[0].meta["val"]))}))

    def rows_of_positive_sum(x):
        h = x[x.sum(-1) > 0]  # data-dependent rows
        return (h * torch.sigmoid(h)).sum(0)

    x = torch.randn(8, 16)
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        (r,) = npu_compile.explain(rows_of_positive_sum, x.clone().requires_grad_(True)).graphs
        xc = x.clone().requires_grad_(True)
        out = torch.compile(rows_of_positive_sum, backend="ascend")(xc)
    assert r.fusions["handwritten_silu"] == 0 and r.graph_breaks == 0
    (site,) = [u for u in r.unfused if u["rule"] == "handwritten_silu"]
    assert site["reason"].startswith("a data-dependent size decides the check (Could not guard on data-dependent "
                                     "expression"), site["reason"]
    xe = x.clone().requires_grad_(True)
    torch.testing.assert_close(out, rows_of_positive_sum(xe))
    out.sum().backward()
    rows_of_positive_sum(xe).sum().backward()
    torch.testing.assert_close(xc.grad, xe.grad)


def test_unmatched_site_says_so(silu_rule):
    def f(x):
        return torch.sigmoid(x) + 1  # a sigmoid, but no x * sigmoid(x)

    (r,) = npu_compile.explain(f, torch.randn(4, 16, requires_grad=True)).graphs
    assert r.fusions["handwritten_silu"] == 0
    (site,) = [u for u in r.unfused if u["rule"] == "handwritten_silu"]
    assert site["reason"] == "no handwritten_silu pattern matched the ops around it"


def test_registration_is_lazy(silu_rule):
    from npu_compile.passes import engine

    assert (SILU.name, passes.TRAINING) not in engine._groups  # nothing traced at registration
    npu_compile.explain(Mlp(), torch.randn(4, 16))
    assert (SILU.name, passes.TRAINING) in engine._groups


# --- gradients a training graph may not want: grad_optional ---
def scaled_silu(x, p):
    return x * torch.sigmoid(x) * p  # p trains, x needs no grad: a training graph with no gradient for x


@pytest.mark.parametrize("optional, fused", [((), 0), (("x",), 1)])
def test_grad_optional_input_is_traced_without_grad_too(optional, fused):
    rule = passes.Rule(**{**SILU.__dict__, "name": "silu_grad_optional", "grad_optional": optional})
    passes.register_rule(rule)
    try:
        x, p = torch.randn(4, 16), torch.randn(16, requires_grad=True)
        (r,) = npu_compile.explain(scaled_silu, x, p, options={"fusions": [rule.name]}).graphs
    finally:
        passes.unregister_rule(rule.name)
    assert r.graphs == ["forward", "backward"] and r.fusions[rule.name] == fused
    assert ("aten.sigmoid" in r.lowered_ops) == (not fused)


def test_grad_variants_switch_off_each_subset_most_gradients_first():
    from npu_compile.passes.engine import grad_variants

    def pattern(x, residual, weight):
        return x + residual * weight

    example = [torch.empty(2, requires_grad=True), torch.empty(2, requires_grad=True), torch.empty(2)]
    variants = grad_variants(pattern, [example], ("x", "residual", "weight"))
    assert [[a.requires_grad for a in v] for v in variants] == [
        [True, True, False], [True, False, False], [False, True, False], [False, False, False]]
    assert [[a.requires_grad for a in v] for v in grad_variants(pattern, [example], ("x",), keep=("x",))] == [
        [True, True, False]]
    with pytest.raises(ValueError, match=r"grad_optional/shared_inputs name \['bias'\], which are not arguments "
                                         r"of pattern\('x', 'residual', 'weight'\)"):
        grad_variants(pattern, [example], ("bias",))


# --- a slice_backward that takes the whole dim is the identity ---
def test_full_slice_backward_is_folded_and_a_partial_one_kept():
    from torch.fx.experimental.proxy_tensor import make_fx

    from npu_compile.passes.engine import fold_full_slice_backwards

    aten = torch.ops.aten

    def f(g, h):
        full = aten.slice_backward(g, [4, 8], 0, 0, 2**63 - 1, 1)
        part = aten.slice_backward(h, [4, 8], 0, 1, 3, 1)
        return full * 2 + part, aten.slice_backward(g, [4, 8], 1, 0, 8, 1)  # the last: an output, g an input

    g, h = torch.randn(4, 8), torch.randn(2, 8)
    gm = make_fx(f)(g, h)
    fold_full_slice_backwards(gm.graph)
    gm.recompile()
    kept = [n.args[1:] for n in gm.graph.find_nodes(op="call_function", target=aten.slice_backward.default)]
    assert kept == [([4, 8], 0, 1, 3, 1), ([4, 8], 1, 0, 8, 1)]
    for got, want in zip(gm(g, h), f(g, h)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_rule_registered_twice_is_kept_once_and_comes_back_after_unregister():
    """Importing a rules module twice registers nothing new; after unregister_rule the same rule registers again
    (the set of registered patterns is a hint the rule list decides)."""
    from npu_compile.passes.engine import RULES

    try:
        passes.register_rule(SILU)
        passes.register_rule(SILU)
        assert RULES[SILU.name] == [SILU]
        passes.unregister_rule(SILU.name)
        assert SILU.name not in RULES
        passes.register_rule(SILU)
        assert RULES[SILU.name] == [SILU]
        RULES[SILU.name].clear()  # a list emptied by hand: the hint alone does not keep the rule out
        passes.register_rule(SILU)
        assert RULES[SILU.name] == [SILU]
    finally:
        passes.unregister_rule(SILU.name)
