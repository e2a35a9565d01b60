"""``npu_compile.explain(model, *args, options={...}, **kwargs)``: what the ascend backend does to a model, as an object.

It compiles ``model`` afresh, runs it once on ``args`` and ``kwargs`` (and, when the output needs grad, compiles
the backward without running it), and returns every graph's report plus Dynamo's graph and break counts. The
backend's options go in ``options=``, as in ``torch.compile``; every other argument is the model's.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

import torch
from torch._functorch import config as functorch_config

from npu_compile import config
from npu_compile.backend import ascend
from npu_compile.debug.report import Report, collect


@dataclasses.dataclass
class Explanation:
    graphs: list[Report]  # one per compiled Dynamo graph, the content of its report.json

    @property
    def graph_count(self) -> int:
        return len(self.graphs)

    @property
    def graph_break_count(self) -> int:
        return sum(r.graph_breaks for r in self.graphs)

    @property
    def break_reasons(self) -> list[str]:
        return [r.graph_break_reason for r in self.graphs if r.graph_break_reason]

    @property
    def fusions(self) -> dict[str, int]:
        total: dict[str, int] = {}
        for r in self.graphs:
            for rule, n in r.fusions.items():
                total[rule] = total.get(rule, 0) + n
        return total

    def to_json(self) -> dict[str, Any]:
        return {
            "graph_count": self.graph_count,
            "graph_break_count": self.graph_break_count,
            "break_reasons": self.break_reasons,
            "graphs": [r.to_json() for r in self.graphs],
        }

    def __str__(self) -> str:
        return json.dumps(self.to_json(), indent=2)


def explain(model: torch.nn.Module | Any, *args: Any, options: Mapping[str, Any] | None = None,
            **kwargs: Any) -> Explanation:
    """Compile ``model`` with ``backend="ascend"`` and ``options``, run it on ``args`` / ``kwargs``, and explain the
    result. ``kwargs`` are the model's own keyword arguments (``explain(gpt, **batch)``), passed through untouched."""
    options = dict(options or {})
    config.validate(options)  # fail on a bad option before any tracing
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=ascend, options=options)
    # Compile the backward at the forward's call, so its report is complete without running it.
    with collect() as reports, functorch_config.patch(force_non_lazy_backward_lowering=True):
        compiled(*args, **kwargs)
    torch._dynamo.reset()
    return Explanation(list(reports))
