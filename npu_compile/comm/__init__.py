"""Collectives in the graph: the Ascend cost model, the two-stream simulator, the overlap scheduler and bucketing.

    profile    a device as data (default: an Ascend 910B-class NPU in an 8-NPU HCCS server); ``load`` your own
    cost       per-node cost in µs: roofline for compute, the collective's algorithm for comm
    simulate   two-stream timeline (compute_us, comm_us, exposed_comm_us) and its Chrome / Perfetto trace
    schedule   the overlap pass on aten graphs: bucketing, then issue early / wait late under a memory cap
    nodes      what a node is to this room (collective, wait, kind, bytes, group)

This room reads FX graphs and rewrites their order and their collectives; it imports nothing from passes/,
ops/ or lowering/.
"""

from __future__ import annotations

from npu_compile.comm.nodes import collectives
from npu_compile.comm.profile import ASCEND_910B, DeviceProfile, load
from npu_compile.comm.schedule import OverlapResult, overlap_stage, schedule_overlap
from npu_compile.comm.simulate import Timeline, chrome_trace, exposed_comm_lower_bound, simulate

__all__ = [
    "ASCEND_910B",
    "DeviceProfile",
    "OverlapResult",
    "Timeline",
    "chrome_trace",
    "collectives",
    "exposed_comm_lower_bound",
    "load",
    "overlap_stage",
    "schedule_overlap",
    "simulate",
]
