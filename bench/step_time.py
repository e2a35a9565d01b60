"""CPU training-step time of a megatron-core GPT (hidden 128, 4 heads, batch 2, fp32): eager, Inductor, ascend on
the whole model (``megatron_glue.adapt()`` + ``torch.compile(gpt_model, backend="ascend")``; adapt()'s default
groups make each layer a frame of its own) and ascend per layer as the training job compiles it
(``megatron_glue.training.training.compile_model``), at sequence 128 / 1024 / 2048 and 2 / 8 / 32 layers; and
"regions", the whole model with its layers one nested compile region of the model's one graph
(``megatron_glue.adapt(groups_for(one_graph=True))``), which needs a process of its own: it is timed in a second
process per row, beside an eager model of its own, and given as a ratio to that eager.

Each (sequence, layers) cell runs in a fresh process that builds the four models from one seed, compiles them,
takes two warm-up steps each, then times their steps in turn (eager, Inductor, ascend, job, eager, ...) so that
the machine's load falls on all four alike; a step is forward, backward and the AdamW step, the figure the
median of at least ``--repeats`` steps, and of as many more rounds as it takes every column to have run
``--min-seconds`` of steps: at sequence 128 a step takes milliseconds, and five of them measure the machine's
noise (±3 %) more than the step. Peak memory: profiler CPU memory events over one forward+backward (bench.harness).
Writes bench/results/step_time.md and step_time.png.

    python -m bench.step_time [--seqs 128,1024,2048] [--layers 2,8,32] [--repeats 5] [--min-seconds 3] [--threads 1]
                              [--skip inductor:32] [--skip inductor:32:2048 ...] [--update]

``--skip COLUMN:LAYERS[:SEQ]`` leaves a column out of the cells it names (Inductor takes minutes to compile 32
layers); a skipped figure shows as "–". ``--update`` measures the rows asked for and keeps the table's others (each
row one process, its columns side by side); the table names the run of each row.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

COLUMNS = ("eager", "inductor", "ascend", "job", "regions")
# The process of the "regions" column adapts megatron-core for one graph (a group the other columns cannot share).
ONE_GRAPH = ("regions",)
HIDDEN, HEADS, BATCH, VOCAB = 128, 4, 2, 128
MiB = 2**20

_CHILD = r"""
import json, statistics, sys, time, types
import torch
import megatron_glue
from megatron_glue.capture import models
from megatron_glue.training.training import compile_model
from bench.harness import peak_bytes
from megatron_glue.capture.adaptations import groups_for
seq, layers, repeats, columns = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4].split(",")
hidden, heads, batch, vocab, threads = (int(a) for a in sys.argv[5:10])
min_seconds = float(sys.argv[10])
megatron_glue.adapt(groups_for(one_graph="regions" in columns)); models.init_single_process()
torch.set_num_threads(threads)
data = models.synthetic_batch(batch, seq, vocab, seed=0)
runs = {}
for column in columns:
    model = models.build_gpt_model(models.gpt_config(hidden_size=hidden, num_attention_heads=heads,
                                                     num_layers=layers), vocab, seq, seed=0)
    if column == "inductor":
        model = torch.compile(model)
    elif column in ("ascend", "regions"):
        model = torch.compile(model, backend="ascend")
    elif column == "job":
        compile_model(model, types.SimpleNamespace(npu_compile_options={}))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    t = time.perf_counter()
    losses = [models.train_step(model, data, opt)]  # compiles
    compile_s = time.perf_counter() - t
    losses.append(models.train_step(model, data, opt))  # warm-up
    runs[column] = dict(model=model, opt=opt, times=[], compile_s=compile_s, losses=losses)
rounds = 0
while rounds < repeats or any(sum(r["times"]) < min_seconds for r in runs.values()):
    rounds += 1
    for r in runs.values():
        t = time.perf_counter()
        models.train_step(r["model"], data, r["opt"])
        r["times"].append(time.perf_counter() - t)
out = {}
for column, r in runs.items():
    model = r["model"]

    def fwd_bwd():
        for p in model.parameters():
            p.grad = None
        models.loss_fn(model, data).backward()

    out[column] = dict(step_s=statistics.median(r["times"]), times=r["times"], peak=peak_bytes(fwd_bwd),
                       compile_s=r["compile_s"], losses=r["losses"])
