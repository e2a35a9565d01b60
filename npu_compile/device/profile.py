"""The device a cost is measured against, as data: compute rates, memory and link bandwidth, collective algorithms.

:data:`ASCEND_910B` is the default, an Ascend 910B-class NPU in an 8-NPU HCCS full-mesh server (Atlas 800T A2
class). Every figure below is an *estimate* from public material, cited beside it; none was measured here.
Give your own with :func:`load` (a dict, or a path to a JSON file holding one); keys left out keep the default.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from typing import Any

import torch

ALGORITHMS = ("ring", "full_mesh")
COLLECTIVE_KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")


@dataclasses.dataclass(frozen=True)
class DeviceProfile:
    """Rates of one device and of the links between devices. Units: FLOP/s, bytes/s, microseconds."""

    name: str
    matrix_flops: Mapping[str, float]  # cube unit, per dtype name ("bfloat16"): matmul-class ops
    vector_flops: Mapping[str, float]  # vector unit, per dtype name: everything elementwise
    hbm_bytes_per_s: float  # device memory bandwidth
    link_bytes_per_s: float  # one HCCS link, one direction
    link_latency_us: float  # per step of a collective algorithm (launch + hop + handshake)
    algorithms: Mapping[str, str]  # collective kind -> "ring" | "full_mesh"
    ranks_per_node: int = 8  # group size assumed when a collective's group cannot be resolved
    # Chunks an MC2 op (matmul fused with a collective) pipelines its work in; 0: one chunk per rank of its group.
    # Per-rank chunks are how the op's data divides by itself: an all-gather brings one shard per rank, a
    # reduce-scatter sends one row block per rank, so each block's matmul can start (or its send can start) once
    # that block is there. torch_npu exposes no tile count (``comm_turn`` takes only 0 in 2.13), so this is an
    # estimate of its granularity, not a documented figure; see ``cost.mc2_cost``.
    mc2_chunks: int = 0
    # The host link, bytes/s one direction: what a saved activation offloaded to host memory (option ``offload``)
    # costs each way.
    host_link_bytes_per_s: float = 32e9
    # Device memory, bytes: the default cap of ``memory_budget="auto"`` (option ``device_memory``).
    memory_bytes: int = 64 * 2**30

    def matrix_rate(self, dtype: torch.dtype) -> float:
        return _rate(self.matrix_flops, dtype)

    def vector_rate(self, dtype: torch.dtype) -> float:
        return _rate(self.vector_flops, dtype)

    def algorithm(self, kind: str) -> str:
        return self.algorithms.get(kind, "ring")


def _rate(table: Mapping[str, float], dtype: torch.dtype) -> float:
    name = str(dtype).removeprefix("torch.")
    if name in table:
        return table[name]
    # Integer and exotic dtypes: the slowest listed rate, so an unknown dtype never looks cheap.
    return min(table.values())


ASCEND_910B = DeviceProfile(
    name="ascend-910b",
    # Cube unit. ~320 TFLOPS FP16 for the 910B ("Huawei Ascend 910B Outperforms H20", boardor.com, which also
    # gives 310 W); ai.gitee.com's Ascend 910B page lists 280 TFLOPS FP16 for its SKU; the first Ascend 910
    # (Hot Chips 31, 2019) was 256 TFLOPS FP16 / 512 TOPS INT8. BF16 runs at the FP16 rate. FP32 on the cube
    # at a quarter of FP16 follows the 400 / 100 TFLOPS BF16 / FP32 split quoted for the 910C
    # (emergentmind.com, "Huawei Ascend 910C NPUs"). All peak figures, not sustained.
    matrix_flops={"float16": 320e12, "bfloat16": 320e12, "float32": 80e12, "int8": 640e12},
    # Vector unit: 2048-bit SIMD per Da Vinci core (Hot Chips 31 slides, via vengineer.hatenablog.com
    # 2019-09-06), i.e. 128 FP16 lanes; assuming ~48 vector cores at ~1.8 GHz with FMA:
    # 48 × 128 × 2 × 1.8e9 ≈ 22 TFLOPS FP16, half that for FP32. An estimate; elementwise ops are bounded by
    # HBM long before this.
    vector_flops={"float16": 22e12, "bfloat16": 22e12, "float32": 11e12},
    # 64 GB HBM2e (ai.gitee.com, Ascend 910B page; memory_bytes): four HBM2e stacks at 3.2 Gb/s per pin give 1.64 TB/s
    # (JEDEC JESD235C figures, as reported by EEPW, 2020-08-15). Other pages quote 1.2 TB/s for 32 GB parts.
    hbm_bytes_per_s=1.6e12,
    # HCCS: eight NPUs fully connected in one server (ai.gitee.com, Ascend 910B page), i.e. 7 links per NPU.
    # 56 GB/s per link (392 GB/s per NPU) is the figure commonly quoted for Atlas 800T A2; we found no primary
    # source for it. It agrees in scale with the ~400 GB/s chip-to-chip figure given for the 910C
    # (techpowerup.com, 2025-04-21). The first 910 had 3 × 240 Gb/s HCCS ports.
    link_bytes_per_s=56e9,
    # Per algorithm step: HCCL launch plus link hop, a few microseconds; 2.1 µs is the end-to-end latency
    # Huawei quotes for its newer optical interconnect (Atlas 950, notebookcheck.net, 2025). An estimate.
    link_latency_us=2.0,
    # HCCL picks Mesh inside a full-mesh server (hiascend.com, HCCL user guide, "Algorithm Overview" and
    # "Mesh": every NPU reads/writes all peers at once over its HCCS links, O(1) steps).
    algorithms={kind: "full_mesh" for kind in COLLECTIVE_KINDS},
    ranks_per_node=8,
    # Host link: PCIe 4.0 x16 (16 GT/s x 16 lanes, 128b/130b: 31.5 GB/s each way), the host interface given for
    # the first Ascend 910 (Hot Chips 31, 2019); we found no primary figure for the 910B's and assume the same.
    # Pinned-memory copies reach most of it; an estimate, not measured here.
    host_link_bytes_per_s=31.5e9,
)

DEFAULT = ASCEND_910B


def load(source: str | os.PathLike | Mapping[str, Any] | DeviceProfile | None = None) -> DeviceProfile:
    """A profile from a dict, a JSON file holding one, or None (the default); missing keys keep the default.

    Nested tables (``matrix_flops``, ``vector_flops``, ``algorithms``) are merged key by key, so
    ``{"algorithms": {"all_reduce": "ring"}}`` changes one collective only.
    """
    if source is None:
        return DEFAULT
    if isinstance(source, DeviceProfile):
        return source
    if isinstance(source, (str, os.PathLike)):
        with open(source) as f:
            source = json.load(f)
    fields = {f.name for f in dataclasses.fields(DeviceProfile)}
    unknown = sorted(set(source) - fields)
    if unknown:
        raise ValueError(
            f"unknown device profile key(s) {', '.join(map(repr, unknown))}; valid keys are {', '.join(sorted(fields))}"
        )
    values = dict(source)
    for table in ("matrix_flops", "vector_flops", "algorithms"):
        if table in values:
            values[table] = {**getattr(DEFAULT, table), **values[table]}
    bad = {k: v for k, v in values.get("algorithms", {}).items() if v not in ALGORITHMS}
    if bad:
        raise ValueError(f"device profile algorithms {bad} not understood; each takes one of {', '.join(ALGORITHMS)}")
    return dataclasses.replace(DEFAULT, **values)
