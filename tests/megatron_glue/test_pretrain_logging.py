"""What the training job tells its user beside the iteration lines: Megatron-LM's start-of-job arguments dump and
parameter counts, and its TensorBoard scalars (`--tensorboard-dir`), read back with TensorBoard's own
EventAccumulator and compared with the job's metrics JSONL and log lines."""

from __future__ import annotations

import math
import os
import re

import pytest

from pretrain_runs import pretrain

pytestmark = [pytest.mark.training]

ITERS = 4


def _scalars(folder):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder), size_guidance={"scalars": 0}).Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def _close(a: float, b: float) -> bool:  # TensorBoard keeps float32
    return math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-12)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tb_run")
    return pretrain(folder, "--train-iters", str(ITERS), "--eval-interval", "2", "--tensorboard-dir",
                    str(folder / "tb"), "--log-throughput", "--log-timers-to-tensorboard",
                    "--log-validation-ppl-to-tensorboard", "--log-world-size-to-tensorboard",
                    "--log-memory-to-tensorboard", "--no-npu-compile", nproc=2).check()


def test_tensorboard_scalars_are_megatron_lms_and_equal_the_log(run):
    scalars = _scalars(run.folder / "tb")
    train = run.rows("train")
    steps = list(range(1, ITERS + 1))
    samples = [8 * i for i in steps]  # --global-batch-size 8
    for tag, key in (("lm loss", "lm loss"), ("learning-rate", "lr"), ("grad-norm", "grad_norm"),
                     ("loss-scale", "loss_scale")):
        assert [s for s, _ in scalars[tag]] == steps, tag
        assert all(_close(v, r[key]) for (_, v), r in zip(scalars[tag], train)), (tag, scalars[tag], train)
        assert [s for s, _ in scalars[f"{tag} vs samples"]] == samples, tag
        assert [v for _, v in scalars[f"{tag} vs samples"]] == [v for _, v in scalars[tag]], tag
    assert scalars["batch-size"] == [(i, 8.0) for i in steps]
    assert scalars["world-size"] == [(i, 2.0) for i in steps]
    assert [s for s, _ in scalars["mem-max-allocated-bytes"]] == steps
    # the monitor's utilization samples of the writing rank's process (the JSONL has rank 0's), at the iterations
    # that had a sample (one each 0.5 s)
    assert all(s in steps and 0 <= v <= 100 * os.cpu_count() for s, v in scalars.get("cpu-utilization", []))

    # each --log-interval: the seconds per iteration, and the throughput the iteration line prints
    printed = [float(x) for x in re.findall(r"throughput per GPU \(TFLOP/s/GPU\): ([\d.]+) \|", run.output)]
    assert [s for s, _ in scalars["iteration-time"]] == steps and len(printed) == ITERS
    assert all(v > 0 for _, v in scalars["iteration-time"])
    assert [s for s, _ in scalars["throughput"]] == steps
    assert [round(v, 1) for _, v in scalars["throughput"]] == printed

    # evaluations: at iteration 2 (--eval-interval) and the final validation and test at 4, under one tag
    valid = [(r["iteration"], r["lm loss"]) for r in run.rows("validation") + run.rows("test")]
    assert [s for s, _ in scalars["lm loss validation"]] == [2, 4, 4]
    assert all(s == i and _close(v, want) for (s, v), (i, want) in zip(scalars["lm loss validation"], valid))
    assert all(_close(v, math.exp(loss)) for (_, v), (_, loss) in zip(scalars["lm loss validation ppl"], valid))


def test_megatron_lms_start_of_job_lines(run):
    """The arguments dump (`_print_args`) and each model-parallel rank's parameter count (`get_model`), printed as
    Megatron-LM prints them, from which its log parsers read the run's settings and model size."""
    out = run.output
    dump = out[out.index("------------------------ arguments ------------------------\n"):
               out.index("-------------------- end of arguments ---------------------\n")].splitlines()[1:]
    rows = dict(re.fullmatch(r"  (\S+) \.+ (.*)", line).groups() for line in dump)
    assert (rows["num_layers"], rows["hidden_size"], rows["tensorboard_dir"], rows["world_size"]) == (
        "2", "64", str(run.folder / "tb"), "2")
    names = [line.split(" ")[2] for line in dump]
    assert names == sorted(names, key=str.lower)
    assert all(line.startswith(f"  {name} {'.' * (48 - len(name))} ") for name, line in zip(names, dump))
    # one process a DP rank (TP = PP = 1): the count printed by DP rank 0 only; h=64, 2 layers, vocabulary 512
    counts = re.findall(r"^ > number of parameters on \(tensor, pipeline\) model parallel rank \((\d+), (\d+)\): "
                        r"(\d+)$", out, re.M)
    layer = 4 * 64 * 64 + 4 * 64 + 2 * 4 * 64 * 64 + 4 * 64 + 64 + 4 * 64  # qkv+proj, their biases, fc1+fc2, norms
    assert counts == [("0", "0", str(512 * 64 + 32 * 64 + 2 * layer + 2 * 64))]
