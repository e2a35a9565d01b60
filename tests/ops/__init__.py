"""Tests of npu_compile.ops, one module per op family (mirroring npu_compile/ops/)."""
