"""Checkpoints of the training job: Megatron-LM's layout, exact resume, resharding across TP/PP, interrupted saves,
architecture checks."""

from __future__ import annotations

import pytest
import torch

from pretrain_runs import assert_close, pretrain

pytestmark = [pytest.mark.slow, pytest.mark.training]


def _train_rows(run):
    return [(r["iteration"], r["lm loss"], r["grad_norm"]) for r in run.rows("train")]


# TINY runs without dropout (layouts compare with each other); resumes run with it: every dropout mask after the
# resume comes from the RNG state the checkpoint restored, and nothing else may draw from it in between.
DROPOUT = ["--hidden-dropout", "0.1", "--attention-dropout", "0.1"]
# No evaluation after the last iteration where a test compares only training rows: in a compiled job the final
# evaluation compiles its own no-grad graphs, 4-24 s a launch beside other work.
NO_EVAL = ["--eval-iters", "0"]
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
    flags = ["--train-iters", "6", "--save-interval", "3", *NO_EVAL, *DROPOUT, *RESUME_LAYOUTS[layout]]
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
    the RNG state, shaped by the layout, is ignored): iterations 4-6 agree. The TP=2 resume loads into the compiled
    model; the resharded ones run eager (what they check is the load, not the compile: test_pretrain_layouts)."""
    ckpt = tmp_path / "ckpt"
    common = ["--train-iters", "6", "--save-interval", "3", *NO_EVAL]
    whole = pretrain(tmp_path / "tp2", *common, *DROPOUT, "--tensor-model-parallel-size", "2", "--save", str(ckpt),
                     nproc=2).check()
    # as if it had stopped at 3 (test_resume_is_bitwise stops a run): the checkpoint of iteration 3 is the same
    (ckpt / "latest_checkpointed_iteration.txt").write_text("3")
    resumed = {}
    for name, nproc, flags in (("tp2", 2, ["--tensor-model-parallel-size", "2", *DROPOUT]),
                               ("tp1", 1, ["--no-npu-compile"]),
                               ("pp2", 2, ["--pipeline-model-parallel-size", "2", "--no-npu-compile"])):
        run = pretrain(tmp_path / f"resume_{name}", *common, *flags, "--load", str(ckpt), nproc=nproc).check()
        assert "at iteration 3" in run.output
        assert ("RNG state will be ignored" in run.output) == (name != "tp2")
        assert [r["iteration"] for r in run.rows("train")] == [4, 5, 6]
        resumed[name] = run
    assert _train_rows(resumed["tp2"]) == _train_rows(whole)[3:]
    assert_close(resumed["pp2"].losses, resumed["tp1"].losses, what="PP=2 vs TP=1 from a TP=2 checkpoint")
    assert_close([r[2] for r in _train_rows(resumed["pp2"])], [r[2] for r in _train_rows(resumed["tp1"])],
                 what="grad norms, PP=2 vs TP=1 from a TP=2 checkpoint")


# The job with megatron-core's dist_checkpointing.save replaced by one that dies in the DIE_AT_SAVE-th save; a module
# in the launch's folder (first on the path of a `python -m`), so that it starts as the job's other launches do. Its
# main guarded: dist_checkpointing's writer starts a multiprocessing manager by spawn, which imports __main__ again.
INTERRUPT = """
import os, sys

if __name__ == "__main__":
    from megatron.core import dist_checkpointing
    import megatron_glue.training.checkpointing as ckpt

    real_save, calls = dist_checkpointing.save, []
    def save(state, folder, **kw):
        calls.append(folder)
        if len(calls) == int(os.environ["DIE_AT_SAVE"]):  # this save dies after writing part of its folder
            open(folder + "/__0_0.distcp", "wb").write(b"partial")
            raise KeyboardInterrupt("killed during the save of " + folder)
        return real_save(state, folder, **kw)
    dist_checkpointing.save = save
    from megatron_glue.pretrain_gpt import main
    sys.exit(main(sys.argv[1:]))
