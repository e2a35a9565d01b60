"""Graph passes: fusion rules on the joint / inference graphs, and memory analysis.

Passes rewrite aten-level FX graphs and never import lowering (a fused op is matched here, mapped per target
there). Importing this package registers every rule family.
"""

from npu_compile.passes.engine import (
    INFERENCE,
    RULES,
    TRAINING,
    Rule,
    apply_rules,
    decompositions,
    register_rule,
    rule_names,
    unregister_rule,
)

__all__ = ["INFERENCE", "RULES", "TRAINING", "Rule", "apply_rules", "decompositions", "register_rule", "rule_names", "unregister_rule"]
