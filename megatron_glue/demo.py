"""`make demo`: the seed's Megatron-LM job, scaled down, on 2 processes, every transformer layer compiled.

    python -m megatron_glue.demo [--out demo_out] [--eager-too]

It makes the embedded data (a corpus from the project's own text, a BPE trained on it, `npu-compile preprocess`),
runs `torchrun --nproc_per_node 2 -m megatron_glue.pretrain_gpt` with the seed script's flags scaled down
(`--distributed-backend gloo`), then shows the loss curve and where the checkpoints, dumps and metrics are.
`--eager-too` runs the same job again with `--no-npu-compile` and prints the step-time ratio of the two.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path


def seed_flags(data: dict, out: Path) -> list[str]:
    """The seed script's flags, sizes scaled down for two CPU processes, and bf16 for its fp16: a CPU has no
    fp16 matrix units (fp16 steps run ~15x slower than bf16 here), Ascend trains in either."""
    return [
        "--num-layers", "4", "--hidden-size", "128", "--num-attention-heads", "4",
        "--micro-batch-size", "4", "--global-batch-size", "16", "--seq-length", "128",
        "--max-position-embeddings", "128",
        "--data-path", data["data_prefix"], "--vocab-file", data["vocab_file"], "--merge-file", data["merge_file"],
        "--save", str(out / "ckpt"), "--load", str(out / "ckpt"), "--log-interval", "10", "--save-interval", "50",
        "--eval-interval", "50", "--distributed-backend", "gloo", "--bf16",
        "--train-iters", "100", "--lr", "1e-3", "--lr-warmup-iters", "10", "--eval-iters", "5",
    ]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ascii_curve(values: list[float], width: int = 60, height: int = 10) -> str:
    """The loss curve in the terminal (the PNG has the real one)."""
    if len(values) < 2:
        return ""
    step = -(-len(values) // width)  # ceil: at most `width` columns
    points = [statistics.fmean(values[i:i + step]) for i in range(0, len(values), step)]
    lo, hi = min(points), max(points)
    rows = []
    for r in range(height):
        level = hi - (hi - lo) * r / (height - 1)
        rows.append(f"{level:7.3f} |" + "".join("*" if abs(p - level) <= (hi - lo) / (2 * (height - 1)) + 1e-12
                                                else " " for p in points))
    rows.append(" " * 8 + "+" + "-" * len(points) + f"> iteration (1..{len(values)})")
    return "\n".join(rows)


def _train_rows(metrics: Path) -> list[dict]:
    return [r for r in map(json.loads, metrics.read_text().splitlines()) if r["kind"] == "train"]


def _median_step_ms(log: str) -> float | None:
    """Median of the logged 'elapsed time per iteration' after the first interval (which holds the compile)."""
    times = [float(t) for t in re.findall(r"elapsed time per iteration \(ms\): ([\d.]+)", log)]
    return statistics.median(times[1:]) if len(times) > 1 else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatron_glue.demo", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="demo_out", help="where data, checkpoints, dumps and metrics go")
    parser.add_argument("--eager-too", action="store_true", help="also run --no-npu-compile and compare step times")
    args = parser.parse_args(argv)
    out = Path(args.out).resolve()
    from megatron_glue.data.demo_data import make_demo_data

    data = make_demo_data(str(out / "data"))
    print(f"data: {data['documents']} documents of the project's own text, BPE vocab {data['vocab_size']}, "
          f"{data['data_prefix']}.bin/.idx", flush=True)
    runs = {"compiled": [], "eager": ["--no-npu-compile"]} if args.eager_too else {"compiled": []}
    results = {}
    for name, extra in runs.items():
        folder = out / name
        shutil.rmtree(folder, ignore_errors=True)  # a fresh job each time (else --load resumes the last one)
        folder.mkdir(parents=True)
        dumps = folder / "dumps"
        flags = seed_flags(data, folder) + extra + ["--no-progress-bar"] * (name != "compiled")
        if name == "compiled":
            flags += ["--npu-compile-options", json.dumps({"dump_dir": str(dumps)})]
        log = folder / "log.txt"
        code, seconds = _tee(flags, folder, log)
        if code:
            print(f"the {name} job failed (exit code {code}); its log: {log}")
            return code
        results[name] = (seconds, _median_step_ms(log.read_text()))

    folder = out / "compiled"
    rows = _train_rows(folder / "ckpt" / "metrics.jsonl")
    losses = [r["lm loss"] for r in rows if "lm loss" in r and not r["skipped"]]
    print("\nlm loss (not-skipped iterations):\n" + ascii_curve(losses))
    reports = sorted((folder / "dumps").rglob("report.json"))
    fused = {}
    for path in reports:
        for rule, count in json.loads(path.read_text())["fusions"].items():
            fused[rule] = fused.get(rule, 0) + count
    print(f"\nloss curve:   {folder / 'ckpt' / 'loss_curve.png'}")
    print(f"checkpoints:  {folder / 'ckpt'} (latest: iteration "
          f"{(folder / 'ckpt' / 'latest_checkpointed_iteration.txt').read_text()})")
    print(f"dumps:        {folder / 'dumps'} ({len(reports)} graphs with report.json; fused sites: "
          f"{', '.join(f'{k} {v}' for k, v in fused.items() if v) or 'none'})")
    print(f"metrics:      {folder / 'ckpt' / 'metrics.jsonl'}")
    print(f"log:          {folder / 'log.txt'}")
    seconds, step = results["compiled"]
    print(f"\ncompiled job: {seconds:.0f} s in all, median step {step:.1f} ms after the first interval")
    if "eager" in results:
        eager_seconds, eager_step = results["eager"]
        print(f"eager job:    {eager_seconds:.0f} s in all, median step {eager_step:.1f} ms "
              f"(compiled / eager step time: {step / eager_step:.2f})")
    return 0


def _tee(flags: list[str], folder: Path, log: Path) -> tuple[int, float]:
    """torchrun the job on 2 processes, rank 0's lines shown here and everything kept in `log`; returns
    (exit code, seconds)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--nnodes=1", "--node_rank=0",
               "--master_addr=127.0.0.1", f"--master_port={_free_port()}", "-m", "megatron_glue.pretrain_gpt",
               *flags]
    env = dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD="0", OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    print("\n$ torchrun --nproc_per_node=2 -m megatron_glue.pretrain_gpt " + " ".join(flags), flush=True)
    started = time.perf_counter()
    with open(log, "w") as f:
        job = subprocess.Popen(command, env=env, cwd=folder, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True)
        for line in job.stdout:
            f.write(line)
            if not line.startswith("[rank"):  # rank 0's log lines and every warning; the rest stays in `log`
                print(line, end="", flush=True)
        code = job.wait()
    return code, time.perf_counter() - started


if __name__ == "__main__":
    sys.exit(main())
