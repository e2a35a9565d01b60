"""Three of MindSpeed-LLM's dense training scripts run as their users run them, with one word changed.

    python -m bench.mindspeed_scripts --repo /path/to/MindSpeed-LLM.git

A Llama 2, a Qwen2.5 and a Llama 3 script: each script's launch line (`bench.mindspeed_census.extract`, flags and
values only) scaled down to a tiny model on 2 CPU processes with every other flag kept
(`bench.mindspeed_census.scale_down`), launched with `torchrun ... -m megatron_glue.pretrain_gpt` in place of
`torchrun ... pretrain_gpt.py`, and trained 20 iterations over gloo (their `--distributed-backend nccl` means the
machine's accelerator backend: gloo here, said in the log). Beside the sizes, each run changes only:

- paths: the data (`npu-compile preprocess` output of the project's own text), a byte-level BPE tokenizer folder
  (`PretrainedFromHF`), the checkpoint folders;
- `--lr` / `--min-lr`: 1e-3 / 1e-5, a learning rate for a 4-layer, 64-wide model (theirs, 1e-6 for 13B-72B models,
  moves a tiny model's loss by nothing in 20 steps);
- added: `--tensorboard-dir` (none of them passes one), `--no-progress-bar`, and `--metrics-file` (where the bench
  reads the losses).

Llama 2 (master) starts from HF weights through its own `--enable-hf2mg-convert --model-type-hf llama2`: `--load`
is a random-init transformers LlamaForCausalLM saved with save_pretrained. Llama 3 (branch 2.3.0; master has no
Llama 3 script) keeps its uneven pipeline stages (`--num-layer-list`, scaled to 1,3) and resumes from its own
checkpoint: a first launch stops at iteration 10 (`--exit-interval 10`, the only flag added), the same command
without it resumes there. Qwen2.5 (branch 2.3.0: master's Qwen2.5 pretraining scripts pack sequences or use
context parallelism, issues of their own) trains straight through. Writes `bench/results/mindspeed_scripts.md`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from bench.mindspeed_census import _git, extract, scale_down

SCRIPTS = [
    # (name, branch, script, how it starts)
    ("Llama 2 13B", "master", "examples/mcore/llama2/pretrain_llama2_13b_ptd.sh", "hf"),
    ("Qwen2.5 7B", "2.3.0", "examples/mcore/qwen25/pretrain_qwen25_7b_32k_ptd.sh", "random"),
    ("Llama 3 70B", "2.3.0", "examples/mcore/llama3/pretrain_llama3_70b_ptd.sh", "resume"),
    # MoE (issue 23): Qwen3-MoE's alltoall script and its alltoall_seq one (run by --only moe)
    ("Qwen3 480B MoE", "master", "examples/mcore/qwen3_moe/pretrain_qwen3_480b_4k_A3_ptd.sh", "hf-moe"),
    ("Qwen3 30B-A3B MoE", "master", "examples/mcore/qwen3_moe/pretrain_qwen3_30b_a3b_4K_ptd.sh", "hf-moe"),
]
# MoE sizes beside bench.mindspeed_census.SIZES: 4 experts of 32, top 2; EP 1, as both processes hold a pipeline
# stage (the scripts' PP, or interleaving, takes them: census scale_down)
MOE_SIZES = {"--num-experts": "4", "--moe-router-topk": "2", "--moe-ffn-hidden-size": "32",
             "--expert-model-parallel-size": "1"}
# flags the job refuses (megatron_glue.training.arguments.REFUSED, with the reason it gives), dropped from the MoE
# scripts; the one-line reasons of the report
MOE_DROPPED = ("--gemm-gradient-accumulation-fusion", "--swap-optimizer")
# accepted alone, refused in these scripts' combination (--swap-attention with --recompute-granularity full: MindSpeed
# pairs its swap with its own MLP recompute, not implemented here), dropped too
MOE_DROPPED_COMBINED = ("--swap-attention",
                        # the all-to-all overlap at EP 1 (MOE_SIZES), which has no all-to-all: MindSpeed refuses it too
                        "--moe-alltoall-overlap-comm")
# the HF start of these scripts (--enable-hf2mg-convert --model-type-hf qwen3-moe with --ckpt-format torch): the
# converter's answer, quoted in the report; they start from random weights instead (as the Qwen2.5 entry)
HF_START = ("--enable-hf2mg-convert", "--model-type-hf")
HF_MOE_TORCH = ("npu-compile convert: --ckpt-format torch: the legacy format of an MoE model (qwen3_moe) is not "
                "written here; use --ckpt-format torch_dist")
VOCAB = 500           # the tokenizer's tokens: under the scaled-down --padded-vocab-size 512
ITERATIONS = 20
RUN = {"--lr": "1e-3", "--min-lr": "1e-5"}  # see the module docstring
ADDED = ["--tensorboard-dir", "tb", "--no-progress-bar"]


@dataclass
class Result:
    name: str
    script: str
    changed: list[str]
    losses: list[float] = field(default_factory=list)
    output: str = ""
    returncode: int = 0
    resumed_at: int | None = None
    hf_start: bool = False
    tensorboard_tags: list[str] = field(default_factory=list)
    layout: str = ""
    model_type_hf: str = "llama2"
    dropped: list[str] = field(default_factory=list)


def _set(argv: list[str], values: dict[str, str]) -> list[str]:
    """argv with the values of the flags in `values` replaced (flags it lacks are left out)."""
    out = list(argv)
    for i, a in enumerate(out):
        if a in values and i + 1 < len(out):
            out[i + 1] = values[a]
    return out


def _flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv and argv.index(name) + 1 < len(argv) else None


def prepare(folder: Path) -> None:
    """data/corpus_text_document (.bin/.idx) and tokenizer/ (an HF tokenizer folder) in `folder`: a byte-level
    BPE of VOCAB tokens trained on the project's own text, saved as transformers' PreTrainedTokenizerFast, and the
    text tokenized by it (`npu-compile preprocess`'s PretrainedFromHF, with the end-of-document token)."""
    from transformers import PreTrainedTokenizerFast

    from megatron_glue.data.demo_data import EOD_TOKEN, byte_level_bpe, corpus_documents
    from megatron_glue.data.preprocess import preprocess

    if (folder / "data" / "corpus_text_document.idx").exists():
        return
    texts = [d["text"] for d in corpus_documents()]
    bpe = byte_level_bpe(texts, VOCAB)
    PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=EOD_TOKEN).save_pretrained(folder / "tokenizer")
    (folder / "data").mkdir(exist_ok=True)
    corpus = folder / "data" / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    with open(os.devnull, "w") as quiet:
        preprocess(str(corpus), str(folder / "data" / "corpus"), tokenizer_type="PretrainedFromHF",
                   tokenizer_name_or_path=str(folder / "tokenizer"), append_eod=True, log=quiet)


