"""Measurement helpers shared by every benchmark: peak memory, step time, compile time, tables.

All figures of one table are measured side by side in one process run; ratios are taken against the eager row of
the same model, never against a number from another run (the machine is shared and noisy).
"""

from __future__ import annotations

import dataclasses
import gc
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile


def one_flat_graph_groups() -> tuple[str, ...]:
    """megatron_glue.adapt()'s groups with the model's layers inlined (neither "layer_frames" nor "regions"): the
    whole step one flat graph, whose memory plan is the step's. Under regions a layer's plan and the model's are
    made apart (README, "Benchmarks"), under layer frames each layer is a graph of its own."""
    from megatron_glue.capture.adaptations import groups_for

    return tuple(g for g in groups_for(one_graph=True) if g != "regions")


def adapt_one_flat_graph() -> None:
    """megatron_glue.adapt(:func:`one_flat_graph_groups`)."""
    import megatron_glue

    megatron_glue.adapt(one_flat_graph_groups())


def peak_bytes(step: Callable[[], object]) -> int:
    """Peak CPU bytes allocated above the level at the start of ``step``, from the profiler's memory events.

    The raw kineto events include every allocation and free (``prof.events()`` only lists those no op owns).
    """
    gc.collect()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = sorted(
        (e for e in prof.profiler.kineto_results.events()
         if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU),
        key=lambda e: e.start_ns(),
    )
    current = peak = 0
    for e in events:
        current += e.nbytes()
        peak = max(peak, current)
    return peak


def median_seconds(step: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


@dataclasses.dataclass
class Row:
    model: str
    backend: str
    peak_bytes: int
    step_s: float
    compile_s: float
    graphs: int | None = None
    extra: dict = dataclasses.field(default_factory=dict)


def markdown_table(rows: list[Row], baseline: str = "eager") -> str:
    """One table, ratios against the ``baseline`` backend's row of the same model."""
    base = {r.model: r for r in rows if r.backend == baseline}
    extra_keys = list(dict.fromkeys(k for r in rows for k in r.extra))
    head = ["model", "backend", "peak MiB", "peak ×eager", "step ms", "step ×eager", "compile s", "graphs", *extra_keys]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        b = base.get(r.model)
        cells = [
            r.model,
            r.backend,
            f"{r.peak_bytes / 2**20:.1f}",
            f"{r.peak_bytes / b.peak_bytes:.2f}" if b and b.peak_bytes else "–",
            f"{r.step_s * 1e3:.1f}",
            f"{r.step_s / b.step_s:.2f}" if b else "–",
            f"{r.compile_s:.1f}",
            "–" if r.graphs is None else str(r.graphs),
            *(str(r.extra.get(k, "–")) for k in extra_keys),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def bar_plot(rows: list[Row], title: str, path: Path) -> Path:
    """Peak memory and step time per model, one bar per backend, side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r.model for r in rows))
    backends = list(dict.fromkeys(r.backend for r in rows))
    by = {(r.model, r.backend): r for r in rows}
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.8 / len(backends)
    for ax, (label, value) in zip(axes, [("peak MiB (one fwd+bwd)", lambda r: r.peak_bytes / 2**20),
                                         ("median step ms", lambda r: r.step_s * 1e3)]):
        for i, b in enumerate(backends):
            xs = [m + i * width for m in range(len(models))]
            ys = [value(by[(m, b)]) if (m, b) in by else 0 for m in models]
            ax.bar(xs, ys, width, label=b)
        ax.set_xticks([m + width * (len(backends) - 1) / 2 for m in range(len(models))], models, fontsize=8)
        ax.set_ylabel(label)
        ax.set_yscale("log")
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_result(name: str, text: str) -> Path:
    out = Path(__file__).parent / "results" / f"{name}.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text + "\n")
    return out
