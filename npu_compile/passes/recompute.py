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
import dataclasses
import operator
from collections.abc import Iterator
from unittest import mock

import torch
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


def _packets(names: tuple[str, ...]) -> OrderedSet:
    import npu_compile.ops  # noqa: F401  (defines the ops)

    return OrderedSet(getattr(_ops, name) for name in names)


class CostModelRuntime(CustomRuntimeEstimator):
    """The partitioner's runtime estimate of a node: its time in µs on the device profile (never 0, so that the
    knapsack still prefers fewer recomputed nodes among free ones)."""

    def __init__(self, profile: DeviceProfile | None = None):
        self.profile = load(profile)
        self._us: dict[torch.fx.Node, float] = {}  # the partitioner and SavingKnapsack both ask, per node

    def __call__(self, node: torch.fx.Node) -> float:
        if node not in self._us:
            self._us[node] = max(cost.node_us(node, self.profile), 1e-3)
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


def _op_types() -> partitioners.OpTypes:
    base = partitioners.get_default_op_list()
    cheap = _packets(CHEAP_FUSED)
    return dataclasses.replace(
        base,
        fusible_ops=base.fusible_ops | cheap,
        recomputable_ops=base.recomputable_ops | cheap,
        compute_intensive_ops=base.compute_intensive_ops | _packets(SAVED_FUSED),
    )


@contextlib.contextmanager
def policy(joint: torch.fx.GraphModule, memory_budget: float, profile: DeviceProfile | None = None) -> Iterator[None]:
    """Within this context, ``min_cut_rematerialization_partition(joint, ...)`` partitions under
    ``memory_budget`` with the cost model and the fused-op policy above."""
    mark_saved(joint.graph)
    op_types = _op_types()
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
    return RecomputeCost(len(again), sum(cost.flops(n) for n in again),
                         round(sum(cost.node_us(n, profile) for n in again), 3), ops)


def matrix_flops(graph: torch.fx.Graph) -> int:
    """Matrix FLOPs of a graph on the cost model's count (matmuls, attention)."""
    return sum(cost.flops(n) for n in graph.nodes if n.op == "call_function")
