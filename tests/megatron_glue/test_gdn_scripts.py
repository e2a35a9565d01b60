"""MindSpeed-LLM's two Gated DeltaNet training scripts (fixtures/gated_deltanet_scripts.json, master's launch lines)
through the job's argument check, and the 340M one trained a few iterations as `bench.gdn_scripts` trains it for 20."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from bench import gdn_scripts
from bench.mindspeed_census import scale_down
from megatron_glue.capture.adaptations import megatron_core_in

pytestmark = pytest.mark.skipif(not megatron_core_in(">=0.16"),
                                reason="megatron-core's GatedDeltaNet arrived in 0.16")

SCRIPTS = json.loads((Path(__file__).parent / "fixtures" / "gated_deltanet_scripts.json").read_text())["scripts"]


def _script(size: str) -> list[str]:
    (flags,) = [v for k, v in SCRIPTS.items() if k.endswith(f"pretrain_gated_deltanet_{size}_ptd.sh")]
    return flags


def _without(argv: list[str], flags) -> list[str]:
    """argv without `flags` and their values."""
    out, skipping = [], False
    for a in argv:
        if a.startswith("--"):
            skipping = a in flags
        if not skipping:
            out.append(a)
    return out


def test_both_scripts_pass_the_argument_check_without_the_conversion_flags():
    from megatron_glue.training.arguments import ArgumentError, parse_args

    args = parse_args(_without(scale_down(_script("340M_4K_A2")), gdn_scripts.DROPPED_CONVERSION), world_size=2)
    assert (args.full_attention_interval, args.rotary_percent, args.mamba_chunk_size, args.mamba_d_conv) == (
        3, 0.25, 64, 4)
    assert args.spec == ["mindspeed_llm.tasks.models.spec.qwen3_next_spec", "layer_spec"]
    big = scale_down(_script("1.3B_4K_A3"))
    parse_args(_without(big, gdn_scripts.DROPPED_CONVERSION + ("--use-ascend-mc2",)), world_size=2)
    # the 1.3B script's MC2 at TP 1: refused, as MindSpeed's own check refuses it (bench.gdn_scripts.WHY)
    with pytest.raises(ArgumentError, match="--use-ascend-mc2 needs --sequence-parallel and "
                                            "--tensor-model-parallel-size > 1 \\(got --sequence-parallel, TP 1\\)"):
        parse_args(_without(big, gdn_scripts.DROPPED_CONVERSION), world_size=2)


@pytest.mark.training
def test_340m_script_trains(tmp_path):
    # the bench's run (every flag kept) for 3 iterations, eager: compiled, each process spends a minute compiling the
    # Gated DeltaNet layer (its chunk loop unrolls), more than a test's budget; the compiled layers are checked
    # against eager in test_gated_deltanet.py, the compiled job over 20 iterations in bench/results/gdn_scripts.md
    result, end = gdn_scripts.run("Gated DeltaNet 340M", _script("340M_4K_A2"), tmp_path, iterations=3,
                                  extra=("--no-npu-compile",))
    assert result.returncode == 0, result.output[-6000:]
    assert result.dropped == ["--enable-mg2hf-convert", "--enable-hf2mg-convert", "--model-type-hf"]
    assert len(result.losses) == 3 and all(math.isfinite(x) and 0 < x < 20 for x in result.losses), result.losses
    assert " iteration        3/       3 | consumed samples:" in result.output
    assert " > number of parameters on (tensor, pipeline) model parallel rank" in result.output
