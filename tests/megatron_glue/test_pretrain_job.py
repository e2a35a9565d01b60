"""The training job as users run it: the seed's script with one word changed, mixed precision, log lines, and
bad input answered with one line naming the fix."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_glue.training.arguments import ArgumentError, parse_args
from pretrain_runs import TINY, env, pretrain

FIXTURES = Path(__file__).parent / "fixtures"
ITERATION_LINE = re.compile(
    r"^ iteration +(\d+)/ +(\d+) \| consumed samples: +\d+ \| elapsed time per iteration \(ms\): [\d.]+ \| "
    r"learning rate: [\d.]+E[-+]\d+ \| global batch size: +\d+ \|( lm loss: [\d.]+E[-+]\d+ \|)? "
    r"loss scale: [\d.]+ \|( grad norm: [\d.]+ \|)? number of skipped iterations: +(\d+) \| "
    r"number of nan iterations: +\d+ \| tokens per second: [\d.]+ \| peak memory \(MB\): [\d.]+ \|$", re.M)
VALIDATION_LINE = re.compile(r"^ validation loss at iteration (\d+)( on (validation|test) set)? \| "
                             r"lm loss value: ([\d.]+E[-+]\d+) \| lm loss PPL: [\d.]+E[-+]\d+ \| $", re.M)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def demo_data(tmp_path_factory):
    from megatron_glue.data.demo_data import make_demo_data

    return make_demo_data(str(tmp_path_factory.mktemp("demo_data")))


@pytest.mark.slow
@pytest.mark.training
def test_seed_script_runs_with_one_word_changed(demo_data, tmp_path):
    script = (FIXTURES / "seed_pretrain_gpt.sh").read_text()
    assert "-m megatron_glue.pretrain_gpt" in script and "pretrain_gpt.py" not in script.split("set -euo")[1]
    ckpt = tmp_path / "ckpt"
    run_env = dict(env(), PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
                   NPUS_PER_NODE="2", NNODES="1", NODE_RANK="0", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(_free_port()), DATA_PATH=demo_data["data_prefix"],
                   VOCAB_FILE=demo_data["vocab_file"], MERGE_FILE=demo_data["merge_file"], CKPT_DIR=str(ckpt))
    done = subprocess.run(["bash", str(FIXTURES / "seed_pretrain_gpt.sh")], cwd=tmp_path, env=run_env,
                          capture_output=True, text=True, timeout=600)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-6000:]
    # nothing of ours warns: no warning raised from the project's files, megatron-core's rerun state machine set up
    # as Megatron-LM sets it up (implicitly, it warns)
    assert not re.findall(r"(?:npu_compile|megatron_glue)/\S+\.py:\d+: \w*Warning.*", out)
    assert "Implicit initialization of Rerun State Machine" not in out

    lines = ITERATION_LINE.findall(out)
    assert [int(it) for it, *_ in lines] == list(range(2, 21, 2))  # --log-interval 2, rank 0 only
    # fp16 from Megatron-LM's default scale 2^32: the first steps overflow and are skipped, then it trains
    skipped = sum(int(s) for *_, s in lines)
    assert 5 <= skipped < 20
    trained = [float(loss.split(": ")[1].rstrip(" |")) for _, _, loss, _, _ in lines if loss]
    assert len(trained) >= 2 and trained[-1] < trained[0]
    validation = {(int(it), where): float(v) for it, _, where, v in VALIDATION_LINE.findall(out)}
    assert set(validation) == {(10, ""), (20, "validation"), (20, "test")}
    assert validation[20, "validation"] < validation[10, ""]  # the loss falls
    for it in (10, 20):
        assert f" successfully saved checkpoint from iteration {it:7d} to {ckpt} [ t 1/1, p 1/1 ]" in out
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "20"
    assert (ckpt / "iter_0000020").is_dir() and (ckpt / "loss_curve.png").stat().st_size > 1000
    assert (ckpt / "metrics.jsonl").is_file()


# The mixed precision runs look at the training rows only: no evaluation after the last iteration (compiled, its
# no-grad graphs cost 4-24 s a launch beside other work).
NO_EVAL = ["--eval-iters", "0"]


@pytest.mark.slow
@pytest.mark.training
@pytest.mark.parametrize("precision", ["--bf16", "--fp16"])
def test_mixed_precision_trains(precision, tmp_path):
    run = pretrain(tmp_path, precision, "--initial-loss-scale", "4096", "--train-iters", "12", "--lr", "3e-3",
                   *NO_EVAL).check()
    losses = run.losses
    assert len(losses) == 12 and not any(r["skipped"] for r in run.rows("train"))
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.2  # the loss falls


@pytest.mark.slow
@pytest.mark.training
def test_fp16_absurd_loss_scale_skips_then_trains(tmp_path):
    run = pretrain(tmp_path, "--fp16", "--initial-loss-scale", "16777216", "--train-iters", "20", "--lr", "3e-3",
                   "--log-interval", "5", *NO_EVAL).check()
    rows = run.rows("train")
    skipped = [r["iteration"] for r in rows if r["skipped"]]
    overflowing = next(i for i, r in enumerate(rows) if not r["skipped"])  # the first steps overflow...
    assert overflowing >= 3 and skipped[:overflowing] == list(range(1, overflowing + 1))
    assert len(skipped) - overflowing <= 2  # ...then it trains (an overflow now and then lowers the scale again)
    scales = [r["loss_scale"] for r in rows]
    assert scales[-1] < 16777216 / 8 and scales == sorted(scales, reverse=True)
    trained = [r["lm loss"] for r in rows if not r["skipped"]]
    assert len(trained) >= 8 and sum(trained[-3:]) < sum(trained[:3])
    logged = [int(s) for *_, s in ITERATION_LINE.findall(run.output)]
    assert sum(logged) == len(skipped) and logged[0] > 0
    assert run.rows("end")[0]["skipped_iterations"] == len(skipped)


# -- bad input ------------------------------------------------------------------------------------------------------

def _parse_error(argv, world_size=1) -> str:
    with pytest.raises(ArgumentError) as info:
        parse_args(argv, world_size=world_size)
    assert info.value.code == 2
    return info.value.message


def test_unknown_flag():
    assert _parse_error([*TINY, "--train-iters", "5", "--no-such-flag"]) == (
        "python -m megatron_glue.pretrain_gpt: error: --no-such-flag: unrecognized (not a flag of Megatron-LM, "
        "MindSpeed or MindSpeed-LLM that this job knows)")


def test_megatron_flag_not_implemented():
    assert _parse_error([*TINY, "--train-iters", "5", "--train-samples", "100"]) == (
        "python -m megatron_glue.pretrain_gpt: error: --train-samples: sample-based training is not implemented "
        "here; give --train-iters")


def test_tensor_parallel_size_must_divide_world():
    assert _parse_error([*TINY, "--train-iters", "5", "--tensor-model-parallel-size", "2"], world_size=3) == (
        "pretrain_gpt: error: world size 3 is not divisible by --tensor-model-parallel-size 2 x "
        "--pipeline-model-parallel-size 1; use sizes whose product divides 3")


def test_global_batch_must_divide_by_micro_batch_times_dp():
    assert _parse_error([*TINY, "--train-iters", "5", "--global-batch-size", "6"], world_size=2) == (
        "pretrain_gpt: error: --global-batch-size 6 is not divisible by --micro-batch-size 2 x data-parallel "
        "size 2; use a multiple of 4")


def test_warmup_must_end_before_decay():
    assert _parse_error([*TINY, "--train-iters", "5", "--lr-warmup-iters", "5"]) == (
        "pretrain_gpt: error: --lr-warmup-iters 5 must be below --lr-decay-iters 5 (default --train-iters); warm up "
        "for fewer iterations")
    assert parse_args([*TINY, "--train-iters", "5", "--lr-warmup-iters", "4"]).lr_warmup_iters == 4


def test_default_ffn_hidden_size_is_megatron_lms():
    """Megatron-LM's validate_args: 4 x hidden; with --swiglu int((4h x 2/3) / 64) x 64, rounded down, so that a
    Megatron-LM checkpoint of a SwiGLU model trained without --ffn-hidden-size loads (hidden 4096: 10880)."""
    def ffn(hidden, *flags):
        return parse_args([*TINY, "--train-iters", "5", "--hidden-size", str(hidden), *flags]).ffn_hidden_size

    assert [ffn(h, "--swiglu") for h in (4096, 5120, 64)] == [10880, 13632, 128]
    assert ffn(4096) == 16384
    assert _parse_error([*TINY, "--train-iters", "5", "--hidden-size", "16", "--swiglu"]) == (
        "pretrain_gpt: error: --swiglu with --hidden-size 16 gives Megatron-LM's default --ffn-hidden-size 0 (8/3 x "
        "hidden rounded down to a multiple of 64); give --ffn-hidden-size")
    assert ffn(16, "--swiglu", "--ffn-hidden-size", "48") == 48


def test_train_iters_and_data_are_required():
    flags = [f for f in TINY if f != "--mock-data"]
    assert _parse_error(flags) == ("pretrain_gpt: error: --train-iters is required: the number of iterations to "
                                   "train (with --skip-train, 0 is fine)")
    assert _parse_error([*flags, "--train-iters", "5"]).startswith("pretrain_gpt: error: --data-path is required")


def test_mindspeed_switches_name_fusions():
    args = parse_args([*TINY, "--train-iters", "5", "--use-flash-attn", "--use-fused-rmsnorm", "--npu-compile-options",
                       '{"fusions": ["swiglu"]}'])
    assert args.npu_compile_options == {"fusions": ["swiglu", "attention", "add_rms_norm", "rms_norm"]}
    assert parse_args([*TINY, "--train-iters", "5", "--use-flash-attn"]).npu_compile_options == {}  # all on already
    assert _parse_error([*TINY, "--train-iters", "5", "--npu-compile-options", "[1]"]).endswith(
        "argument --npu-compile-options: needs a JSON object like '{\"dump_dir\": \"dumps\"}', got '[1]'")
    # the backend's own check, with the other flags, before any model is built
    assert _parse_error([*TINY, "--train-iters", "5", "--npu-compile-options", '{"budget": 0.5}']) == (
        "pretrain_gpt: error: --npu-compile-options: unknown npu_compile option(s) 'budget'; valid options are "
        "target, graph_mode, fusions, memory_budget, device_memory, resident_memory, activation_copies, recompute, "
        "offload, overlap, "
        "mc2, dump_dir, verify, fast_gelu, cache, pattern_cache, torchair_check")


def test_use_ascend_mc2_is_mc2_on_and_needs_sequence_parallel_at_tp_above_1():
    tp2 = [*TINY, "--train-iters", "5", "--tensor-model-parallel-size", "2"]
    sim = ["--npu-compile-options", '{"target": "npu-sim"}']  # MC2 ops on the CPU (no torch_npu here)
    # MindSpeed's meaning: every TP linear's all-gather + matmul and matmul + reduce-scatter as an MC2 op
    assert parse_args([*tp2, "--sequence-parallel", "--use-ascend-mc2", *sim], world_size=2).npu_compile_options == {
        "target": "npu-sim", "mc2": "on"}
    assert parse_args([*tp2, "--sequence-parallel", "--use-ascend-mc2", "--npu-compile-options",
                       '{"target": "npu-sim", "overlap": false}'], world_size=2).npu_compile_options == {
        "target": "npu-sim", "overlap": False, "mc2": "on"}
    assert parse_args([*tp2, "--sequence-parallel"], world_size=2).npu_compile_options == {}  # mc2 stays "auto"
    assert parse_args([*tp2, "--npu-compile-options", '{"mc2": "off"}'], world_size=2).npu_compile_options == {
        "mc2": "off"}
    # refused as MindSpeed refuses it: without sequence parallelism, or at TP 1
    assert _parse_error([*tp2, "--use-ascend-mc2"], world_size=2) == (
        "pretrain_gpt: error: --use-ascend-mc2 needs --sequence-parallel and --tensor-model-parallel-size > 1 (got "
        "no --sequence-parallel, TP 2): MC2 fuses the all-gather + matmul and matmul + reduce-scatter that sequence "
        "parallelism puts around the tensor-parallel linears (MindSpeed refuses this combination too)")
    assert _parse_error([*TINY, "--train-iters", "5", "--sequence-parallel", "--use-ascend-mc2"]) == (
        "pretrain_gpt: error: --use-ascend-mc2 needs --sequence-parallel and --tensor-model-parallel-size > 1 (got "
        "--sequence-parallel, TP 1): MC2 fuses the all-gather + matmul and matmul + reduce-scatter that sequence "
        "parallelism puts around the tensor-parallel linears (MindSpeed refuses this combination too)")
    assert _parse_error([*tp2, "--sequence-parallel", "--use-ascend-mc2", "--npu-compile-options", '{"mc2": "off"}'],
                        world_size=2) == (
        "pretrain_gpt: error: --use-ascend-mc2 sets npu_compile option mc2='on', but --npu-compile-options gives "
        "mc2='off'; drop one of them")
    # never a silent no-op: eager, or a target without MC2 ops
    assert _parse_error([*tp2, "--sequence-parallel", "--use-ascend-mc2", "--no-npu-compile"], world_size=2) == (
        "pretrain_gpt: error: --use-ascend-mc2 is done by the compiler (option mc2='on'), which --no-npu-compile "
        "turns off; drop one of them")
    def reference(why):
        return ("pretrain_gpt: error: --use-ascend-mc2 makes MC2 ops, which only the npu and npu-sim targets have; "
                f"this job compiles for target 'reference' ({why}); to run them on the CPU, give "
                "--npu-compile-options '{\"target\": \"npu-sim\"}'")

    assert _parse_error([*tp2, "--sequence-parallel", "--use-ascend-mc2"], world_size=2) == reference(
        "auto: no usable torch_npu here")
    assert _parse_error([*tp2, "--sequence-parallel", "--use-ascend-mc2", "--npu-compile-options",
                         '{"target": "reference"}'], world_size=2) == reference("as --npu-compile-options says")


def _one_line_failure(run, code: int) -> str:
    assert run.returncode == code, run.output[-4000:]
    assert "Traceback" not in run.output, run.output[-4000:]
    errors = [line for line in run.output.splitlines() if "error:" in line]
    assert len(set(errors)) == 1, errors  # the same line from each rank
    return errors[0]


@pytest.mark.any_megatron_line  # the device check at start (megatron_glue/training/device.py), before megatron-core
def test_hccl_without_torch_npu(tmp_path):
    line = _one_line_failure(pretrain(tmp_path, "--train-iters", "2", "--distributed-backend", "hccl"), 2)
    assert line == ("pretrain_gpt: error: --distributed-backend hccl needs torch_npu and an Ascend NPU, but "
                    "torch_npu is not installed; install Ascend CANN and `pip install torch-npu==2.13.0` (the npu "
                    "extra), or on CPU use --distributed-backend gloo")


def test_missing_data_path(tmp_path):
    flags = [f for f in TINY if f not in ("--mock-data",)]
    prefix = tmp_path / "nothing_text_document"
    run = pretrain(tmp_path, "--train-iters", "2", "--data-path", str(prefix), "--tokenizer-type", "NullTokenizer",
                   base=flags)
    assert _one_line_failure(run, 1) == (f"pretrain_gpt: error: data prefix {prefix}: expected {prefix}.bin and "
                                         f"{prefix}.idx, missing {prefix}.bin and {prefix}.idx (write them with "
                                         "`npu-compile preprocess`)")


def test_demo_runs_the_seed_flags(tmp_path):
    """`make demo`'s job is the seed script's flags (sizes scaled down, gloo, bf16 for fp16): they parse at 2
    processes as the flags of a real job, and its terminal curve draws what the metrics hold."""
    from megatron_glue.demo import ascii_curve, seed_flags

    data = {"data_prefix": str(tmp_path / "corpus_text_document"), "vocab_file": "v.json", "merge_file": "m.txt"}
    args = parse_args(seed_flags(data, tmp_path), world_size=2)
    assert (args.data_parallel_size, args.num_microbatches, args.params_dtype) == (2, 2, "bfloat16")
    assert args.save == args.load == str(tmp_path / "ckpt") and args.tokenizer_type == "GPT2BPETokenizer"
    curve = ascii_curve([8.0, 7.0, 6.0, 5.0], width=4, height=4).splitlines()
    assert [row.split("|")[1] for row in curve[:4]] == ["*   ", " *  ", "  * ", "   *"]


def test_device_placement_per_backend(monkeypatch, capsys):
    from megatron_glue.training.device import placement

    monkeypatch.setenv("HCCL_CONNECT_TIMEOUT", "90")
    monkeypatch.setenv("LOCAL_RANK", "1")
    where = placement(parse_args([*TINY, "--train-iters", "1"]))
    assert (where.backend, where.device.type, where.local_rank, where.timeout.total_seconds()) == ("gloo", "cpu", 1, 90)
    assert placement(parse_args([*TINY, "--train-iters", "1", "--local-rank", "3"])).local_rank == 3
    monkeypatch.delenv("HCCL_CONNECT_TIMEOUT")
    assert placement(parse_args([*TINY, "--train-iters", "1", "--distributed-timeout-minutes", "2"])).timeout \
        .total_seconds() == 120
    # nccl: the machine's accelerator backend, as torch_npu makes it mean; here (no NPU, no CUDA) gloo, said so
    where = placement(parse_args([t if t != "gloo" else "nccl" for t in TINY] + ["--train-iters", "1"]))
    assert (where.backend, where.device.type) == ("gloo", "cpu")
    assert capsys.readouterr().out == (" --distributed-backend nccl: this machine has no NPU (torch_npu) and no CUDA; "
                                       "running on the CPU with gloo\n")
