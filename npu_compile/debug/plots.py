"""memory.png: live bytes over the forward+backward schedule, before and after the memory passes.

The peak of the final schedule is marked and its largest buffers are labelled: the first thing to look at when a
step runs out of memory. matplotlib is optional; without it the plot is skipped with one log line.
"""

from __future__ import annotations

import io
import logging

from npu_compile.passes.memory import Liveness

log = logging.getLogger("npu_compile")


def memory_png(before: Liveness, after: Liveness, boundary: int | None, title: str) -> bytes | None:
    """PNG bytes of the two live-bytes curves; ``boundary`` is the first backward step (None for inference)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.info("npu_compile: matplotlib is not installed; memory.png skipped")
        return None
    mib = 2**20
    fig, ax = plt.subplots(figsize=(10, 4.8))
    ax.plot([b / mib for b in before.curve], label=f"as partitioned (peak {before.peak / mib:.1f} MiB)", alpha=0.6)
    ax.plot([b / mib for b in after.curve], label=f"as compiled (peak {after.peak / mib:.1f} MiB)")
    if boundary is not None:
        ax.axvline(boundary, color="grey", linestyle=":", label="forward | backward")
    ax.scatter([after.peak_step], [after.peak / mib], color="red", zorder=3)
    top = "\n".join(f"{b.name}  {b.op}  {list(b.shape)} {b.dtype}  {b.bytes / mib:.2f} MiB" for b in after.at_peak[:5])
    ax.annotate(top, (after.peak_step, after.peak / mib), xytext=(8, -8), textcoords="offset points", fontsize=7,
                va="top", family="monospace", bbox={"boxstyle": "round", "fc": "white", "alpha": 0.8})
    ax.set_xlabel("step (nodes of the forward, then the backward)")
    ax.set_ylabel("live MiB")
    ax.set_title(title)
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    return buf.getvalue()
