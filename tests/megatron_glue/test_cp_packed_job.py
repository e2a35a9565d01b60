"""Packed rows (--reset-attention-mask --reset-position-ids --eod-mask-loss) at --context-parallel-size 2 over 2
gloo processes, Ulysses and ring, eager and compiled: lm losses and gradient norms equal to one process at CP 1
on the same packed batches (fp32, 1e-5), with RoPE and GQA; --attention-mask-type general gives what causal gives. The arithmetic in
one process: test_cp_packed_documents.py."""

from __future__ import annotations

import json

import pytest

from megatron_glue.capture.adaptations import megatron_core_in
from pretrain_runs import assert_close, pretrain
from test_packed_sequences import PACKING, _on_demo_data, demo_data, short_documents  # noqa: F401  (fixtures)


@pytest.fixture(scope="module")
def packed_reference(short_documents, tmp_path_factory):  # noqa: F811
    """One process, CP 1, eager (Megatron's dense reset mask): the losses and gradient norms CP 2 must give."""
    folder = tmp_path_factory.mktemp("packed_cp1")
    # RoPE (megatron-core splits it per CP rank: the adaptation rope_cp_split_on_its_device) and GQA, as the
    # scripts that pack rows under CP have them
    argv = [*_on_demo_data(short_documents), "--data-cache-path", str(folder / "cache"), "--position-embedding-type",
            "rope", "--group-query-attention", "--num-query-groups", "2"]
    return argv, pretrain(folder / "run", *PACKING, "--no-npu-compile", base=argv).check()


@pytest.mark.slow
@pytest.mark.training
@pytest.mark.parametrize("algorithm, compiled, mask_type", [
    pytest.param("ulysses_cp_algo", False, "causal", id="ulysses-eager"),
    # on megatron-core 0.12 the compiled job keeps Megatron's dense mask (gpt.passes_lengths) and the schedule
    # multiplies the loss by CP (versions.loss_times_cp_size): make test-mcore012 runs this one
    pytest.param("ulysses_cp_algo", True, "general", id="ulysses-compiled-general", marks=pytest.mark.megatron_lines),
    # the ring's dense-mask blocks (eager, and compiled on megatron-core 0.12): test_cp_packed_documents.py
    pytest.param("megatron_cp_algo", True, "causal", id="ring-compiled"),
])
def test_packed_rows_at_cp2_equal_cp1(packed_reference, algorithm, compiled, mask_type, tmp_path):
    argv, reference = packed_reference
    flags = [*PACKING, "--context-parallel-size", "2", "--context-parallel-algo", algorithm,
             "--attention-mask-type", mask_type]
    dumps = tmp_path / "dumps"
    flags += ["--npu-compile-options", json.dumps({"dump_dir": str(dumps)})] if compiled else ["--no-npu-compile"]
    run = pretrain(tmp_path / "run", *flags, nproc=2, base=argv).check()
    assert_close(run.losses, reference.losses, what=f"{algorithm} packed lm loss")
    assert_close([r["grad_norm"] for r in run.rows("train")], [r["grad_norm"] for r in reference.rows("train")],
                 what=f"{algorithm} packed grad norm")
    if not compiled:
        return
    for rank in (0, 1):
        reports = [json.loads(p.read_text()) for p in (dumps / f"rank{rank}").glob("*/report.json")]
        assert reports and all(r["graph_breaks"] == 0 for r in reports)
        layer = [r for r in reports if r["lowered_ops"].get("_c10d_functional.all_to_all_single")]
        assert layer, f"rank {rank}: no graph holds the CP all-to-all"
        if algorithm == "ulysses_cp_algo" and megatron_core_in(">=0.13"):
            # the whole rows' documents after the all-to-all: the lengths reach the fused varlen attention
            assert all(r["fusions"].get("varlen_attention") for r in layer)
            assert all(r["lowered_ops"].get("npu_compile.varlen_attention") for r in layer)
        elif algorithm == "ulysses_cp_algo":  # 0.12: the attention fused over the whole rows' dense mask
            assert all(r["fusions"].get("attention") for r in layer)
        assert not any("npu_compile.document_mask" in r["lowered_ops"] for r in reports)
