"""Activation recompute as Megatron-LM means it (`--recompute-granularity full --recompute-method uniform|block
--recompute-num-layers N`, selective, `--recompute-activations`): Megatron-LM's validation, the TransformerConfig
the job builds from the flags, and (marked `training`) the job itself: the same numbers as without recompute, and
the layers each method recomputes, read from the report.json of each compiled layer graph."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from megatron_glue.training.arguments import ArgumentError, parse_args
from pretrain_runs import TINY, assert_close, pretrain

FULL = ["--recompute-granularity", "full"]


def _parse(*flags, layers=4, pp=1, world_size=1):
    argv = [*TINY, "--train-iters", "3", *flags]
    argv[argv.index("--num-layers") + 1] = str(layers)
    if pp > 1:
        argv += ["--pipeline-model-parallel-size", str(pp)]
    return parse_args(argv, world_size=world_size)


def _error(*flags, **kwargs) -> str:
    with pytest.raises(ArgumentError) as info:
        _parse(*flags, **kwargs)
    assert info.value.code == 2
    return info.value.message


# -- Megatron-LM's rules --------------------------------------------------------------------------------------------

def test_full_needs_a_method():
    assert _error(*FULL, "--recompute-num-layers", "1") == (
        'pretrain_gpt: error: --recompute-granularity full needs --recompute-method "block" or "uniform"')


def test_full_needs_a_number_of_layers():
    assert _error(*FULL, "--recompute-method", "block") == (
        "pretrain_gpt: error: --recompute-granularity full needs --recompute-num-layers between 1 and the 4 layers "
        "of each model chunk")
    assert _error(*FULL, "--recompute-method", "block", "--recompute-num-layers", "0", layers=4, pp=2,
                  world_size=2) == (
        "pretrain_gpt: error: --recompute-granularity full needs --recompute-num-layers between 1 and the 2 layers "
        "of each model chunk (got 0)")


def test_uniform_chunks_must_divide_the_layers_of_a_chunk():
    assert _error(*FULL, "--recompute-method", "uniform", "--recompute-num-layers", "3") == (
        "pretrain_gpt: error: --recompute-method uniform checkpoints chunks of --recompute-num-layers 3 layers, which "
        "must divide the 4 layers of each model chunk; use a divisor of 4")


def test_selective_with_a_method_or_layers_is_an_error():
    assert _error("--recompute-granularity", "selective", "--recompute-method", "uniform") == (
        "pretrain_gpt: error: --recompute-method is not supported with --recompute-granularity selective "
        "(Megatron-LM: recompute method is not yet supported for selective recomputing granularity); drop "
        "--recompute-method, or use --recompute-granularity full")
    assert _error("--recompute-activations", "--recompute-num-layers", "2") == (
        "pretrain_gpt: error: --recompute-num-layers must be None with --recompute-granularity selective (selective "
        "recomputes core attention in every layer); drop --recompute-num-layers")


def test_a_method_without_a_granularity_is_refused_not_ignored():
    assert _error("--recompute-method", "block", "--recompute-num-layers", "1") == (
        "pretrain_gpt: error: --recompute-method has no effect without --recompute-granularity full (Megatron-LM "
        "ignores it); give --recompute-granularity full, or drop it")


def test_bad_values_are_argparse_errors():
    assert "argument --recompute-method: invalid choice: 'chunked'" in _error(*FULL, "--recompute-method", "chunked")


def test_recompute_activations_means_selective_over_any_granularity():
    args = _parse("--recompute-activations", "--recompute-granularity", "full")
    assert args.recompute_granularity == "selective" and not hasattr(args, "recompute_activations")


def test_compiled_full_recompute_refuses_dropout():
    assert _error(*FULL, "--recompute-method", "uniform", "--recompute-num-layers", "1", "--hidden-dropout",
                  "0.1") == (
        "pretrain_gpt: error: --recompute-granularity full in the compiled job needs --hidden-dropout 0 and "
        "--attention-dropout 0 (got 0.1 and 0.0): the recomputed layer's graph draws its dropout masks in another "
        "order than the forward's; set both to 0, or run --no-npu-compile")
    _parse(*FULL, "--recompute-method", "uniform", "--recompute-num-layers", "1", "--hidden-dropout", "0.1",
           "--no-npu-compile")  # eager: Megatron's checkpoint restores the generator for the same draws


def test_selective_needs_the_attention_fusion_in_the_compiled_job():
    assert _error("--recompute-activations", "--npu-compile-options", '{"fusions": ["rms_norm"]}') == (
        "pretrain_gpt: error: --recompute-granularity selective (core attention) is done by the fused attention, "
        "whose backward recomputes the attention probabilities, and --npu-compile-options 'fusions' leaves the "
        "attention rule out; add \"attention\" to 'fusions', or drop the recompute flag")
    _parse("--recompute-activations", "--npu-compile-options", '{"fusions": {"attention": true}}')


# -- what the job builds --------------------------------------------------------------------------------------------

def _config(args):
    from megatron_glue.training.training import transformer_config

    return transformer_config(args, SimpleNamespace(device=torch.device("cpu")))


@pytest.mark.parametrize("flags, expected", [
    ([], (None, None, None)),
    ([*FULL, "--recompute-method", "uniform", "--recompute-num-layers", "2"], ("full", "uniform", 2)),
    ([*FULL, "--recompute-method", "block", "--recompute-num-layers", "1"], ("full", "block", 1)),
    # selective, compiled: the fused attention's backward recomputes core attention; nothing checkpointed around it
    (["--recompute-activations"], (None, None, None)),
    (["--recompute-activations", "--no-npu-compile"], ("selective", None, None)),
], ids=["none", "uniform", "block", "selective", "selective-eager"])
def test_transformer_config_carries_the_flags(megatron_cpu, flags, expected):
    config = _config(_parse(*flags))
    assert (config.recompute_granularity, config.recompute_method, config.recompute_num_layers) == expected


# -- the job --------------------------------------------------------------------------------------------------------

RUNS = {
    "none": [],
    "uniform": [*FULL, "--recompute-method", "uniform", "--recompute-num-layers", "1"],
    "block": [*FULL, "--recompute-method", "block", "--recompute-num-layers", "1"],
    "selective": ["--recompute-activations"],
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Four layers, three iterations, no evaluation (whose no-grad forwards would compile layer graphs too), the
    compile cache off so that every graph is compiled and reported here."""
    root = tmp_path_factory.mktemp("recompute")
    flags = ["--num-layers", "4", "--train-iters", "3", "--eval-iters", "0", "--npu-compile-options",
             json.dumps({"dump_dir": "dumps", "cache": False})]
    return {name: pretrain(root / name, *flags, *extra).check() for name, extra in RUNS.items()}


