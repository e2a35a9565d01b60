"""memory_budget="auto": the least recompute whose planned peak fits device_memory, chosen at compile time and
recorded in report.json; a job that cannot fit is refused before its first step, with the figures."""

import pytest
import torch
from test_recompute import Block

from npu_compile.config import OptionError
from npu_compile.debug.report import collect
from npu_compile.passes import recompute

MiB = 2**20


def run(options, compiled=True):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(Block() for _ in range(4)))  # the saved activations of 4 blocks make the peak
    x = torch.randn(2, 96, 64, requires_grad=True)
    fn = torch.compile(model, backend="ascend", options=options) if compiled else model
    with collect() as reports:
        out = fn(x)
        out.backward(torch.ones_like(out))
    torch._dynamo.reset()
    return [out.detach(), x.grad, *(p.grad for p in model.parameters())], (reports[0] if reports else None)


@pytest.fixture(scope="module")
def refused():
    """A cap nothing fits: every budget of the ladder tried, each with its planned peak."""
    with pytest.raises(recompute.MemoryFitError) as err:
        run({"memory_budget": "auto", "device_memory": 1, "resident_memory": 64 * MiB})
    return err.value


def test_a_loose_cap_keeps_budget_1(rel_error):
    got, report = run({"memory_budget": "auto", "device_memory": 2**40})
    assert report.budget["chosen"] == 1.0 and len(report.budget["tried"]) == 1
    assert report.budget["tried"][0]["planned_peak_bytes"] == report.memory["peak_bytes_before"]
    assert report.memory["recompute_nodes"] == run({"memory_budget": 1.0})[1].memory["recompute_nodes"]
    for a, b in zip(got, run({}, compiled=False)[0]):
        assert rel_error(a, b) < 1e-5


def test_a_tight_cap_takes_the_largest_budget_that_fits(refused, rel_error):
    peaks = [p.peak - 64 * MiB for p in refused.plans]  # without the resident memory of that run
    assert [p.budget for p in refused.plans] == list(recompute.LADDER)
    cap = (peaks[0] + min(peaks)) // 2
    want = next(b for b, peak in zip(recompute.LADDER, peaks) if peak <= cap)
    got, report = run({"memory_budget": "auto", "device_memory": cap})
    assert report.budget["chosen"] == want < 1.0
    assert [t["budget"] for t in report.budget["tried"]] == list(recompute.LADDER[:recompute.LADDER.index(want) + 1])
    assert all(t["planned_peak_bytes"] > cap for t in report.budget["tried"][:-1])
    assert report.memory["planned_peak_bytes"] <= cap and report.memory["recompute_nodes"] > 0
    for a, b in zip(got, run({}, compiled=False)[0]):
        assert rel_error(a, b) < 1e-5


def test_the_plan_does_not_depend_on_what_compiled_before():
    """Four blocks of one shape, the pattern traces first made in this compile (as in a new process) and then
    reused by a second compile: the same plans at every budget. (The copies a trace hands out to each site once
    shared their values: the four blocks' attention outputs and activations read as one buffer, and the first
    compile in a process planned less memory than the next.)"""
    from npu_compile.passes.engine import TRACE_CACHE

    TRACE_CACHE.clear()
    plans = []
    for _ in range(2):
        with pytest.raises(recompute.MemoryFitError) as err:
            run({"memory_budget": "auto", "device_memory": 1})
        plans.append([(p.budget, p.saved, p.live) for p in err.value.plans])
    assert plans[0] == plans[1]


def test_resident_memory_and_copies_count_in_the_plan():
    _, once = run({"memory_budget": "auto", "device_memory": 2**40})
    _, report = run({"memory_budget": "auto", "device_memory": 2**40, "resident_memory": 100 * MiB,
                     "activation_copies": 3})
    (t,) = report.budget["tried"]
    saved = report.memory["saved_activation_bytes"]
    assert t["planned_peak_bytes"] == 100 * MiB + 2 * saved + once.budget["tried"][0]["planned_peak_bytes"]
    assert report.memory["planned_peak_bytes"] == 100 * MiB + 2 * saved + report.memory["lower_bound_bytes"]


def test_a_cap_nothing_fits_is_refused_with_figures(refused):
    least = min(refused.plans, key=lambda p: p.peak)
    text = str(refused)
    gib = lambda n: f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / MiB:.1f} MiB"  # noqa: E731
    assert text.startswith(f"npu_compile: graph 0_0 does not fit device_memory {gib(1)} under memory_budget \"auto\": "
                           f"with the least activation memory (budget {least.budget}) a step needs {gib(least.peak)} "
                           f"= resident_memory {gib(64 * MiB)} + the graph's live bytes {gib(least.live)} + 0 other "
                           "copies (activation_copies)")
    assert "What would fit:" in text and f"device_memory ≥ {gib(least.peak)}" in text
    assert "resident_memory alone" in text or "a micro-batch of at most" in text


@pytest.mark.parametrize("options, message", [
    ({"memory_budget": "Auto"}, "npu_compile option 'memory_budget' got 'Auto'; it takes a float in [0, 1] or \"auto\""),
    ({"device_memory": 0}, "npu_compile option 'device_memory' got 0; it takes an int ≥ 1 or None"),
    ({"activation_copies": 1.5}, "npu_compile option 'activation_copies' got 1.5; it takes an int ≥ 1"),
    ({"resident_memory": -1}, "npu_compile option 'resident_memory' got -1; it takes an int ≥ 0"),
])
def test_wrong_memory_options_name_what_is_right(options, message):
    from npu_compile import config

    with pytest.raises(OptionError) as err:
        config.resolve(options)
    assert str(err.value) == message
