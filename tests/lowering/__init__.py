"""Tests of npu_compile.lowering, mirroring its modules (npu.py, npu_sim.py, npu_sim_kernels.py, npu_schemas.py)."""
