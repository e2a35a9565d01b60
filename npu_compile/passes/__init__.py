"""Graph passes: fusion rules on the joint / inference graphs, and memory analysis.

Passes rewrite aten-level FX graphs and never import lowering (a fused op is matched here, mapped per target
there). Importing this package registers every rule family; rules apply in this import order, so a family
that should claim shared ops first (an add feeding a norm) is imported first.
"""

from npu_compile.passes.engine import (
    GRAPH_RULES,
    INFERENCE,
    RULES,
    TRAINING,
    GraphRule,
    Rule,
    apply_rules,
    decompositions,
    register_graph_rule,
    register_rule,
    rule_names,
    unregister_rule,
)

__all__ = ["GRAPH_RULES", "INFERENCE", "RULES", "TRAINING", "GraphRule", "Rule", "apply_rules", "decompositions", "register_graph_rule", "register_rule", "rule_names", "unregister_rule"]

# Rule families, in the order their rules apply.
from npu_compile.passes import attention, norms, activations, rotary, dropout_add  # noqa: E402,F401
from npu_compile.passes import cross_entropy  # noqa: E402,F401
from npu_compile.passes import varlen_attention  # noqa: E402,F401  (after attention: it takes what attention fused)
from npu_compile.passes import moe  # noqa: E402,F401  (a graph rule: runs after every pattern rule)
from npu_compile.passes import causal_mask  # noqa: E402,F401  (a graph rule: after attention and varlen_attention)

# The rules registered above, each with its place in the registry: their content is fixed by this package's source
# (whose digest every cache key holds), so a key names them by place instead of reading each (thousands of attention
# spellings). Rules are frozen dataclasses: the same object still registered is the same rule.
BUILTIN_RULES: dict[int, tuple[Rule, int]] = {
    id(rule): (rule, place) for place, rule in enumerate(r for rules in RULES.values() for r in rules)}


def builtin_place(rule: Rule) -> int | None:
    """The place of one of this package's own rules in the registry (:data:`BUILTIN_RULES`), else None."""
    known = BUILTIN_RULES.get(id(rule))
    return known[1] if known is not None and known[0] is rule else None
