"""Graph passes: fusion rules on the joint / inference graphs, and memory analysis.

Passes rewrite aten-level FX graphs and never import lowering (a fused op is matched here, mapped per target
there). The fusion rule registry lives in :mod:`npu_compile.passes.rules`.
"""

from npu_compile.passes.rules import decompositions, rule_names, run_inference_rules, run_joint_rules

__all__ = ["decompositions", "rule_names", "run_inference_rules", "run_joint_rules"]