"""


def _interrupted(monkeypatch, folder, *flags, die_at: int):
    monkeypatch.setenv("DIE_AT_SAVE", str(die_at))  # pretrain_runs.env() passes the environment on
    folder.mkdir(parents=True)
    (folder / "die_at_save.py").write_text(INTERRUPT)
    return pretrain(folder, *flags, module="die_at_save")


def test_interrupted_save_keeps_the_last_complete_checkpoint(tmp_path, monkeypatch):
    """A save that dies leaves the tracker and every iter_* folder as they were: its files are in
    .iter_XXXXXXX.incomplete, which the next save removes; a committed iteration saved again (a resumed job's last
    save of the iteration it loaded) is replaced only once the new folder is complete, and where the save died
    with it moved aside, the next load puts it back. Eager: the checkpoint's files are what it looks at."""
    ckpt = tmp_path / "ckpt"
    flags = ["--train-iters", "6", "--save-interval", "2", "--save", str(ckpt), "--no-npu-compile", *NO_EVAL]
    died = _interrupted(monkeypatch, tmp_path / "a", *flags, die_at=2)
    assert died.returncode != 0 and "killed during the save of" in died.output
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "2"
    assert sorted(p.name for p in ckpt.iterdir()) == [".iter_0000004.incomplete", "iter_0000002",
                                                      "latest_checkpointed_iteration.txt"]
    assert (ckpt / ".iter_0000004.incomplete" / "__0_0.distcp").read_bytes() == b"partial"

    again = pretrain(tmp_path / "b", *flags, "--load", str(ckpt)).check()
    assert "at iteration 2" in again.output
    assert [r["iteration"] for r in again.rows("train")] == [3, 4, 5, 6]
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "6"
    assert sorted(p.name for p in ckpt.iterdir()) == ["iter_0000002", "iter_0000004", "iter_0000006",
                                                      "latest_checkpointed_iteration.txt"]

    # loaded at 6 with nothing left to train: the job saves iteration 6 again (6 is no multiple of 4), and dies
    resave = _interrupted(monkeypatch, tmp_path / "c", "--train-iters", "6", "--save-interval", "4",
                          "--save", str(ckpt), "--load", str(ckpt), "--no-npu-compile", *NO_EVAL, die_at=1)
    assert resave.returncode != 0 and "killed during the save of" in resave.output
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "6"
    assert (ckpt / "iter_0000006" / "metadata.json").is_file()  # the committed iteration 6, whole
    assert (ckpt / ".iter_0000006.incomplete").is_dir()
    # a save that died between its two renames: the committed folder moved aside, the new one not yet in its place
    (ckpt / "iter_0000006").rename(ckpt / ".iter_0000006.replaced")
    last = pretrain(tmp_path / "d", "--train-iters", "6", "--load", str(ckpt), "--no-npu-compile", *NO_EVAL).check()
    assert f"{ckpt}/iter_0000006 restored from .iter_0000006.replaced" in last.output
    assert f"successfully loaded checkpoint from {ckpt} [ t 1/1, p 1/1 ] at iteration 6" in last.output


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


@pytest.mark.megatron_lines  # the distributed optimizer's parameter state: megatron-core's own, per line
def test_torch_format_with_distributed_optimizer_resumes_bitwise(tmp_path):
    """--ckpt-format torch --use-distributed-optimizer at DP=2 (45 of 48 of MindSpeed-LLM's pretraining scripts):
    Megatron-LM's legacy layout, mp_rank_00/model_optim_rng.pt with the optimizer's state_dict() and distrib_optim.pt
    beside it (the DP shards gathered to DP rank 0 by megatron-core's save_parameter_state); resumed at iteration 3
    (load_parameter_state scatters them back), iterations 4-6 bitwise those of the run that went on, dropout on;
    loaded at DP=1, the same optimizer state; loaded without the distributed optimizer, refused."""
    ckpt = tmp_path / "ckpt"
    flags = ["--train-iters", "6", "--save-interval", "3", "--use-distributed-optimizer", "--ckpt-format", "torch",
             *NO_EVAL, *DROPOUT]
    whole = pretrain(tmp_path / "whole", *flags, "--save", str(ckpt), nproc=2).check()
    assert sorted(p.name for p in ckpt.iterdir()) == ["iter_0000003", "iter_0000006",
                                                      "latest_checkpointed_iteration.txt"]
    for folder in ("iter_0000003", "iter_0000006"):  # one (TP, PP) rank: one folder, DP rank 0's two files
        assert sorted(str(p.relative_to(ckpt / folder)) for p in (ckpt / folder).rglob("*")) == [
            "mp_rank_00", "mp_rank_00/distrib_optim.pt", "mp_rank_00/model_optim_rng.pt"]
    model = torch.load(ckpt / "iter_0000003" / "mp_rank_00" / "model_optim_rng.pt", weights_only=False)
    assert model["iteration"] == 3 and model["args"]["use_distributed_optimizer"] is True
    # DistributedOptimizer.state_dict(): the param groups without the parameter state, which is in distrib_optim.pt
    assert "state" not in model["optimizer"]["optimizer"] and model["optimizer"]["optimizer"]["param_groups"]
    param_state = torch.load(ckpt / "iter_0000003" / "mp_rank_00" / "distrib_optim.pt")
    words = sum(t.numel() for d in param_state[0].values() if isinstance(d, dict)
                for k, t in d.items() if k == "param")
    assert words == sum(t.numel() for t in model["model"].values() if isinstance(t, torch.Tensor))  # every DP shard

    (ckpt / "latest_checkpointed_iteration.txt").write_text("3")  # as if it had stopped at 3
    resumed = pretrain(tmp_path / "resumed", *flags, "--load", str(ckpt), nproc=2).check()
    assert f"successfully loaded checkpoint from {ckpt} [ t 1/1, p 1/1 ] at iteration 3" in resumed.output
    assert [r["iteration"] for r in resumed.rows("train")] == [4, 5, 6]
    assert _train_rows(resumed) == _train_rows(whole)[3:]

    # at DP=1 (one process, eager): megatron-core scatters the gathered state to the DP ranks there are; saved
    # again at once (iteration 3, no step between), it is the same state
    flags = ["--ckpt-format", "torch", "--no-npu-compile", "--eval-iters", "0", "--load", str(ckpt)]
    pretrain(tmp_path / "dp1", "--train-iters", "3", "--save-interval", "4", "--use-distributed-optimizer", *flags,
             "--save", str(tmp_path / "dp1" / "ckpt")).check()
    again = torch.load(tmp_path / "dp1" / "ckpt" / "iter_0000003" / "mp_rank_00" / "distrib_optim.pt")
    assert again.keys() == param_state.keys() and again[0].keys() == param_state[0].keys()
    for key, saved in param_state[0].items():
        assert saved.keys() == again[0][key].keys() == {"param", "exp_avg", "exp_avg_sq", "numel_unpadded"}
        assert all(torch.equal(saved[k], again[0][key][k]) for k in ("param", "exp_avg", "exp_avg_sq"))
    # the other optimizer cannot take this state: refused at the load, naming both ways out
    other = pretrain(tmp_path / "plain", "--train-iters", "4", *flags)
    assert other.returncode == 1
    assert (f"pretrain_gpt: error: {ckpt}/iter_0000003 was saved with --use-distributed-optimizer, this job runs "
            "without it: the optimizer state is in the other's form; run with --use-distributed-optimizer, or load "
            "the weights alone with --no-load-optim") in other.output


