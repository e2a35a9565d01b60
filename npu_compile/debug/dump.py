"""Where a compiled graph leaves its traces: the dump dir, tlparse artifacts and the ``npu_compile`` logger.

Layout (DESIGN.md): ``<dump_dir>/<graph-id>/{joint,forward,backward,inference}/NN_<stage>.py`` plus one
``report.json`` per graph id. A dump that cannot be written is logged once and skipped: debugging aids never
stop a compile.
"""

from __future__ import annotations

import json
import logging
import os
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
        n = self._counters.get(kind, 0)
        self._counters[kind] = n + 1
        code = graph_code(gm)
        trace_structured(
            "artifact",
            metadata_fn=lambda: {"name": f"npu_compile_{kind}_{n:02d}_{stage}", "encoding": "string"},
            payload_fn=lambda: code,
        )
        log.debug("graph %s %s after %s:\n%s", self.graph_id, kind, stage, code)
        self.write(f"{kind}/{n:02d}_{stage}.py", code)

    def report(self, content: dict[str, Any]) -> Path | None:
        return self.write("report.json", json.dumps(content, indent=2, sort_keys=False) + "\n")
