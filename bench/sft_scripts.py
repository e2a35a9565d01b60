"""Two of MindSpeed-LLM's instruction-tuning scripts run as their users run them, with one word changed.

    python -m bench.sft_scripts --repo /path/to/MindSpeed-LLM.git

Each pair is MindSpeed-LLM master's data script (`examples/mcore/*/data_convert_*_instruction*.sh`: its
`preprocess_data.py` flags, run as `npu-compile preprocess` with them) and its tune script (`tune_*.sh`: its
`posttrain_gpt.py` launch line, run as `torchrun ... -m megatron_glue.posttrain_gpt`), scaled down as
`bench.mindspeed_scripts` scales pretraining scripts (`bench.mindspeed_census.scale_down`: a 4-layer, 64-wide model
on 2 CPU processes over gloo, every other flag kept), trained 20 iterations:

Tokenizer: a byte-level BPE of the project's text, 510 tokens and Qwen's `<|im_start|>` / `<|im_end|>`: 512, the
scaled-down `--padded-vocab-size`.

- Qwen2.5 packed: `data_convert_qwen25_instruction_pack.sh` (`--prompt-type qwen --pack --neat-pack --seq-length`)
  and `tune_qwen25_72b_4k_full_pack.sh` (`--reset-attention-mask --neat-pack --padded-samples`, TP 8 x PP 4 there);
- Qwen3 unpacked: `data_convert_qwen3_instruction.sh` (`--prompt-type qwen3 --enable-thinking true`) and
  `tune_qwen3_0point6b_4K_full_ptd.sh` (`--no-pad-to-seq-lengths`: each micro-batch as long as its longest sample,
  rounded up to 8).

Beside the sizes, each run changes only: paths (the data: Alpaca records `{instruction, input, output}` cut from
this project's own text, in place of their alpaca parquet; a byte-level BPE tokenizer folder with the Qwen chat
specials; the checkpoint folders; `--load` a random-init transformers model of the scaled-down architecture,
which the scripts' own `--enable-hf2mg-convert --model-type-hf` converts at start); `--seq-length` /
`--max-position-embeddings` 256 (the census' 32 cannot hold a chat template's prompt; the data script's
`--seq-length` too); `--lr` / `--min-lr` 1e-3 / 1e-5 (theirs, ~1e-6 for 0.6B-72B models, moves a tiny model's loss
by nothing in 20 steps); added `--no-progress-bar` and `--metrics-file` (where the bench reads the losses and the
compiled graph count). Writes `bench/results/sft_scripts.md`.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from bench.mindspeed_census import _git, extract, scale_down
from bench.mindspeed_scripts import _env, _flag, _set

PAIRS = [
    # (name, data script, tune script)
    ("Qwen2.5 72B, packed", "examples/mcore/qwen25/data_convert_qwen25_instruction_pack.sh",
     "examples/mcore/qwen25/tune_qwen25_72b_4k_full_pack.sh"),
    ("Qwen3 0.6B, --no-pad-to-seq-lengths", "examples/mcore/qwen3/data_convert_qwen3_instruction.sh",
     "examples/mcore/qwen3/tune_qwen3_0point6b_4K_full_ptd.sh"),
]
ITERATIONS = 20
SEQ = "256"
RUN = {"--lr": "1e-3", "--min-lr": "1e-5", "--seq-length": SEQ, "--max-position-embeddings": SEQ,
       "--data-path": "finetune_dataset/alpaca", "--load": "hf"}
DATA_PATHS = {"--input": "alpaca.jsonl", "--tokenizer-name-or-path": "tokenizer",
              "--output-prefix": "finetune_dataset/alpaca", "--seq-length": SEQ, "--workers": "1"}
SPECIALS = ["<|im_start|>", "<|im_end|>"]  # Qwen's chat tokens (eos and pad: the BPE's <|endoftext|>)
# the tokenizer's tokens, specials included: the scaled-down --padded-vocab-size 512 exactly, so that the HF model
# the scripts convert at start (its vocab_size the tokenizer's) pads to the job's vocabulary (see the report)
VOCAB = 512


@dataclass
class Result:
    name: str
    data_script: str = ""
    tune_script: str = ""
    layout: str = ""
    data_flags: list[str] = field(default_factory=list)
    data_output: str = ""
    losses: list[float] = field(default_factory=list)
    graphs: int | None = None
    lengths: list[int] = field(default_factory=list)
    output: str = ""
    returncode: int = 0


def data_flags(script: str) -> list[str]:
    """The flags and values of the data script's `preprocess_data.py` line, comments dropped."""
    text = script.replace("\\\r\n", " ").replace("\\\n", " ")
    for line in text.splitlines():
        if "preprocess_data.py" in line and not line.lstrip().startswith("#"):
            words = shlex.split(line, comments=True)
            return words[next(i for i, w in enumerate(words) if w.endswith("preprocess_data.py")) + 1:]
    raise ValueError("no preprocess_data.py line in the data script")


