"""memory_budget="auto" at three device-memory caps: loose, tight, impossible.

megatron-core GPTModel (local layer spec), 4 layers, hidden 512, 8 heads, LayerNorm + GeLU with biases, causal,
micro-batch 2, seq 1024, vocab 2048, fp32; the whole model one graph (``torch.compile(model, backend="ascend",
options={"memory_budget": "auto", "device_memory": cap})``, its layers inlined:
bench.harness.adapt_one_flat_graph), one process, side by side:

    impossible   a cap below what the least activation memory needs: refused at the first call, before a step
    tight        halfway between the least planned peak and the planned peak at budget 1.0
    loose        the device profile's memory (64 GiB): budget 1.0

The tight cap is taken from the impossible run's figures (``MemoryFitError.plans``: every budget tried, with its
planned peak). Per cap: the budget chosen, the planned step peak (report.json ``memory.planned_peak_bytes``: the
live-bytes peak of the compiled fw+bw schedule; no resident memory declared, since the measurement counts only
what the step allocates) and the measured one (the profiler's CPU memory events over one forward+backward after
warm-up, bench.harness). Writes bench/results/memory_fit.md and memory_fit.png.

    python -m bench.memory_fit [--seq 1024] [--layers 4]
"""

from __future__ import annotations

import argparse
import gc
import os
import platform

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

import torch  # noqa: E402

from bench.harness import adapt_one_flat_graph, peak_bytes, write_result  # noqa: E402

HIDDEN, HEADS, BATCH, VOCAB = 512, 8, 2, 2048
MiB = 2**20


def build(layers: int, seq: int, cap: int | None):
    from megatron_glue.capture import models

    torch._dynamo.reset()
    gc.collect()
    config = models.gpt_config(hidden_size=HIDDEN, num_attention_heads=HEADS, num_layers=layers)
    model = models.build_gpt_model(config, VOCAB, seq, seed=0)
    options = {"memory_budget": "auto", "cache": False}
    if cap is not None:
        options["device_memory"] = cap
    return model, torch.compile(model, backend="ascend", options=options), models.synthetic_batch(BATCH, seq, VOCAB)


def measure(layers: int, seq: int, cap: int | None) -> dict:
    from megatron_glue.capture import models
    from npu_compile.debug.report import collect

    model, compiled, data = build(layers, seq, cap)

    def fwd_bwd():
        for p in model.parameters():
            p.grad = None
        models.loss_fn(compiled, data).backward()

    with collect() as reports:
        fwd_bwd()  # compiles
        fwd_bwd()  # warm-up
    peak = peak_bytes(fwd_bwd)
    (report,) = reports
    return {"cap": cap if cap is not None else report.budget["device_memory"], "chosen": report.budget["chosen"],
            "tried": len(report.budget["tried"]), "planned": report.memory["planned_peak_bytes"], "peak": peak,
            "recompute": report.memory["recompute_nodes"]}


def refused(layers: int, seq: int, cap: int) -> dict:
    """The impossible cap: the error, and that no step ran (the parameters are those the model was built with)."""
    from megatron_glue.capture import models
    from npu_compile.passes.recompute import MemoryFitError

    model, compiled, data = build(layers, seq, cap)
    before = [p.detach().clone() for p in model.parameters()]
    try:
        models.loss_fn(compiled, data).backward()
    except MemoryFitError as e:
        unchanged = all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
        no_grads = all(p.grad is None for p in model.parameters())
        return {"cap": cap, "error": str(e), "plans": e.plans, "no_step": unchanged and no_grads}
    raise AssertionError(f"a cap of {cap} bytes was not refused")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.memory_fit", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4)
    args = p.parse_args(argv)

    from megatron_glue.capture import models

    adapt_one_flat_graph()
    models.init_single_process()
    # the impossible cap first: its figures give the tight one
    probe = refused(args.layers, args.seq, 1)
    peaks = [plan.peak for plan in probe["plans"]]
    least = min(peaks)
    impossible = refused(args.layers, args.seq, least * 9 // 10)
    tight = measure(args.layers, args.seq, (least + peaks[0]) // 2)
    loose = measure(args.layers, args.seq, None)

    head = ["cap", "device_memory MiB", "budget chosen (tries)", "planned peak MiB", "measured peak MiB",
            "planned / measured", "under the cap", "recomputed nodes"]
    lines = [f"# memory_budget=\"auto\": megatron-core GPT, {args.layers} layers, hidden {HIDDEN}, seq {args.seq}, "
             f"micro-batch {BATCH}, fp32", "",
             f"torch {torch.__version__}, {platform.machine()}, {torch.get_num_threads()} threads. Planned: "
             "report.json `memory.planned_peak_bytes` (the compiled fw+bw schedule's live bytes); measured: profiler "
             "CPU memory events over one forward+backward after warm-up. Planned peak per budget "
             "(MiB): " + ", ".join(f"{pl.budget}: {pl.peak / MiB:.1f}" for pl in probe["plans"]) + ".", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, r in (("loose", loose), ("tight", tight)):
        lines.append(f"| {name} | {r['cap'] / MiB:.1f} | {r['chosen']} ({r['tried']}) | {r['planned'] / MiB:.1f} | "
                     f"{r['peak'] / MiB:.1f} | {r['planned'] / r['peak']:.3f} | "
                     f"{'yes' if max(r['planned'], r['peak']) <= r['cap'] else 'NO'} | {r['recompute']} |")
    lines.append(f"| impossible | {impossible['cap'] / MiB:.1f} | refused at the first call"
                 f"{', no step ran' if impossible['no_step'] else ', AFTER A STEP'} | – | – | – | – | – |")
    lines += ["", "The refusal:", "", "```", impossible["error"].split("\n\nSet TORCHDYNAMO")[0].strip(), "```"]
    text = "\n".join(lines)
    write_result("memory_fit", text)
    print(text)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        names = ["loose", "tight"]
        for i, r in enumerate((loose, tight)):
            ax.bar(i - 0.2, r["planned"] / MiB, 0.4, color="tab:blue", label="planned" if i == 0 else None)
            ax.bar(i + 0.2, r["peak"] / MiB, 0.4, color="tab:orange", label="measured" if i == 0 else None)
        ax.hlines(tight["cap"] / MiB, 0.6, 1.4, color="black", label="tight cap")
        ax.axhline(impossible["cap"] / MiB, color="red", linestyle="--", label="impossible cap (refused)")
        ax.set_xticks(range(2), [f"{n}\nbudget {r['chosen']}" for n, r in zip(names, (loose, tight))])
        ax.set_ylabel("peak MiB, one forward+backward")
        ax.set_title('memory_budget="auto": planned vs measured peak')
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(write_result("memory_fit", text).with_suffix(".png"), dpi=110)
        plt.close(fig)
    except ImportError:
        pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