def _layer_graphs(run, rank: int | None = None) -> dict[str, int]:
    """{"forward+backward" / "inference": how many layers ran that graph} over the layer graphs (those with the
    fused attention) this run (this rank of it) compiled."""
    counts = {}
    dumps = run.folder / "dumps" / ("" if rank is None else f"rank{rank}")
    for report in sorted(dumps.glob("*/report.json")):
        r = json.loads(report.read_text())
        if r["fusions"].get("attention"):
            kind = "+".join(r["graphs"])
            counts[kind] = counts.get(kind, 0) + r["reused_by"]
    return counts


@pytest.mark.slow
@pytest.mark.training
def test_full_uniform_recompute_computes_the_same_numbers(runs):
    none, uniform = runs["none"], runs["uniform"]
    assert_close(uniform.losses, none.losses, 1e-5, "lm loss")
    grad_norms = [[r["grad_norm"] for r in run.rows("train")] for run in (uniform, none)]
    assert_close(*grad_norms, 1e-5, "grad norm")
    assert len(none.losses) == 3


@pytest.mark.slow
@pytest.mark.training
def test_uniform_recomputes_every_layer_and_block_the_first_n(runs):
    # Every layer trains through its compiled forward+backward graph; the checkpointed ones first run the same
    # layer without grad (Megatron's checkpoint forward), which compiles the layer's inference graph: its reuse
    # count is the number of layers recomputed.
    assert _layer_graphs(runs["none"]) == {"forward+backward": 4}
    assert _layer_graphs(runs["uniform"]) == {"forward+backward": 4, "inference": 4}
    assert _layer_graphs(runs["block"]) == {"forward+backward": 4, "inference": 1}
    # selective: core attention is the fused attention's, whose backward recomputes the probabilities; nothing is
    # checkpointed around the layers
    assert _layer_graphs(runs["selective"]) == {"forward+backward": 4}
    assert_close(runs["selective"].losses, runs["none"].losses, 1e-5, "lm loss")
    for run in runs.values():
        assert all(json.loads(p.read_text())["graph_breaks"] == 0 for p in (run.folder / "dumps").glob("*/report.json"))


@pytest.mark.slow
@pytest.mark.training
def test_block_recomputes_the_first_n_layers_of_each_pipeline_stage(tmp_path):
    # The reference without recompute runs eager: its numbers are all it is compared on (compiled equals eager at
    # PP=2 is test_pretrain_layouts'); compiled, it took 6 CPU-seconds more (16 against 10 in a torchrun launch).
    flags = ["--num-layers", "4", "--train-iters", "3", "--eval-iters", "0", "--pipeline-model-parallel-size", "2"]
    none = pretrain(tmp_path / "none", *flags, "--no-npu-compile", nproc=2).check()
    block = pretrain(tmp_path / "block", *flags, *RUNS["block"], "--npu-compile-options",
                     json.dumps({"dump_dir": "dumps", "cache": False}), nproc=2).check()
    for rank in (0, 1):  # two layers a stage: the first of each recomputed
        assert _layer_graphs(block, rank) == {"forward+backward": 2, "inference": 1}
    assert_close(block.losses, none.losses, 1e-5, "lm loss")
    assert_close(*[[r["grad_norm"] for r in run.rows("train")] for run in (block, none)], 1e-5, "grad norm")