def _drop(argv: list[str], names) -> tuple[list[str], list[str]]:
    """argv without the flags in `names` (and their values); the flags dropped, in order."""
    out, dropped, i = [], [], 0
    while i < len(argv):
        j = i + 1
        while j < len(argv) and not argv[j].startswith("--"):
            j += 1
        (dropped if argv[i] in names else out).extend([argv[i]] if argv[i] in names else argv[i:j])
        i = j
    return out, dropped


def save_hf_llama(argv: list[str], root: Path) -> None:
    """A random-init transformers Llama of the scaled-down script's architecture, saved where --load points (the
    script's paths are relative to `root`, where it runs)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from megatron_glue.training.arguments import parse_args
    from megatron_glue.training.gpt import set_vocabulary

    args = parse_args(argv, world_size=2)
    args.tokenizer_name_or_path = str(root / args.tokenizer_name_or_path)
    set_vocabulary(args)
    config = LlamaConfig(
        vocab_size=args.padded_vocab_size, hidden_size=args.hidden_size, intermediate_size=args.ffn_hidden_size,
        num_hidden_layers=args.num_layers, num_attention_heads=args.num_attention_heads,
        num_key_value_heads=args.num_query_groups, head_dim=args.kv_channels,
        max_position_embeddings=args.max_position_embeddings, rms_norm_eps=args.norm_epsilon,
        rope_theta=float(args.rotary_base), tie_word_embeddings=not args.untie_embeddings_and_output_weights,
        attention_bias=False, mlp_bias=False)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(root / args.load)


def _env() -> dict:
    return dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD="0", OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo",
                TORCHINDUCTOR_COMPILE_THREADS="1", PYTHONUNBUFFERED="1")


def launch(folder: Path, argv: list[str], timeout: float) -> subprocess.CompletedProcess:
    """torchrun --nproc_per_node=2 -m megatron_glue.pretrain_gpt <argv>, run in `folder`."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
               "megatron_glue.pretrain_gpt", *argv]
    return subprocess.run(command, cwd=folder, env=_env(), capture_output=True, text=True, timeout=timeout)


