"""Recompute policy for the min-cut partitioner: what the backward may recompute, and what it costs.

``memory_budget`` is torch's ``activation_memory_budget`` (1.0: the runtime-optimal cut; below it, a knapsack
chooses the cheapest recompute that brings the saved activations down to that share). This module tells the
partitioner three things it cannot know about the fused ops:

- **cost**: the knapsack weighs recompute with :class:`CostModelRuntime`, the Ascend cost model of
  :mod:`npu_compile.device.cost` (roofline: matmul FLOPs over the cube rate, elementwise bytes over HBM
  bandwidth), instead of torch's FLOP counter, which calls every elementwise op free and cannot run our ops;
- **cheap fused ops may be recomputed**: norms, bias-GeLU, SwiGLU, RoPE and bias-dropout-add (a dropout seed is
  an input of the op and is itself saved: a recompute draws the same mask). They are one pass over their
  operands; MindSpeed offers the same trade by hand (``--recompute-norm``, ``--recompute-activation-function``);
- **attention is never recomputed**: its outputs (out, softmax max and sum) are MUST_SAVE, it counts as
  compute-intensive in the min-cut's bans, and the knapsack (:class:`SavingKnapsack`) saves it before it weighs
  anything else; recomputing it would cost a second forward of the layer's most expensive op to drop tensors
  that are [b, s, h] and [b, n, s] at most.

torch 2.13's partitioner takes its recomputable-op list from ``partitioners.get_default_op_list`` (its
``recomputable_ops`` argument is documented but unused), so the list is extended for the duration of one
partition call only, with the budget and estimator set through ``torch._functorch.config.patch``.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import operator
from collections.abc import Iterator
from unittest import mock

import torch
from torch._dynamo.exc import ShortenTraceback
from torch._functorch import config as functorch_config
from torch._functorch import partitioners
from torch._functorch._activation_checkpointing.knapsack import dp_knapsack
from torch._inductor.custom_graph_pass import CustomKnapsackSolver, CustomRuntimeEstimator
from torch.utils._ordered_set import OrderedSet
from torch.utils.checkpoint import CheckpointPolicy

from npu_compile.device import cost
from npu_compile.device.profile import DeviceProfile, load

_ops = torch.ops.npu_compile
# Fused ops the backward may recompute from their inputs: one memory-bound pass each.
CHEAP_FUSED = ("rms_norm", "add_rms_norm", "add_layer_norm", "bias_gelu", "swiglu", "rotary", "bias_dropout_add")
# Fused ops whose outputs are always saved.
SAVED_FUSED = ("fused_attention",)
# Matmuls as mm is: compute-intensive, not recomputed under a budget unless the min-cut finds it pays
MATMUL_FUSED = ("grouped_matmul", "grouped_matmul_weight_grad")
# Option ``recompute``: op kinds whose outputs the backward always recomputes (MUST_RECOMPUTE), at any budget.
ALWAYS_RECOMPUTED = {"activation": ("bias_gelu", "swiglu")}


def _packets(names: tuple[str, ...]) -> OrderedSet:
    import npu_compile.ops  # noqa: F401  (defines the ops)

    return OrderedSet(getattr(_ops, name) for name in names)


class CostModelRuntime(CustomRuntimeEstimator):
    """The partitioner's runtime estimate of a node: its time in µs on the device profile (never 0, so that the
    knapsack still prefers fewer recomputed nodes among free ones)."""

    def __init__(self, profile: DeviceProfile | None = None):
        self.profile = load(profile)
        self._us: dict[torch.fx.Node, float] = {}  # the partitioner and SavingKnapsack both ask, per node
        self._regions: dict[int, float] = {}  # a region's time, the same at each of its calls

    def __call__(self, node: torch.fx.Node) -> float:
        if node not in self._us:
            self._us[node] = max(cost.node_us(node, self.profile, self._regions), 1e-3)
        return self._us[node]

    def uuid(self) -> str:
        return f"npu_compile.CostModelRuntime:{self.profile.name}"


class SavingKnapsack(CustomKnapsackSolver):
    """torch's DP knapsack over the nodes the budget may recompute, with attention kept out of it: those nodes
    are saved first, from the budget, and the rest is chosen by their time on the cost model. (Marking the
    attention tuple MUST_SAVE instead would make the partitioner save the tuple itself below budget 1.0.)"""

    def __init__(self, runtime: CostModelRuntime):
        self.runtime = runtime
        self.saved_ops = _packets(SAVED_FUSED)

    def __call__(self, memory, joint_graph, max_memory, node_info, nodes):
        forced = [i for i, n in enumerate(nodes) if getattr(n.target, "overloadpacket", None) in self.saved_ops]
        free = [i for i in range(len(nodes)) if i not in forced]
        budget = max(max_memory - sum(memory[i] for i in forced), 0.0)
        _, saved, recomputed = dp_knapsack([memory[i] for i in free], [self.runtime(nodes[i]) for i in free], budget)
        return forced + [free[i] for i in saved], [free[i] for i in recomputed]

    def uuid(self) -> str:
        return f"npu_compile.SavingKnapsack:{self.runtime.uuid()}"


def mark_saved(graph: torch.fx.Graph) -> int:
    """MUST_SAVE on the outputs of the ops that are never recomputed (attention); returns how many ops."""
    saved = _packets(SAVED_FUSED)
    marked = 0
    for node in graph.nodes:
        if node.op == "call_function" and getattr(node.target, "overloadpacket", None) in saved:
            # Its items, not the tuple node: below budget 1.0 the knapsack returns MUST_SAVE nodes as saved
            # values as they are, and a saved tuple breaks autograd's saved-tensor check. (The tuple node itself
            # is kept from recompute by counting as compute-intensive, see _op_types.)
            for user in node.users:
                if user.target is operator.getitem:
                    user.meta["recompute"] = CheckpointPolicy.MUST_SAVE
            marked += 1
    return marked


def mark_recomputed(graph: torch.fx.Graph, kinds: tuple[str, ...]) -> int:
    """MUST_RECOMPUTE on the outputs of the ops of ``kinds`` (option ``recompute``): the forward does not save them
    and the backward computes them again from their inputs; returns how many ops."""
    ops = _packets(tuple(name for kind in kinds for name in ALWAYS_RECOMPUTED[kind]))
    marked = 0
    for node in graph.nodes:
        if node.op == "call_function" and getattr(node.target, "overloadpacket", None) in ops:
            node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
            marked += 1
    return marked


def _op_types(saved: tuple[str, ...] = ()) -> partitioners.OpTypes:
    """torch's op lists with the fused ops added; the ops of the kinds in ``saved`` are left out of the
    recomputable ones, which torch's min-cut then never recomputes at budget 1.0 (its knapsack below 1.0 may)."""
    base = partitioners.get_default_op_list()
    cheap = _packets(CHEAP_FUSED)
    kept = _packets(tuple(name for kind in saved for name in ALWAYS_RECOMPUTED[kind]))
    return dataclasses.replace(
        base,
        fusible_ops=base.fusible_ops | cheap,
        recomputable_ops=(base.recomputable_ops | cheap) - kept,
        compute_intensive_ops=base.compute_intensive_ops | _packets(SAVED_FUSED) | _packets(MATMUL_FUSED),
    )


