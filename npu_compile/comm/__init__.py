"""Collectives in the graph, for every target: the two-stream simulator, the overlap scheduler and bucketing.

    simulate   two-stream timeline (compute_us, comm_us, exposed_comm_us) and its Chrome / Perfetto trace
    schedule   the overlap pass on aten graphs: bucketing, then issue early / wait late under a memory cap

Costs come from the device model (``npu_compile.device``). This room reads FX graphs and rewrites their order and
their collectives; it knows no target (a target that fuses matmuls with collectives declares those ops to the
cost model, ``device.nodes.fused_collective``) and imports nothing from passes/, ops/ or lowering/.
"""

from __future__ import annotations

from npu_compile.comm.schedule import OverlapResult, overlap_stage, schedule_overlap
from npu_compile.comm.simulate import Timeline, chrome_trace, exposed_comm_lower_bound, simulate
from npu_compile.device.nodes import collectives

__all__ = [
    "OverlapResult",
    "Timeline",
    "chrome_trace",
    "collectives",
    "exposed_comm_lower_bound",
    "overlap_stage",
    "schedule_overlap",
    "simulate",
]
