"""The overlap pass: it hides comm where the graph allows, never makes the simulated time longer, honours its
memory cap, keeps side effects in order, buckets small collectives, and fills report.json's ``comm``."""

import json

import networkx as nx
import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch._inductor.pattern_matcher import stable_topological_sort
from torch.fx.experimental.proxy_tensor import make_fx

from comm_graphs import random_program
from npu_compile.comm import collectives, schedule_overlap, simulate
from npu_compile.comm.schedule import dependency_graph
from megatron_glue.capture.testing import fake_process_group

c10d = torch.ops._c10d_functional
bf16 = torch.bfloat16
MiB = 2**20


def trace(fn, *args):
    return make_fx(fn, tracing_mode="fake")(*args)


def by_name(gm):
    return {n.name: n for n in gm.graph.nodes}


def order(gm):
    return [n.name for n in gm.graph.nodes]


def big(*shape):
    return torch.empty(*shape, dtype=bf16)


def test_collective_is_hidden_behind_independent_compute():
    def f(x, w, s):
        y = c10d.wait_tensor(c10d.all_reduce(x @ w, "sum", "tp"))  # 430 µs matmul, then a 154 µs all-reduce
        z = s @ w  # independent: can hide it
        return y + 1, z

    gm = trace(f, big(4096, 4096), big(4096, 4096), big(4096, 4096))
    result = schedule_overlap(gm)
    assert result.before.exposed_comm_us == pytest.approx(result.before.comm_us)
    assert result.after.exposed_comm_us == 0
    assert result.after.total_us < result.before.total_us
    names = order(gm)
    assert names.index("all_reduce") < names.index("mm_1") < names.index("wait_tensor")
    assert simulate(gm).exposed_comm_us == 0  # what the report will say is what the result said


def test_critical_path_saves_weight_gradients_for_hiding_comm():
    # Backward of a column-parallel linear: the weight gradient is off the path to the next collective.
    def backward(g, w, act):
        wgrad = g.t() @ act  # first in the original order
        dgrad = g @ w
        rs = c10d.wait_tensor(c10d.reduce_scatter_tensor(dgrad, "sum", 8, "tp"))
        return wgrad, rs * 2

    gm = trace(backward, big(4096, 4096), big(4096, 4096), big(4096, 4096))
    result = schedule_overlap(gm)
    assert result.strategy == "critical_path"
    assert result.before.exposed_comm_us > 0 and result.after.exposed_comm_us == 0
    names = order(gm)
    assert names.index("mm_1") < names.index("reduce_scatter_tensor") < names.index("mm") < names.index("wait_tensor")


def test_serial_chain_is_left_alone():
    def chain(x, w):
        y = c10d.wait_tensor(c10d.all_gather_into_tensor(x, 8, "tp"))
        return c10d.wait_tensor(c10d.reduce_scatter_tensor(y @ w, "sum", 8, "tp"))

    gm = trace(chain, big(512, 4096), big(4096, 4096))
    before = order(gm)
    result = schedule_overlap(gm)
    assert result.strategy == "unchanged" and order(gm) == before


def test_order_is_a_stable_topological_order():
    gm = random_program(3, world_size=8).trace()
    schedule_overlap(gm, {"link_latency_us": 100.0})
    scheduled = order(gm)
    stable_topological_sort(gm.graph)
    assert order(gm) == scheduled
    gm.graph.lint()


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 10_000))
def test_never_longer_than_the_original(seed):
    gm = random_program(seed, world_size=8).trace()
    slow_links = {"link_latency_us": 50.0, "link_bytes_per_s": 1e6}  # comm dominates even tiny graphs
    result = schedule_overlap(gm, slow_links)
    assert result.after.total_us <= result.before.total_us + 1e-9
    assert result.after.exposed_comm_us <= result.before.exposed_comm_us + 1e-9
    assert simulate(gm, slow_links).total_us == pytest.approx(result.after.total_us)


