"""Fusion rules: attention family (see npu_compile.passes.engine for the rule API)."""
