"""Checkpoints of the training job: Megatron-LM's layout, exact resume, resharding across TP/PP, interrupted saves,
architecture checks."""

from __future__ import annotations

import sys

import pytest

from pretrain_runs import assert_close, pretrain

pytestmark = [pytest.mark.slow, pytest.mark.training]


def _train_rows(run):
    return [(r["iteration"], r["lm loss"], r["grad_norm"]) for r in run.rows("train")]


# TINY runs without dropout (layouts compare with each other); resumes run with it: every dropout mask after the
# resume comes from the RNG state the checkpoint restored, and nothing else may draw from it in between.
DROPOUT = ["--hidden-dropout", "0.1", "--attention-dropout", "0.1"]
RESUME_LAYOUTS = {
    "dp2_distopt_overlap": ["--use-distributed-optimizer", "--overlap-grad-reduce"],
    "pp2": ["--pipeline-model-parallel-size", "2"],  # each stage its own seed, its own RNG state in the checkpoint
}


# megatron_lines: the distributed optimizer's sharded state (versions.optimizer_sharded_state_dict) differs by line
@pytest.mark.parametrize("layout", [pytest.param(n, marks=[pytest.mark.megatron_lines] if n.startswith("dp2") else [])
                                    for n in RESUME_LAYOUTS])
def test_resume_is_bitwise(layout, tmp_path):
    """6 iterations in one go == 3, stop, load iteration 3, 3 more: losses and grad norms of 4-6 identical, dropout
    on. Compiled, 2 processes (TP=2: test_tp2_checkpoint_loads_at_tp1_and_pp2)."""
    flags = ["--train-iters", "6", "--save-interval", "3", *DROPOUT, *RESUME_LAYOUTS[layout]]
    whole = pretrain(tmp_path / "whole", *flags, "--save", str(tmp_path / "whole" / "ckpt"), nproc=2).check()
    ckpt = tmp_path / "parts" / "ckpt"
    first = pretrain(tmp_path / "parts", *flags, "--save", str(ckpt), "--exit-interval", "3", nproc=2).check()
    assert "exiting program at iteration 3" in first.output
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "3"
    assert (ckpt / "iter_0000003").is_dir() and not (ckpt / "iter_0000006").exists()
    second = pretrain(tmp_path / "parts", *flags, "--save", str(ckpt), "--load", str(ckpt), nproc=2).check()
    assert f"successfully loaded checkpoint from {ckpt} [ t 1/1, p 1/" in second.output
    assert "at iteration 3" in second.output and "RNG state will be ignored" not in second.output

    resumed = _train_rows(second)  # the JSONL of the folder holds both parts: 1-3, then 4-6
    assert [r[0] for r in resumed] == list(range(1, 7))
    assert resumed == _train_rows(whole)
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "6"


def test_tp2_checkpoint_loads_at_tp1_and_pp2(tmp_path):
    """Saved at TP=2 after 3 of 6 iterations; resumed at TP=2 with dropout on, bit for bit with the run that went
    on; resumed at TP=1 and PP=2 without dropout (model, optimizer and scheduler resharded by dist_checkpointing;
    the RNG state, shaped by the layout, is ignored): iterations 4-6 agree."""
    ckpt = tmp_path / "ckpt"
    common = ["--train-iters", "6", "--save-interval", "3"]
    whole = pretrain(tmp_path / "tp2", *common, *DROPOUT, "--tensor-model-parallel-size", "2", "--save", str(ckpt),
                     nproc=2).check()
    # as if it had stopped at 3 (test_resume_is_bitwise stops a run): the checkpoint of iteration 3 is the same
    (ckpt / "latest_checkpointed_iteration.txt").write_text("3")
    resumed = {}
    for name, nproc, flags in (("tp2", 2, ["--tensor-model-parallel-size", "2", *DROPOUT]), ("tp1", 1, []),
                               ("pp2", 2, ["--pipeline-model-parallel-size", "2"])):
        run = pretrain(tmp_path / f"resume_{name}", *common, *flags, "--load", str(ckpt), nproc=nproc).check()
        assert "at iteration 3" in run.output
        assert ("RNG state will be ignored" in run.output) == (name != "tp2")
        assert [r["iteration"] for r in run.rows("train")] == [4, 5, 6]
        resumed[name] = run
    assert _train_rows(resumed["tp2"]) == _train_rows(whole)[3:]
    assert_close(resumed["pp2"].losses, resumed["tp1"].losses, what="PP=2 vs TP=1 from a TP=2 checkpoint")
    assert_close([r[2] for r in _train_rows(resumed["pp2"])], [r[2] for r in _train_rows(resumed["tp1"])],
                 what="grad norms, PP=2 vs TP=1 from a TP=2 checkpoint")


