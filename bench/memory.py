"""Memory planning on megatron-core GPT: measured peak of one forward+backward, eager vs Inductor vs ascend.

megatron-core GPTModel (local layer spec), 2 layers, hidden 512, 8 heads, LayerNorm + GeLU with biases, causal
mask, micro-batch 2, fp32, vocab 2048, at sequence 1024 and 2048; the whole model one flat graph (its layers
inlined: bench.harness.adapt_one_flat_graph). Per model, side by side in one process:

    eager           Megatron as written
    inductor        torch.compile(backend="inductor")
    ascend 1.0      torch.compile(backend="ascend"), memory_budget 1.0 (the default)
    ascend 0.5      memory_budget 0.5

Measured peak: the profiler's CPU memory events over one forward+backward after warm-up (bench.harness). For
ascend also what the compiler planned (report.json ``memory``): the live-bytes peak of its fw+bw schedule
(``lower_bound_bytes``), the static arena of that schedule (``peak_bytes_after``), the activations saved for the
backward, and what the backward recomputes (nodes, matrix FLOPs, estimated µs on the Ascend cost model).

Writes bench/results/memory.md and memory.png.

    python -m bench.memory [--models seq1024,seq2048] [--backends eager,inductor,ascend@1.0,ascend@0.5]
"""

from __future__ import annotations

import argparse
import gc
import os
import platform

os.environ.setdefault("TORCHINDUCTOR_FORCE_DISABLE_CACHES", "1")
os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

import torch  # noqa: E402

from bench.harness import adapt_one_flat_graph, peak_bytes, write_result  # noqa: E402

HIDDEN, HEADS, LAYERS, BATCH, VOCAB = 512, 8, 2, 2, 2048
MODELS = {"seq1024": 1024, "seq2048": 2048}
BACKENDS = ("eager", "inductor", "ascend@1.0", "ascend@0.5")
MiB = 2**20


def measure(seq: int, backend: str) -> dict:
    from megatron_glue.capture import models
    from npu_compile.debug.report import collect

    torch._dynamo.reset()
    gc.collect()
    config = models.gpt_config(hidden_size=HIDDEN, num_attention_heads=HEADS, num_layers=LAYERS)
    model = models.build_gpt_model(config, VOCAB, seq, seed=0)
    name, _, budget = backend.partition("@")
    if name != "eager":
        options = {"memory_budget": float(budget)} if name == "ascend" else None
        model = torch.compile(model, backend=name, options=options)
    data = models.synthetic_batch(BATCH, seq, VOCAB, seed=0)

    def fwd_bwd():
        for p in model.parameters():
            p.grad = None
        loss = models.loss_fn(model, data)
        loss.backward()
        return loss.detach()

    with collect() as reports:
        loss = fwd_bwd()  # compiles
        fwd_bwd()  # warm-up: first-touch allocations, lazy inits inside Megatron
    peak = peak_bytes(fwd_bwd)
    row = {"model": f"s{seq} b{BATCH}", "backend": backend, "peak": peak, "loss": loss.item()}
    if name == "ascend":
        (report,) = reports
        m = report.memory
        row.update(planned=m["lower_bound_bytes"], arena=m["peak_bytes_after"], saved=m["saved_activation_bytes"],
                   recompute_nodes=m["recompute_nodes"], recompute_flops=m["recompute_flops"],
                   recompute_us=m["recompute_us"], step_flops=m["step_flops"], fusions=dict(report.fusions))
    del model
    return row


def table(rows: list[dict]) -> str:
    eager = {r["model"]: r["peak"] for r in rows if r["backend"] == "eager"}
    inductor = {r["model"]: r["peak"] for r in rows if r["backend"] == "inductor"}
    head = ["model", "backend", "measured peak MiB", "×eager", "×inductor", "planned (live bytes) MiB",
            "planned / measured", "arena MiB", "arena / planned", "saved activations MiB", "recompute"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        e, i = eager.get(r["model"]), inductor.get(r["model"])
        cells = [r["model"], r["backend"], f"{r['peak'] / MiB:.1f}",
                 f"{r['peak'] / e:.2f}" if e else "–", f"{r['peak'] / i:.2f}" if i else "–"]
        if "planned" in r:
            share = r["recompute_flops"] / r["step_flops"] if r["step_flops"] else 0.0
            cells += [f"{r['planned'] / MiB:.1f}", f"{r['planned'] / r['peak']:.3f}", f"{r['arena'] / MiB:.1f}",
                      f"{r['arena'] / r['planned']:.3f}", f"{r['saved'] / MiB:.1f}",
                      f"{r['recompute_nodes']} nodes, {r['recompute_flops'] / 1e9:.2f} GFLOP "
                      f"({share:.1%} of the step's), {r['recompute_us']:.0f} µs est."]
        else:
            cells += ["–"] * 6
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(rows: list[dict], path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["model"] for r in rows))
    backends = list(dict.fromkeys(r["backend"] for r in rows))
    by = {(r["model"], r["backend"]): r for r in rows}
    fig, ax = plt.subplots(figsize=(9, 4.5))
    width = 0.8 / len(backends)
    for i, b in enumerate(backends):
        xs = [m + i * width for m in range(len(models))]
        ax.bar(xs, [by[(m, b)]["peak"] / MiB if (m, b) in by else 0 for m in models], width, label=f"{b} measured")
        planned = [(x, by[(m, b)]["planned"] / MiB) for x, m in zip(xs, models) if "planned" in by.get((m, b), {})]
        if planned:
            ax.scatter(*zip(*planned), marker="_", s=400, color="black", zorder=3,
                       label="planned (live bytes)" if i == backends.index("ascend@1.0") else None)
    ax.set_xticks([m + width * (len(backends) - 1) / 2 for m in range(len(models))], models)
    ax.set_ylabel("peak MiB, one forward+backward")
    ax.set_title(f"megatron-core GPT, {LAYERS} layers, hidden {HIDDEN}, {HEADS} heads, fp32 (CPU, profiler)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.memory", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--backends", default=",".join(BACKENDS))
    args = p.parse_args(argv)

    from megatron_glue.capture import models

    adapt_one_flat_graph()
    models.init_single_process()
    rows = []
    for model in args.models.split(","):
        for backend in args.backends.split(","):
            print(f"measuring {model} / {backend} ...", flush=True)
            rows.append(measure(MODELS[model], backend))
            print(f"  peak {rows[-1]['peak'] / MiB:.1f} MiB", flush=True)
    header = (
        f"# Memory: megatron-core GPT, measured peak of one forward+backward\n\n"
        f"{LAYERS} layers, hidden {HIDDEN}, {HEADS} heads, LayerNorm + GeLU with biases, causal, micro-batch {BATCH}, "
        f"vocab {VOCAB}, fp32; torch {torch.__version__}, {platform.machine()}. Measured: profiler CPU memory events "
        f"above the level before the step, after warm-up. Planned: the compiler's live-bytes peak of its fw+bw "
        f"schedule (report.json `lower_bound_bytes`); arena: its static plan (`peak_bytes_after`). Recompute: "
        f"forward nodes the backward repeats, their matrix FLOPs against the step's (forward + backward, as "
        f"partitioned) and their time on the Ascend cost model.\n"
    )
    text = header + "\n" + table(rows)
    path = write_result("memory", text)
    plot(rows, path.with_suffix(".png"))
    print("\n" + text + f"\n\nwritten to {path} and {path.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