def _replace(argv: list[str], values: dict[str, str]) -> list[str]:
    out = list(argv)
    for i, a in enumerate(out):
        if a in values and i + 1 < len(out) and not out[i + 1].startswith("--"):
            out[i + 1] = values[a]
    return out


def records(n: int = 400) -> list[dict]:
    """Alpaca records from the project's own text (its plain words): continue a line of it."""
    from megatron_glue.data.demo_data import corpus_documents

    out = []
    for doc in corpus_documents():
        words = [w for w in doc["text"].split() if w.isalpha()]
        for at in range(0, len(words) - 24, 24):
            out.append({"instruction": "Continue:", "input": " ".join(words[at:at + 4]),
                        "output": " ".join(words[at + 4:at + 8])})
            if len(out) == n:
                return out
    return out


def prepare(folder: Path) -> None:
    """tokenizer/ (a byte-level BPE of VOCAB tokens on the project's text, <|endoftext|> its eos and pad, the Qwen
    chat specials added) and alpaca.jsonl in `folder`."""
    from transformers import PreTrainedTokenizerFast

    from megatron_glue.data.demo_data import EOD_TOKEN, byte_level_bpe, corpus_documents

    if (folder / "alpaca.jsonl").exists():
        return
    bpe = byte_level_bpe([d["text"] for d in corpus_documents()], VOCAB - len(SPECIALS))
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=EOD_TOKEN, pad_token=EOD_TOKEN,
                                  additional_special_tokens=SPECIALS)
    tok.save_pretrained(folder / "tokenizer")
    (folder / "alpaca.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records()))


def save_hf(argv: list[str], root: Path, model_type: str) -> None:
    """A random-init transformers model (Qwen2 for qwen25, Qwen3 for qwen3) of the scaled-down architecture, saved
    where --load points."""
    import torch
    import transformers

    from megatron_glue.training.arguments import parse_args
    from megatron_glue.training.gpt import set_vocabulary

    args = parse_args(argv, world_size=2)
    args.tokenizer_name_or_path = str(root / args.tokenizer_name_or_path)
    set_vocabulary(args)
    common = dict(vocab_size=args.orig_vocab_size, hidden_size=args.hidden_size,
                  intermediate_size=args.ffn_hidden_size, num_hidden_layers=args.num_layers,
                  num_attention_heads=args.num_attention_heads, num_key_value_heads=args.num_query_groups,
                  max_position_embeddings=args.max_position_embeddings, rms_norm_eps=args.norm_epsilon,
                  rope_theta=float(args.rotary_base), tie_word_embeddings=not args.untie_embeddings_and_output_weights)
    if model_type == "qwen3":
        config = transformers.Qwen3Config(head_dim=args.kv_channels, attention_bias=False, **common)
        model = transformers.Qwen3ForCausalLM
    else:
        config = transformers.Qwen2Config(**common)
        model = transformers.Qwen2ForCausalLM
    torch.manual_seed(0)
    model(config).save_pretrained(root / args.load)


def launch(folder: Path, module: list[str], argv: list[str], timeout: float, nproc: int = 2):
    prefix = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "-m"]
              if nproc else [sys.executable, "-m"])
    # a compile cache of the run's own: the job's warm start (npu_compile.precompile) would otherwise load an
    # earlier run's compiles without Dynamo, and the graph count would say 0
    env = dict(_env(), TORCHINDUCTOR_CACHE_DIR=str(folder / "compile_cache"),
               NPU_COMPILE_CACHE_DIR=str(folder / "compile_cache" / "npu_compile"))
    return subprocess.run([*prefix, *module, *argv], cwd=folder, env=env, capture_output=True, text=True,
                          timeout=timeout)


def _metrics(folder: Path) -> tuple[list[float], int | None]:
    path = folder / "metrics.jsonl"
    if not path.exists():
        return [], None
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    losses = [r["lm loss"] for r in rows if r["kind"] == "train" and "lm loss" in r]
    ends = [r.get("graphs") for r in rows if r["kind"] == "end"]
    return losses, (ends[-1] if ends else None)


