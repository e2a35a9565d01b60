"""CPU training-step time of a megatron-core MoE GPT: eager, Inductor, ascend on the whole model
(``megatron_glue.adapt()`` + ``torch.compile(gpt_model, backend="ascend")``) and ascend per layer as the training
job compiles it (``megatron_glue.training.training.compile_model``), with the allgather and alltoall dispatchers.

The model: every layer an MoE layer (megatron-core's local spec: TopKRouter, the token dispatcher, SequentialMLP
experts), 8 SwiGLU experts, top-2, aux loss on (coefficient 0.01), RMSNorm, RoPE, hidden 256, 4 heads, expert
hidden 512, batch 2, vocab 128, fp32, one process (EP 1). Dynamo's MoE settings are the job's
(``training.moe_dynamo_config``: capture_scalar_outputs, capture_dynamic_output_shape_ops), set for every compiled
column alike.

Each (sequence, layers, dispatcher) cell runs in a fresh process that builds the four models from one seed,
compiles them, takes two warm-up steps each (the first timed as the compile step), then times their steps in turn
(eager, Inductor, ascend, job, eager, ...) so that the machine's load falls on all four alike; a step is forward,
backward and the AdamW step, the figure the median of ``--repeats``. Peak memory: profiler CPU memory events over
one forward+backward (bench.harness). Graphs and breaks: Dynamo's compilation metrics (the frame each graph comes
from, its graph-break count) and ``counters["graph_break"]``; fusions: each compiled graph's report.json
(``npu_compile.debug.report.collect``), every rule it names. Writes bench/results/moe_step.{md,json,png}.

    python -m bench.moe_step [--seqs 128,1024] [--layers 2] [--dispatchers allgather,alltoall]
                             [--repeats 5] [--threads 1] [--skip inductor:8[:1024[:alltoall]]] [--append]

Why these shapes: hidden 256 with 8 experts of hidden 512 keeps the experts' matmuls (each expert gets about a
quarter of the tokens) the bulk of the step, so the figures are the MoE path's, not attention's, where the fused
attention wins alone (bench/results/step_time.md: 0.25-0.37x eager at seq 1024-2048); seq 128 is the size where
compiled graphs have the least to gain (launch-bound on a CPU, small matmuls), seq 1024 the size where activations
dominate. On a 2-core machine the compiled columns take minutes to compile each (Inductor 3-4, ascend whole-model
1-3 at 2 layers), so the default runs 2 layers; `--layers 2,8 --skip inductor:8 --skip ascend:8` adds the job's
per-layer compile at 8 layers, where one layer graph serves every layer.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

COLUMNS = ("eager", "inductor", "ascend", "job")
COMPILED = COLUMNS[1:]
HIDDEN, HEADS, FFN, EXPERTS, TOPK, AUX, BATCH, VOCAB = 256, 4, 512, 8, 2, 0.01, 2, 128
MiB = 2**20

_CHILD = r"""
import collections, json, statistics, sys, time, types
from pathlib import Path
import torch
import torch._dynamo.utils as dynamo_utils
import megatron_glue
from megatron_glue.capture import models
from megatron_glue.training.training import compile_model, moe_dynamo_config
from npu_compile.debug.report import collect
from bench.harness import peak_bytes
megatron_glue.adapt(); models.init_single_process()
moe_dynamo_config()  # the job's Dynamo settings for MoE, for every compiled column alike
seq, layers, dispatcher, repeats, columns = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), \
    sys.argv[5].split(",")
hidden, heads, ffn, experts, topk, batch, vocab, threads = (int(a) for a in sys.argv[6:14])
aux = float(sys.argv[14])
torch.set_num_threads(threads)
data = models.synthetic_batch(batch, seq, vocab, seed=0)


def kind(m):
    return f"{Path(m.co_filename).stem}.{m.co_name}"


