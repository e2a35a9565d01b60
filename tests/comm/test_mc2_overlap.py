"""MC2 ops in the comm room: their cost (an estimate with hand-computed figures), the simulator's accounting of
them, the lower bound's treatment of them, and the npu targets' MC2 stage rewriting sites before the overlap
stage buckets."""

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch.fx.experimental.proxy_tensor import make_fx

from comm_graphs import random_program
from npu_compile import config
from npu_compile import lowering
from npu_compile.comm import exposed_comm_lower_bound, overlap_stage, schedule, schedule_overlap, simulate
from npu_compile.device import cost, nodes, profile
from npu_compile.device.cost import MC2Cost
from npu_compile.device.profile import ASCEND_910B
from npu_compile.lowering import npu_sim
from npu_compile.lowering.npu.mc2 import declare_all, fused_sites, rewrite_mc2
from megatron_glue.capture.testing import fake_process_group

c10d = torch.ops._c10d_functional
bf16 = torch.bfloat16
MiB = 2**20
ALPHA, LINK, CUBE, HBM = 2.0, 56e9, 320e12, 1.6e12  # the default profile's figures


@pytest.fixture(autouse=True, scope="module")
def npu_ops():
    npu_sim.register()


def trace(fn, *args):
    """make_fx of ``fn``, its MC2 ops declared to the cost model as the MC2 stage declares those it emits."""
    gm = make_fx(fn, tracing_mode="fake")(*args)
    declare_all(gm)
    return gm


def stages(gm, target="npu-sim", kind="forward"):
    """What the backend runs on ``gm`` between memory ordering and lowering: the target's stages, then overlap;
    the stages' report.json ``unfused`` entries."""
    opts = config.Options(target=target, overlap=True)
    unfused = [e for _, stage in lowering.target(target).stages for e in stage(gm, opts, kind) or []]
    overlap_stage(gm, opts, kind)
    return unfused


def empty(*shape):
    return torch.empty(*shape, dtype=bf16)


def mc2_node(gm):
    (node,) = [n for n in gm.graph.nodes if nodes.fused_collective(n) is not None]
    return node


def ag_mm(x, w):
    return torch.ops.npu.npu_all_gather_base_mm(x, w, "tp", 8)[0]


def mm_rs(x, w):
    return torch.ops.npu.npu_mm_reduce_scatter_base(x, w, "tp", 8)


# ---- cost ---------------------------------------------------------------------------------------------------

def test_all_gather_mm_compute_bound():
    # shard [512, 4096] gathered over 8 ranks: x1 [4096, 4096] @ [4096, 1024]
    node = mc2_node(trace(ag_mm, empty(512, 4096), empty(4096, 1024)))
    part = cost.mc2_cost(node)
    matmul = 2 * 4096 * 4096 * 1024 / CUBE * 1e6  # 107.374 µs; HBM: (4096² + 2·4096·1024)·2 B = 31.5 µs
    gathered = 4096 * 4096 * 2  # 32 MiB
    comm = ALPHA + gathered / (8 * LINK) * 1e6  # full mesh: 76.898 µs
    c1 = ALPHA + gathered / 8 / (8 * LINK) * 1e6  # one rank's chunk: 11.362 µs
    m1 = matmul / 8  # 13.422 µs
    assert (part.kind, part.ranks, part.chunks) == ("all_gather", 8, 8)
    assert part.matmul_us == pytest.approx(matmul) and part.matmul_us == pytest.approx(107.374, abs=1e-3)
    assert part.comm_us == pytest.approx(comm) and part.comm_us == pytest.approx(76.898, abs=1e-3)
    assert part.fused_us == pytest.approx(c1 + m1 + 7 * m1)
    assert part.fused_us == pytest.approx(118.736, abs=1e-3)  # only the first chunk's gather shows
    assert part.fused_us - part.matmul_us == pytest.approx(11.362, abs=1e-3)
    assert part.chunk_comm_us == pytest.approx(c1) and not part.comm_bound
    assert cost.node_us(node) == part.fused_us == cost.compute_us(node, ASCEND_910B)