def test_uneven_stages_resume_in_the_legacy_layout(tmp_path):
    """--num-layer-list 1,3 at PP=2 with --ckpt-format torch: each stage's file holds its own layers
    (mp_rank_00_000: one, mp_rank_00_001: three), resumed bit for bit (eager, 2 processes). A job of other stages
    is refused at the load, naming both: test_convert_legacy."""
    common = ["--num-layers", "4", "--pipeline-model-parallel-size", "2", "--num-layer-list", "1,3", "--train-iters",
              "4", "--save-interval", "2", "--ckpt-format", "torch", "--no-npu-compile"]
    whole = pretrain(tmp_path / "whole", *common, "--save", str(tmp_path / "whole" / "ckpt"), nproc=2).check()
    ckpt = tmp_path / "parts" / "ckpt"
    pretrain(tmp_path / "parts", *common, "--save", str(ckpt), "--exit-interval", "2", nproc=2).check()
    layers = {stage: {k.split(".")[2] for k in torch.load(ckpt / "iter_0000002" / f"mp_rank_00_00{stage}" /
                                                             "model_optim_rng.pt", weights_only=False)["model"]
                      if k.startswith("decoder.layers.")} for stage in (0, 1)}
    assert layers == {0: {"0"}, 1: {"0", "1", "2"}}
    second = pretrain(tmp_path / "parts", *common, "--save", str(ckpt), "--load", str(ckpt), nproc=2).check()
    assert _train_rows(second) == _train_rows(whole)  # the metrics file holds both launches' rows


@pytest.mark.parametrize("reuse", [[], ["--use-distributed-optimizer", "--reuse-fp32-param"]], ids=["plain", "reuse"])
def test_bf16_weights_loaded_without_the_optimizer_reach_the_master_weights(reuse, tmp_path):
    """--bf16 keeps fp32 master weights in the optimizer, made from the model when the optimizer is built, before
    the load: a load without optimizer state (--finetune, --no-load-optim, HF weights at start) copies the loaded
    weights into them, as Megatron-LM does. With --lr 0 the step leaves the masters as they are, so the validation
    loss after one step is the saved model's, bit for bit (without the copy: the random initial weights'). The
    same path serves --no-load-optim."""
    ckpt = tmp_path / "ckpt"
    common = ["--bf16", "--eval-iters", "1", *reuse]
    saved = pretrain(tmp_path / "a", *common, "--train-iters", "3", "--eval-interval", "3", "--save", str(ckpt)).check()
    loaded = pretrain(tmp_path / "b", *common, "--train-iters", "1", "--eval-interval", "1", "--lr", "0",
                      "--min-lr", "0", "--load", str(ckpt), "--finetune").check()
    assert "successfully loaded checkpoint" in loaded.output
    assert loaded.rows("validation")[0]["lm loss"] == saved.rows("validation")[-1]["lm loss"]
