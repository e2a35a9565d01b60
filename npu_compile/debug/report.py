"""report.json: what the backend did to one compiled graph, in figures.

The keys are a contract (README, report.json): they may grow, never shrink. A :class:`Recorder` fills one
:class:`Report` as the backend moves a graph through the pipeline (fusions, the partition's memory figures,
each stage's ``unfused`` entries, each compiled piece's ops, memory plan and comm timeline); the report is
rewritten after each compiled piece (the backward compiles lazily, on the first ``.backward()``), and every
report made inside :func:`collect` is handed to its caller (``npu_compile.explain``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import torch

from npu_compile import comm, passes, regions
from npu_compile.config import Options
from npu_compile.debug.dump import GraphDump
from npu_compile.debug.plots import memory_png
from npu_compile.passes import offload, recompute
from npu_compile.passes.memory import arena, graph_buffers, liveness, training_buffers, training_memory

log = logging.getLogger("npu_compile")


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
    # npu targets, per graph kind: the graph mode it will run in (torchair GE, aclgraph, or op by op) and whether
    # torchair's own conversion of it passed on the CPU: "checked", "failed" (with "reason") or "unchecked" (with
    # "reason": option torchair_check off, no wheel, ...)
    graph_modes: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    options: dict[str, Any] = dataclasses.field(default_factory=dict)
    verify: dict[str, Any] | None = None
    # How many distinct modules (parameter sets) have run this compiled graph: N identical layers compiled once
    # show N here; reused is True when more than one did.
    reused_by: int = 0
    reused: bool = False
    # Persistent cache, per step ("partition", "forward", "backward", "inference"): "hit", "miss" (compiled and
    # stored), "rebuilt" (an entry failed its checks: ignored, compiled again) or "off".
    cache: dict[str, str] = dataclasses.field(default_factory=dict)
    # Seconds this backend spent on the graph, per part (wall clock, summed over forward / backward / inference):
    # "rule_tracing" (tracing rule patterns, or loading them from the pattern cache, first needed in this
    # process), "rule_matching" (the rest of the fusion rules), "partition" (the min-cut), "aten_stages" (memory
    # order, the target's stages, overlap), "lowering", "cache" (keys, loads, stores). Dynamo's and
    # aot_autograd's own tracing are not counted (tlparse / TORCH_LOGS=dynamo show them).
    compile_s: dict[str, float] = dataclasses.field(default_factory=dict)
    # memory_budget "auto": the budget chosen, the cap, and every budget tried with its planned peak
    budget: dict[str, Any] | None = None
    # Nested compile regions (invoke_subgraph, e.g. N identical layers): name -> {"fusions": {rule: sites in one
    # call}, "calls": call sites in the graph}. Each region's rules run once; ``fusions`` above counts every
    # call (sites × calls).
    regions: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)

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
    """Operator counts over ``graphs`` as they run, most frequent first: a region call counts as
    ``higher_order.invoke_subgraph`` and as the ops of its subgraph, once per call."""
    counts: Counter[str] = Counter()
    per_region: dict[int, Counter[str]] = {}  # id(subgraph) -> the ops of one call: each region walked once

    def walk(gm: torch.fx.GraphModule, into: Counter[str]) -> None:
        for n in gm.graph.nodes:
            sub = regions.subgraph(n)
            if sub is not None:
                into["higher_order.invoke_subgraph"] += 1
                if id(sub) not in per_region:
                    per_region[id(sub)] = Counter()
                    walk(sub, per_region[id(sub)])
                into.update(per_region[id(sub)])
            elif (name := op_name(n)) is not None:
                into[name] += 1

    for gm in graphs:
        walk(gm, counts)
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
        # by identity: nested blocks hold equal lists (each report goes to every block)
        _collectors[:] = [c for c in _collectors if c is not reports]


@dataclasses.dataclass
class _Region:
    fusions: dict[str, int]
    unfused: list[dict[str, str]]
    modules: list[Any]
    name: str | None = None
    calls: int = 0


class Recorder:
    """Assembles the report of one Dynamo graph as the backend compiles it, and writes it to the dump dir."""

    def __init__(self, gm: torch.fx.GraphModule, opts: Options, dump: GraphDump):
        reason = getattr(gm, "compile_subgraph_reason", None)
        broke = bool(reason is not None and reason.graph_break)
        self.report = Report(
            graph_id=dump.graph_id,
            target=opts.target,
            graph_breaks=int(broke),
            graph_break_reason=reason.reason if broke else None,
            options={k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(opts).items()},
        )
        self.dump, self.opts = dump, opts
        self.final: dict[str, torch.fx.GraphModule] = {}  # kind -> graph as it runs
        self.partitioned_bw: torch.fx.GraphModule | None = None
        self.before: tuple | None = None  # (buffers, steps) of the graph(s) as aot_autograd gave them
        # kind -> simulated comm timelines of the graph as aot_autograd gave it and after the aten stages
        self.comm_timelines: dict[str, tuple[comm.Timeline, comm.Timeline]] = {}
        self._own_fusions: dict[str, int] = {}  # the graph's own sites, regions apart
        self._regions: dict[int, _Region] = {}  # id(region subgraph) -> its record (forward and backward alike)
        self._named: dict[str, _Region] = {}
        publish(self.report)

    @contextlib.contextmanager
    def timed(self, part: str) -> Iterator[None]:
        """Add the wall time of the block to report.json ``compile_s[part]``."""
        start = time.perf_counter()
        try:
            yield
        finally:
            spent = self.report.compile_s.get(part, 0.0) + time.perf_counter() - start
            self.report.compile_s[part] = round(spent, 4)

    def rules(self, gm: torch.fx.GraphModule, enabled: Callable[[str], bool], mode: str) -> dict[str, int]:
        """Apply the fusion rules to ``gm``, recording their counts, unfused sites and time (tracing apart)."""
        counts, unfused = self.region_rules(gm, enabled, mode)
        self.fusions(counts, unfused)
        return counts

    def fusions(self, counts: dict[str, int], unfused: list[dict[str, str]]) -> None:
        for rule, n in counts.items():
            self._own_fusions[rule] = self._own_fusions.get(rule, 0) + n
        self.report.unfused += unfused
        self._total_fusions()

    # -- regions: counted once each, with their calls
    def region_rules(self, gm: torch.fx.GraphModule, enabled: Callable[[str], bool],
                     mode: str) -> tuple[dict[str, int], list[dict[str, str]]]:
        """Apply the fusion rules to one region's graph, timed as ``rules``; counted when the region is named."""
        traced_before = passes.engine.TRACING.seconds
        with self.timed("rule_matching"), passes.engine.TRACE_CACHE.persisting(self.opts.pattern_cache):
            counts, unfused = passes.apply_rules(gm, enabled, mode)
        tracing = passes.engine.TRACING.seconds - traced_before
        self.report.compile_s["rule_matching"] = round(self.report.compile_s["rule_matching"] - tracing, 4)
        self.report.compile_s["rule_tracing"] = round(self.report.compile_s.get("rule_tracing", 0.0) + tracing, 4)
        return counts, unfused

    def region_partitioned(self, fw: torch.fx.GraphModule, bw: torch.fx.GraphModule | None,
                           counts: dict[str, int], unfused: list[dict[str, str]]) -> None:
        region = _Region(dict(counts), list(unfused), [fw, bw])  # holds the modules: their ids stay theirs
        for gm in (fw, bw):
            if gm is not None:
                self._regions[id(gm)] = region

    def knows_region(self, gm: torch.fx.GraphModule) -> bool:
        return id(gm) in self._regions

    def region_called(self, gm: torch.fx.GraphModule, name: str, calls: int) -> None:
        """The region whose (forward or backward) subgraph is ``gm`` is ``name``, called ``calls`` times."""
        region = self._regions[id(gm)]
        if region.name is None:
            region.name = name
            self._named[name] = region
            self.report.unfused += [{**u, "region": name} for u in region.unfused]
        region.calls = max(region.calls, calls)
        self._total_fusions()

    def regions_json(self) -> dict[str, dict[str, Any]]:
        return {name: {"fusions": r.fusions, "calls": r.calls, "unfused": r.unfused} for name, r in self._named.items()}

    def restore_regions(self, stored: dict[str, dict[str, Any]]) -> None:
        """The regions of a graph loaded from the cache, as ``regions_json`` stored them."""
        for name, r in stored.items():
            self._named[name] = _Region(dict(r["fusions"]), list(r["unfused"]), [], name, r["calls"])
            self.report.unfused += [{**u, "region": name} for u in r["unfused"]]
        self._total_fusions()

    def _total_fusions(self) -> None:
        total = dict(self._own_fusions)
        for r in self._named.values():
            for rule, n in r.fusions.items():
                total[rule] = total.get(rule, 0) + n * r.calls
        self.report.fusions = total
        self.report.regions = {name: {"fusions": {k: v for k, v in r.fusions.items() if v}, "calls": r.calls}
                               for name, r in self._named.items()}

    def budget(self, chosen: recompute.Plan, tried: list[recompute.Plan], device_memory: int) -> None:
        self.report.budget = {"chosen": chosen.budget, "device_memory": device_memory,
                              "resident_memory": chosen.resident, "activation_copies": chosen.copies,
                              "tried": [p.to_json() for p in tried]}
        log.info("graph %s: memory_budget auto chose %s (planned peak %.2f MiB of %.2f MiB)", self.report.graph_id,
                 chosen.budget, chosen.peak / 2**20, device_memory / 2**20)

    def offload(self, result: offload.Offload) -> None:
        """Option ``offload``: what went to host memory, the copies' cost, the planned peak with and without."""
        self.report.memory["offload"] = result.to_json()
        log.info("graph %s: offload %d saved tensors (%.2f MiB) of %s to host; planned peak %.2f -> %.2f MiB",
                 self.report.graph_id, len(result.tensors), result.bytes / 2**20, ", ".join(result.modules),
                 result.peak_bytes_without / 2**20, result.peak_bytes_with / 2**20)

    def offload_placed(self, bw: torch.fx.GraphModule) -> None:
        """The backward's prefetches as scheduled (after memory ordering): the time compute waits for them."""
        if "offload" in self.report.memory:
            self.report.memory["offload"]["exposed_h2d_us"] = offload.exposed_h2d_us(bw)

    def partition(self, fw: torch.fx.GraphModule, bw: torch.fx.GraphModule) -> None:
        """The min-cut's result: what it recomputes, and the memory of the two halves as partitioned."""
        again = recompute.recompute_cost(fw.graph, bw.graph)
        self.report.memory.update(recompute_nodes=again.nodes, recompute_flops=again.flops,
                                  recompute_us=again.us, recompute_ops=again.ops,
                                  step_flops=recompute.matrix_flops(fw.graph) + recompute.matrix_flops(bw.graph))
        self.before = training_buffers(fw.graph, bw.graph)
        self.report.memory["peak_bytes_before"] = liveness(*self.before).peak
        self.partitioned_bw = bw

    def unbacked_hints(self, hints: dict[str, int]) -> None:
        """The size hints given to the graph's data-dependent sizes (passes/unbacked_hints.py): report.json
        memory ``unbacked_hints``."""
        if hints:
            self.report.memory["unbacked_hints"] = hints

    def inference_input(self, gm: torch.fx.GraphModule) -> None:
        """The memory of an inference graph as aot_autograd gave it."""
        gb = graph_buffers(gm.graph)
        self.before = (gb.buffers, len(gb.steps))
        self.report.memory["peak_bytes_before"] = liveness(*self.before).peak

    def graph_done(self, kind: str, gm: torch.fx.GraphModule) -> None:
        """``gm`` (the ``kind`` graph) is lowered: its figures join the report, which is written again."""
        self.final[kind] = gm
        r = self.report
        r.graphs.append(kind)
        graphs = list(self.final.values())
        r.lowered_ops = count_ops(*graphs)
        r.comm["collectives"] = len(comm.collectives(*graphs))
        self._record_comm()
        if "inference" in self.final:
            gb = graph_buffers(self.final["inference"].graph)
            buffers, steps = gb.buffers, len(gb.steps)
            r.memory["saved_activation_bytes"] = 0
        else:
            bw = self.final.get("backward", self.partitioned_bw)
            t = training_memory(self.final["forward"].graph, bw.graph)
            buffers, steps = t.buffers, t.steps
            r.memory["saved_activation_bytes"] = t.saved_bytes
        live = liveness(buffers, steps)
        # the step's planned peak: what the job holds besides (resident_memory), the other copies' saved
        # activations, and this schedule's live bytes
        opts = self.opts
        r.memory["planned_peak_bytes"] = (opts.resident_memory + (opts.activation_copies - 1)
                                          * r.memory["saved_activation_bytes"] + live.peak)
        _, arena_bytes = arena(buffers)
        r.memory["peak_bytes_after"] = arena_bytes  # what the static plan of the final order needs
        r.memory["lower_bound_bytes"] = live.peak  # what any allocator needs for that order
        r.memory["peak_tensors"] = [dataclasses.asdict(b) for b in live.at_peak[:8]]
        if self.dump.root is not None and kind != "forward":  # the whole schedule is known
            boundary = None if kind == "inference" else sum(
                1 for n in self.final["forward"].graph.nodes if n.op not in ("placeholder", "get_attr", "output"))
            png = memory_png(liveness(*self.before), live, boundary, f"graph {r.graph_id}: live bytes, {kind}")
            if png is not None:
                self.dump.write("memory.png", png)
        self.dump.report(r.to_json())
        log.info("%s", self.dump.summary(kind))
        if kind != "forward":  # the graph is complete: its one line
            fused = {rule: n for rule, n in r.fusions.items() if n}
            log.info(
                "graph %s (%s): %s compiled, fusions %s, %d unfused, peak %.2f MiB, %d collectives",
                r.graph_id, r.target, "+".join(r.graphs), fused or "none", len(r.unfused), live.peak / 2**20,
                r.comm["collectives"],
            )

    def _record_comm(self) -> None:
        """report.json ``comm`` from the simulated timelines, summed over the graphs compiled so far, and, when
        they hold collectives, their Chrome / Perfetto trace as ``overlap_trace.json`` in the dump dir."""
        runs = self.comm_timelines.values()
        self.report.comm.update(
            comm_us=round(sum(after.comm_us for _, after in runs), 3),
            compute_us=round(sum(after.compute_us for _, after in runs), 3),
            exposed_comm_us_before=round(sum(before.exposed_comm_us for before, _ in runs), 3),
            exposed_comm_us_after=round(sum(after.exposed_comm_us for _, after in runs), 3),
        )
        if self.dump.root is not None and any(before.collectives for before, _ in runs):
            timelines = {
                f"{kind} · {when}": timeline
                for kind, (before, after) in self.comm_timelines.items()
                for when, timeline in (("as captured", before), ("scheduled", after))
            }
            self.dump.write("overlap_trace.json", json.dumps(comm.chrome_trace(timelines)))
