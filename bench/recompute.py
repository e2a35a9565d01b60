"""Megatron-LM's activation recompute in the training job: peak memory and step time of `--recompute-granularity
full --recompute-method uniform --recompute-num-layers 1` against no recompute, compiled (backend="ascend") and
eager Megatron (`--no-npu-compile`) with the same flags; and, for the choice docs/recompute.md explains, the
memory planner's own recompute at `memory_budget` 0 on every layer graph.

Each configuration is one run of `python -m megatron_glue.pretrain_gpt` (one process, gloo, mock data, fp32,
dropout 0) in a fresh process. In it, iteration 1 compiles and iteration 2 warms up; iteration 3 is measured with
the profiler's CPU memory events (bench.harness.peak_bytes: peak bytes allocated above the level at the start of
the step: activations, gradients, the optimizer's temporaries) and the later ones are timed (the fastest). Compiled
and eager differ in what the layers save (the compiled layers' fused attention keeps no seq x seq probabilities),
so each recompute row is read against the no-recompute row of its own kind.

Writes bench/results/recompute.md and prints it.

    python -m bench.recompute [--layers 6] [--hidden 128] [--seq 1024] [--iters 10]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

MiB = 2**20
FULL = ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
CONFIGS = {  # name -> (row label, flags)
    "eager": ("eager Megatron, no recompute", ["--no-npu-compile"]),
    "eager-full": ("eager Megatron, full/uniform/1", ["--no-npu-compile", *FULL]),
    "ascend": ("ascend, no recompute", []),
    "ascend-full": ("ascend, full/uniform/1", FULL),
    "ascend-full2": ("ascend, full/uniform/2", [*FULL[:-1], "2"]),
    "ascend-budget0": ("ascend, no flags, memory_budget 0 (the planner)",
                       ["--npu-compile-options", '{"memory_budget": 0.0}']),
}
MEASURED = 3  # the iteration measured for memory (1: compile, 2: warm-up)


def job_flags(layers: int, hidden: int, seq: int, iters: int) -> list[str]:
    return [
        "--num-layers", str(layers), "--hidden-size", str(hidden), "--num-attention-heads", str(max(hidden // 32, 1)),
        "--seq-length", str(seq), "--max-position-embeddings", str(seq), "--micro-batch-size", "2",
        "--global-batch-size", "2", "--mock-data", "--vocab-size", "1000", "--lr", "1e-4", "--train-iters",
        str(iters), "--log-interval", "1", "--eval-iters", "0", "--distributed-backend", "gloo", "--no-progress-bar",
        "--hidden-dropout", "0", "--attention-dropout", "0", "--seed", "1",
    ]


def child(out: str, argv: list[str]) -> int:
    """The job with its train_step measured: iteration MEASURED under the profiler, the rest timed."""
    from bench.harness import peak_bytes
    from megatron_glue import pretrain_gpt
    from megatron_glue.training import training

    original = training.train_step
    seconds, peak = [], []

    def measured_step(*args, **kwargs):
        if len(seconds) + len(peak) + 1 == MEASURED:
            result = []
            peak.append(peak_bytes(lambda: result.append(original(*args, **kwargs))))
            return result[0]
        start = time.perf_counter()
        result = original(*args, **kwargs)
        seconds.append(time.perf_counter() - start)
        return result

    training.train_step = measured_step
    code = pretrain_gpt.main(argv)
    with open(out, "w") as f:
        json.dump({"code": code, "seconds": seconds, "peak": peak}, f)
    return code


def measure(name: str, flags: list[str], folder: str) -> dict:
    out = os.path.join(folder, "result.json")
    env = dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD="0", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
               GLOO_SOCKET_IFNAME="lo", PYTHONPATH=os.getcwd())
    command = [sys.executable, "-m", "bench.recompute", "--child", out, "--", *flags]
    done = subprocess.run(command, cwd=folder, env=env, capture_output=True, text=True)
    if done.returncode or not os.path.exists(out):
        raise RuntimeError(f"{name}: the job failed ({done.returncode}):\n{(done.stdout + done.stderr)[-4000:]}")
    with open(out) as f:
        result = json.load(f)
    timed = result["seconds"][2:]  # after the compiling and the warm-up iterations
    # the fastest step: on a shared machine other processes only ever add time
    return {"peak": result["peak"][0], "step": min(timed)}


def table(rows: dict[str, dict], setup: str) -> str:
    lines = [f"# Activation recompute in the training job\n", setup, "",
             "| configuration | peak memory of a step (MiB) | vs its no-recompute row | step time (ms) | vs its no-recompute row |",
             "|---|---|---|---|---|"]
    for name, r in rows.items():
        base = rows.get("eager" if name.startswith("eager") else "ascend", r)
        lines.append(f"| {CONFIGS[name][0]} | {r['peak'] / MiB:.1f} | {r['peak'] / base['peak']:.2f}x | {r['step'] * 1e3:.0f} | "
                     f"{r['step'] / base['step']:.2f}x |")
    return "\n".join(lines) + "\n"


def main() -> None:
    if "--child" in sys.argv:
        i = sys.argv.index("--child")
        sys.exit(child(sys.argv[i + 1], sys.argv[sys.argv.index("--") + 1:]))
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated, of " + ", ".join(CONFIGS))
    a = p.parse_args()
    flags = job_flags(a.layers, a.hidden, a.seq, a.iters)
    rows = {}
    for name in a.configs.split(","):
        with tempfile.TemporaryDirectory(prefix="recompute_bench_") as folder:
            start = time.perf_counter()
            rows[name] = measure(name, [*flags, *CONFIGS[name][1]], folder)
            print(f"{name}: {rows[name]['peak'] / MiB:.1f} MiB, {rows[name]['step'] * 1e3:.0f} ms "
                  f"({time.perf_counter() - start:.0f} s)", flush=True)
    setup = (f"megatron-core GPT, {a.layers} layers, hidden {a.hidden}, {max(a.hidden // 32, 1)} heads, seq {a.seq}, "
             f"micro-batch 2, fp32, dropout 0, one CPU process (`python -m megatron_glue.pretrain_gpt`). Peak memory: "
             f"iteration {MEASURED} under the profiler's CPU memory events, bytes above the step's start; step time: "
             f"the fastest of iterations {MEASURED + 1}..{a.iters} (the machine is shared: other processes only add "
             "time). Each recompute row is compared with the "
             "no-recompute row of its own kind (eager or compiled).")
    text = table(rows, setup)
    from bench.harness import write_result

    write_result("recompute", text)
    print(text)


if __name__ == "__main__":
    main()