@contextlib.contextmanager
def policy(joint: torch.fx.GraphModule, memory_budget: float, profile: DeviceProfile | None = None,
           always: tuple[str, ...] = (), saved: tuple[str, ...] = ()) -> Iterator[None]:
    """Within this context, ``min_cut_rematerialization_partition(joint, ...)`` partitions under
    ``memory_budget`` with the cost model and the fused-op policy above; the ops of the kinds in ``always``
    (option ``recompute``) are recomputed whatever the budget, those of the kinds in ``saved`` (the target's
    ``saved_at_full_budget``) are not recomputed at budget 1.0 unless ``always`` names them too."""
    mark_saved(joint.graph)
    mark_recomputed(joint.graph, always)
    op_types = _op_types(tuple(kind for kind in saved if kind not in always))
    # At exactly 0 torch's min-cut saves the graph inputs only, ignoring MUST_SAVE (random values, attention),
    # so a dropout seed would be redrawn in the backward; the smallest positive budget saves just those.
    budget = max(memory_budget, 1e-6)
    runtime = CostModelRuntime(profile)
    with functorch_config.patch(activation_memory_budget=budget,
                                activation_memory_budget_runtime_estimator=runtime,
                                activation_memory_budget_solver=SavingKnapsack(runtime),
                                ban_recompute_materialized_backward=False), \
            mock.patch.object(partitioners, "get_default_op_list", lambda: op_types):
        yield


@dataclasses.dataclass(frozen=True)
class RecomputeCost:
    """What the backward graph computes again of the forward: nodes, matrix FLOPs, estimated µs."""

    nodes: int
    flops: int
    us: float
    ops: dict[str, int]  # op -> recomputed nodes


def recompute_cost(fw: torch.fx.Graph, bw: torch.fx.Graph, profile: DeviceProfile | None = None) -> RecomputeCost:
    """The forward work the backward repeats. Both graphs come out of one joint graph with its node names, so a
    compute node present in both is one the partitioner chose to recompute."""
    profile = load(profile)
    forward = {n.name for n in fw.nodes if n.op == "call_function"}
    again = [n for n in bw.nodes if n.op == "call_function" and n.name in forward and not cost.is_free(n)]
    ops: dict[str, int] = {}
    for n in again:
        key = str(getattr(n.target, "overloadpacket", n.target))
        ops[key] = ops.get(key, 0) + 1
    region_flops: dict[int, int] = {}
    region_us: dict[int, float] = {}
    return RecomputeCost(len(again), sum(cost.flops(n, region_flops) for n in again),
                         round(sum(cost.node_us(n, profile, region_us) for n in again), 3), ops)