def _losses(folder: Path) -> list[float]:
    path = folder / "metrics.jsonl"
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r["lm loss"] for r in rows if r["kind"] == "train" and "lm loss" in r]


def _tags(folder: Path) -> list[str]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    if not folder.exists():
        return []
    return sorted(EventAccumulator(str(folder)).Reload().Tags()["scalars"])


def run_script(name: str, flags: list[str], start: str, folder: Path, iterations: int = ITERATIONS,
               timeout: float = 900, sizes: dict[str, str] | None = None, drop: tuple[str, ...] = (),
               extra: tuple[str, ...] = ()) -> Result:
    """One script, scaled down, trained `iterations` iterations in `folder` (its data prepared there); `sizes`: more
    sizes to scale down (flag -> value), `drop`: flags left out (reported as dropped), `extra`: flags added."""
    folder.mkdir(parents=True, exist_ok=True)
    prepare(folder)
    argv = _set(scale_down(flags), {**RUN, **(sizes or {}), "--train-iters": str(iterations),
                                    "--lr-decay-iters": str(iterations)})
    changed = ["sizes", "paths", "--lr/--min-lr"]
    argv, dropped = _drop(argv, drop)
    if start == "hf-moe":
        argv, more = _drop(_set(argv, MOE_SIZES), MOE_DROPPED + MOE_DROPPED_COMBINED + HF_START)
        dropped += more
        changed[0] = "sizes (MoE: 4 experts of 32, top 2, EP 1)"
    if start == "hf":
        argv = _set(argv, {"--load": "hf"})
        save_hf_llama(argv, folder)
    argv += [*ADDED, *extra, "--metrics-file", "metrics.jsonl"]
    result = Result(name, "", changed + ["+--tensorboard-dir"], hf_start=start == "hf", dropped=dropped,
                    model_type_hf=_flag(argv, "--model-type-hf") or "",
                    layout=f"TP {_flag(argv, '--tensor-model-parallel-size') or 1}, "
                           f"PP {_flag(argv, '--pipeline-model-parallel-size') or 1}"
                           + (f", stages {_flag(argv, '--num-layer-list')}" if "--num-layer-list" in argv else ""))
    if start == "resume":
        half = iterations // 2
        first = launch(folder, [*argv, "--exit-interval", str(half)], timeout)
        result.output = first.stdout + first.stderr
        if first.returncode:
            result.returncode = first.returncode
            return result
        result.changed.append("+--exit-interval (first launch)")
        result.resumed_at = half
    done = launch(folder, argv, timeout)
    result.output += done.stdout + done.stderr
    result.returncode = done.returncode
    result.losses = _losses(folder)
    result.tensorboard_tags = _tags(folder / "tb")
    return result


def check_resumed(result: Result) -> bool:
    return result.resumed_at is not None and re.search(
        rf"successfully loaded checkpoint from .* at iteration\s+{result.resumed_at}\b", result.output) is not None


