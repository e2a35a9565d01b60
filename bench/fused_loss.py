"""Fused output projection + cross-entropy on a Llama-style megatron-core GPT: measured peak of one forward+backward.

megatron-core GPTModel (local layer spec), Llama style (RMSNorm, SwiGLU, RoPE, no biases), 2 layers, hidden 512,
8 heads, bf16 weights and activations, micro-batch 1, vocab 32000, sequence 2048 (``--quick``: vocab 8000,
sequence 512). One fresh subprocess per row, in turn (no compiled graph, cache or freed-but-kept buffer of one row
is there when the next is measured):

    eager               Megatron as written
    inductor            torch.compile(backend="inductor")
    ascend-unfused      torch.compile(backend="ascend"), every fusion rule but the two loss rules
                        (linear_cross_entropy, vocab_parallel_cross_entropy)
    ascend              torch.compile(backend="ascend"), default options (every rule)
    ascend-fp32-logits  (--backends only) the same, with GPTModel handing its loss ``logits.float()`` instead of
                        the bf16 logits (the same values: Megatron's loss casts them first thing): the loss rule
                        takes both forms, and the two rows should agree

Measured peak: the profiler's CPU memory events over one forward+backward after a warm-up step (bench.harness),
gradients cleared before it, so the parameters' new gradients count. Step: median forward+backward. Loss fused:
the loss rules' fusions in the ascend reports (report.json ``fusions``), their ``unfused`` reasons where none
fired. Checks: each loss against eager's (relative, LOSS_RTOL) and each ascend run's gradients against eager's
(per parameter, relative L2 error at most GRAD_RTOL). Under the table: what the compiler planned for each ascend
row (report.json ``memory``: the live-bytes peak of its fw+bw schedule, the largest tensors live there).

Writes bench/results/fused_loss.md and fused_loss.png (``--quick`` prints only).

    python -m bench.fused_loss [--quick] [--repeats 3] [--backends eager,inductor,...]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("TORCHINDUCTOR_FORCE_DISABLE_CACHES", "1")
os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

import torch  # noqa: E402

from bench.harness import median_seconds, peak_bytes, write_result  # noqa: E402

HIDDEN, HEADS, LAYERS, BATCH = 512, 8, 2, 1
FULL, QUICK = (32000, 2048), (8000, 512)  # (vocab, seq)
BACKENDS = ("eager", "inductor", "ascend-unfused", "ascend")  # ascend-fp32-logits: with --backends only
LABELS = {"eager": "eager", "inductor": "inductor", "ascend-unfused": "ascend, no loss fusion",
          "ascend": "ascend (default options)", "ascend-fp32-logits": "ascend, fp32 logits to the loss"}
LOSS_RULES = ("linear_cross_entropy", "vocab_parallel_cross_entropy")
# The logits are bf16 matmuls, the loss fp32: a compiled graph rounds its bf16 ops in other places (fused norms,
# another order), which moves the mean loss in its 4th-5th digit; gradients of bf16 weights are compared in norm.
LOSS_RTOL, GRAD_RTOL = 2e-3, 5e-2
MiB = 2**20
RESULT = Path(__file__).parent / "results" / "fused_loss.md"
# What follows this line in RESULT is written by hand (what the dumps say about the peak) and kept on rewrites.
FINDINGS = "<!-- findings: written by hand from this run's dumps, kept when the bench rewrites the table -->"


def _options(backend: str, dump_dir: str) -> dict | None:
    from npu_compile.passes import rule_names

    if backend == "ascend-unfused":
        return {"fusions": [r for r in rule_names() if r not in LOSS_RULES], "dump_dir": dump_dir}
    return {"dump_dir": dump_dir}


@contextlib.contextmanager
def _fp32_logits_to_the_loss():
    """GPTModel's loss gets ``logits.float()``: Megatron's vocab_parallel_cross_entropy casts its logits to fp32
    inside its autograd.Function (tensor_parallel/cross_entropy.py:28), so the values are the same; only the
    cast's backward is traced as ``.float()``'s (a ``_to_copy`` with layout and device) rather than as the
    Function's cast of its input gradient (a ``_to_copy`` with dtype only)."""
    from megatron.core.models.common.language_module.language_module import LanguageModule

    original = LanguageModule.compute_language_model_loss

    def compute_language_model_loss(self, labels, logits):
        return original(self, labels, logits.float())

    LanguageModule.compute_language_model_loss = compute_language_model_loss
    try:
        yield
    finally:
        LanguageModule.compute_language_model_loss = original