def run_pair(name: str, data_script: list[str], tune_script: list[str], folder: Path,
             iterations: int = ITERATIONS, timeout: float = 900) -> Result:
    """One data script and its tune script, scaled down, in `folder`: the data written by `npu-compile preprocess`
    with the data script's flags, then `iterations` iterations of `-m megatron_glue.posttrain_gpt`."""
    folder.mkdir(parents=True, exist_ok=True)
    prepare(folder)
    result = Result(name)
    flags = _replace(data_script, DATA_PATHS)
    result.data_flags = flags
    done = launch(folder, ["npu_compile", "preprocess"], flags, timeout, nproc=0)
    result.data_output = done.stdout + done.stderr
    if done.returncode:
        result.returncode, result.output = done.returncode, result.data_output
        return result
    argv = _set(scale_down(tune_script), {**RUN, "--train-iters": str(iterations),
                                          "--lr-decay-iters": str(iterations)})
    save_hf(argv, folder, _flag(argv, "--model-type-hf"))
    argv += ["--no-progress-bar", "--metrics-file", "metrics.jsonl"]
    result.layout = (f"TP {_flag(argv, '--tensor-model-parallel-size') or 1}, "
                     f"PP {_flag(argv, '--pipeline-model-parallel-size') or 1}")
    done = launch(folder, ["megatron_glue.posttrain_gpt"], argv, timeout)
    result.output = done.stdout + done.stderr
    (folder / "posttrain_gpt.log").write_text(result.output)
    result.returncode = done.returncode
    result.losses, result.graphs = _metrics(folder)
    return result


def report(results: list[Result], source: str) -> str:
    lines = [
        "# Two MindSpeed-LLM instruction-tuning scripts, run with one word changed",
        "",
        f"Source: Ascend/MindSpeed-LLM (`master` {source}); `python -m bench.sft_scripts --repo <MindSpeed-LLM git "
        f"dir>`. Each data script's flags through `npu-compile preprocess`, each tune script's flags scaled down to "
        f"a tiny model (4 layers, hidden 64, sequence {SEQ}) on 2 gloo processes, every other flag kept, trained "
        f"{ITERATIONS} iterations with `-m megatron_glue.posttrain_gpt` in place of `posttrain_gpt.py`, every layer "
        "compiled (backend ascend). What else changes: the bench's docstring (paths, the learning rate, the "
        "sequence length). Compiled graphs: the job's count at the end (Dynamo's unique graphs in the process "
        "that logs), each run with a compile cache of its own (cold).",
        "",
        "| scripts | layout (2 processes) | data (npu-compile preprocess) | loss first → last | compiled graphs | "
        "flags dropped |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        scripts = f"{r.data_script} + {r.tune_script}"
        if r.returncode or not r.losses:
            tail = r.output.strip().splitlines()[-1:] or ["no output"]
            lines.append(f"| {scripts} | {r.layout} | | **failed** (exit {r.returncode}): `{tail[0][:300]}` | | |")
            continue
        data = next((line for line in r.data_output.splitlines() if line.startswith("Packed ")), "") or next(
            (line for line in r.data_output.splitlines() if line.startswith("Wrote ")), "").split(" (")[0]
        lines.append(f"| {scripts} | {r.layout} | {data} | {r.losses[0]:.4f} → {r.losses[-1]:.4f} "
                     f"({len(r.losses)} iterations) | {r.graphs} | none |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.sft_scripts", description=__doc__.split("\n")[0])
    parser.add_argument("--repo", required=True, help="a MindSpeed-LLM git directory (bare, or a work tree's .git)")
    parser.add_argument("--work", default=None, help="where the runs go (default: a temporary folder)")
    a = parser.parse_args(argv)
    import tempfile

    work = Path(a.work or tempfile.mkdtemp(prefix="sft_scripts_"))
    results = []
    for name, data_path, tune_path in PAIRS:
        data = data_flags(_git(a.repo, "show", f"master:{data_path}"))
        tune = extract(_git(a.repo, "show", f"master:{tune_path}"))
        result = run_pair(name, data, tune, work / Path(tune_path).stem)
        result.data_script = data_path.removeprefix("examples/mcore/")
        result.tune_script = tune_path.removeprefix("examples/mcore/")
        results.append(result)
        print(f"{name}: exit {result.returncode}, losses {result.losses[:1]} ... {result.losses[-1:]}, graphs "
              f"{result.graphs}", flush=True)
    commit = _git(a.repo, "rev-parse", "--short", "master").strip()
    text = report(results, commit)
    (Path(__file__).parent / "results" / "sft_scripts.md").write_text(text + "\n")
    print(text)
    return 0 if all(r.returncode == 0 and r.losses for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