runs = {}
for column in columns:
    model = models.build_gpt_model(models.llama_config(
        hidden_size=hidden, num_attention_heads=heads, num_layers=layers, ffn_hidden_size=ffn,
        num_moe_experts=experts, moe_router_topk=topk, moe_ffn_hidden_size=ffn, moe_aux_loss_coeff=aux,
        moe_router_load_balancing_type="aux_loss", moe_token_dispatcher_type=dispatcher), vocab, seq, seed=0)
    if column == "inductor":
        model = torch.compile(model)
    elif column == "ascend":
        model = torch.compile(model, backend="ascend")
    elif column == "job":
        compile_model(model, types.SimpleNamespace(npu_compile_options={}, num_experts=experts))
    spans, hooks = [], []  # job: [module kind, first report, end] of each compiled module's call (it compiles)
    if column == "job":
        for module, name in [(model.embedding, "language_model_embedding.forward"),
                             *((layer, "transformer_layer.forward") for layer in model.decoder.layers)]:
            hooks += [module.register_forward_pre_hook(
                          lambda m, a, name=name: spans.append([name, len(reports), None])),
                      module.register_forward_hook(lambda m, a, o: spans[-1].__setitem__(2, len(reports)))]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    dynamo_utils.clear_compilation_metrics()
    dynamo_utils.counters.clear()
    with collect() as reports:
        t = time.perf_counter()
        losses = [models.train_step(model, data, opt)]  # compiles (forward, then backward)
        compile_s = time.perf_counter() - t
        losses.append(models.train_step(model, data, opt))  # warm-up
    for h in hooks:
        h.remove()
    metrics = [m for m in dynamo_utils.get_compilation_metrics() if m.graph_op_count]
    by_id = {str(m.compile_id).replace("/", "_"): kind(m) for m in metrics}
    for name, start, end in spans:  # the job compiles through precompile (aot_compile): no Dynamo metrics
        by_id.update((r.graph_id, name) for r in reports[start:end])
    # the job's output layer and loss (chunk._postprocess) compile inside GPTModel.forward, outside the hooks
    other = "gpt_model._postprocess" if column == "job" else "?"
    graph_reports = [dict(kind=by_id.get(r.graph_id, other), graph_id=r.graph_id, fusions=dict(r.fusions),
                          unfused=dict(collections.Counter(u.get("rule", "?") for u in r.unfused)),
                          graph_breaks=r.graph_breaks, graph_break_reason=r.graph_break_reason,
                          reused_by=r.reused_by, compile_s=sum(r.compile_s.values()))
                     for r in reports]
    graphs = collections.Counter(kind(m) for m in metrics) if column == "inductor" else \
        collections.Counter(g["kind"] for g in graph_reports)
    runs[column] = dict(model=model, opt=opt, times=[], compile_s=compile_s, losses=losses, graphs=dict(graphs),
                        graph_breaks=sum(dynamo_utils.counters["graph_break"].values()),
                        break_reasons=sorted(set(dynamo_utils.counters["graph_break"])),
                        unique_graphs=dynamo_utils.counters["stats"]["unique_graphs"], reports=graph_reports)
for _ in range(repeats):
    for r in runs.values():
        t = time.perf_counter()
        models.train_step(r["model"], data, r["opt"])
        r["times"].append(time.perf_counter() - t)
out = {}
for column, r in runs.items():
    model = r.pop("model")
    r.pop("opt")

    def fwd_bwd():
        for p in model.parameters():
            p.grad = None
        models.loss_fn(model, data).backward()

    out[column] = dict(r, step_s=statistics.median(r["times"]), peak=peak_bytes(fwd_bwd))
