"""Two of MindSpeed-LLM's context-parallel scripts run as their users run them, scaled down to CP 2.

    python -m bench.cp_scripts --repo /path/to/MindSpeed-LLM.git

- Ring: `qwen25/pretrain_qwen25_72b_32k_ptd.sh` (`--context-parallel-algo megatron_cp_algo`, CP 4 x TP 8 x PP 4
  there), its launch line through `bench.mindspeed_scripts`' machinery: pretraining data of the project's own text
  tokenized by bench.sft_scripts' tokenizer (512 tokens, the scaled-down `--padded-vocab-size`), its own
  `--enable-hf2mg-convert --model-type-hf qwen25` start from a random-init transformers Qwen2 saved at `--load`.
- Packed Ulysses: `qwen25/data_convert_qwen25_instruction_pack.sh` (`--prompt-type qwen --pack --neat-pack`) through
  `npu-compile preprocess`, and `qwen25/tune_qwen25_72b_32k_full_pack.sh` (`--context-parallel-algo
  ulysses_cp_algo --reset-attention-mask --neat-pack --padded-samples`, CP 4 x TP 8 x PP 2 there) through
  `-m megatron_glue.posttrain_gpt`, as `bench.sft_scripts` runs its pairs.

Each launch line is scaled down by `bench.mindspeed_census.scale_down`: a 4-layer, 64-wide model on 2 CPU processes
over gloo, context parallelism kept at 2 with the script's algorithm, TP and PP 1 (the flags that need pipeline
stages, here the ring script's `--num-layer-list`, left out: the job refuses them at PP 1), every other flag kept,
trained 20 iterations compiled (backend ascend). Beside the sizes: the paths, `--lr` / `--min-lr` 1e-3 / 1e-5, the
SFT pair's sequence 256 (bench.sft_scripts' reasons), the ring's `--load` the HF folder; added `--no-progress-bar`
and `--metrics-file` (the losses, the compiled graph count and graph breaks the job logs at its end). Writes
`bench/results/cp_scripts.md`.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from pathlib import Path

from bench import mindspeed_scripts as pretraining
from bench import sft_scripts as sft
from bench.mindspeed_census import PIPELINE_ONLY, TENSOR_ONLY, _git, extract, scale_down

RING = ("Qwen2.5 72B 32K, ring (megatron_cp_algo)", "examples/mcore/qwen25/pretrain_qwen25_72b_32k_ptd.sh")
PACKED = ("Qwen2.5 72B 32K, packed SFT, Ulysses (ulysses_cp_algo)",
          "examples/mcore/qwen25/data_convert_qwen25_instruction_pack.sh",
          "examples/mcore/qwen25/tune_qwen25_72b_32k_full_pack.sh")
ITERATIONS = 20
RING_DATA = "the project's text, a BPE of 512 tokens"


@dataclass
class Result:
    name: str
    scripts: str
    layout: str = ""
    dropped: list[str] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    graphs: int | None = None
    breaks: int | None = None
    data: str = ""
    output: str = ""
    returncode: int = 0


def _end(folder: Path) -> tuple[int | None, int | None]:
    import json

    path = folder / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    ends = [r for r in rows if r["kind"] == "end"]
    return (ends[-1].get("graphs"), ends[-1].get("graph_breaks")) if ends else (None, None)


def _layout(argv: list[str]) -> str:
    flag = pretraining._flag
    return (f"CP {flag(argv, '--context-parallel-size')} ({flag(argv, '--context-parallel-algo')}), "
            f"TP {flag(argv, '--tensor-model-parallel-size') or 1}, PP {flag(argv, '--pipeline-model-parallel-size') or 1}")


def _dropped(original: list[str], scaled: list[str]) -> list[str]:
    return [f for f in original if f.startswith("--") and f not in scaled and f in PIPELINE_ONLY + TENSOR_ONLY]


def prepare_ring(folder: Path) -> None:
    """tokenizer/ as bench.sft_scripts makes it (a byte-level BPE of the project's text with Qwen's chat specials:
    512 tokens, the scaled-down --padded-vocab-size, so that the HF Qwen2 the script converts at start has the
    job's vocabulary) and data/corpus_text_document, the project's text tokenized by it with end-of-document
    tokens (`npu-compile preprocess`'s PretrainedFromHF)."""
    import json
    import os

    from megatron_glue.data.demo_data import corpus_documents
    from megatron_glue.data.preprocess import preprocess

    sft.prepare(folder)
    if (folder / "data" / "corpus_text_document.idx").exists():
        return
    (folder / "data").mkdir(exist_ok=True)
    corpus = folder / "data" / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": d["text"]}) + "\n" for d in corpus_documents()))
    with open(os.devnull, "w") as quiet:
        preprocess(str(corpus), str(folder / "data" / "corpus"), tokenizer_type="PretrainedFromHF",
                   tokenizer_name_or_path=str(folder / "tokenizer"), append_eod=True, log=quiet)


def run_ring(flags: list[str], folder: Path, timeout: float = 1200) -> Result:
    folder.mkdir(parents=True, exist_ok=True)
    prepare_ring(folder)
    argv = pretraining._set(scale_down(flags), {**pretraining.RUN, "--train-iters": str(ITERATIONS),
                                                "--lr-decay-iters": str(ITERATIONS), "--load": "hf"})
    sft.save_hf(argv, folder, "qwen25")
    argv += ["--no-progress-bar", "--metrics-file", "metrics.jsonl"]
    result = Result(RING[0], RING[1].removeprefix("examples/mcore/"), layout=_layout(argv),
                    dropped=_dropped(flags, argv))
    done = pretraining.launch(folder, argv, timeout)
    result.output = done.stdout + done.stderr
    (folder / "pretrain_gpt.log").write_text(result.output)
    result.returncode = done.returncode
    result.losses = pretraining._losses(folder)
    result.graphs, result.breaks = _end(folder)
    return result


def run_packed(data: list[str], tune: list[str], folder: Path) -> Result:
    done = sft.run_pair(PACKED[0], data, tune, folder, iterations=ITERATIONS, timeout=1200)
    argv = scale_down(tune)
    result = Result(PACKED[0], f"{PACKED[1].removeprefix('examples/mcore/')} + "
                               f"{PACKED[2].removeprefix('examples/mcore/')}",
                    layout=_layout(argv), dropped=_dropped(tune, argv), losses=done.losses, output=done.output,
                    returncode=done.returncode)
    result.data = next((line for line in done.data_output.splitlines() if line.startswith("Packed ")), "")
    result.graphs, result.breaks = _end(folder)
    return result


def report(results: list[Result], source: str) -> str:
    lines = [
        "# Two MindSpeed-LLM context-parallel scripts, scaled down to CP 2",
        "",
        f"Source: Ascend/MindSpeed-LLM (`master` {source}); `python -m bench.cp_scripts --repo <MindSpeed-LLM git "
        f"dir>`. Each launch line scaled down to a tiny model (4 layers, hidden 64) on 2 gloo processes, context "
        f"parallelism 2 with the script's algorithm, TP and PP 1, every other flag kept, trained {ITERATIONS} "
        "iterations compiled (backend ascend); the SFT pair's data through `npu-compile preprocess` with its data "
        "script's flags (bench.sft_scripts). What else changes: the bench's docstring. Graphs and breaks: the job's "
        "count at its end (Dynamo's unique graphs and graph breaks in the process that logs), a compile cache "
        "of the run's own for the SFT pair. Runs differ in the last digits from one to the next (not traced further; the "
        "scripts train in bf16): an earlier run of the same code gave 6.2520 → 6.0145 and "
        "6.2527 → 5.6437.",
        "",
        "| scripts | layout (2 processes) | data | loss first → last | compiled graphs | graph breaks | "
        "flags dropped |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        dropped = ", ".join(f"`{d}`" for d in r.dropped) or "none"
        if r.returncode or not r.losses:
            tail = r.output.strip().splitlines()[-1:] or ["no output"]
            lines.append(f"| {r.scripts} | {r.layout} | {r.data} | **failed** (exit {r.returncode}): "
                         f"`{tail[0][:300]}` | | | {dropped} |")
            continue
        lines.append(f"| {r.scripts} | {r.layout} | {r.data or RING_DATA} | "
                     f"{r.losses[0]:.4f} → {r.losses[-1]:.4f} ({len(r.losses)} iterations) | {r.graphs} | "
                     f"{r.breaks} | {dropped} |")
    reasons = {"--num-layer-list": "the door: \"needs --pipeline-model-parallel-size > 1\": it splits the layers "
                                   "over pipeline stages",
               "--use-ascend-mc2": "the door: \"needs --sequence-parallel and --tensor-model-parallel-size > 1\": "
                                   "MC2 fuses tensor parallelism's collectives"}
    dropped = list(dict.fromkeys(d for r in results for d in r.dropped))
    if dropped:
        lines += ["", "Dropped by the scale-down (2 processes hold CP 2, so TP and PP are 1): "
                  + "; ".join(f"`{d}` ({reasons[d]})" for d in dropped) + "."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.cp_scripts", description=__doc__.split("\n")[0])
    parser.add_argument("--repo", required=True, help="a MindSpeed-LLM git directory (bare, or a work tree's .git)")
    parser.add_argument("--work", default=None, help="where the runs go (default: a temporary folder)")
    a = parser.parse_args(argv)
    import tempfile

    work = Path(a.work or tempfile.mkdtemp(prefix="cp_scripts_"))
    show = lambda path: _git(a.repo, "show", f"master:{path}")  # noqa: E731
    results = [run_ring(extract(show(RING[1])), work / "ring"),
               run_packed(sft.data_flags(show(PACKED[1])), extract(show(PACKED[2])), work / "packed")]
    for r in results:
        print(f"{r.name}: exit {r.returncode}, losses {r.losses[:1]} ... {r.losses[-1:]}, graphs {r.graphs}, "
              f"breaks {r.breaks}", flush=True)
    text = report(results, _git(a.repo, "rev-parse", "--short", "master").strip())
    (Path(__file__).parent / "results" / "cp_scripts.md").write_text(text + "\n")
    print(text)
    return 0 if all(r.returncode == 0 and r.losses for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
