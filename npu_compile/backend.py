"""The ``ascend`` torch.compile backend: the whole pipeline, top to bottom.

    Dynamo graph
      → aot_autograd (functionalized aten; inputs mutated in inference graphs stay mutations)
      → training: joint forward+backward graph → fusion rules → min-cut partition under ``memory_budget``
        inference: fusion rules on the forward graph
      → per graph (forward / backward / inference): aten-level stages → lowering for the target → executor

Each stage's graph goes to the dump dir and to tlparse; each compiled Dynamo graph gets one report.json.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.partitioners import min_cut_rematerialization_partition

from npu_compile import comm, config, lowering, passes
from npu_compile.debug.dump import GraphDump
from npu_compile.debug.plots import memory_png
from npu_compile.debug.report import Report, count_ops, publish
from npu_compile.debug.verify import verified
from npu_compile.passes import recompute
from npu_compile.passes.reorder import reorder_for_peak
from npu_compile.passes.memory import (
    arena,
    graph_buffers,
    is_saved_activation,
    liveness,
    saved_activation_bytes,
    training_buffers,
)

log = logging.getLogger("npu_compile")



def _memory_order(gm: torch.fx.GraphModule, opts: config.Options, kind: str) -> None:
    # In a backward graph the saved activations die inside it: ordering can release them early.
    reorder_for_peak(gm, is_saved_activation if kind == "backward" else (lambda n: False))


# Aten-level stages run on every forward / backward / inference graph, in order, before lowering:
# (name, pass(gm, options, kind)). Overlap scheduling (a no-op unless ``options.overlap``) comes after memory
# ordering: memory ordering pins only the collectives' relative order and may move compute across their waits,
# while the overlap pass keeps peak memory within a cap of the order it is given.
ATEN_STAGES: list[tuple[str, Callable[[torch.fx.GraphModule, config.Options, str], None]]] = [
    ("memory_order", _memory_order),
    ("overlap", comm.overlap_stage),
]

_direct_ids = itertools.count()


def _graph_id(gm: torch.fx.GraphModule) -> str:
    compile_id = gm.meta.get("dynamo_compile_id") or torch._guards.CompileContext.current_compile_id()
    if compile_id is None:  # called outside Dynamo, e.g. on a hand-made GraphModule
        return f"direct_{next(_direct_ids)}"
    return str(compile_id).replace("/", "_")


class _Compilation:
    """The state shared by the compilers of one Dynamo graph: options, dump and report."""

    def __init__(self, gm: torch.fx.GraphModule, opts: config.Options):
        self.opts = opts
        self.graph_id = _graph_id(gm)
        self.dump = GraphDump(opts.dump_dir, self.graph_id)
        reason = getattr(gm, "compile_subgraph_reason", None)
        broke = bool(reason is not None and reason.graph_break)
        self.report = Report(
            graph_id=self.graph_id,
            target=opts.target,
            graph_breaks=int(broke),
            graph_break_reason=reason.reason if broke else None,
            options={k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(opts).items()},
        )
        self.final: dict[str, torch.fx.GraphModule] = {}  # kind -> graph as it runs
        self.partitioned_bw: torch.fx.GraphModule | None = None
        # kind -> simulated comm timelines of the graph as aot_autograd gave it and after the aten stages
        self.comm_timelines: dict[str, tuple[comm.Timeline, comm.Timeline]] = {}
        publish(self.report)
        self.dump.stage("dynamo", "captured", gm)

    # -- training: runs once on the joint graph, before either half is compiled
    def partition(self, joint: torch.fx.GraphModule, joint_inputs: Sequence[Any], **kwargs: Any):
        self.dump.stage("joint", "aot_joint", joint)
        self._record_fusions(*passes.apply_rules(joint, self.opts.fusion_enabled, passes.TRAINING))
        self.dump.stage("joint", "fused", joint)
        # memory_budget → the min-cut's activation budget, recompute weighed by the cost model; attention's
        # outputs are always saved, cheap fused ops may be recomputed (passes/recompute.py)
        with recompute.policy(joint, self.opts.memory_budget):
            fw, bw = min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)
        again = recompute.recompute_cost(fw.graph, bw.graph)
        self.report.memory.update(recompute_nodes=again.nodes, recompute_flops=again.flops,
                                  recompute_us=again.us, recompute_ops=again.ops,
                                  step_flops=recompute.matrix_flops(fw.graph) + recompute.matrix_flops(bw.graph))
        self.before = training_buffers(fw.graph, bw.graph)
        self.report.memory["peak_bytes_before"] = liveness(*self.before).peak
        self.partitioned_bw = bw
        log.info("%s", self.dump.summary("joint"))
        return fw, bw

    def compiler(self, kind: str) -> Callable:
        """The compiler aot_autograd calls for the ``kind`` graph: forward, backward or inference."""

        def compile_graph(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]):
            self.dump.stage(kind, "aot", gm)
            if kind == "inference":
                gb = graph_buffers(gm.graph)
                self.before = (gb.buffers, len(gb.steps))
                self.report.memory["peak_bytes_before"] = liveness(*self.before).peak
                self._record_fusions(*passes.apply_rules(gm, self.opts.fusion_enabled, passes.INFERENCE))
                self.dump.stage(kind, "fused", gm)
            comm_before = comm.simulate(gm)
            for name, stage in ATEN_STAGES:
                stage(gm, self.opts, kind)
                self.dump.stage(kind, name, gm)
            self.comm_timelines[kind] = (comm_before, comm.simulate(gm))
            self.report.unfused += lowering.lower(gm, self.opts)
            gm.graph.lint()
            gm.recompile()
            self.dump.stage(kind, f"lowered_{self.opts.target}", gm)
            self.final[kind] = gm
            self._finish_report(kind)
            return lowering.executor(gm, example_inputs, self.opts)  # op by op, or torchair on the NPU

        return compile_graph

    def _record_fusions(self, counts: dict[str, int], unfused: list[dict[str, str]]) -> None:
        for rule, n in counts.items():
            self.report.fusions[rule] = self.report.fusions.get(rule, 0) + n
        self.report.unfused += unfused

    def _finish_report(self, kind: str) -> None:
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
            buffers, steps = training_buffers(self.final["forward"].graph, bw.graph)
            r.memory["saved_activation_bytes"] = saved_activation_bytes(bw.graph)
        live = liveness(buffers, steps)
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


def ascend(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], *, options: dict | None = None, mode: str | None = None):
    """``torch.compile(model, backend="ascend", options={...})``: compile one Dynamo graph for Ascend."""
    if mode not in (None, "default"):
        raise config.OptionError(
            f"the ascend backend takes no torch.compile mode (got {mode!r}); pass options={{...}} with keys "
            f"{', '.join(config.KEYS)}"
        )
    opts = config.resolve(options)  # first: a wrong option is the error the user reads, raised as itself
    if opts.target == "npu-sim":  # the npu ops exist before the aten stages: the overlap stage's MC2 rewrite emits them
        from npu_compile.lowering import npu_sim_kernels

        npu_sim_kernels.register()
    c = _Compilation(gm, opts)
    compiled = aot_autograd(
        fw_compiler=c.compiler("forward"),
        bw_compiler=c.compiler("backward"),
        inference_compiler=c.compiler("inference"),
        partition_fn=c.partition,
        decompositions=passes.decompositions(),
        keep_inference_input_mutations=True,
    )(gm, example_inputs)
    return verified(compiled, gm, c.report, c.dump) if opts.verify else compiled
