"""Two-stream simulator on hand-built graphs whose exposed comm can be counted on one's fingers."""

import json

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from npu_compile.comm import chrome_trace, exposed_comm_lower_bound, simulate

c10d = torch.ops._c10d_functional


def trace(fn, *args):
    return make_fx(fn, tracing_mode="fake")(*args)


def costs(**by_name):
    """A cost function by node name (µs); every other node is free."""
    return lambda n: by_name.get(n.name, 0.0)


X = torch.empty(8, 8)


def test_wait_exposes_what_compute_did_not_cover():
    def f(x):
        ar = c10d.all_reduce(x, "sum", "0")  # issued at 0, runs 8
        y = x @ x  # 5: hides 5 of the 8
        z = c10d.wait_tensor(ar)  # holds compute 3
        return y + z  # 1

    t = simulate(trace(f, X), cost_us=costs(all_reduce=8, mm=5, add=1))
    assert (t.compute_us, t.comm_us, t.exposed_comm_us, t.total_us) == (6, 8, 3, 9)
    exposed = [e for e in t.events if e.stream == "exposed"]
    assert [(e.start_us, e.dur_us) for e in exposed] == [(5, 3)]


def test_comm_stream_runs_one_collective_at_a_time():
    def f(x):
        a = c10d.all_reduce(x, "sum", "0")  # 0..8
        b = c10d.all_reduce(x, "sum", "0")  # queued: 8..16
        y = x @ x  # 0..5
        a = c10d.wait_tensor(a)  # held 5..8
        b = c10d.wait_tensor(b)  # held 8..16
        return y + a + b  # add 16..17, add_1 17..18

    t = simulate(trace(f, X), cost_us=costs(all_reduce=8, all_reduce_1=8, mm=5, add=1, add_1=1))
    assert (t.exposed_comm_us, t.total_us) == (11, 18)


def test_collective_waits_for_the_compute_stream_to_reach_it():
    def f(x):
        y = x @ x  # 0..5
        ar = c10d.all_reduce(y, "sum", "0")  # issued at 5: 5..9
        z = x + 1  # 5..7
        return c10d.wait_tensor(ar) + z  # held 7..9, then add_1

    t = simulate(trace(f, X), cost_us=costs(mm=5, all_reduce=4, add=2, add_1=1))
    comm = next(e for e in t.events if e.stream == "comm")
    assert (comm.start_us, t.exposed_comm_us, t.total_us) == (5, 2, 10)


def test_no_collectives_no_exposed_time():
    t = simulate(trace(lambda x: (x @ x).relu(), X))
    assert t.collectives == 0 and t.exposed_comm_us == 0 and t.total_us == pytest.approx(t.compute_us)


def test_lower_bound_is_the_dependency_chain():
    def chain(x):
        y = c10d.wait_tensor(c10d.all_reduce(x @ x, "sum", "0"))
        return y @ y

    gm = trace(chain, X)
    cost_us = costs(mm=5, all_reduce=4, mm_1=5)
    assert exposed_comm_lower_bound(gm, cost_us=cost_us) == 4  # nothing can overlap a serial chain
    assert simulate(gm, cost_us=cost_us).exposed_comm_us == 4

    def parallel(x):
        y = c10d.all_reduce(x, "sum", "0")
        return x @ x, c10d.wait_tensor(y)

    assert exposed_comm_lower_bound(trace(parallel, X), cost_us=costs(mm=5, all_reduce=4)) == 0


def test_chrome_trace_has_both_streams():
    def f(x):
        ar = c10d.all_reduce(x, "sum", "0")
        y = x @ x
        return c10d.wait_tensor(ar) + y

    t = simulate(trace(f, X), cost_us=costs(all_reduce=8, mm=5, add=1))
    events = json.loads(json.dumps(chrome_trace({"forward · scheduled": t})))["traceEvents"]
    spans = {(e["name"], e["tid"], e["ts"], e["dur"]) for e in events if e["ph"] == "X"}
    assert ("all_reduce", 1, 0, 8) in spans  # comm thread
    assert ("mm", 0, 0, 5) in spans  # compute thread
    assert ("wait all_reduce", 0, 5, 3) in spans  # the exposed hold, on the compute thread
    names = {e["args"]["name"] for e in events if e["ph"] == "M"}
    assert {"forward · scheduled", "compute", "comm"} <= names
