"""Recompute under memory_budget: never changes results, never recomputes attention, trades saved bytes for
recomputed work monotonically, and is weighed by the cost model."""

import pytest
import torch
import torch.nn.functional as F

from npu_compile.debug.report import collect
from npu_compile.passes import recompute

BUDGETS = [1.0, 0.5, 0.3, 0.0]


class Block(torch.nn.Module):
    """A pre-norm transformer block: LayerNorm, causal SDPA attention, LayerNorm, bias + GeLU MLP."""

    def __init__(self, h=64, heads=4, dropout=0.0):
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.ln1, self.ln2 = torch.nn.LayerNorm(h), torch.nn.LayerNorm(h)
        self.qkv, self.proj = torch.nn.Linear(h, 3 * h), torch.nn.Linear(h, h)
        # fc1's bias added apart, as Megatron's ColumnParallelLinear(skip_bias_add) hands it to bias_gelu
        self.fc1, self.fc1_bias = torch.nn.Linear(h, 4 * h, bias=False), torch.nn.Parameter(torch.randn(4 * h) / 8)
        self.fc2 = torch.nn.Linear(4 * h, h)

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, h))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x)) + self.fc1_bias, approximate="tanh"))


def run(budget, dropout=0.0, compiled=True):
    torch.manual_seed(0)
    model = torch.nn.Sequential(Block(dropout=dropout), Block(dropout=dropout))
    x = torch.randn(2, 96, 64, requires_grad=True)
    fn = torch.compile(model, backend="ascend", options={"memory_budget": budget}) if compiled else model
    torch.manual_seed(1)  # the dropout draws
    with collect() as reports:
        out = fn(x)
        out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(2)))
    torch._dynamo.reset()
    results = [out.detach(), x.grad, *(p.grad for p in model.parameters())]
    return results, (reports[0] if reports else None)


@pytest.fixture(scope="module")
def eager():
    return run(1.0, compiled=False)[0]


@pytest.fixture(scope="module")
def by_budget():
    return {budget: run(budget) for budget in BUDGETS}


@pytest.mark.parametrize("budget", BUDGETS)
def test_recompute_never_changes_results(budget, eager, by_budget, rel_error):
    got, report = by_budget[budget]
    # the second block's first norm takes the residual sum of the first block
    assert {k: v for k, v in report.fusions.items() if v} == {"attention": 2, "add_layer_norm": 3, "bias_gelu": 2}
    errors = {i: rel_error(g, e) for i, (g, e) in enumerate(zip(got, eager))}
    assert max(errors.values()) <= 1e-5, errors


def test_attention_is_never_recomputed_and_the_mlp_activation_only_below_full_budget(by_budget):
    """On the reference target (these tests' CPU) the GeLU is saved when memory allows (budget 1.0) and recomputed
    below it, where the knapsack finds its output the cheapest memory to give back."""
    for budget, (_, report) in by_budget.items():
        ops = report.memory["recompute_ops"]
        assert "npu_compile.fused_attention" not in ops, (budget, ops)
        assert report.lowered_ops["npu_compile.fused_attention"] == 2, budget
        assert ops.get("npu_compile.bias_gelu") == (None if budget == 1.0 else 2), (budget, ops)


def test_lower_budgets_save_less_and_recompute_more(by_budget):
    saved = [by_budget[b][1].memory["saved_activation_bytes"] for b in BUDGETS]
    work = [by_budget[b][1].memory["recompute_us"] for b in BUDGETS]
    flops = [by_budget[b][1].memory["recompute_flops"] for b in BUDGETS]
    # (the knapsack counts each saved tensor, this report distinct storages: between two budgets below 1.0 the
    # order may swap by a view's worth; against 1.0 and at 0.0 it may not)
    assert all(s < saved[0] for s in saved[1:]) and saved[-1] == min(saved), saved
    assert work == sorted(work) and work[-1] > work[0], work
    assert flops == sorted(flops), flops
    assert flops[0] == 0  # at 1.0 no matmul is repeated


