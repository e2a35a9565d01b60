"""MindSpeed-LLM master's packed instruction tuning run as its users run it, with one word changed
(`bench.sft_scripts`): the data script `data_convert_qwen25_instruction_pack.sh` through `npu-compile preprocess`
(`--prompt-type qwen --pack --neat-pack --seq-length`), then `tune_qwen25_72b_4k_full_pack.sh`
(`--reset-attention-mask --neat-pack --padded-samples`, converted from HF at start) scaled down to 2 gloo processes,
every other flag kept, trained a few iterations with `-m megatron_glue.posttrain_gpt`, every layer compiled (the
scripts' flags and values: fixtures/mindspeed_llm_scripts.json, extracted from master c77308a1). The
bench runs it and the Qwen3 `--no-pad-to-seq-lengths` pair for 20 iterations (bench/results/sft_scripts.md)."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from bench import sft_scripts

pytestmark = [pytest.mark.training]

# flags and values of MindSpeed-LLM master's scripts (bench.sft_scripts.data_flags, bench.mindspeed_census.extract)
SCRIPTS = json.loads((Path(__file__).parent / "fixtures" / "mindspeed_llm_scripts.json").read_text())["scripts"]


def _script(path: str) -> list[str]:
    (key,) = [k for k in SCRIPTS if k.startswith("master@") and k.endswith(":" + path)]
    return SCRIPTS[key]


def test_qwen25_packed_instruction_tuning_with_one_word_changed(tmp_path):
    name, data_path, tune_path = sft_scripts.PAIRS[0]
    data = _script(data_path)
    assert {"--pack", "--neat-pack", "--seq-length"} <= set(data)
    tune = _script(tune_path)
    assert {"--reset-attention-mask", "--neat-pack", "--padded-samples", "--is-instruction-dataset"} <= set(tune)
    result = sft_scripts.run_pair(name, data, tune, tmp_path, iterations=2)
    assert result.returncode == 0, result.output[-6000:]
    rows = re.search(r"Packed (\d+) records into (\d+) rows of 256 tokens", result.data_output)
    assert rows and int(rows[1]) > 2 * int(rows[2]), result.data_output  # several records in each row
    assert len(result.losses) == 2 and all(math.isfinite(x) and 0 < x < 20 for x in result.losses), result.losses
    # the embedding, the layers and the output layer, each compiled once and at most once again (in 2 iterations:
    # the second step's guards, bench/results/sft_scripts.md); never once per batch: the number of records per row
    # changes no shape (the lengths are padded to one length)
    assert result.graphs in (3, 6), result.graphs
    assert re.search(r"^ iteration +2/ +2 \| consumed samples: +8 \|", result.output, re.M)