def test_mm_reduce_scatter_comm_bound():
    # the attention projection of a TP=8 layer: [4096, 512] @ [512, 4096], scattered over 8 ranks
    node = mc2_node(trace(mm_rs, empty(4096, 512), empty(512, 4096)))
    part = cost.mc2_cost(node)
    matmul = 2 * 4096 * 512 * 4096 / CUBE * 1e6  # 53.687 µs (HBM: 40 MiB, 26.2 µs)
    c1 = ALPHA + 4096 * 4096 * 2 / 8 / (8 * LINK) * 1e6  # 11.362 µs > m1 = 6.711 µs
    assert part.kind == "reduce_scatter"
    assert part.matmul_us == pytest.approx(matmul)
    assert part.comm_us == pytest.approx(76.898, abs=1e-3)
    assert part.fused_us == pytest.approx(c1 + matmul / 8 + 7 * c1)
    assert part.fused_us == pytest.approx(97.609, abs=1e-3)  # every chunk's comm shows: 43.9 µs exposed
    assert part.fused_us - part.matmul_us == pytest.approx(43.922, abs=1e-3)
    assert part.comm_bound


def test_mm_all_reduce_takes_the_profile_group_and_bias():
    def f(x, w, b):
        return torch.ops.npu.npu_mm_all_reduce_base(x, w, "no-such-group", bias=b)

    node = mc2_node(trace(f, empty(2, 1024, 4096), empty(4096, 1024), empty(1024)))
    part = cost.mc2_cost(node)
    out = 2048 * 1024 * 2  # 4 MiB of partial sums
    matmul = 2 * 2048 * 4096 * 1024 / CUBE * 1e6  # 53.687 µs
    c1 = 2 * (ALPHA + out / 8 / (8 * LINK) * 1e6)  # an all-reduce is two passes: 6.341 µs < m1 = 6.711
    assert (part.kind, part.ranks, part.chunks) == ("all_reduce", 8, 8)  # hcom names no live group: 8 ranks
    assert part.comm_us == pytest.approx(2 * (ALPHA + out / (8 * LINK) * 1e6))
    assert part.fused_us == pytest.approx(c1 + matmul)
    assert part.fused_us == pytest.approx(60.028, abs=1e-3)


def test_one_chunk_hides_nothing_and_more_chunks_pay_more_latency():
    gm = trace(mm_rs, empty(4096, 512), empty(512, 4096))
    node = mc2_node(gm)
    serial = cost.mc2_cost(node, profile.load({"mc2_chunks": 1}))
    assert serial.chunks == 1 and serial.fused_us == pytest.approx(serial.matmul_us + serial.comm_us)
    fine = cost.mc2_cost(node, profile.load({"mc2_chunks": 64}))
    # comm-bound: 64 chunks of α + 74.898/64 µs, plus one chunk of matmul
    assert fine.fused_us == pytest.approx(64 * (ALPHA + 74.898 / 64) + 53.687 / 64, abs=1e-3)


# ---- simulator ----------------------------------------------------------------------------------------------

PARTS = MC2Cost(matmul_us=10.0, comm_us=8.0, fused_us=13.0, chunks=8, kind="reduce_scatter", ranks=8,
                chunk_comm_us=3.0)


def by_name(**costs):
    return lambda n: costs.get(n.name, 0.0)


def test_mc2_on_a_free_link_exposes_fused_minus_matmul():
    gm = trace(lambda x, w: mm_rs(x @ w, w).relu(), empty(4096, 512), empty(512, 512))
    t = simulate(gm, cost_us=by_name(mm=5.0, relu=1.0), mc2_cost=lambda n: PARTS)
    assert (t.compute_us, t.comm_us, t.exposed_comm_us, t.total_us) == (16.0, 8.0, 3.0, 19.0)
    assert (t.collectives, t.mc2) == (0, 1)
    spans = {(e.stream, e.start_us, e.dur_us) for e in t.events}
    assert {("compute", 0.0, 5.0), ("compute", 5.0, 13.0), ("comm", 5.0, 13.0), ("compute", 18.0, 1.0)} == spans


