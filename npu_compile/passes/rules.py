"""The fusion rule registry: named rules, each switchable through ``options["fusions"]``, each counted.

Rules run on the aot_autograd joint graph (training: the fused op's backward replaces autograd's) and on
inference graphs. Both are traced without decompositions, so a rule's pattern sees the same aten ops the model's
graph holds.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from npu_compile.config import Options


@dataclasses.dataclass(frozen=True)
class Rule:
    name: str
    # Rewrites every site in the graph, returns how many sites it took.
    apply_joint: Callable[[torch.fx.GraphModule], int]
    apply_inference: Callable[[torch.fx.GraphModule], int]


RULES: dict[str, Rule] = {}


def rule_names() -> tuple[str, ...]:
    return tuple(RULES)


def decompositions() -> dict:
    """The decomposition table of our aot_autograd call, shared with pattern tracing (they must agree)."""
    return {}


def _run(gm: torch.fx.GraphModule, opts: Options, joint: bool) -> dict[str, int]:
    counts = {}
    for rule in RULES.values():
        if opts.fusion_enabled(rule.name):
            counts[rule.name] = (rule.apply_joint if joint else rule.apply_inference)(gm)
    if any(counts.values()):
        gm.graph.eliminate_dead_code()
        gm.recompile()
    return counts


def run_joint_rules(gm: torch.fx.GraphModule, opts: Options) -> dict[str, int]:
    """Apply the enabled rules to a joint forward+backward graph; matched sites per rule."""
    return _run(gm, opts, joint=True)


def run_inference_rules(gm: torch.fx.GraphModule, opts: Options) -> dict[str, int]:
    """Apply the enabled rules to an inference graph; matched sites per rule."""
    return _run(gm, opts, joint=False)