def measure(backend: str, vocab: int, seq: int, repeats: int, dump_dir: str) -> tuple[dict, dict]:
    """One row (and the parameters' gradients of its compile step), in this process."""
    from megatron_glue.capture import adapt, models
    from npu_compile.debug.report import collect

    adapt(("cpu", "compile"))
    models.init_single_process()
    config = models.llama_config(hidden_size=HIDDEN, num_attention_heads=HEADS, num_layers=LAYERS, bf16=True,
                                 params_dtype=torch.bfloat16)
    model = models.build_gpt_model(config, vocab, seq, seed=0).to(torch.bfloat16)
    params = dict(model.named_parameters())
    if backend != "eager":
        name = "inductor" if backend == "inductor" else "ascend"
        model = torch.compile(model, backend=name, options=None if name == "inductor" else _options(backend, dump_dir))
    data = models.synthetic_batch(BATCH, seq, vocab, seed=0)

    def clear():
        for p in params.values():
            p.grad = None
        gc.collect()

    def fwd_bwd():
        loss = models.loss_fn(model, data)
        loss.backward()
        return loss.detach()

    def step():
        clear()
        return fwd_bwd()

    patch = _fp32_logits_to_the_loss() if backend == "ascend-fp32-logits" else contextlib.nullcontext()
    with patch, collect() as reports:
        loss = step()  # compiles
        grads = {n: p.grad.detach().clone() for n, p in params.items() if p.grad is not None}
        step()  # warm-up: first-touch allocations, lazy inits inside Megatron
        clear()
        peak = peak_bytes(fwd_bwd)
        step_s = median_seconds(step, repeats)
    row = {"backend": backend, "peak": peak, "step_s": step_s, "loss": loss.float().item()}
    if backend.startswith("ascend"):
        row["fused"] = sum(r.fusions.get(rule, 0) for r in reports for rule in LOSS_RULES)
        row["fusions"] = {k: v for r in reports for k, v in r.fusions.items() if v}
        row["unfused"] = [u for r in reports for u in r.unfused if u.get("rule") in LOSS_RULES]
        row["graphs"] = len(reports)
        row["graph_breaks"] = sum(r.graph_breaks for r in reports)
        row["memory"] = [dict(r.memory, graph_id=r.graph_id) for r in reports]
        row["dump_dir"] = dump_dir
    return row, grads