print(json.dumps(out))
"""


def measure(seq: int, layers: int, repeats: int, columns: list[str], threads: int, min_seconds: float = 0.0) -> dict:
    root = Path(__file__).parent.parent
    with tempfile.TemporaryDirectory() as cache, tempfile.TemporaryDirectory() as inductor:
        env = dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD="0", OMP_NUM_THREADS=str(threads),
                   NPU_COMPILE_CACHE_DIR=cache, TORCHINDUCTOR_CACHE_DIR=inductor, PYTHONWARNINGS="ignore",
                   PYTHONPATH=os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])))
        done = subprocess.run([sys.executable, "-c", _CHILD, str(seq), str(layers), str(repeats), ",".join(columns),
                               str(HIDDEN), str(HEADS), str(BATCH), str(VOCAB), str(threads), str(min_seconds)],
                              env=env, capture_output=True, text=True, timeout=7200, cwd=root)
    if done.returncode:
        raise RuntimeError(f"seq {seq}, {layers} layers failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def skipped(skips: list[str], column: str, layers: int, seq: int) -> bool:
    for s in skips:
        parts = s.split(":")
        if len(parts) not in (2, 3) or parts[0] not in COLUMNS:
            raise SystemExit(f"--skip {s!r}: expected COLUMN:LAYERS[:SEQ] with COLUMN one of {', '.join(COLUMNS)}")
        if parts[0] == column and int(parts[1]) == layers and (len(parts) == 2 or int(parts[2]) == seq):
            return True
    return False


def table(cells: list[tuple[int, int, dict]]) -> str:
    def ms(r, c):  # a tenth of a millisecond where steps take tens of them
        if c not in r:
            return "–"
        v = r[c]["step_s"] * 1e3
        return f"{v:.1f}" if v < 100 else f"{v:.0f}"

    def ratio(r, c, base):
        return f"{r[c]['step_s'] / r[base]['step_s']:.2f}" if c in r and base in r else "–"

    def regions(r):  # against the eager of its own process
        return ratio(r, "regions", "regions_eager")

    def peak(r, c):
        return f"{r[c]['peak'] / MiB:.0f}" if c in r else "–"

    def steps(r):  # every column of a row times the same rounds
        return str(min(len(v["times"]) for v in r.values()))

    head = ["seq", "layers", "eager ms", "inductor ms", "ascend ms", "job ms", "ascend ×eager", "ascend ×inductor",
            "job ×eager", "job ×inductor", "inductor ×eager", "regions ×eager", "steps",
            "peak MiB eager / inductor / ascend / job / regions"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for seq, layers, r in cells:
        lines.append("| " + " | ".join([
            str(seq), str(layers), ms(r, "eager"), ms(r, "inductor"), ms(r, "ascend"), ms(r, "job"),
            ratio(r, "ascend", "eager"), ratio(r, "ascend", "inductor"), ratio(r, "job", "eager"),
            ratio(r, "job", "inductor"), ratio(r, "inductor", "eager"), regions(r), steps(r),
            " / ".join(peak(r, c) for c in COLUMNS)]) + " |")
    return "\n".join(lines)


def plot(cells: list[tuple[int, int, dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"s{seq}\nL{layers}" for seq, layers, _ in cells]
    fig, ax = plt.subplots(figsize=(max(8, len(cells) * 1.1), 4.5))
    shown = ("inductor", "ascend", "job", "regions")
    width = 0.8 / len(shown)
    for i, c in enumerate(shown):
        base = "regions_eager" if c == "regions" else "eager"
        ys = [r[c]["step_s"] / r[base]["step_s"] if c in r and base in r else 0 for _, _, r in cells]
        ax.bar([x + i * width for x in range(len(cells))], ys, width, label=c)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([x + width for x in range(len(cells))], labels, fontsize=8)
    ax.set_ylabel("median step time × eager")
    ax.set_title(f"megatron-core GPT training step on CPU (hidden {HIDDEN}, batch {BATCH}, fp32)")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(rows: list[tuple[int, int, dict, str]], args: argparse.Namespace, torch_version: str) -> Path:
    cells = [(seq, layers, r) for seq, layers, r, _ in rows]
    runs = sorted({run for *_, run in rows})
    origin = "" if len(runs) == 1 else " Rows from more than one run (`--update`): " + "; ".join(
        f"{run}: " + ", ".join(f"seq {s} × {n} layers" for s, n, _, r in rows if r == run) for run in runs) + "."
    text = (
        f"# CPU training-step time: eager vs Inductor vs ascend (whole model and per layer)\n\n"
        f"megatron-core GPTModel, hidden {HIDDEN}, {HEADS} heads, LayerNorm + GeLU, causal, batch {BATCH}, vocab "
        f"{VOCAB}, fp32; torch {torch_version}, {platform.machine()}, {args.threads} thread(s) on {os.cpu_count()} "
        f"cores. A step is forward, backward and AdamW; median of at least {args.repeats} steps and "
        f"of at least {args.min_seconds:g} s of steps per column (\"steps\": how many), after two warm-up steps, the "
        f"first four columns timed in turn in one process per row. ascend = `torch.compile(gpt_model, "
        f"backend=\"ascend\")` after `megatron_glue.adapt()` (its default groups: each layer a frame of its own, "
        f"group `layer_frames`); job = the training job's per-layer compile (`compile_model`); regions = the same "
        f"`torch.compile` after `adapt(groups_for(one_graph=True))` (the layers one nested compile region of one "
        f"graph), timed in a second process per row in turn with an eager model of its own, its ratio to that "
        f"eager. Peak: profiler CPU "
        f"memory events over one forward+backward. `python -m bench.step_time`"
        + (f" (skipped: {', '.join(args.skip)})" if args.skip else "") + "." + origin + "\n\n" + table(cells) + "\n"
    )
    from bench.harness import write_result

    out = write_result("step_time", text.rstrip("\n"))
    (out.parent / "step_time.json").write_text(json.dumps([[s, n, r, run] for s, n, r, run in rows], indent=1))
    plot(cells, out.with_suffix(".png"))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.step_time", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqs", default="128,1024,2048")
    p.add_argument("--layers", default="2,8,32")
    p.add_argument("--repeats", type=int, default=5, help="the fewest timed steps of a column (default 5)")
    p.add_argument("--min-seconds", type=float, default=3.0,
                   help="time each column's steps until it has run this long, in rounds of one step a column "
                        "(default 3)")
    p.add_argument("--threads", type=int, default=1,
                   help="intra-op threads (default 1: on a shared machine OpenMP's barriers measure the load)")
    p.add_argument("--skip", action="append", default=[], metavar="COLUMN:LAYERS[:SEQ]")
    p.add_argument("--update", action="store_true",
                   help="measure only the rows asked for and keep the other rows of results/step_time.json (each "
                        "row is its own process: its columns stay side by side); the table says which run each "
                        "row is from")
    args = p.parse_args(argv)
    import torch

    cells = []
    kept: list[tuple[int, int, dict, str]] = []
    if args.update:
        stored = json.loads((Path(__file__).parent / "results" / "step_time.json").read_text())
        wanted = {(int(s), int(n)) for n in args.layers.split(",") for s in args.seqs.split(",")}
        kept = [(c[0], c[1], c[2], c[3] if len(c) > 3 else "an earlier run") for c in stored
                if (c[0], c[1]) not in wanted]
    run = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())  # two runs of one day (loaded, quiet) stay apart
    for layers in (int(n) for n in args.layers.split(",")):
        for seq in (int(s) for s in args.seqs.split(",")):
            columns = [c for c in COLUMNS if not skipped(args.skip, c, layers, seq)]
            print(f"seq {seq}, {layers} layers: {', '.join(columns)} ...", flush=True)
            r = measure(seq, layers, args.repeats, [c for c in columns if c not in ONE_GRAPH], args.threads,
                        args.min_seconds)
            if any(c in ONE_GRAPH for c in columns):  # its own process, beside an eager of its own
                second = measure(seq, layers, args.repeats, ["eager", *ONE_GRAPH], args.threads, args.min_seconds)
                r.update({c: second[c] for c in ONE_GRAPH}, regions_eager=second["eager"])
            cells.append((seq, layers, r, run))
            print("  " + ", ".join(f"{c} {v['step_s'] * 1e3:.0f} ms" for c, v in r.items()), flush=True)
            rows = sorted(kept + cells, key=lambda c: (c[1], c[0]))
            out = write(rows, args, torch.__version__)  # after each row: a long run leaves what it measured
    print("\n" + out.read_text() + f"\nwritten to {out} and {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
