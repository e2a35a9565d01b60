"""Fusion rules: dropout_add family (see npu_compile.passes.engine for the rule API)."""