INTERRUPT = """
import sys
from megatron.core import dist_checkpointing
import megatron_glue.training.checkpointing as ckpt

real_save, calls = dist_checkpointing.save, []
def save(state, folder, **kw):
    calls.append(folder)
    if len(calls) == 2:  # the second save dies after writing part of its folder
        open(folder + "/__0_0.distcp", "wb").write(b"partial")
        raise KeyboardInterrupt("killed during the save of " + folder)
    return real_save(state, folder, **kw)
dist_checkpointing.save = save
from megatron_glue.pretrain_gpt import main
sys.exit(main(sys.argv[1:]))
"""


def test_interrupted_save_keeps_the_last_complete_checkpoint(tmp_path):
    ckpt = tmp_path / "ckpt"
    flags = ["--train-iters", "6", "--save-interval", "2", "--save", str(ckpt)]
    died = pretrain(tmp_path / "a", *flags, prefix=[sys.executable, "-c", INTERRUPT])
    assert died.returncode != 0 and "killed during the save of" in died.output
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "2"
    assert (ckpt / "iter_0000004").is_dir()  # the broken folder is there, but nothing points at it

    again = pretrain(tmp_path / "b", *flags, "--load", str(ckpt)).check()
    assert "at iteration 2" in again.output
    assert [r["iteration"] for r in again.rows("train")] == [3, 4, 5, 6]
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "6"
    partial = ckpt / "iter_0000004" / "__0_0.distcp"
    assert not partial.exists() or partial.read_bytes() != b"partial"  # the folder was written anew


def test_architecture_mismatch_is_refused(tmp_path):
    ckpt = tmp_path / "ckpt"
    pretrain(tmp_path / "a", "--train-iters", "1", "--save", str(ckpt), "--no-npu-compile").check()
    run = pretrain(tmp_path / "b", "--train-iters", "2", "--load", str(ckpt), "--hidden-size", "32",
                   "--no-npu-compile")
    assert run.returncode == 1
    assert (f"pretrain_gpt: error: the checkpoint at {ckpt}/iter_0000001 was saved with --hidden-size 64, this "
            "job has 32; use the checkpoint's value") in run.output


def test_torch_format_resumes_exactly(tmp_path):
    """--ckpt-format torch: Megatron-LM's mp_rank_XX/model_optim_rng.pt, resumed bit for bit (eager)."""
    common = ["--train-iters", "4", "--save-interval", "2", "--ckpt-format", "torch", "--no-npu-compile"]
    whole = pretrain(tmp_path / "whole", *common, "--save", str(tmp_path / "whole" / "ckpt")).check()
    ckpt = tmp_path / "parts" / "ckpt"
    pretrain(tmp_path / "parts", *common, "--save", str(ckpt), "--exit-interval", "2").check()
    assert (ckpt / "iter_0000002" / "mp_rank_00" / "model_optim_rng.pt").is_file()
    second = pretrain(tmp_path / "parts", *common, "--save", str(ckpt), "--load", str(ckpt)).check()
    assert _train_rows(second) == _train_rows(whole)
