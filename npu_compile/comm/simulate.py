"""A two-stream timeline of one FX graph in its node order, and its Chrome / Perfetto trace.

The compute stream runs the compute nodes one after another, in graph order. A collective is issued when the
compute stream reaches it (its inputs are ready by then) and starts once the comm stream is free; comm runs
collectives one at a time, in issue order. Its ``wait_tensor`` holds the compute stream until the collective
has finished: that hold is *exposed* communication. Costs come from :mod:`npu_compile.device.cost`.

An MC2 node (a matmul and a collective in one kernel) runs on the compute stream for its fused time and holds the
link as long: it starts when the compute stream reaches it and the link is free (the compute stream idles until
then, exposed), and the link is busy until it ends. It counts its matmul as compute, its collective as comm, and
fused − matmul as exposed comm (:func:`npu_compile.device.cost.mc2_cost`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable, Mapping

import torch

from npu_compile.device import cost, nodes
from npu_compile.device.profile import DeviceProfile, load

log = logging.getLogger("npu_compile")

COMPUTE, COMM, EXPOSED = "compute", "comm", "exposed"


@dataclasses.dataclass(frozen=True)
class Event:
    name: str
    stream: str  # compute | comm | exposed (the compute stream held by a wait)
    start_us: float
    dur_us: float
    op: str = ""


@dataclasses.dataclass
class Timeline:
    events: list[Event]
    compute_us: float  # sum of compute node costs (an MC2 node's matmul part)
    comm_us: float  # sum of collective costs (an MC2 node's collective part)
    exposed_comm_us: float  # time the compute stream spends waiting for collectives (and in MC2 beyond its matmul)
    total_us: float  # end of the last event
    collectives: int  # _c10d_functional collectives
    mc2: int = 0  # MC2 nodes

    def summary(self) -> dict[str, float]:
        return {
            "collectives": self.collectives,
            "mc2": self.mc2,
            "compute_us": round(self.compute_us, 3),
            "comm_us": round(self.comm_us, 3),
            "exposed_comm_us": round(self.exposed_comm_us, 3),
            "total_us": round(self.total_us, 3),
        }


Schedule = torch.fx.GraphModule | torch.fx.Graph | Iterable[torch.fx.Node]


def _nodes(schedule: Schedule) -> Iterable[torch.fx.Node]:
    """The nodes of a graph in its order, or a node order given as a sequence."""
    if isinstance(schedule, torch.fx.GraphModule):
        return schedule.graph.nodes
    if isinstance(schedule, torch.fx.Graph):
        return schedule.nodes
    return schedule


def _op(node: torch.fx.Node) -> str:
    return str(node.target) if node.op == "call_function" else node.op


MC2Costs = Callable[[torch.fx.Node], "cost.MC2Cost"]


def simulate(
    schedule: Schedule,
    profile: DeviceProfile | Mapping | None = None,
    cost_us: Callable[[torch.fx.Node], float] | None = None,
    mc2_cost: MC2Costs | None = None,
) -> Timeline:
    """Run a graph (or a node order) on the two streams; ``cost_us`` overrides the profile's cost model for plain
    nodes, ``mc2_cost`` (a node → :class:`~npu_compile.device.cost.MC2Cost`) for MC2 nodes."""
    profile = load(profile)
    per_region: dict[int, float] = {}  # each region's time once, not once per call
    cost_us = cost_us or (lambda n: cost.node_us(n, profile, per_region))
    mc2_cost = mc2_cost or (lambda n: cost.mc2_cost(n, profile))
    events: list[Event] = []
    clock = comm_free = compute = comm = exposed = 0.0
    finish: dict[torch.fx.Node, float] = {}  # collective -> when it completes
    fused_ops = 0
    for node in _nodes(schedule):
        if nodes.fused_collective(node) is not None:
            parts = mc2_cost(node)
            start = max(clock, comm_free)
            if start > clock:  # the link is still busy with earlier comm
                events.append(Event(f"link busy: {node.name}", EXPOSED, clock, start - clock, _op(node)))
            events.append(Event(node.name, COMPUTE, start, parts.fused_us, _op(node)))
            events.append(Event(node.name, COMM, start, parts.fused_us, _op(node)))
            exposed += start - clock + parts.fused_us - parts.matmul_us
            clock = comm_free = start + parts.fused_us
            compute += parts.matmul_us
            comm += parts.comm_us
            fused_ops += 1
        elif nodes.is_collective(node):
            dur = cost_us(node)
            start = max(clock, comm_free)
            comm_free = finish[node] = start + dur
            comm += dur
            events.append(Event(node.name, COMM, start, dur, _op(node)))
        elif nodes.is_wait(node):
            done = finish.get(nodes.collective_of(node), clock)
            if done > clock:
                events.append(Event(f"wait {node.args[0].name}", EXPOSED, clock, done - clock, _op(node)))
                exposed += done - clock
                clock = done
        else:
            dur = cost_us(node)
            if dur > 0:
                events.append(Event(node.name, COMPUTE, clock, dur, _op(node)))
                clock += dur
                compute += dur
    total = max(clock, comm_free)
    # A collective nobody waits for still has to finish before the graph does.
    exposed += total - clock
    return Timeline(events, compute, comm, exposed, total, len(finish), fused_ops)


def exposed_comm_lower_bound(
    schedule: Schedule,
    profile: DeviceProfile | Mapping | None = None,
    cost_us: Callable[[torch.fx.Node], float] | None = None,
    mc2_cost: MC2Costs | None = None,
) -> float:
    """The least exposed comm any order of the graph can reach, as :func:`simulate` counts it: no schedule ends
    before the compute stream's busy time, the link's busy time, or the longest dependency chain of compute and
    collectives; and exposed = end − compute.

    An MC2 node holds both the compute stream and the link for its fused time, so both busy times and the chain
    take its fused time, while compute counts only its matmul (as in :func:`simulate`): a graph of MC2 nodes
    alone has Σ (fused − matmul) exposed in any order."""
    profile = load(profile)
    per_region: dict[int, float] = {}  # each region's time once, not once per call
    cost_us = cost_us or (lambda n: cost.node_us(n, profile, per_region))
    mc2_cost = mc2_cost or (lambda n: cost.mc2_cost(n, profile))
    path: dict[torch.fx.Node, float] = {}
    compute = busy = link = 0.0  # compute counted; compute stream busy; link busy
    for node in _nodes(schedule):  # any schedule is a topological order
        if nodes.fused_collective(node) is not None:
            parts = mc2_cost(node)
            c = parts.fused_us
            compute += parts.matmul_us
            busy += c
            link += c
        else:
            c = cost_us(node)
            if nodes.is_collective(node):
                link += c
            else:
                compute += c
                busy += c
        path[node] = c + max((path[i] for i in node.all_input_nodes), default=0.0)
    end = max(busy, link, max(path.values(), default=0.0))
    return end - compute


def chrome_trace(timelines: Mapping[str, Timeline]) -> dict:
    """Chrome / Perfetto trace: one process per timeline (e.g. "forward · scheduled"), threads compute and comm."""
    threads = {COMPUTE: 0, EXPOSED: 0, COMM: 1}
    trace: list[dict] = []
    for pid, (label, timeline) in enumerate(timelines.items()):
        trace.append({"name": "process_name", "ph": "M", "pid": pid, "args": {"name": label}})
        trace.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": "compute"}})
        trace.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": 1, "args": {"name": "comm"}})
        for e in timeline.events:
            trace.append({
                "name": e.name, "cat": e.stream, "ph": "X", "pid": pid, "tid": threads[e.stream],
                "ts": round(e.start_us, 3), "dur": round(e.dur_us, 3), "args": {"op": e.op},
            })
        trace.append({
            "name": "summary", "ph": "i", "s": "p", "pid": pid, "tid": 0, "ts": round(timeline.total_us, 3),
            "args": timeline.summary(),
        })
    return {"traceEvents": trace, "displayTimeUnit": "ms"}