def report(results: list[Result], source: str, title: str = "Three MindSpeed-LLM training scripts") -> str:
    lines = [
        f"# {title}, run with one word changed",
        "",
        f"Source: Ascend/MindSpeed-LLM ({source}); `python -m bench.mindspeed_scripts --repo <MindSpeed-LLM git dir>`. "
        f"Each script's flags scaled down to a tiny model (4 layers, hidden 64, sequence 32) on 2 gloo processes, "
        f"every other flag kept, trained {ITERATIONS} iterations with `-m megatron_glue.pretrain_gpt` in place of "
        "`pretrain_gpt.py` (see the bench's docstring for what else changes: paths, the learning rate, an added "
        "`--tensorboard-dir`).",
        "",
        "| script | layout (2 processes) | flags dropped (and why) | changed | loss first → last | resumed? | "
        "HF start? | TensorBoard tags | Megatron-LM log lines |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if r.returncode or not r.losses:
            tail = r.output.strip().splitlines()[-1:] or ["no output"]
            lines.append(f"| {r.script} | {r.layout} | – | {', '.join(r.changed)} | **failed** (exit "
                         f"{r.returncode}): `{tail[0][:200]}` | | | | |")
            continue
        lines.append(
            f"| {r.script} | {r.layout} | {', '.join(f'`{d}`' for d in r.dropped) or 'none'} | {', '.join(r.changed)} | {r.losses[0]:.4f} → {r.losses[-1]:.4f} "
            f"({len(r.losses)} iterations) | "
            f"{'yes, at iteration ' + str(r.resumed_at) if check_resumed(r) else 'no'} | "
            f"{f'yes (`--enable-hf2mg-convert --model-type-hf {r.model_type_hf}`)' if r.hf_start else 'no'} | "
            f"{len(r.tensorboard_tags)} ({', '.join(t for t in r.tensorboard_tags if 'vs samples' not in t)}) | "
            f"{_log_lines(r.output)} |")
    dropped = list(dict.fromkeys(d for r in results for d in r.dropped))
    if dropped:
        from megatron_glue.training.arguments import REFUSED

        lines += ["", "Dropped: flags the job refuses, each with the reason its argument check gives.", ""]
        lines += [f"- `{d}`: {REFUSED[d][1]}" for d in dropped if d in REFUSED]
        if any(d in HF_START for d in dropped):
            lines.append(f"- `{' '.join(HF_START)}` (HF weights at start): the converter's answer for these "
                         f"scripts, `{HF_MOE_TORCH}`; they start from random weights")
    return "\n".join(lines)


def _log_lines(output: str) -> str:
    checks = {"arguments dump": "-------------------- end of arguments ---------------------",
              "parameter count": " > number of parameters on (tensor, pipeline) model parallel rank",
              "iteration lines": " iteration       20/      20 | consumed samples:",
              "saved checkpoint": " successfully saved checkpoint from iteration"}
    return ", ".join(name for name, text in checks.items() if text in output)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.mindspeed_scripts", description=__doc__.split("\n")[0])
    parser.add_argument("--repo", required=True, help="a MindSpeed-LLM git directory (bare, or a work tree's .git)")
    parser.add_argument("--work", default=None, help="where the runs go (default: a temporary folder)")
    parser.add_argument("--only", choices=["dense", "moe"], default="dense",
                        help="the three dense scripts (results/mindspeed_scripts.md) or the two MoE ones "
                             "(results/mindspeed_moe_scripts.md)")
    a = parser.parse_args(argv)
    import tempfile

    work = Path(a.work or tempfile.mkdtemp(prefix="mindspeed_scripts_"))
    results, sources = [], []
    for name, rev, path, start in SCRIPTS:
        if (start == "hf-moe") != (a.only == "moe"):
            continue
        commit = _git(a.repo, "rev-parse", "--short", rev).strip()
        sources.append(f"`{rev}` {commit}")
        flags = extract(_git(a.repo, "show", f"{rev}:{path}"))
        result = run_script(name, flags, start, work / Path(path).stem)
        result.script = f"{rev}: {path.removeprefix('examples/mcore/')}"
        results.append(result)
        print(f"{result.script}: exit {result.returncode}, losses {result.losses[:1]} ... {result.losses[-1:]}",
              flush=True)
    moe = a.only == "moe"
    text = report(results, ", ".join(dict.fromkeys(sources)),
                  *(["Two MindSpeed-LLM MoE training scripts"] if moe else []))
    (Path(__file__).parent / "results" / ("mindspeed_moe_scripts.md" if moe else "mindspeed_scripts.md")).write_text(
        text + "\n")
    print(text)
    return 0 if all(r.returncode == 0 and r.losses for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
