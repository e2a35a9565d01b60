"""Cost model: the formulas against figures computed by hand, and the device profile as data."""

import json

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import npu_compile.ops  # noqa: F401  (registers npu_compile.fused_attention)
from npu_compile.device import cost, profile
from npu_compile.device.profile import ASCEND_910B

c10d = torch.ops._c10d_functional
MiB = 2**20


def trace(fn, *args):
    return make_fx(fn, tracing_mode="fake")(*args)


def node(gm, name):
    return next(n for n in gm.graph.nodes if n.name == name)


def test_matmul_is_flops_over_cube_rate_when_compute_bound():
    # [4096, 4096] @ [4096, 1536] in bf16: the QKV projection of a TP=8 layer with hidden 4096, seq 4096.
    a = torch.empty(4096, 4096, dtype=torch.bfloat16)
    w = torch.empty(4096, 1536, dtype=torch.bfloat16)
    gm = trace(torch.mm, a, w)
    mm = node(gm, "mm")
    flops = 2 * 4096 * 4096 * 1536  # 51.54 GFLOP
    assert cost.flops(mm) == flops
    assert cost.bytes_moved(mm) == (4096 * 4096 + 2 * 4096 * 1536) * 2
    assert cost.node_us(mm) == pytest.approx(flops / 320e12 * 1e6)  # 161.06 µs > 36.7 µs of HBM traffic


def test_bmm_addmm_baddbmm_flops():
    x, w, b = torch.empty(8, 16), torch.empty(16, 32), torch.empty(32)
    gm = trace(lambda x, w, b: torch.addmm(b, x, w), x, w, b)
    assert cost.flops(node(gm, "addmm")) == 2 * 8 * 16 * 32
    p, q, r = torch.empty(4, 8, 16), torch.empty(4, 16, 32), torch.empty(4, 8, 32)
    gm = trace(lambda p, q, r: (torch.bmm(p, q), torch.baddbmm(r, p, q)), p, q, r)
    assert cost.flops(node(gm, "bmm")) == 2 * 4 * 8 * 16 * 32
    assert cost.flops(node(gm, "baddbmm")) == 2 * 4 * 8 * 16 * 32


def test_small_matmul_is_memory_bound():
    gm = trace(torch.mm, torch.empty(4, 4096), torch.empty(4096, 4))
    mm = node(gm, "mm")
    assert cost.node_us(mm) == pytest.approx(cost.bytes_moved(mm) / 1.6e12 * 1e6)


def test_elementwise_is_bytes_over_hbm_and_views_are_free():
    gm = trace(lambda a, b: (a + b).view(-1), torch.empty(1024, 1024), torch.empty(1024, 1024))
    add = node(gm, "add")
    # reads two fp32 MiB-elements tensors, writes one: 12 MiB over 1.6 TB/s = 7.86 µs (the vector unit: 0.1 µs)
    assert cost.node_us(add) == pytest.approx(3 * 4 * MiB / 1.6e12 * 1e6)
    assert cost.node_us(node(gm, "view")) == 0.0


def test_fused_attention_flops_from_layout_and_causal():
    q = torch.empty(4096, 1, 4, 128, dtype=torch.bfloat16)  # sbnd: s=4096, b=1, n=4, d=128

    def attention(q, k, v):
        return torch.ops.npu_compile.fused_attention(q, k, v, layout="sbnd", causal=True)

    gm = trace(attention, q, q, q)
    fwd = node(gm, "fused_attention")
    full = 2 * 1 * 4 * 4096 * 4096 * (128 + 128)  # QKᵀ and PV
    assert cost.flops(fwd) == full // 2  # causal: half the score tiles


def test_fused_attention_backward_flops():
    q = torch.empty(2, 3, 64, 16)  # bnsd
    stats = torch.empty(2, 3, 64)

    def backward(dout, q, k, v, out, m, s):
        return torch.ops.npu_compile.fused_attention_backward(dout, q, k, v, out, m, s)

    gm = trace(backward, q, q, q, q, q, stats, stats)
    bwd = node(gm, "fused_attention_backward")
    assert cost.flops(bwd) == 2 * 2 * 3 * 64 * 64 * (3 * 16 + 2 * 16)  # recompute QKᵀ; dV, dP, dQ, dK


def test_collective_formulas():
    S, n, B, a = 32 * MiB, 8, 56e9, 2.0
    mesh = ASCEND_910B
    ring = profile.load({"algorithms": {k: "ring" for k in profile.COLLECTIVE_KINDS}})
    # full mesh: one step, S/n to each of the n-1 peers over its own link
    assert cost.collective_us("all_gather", S, n, mesh) == pytest.approx(a + (n - 1) / n * S / ((n - 1) * B) * 1e6)
    assert cost.collective_us("all_gather", S, n, mesh) == pytest.approx(76.898, abs=1e-3)
    assert cost.collective_us("reduce_scatter", S, n, mesh) == cost.collective_us("all_gather", S, n, mesh)
    assert cost.collective_us("all_reduce", S, n, mesh) == pytest.approx(2 * 76.898, abs=1e-3)
    # ring: n-1 steps of S/n over one link
    assert cost.collective_us("all_gather", S, n, ring) == pytest.approx((n - 1) * a + (n - 1) / n * S / B * 1e6)
    assert cost.collective_us("all_gather", S, n, ring) == pytest.approx(538.288, abs=1e-3)
    assert cost.collective_us("all_reduce", S, n, ring) == pytest.approx(2 * 538.288, abs=1e-3)
    assert cost.collective_us("all_reduce", S, 1, ring) == 0.0


def test_collective_nodes_take_size_and_group_from_the_graph():
    x = torch.empty(512, 4096, dtype=torch.bfloat16)  # 4 MiB shard; gathered over 8 ranks: 32 MiB

    def f(x):
        ag = c10d.wait_tensor(c10d.all_gather_into_tensor(x, 8, "tp"))
        rs = c10d.wait_tensor(c10d.reduce_scatter_tensor(ag, "sum", 8, "tp"))
        ar = c10d.wait_tensor(c10d.all_reduce(x, "sum", "tp"))  # no group size in the op: the profile's 8
        return ag, rs, ar

    gm = trace(f, x)
    for name in ("all_gather_into_tensor", "reduce_scatter_tensor"):
        assert cost.node_us(node(gm, name)) == pytest.approx(76.898, abs=1e-3)
    assert cost.node_us(node(gm, "all_reduce")) == pytest.approx(2 * (2.0 + 4 * MiB / 8 / 56e9 * 1e6))
    assert cost.node_us(node(gm, "wait_tensor")) == 0.0


def test_profile_load_merges_tables_and_rejects_unknown_keys(tmp_path):
    mine = profile.load({"link_bytes_per_s": 100e9, "algorithms": {"all_reduce": "ring"}})
    assert mine.link_bytes_per_s == 100e9
    assert mine.algorithm("all_reduce") == "ring" and mine.algorithm("all_gather") == "full_mesh"
    assert mine.matrix_rate(torch.bfloat16) == ASCEND_910B.matrix_rate(torch.bfloat16)
    path = tmp_path / "npu.json"
    path.write_text(json.dumps({"name": "slow", "hbm_bytes_per_s": 1e12}))
    assert profile.load(path).hbm_bytes_per_s == 1e12
    assert profile.load(None) is ASCEND_910B
    with pytest.raises(ValueError, match="hbm_bytes_per_s"):
        profile.load({"hbm_bandwidth": 1})
    with pytest.raises(ValueError, match="ring"):
        profile.load({"algorithms": {"all_reduce": "tree"}})