def matrix_flops(graph: torch.fx.Graph) -> int:
    """Matrix FLOPs of a graph on the cost model's count (matmuls, attention); a region's once, not once per
    call."""
    per_region: dict[int, int] = {}
    return sum(cost.flops(n, per_region) for n in graph.nodes if n.op == "call_function")


# -- memory_budget="auto": the least recompute whose planned peak fits the device --------------------------------

# Budgets tried, most memory first.
LADDER = (1.0, 0.8, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1, 0.05, 0.0)
GiB = 2**30


class MemoryFitError(ShortenTraceback, RuntimeError):
    """``memory_budget="auto"``: no budget brings a graph's planned peak under ``device_memory``. Raised while the
    graph compiles, at its first call, before any step has run; as itself (Dynamo passes a ShortenTraceback on)."""

    def __init__(self, message: str, plans: list["Plan"] = ()):
        super().__init__(message, first_useful_frame=None)
        self.plans = list(plans)  # every budget tried, in LADDER order


@dataclasses.dataclass(frozen=True)
class Plan:
    """The planned step peak of one partition: ``resident + (copies − 1) × saved + live``, where ``live`` is the
    live-bytes peak of the graph's fw+bw schedule (one copy of its saved activations among them) and the other
    copies are forwards of the same graph (layers sharing it, micro-batches in flight) holding their own."""

    budget: float
    resident: int
    copies: int
    saved: int
    live: int

    @property
    def peak(self) -> int:
        return self.resident + (self.copies - 1) * self.saved + self.live

    def to_json(self) -> dict:
        return {"budget": self.budget, "planned_peak_bytes": self.peak, "saved_activation_bytes": self.saved,
                "live_bytes": self.live}


def plan(fw: torch.fx.Graph, bw: torch.fx.Graph, budget: float, resident: int, copies: int) -> Plan:
    """The planned peak of a partition (the graphs' live-bytes peak over their fw+bw schedule, passes/memory)."""
    from npu_compile.passes.memory import liveness, training_memory

    t = training_memory(fw, bw)
    return Plan(budget, resident, copies, t.saved_bytes, liveness(t.buffers, t.steps).peak)


def partition_to_fit(joint: torch.fx.GraphModule, joint_inputs, partition, *, device_memory: int, resident: int,
                     copies: int, graph_id: str, always: tuple[str, ...] = (), saved: tuple[str, ...] = (),
                     **kwargs):
    """``partition`` (the min-cut) of ``joint`` under the largest budget of :data:`LADDER` whose planned peak fits
    ``device_memory``: the budgets are tried from 1.0 down, each on a copy of the joint graph, and the first that
    fits is taken. (The peak is not monotone in the budget: at the lowest budgets the backward recomputes so
    much at once that its own peak can exceed what saving would have cost.) Returns (fw, bw, the chosen Plan,
    every Plan tried). Raises :class:`MemoryFitError` with the figures when no budget fits."""
    tried: list[Plan] = []
    for budget in LADDER:
        trial = torch.fx.GraphModule(joint, copy.deepcopy(joint.graph))
        with policy(trial, budget, always=always, saved=saved):
            fw, bw = partition(trial, joint_inputs, **kwargs)
        tried.append(plan(fw.graph, bw.graph, budget, resident, copies))
        if tried[-1].peak <= device_memory:
            return fw, bw, tried[-1], tried
    raise MemoryFitError(_no_fit(min(tried, key=lambda p: p.peak), tried[0], device_memory, graph_id), tried)


def _no_fit(least: Plan, most: Plan, device_memory: int, graph_id: str) -> str:
    def gib(n: float) -> str:
        return f"{n / GiB:.2f} GiB" if abs(n) >= GiB else f"{n / 2**20:.1f} MiB"

    activations = least.peak - least.resident
    room = device_memory - least.resident
    lines = [
        f"npu_compile: graph {graph_id} does not fit device_memory {gib(device_memory)} under memory_budget "
        f'"auto": with the least activation memory (budget {least.budget}) a step needs '
        f"{gib(least.peak)} = resident_memory {gib(least.resident)} + the graph's live bytes {gib(least.live)} + "
        f"{least.copies - 1} other copies (activation_copies) × saved activations {gib(least.saved)}; "
        f"{gib(least.peak - device_memory)} more than the device has (at budget 1.0: {gib(most.peak)}).",
        "What would fit:",
        f"  - device_memory ≥ {gib(least.peak)};",
    ]
    if room > 0:
        lines.append(f"  - activation memory of at most {gib(room)} instead of {gib(activations)}: a micro-batch of "
                     f"at most {room / activations:.0%} of this one (activation memory grows with it), or fewer "
                     f"forwards holding theirs at once (activation_copies {least.copies});")
    else:
        lines.append(f"  - resident_memory alone ({gib(least.resident)}) fills the device: no activations fit;")
    if least.resident:
        lines.append(f"  - less resident_memory than {gib(least.resident)}: a distributed optimizer (its state "
                     "sharded over data-parallel ranks), more tensor or pipeline parallelism.")
    return "\n".join(lines)
