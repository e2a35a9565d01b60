"""MindSpeed's `--recompute-activation-function` in the compiled job: the backend's option recompute
["activation"] (the fused GeLU / SwiGLU marked must-recompute in every layer graph), MindSpeed's rules, and (marked
`training`) the job with it against the job without it."""

from __future__ import annotations

import json

import pytest

from pretrain_runs import parse_error as _error, parse_tiny as _parse, pretrain

FLAG = "--recompute-activation-function"


def test_maps_onto_the_backends_always_recomputed_activation():
    assert _parse(FLAG).npu_compile_options["recompute"] == ["activation"]
    options = _parse(FLAG, "--npu-compile-options", '{"memory_budget": 0.5, "recompute": ["activation"]}')
    assert options.npu_compile_options == {"memory_budget": 0.5, "recompute": ["activation"]}
    assert "recompute" not in _parse().npu_compile_options


def test_mindspeeds_rules_and_what_the_compiler_needs():
    assert _error(FLAG, "--recompute-activations") == (
        "pretrain_gpt: error: --recompute-activation-function is not compatible with --recompute-granularity "
        "selective (MindSpeed refuses the pair too); drop one of them")
    assert _error(FLAG, "--recompute-granularity", "full", "--recompute-method", "uniform",
                  "--recompute-num-layers", "1") == (
        "pretrain_gpt: error: --recompute-activation-function is not compatible with --recompute-method uniform "
        "(MindSpeed refuses the pair too: every layer is recomputed whole); drop one of them, or use "
        "--recompute-method block")
    assert _error(FLAG, "--no-npu-compile") == (
        "pretrain_gpt: error: --recompute-activation-function is done by the compiler (the fused activation ops "
        "recomputed in every layer graph), which --no-npu-compile turns off; in the eager job it is not implemented "
        "here: drop one of them")
    assert _error(FLAG, "--swiglu", "--npu-compile-options", '{"fusions": ["attention"]}') == (
        "pretrain_gpt: error: --recompute-activation-function recomputes the backend's fused activation op, and "
        "--npu-compile-options 'fusions' leaves its rule \"swiglu\" out; add it, or drop the flag")


def _layer_reports(run) -> list[dict]:
    reports = [json.loads(p.read_text()) for p in sorted((run.folder / "dumps").glob("*/report.json"))]
    return [r for r in reports if r["fusions"].get("attention") and "backward" in r["graphs"]]


@pytest.mark.slow
@pytest.mark.training
def test_job_recomputes_the_swiglu_of_every_layer_with_the_same_numbers(tmp_path):
    """Compiled, SwiGLU: with the flag every layer's forward+backward graph recomputes its fused SwiGLU (report.json
    recompute_ops) and saves less than without it: on the reference target (this CPU) the min-cut saves the SwiGLU's
    output when memory allows (lowering/reference.py, saved_at_full_budget), which the flag overrides. Losses and
    grad norms bit for bit (the same op on the same input, saved or computed again)."""
    flags = ["--swiglu", "--train-iters", "2", "--eval-iters", "0", "--npu-compile-options",
             json.dumps({"dump_dir": "dumps", "cache": False})]
    plain = pretrain(tmp_path / "plain", *flags).check()
    flagged = pretrain(tmp_path / "flagged", *flags, FLAG).check()
    rows = [[(r["lm loss"], r["grad_norm"]) for r in run.rows("train")] for run in (plain, flagged)]
    assert rows[0] == rows[1] and len(rows[0]) == 2
    layers = {name: _layer_reports(run) for name, run in (("plain", plain), ("flagged", flagged))}
    assert layers["flagged"] and all(r["memory"]["recompute_ops"].get("npu_compile.swiglu") for r in layers["flagged"])
    assert not any(r["memory"]["recompute_ops"].get("npu_compile.swiglu") for r in layers["plain"])
    assert len(layers["plain"]) == len(layers["flagged"])
    for saving, forced in zip(layers["plain"], layers["flagged"]):
        assert saving["memory"]["saved_activation_bytes"] > forced["memory"]["saved_activation_bytes"]
