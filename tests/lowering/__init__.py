"""Tests of npu_compile.lowering, mirroring its packages (npu/: emit, attention, norms, …, mc2, graph_modes, schemas; npu_sim/)."""
