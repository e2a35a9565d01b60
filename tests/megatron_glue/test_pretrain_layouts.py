"""The training job over gloo processes at every parallel layout: compiled equals eager, and every layout equals
the one-process run of the same global batch (fp32, 1e-5), in its losses and in its gradient norms. All runs
start from one checkpoint saved by a one-process run (`--load ... --finetune`): pipeline stages seed their init
differently (Megatron-LM's seed + 100 x stage), so only loaded weights are the same at every layout."""

from __future__ import annotations

import json
import re

import pytest

from pretrain_runs import assert_close, pretrain

pytestmark = [pytest.mark.slow, pytest.mark.training]

LAYOUTS = {
    # name: (processes, flags, layers)
    "tp2_sp": (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"], 2),
    "pp2_1f1b": (2, ["--pipeline-model-parallel-size", "2"], 2),
    "pp2_interleaved": (2, ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"], 4),
    "dp2_distopt_overlap": (2, ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"], 2),
    "tp2_pp2": (4, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"], 2),
    # MindSpeed-LLM's uneven stages (megatron-core's num_layers_in_first_pipeline_stage)
    "pp2_uneven": (2, ["--pipeline-model-parallel-size", "2", "--num-layer-list", "1,3"], 4),
}
# no evaluation after the last iteration: its no-grad graphs, compiled, cost 4-24 s a launch and are compared nowhere
ITERS = ["--train-iters", "5", "--eval-iters", "0"]


def _lazy(make):
    """A dict-like of results made on first use (a run of one layout builds only the references it needs)."""
    made = {}

    def get(*key):
        if key not in made:
            made[key] = make(*key)
        return made[key]
    return get


@pytest.fixture(scope="module")
def start(tmp_path_factory):
    """layers -> a checkpoint saved by one process after one step, to start every layout from."""
    def make(layers):
        folder = tmp_path_factory.mktemp(f"start{layers}")
        pretrain(folder, "--num-layers", str(layers), "--train-iters", "1", "--save", str(folder / "ckpt"),
                 "--no-npu-compile").check()
        return folder / "ckpt"
    return _lazy(make)


def _layers(layers):
    return ["--num-layers", str(layers)]


def grad_norms(run) -> list[float]:
    """The gradient norm of each iteration as the optimizer computed it (before clipping): --clip-grad 1.0 clips
    every step and Adam ignores the gradients' scale, so the losses alone would not show gradients off by a
    factor."""
    norms = [r["grad_norm"] for r in run.rows("train")]
    assert norms and None not in norms, norms
    return norms


def assert_same_training(a, b, what: str) -> None:
    """Losses and gradient norms of every iteration within 1e-5 of each other."""
    assert_close(a.losses, b.losses, what=f"{what}: losses")
    assert_close(grad_norms(a), grad_norms(b), what=f"{what}: grad norms")


@pytest.fixture(scope="module")
def one_process(start, tmp_path_factory):
    """(layers, compiled) -> the one-process run."""
    def make(layers, compiled):
        folder = tmp_path_factory.mktemp(f"ref{layers}{'c' if compiled else 'e'}")
        flags = [*ITERS, *_layers(layers), "--load", str(start(layers)), "--finetune"]
        return pretrain(folder, *flags, *([] if compiled else ["--no-npu-compile"])).check()
    return _lazy(make)


def test_one_process_compiled_equals_eager(one_process):
    for layers in (2, 4):
        assert_same_training(one_process(layers, True), one_process(layers, False), f"{layers} layers")


# megatron_lines: the layouts whose code differs between megatron-core lines (megatron_glue/training/versions.py:
# the virtual pipeline stage, the distributed optimizer's state), run on 0.12.1 too.
@pytest.mark.parametrize("name", [pytest.param(n, marks=[pytest.mark.megatron_lines] if n in (
    "pp2_interleaved", "dp2_distopt_overlap", "pp2_uneven") else []) for n in LAYOUTS])
def test_layout(name, start, one_process, tmp_path):
    nproc, flags, layers = LAYOUTS[name]
    common = [*ITERS, *_layers(layers), "--load", str(start(layers)), "--finetune", *flags]
    dumps = tmp_path / "dumps"
    # the compile cache off: this layout's graphs are traced and compiled here, whatever ran before in the session
    # (with the cache, a layout whose layer graphs an earlier run stored traces nothing, and `graphs` counts none)
    compiled = pretrain(tmp_path / "compiled", *common, "--npu-compile-options",
                        json.dumps({"dump_dir": str(dumps), "cache": False}), nproc=nproc).check()
    eager = pretrain(tmp_path / "eager", *common, "--no-npu-compile", nproc=nproc).check()

    assert len(compiled.losses) == 5
    if name == "pp2_uneven":  # the stages are 1 and 3 layers (the numerics alone would not show an even split)
        layer = 4 * 64 * 64 + 4 * 64 + 2 * 4 * 64 * 64 + 4 * 64 + 64 + 4 * 64  # TINY's layer: h=64, ffn 4h
        embedding = 512 * 64  # the padded vocabulary's rows (the last stage holds the tied output copy)
        for run in (compiled, eager):
            assert sorted(re.findall(r"model parallel rank \(0, (\d)\): (\d+)", run.output)) == [
                ("0", str(embedding + 32 * 64 + layer)), ("1", str(3 * layer + 2 * 64 + embedding))]
    assert_same_training(compiled, eager, f"{name}: compiled vs --no-npu-compile")
    assert_same_training(eager, one_process(layers, False), f"{name} vs one process (eager)")
    assert_same_training(compiled, one_process(layers, True), f"{name} vs one process (compiled)")

    # Every layer went through the backend, in whole graphs: no graph breaks, attention fused.
    end = compiled.rows("end")[0]
    assert end["graph_breaks"] == 0 and end["graphs"] > 0
    assert sorted(p.name for p in dumps.iterdir()) == [f"rank{r}" for r in range(nproc)]  # one folder a rank
    reports = [json.loads(p.read_text()) for p in dumps.rglob("report.json")]
    assert reports, f"no report.json under {dumps}"
    assert any(r["fusions"].get("attention", 0) > 0 for r in reports), [r["fusions"] for r in reports]
    assert eager.rows("end")[0]["graphs"] == 0
