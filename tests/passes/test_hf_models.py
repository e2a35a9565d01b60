"""The fusion rules on transformers' own model classes (bench/hf_fusions.py builds them: nine families,
random-init, 2 layers, fp32), not on spellings copied from them: eager and SDPA attention, training with and
without the KV cache, inference with it (a prefill and one decode step). Each compiled model must fuse its
attention once per layer (and its SwiGLU where the MLP is SiLU-gated), leave no attention site unmatched, and
equal eager: logits, loss and every parameter's gradient.

A representative share runs in ``make test`` (each spelling the families differ in: GQA repeated by expand,
q/k/v laid out [b, s, n, d], GPT-2's split heads and kᵀ as transpose(-1, -2), OPT's query scaled before its
heads split, GPT-NeoX's mixed layouts, Phi-3's up · silu(gate), the decode step on a cache, SDPA); the whole
matrix is marked ``fuzz``."""

import pytest

from bench.hf_fusions import FAMILIES, IMPLEMENTATIONS, LAYERS, SCENARIOS, counts, run_case

pytest.importorskip("transformers")

# fp32, as tests/passes/conftest.py TOLERANCE: held to the float64 run, no further from it than eager plus 1e-5
TOLERANCE = 1e-5


def check(family: str, implementation: str, scenario: str) -> None:
    case = run_case(family, implementation, scenario)
    passes = 2 if scenario == "infer_cache" else 1  # the decode step is a graph of its own
    assert all(r.graph_breaks == 0 for r in case.reports), [r.graph_break_reason for r in case.reports]
    missed = [u for u in case.unfused() if u.get("rule") == "attention"]
    assert missed == [], missed
    found = counts(case, family)
    assert found["attention"] == LAYERS * passes, case.fusions()
    if FAMILIES[family].swiglu:
        assert found["swiglu"] == LAYERS * passes, (case.fusions(), case.unfused())
    assert not [u for u in case.unfused() if u.get("rule") == "swiglu"], case.unfused()
    bad = case.excess(TOLERANCE)
    assert not bad, f"relative errors against float64: {bad}"


SHARE = [
    ("llama", "eager", "train"),          # GQA: k/v repeated by expand + reshape; q [b, s, n, d] in memory
    ("llama", "eager", "infer_cache"),    # k/v from the cache (contiguous), a decode step of one row
    ("llama", "sdpa", "train_cache"),
    ("gpt2", "eager", "train"),           # heads split from one projection, kᵀ as transpose(-1, -2)
    ("opt", "eager", "train_cache"),      # the query scaled before its heads split: unscaled scores
    ("gpt_neox", "eager", "train"),       # q, k rotated by cat (contiguous), v a strided view
    ("phi3", "eager", "train"),           # up · silu(gate) on the halves of gate_up_proj
]


@pytest.mark.parametrize("family, implementation, scenario", SHARE, ids=["-".join(c) for c in SHARE])
def test_hf_model_fuses_and_equals_eager(family, implementation, scenario):
    check(family, implementation, scenario)


MATRIX = [(f, i, s) for f in FAMILIES for i in IMPLEMENTATIONS for s in SCENARIOS if (f, i, s) not in SHARE]


@pytest.mark.fuzz
@pytest.mark.parametrize("family, implementation, scenario", MATRIX, ids=["-".join(c) for c in MATRIX])
def test_hf_model_fuses_and_equals_eager_matrix(family, implementation, scenario):
    check(family, implementation, scenario)


def test_two_projection_swiglu_keeps_no_concatenated_weight_for_the_backward():
    """In training the gate and up weights are concatenated for one matmul; the forward keeps x and the
    projection for the backward (no more than the unfused MLP keeps), never the [2I, H] weight copy (here twice
    the projection's size: it would show). On an npu target, whose partition recomputes the fused activation as
    torch's min-cut recomputes the unfused one (the reference target saves the fused one's output at budget 1.0,
    what eager keeps)."""
    fused = run_case("llama", "eager", "train", options={"target": "npu-sim"}).reports[0]
    unfused = run_case("llama", "eager", "train", options={"target": "npu-sim", "fusions": {"swiglu": False}}).reports[0]
    assert fused.fusions["swiglu"] == LAYERS and unfused.fusions.get("swiglu", 0) == 0
    assert fused.memory["saved_activation_bytes"] <= unfused.memory["saved_activation_bytes"]
