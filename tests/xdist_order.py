"""The order in which `--dist loadscope` hands test modules to the xdist workers: longest first, by a checked-in
table of each test's seconds (tests/durations.json), where xdist hands out the modules with the most tests first.

xdist's order starts few-but-slow modules (a module-scoped compile fixture, a random Megatron sweep) last, and one
worker then runs alone for minutes at the end while the other idles. Longest-processing-time order hands out the
short modules last, so both workers finish close together. Each scope (a module, or a class) still runs whole on
one worker, as loadscope does: its module-scoped fixtures are made once. A test the table does not know counts as
the table's mean test, so a new module is placed by its test count.

Refresh the table with `--store-durations` on any of the Makefile's pytest lines (the seconds are merged in).
"""

from __future__ import annotations

import json
import os
from collections import OrderedDict
from pathlib import Path

DURATIONS = Path(__file__).with_name("durations.json")


def stored_durations(path: Path = DURATIONS) -> dict[str, float]:
    return json.loads(path.read_text()) if path.exists() else {}


def longest_first(workqueue: dict[str, dict[str, bool]], seconds: dict[str, float]) -> OrderedDict:
    """The work units (scope -> {node id: done}) reordered by their expected seconds, longest first; ties keep
    xdist's order."""
    mean = sum(seconds.values()) / len(seconds) if seconds else 1.0
    expected = {scope: sum(seconds.get(nodeid, mean) for nodeid in unit) for scope, unit in workqueue.items()}
    return OrderedDict(sorted(workqueue.items(), key=lambda kv: -expected[kv[0]]))


def make_scheduler(config, log, seconds: dict[str, float] | None = None):
    """The scheduler for `pytest_xdist_make_scheduler`: loadscope's, longest first; None for another --dist."""
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    table = stored_durations() if seconds is None else seconds

    class LongestFirst(LoadScopeScheduling):
        _ordered = False

        def _assign_work_unit(self, node):
            # loadscope's schedule() builds the whole work queue, then assigns its first units: reordered here,
            # once, before the first one leaves.
            if not self._ordered:
                self._ordered = True
                self.workqueue = longest_first(self.workqueue, table)
            super()._assign_work_unit(node)

    return LongestFirst(config, log)


class DurationRecorder:
    """`--store-durations`: each test's setup + call + teardown seconds, summed where the whole run is seen (the
    xdist controller, or the one process without xdist), merged into the table at the end of the session."""

    def __init__(self, path: Path = DURATIONS):
        self.path, self.measured = path, {}

    def pytest_runtest_logreport(self, report):
        if os.environ.get("PYTEST_XDIST_WORKER") is None:
            self.measured[report.nodeid] = self.measured.get(report.nodeid, 0.0) + report.duration

    def pytest_sessionfinish(self, session):
        if os.environ.get("PYTEST_XDIST_WORKER") is None and self.measured:
            table = stored_durations(self.path) | {nodeid: round(s, 2) for nodeid, s in self.measured.items()}
            self.path.write_text(json.dumps(dict(sorted(table.items())), indent=0) + "\n")
