"""report.json: what the backend did to one compiled graph, in figures.

The keys are a contract (DESIGN.md): they may grow, never shrink. Stages fill a :class:`Report` as the graph
moves through the pipeline; the report is rewritten after each compiled piece (the backward compiles lazily, on
the first ``.backward()``), and every report made inside :func:`collect` is handed to its caller
(``npu_compile.explain``).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections import Counter
from collections.abc import Iterator
from typing import Any

import torch


@dataclasses.dataclass
class Report:
    graph_id: str
    target: str
    fusions: dict[str, int] = dataclasses.field(default_factory=dict)
    unfused: list[dict[str, str]] = dataclasses.field(default_factory=list)
    lowered_ops: dict[str, int] = dataclasses.field(default_factory=dict)
    graph_breaks: int = 0
    graph_break_reason: str | None = None
    memory: dict[str, Any] = dataclasses.field(
        default_factory=lambda: dict.fromkeys(
            ("peak_bytes_before", "peak_bytes_after", "lower_bound_bytes", "saved_activation_bytes"), 0
        )
    )
    comm: dict[str, Any] = dataclasses.field(
        default_factory=lambda: {
            "collectives": 0,
            "comm_us": 0.0,
            "compute_us": 0.0,
            "exposed_comm_us_before": 0.0,
            "exposed_comm_us_after": 0.0,
        }
    )
    # Which graphs of this Dynamo graph have been compiled so far: forward/backward or inference.
    graphs: list[str] = dataclasses.field(default_factory=list)
    options: dict[str, Any] = dataclasses.field(default_factory=dict)
    verify: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def op_name(node: torch.fx.Node) -> str | None:
    """``namespace.op`` of an operator node (``aten.mm``, ``npu.npu_fusion_attention``), else None."""
    if node.op != "call_function":
        return None
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        ns, _, name = target._schema.name.partition("::")
        return f"{ns}.{name}"
    if isinstance(target, torch._ops.HigherOrderOperator):
        return f"higher_order.{target.name()}"
    return None


def count_ops(*graphs: torch.fx.GraphModule) -> dict[str, int]:
    """Operator counts over ``graphs``, most frequent first."""
    counts = Counter(name for gm in graphs for n in gm.graph.nodes if (name := op_name(n)) is not None)
    return dict(counts.most_common())


_collectors: list[list[Report]] = []


def publish(report: Report) -> None:
    """Hand a new report to every active :func:`collect` block."""
    for reports in _collectors:
        if all(r is not report for r in reports):
            reports.append(report)


@contextlib.contextmanager
def collect() -> Iterator[list[Report]]:
    """Every report made inside the block, in compile order (they keep filling while their graphs compile)."""
    reports: list[Report] = []
    _collectors.append(reports)
    try:
        yield reports
    finally:
        _collectors.remove(reports)