def test_mc2_waits_for_a_busy_link():
    def f(x, w):
        ar = c10d.all_reduce(x, "sum", "tp")  # on the link 0..8
        y = x @ w  # compute 0..5
        z = mm_rs(y, w)  # link busy until 8: waits 3, runs 8..21
        return z, c10d.wait_tensor(ar)  # done long before

    t = simulate(trace(f, empty(4096, 512), empty(512, 512)), cost_us=by_name(all_reduce=8.0, mm=5.0),
                 mc2_cost=lambda n: PARTS)
    assert (t.compute_us, t.comm_us, t.exposed_comm_us, t.total_us) == (15.0, 16.0, 6.0, 21.0)
    assert [(e.name, e.start_us, e.dur_us) for e in t.events if e.stream == "exposed"] == [
        ("link busy: npu_mm_reduce_scatter_base", 5.0, 3.0)]
    assert t.summary() == {"collectives": 1, "mc2": 1, "compute_us": 15.0, "comm_us": 16.0,
                           "exposed_comm_us": 6.0, "total_us": 21.0}


def test_a_collective_issued_after_mc2_waits_for_the_link():
    def f(x, w):
        z = mm_rs(x, w)  # 0..13, holding the link
        return z, c10d.wait_tensor(c10d.all_reduce(x, "sum", "tp"))  # link free at 13: 13..21, all exposed

    t = simulate(trace(f, empty(4096, 512), empty(512, 512)), cost_us=by_name(all_reduce=8.0),
                 mc2_cost=lambda n: PARTS)
    assert (t.exposed_comm_us, t.total_us) == (11.0, 21.0)


def test_lower_bound_of_mc2_nodes():
    chain = trace(lambda x, w: mm_rs(ag_mm(x, w), w), empty(512, 512), empty(512, 512))
    assert exposed_comm_lower_bound(chain, mc2_cost=lambda n: PARTS) == 6.0  # 2 × (13 − 10), in any order

    def beside(x, w):  # an MC2 op and an all-reduce side by side: the link is busy 13 + 8 µs
        return mm_rs(x, w), c10d.wait_tensor(c10d.all_reduce(x, "sum", "tp")), (x @ w).relu()

    gm = trace(beside, empty(4096, 512), empty(512, 512))
    cost_us = by_name(all_reduce=8.0, mm=1.0, relu=1.0)
    bound = exposed_comm_lower_bound(gm, cost_us=cost_us, mc2_cost=lambda n: PARTS)
    assert bound == 21.0 - 12.0
    assert simulate(gm, cost_us=cost_us, mc2_cost=lambda n: PARTS).exposed_comm_us >= bound


SLOW_LINKS = {"link_latency_us": 50.0, "link_bytes_per_s": 1e6}  # comm dominates even tiny graphs


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 10_000))
def test_lower_bound_holds_for_random_graphs_with_mc2(seed):
    gm = random_program(seed, world_size=8, mc2=True, n_steps=20).trace()
    bound = exposed_comm_lower_bound(gm, SLOW_LINKS)
    before = simulate(gm, SLOW_LINKS)
    assert bound <= before.exposed_comm_us + 1e-6
    assert before.total_us == pytest.approx(before.compute_us + before.exposed_comm_us)
    reordered = schedule_overlap(gm, SLOW_LINKS, bucket=False)  # any order of this graph
    assert bound <= reordered.after.exposed_comm_us + 1e-6
    assert reordered.after.total_us <= reordered.before.total_us + 1e-9
    bucketed = random_program(seed, world_size=8, mc2=True, n_steps=20).trace()
    result = schedule_overlap(bucketed, SLOW_LINKS)  # bucketing makes another graph, with its own bound
    assert exposed_comm_lower_bound(bucketed, SLOW_LINKS) <= result.after.exposed_comm_us + 1e-6


# ---- the overlap stage on npu-sim ---------------------------------------------------------------------------

@pytest.fixture
def fake_world():
    with fake_process_group(8) as group:
        yield group.group_name


