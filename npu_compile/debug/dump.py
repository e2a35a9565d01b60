"""Where a compiled graph leaves its traces: the dump dir, tlparse artifacts and the ``npu_compile`` logger.

Layout: ``<dump_dir>/<graph-id>/{joint,forward,backward,inference}/NN_<stage>.py`` plus one ``report.json`` per
graph id. A dump that cannot be written is logged once and skipped: debugging aids never stop a compile.

tlparse artifacts are named ``npu_compile_<graph-id>_<kind>_NN_<stage>`` and carry the full code (shapes,
strides, devices). The logger: INFO is one line per compiled graph (see ``backend``) plus one per graph kind
summarizing its stages (node counts and time); DEBUG adds each stage's graph, compact (no stride / device
annotations) and only when the stage changed it.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import torch
from torch._logging import trace_structured

log = logging.getLogger("npu_compile")


def graph_code(gm: torch.fx.GraphModule) -> str:
    """Readable code of a graph, with shapes, strides and devices of every value."""
    return gm.print_readable(print_output=False, include_stride=True, include_device=True)


class GraphDump:
    """The dump of one compiled graph (one Dynamo graph id); a no-op when no dump dir is set."""

    def __init__(self, dump_dir: str | None, graph_id: str):
        self.graph_id = graph_id
        self.root = Path(dump_dir) / graph_id if dump_dir else None
        self._counters: dict[str, int] = {}
        self._failed = False
        # kind -> [(stage, node count, seconds since the previous stage of that kind)], and the last logged code
        self.stages: dict[str, list[tuple[str, int, float]]] = {}
        self._clock: dict[str, float] = {}
        self._logged: dict[str, str] = {}

    def write(self, relpath: str, data: str | bytes) -> Path | None:
        """Write ``data`` to ``relpath`` under this graph's folder; a failure is logged once, never raised."""
        if self.root is None or self._failed:
            return None
        path = self.root / relpath
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(path.suffix + ".tmp")
            tmp.write_bytes(data) if isinstance(data, bytes) else tmp.write_text(data)
            os.replace(tmp, path)
            return path
        except OSError as e:
            self._failed = True  # one warning per graph, not one per stage
            log.warning("npu_compile: cannot write dumps under %s (%s); compiling on without them", self.root, e)
            return None

    def stage(self, kind: str, stage: str, gm: torch.fx.GraphModule) -> None:
        """Record ``gm`` after ``stage`` of the ``kind`` graph (joint / forward / backward / inference)."""
        now = time.perf_counter()
        n = self._counters.get(kind, 0)
        self._counters[kind] = n + 1
        nodes = sum(1 for node in gm.graph.nodes if node.op not in ("placeholder", "output"))
        self.stages.setdefault(kind, []).append((stage, nodes, now - self._clock.get(kind, now)))
        name = f"npu_compile_{self.graph_id}_{kind}_{n:02d}_{stage}"
        # the payload is rendered inside the call, and only when a trace is being written
        trace_structured("artifact", metadata_fn=lambda: {"name": name, "encoding": "string"},
                         payload_fn=lambda: graph_code(gm))
        if self.root is not None:
            self.write(f"{kind}/{n:02d}_{stage}.py", graph_code(gm))
        if log.isEnabledFor(logging.DEBUG):
            compact = gm.print_readable(print_output=False)
            if compact == self._logged.get(kind):
                log.debug("graph %s %s after %s: unchanged", self.graph_id, kind, stage)
            else:
                log.debug("graph %s %s after %s:\n%s", self.graph_id, kind, stage, compact)
                self._logged[kind] = compact
        self._clock[kind] = time.perf_counter()

    def text(self, kind: str, name: str, text: str) -> None:
        """A text beside the ``kind`` graph's stages, numbered after them (e.g. ``forward/05_ge_graph.txt``)."""
        n = self._counters.get(kind, 0)
        self._counters[kind] = n + 1
        if self.root is not None:
            self.write(f"{kind}/{n:02d}_{name}", text)

    def summary(self, kind: str) -> str:
        """One line: the ``kind`` graph's stages in order with their node counts and times."""
        parts = [f"{stage} {nodes}" + (f" ({dt * 1e3:.0f} ms)" if dt >= 5e-4 else "")
                 for stage, nodes, dt in self.stages.get(kind, [])]
        return f"graph {self.graph_id} {kind} stages (nodes): " + " → ".join(parts)

    def report(self, content: dict[str, Any]) -> Path | None:
        return self.write("report.json", json.dumps(content, indent=2, sort_keys=False) + "\n")
