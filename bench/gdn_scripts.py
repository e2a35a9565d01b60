"""MindSpeed-LLM's two Gated DeltaNet training scripts (Qwen3-Next's linear attention, `examples/mcore/gated_deltanet/`)
run as their users run them, with one word changed.

    python -m bench.gdn_scripts --repo /path/to/MindSpeed-LLM.git [--rev master]

Each script's launch line scaled down and trained 20 iterations over 2 gloo processes by the machinery of
`bench.mindspeed_scripts` (`run_script`: the census' scale-down, the project's text tokenized by a byte-level BPE
tokenizer folder, `--lr 1e-3`, `--tensorboard-dir` added), compiled (each layer `torch.compile(backend="ascend")`),
every other flag kept. Beside the census' sizes the Gated DeltaNet's own are scaled down (GDN_SIZES: heads of 16, 2
key and 2 value heads, the scripts' 1:1 ratio). Dropped, each for the reason in the report: the HF conversion flags
(DROPPED_CONVERSION: another piece of work's; these runs start from random weights and save Megatron checkpoints),
and the 1.3B script's `--use-ascend-mc2` at TP 1, which the job refuses as MindSpeed itself does. Writes
`bench/results/gdn_scripts.md`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from bench.mindspeed_census import _git, extract
from bench.mindspeed_scripts import ITERATIONS, run_script

SCRIPTS = [
    ("Gated DeltaNet 340M", "examples/mcore/gated_deltanet/pretrain_gated_deltanet_340M_4K_A2_ptd.sh"),
    ("Gated DeltaNet 1.3B", "examples/mcore/gated_deltanet/pretrain_gated_deltanet_1.3B_4K_A3_ptd.sh"),
]
GDN_SIZES = {"--linear-key-head-dim": "16", "--linear-value-head-dim": "16", "--linear-num-key-heads": "2",
             "--linear-num-value-heads": "2"}
# MindSpeed-LLM's HF conversion at start and at save for qwen3-next: not this bench's (the converter's family is
# separate work); --enable-hf2mg-convert is in the launch line only when the script's CKPT_LOAD_DIR names HF weights
# (its default "None": from scratch), but the census' extraction keeps both sides of that `if`
DROPPED_CONVERSION = ("--enable-mg2hf-convert", "--model-type-hf", "--enable-hf2mg-convert")
WHY = {
    "--enable-mg2hf-convert": "Megatron → HF conversion at each save, for qwen3-next: the conversion side's "
                              "(separate work; the job refuses it today); the runs save Megatron checkpoints",
    "--model-type-hf": "the HF family (qwen3-next) of those conversions; the converter has no qwen3-next yet",
    "--enable-hf2mg-convert": "HF weights at start: the script passes it only when CKPT_LOAD_DIR names HF weights "
                              "(its default None trains from scratch, as here)",
    "--use-ascend-mc2": "the 1.3B script passes it at TP 1 (with --sequence-parallel, which TP 1 turns off): the "
                        "job's argument check refuses MC2 without TP > 1, as MindSpeed's own does "
                        "(mindspeed/features_manager/tensor_parallel/mc2.py:23-28, in MindSpeed-LLM's feature list: "
                        "mindspeed_llm/features_manager/__init__.py:192): the script as written stops there too",
}


def _end(folder: Path) -> dict:
    """The job's last metrics row of kind "end" (compiled graphs and graph breaks, training.py _count_graphs)."""
    path = folder / "metrics.jsonl"
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []
    ends = [r for r in rows if r["kind"] == "end"]
    return ends[-1] if ends else {}


def run(name: str, flags: list[str], folder: Path, iterations: int = ITERATIONS, timeout: float = 1800,
        sizes: dict[str, str] | None = None, extra: tuple[str, ...] = ()):
    """One script scaled down and trained in `folder` (`sizes`: more values beside GDN_SIZES, `extra`: flags added);
    (Result, its "end" metrics row)."""
    # the run's own compile caches (the launch's environment is this process's): a warm start from an earlier run's
    # would load its graphs without Dynamo, and the graph count would say 0
    caches = {"TORCHINDUCTOR_CACHE_DIR": str(folder / "compile_cache"),
              "NPU_COMPILE_CACHE_DIR": str(folder / "compile_cache" / "npu_compile")}
    before = {k: os.environ.get(k) for k in caches}
    os.environ.update(caches)
    drop = DROPPED_CONVERSION + (("--use-ascend-mc2",) if "--use-ascend-mc2" in flags else ())
    try:
        result = run_script(name, flags, "random", folder, iterations=iterations, timeout=timeout,
                            sizes={**GDN_SIZES, **(sizes or {})}, drop=drop, extra=extra)
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    (folder / "pretrain_gpt.log").write_text(result.output)
    return result, _end(folder)