def two_gathers(group, rows=16, k=256, n=64):
    def f(x1, x2, w1, w2):
        a = c10d.all_gather_into_tensor(x1, 8, group)
        b = c10d.all_gather_into_tensor(x2, 8, group)
        return c10d.wait_tensor(a) @ w1, c10d.wait_tensor(b) @ w2

    return trace(f, empty(rows, k), empty(rows, k), empty(k, n), empty(k, n))


def ops(gm):
    return [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]


def test_bucketing_alone_would_hide_the_mc2_sites(fake_world):
    gm = two_gathers(fake_world)
    assert schedule_overlap(gm).buckets == 1  # two latency-bound all-gathers: one merged collective
    gathers = [o for o in ops(gm) if o.startswith("_c10d_functional.all_gather")]
    assert gathers == ["_c10d_functional.all_gather_into_tensor_out.default"]  # into one flat buffer, then split
    assert rewrite_mc2(gm, npu_sim.c10d_group_name) == [] and fused_sites(gm) == {}  # no site left to fuse


def test_overlap_stage_rewrites_mc2_before_bucketing(fake_world):
    # 2 MiB gathered each: 2 + 4.68 µs, 30% latency, so bucketing would merge them; each [256, 4096] @ [4096, 4096]
    # (26.8 µs) outlasts a chunk's gather (2.59 µs), so MC2 exposes 2 × 2.59 µs against 6.68 µs left plain
    gm = two_gathers(fake_world, rows=32, k=4096, n=4096)
    assert schedule.bucket_small_collectives(schedule.copy_module(gm), profile.load()) == 1
    assert stages(gm) == []
    assert ops(gm).count("npu.npu_all_gather_base_mm.default") == 2
    assert not [o for o in ops(gm) if o.startswith("_c10d_functional")]
    assert sorted(fused_sites(gm)) == ["all_gather_into_tensor", "all_gather_into_tensor_1"]
    assert simulate(gm).exposed_comm_us == pytest.approx(2 * (ALPHA + 2 * MiB / 8 / (8 * LINK) * 1e6))  # 2 × 2.585


def test_overlap_stage_on_reference_leaves_mc2_to_nobody(fake_world):
    gm = two_gathers(fake_world)
    assert stages(gm, target="reference") == []
    assert not [o for o in ops(gm) if o.startswith("npu.")]


def test_declined_sites_are_reported_once_by_the_stage(fake_world):
    def f(x1, x2, w1, w2):
        a = c10d.wait_tensor(c10d.all_gather_into_tensor(x1, 8, fake_world)) @ w1
        b = c10d.wait_tensor(c10d.all_gather_into_tensor(x2, 8, fake_world)) @ w2  # k = 128: declined
        return a, b

    gm = trace(f, empty(512, 4096), empty(16, 128), empty(4096, 1024), empty(128, 64))
    declined = {"op": "npu.npu_all_gather_base_mm",
                "reason": "npu: MC2 declined: npu_all_gather_base_mm: k must be in [256, 65535), got 128"}
    assert stages(gm) == [declined]  # once, though the choice rewrote copies of the graph many times
    assert ops(gm).count("npu.npu_all_gather_base_mm.default") == 1


def test_megatron_gather_into_its_own_buffer_is_a_site(fake_world):
    def f(x, w):  # what _all_gather_base(out, x) functionalizes to
        full = torch.ops.aten.copy(torch.empty(128, 256, dtype=bf16), c10d.wait_tensor(
            c10d.all_gather_into_tensor(x, 8, fake_world)))
        return full @ w, full.sum(0)

    gm = trace(f, empty(16, 256), empty(256, 64))
    assert rewrite_mc2(gm, npu_sim.c10d_group_name) == []
    names = ops(gm)
    assert names.count("npu.npu_all_gather_base_mm.default") == 1
    assert "aten.copy.default" not in names and "aten.empty.memory_format" not in names
    fused = mc2_node(gm)
    assert fused.kwargs == {"gather_output": True}  # the sum reads the gathered tensor
