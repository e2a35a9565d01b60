"""The ``ascend`` torch.compile backend: the whole pipeline, top to bottom.

    Dynamo graph
      → aot_autograd (functionalized aten; inputs mutated in inference graphs stay mutations)
      → training: joint forward+backward graph → fusion rules → min-cut partition under ``memory_budget``
        inference: fusion rules on the forward graph
      → per graph (forward / backward / inference): aten-level stages (memory ordering, the target's own, overlap
        scheduling) → the target's lowering → the target's executor

Regions (``torch.compiler.nested_compile_region``: Dynamo's invoke_subgraph, e.g. N identical transformer layers)
are compiled once each, not once per call: aot_autograd hands each region's joint graph to the partitioner before
the outer one (torch/_functorch/_aot_autograd/graph_compile.py, run_joint_graph_passes_on_hops), so the fusion
rules and the min-cut run there per region; the aten stages and lowering run on each region's forward / backward
subgraph once, before the graph that calls it; the executor runs the lowered subgraph at every call site.

The target is an object (``lowering.target``): this module composes what it declares and knows no target by
name. Each stage's graph goes to the dump dir and to tlparse; each compiled Dynamo graph gets one report.json
(assembled by ``debug/report.py``). The partition and each graph's stages + lowering go through the persistent
cache (``cache.py``): on a hit their result is loaded instead of computed.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.partitioners import min_cut_rematerialization_partition

from npu_compile import cache, comm, config, lowering, passes, precompile, regions
from npu_compile.debug.dump import GraphDump
from npu_compile.debug.report import Recorder
from npu_compile.debug.verify import verified
from npu_compile.device.profile import load as load_profile
from npu_compile.passes import offload, recompute, unbacked_hints
from npu_compile.passes.memory import is_saved_activation, nothing_dies_inside
from npu_compile.passes.reorder import reorder_for_peak

log = logging.getLogger("npu_compile")


def _memory_order(gm: torch.fx.GraphModule, opts: config.Options, kind: str) -> None:
    # In a backward graph the saved activations die inside it: ordering can release them early.
    reorder_for_peak(gm, is_saved_activation if kind == "backward" else nothing_dies_inside)
    if kind == "backward" and opts.offload:
        # ordering puts each prefetch just before its reader (it only adds live bytes): issue it early again
        offload.place_prefetches(gm)


def aten_stages(target: lowering.Target) -> list[tuple[str, lowering.Stage]]:
    """The aten-level stages every forward / backward / inference graph goes through, in order, before lowering:
    (name, stage(gm, options, kind) -> ``unfused`` entries or None). Memory ordering first: it pins only the
    collectives' relative order and may move compute across their waits. Then the target's own stages (npu's MC2
    rewrite, which must see the collectives before bucketing merges them). Overlap scheduling (a no-op unless
    ``options.overlap``) last: it keeps peak memory within a cap of the order it is given."""
    return [("memory_order", _memory_order), *target.stages, ("overlap", comm.overlap_stage)]


_direct_ids = itertools.count()


def _graph_id(gm: torch.fx.GraphModule) -> str:
    compile_id = gm.meta.get("dynamo_compile_id") or torch._guards.CompileContext.current_compile_id()
    if compile_id is None:  # called outside Dynamo, e.g. on a hand-made GraphModule
        return f"direct_{next(_direct_ids)}"
    return str(compile_id).replace("/", "_")



class _Compilation:
    """The state shared by the compilers of one Dynamo graph: options, target, dump and report."""

    def __init__(self, gm: torch.fx.GraphModule, opts: config.Options, target: lowering.Target):
        self.opts, self.target = opts, target
        self.dump = GraphDump(opts.dump_dir, _graph_id(gm))
        self.record = Recorder(gm, opts, self.dump)
        self.report = self.record.report
        self._lowered_regions: set[int] = set()
        self.dump.stage("dynamo", "captured", gm)

    def _cached(self, step: str, gm: torch.fx.GraphModule, inputs: Sequence[Any]) -> tuple[str | None, dict | None]:
        """(key, entry) of ``step`` on ``gm``: entry None on a miss; key None with the cache off."""
        if not self.opts.cache:
            self.report.cache[step] = "off"
            return None, None
        try:
            with self.record.timed("cache"):
                key = cache.graph_key(step, gm, self.opts, self.target.communicator)
        except Exception as e:  # a graph the key cannot describe: compile it, uncached
            log.info("npu_compile cache: no key for %s of graph %s (%s)", step, self.report.graph_id, e)
            self.report.cache[step] = "off"
            return None, None
        with self.record.timed("cache"):
            state, entry = cache.load(key, cache.fake_mode_of(inputs))
        self.report.cache[step] = state
        return key, entry

    def _store(self, key: str | None, value: dict) -> None:
        if key is not None:
            with self.record.timed("cache"):
                cache.store(key, value)

    # -- training: runs once on the joint graph, before either half is compiled
    def partition(self, joint: torch.fx.GraphModule, joint_inputs: Sequence[Any], **kwargs: Any):
        if not joint_inputs:
            # aot_autograd partitions each region's joint graph before the outer one, with no example inputs
            # (graph_compile.py, run_joint_graph_passes_on_hops: partition_fn(joint_hop_gm, [], ...)); a training
            # graph of its own always has inputs
            return self._partition_region(joint, **kwargs)
        self.dump.stage("joint", "aot_joint", joint)
        self.record.unbacked_hints(unbacked_hints.seed(joint.graph))  # before any memory analysis, cached or not
        key, hit = self._cached("partition", joint, joint_inputs)
        primals = sum(1 for n in joint.graph.nodes if n.op == "placeholder" and n.name.startswith("primals"))
        if hit is not None and sum(1 for n in hit["fw"].graph.nodes if n.op == "placeholder") == primals:
            fw, bw = hit["fw"], hit["bw"]
            if hit.get("offload") is not None:
                self.report.memory["offload"] = hit["offload"]
            self.record.fusions(hit["fusions"], hit["unfused"])
            self.record.restore_regions(hit.get("regions", {}))
        else:
            if hit is not None:
                log.warning("npu_compile cache: partition entry of graph %s does not fit its joint graph; rebuilding",
                            self.report.graph_id)
                self.report.cache["partition"] = "rebuilt"
            unfused_from = len(self.report.unfused)
            counts = self.record.rules(joint, self.opts.fusion_enabled, passes.TRAINING)
            unfused = self.report.unfused[unfused_from:]
            self._name_regions(joint, passes.INFERENCE)
            self.dump.stage("joint", "fused", joint)
            # memory_budget → the min-cut's activation budget, recompute weighed by the cost model; attention's
            # outputs are always saved, cheap fused ops may be recomputed (passes/recompute.py)
            with self.record.timed("partition"):
                fw, bw = self._partition(joint, joint_inputs, **kwargs)
            self._store(key, {"fw": fw, "bw": bw, "fusions": counts, "unfused": unfused,
                              "regions": self.record.regions_json(), "offload": self.report.memory.get("offload")})
        self.record.partition(fw, bw)
        log.info("%s", self.dump.summary("joint"))
        return fw, bw

    def _partition_region(self, joint: torch.fx.GraphModule, **kwargs: Any):
        """One region's joint graph: the fusion rules and the min-cut, as for a whole graph; counted per region
        (``Recorder.region_partitioned``), once its name and calls are known from the outer joint."""
        self.dump.stage("regions", "aot_joint", joint)
        inputs = [n.meta.get("val") for n in joint.graph.find_nodes(op="placeholder")]
        key, hit = self._cached("region_partition", joint, inputs)
        if hit is not None:
            fw, bw, counts, unfused = hit["fw"], hit["bw"], hit["fusions"], hit["unfused"]
        else:
            counts, unfused = self.record.region_rules(joint, self.opts.fusion_enabled, passes.TRAINING)
            self.dump.stage("regions", "fused", joint)
            with self.record.timed("partition"):
                fw, bw = self._partition(joint, [], **kwargs)
            self._store(key, {"fw": fw, "bw": bw, "fusions": counts, "unfused": unfused})
        self.record.region_partitioned(fw, bw, counts, unfused)
        return fw, bw

    def _name_regions(self, gm: torch.fx.GraphModule, mode: str) -> None:
        """Name the regions ``gm`` calls and count their calls; a region no partition saw (an inference graph's,
        or a training region nothing differentiates) gets the rules of ``mode`` here, once."""
        calls = regions.calls(gm)
        for attr, sub in regions.regions(gm):
            if not self.record.knows_region(sub):
                self.record.region_partitioned(sub, None, *self.record.region_rules(sub, self.opts.fusion_enabled, mode))
                self.dump.stage("regions", f"{regions.name(attr)}_fused", sub)
            self.record.region_called(sub, regions.name(attr), calls.get(id(sub), 0))

    def _compile_regions(self, gm: torch.fx.GraphModule, kind: str) -> None:
        """The aten stages and lowering on each region ``gm`` calls, once per region (a region's forward and its
        backward are separate subgraphs, so each kind meets its own)."""
        for attr, sub in regions.regions(gm):
            if id(sub) in self._lowered_regions:
                continue
            self._lowered_regions.add(id(sub))
            with self.record.timed("aten_stages"):
                for name, stage in aten_stages(self.target):
                    self.report.unfused += stage(sub, self.opts, kind) or []
            with self.record.timed("lowering"):
                self.report.unfused += self.target.lower(sub, self.opts)
                sub.graph.lint()
                sub.recompile()
            self.dump.stage("regions", f"{regions.name(attr)}_{kind}_lowered_{self.opts.target}", sub)

    def _partition(self, joint: torch.fx.GraphModule, joint_inputs: Sequence[Any], **kwargs: Any):
        o = self.opts
        offloaded: list[offload.Offload] = []

        def partition(trial: torch.fx.GraphModule, inputs: Sequence[Any], **kw: Any):
            # the min-cut, then option offload's host copies of the chosen saved values (passes/offload.py)
            fw, bw = min_cut_rematerialization_partition(trial, inputs, **kw)
            if o.offload:
                offloaded.append(offload.offload_saved(fw, bw, o.offload))
            return fw, bw

        if o.memory_budget != "auto":
            saved = self.target.saved_at_full_budget
            with recompute.policy(joint, o.memory_budget, always=o.recompute, saved=saved):
                fw, bw = partition(joint, joint_inputs, **kwargs)
        else:
            cap = o.device_memory if o.device_memory is not None else load_profile().memory_bytes
            fw, bw, chosen, tried = recompute.partition_to_fit(
                joint, joint_inputs, partition, device_memory=cap,
                resident=o.resident_memory, copies=o.activation_copies, graph_id=self.report.graph_id,
                always=o.recompute, saved=self.target.saved_at_full_budget, **kwargs)
            self.record.budget(chosen, tried, cap)
        if offloaded:
            self.record.offload(offloaded[-1])
        return fw, bw

    def _describe(self, kind: str, gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> None:
        """What the target's graph compiler will make of ``gm``: report.json ``graph_modes``, and its artifacts
        (npu: the GE graph torchair builds) in the dump dir."""
        if self.target.describe is None:
            return
        info = dict(self.target.describe(gm, example_inputs, self.opts))
        for name, text in info.pop("artifacts", {}).items():
            self.dump.text(kind, name, text)
        self.report.graph_modes[kind] = info

    def compiler(self, kind: str) -> Callable:
        """The compiler aot_autograd calls for the ``kind`` graph: forward, backward or inference."""

        def compile_graph(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]):
            self.dump.stage(kind, "aot", gm)
            key, hit = self._cached(kind, gm, example_inputs)
            if kind == "inference":
                self.record.unbacked_hints(unbacked_hints.seed(gm.graph))
                self.record.inference_input(gm)
            if hit is not None:
                lowered = hit["gm"]
                self.record.fusions(hit["fusions"], hit["unfused"])
                self.record.restore_regions(hit.get("regions", {}))
                self.record.comm_timelines[kind] = hit["comm"]
                self.dump.stage(kind, f"cached_lowered_{self.opts.target}", lowered)
                self._describe(kind, lowered, example_inputs)
                self.record.graph_done(kind, lowered)
                return precompile.AscendOutputCode(lowered, example_inputs, self.opts, self.target)
            unfused_from = len(self.report.unfused)
            counts: dict[str, int] = {}
            if kind == "inference":
                counts = self.record.rules(gm, self.opts.fusion_enabled, passes.INFERENCE)
                self._name_regions(gm, passes.INFERENCE)
                self.dump.stage(kind, "fused", gm)
            self._compile_regions(gm, kind)
            with self.record.timed("aten_stages"):
                comm_before = comm.simulate(gm)
                for name, stage in aten_stages(self.target):
                    self.report.unfused += stage(gm, self.opts, kind) or []
                    self.dump.stage(kind, name, gm)
                self.record.comm_timelines[kind] = (comm_before, comm.simulate(gm))
                if kind == "backward":
                    self.record.offload_placed(gm)
            with self.record.timed("lowering"):
                self.report.unfused += self.target.lower(gm, self.opts)
                gm.graph.lint()
                gm.recompile()
            self.dump.stage(kind, f"lowered_{self.opts.target}", gm)
            self._store(key, {"gm": gm, "fusions": counts, "unfused": self.report.unfused[unfused_from:],
                              "comm": self.record.comm_timelines[kind],
                              "regions": self.record.regions_json() if kind == "inference" else {}})
            self._describe(kind, gm, example_inputs)
            self.record.graph_done(kind, gm)
            # op by op, or torchair on the NPU; an OutputCode, which precompile can serialize
            return precompile.AscendOutputCode(gm, example_inputs, self.opts, self.target)

        return compile_graph


def ascend(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], *, options: dict | None = None, mode: str | None = None):
    """``torch.compile(model, backend="ascend", options={...})``: compile one Dynamo graph for Ascend."""
    if mode not in (None, "default"):
        raise config.OptionError(
            f"the ascend backend takes no torch.compile mode (got {mode!r}); pass options={{...}} with keys "
            f"{', '.join(config.KEYS)}"
        )
    opts = config.resolve(options)  # first: a wrong option is the error the user reads, raised as itself
    target = lowering.target(opts.target)
    target.prepare()  # the target's ops exist before its stages emit them
    c = _Compilation(gm, opts, target)
    with regions.schema_once_per_region():
        compiled = aot_autograd(
            fw_compiler=c.compiler("forward"),
            bw_compiler=c.compiler("backward"),
            inference_compiler=c.compiler("inference"),
            partition_fn=c.partition,
            decompositions=passes.decompositions(),
            keep_inference_input_mutations=True,
        )(gm, example_inputs)
    compiled = verified(compiled, gm, c.report, c.dump) if opts.verify else compiled
    return _count_users(compiled, gm, example_inputs, c)


def _count_users(compiled: Callable, gm: torch.fx.GraphModule, example_inputs: Sequence[Any], c: _Compilation):
    """``compiled``, counting the distinct modules that run it: with their parameters as graph inputs (Dynamo's
    default in torch 2.13), N identical layers run one compiled graph, each with its own parameters. The first
    parameter input tells them apart; each new one updates report.json ``reused_by`` / ``reused``."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    where = next((i for i, (n, x) in enumerate(zip(placeholders, example_inputs))
                  if isinstance(x, torch.nn.Parameter) or "_parameters_" in n.name), None)
    if where is None:
        return compiled
    seen: set[int] = set()
    boxed = getattr(compiled, "_boxed_call", False)

    def run(*args):
        # boxed: one list of inputs (Dynamo's usual call); Dynamo also calls a graph with sizes unboxed
        flat = args[0] if len(args) == 1 and isinstance(args[0], list) else args
        who = id(flat[where])
        if who not in seen:
            seen.add(who)
            c.report.reused_by, c.report.reused = len(seen), len(seen) > 1
            c.dump.report(c.report.to_json())
            if len(seen) == 2:
                log.info("graph %s reused by a second module", c.report.graph_id)
        return compiled(*args)

    if boxed:
        run._boxed_call = True  # type: ignore[attr-defined]
    run.serialize = getattr(compiled, "serialize", None)  # type: ignore[attr-defined]  # what precompile saves
    return run