def run_row(backend: str, vocab: int, seq: int, repeats: int, dump_root: str) -> tuple[dict, dict]:
    """measure() in a fresh interpreter; its row and gradients come back through a file."""
    out = os.path.join(dump_root, f"{backend}.pt")
    cmd = [sys.executable, "-m", "bench.fused_loss", "--child", backend, "--vocab", str(vocab), "--seq", str(seq),
           "--repeats", str(repeats), "--dump-dir", os.path.join(dump_root, backend), "--out", out]
    root = str(Path(__file__).resolve().parent.parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(cmd, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if done.returncode != 0:
        tail = "\n".join(done.stdout.splitlines()[-30:])
        raise RuntimeError(f"row {backend} failed (exit {done.returncode}):\n{tail}")
    saved = torch.load(out, weights_only=False)
    return saved["row"], saved["grads"]


def grad_error(grads: dict, reference: dict) -> tuple[float, str]:
    """The worst relative L2 error of one parameter's gradient against the reference's, and that parameter."""
    worst, where = 0.0, ""
    for name, ref in reference.items():
        got = grads.get(name)
        if got is None:
            return float("inf"), f"{name} (no gradient)"
        ref32, got32 = ref.float(), got.float()
        err = ((got32 - ref32).norm() / ref32.norm().clamp_min(1e-30)).item()
        if err > worst:
            worst, where = err, name
    return worst, where


def table(rows: list[dict]) -> str:
    by = {r["backend"]: r for r in rows}
    e, i = by.get("eager"), by.get("inductor")
    head = ["backend", "peak MiB", "× eager", "× inductor", "step s", "loss fused", "loss",
            "worst grad error vs eager"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        fused = ("yes" if r["fused"] else "no") if "fused" in r else "–"
        grads = f"{r['grad_err']:.1e} ({r['grad_worst']})" if "grad_err" in r else "–"
        cells = [LABELS[r["backend"]], f"{r['peak'] / MiB:.1f}",
                 f"{r['peak'] / e['peak']:.2f}" if e else "–", f"{r['peak'] / i['peak']:.2f}" if i else "–",
                 f"{r['step_s']:.2f}", fused, f"{r['loss']:.5f}", grads]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(rows: list[dict], title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    names = [LABELS[r["backend"]].replace(" (", "\n(").replace(", ", ",\n") for r in rows]
    colors = ["tab:gray", "tab:blue", "tab:orange", "tab:green", "tab:olive"][:len(rows)]
    for ax, (label, values, fmt) in zip(axes, [
            ("peak MiB, one forward+backward", [r["peak"] / MiB for r in rows], "%.0f"),
            ("median step s (forward+backward)", [r["step_s"] for r in rows], "%.2f")]):
        bars = ax.bar(range(len(rows)), values, color=colors)
        ax.bar_label(bars, fmt=fmt, fontsize=8)
        if "MiB" in label:
            for base, share, style in (("eager", 0.25, "--"), ("inductor", 0.4, ":")):
                ref = next((r["peak"] for r in rows if r["backend"] == base), None)
                if ref:
                    ax.axhline(share * ref / MiB, color="black", linestyle=style, linewidth=0.8,
                               label=f"goal: {share}× {base}")
            ax.legend(fontsize=8)
        ax.set_xticks(range(len(rows)), names, fontsize=7)
        ax.set_ylabel(label)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def planned(row: dict, top: int = 6) -> list[str]:
    """Per compiled graph of an ascend row: its planned peak and the largest tensors live there."""
    out = []
    for m in row["memory"]:
        tensors = sorted(m.get("peak_tensors", []), key=lambda b: -b["bytes"])[:top]
        desc = "; ".join(f"`{b['name']}` {b['op']} {list(b['shape'])} {b['dtype']}, {b['bytes'] / MiB:.1f} MiB"
                         for b in tensors)
        out.append(f"graph {m['graph_id']}: planned peak (live bytes) {m.get('lower_bound_bytes', 0) / MiB:.1f} "
                   f"MiB (measured {row['peak'] / MiB:.1f}), saved activations {m.get('saved_activation_bytes', 0) / MiB:.1f} MiB; largest live at "
                   f"the planned peak: {desc}")
    return out


def report(rows: list[dict], grads: dict, vocab: int, seq: int, repeats: int, write: bool) -> str:
    """The checks, the table and the notes; with ``write``, bench/results/fused_loss.md (keeping what follows
    FINDINGS in the old file) and fused_loss.png."""
    eager = next((r for r in rows if r["backend"] == "eager"), None)
    problems = []
    for r in rows:
        if eager is None or r is eager:
            continue
        r["grad_err"], r["grad_worst"] = grad_error(grads[r["backend"]], grads["eager"])
        if abs(r["loss"] - eager["loss"]) > LOSS_RTOL * abs(eager["loss"]):
            problems.append(f"{LABELS[r['backend']]}: loss {r['loss']:.5f} vs eager {eager['loss']:.5f} "
                            f"(rtol {LOSS_RTOL})")
        if r["backend"].startswith("ascend") and not r["grad_err"] <= GRAD_RTOL:
            problems.append(f"{LABELS[r['backend']]}: gradient of {r['grad_worst']} off by {r['grad_err']:.2e} "
                            f"(relative L2, limit {GRAD_RTOL})")

    title = (f"megatron-core Llama-style GPT, {LAYERS} layers, hidden {HIDDEN}, vocab {vocab}, seq {seq}, "
             f"micro-batch {BATCH}, bf16 (CPU, profiler)")
    header = (
        f"# Fused output projection + cross-entropy: measured peak of one forward+backward\n\n"
        f"megatron-core GPTModel (local spec), Llama style (RMSNorm, SwiGLU, RoPE, no biases), {LAYERS} layers, "
        f"hidden {HIDDEN}, {HEADS} heads, vocab {vocab}, seq {seq}, micro-batch {BATCH}, bf16; torch "
        f"{torch.__version__}, {platform.machine()} CPU ({os.cpu_count()} cores, shared with other jobs). One "
        f"fresh subprocess per row. Peak: profiler CPU memory events (`bench.harness.peak_bytes`) over one "
        f"forward+backward after a warm-up step, counted from the level before it, gradients cleared before it "
        f"(the new ones count). Step: median of {repeats} forward+backward. Loss fused: a loss rule fired "
        f"(report.json `fusions`). Losses agree with eager's within rtol {LOSS_RTOL}; grad error: the worst "
        f"relative L2 error of one parameter's gradient against eager's (limit {GRAD_RTOL} for the ascend "
        f"rows).\n"
    )
    notes = ["", "Checks: " + ("; ".join(problems) if problems else
                                f"every loss within rtol {LOSS_RTOL} of eager's, every ascend row's gradients "
                                f"within {GRAD_RTOL} of eager's.")]
    by = {r["backend"]: r for r in rows}
    if eager and "inductor" in by:
        for key in ("ascend", "ascend-fp32-logits"):
            if key in by:
                r = by[key]
                xe, xi = r["peak"] / eager["peak"], r["peak"] / by["inductor"]["peak"]
                notes.append(f"\n{LABELS[key]}: {xe:.2f}× eager (goal ≤ 0.25: {'met' if xe <= 0.25 else 'missed'}), "
                             f"{xi:.2f}× inductor (goal ≤ 0.4: {'met' if xi <= 0.4 else 'missed'}).")
    for r in rows:
        if "fused" not in r:
            continue
        notes.append("")
        notes.append(f"{LABELS[r['backend']]}: {r['graphs']} compiled graph(s), {r['graph_breaks']} graph "
                     f"break(s), fusions {json.dumps(r['fusions'])}.")
        if not r["fused"] and r["backend"] != "ascend-unfused":
            reasons = sorted({f"{u.get('rule')} at `{u.get('node')}`: {u.get('reason')}" for u in r["unfused"]})
            notes.append("Loss not fused; report.json `unfused`: " + ("; ".join(reasons) or "nothing recorded"))
        for line in planned(r):
            notes.append(f"- {line}")
    text = header + "\n" + table(rows) + "\n" + "\n".join(notes)
    print("\n" + text)
    if write:
        old = RESULT.read_text() if RESULT.exists() else ""
        kept = old[old.index(FINDINGS):] if FINDINGS in old else ""
        path = write_result("fused_loss", text + ("\n\n" + kept.rstrip("\n") if kept else ""))
        plot(rows, title, path.with_suffix(".png"))
        print(f"\nwritten to {path} and {path.with_suffix('.png')}")
    return text


def child(args) -> int:
    row, grads = measure(args.child, args.vocab, args.seq, args.repeats, args.dump_dir)
    torch.save({"row": row, "grads": grads}, args.out)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.fused_loss", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help=f"vocab {QUICK[0]}, seq {QUICK[1]}; prints, writes nothing")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--backends", default=",".join(BACKENDS))
    p.add_argument("--dump-dir", default=None, help="where the rows' dumps (graphs, report.json) go "
                                                   "(default: a temporary folder, kept)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--vocab", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--seq", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return child(args)
    vocab, seq = QUICK if args.quick else FULL

    dump_root = args.dump_dir or tempfile.mkdtemp(prefix="fused_loss_")
    os.makedirs(dump_root, exist_ok=True)
    rows, grads = [], {}
    for backend in args.backends.split(","):
        print(f"measuring {backend} (vocab {vocab}, seq {seq}) in a subprocess ...", flush=True)
        row, grads[backend] = run_row(backend, vocab, seq, args.repeats, dump_root)
        rows.append(row)
        print(f"  peak {row['peak'] / MiB:.1f} MiB, step {row['step_s']:.2f} s, loss {row['loss']:.5f}"
              + (f", loss fusions {row['fused']}" if "fused" in row else ""), flush=True)

    report(rows, grads, vocab, seq, args.repeats, write=not args.quick)
    print(f"dumps: {dump_root}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