def test_dropout_is_drawn_once_at_every_budget():
    """Recomputed work must not redraw a mask: every budget gives the result of budget 1.0, bit for bit."""
    reference, _ = run(1.0, dropout=0.2)
    for budget in (0.3, 0.0):
        got, report = run(budget, dropout=0.2)
        assert "npu_compile.fused_attention" not in report.memory["recompute_ops"]
        for g, r in zip(got, reference):
            torch.testing.assert_close(g, r, rtol=0, atol=0)


def test_the_knapsack_is_weighed_by_the_cost_model(monkeypatch):
    calls = []
    real = recompute.CostModelRuntime.__call__

    def counting(self, node):
        calls.append(node)
        return real(self, node)

    monkeypatch.setattr(recompute.CostModelRuntime, "__call__", counting)
    run(0.3)
    assert calls, "the partitioner never asked the cost model"
    mm = next(n for n in calls if n.target is torch.ops.aten.mm.default)
    from npu_compile.device import cost

    assert real(recompute.CostModelRuntime(), mm) == cost.node_us(mm)


def _compiled(options):
    torch.manual_seed(0)
    model = torch.nn.Sequential(Block(), Block())
    x = torch.randn(2, 96, 64, requires_grad=True)
    with collect() as reports:
        out = torch.compile(model, backend="ascend", options={"cache": False, **options})(x)
        out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(2)))
    torch._dynamo.reset()
    return [out.detach(), x.grad, *(p.grad for p in model.parameters())], reports[0]


def test_option_recompute_activation_forces_it_where_the_min_cut_would_save_it(monkeypatch, eager, rel_error):
    """Option recompute ["activation"] (MindSpeed's --recompute-activation-function) marks the fused activation
    MUST_RECOMPUTE. The reference target's min-cut saves its output at budget 1.0 (below), and so does any target's
    with bias_gelu taken off the cheap fused ops; the option still has it recomputed: fewer saved bytes, the same
    results."""
    monkeypatch.setattr(recompute, "CHEAP_FUSED", tuple(n for n in recompute.CHEAP_FUSED if n != "bias_gelu"))
    saving, saving_report = _compiled({})
    forced, forced_report = _compiled({"recompute": ["activation"]})
    assert "npu_compile.bias_gelu" not in saving_report.memory["recompute_ops"]
    assert forced_report.memory["recompute_ops"].get("npu_compile.bias_gelu") == 2
    # the two [2, 96, 256] fp32 GeLU outputs no longer saved
    assert saving_report.memory["saved_activation_bytes"] - forced_report.memory["saved_activation_bytes"] == (
        2 * 2 * 96 * 256 * 4)
    for got in (saving, forced):
        errors = {i: rel_error(g, e) for i, (g, e) in enumerate(zip(got, eager))}
        assert max(errors.values()) <= 1e-6, errors
    for g, s in zip(forced, saving):  # recomputing the same op on the same input: bit for bit
        torch.testing.assert_close(g, s, rtol=0, atol=0)


def test_the_reference_target_saves_the_activation_the_npu_target_recomputes(eager, rel_error):
    """At budget 1.0 the min-cut counts an elementwise recompute free. The NPU targets keep that (one pass of the
    vector unit at memory bandwidth): the GeLU is recomputed. The reference target (a CPU, where the GeLU's tanh is
    compute) saves its output instead: the two [2, 96, 256] fp32 GeLU outputs more saved, the same results."""
    saving, saving_report = _compiled({"target": "reference"})
    npu, npu_report = _compiled({"target": "npu-sim"})
    assert "npu_compile.bias_gelu" not in saving_report.memory["recompute_ops"]
    assert npu_report.memory["recompute_ops"].get("npu_compile.bias_gelu") == 2
    assert saving_report.memory["saved_activation_bytes"] - npu_report.memory["saved_activation_bytes"] == (
        2 * 2 * 96 * 256 * 4)
    for got in (saving, npu):
        errors = {i: rel_error(g, e) for i, (g, e) in enumerate(zip(got, eager))}
        assert max(errors.values()) <= 1e-5, errors


def test_option_recompute_names_its_kinds():
    from npu_compile import config

    with pytest.raises(config.OptionError) as info:
        config.validate({"recompute": ["activation", "norm"]})
    assert str(info.value) == ("npu_compile option 'recompute' names unknown op kind(s) 'norm'; known kinds are "
                               "'activation'")
    assert config.validate({"recompute": ["activation"]}).recompute == ("activation",)
