"""MoE layers at --context-parallel-size 2 over 2 gloo processes (EP 1): megatron-core folds CP into the expert
data-parallel group and reduces the router's load-balancing statistics over TP x CP; lm loss and gradient norms
equal to one process at CP 1 (fp32, 1e-5)."""

from __future__ import annotations

import pytest

from megatron_glue.capture.adaptations import megatron_core_in
from pretrain_runs import assert_close, pretrain

# with a load-balancing loss where megatron-core scales its gradient by CP (0.13 on; 0.12 refuses it under CP:
# test_cp_packed_documents.py)
AUX = "0.01" if megatron_core_in(">=0.13") else "0"
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32", "--moe-aux-loss-coeff", AUX,
       "--train-iters", "2", "--eval-iters", "0", "--position-embedding-type", "rope", "--disable-bias-linear",
       "--normalization", "RMSNorm", "--swiglu"]


@pytest.fixture(scope="module")
def moe_reference(tmp_path_factory):
    return pretrain(tmp_path_factory.mktemp("moe_cp1"), *MOE, "--no-npu-compile").check()


@pytest.mark.slow
@pytest.mark.training
def test_moe_at_cp2_equals_cp1(moe_reference, tmp_path):
    """Eager in the suite; compiled, the same run gave the same equality by hand (~100 s on 2 shared cores, over
    this suite's budget): docs/context_parallel.md."""
    flags = [*MOE, "--context-parallel-size", "2", "--no-npu-compile"]
    run = pretrain(tmp_path / "run", *flags, nproc=2).check()
    assert_close(run.losses, moe_reference.losses, what="MoE at CP 2 lm loss")
    assert_close([r["grad_norm"] for r in run.rows("train")], [r["grad_norm"] for r in moe_reference.rows("train")],
                 what="MoE at CP 2 grad norm")