def test_memory_cap_is_honoured():
    # Issuing the all-gather first would keep its 32 MiB output alive across the big matmul.
    def f(x, s, w):
        y = (s @ w).sum(0)
        ag = c10d.wait_tensor(c10d.all_gather_into_tensor(x, 8, "tp"))
        return y, ag @ w

    args = big(512, 4096), big(4096, 4096), big(4096, 4096)
    capped = schedule_overlap(trace(f, *args), max_extra_bytes=0)
    assert capped.peak_bytes_after <= capped.peak_bytes_before
    free = schedule_overlap(trace(f, *args), max_extra_bytes=64 * MiB)
    assert free.after.exposed_comm_us < capped.after.exposed_comm_us
    assert capped.peak_bytes_before < free.peak_bytes_after <= free.peak_bytes_before + 64 * MiB


def test_mutations_and_random_draws_keep_their_order():
    def f(x, y):
        a = x * 2  # reads x before the update
        t = x.t()  # a view of x
        x.add_(1)
        b = t * 3  # reads the updated storage through the view
        r1 = torch.rand_like(a)
        r2 = torch.rand_like(b)
        ar = c10d.wait_tensor(c10d.all_reduce(y, "sum", "tp"))
        return a + r1, b + r2, ar

    gm = trace(f, torch.empty(8, 8), torch.empty(8, 8))
    deps, n = dependency_graph(gm.graph), by_name(gm)
    assert nx.has_path(deps, n["mul"], n["add_"])
    assert nx.has_path(deps, n["add_"], n["mul_1"])
    assert nx.has_path(deps, n["rand_like"], n["rand_like_1"])
    assert not nx.has_path(deps, n["add_"], n["all_reduce"])  # the collective is free to move up
    schedule_overlap(gm, {"link_latency_us": 100.0})
    names = order(gm)
    assert names.index("mul") < names.index("add_") < names.index("mul_1")
    assert names.index("rand_like") < names.index("rand_like_1")
    assert names.index("all_reduce") < names.index("mul")


def test_small_same_group_collectives_are_bucketed():
    def f(a, b, c, x):
        ra = c10d.wait_tensor(c10d.all_reduce(a, "sum", "tp"))
        rb = c10d.wait_tensor(c10d.all_reduce(b, "sum", "tp"))
        rc = c10d.wait_tensor(c10d.all_reduce(c, "sum", "tp"))
        big_one = c10d.wait_tensor(c10d.all_reduce(x, "sum", "tp"))  # bandwidth-bound: left alone
        return ra + 1, rb + 1, rc + 1, big_one

    gm = trace(f, torch.empty(64), torch.empty(64), torch.empty(128), big(4096, 4096))
    result = schedule_overlap(gm)
    assert result.buckets == 1
    assert len(collectives(gm)) == 2
    assert result.after.comm_us < result.before.comm_us  # one latency instead of three


@pytest.fixture
def fake_world():
    with fake_process_group(8) as group:
        yield group


def test_backend_reports_comm_and_writes_the_trace(tmp_path, fake_world):
    from torch.distributed import _functional_collectives as funcol

    def step(x, w, s):
        y = funcol.all_reduce(x @ w, "sum", fake_world)
        return y + 1, s @ w

    args = torch.randn(64, 64), torch.randn(64, 64), torch.randn(64, 64)
    torch.compile(step, backend="ascend", fullgraph=True, options={"dump_dir": str(tmp_path)})(*args)
    folder = next(tmp_path.iterdir())
    report = json.loads((folder / "report.json").read_text())["comm"]
    assert report["collectives"] == 1
    assert report["comm_us"] > 0 and report["compute_us"] > 0
    assert 0 <= report["exposed_comm_us_after"] <= report["exposed_comm_us_before"] <= report["comm_us"] + 1e-6
    trace_events = json.loads((folder / "overlap_trace.json").read_text())["traceEvents"]
    processes = {e["args"]["name"] for e in trace_events if e["name"] == "process_name"}
    assert processes == {"inference · as captured", "inference · scheduled"}