def report(runs, source: str) -> str:
    lines = [
        "# MindSpeed-LLM's Gated DeltaNet training scripts, run with one word changed",
        "",
        f"Source: Ascend/MindSpeed-LLM ({source}); `python -m bench.gdn_scripts --repo <MindSpeed-LLM git dir>`. "
        "Each script's flags scaled down (4 layers, hidden 64, sequence 32; Gated DeltaNet heads of 16, 2 key and 2 "
        f"value heads) on 2 gloo processes, every other flag kept, trained {ITERATIONS} iterations with "
        "`-m megatron_glue.pretrain_gpt` in place of `pretrain_gpt.py`, each layer compiled "
        "(`torch.compile(backend=\"ascend\")`); the layers are megatron-core 0.16's GatedDeltaNet with every 3rd "
        "(`--full-attention-interval 3`) full attention (docs/linear_attention.md). Graphs and breaks: Dynamo's "
        "counts in each process at the end of the job (the metrics file's `end` row).",
        "",
        "| script | layout (2 processes) | flags dropped | loss first → last | compiled graphs | graph breaks | "
        "Megatron-LM log lines |",
        "|---|---|---|---|---|---|---|",
    ]
    for result, end in runs:
        dropped = ", ".join(f"`{d}`" for d in result.dropped) or "none"
        if result.returncode or not result.losses:
            tail = result.output.strip().splitlines()[-1:] or ["no output"]
            lines.append(f"| {result.script} | {result.layout} | {dropped} | **failed** (exit {result.returncode}): "
                         f"`{tail[0][:300]}` | | | |")
            continue
        seen = [name for name, text in (
            ("arguments dump", "-------------------- end of arguments ---------------------"),
            ("parameter count", " > number of parameters on (tensor, pipeline) model parallel rank"),
            ("iteration lines", f" iteration {ITERATIONS:>8}/{ITERATIONS:>8} | consumed samples:"),
            ("saved checkpoint", " successfully saved checkpoint from iteration")) if text in result.output]
        lines.append(f"| {result.script} | {result.layout} | {dropped} | {result.losses[0]:.4f} → "
                     f"{result.losses[-1]:.4f} ({len(result.losses)} iterations) | {end.get('graphs', '?')} | "
                     f"{end.get('graph_breaks', '?')} | {', '.join(seen)} |")
    dropped = list(dict.fromkeys(d for result, _ in runs for d in result.dropped))
    lines += ["", "Dropped, and why:", ""] + [f"- `{d}`: {WHY[d]}" for d in dropped]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gdn_scripts", description=__doc__.split("\n")[0])
    parser.add_argument("--repo", required=True, help="a MindSpeed-LLM git directory (bare, or a work tree's .git)")
    parser.add_argument("--rev", default="master", help="the revision whose scripts run (default master)")
    parser.add_argument("--work", default=None, help="where the runs go (default: a temporary folder)")
    parser.add_argument("--only", choices=["340M", "1.3B"], default=None, help="one of the two scripts")
    a = parser.parse_args(argv)
    work = Path(a.work or tempfile.mkdtemp(prefix="gdn_scripts_"))
    commit = _git(a.repo, "rev-parse", "--short", a.rev).strip()
    runs = []
    for name, path in SCRIPTS:
        if a.only and not name.endswith(a.only):
            continue
        flags = extract(_git(a.repo, "show", f"{a.rev}:{path}"))
        result, end = run(name, flags, work / Path(path).stem)
        result.script = f"{a.rev}: {path.removeprefix('examples/mcore/')}"
        runs.append((result, end))
        print(f"{result.script}: exit {result.returncode}, losses {result.losses[:1]} ... {result.losses[-1:]}, "
              f"graphs {end.get('graphs')}, breaks {end.get('graph_breaks')}", flush=True)
    text = report(runs, f"`{a.rev}` {commit}")
    (Path(__file__).parent / "results" / "gdn_scripts.md").write_text(text + "\n")
    print(text)
    return 0 if all(r.returncode == 0 and r.losses for r, _ in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