print(json.dumps(out))
"""


def measure(seq: int, layers: int, dispatcher: str, repeats: int, columns: list[str], threads: int) -> dict:
    root = Path(__file__).parent.parent
    with tempfile.TemporaryDirectory() as cache, tempfile.TemporaryDirectory() as inductor:
        env = dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD="0", OMP_NUM_THREADS=str(threads),
                   NPU_COMPILE_CACHE_DIR=cache, TORCHINDUCTOR_CACHE_DIR=inductor, PYTHONWARNINGS="ignore",
                   TORCHINDUCTOR_COMPILE_THREADS="1",
                   PYTHONPATH=os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])))
        done = subprocess.run([sys.executable, "-c", _CHILD, str(seq), str(layers), dispatcher, str(repeats),
                               ",".join(columns), *map(str, (HIDDEN, HEADS, FFN, EXPERTS, TOPK, BATCH, VOCAB,
                                                              threads, AUX))],
                              env=env, capture_output=True, text=True, timeout=7200, cwd=root)
    if done.returncode:
        raise RuntimeError(f"seq {seq}, {layers} layers, {dispatcher} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def skipped(skips: list[str], column: str, layers: int, seq: int, dispatcher: str) -> bool:
    for s in skips:
        parts = s.split(":")
        if not 2 <= len(parts) <= 4 or parts[0] not in COLUMNS:
            raise SystemExit(f"--skip {s!r}: expected COLUMN:LAYERS[:SEQ[:DISPATCHER]] with COLUMN one of "
                             f"{', '.join(COLUMNS)}")
        if (parts[0] == column and int(parts[1]) == layers and (len(parts) < 3 or int(parts[2]) == seq)
                and (len(parts) < 4 or parts[3] == dispatcher)):
            return True
    return False


Cell = tuple[int, int, str, dict]


def step_table(cells: list[Cell]) -> str:
    def ms(r, c):
        return f"{r[c]['step_s'] * 1e3:.0f}" if c in r else "–"

    def ratio(r, c, base):
        return f"{r[c]['step_s'] / r[base]['step_s']:.2f}" if c in r and base in r else "–"

    def peak(r, c):
        return f"{r[c]['peak'] / MiB:.0f}" if c in r else "–"

    def first(r, c):
        return f"{r[c]['compile_s']:.1f}" if c in r else "–"

    head = ["seq", "layers", "dispatcher", "eager ms", "inductor ms", "ascend ms", "job ms", "ascend ×eager",
            "ascend ×inductor", "job ×eager", "job ×inductor", "inductor ×eager",
            "peak MiB eager / inductor / ascend / job", "first step s eager / inductor / ascend / job"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for seq, layers, dispatcher, r in cells:
        lines.append("| " + " | ".join([
            str(seq), str(layers), dispatcher, ms(r, "eager"), ms(r, "inductor"), ms(r, "ascend"), ms(r, "job"),
            ratio(r, "ascend", "eager"), ratio(r, "ascend", "inductor"), ratio(r, "job", "eager"),
            ratio(r, "job", "inductor"), ratio(r, "inductor", "eager"),
            " / ".join(peak(r, c) for c in COLUMNS), " / ".join(first(r, c) for c in COLUMNS)]) + " |")
    return "\n".join(lines)


def _fusions(reports: list[dict], key: str) -> str:
    """Sites per rule in each graph kind, summed over its graphs as report.json names them (a graph run by N
    layers counted once)."""
    parts = []
    for kind in dict.fromkeys(g["kind"] for g in reports):
        total: dict[str, int] = {}
        for g in reports:
            if g["kind"] == kind:
                for rule, n in g[key].items():
                    if n:
                        total[rule] = total.get(rule, 0) + n
        if total:
            parts.append(f"{kind}: " + ", ".join(f"{rule} {n}" for rule, n in sorted(total.items())))
    return "; ".join(parts) or "none"


def graph_table(cells: list[Cell]) -> str:
    head = ["seq", "layers", "dispatcher", "column", "graphs per frame (kind)", "graph breaks", "loss Δ vs eager",
            "fusions (report.json)", "declined sites (report.json unfused)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for seq, layers, dispatcher, r in cells:
        for c in COMPILED:
            if c not in r:
                continue
            x = r[c]
            graphs = ", ".join(f"{k} {n}" for k, n in sorted(x["graphs"].items()))
            shared = [g for g in x["reports"] if g["reused_by"] > 1]
            if shared:
                graphs += " (" + ", ".join(f"{g['kind']} run by {g['reused_by']} layers" for g in shared) + ")"
            delta = (max(abs(a - b) / abs(b) for a, b in zip(x["losses"], r["eager"]["losses"]))
                     if "eager" in r else None)
            breaks = str(x["graph_breaks"]) + (f" ({'; '.join(x['break_reasons'])})" if x["break_reasons"] else "")
            lines.append("| " + " | ".join([
                str(seq), str(layers), dispatcher, c, graphs, breaks, "–" if delta is None else f"{delta:.1e}",
                _fusions(x["reports"], "fusions") if c != "inductor" else "–",
                _fusions(x["reports"], "unfused") if c != "inductor" else "–"]) + " |")
    return "\n".join(lines)


def plot(cells: list[Cell], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"s{seq} L{layers}\n{dispatcher}" for seq, layers, dispatcher, _ in cells]
    fig, axes = plt.subplots(1, 2, figsize=(max(12, len(cells) * 1.6), 4.8))
    width = 0.8 / len(COMPILED)
    for ax, key, ylabel in ((axes[0], "step_s", "median step time × eager"), (axes[1], "peak", "peak memory × eager")):
        for i, c in enumerate(COMPILED):
            ys = [r[c][key] / r["eager"][key] if c in r and "eager" in r else 0 for *_, r in cells]
            ax.bar([x + i * width for x in range(len(cells))], ys, width, label=c)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks([x + width for x in range(len(cells))], labels, fontsize=7)
        ax.set_ylabel(ylabel)
    axes[1].legend(loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.suptitle(f"megatron-core MoE GPT training step on CPU ({EXPERTS} SwiGLU experts top-{TOPK}, aux loss "
                 f"{AUX}, hidden {HIDDEN}, batch {BATCH}, fp32)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(cells: list[Cell], args: argparse.Namespace, torch_version: str) -> Path:
    text = (
        f"# CPU training step of an MoE GPT: eager vs Inductor vs ascend (whole model and per layer)\n\n"
        f"megatron-core GPTModel, every layer MoE: {EXPERTS} SwiGLU experts (SequentialMLP, expert hidden {FFN}), "
        f"top-{TOPK} softmax router, aux loss on (coefficient {AUX}), RMSNorm, RoPE, hidden {HIDDEN}, {HEADS} "
        f"heads, causal, batch {BATCH}, vocab {VOCAB}, fp32, EP 1; torch {torch_version}, {platform.machine()}, "
        f"{args.threads} thread(s) on {os.cpu_count()} cores. A step is forward, backward and AdamW; median of "
        f"{args.repeats} steps after two warm-up steps (the first is the \"first step\" column: compile included), "
        f"the four columns timed in turn in one process per row. ascend = `torch.compile(gpt_model, "
        f"backend=\"ascend\")` after `megatron_glue.adapt()`; job = the training job's per-layer compile "
        f"(`compile_model`); every compiled column with the job's Dynamo MoE settings (`moe_dynamo_config`). Peak: "
        f"profiler CPU memory events over one forward+backward. `python -m bench.moe_step`"
        + (f" (skipped: {', '.join(args.skip)})" if args.skip else "") + ".\n\n## Step time and peak memory\n\n"
        + step_table(cells) + "\n\n## Graphs, breaks and fusions\n\n"
        "Graphs per frame: Dynamo's compilation metrics, one entry per graph, named by the source file and function "
        "of its frame (`gpt_model.forward`: the whole model; `transformer_layer.forward`: one layer; "
        "`language_model_embedding.forward`, `gpt_model._postprocess`: embedding, output layer and loss); "
        "graph breaks: `torch._dynamo` `counters[\"graph_break\"]` over the first two steps. Fusions and declined "
        "sites: each graph's report.json, every rule it names, one layer graph counted once however many layers "
        "run it. Loss Δ: largest relative difference from eager over the two first steps.\n\n"
        + graph_table(cells) + "\n"
    )
    from bench.harness import write_result

    out = write_result("moe_step", text.rstrip("\n"))
    (out.parent / "moe_step.json").write_text(json.dumps([[s, n, d, r] for s, n, d, r in cells], indent=1))
    plot(cells, out.with_suffix(".png"))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.moe_step", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqs", default="128,1024")
    p.add_argument("--layers", default="2")
    p.add_argument("--dispatchers", default="allgather,alltoall")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1,
                   help="intra-op threads (default 1: on a shared machine OpenMP's barriers measure the load)")
    p.add_argument("--skip", action="append", default=[], metavar="COLUMN:LAYERS[:SEQ[:DISPATCHER]]")
    p.add_argument("--append", action="store_true",
                   help="keep the cells of bench/results/moe_step.json that this run does not measure")
    args = p.parse_args(argv)
    import torch

    cells: list[Cell] = []
    saved = Path(__file__).parent / "results" / "moe_step.json"
    if args.append and saved.exists():
        cells = [tuple(c) for c in json.loads(saved.read_text())]
    for dispatcher in args.dispatchers.split(","):
        for layers in (int(n) for n in args.layers.split(",")):
            for seq in (int(s) for s in args.seqs.split(",")):
                columns = [c for c in COLUMNS if not skipped(args.skip, c, layers, seq, dispatcher)]
                print(f"seq {seq}, {layers} layers, {dispatcher}: {', '.join(columns)} ...", flush=True)
                r = measure(seq, layers, dispatcher, args.repeats, columns, args.threads)
                cells = [c for c in cells if c[:3] != (seq, layers, dispatcher)] + [(seq, layers, dispatcher, r)]
                print("  " + ", ".join(f"{c} {v['step_s'] * 1e3:.0f} ms (first {v['compile_s']:.1f} s)"
                                       for c, v in r.items()), flush=True)
                out = write(cells, args, torch.__version__)  # after each row: a long run leaves what it measured
    print("\n" + out.read_text() + f"\nwritten to {out} and {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
