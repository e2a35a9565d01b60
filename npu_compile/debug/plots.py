"""memory.png: live bytes over the forward+backward schedule, before and after the memory passes.

The peak of the final schedule is marked and its largest buffers are labelled: the first thing to look at when a
step runs out of memory. matplotlib is optional; without it the plot is skipped with one log line.
"""

from __future__ import annotations

import io
import logging

from npu_compile.passes.memory import Liveness

log = logging.getLogger("npu_compile")


# A buffer's line beside the plot is cut to this many characters: Megatron's fused ops have long names.
LINE_CHARS = 120


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**20:8.2f} MiB" if nbytes >= 2**20 / 100 else f"{nbytes / 2**10:8.2f} KiB"


def memory_png(before: Liveness, after: Liveness, boundary: int | None, title: str) -> bytes | None:
    """PNG bytes of the two live-bytes curves; ``boundary`` is the first backward step (None for inference)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.info("npu_compile: matplotlib is not installed; memory.png skipped")
        return None
    fig = memory_figure(before, after, boundary, title)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
    plt.close(fig)
    return buf.getvalue()


def memory_figure(before: Liveness, after: Liveness, boundary: int | None, title: str):
    """The figure of :func:`memory_png`: the curves above; below them, out of their way, the legend and the largest
    buffers live at the peak (constrained layout sizes both rows to what they hold)."""
    import matplotlib.pyplot as plt

    mib = 2**20
    fig, (ax, notes) = plt.subplots(2, 1, figsize=(10, 6.4), height_ratios=(4, 1.3), layout="constrained")
    ax.plot([b / mib for b in before.curve], label=f"as partitioned (peak {before.peak / mib:.1f} MiB)", alpha=0.6)
    ax.plot([b / mib for b in after.curve], label=f"as compiled (peak {after.peak / mib:.1f} MiB)")
    if boundary is not None:
        ax.axvline(boundary, color="grey", linestyle=":", label="forward | backward")
    ax.scatter([after.peak_step], [after.peak / mib], color="red", zorder=3, label="the peak, as compiled")
    # the mark's label on the side of the point with room for it
    left = after.peak_step > (len(after.curve) - 1) / 2
    ax.annotate(f"peak {after.peak / mib:.1f} MiB at step {after.peak_step}", (after.peak_step, after.peak / mib),
                xytext=(-8 if left else 8, 0), textcoords="offset points", ha="right" if left else "left",
                va="center", fontsize=8)
    ax.margins(y=0.12)
    ax.set_xlabel("step (nodes of the forward, then the backward)" if boundary is not None else "step (nodes of the graph)")
    ax.set_ylabel("live MiB")
    ax.set_title(title)
    notes.axis("off")
    notes.legend(*ax.get_legend_handles_labels(), loc="upper left", ncol=4, fontsize=8, frameon=False)
    lines = [f"{_size(b.bytes)}  {b.dtype} {list(b.shape)}  {b.name}  ({b.op})" for b in after.at_peak[:5]]
    text = "\n".join(line if len(line) <= LINE_CHARS else line[:LINE_CHARS - 1] + "…" for line in lines)
    notes.text(0, 0.62, f"largest buffers live at the peak (step {after.peak_step}):\n{text}", transform=notes.transAxes,
               va="top", fontsize=7, family="monospace")
    return fig
