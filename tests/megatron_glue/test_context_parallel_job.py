"""The job at --context-parallel-size 2 over 2 gloo processes, Ulysses and ring, eager and compiled: losses and
gradient norms equal to one process at CP 1 on the same global batch (fp32, 1e-5); compiled, the collectives are
in the layer's graph and nothing breaks it. The attention's arithmetic in one process:
tests/megatron_glue/test_context_parallel.py."""

from __future__ import annotations

import json

import pytest

from pretrain_runs import assert_close, pretrain

ITERS = ["--train-iters", "2", "--eval-iters", "0"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One process, CP 1, eager: the losses and gradient norms CP 2 must give."""
    run = pretrain(tmp_path_factory.mktemp("cp1"), *ITERS, "--no-npu-compile").check()
    return run


@pytest.mark.slow
@pytest.mark.training
@pytest.mark.parametrize("algorithm, compiled", [
    pytest.param("ulysses_cp_algo", False, id="ulysses_cp_algo-eager"),
    pytest.param("ulysses_cp_algo", True, id="ulysses_cp_algo-compiled"),
    # megatron-core 0.12 scales the CP loss otherwise (versions.loss_times_cp_size): make test-mcore012 runs this one
    pytest.param("megatron_cp_algo", False, id="megatron_cp_algo-eager", marks=pytest.mark.megatron_lines),
    pytest.param("megatron_cp_algo", True, id="megatron_cp_algo-compiled"),
])
def test_context_parallel_2_equals_one_process(reference, algorithm, compiled, tmp_path):
    flags = [*ITERS, "--context-parallel-size", "2", "--context-parallel-algo", algorithm]
    if compiled:
        flags += ["--npu-compile-options", json.dumps({"dump_dir": str(tmp_path / "dumps")})]
    else:
        flags.append("--no-npu-compile")
    run = pretrain(tmp_path / "run", *flags, nproc=2).check()
    assert_close(run.losses, reference.losses, what=f"{algorithm} lm loss")
    norms = [r["grad_norm"] for r in run.rows("train")]
    assert_close(norms, [r["grad_norm"] for r in reference.rows("train")], what=f"{algorithm} grad norm")
    if not compiled:
        return
    # the layer's training graph on each rank: the CP collectives in it, no break; Ulysses' attention fused, the
    # ring's steps the fused attention_with_lse
    for rank in (0, 1):
        reports = [json.loads(p.read_text()) for p in (tmp_path / "dumps" / f"rank{rank}").glob("*/report.json")]
        layer = [r for r in reports if r["lowered_ops"].get("_c10d_functional.all_to_all_single")]
        assert layer, f"rank {rank}: no graph holds the CP all-to-all"
        assert all(r["graph_breaks"] == 0 for r in reports)
        training = max(layer, key=lambda r: r["lowered_ops"]["_c10d_functional.all_to_all_single"])
        # forward and backward: Ulysses 4 each way (q, k, v, context), the ring 1 each way at CP 2
        assert training["lowered_ops"]["_c10d_functional.all_to_all_single"] == (8 if algorithm == "ulysses_cp_algo"
                                                                                  else 2)
        assert training["comm"]["collectives"] == training["lowered_ops"]["_c10d_functional.all_to_all_single"]
        if algorithm == "ulysses_cp_algo":
            assert training["fusions"]["attention"] == 1
        else:  # each of the ring's 2 steps the fused attention_with_lse, forward and backward
            assert training["lowered_ops"].get("npu_compile.attention_with_lse") == 2, training["lowered_ops"]
            assert training["lowered_ops"].get("npu_compile.attention_with_lse_backward") == 2


@pytest.mark.slow
@pytest.mark.training
def test_tensor_and_context_parallel_2x2_equals_one_process(reference, tmp_path):
    """TP 2 x CP 2 on 4 processes, Ulysses, sequence parallel, compiled: the TP collectives and the CP all-to-alls
    in one layer graph, equal to one process."""
    flags = [*ITERS, "--context-parallel-size", "2", "--tensor-model-parallel-size", "2", "--sequence-parallel",
             "--npu-compile-options", json.dumps({"dump_dir": str(tmp_path / "dumps")})]
    run = pretrain(tmp_path / "run", *flags, nproc=4).check()
    assert_close(run.losses, reference.losses, what="TP2 x CP2 lm loss")
    assert_close([r["grad_norm"] for r in run.rows("train")], [r["grad_norm"] for r in reference.rows("train")],
                 what="TP2 x CP2 grad norm")
    reports = [json.loads(p.read_text()) for p in (tmp_path / "dumps" / "rank0").glob("*/report.json")]
    assert all(r["graph_breaks"] == 0 for r in reports)
    (layer,) = [r for r in reports if r["lowered_ops"].get("_c10d_functional.all_to_all_single")]
    assert layer["lowered_ops"]["_c10d_functional.all_to_all_single"] == 8
    assert layer["lowered_ops"]["_c10d_functional.reduce_scatter_tensor"] > 0  # SP's, beside them
    assert layer["fusions"]["attention"] == 1
