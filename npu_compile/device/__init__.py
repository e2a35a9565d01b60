"""The device as the compiler models it: rates and links as data, and what each node costs on them.

    profile  a device as data (default: an Ascend 910B-class NPU in an 8-NPU HCCS server); ``load`` your own
    cost     per-node cost in µs: roofline for compute, the collective's algorithm for comm, MC2 pipelining
    nodes    what a node is to the cost model (collective, wait, kind, bytes, group, a fused collective)

The ground floor: passes (recompute), comm (scheduling, simulation) and the targets' stages (MC2) cost with it;
it imports nothing of the package but the attention layout table (``ops/layout.py``).
"""

from __future__ import annotations

from npu_compile.device.profile import ASCEND_910B, DeviceProfile, load

__all__ = ["ASCEND_910B", "DeviceProfile", "load"]
