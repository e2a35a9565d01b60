"""Which MC2 sites the npu targets' MC2 stage fuses: ``rewrite_mc2``'s ``leave`` (sites kept plain by choice, each
reported once) and ``choose_mc2`` (the cost model weighing MC2 against the generic overlap scheduler).

Figures are the default profile's (320 TFLOPS bf16, 56 GB/s per link, 2 µs per step, full mesh, 8 ranks):
a gathered [4096, 4096] bf16 tensor (32 MiB) costs 76.898 µs to all-gather, 11.362 µs per rank's chunk."""

import logging

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from megatron_glue.capture.testing import fake_process_group
from npu_compile import config
from npu_compile.comm import overlap_stage, simulate
from npu_compile.lowering import npu_sim
from npu_compile.lowering.npu.mc2 import choose_mc2, fused_sites, mc2_stage, rewrite_mc2

c10d = torch.ops._c10d_functional
bf16 = torch.bfloat16
NPU_SIM = config.Options(target="npu-sim", overlap=True)
HCOM = npu_sim.c10d_group_name  # npu-sim's communicator names: the c10d group's
AG_MM = "npu.npu_all_gather_base_mm.default"
AG = "_c10d_functional.all_gather_into_tensor.default"
MM_512, MM_768, MM_2048 = (2 * 4096 * 4096 * n / 320e12 * 1e6 for n in (512, 768, 2048))  # flop-bound rooflines
AG_US = 2 + 32 * 2**20 / (8 * 56e9) * 1e6  # 76.898: the 32 MiB all-gather over a full mesh of 8
C1 = 2 + 4 * 2**20 / (8 * 56e9) * 1e6  # 11.362: one rank's chunk of it
FUSED_512 = 8 * C1 + MM_512 / 8  # 97.609: comm-bound MC2, every chunk's gather shows
FUSED_2048 = C1 + MM_2048  # 226.111: compute-bound MC2, the first chunk's gather, then the matmul


def stages(gm, kind):
    """The MC2 stage, then the overlap stage, as the backend runs them; the MC2 stage's ``unfused`` entries."""
    unfused = mc2_stage(gm, NPU_SIM, kind, hcom=HCOM)
    overlap_stage(gm, NPU_SIM, kind)
    return unfused


def figures(choice):
    return {c.label: (c.total_us, c.exposed_comm_us) for c in choice.candidates}


def approx(expected):
    return {label: pytest.approx(pair, abs=1e-6) for label, pair in expected.items()}


@pytest.fixture(autouse=True, scope="module")
def npu_ops():
    npu_sim.register()


@pytest.fixture
def group():
    with fake_process_group(8) as world:
        yield world.group_name


def empty(*shape):
    return torch.empty(*shape, dtype=bf16)


def ops(gm):
    return [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]


def wait(t):
    return c10d.wait_tensor(t)


def chain(group, beside: bool):
    """all-gather → mm (comm-bound: 53.7 µs matmul, 76.9 µs gather) → all-gather of its output → mm (compute-bound:
    214.7 µs); with ``beside``, an independent 80.5 µs matmul that the first gather can hide behind."""

    def f(x, w1, w2, y, wy):
        h = wait(c10d.all_gather_into_tensor(x, 8, group)) @ w1  # [4096, 512]
        out = wait(c10d.all_gather_into_tensor(h.view(512, 4096), 8, group)) @ w2
        return (out, y @ wy) if beside else (out,)

    return make_fx(f, tracing_mode="fake")(empty(512, 4096), empty(4096, 512), empty(4096, 2048),
                                            empty(4096, 4096), empty(4096, 768))


# ---- rewrite_mc2(leave=...) ---------------------------------------------------------------------------------

def test_a_left_site_stays_plain_and_is_reported(group):
    gm = chain(group, beside=True)
    report = {"op": "npu.npu_all_gather_base_mm", "reason": "npu: MC2 not taken: because"}
    assert rewrite_mc2(gm, HCOM, leave={"all_gather_into_tensor": "because"}) == [report]
    assert ops(gm).count(AG) == 1 and ops(gm).count(AG_MM) == 1
    assert list(fused_sites(gm)) == ["all_gather_into_tensor_1"]  # the fused op names the collective it replaced


def test_leave_the_second_site(group):
    gm = chain(group, beside=False)
    left = {"all_gather_into_tensor_1": "x"}
    assert rewrite_mc2(gm, HCOM, leave=left) == [
        {"op": "npu.npu_all_gather_base_mm", "reason": "npu: MC2 not taken: x"}]
    assert ops(gm).count(AG) == 1 and list(fused_sites(gm)) == ["all_gather_into_tensor"]


def test_a_constraint_decline_keeps_its_own_reason(group):
    def f(x, w):
        return wait(c10d.all_gather_into_tensor(x, 8, group)) @ w  # k = 128

    gm = make_fx(f, tracing_mode="fake")(empty(16, 128), empty(128, 64))
    assert rewrite_mc2(gm, HCOM, leave={"all_gather_into_tensor": "chosen"}) == [
        {"op": "npu.npu_all_gather_base_mm",
         "reason": "npu: MC2 declined: npu_all_gather_base_mm: k must be in [256, 65535), got 128"}]


# ---- choose_mc2 and the MC2 stage ----------------------------------------------------------------------------

def test_choice_leaves_a_comm_bound_site_with_compute_beside_it(group, caplog):
    gm = chain(group, beside=True)
    original = ops(gm)
    choice = choose_mc2(gm, HCOM)
    assert ops(gm) == original  # chosen on copies
    assert list(choice.sites) == ["all_gather_into_tensor", "all_gather_into_tensor_1"]
    assert choice.comm_bound == ["all_gather_into_tensor"]
    # (a) the comm-bound MC2 op exposes 97.609 − 53.687 µs, the other its first chunk
    # (b) the first gather hides behind y @ wy, the second (after mm1) has nothing beside it: 76.898 exposed
    # (c) the first gather hides behind y @ wy, the second is fused: only its first chunk shows
    assert figures(choice) == approx({
        "all MC2": (FUSED_512 + MM_768 + FUSED_2048, FUSED_512 - MM_512 + C1),
        "no MC2": (MM_768 + MM_512 + AG_US + MM_2048, AG_US),
        "MC2 but the comm-bound sites": (MM_768 + MM_512 + FUSED_2048, C1),
    })
    assert figures(choice)["MC2 but the comm-bound sites"] == pytest.approx((360.328, 11.362), abs=1e-3)
    assert figures(choice)["all MC2"][1] == pytest.approx(55.284, abs=1e-3)
    assert choice.chosen.label == "MC2 but the comm-bound sites"
    why = ("the cost model finds the graph faster with this collective left to the overlap scheduler "
           "(exposed 55.3 µs as MC2 vs 11.4 µs scheduled)")
    assert choice.reasons == {"all_gather_into_tensor": why}

    with caplog.at_level(logging.INFO, logger="npu_compile"):
        unfused = stages(gm, "backward")
    assert unfused == [{"op": "npu.npu_all_gather_base_mm", "reason": f"npu: MC2 not taken: {why}"}]  # once
    assert ops(gm).count(AG) == 1 and ops(gm).count(AG_MM) == 1
    assert [n.args[1].name for n in gm.graph.nodes if str(n.target) == AG_MM] == ["w2_1"]  # mm2's weight
    order = [n.name for n in gm.graph.nodes if n.op == "call_function" and n.target != torch.ops.aten.view.default]
    assert order.index("all_gather_into_tensor") < order.index("mm_2") < order.index("wait_tensor")  # hidden
    t = simulate(gm)
    assert (t.total_us, t.exposed_comm_us) == pytest.approx((MM_768 + MM_512 + FUSED_2048, C1), abs=1e-6)
    assert (t.collectives, t.mc2) == (1, 1)
    assert ("MC2 for the backward graph: MC2 but the comm-bound sites (1 of 2 sites fused): total 360.3 µs, "
            "exposed comm 11.4 µs; tried all MC2: 404.3 / 55.3 µs; no MC2: 425.9 / 76.9 µs; "
            "MC2 but the comm-bound sites: 360.3 / 11.4 µs") in caplog.messages


def test_choice_fuses_a_comm_bound_site_with_nothing_beside_it(group):
    gm = chain(group, beside=False)
    choice = choose_mc2(gm, HCOM)
    assert figures(choice) == approx({
        "all MC2": (FUSED_512 + FUSED_2048, FUSED_512 - MM_512 + C1),  # 55.284 exposed
        "no MC2": (AG_US + MM_512 + AG_US + MM_2048, 2 * AG_US),
        "MC2 but the comm-bound sites": (AG_US + MM_512 + FUSED_2048, AG_US + C1),
        "MC2 but all_gather_into_tensor_1": (FUSED_512 + AG_US + MM_2048, FUSED_512 - MM_512 + AG_US),
    })
    assert choice.chosen.label == "all MC2" and choice.reasons == {}
    assert stages(gm, "forward") == []
    assert ops(gm).count(AG_MM) == 2 and not [o for o in ops(gm) if o.startswith("_c10d_functional")]
    t = simulate(gm)
    assert t.exposed_comm_us == pytest.approx(55.284, abs=1e-3) and t.mc2 == 2


def test_no_site_no_choice(group):
    def f(x):
        return wait(c10d.all_gather_into_tensor(x, 8, group)).relu()

    gm = make_fx(f, tracing_mode="fake")(empty(512, 4096))
    assert choose_mc2(gm, HCOM) is None


def test_tiny_sites_stay_plain_and_are_bucketed(group):
    """Two latency-bound gathers: eight chunks of MC2 pay the link latency eight times; plain, one merged gather."""

    def f(x1, x2, w1, w2):
        a = c10d.all_gather_into_tensor(x1, 8, group)
        b = c10d.all_gather_into_tensor(x2, 8, group)
        return wait(a) @ w1, wait(b) @ w2

    gm = make_fx(f, tracing_mode="fake")(empty(16, 256), empty(16, 256), empty(256, 64), empty(256, 64))
    choice = choose_mc2(gm, HCOM)
    assert choice.chosen.label == "no MC2"
    unfused = stages(gm, "forward")
    assert not [o for o in ops(gm) if o.startswith("npu.")]
    assert [o for o in ops(gm) if "all_gather" in o] == ["_c10d_functional.all_gather_into_tensor_out.default"]
    assert [u["reason"] for u in unfused] == [f"npu: MC2 not taken: {choice.reasons[s]}" for s in choice.sites]
    assert len(unfused) == 2


def test_every_mc2_call_the_stage_emits_binds(group):
    """The MC2 stage's calls go through the schema check every other call does: all-gather → mm, mm →
    reduce-scatter, addmm → all-reduce (Megatron's 3-D view → mm → view forms), each bound to the torch-npu
    2.13.0 wheel's schema."""
    from npu_compile.lowering.npu.schemas import MC2

    from .wheel import assert_calls_bind

    def f(x, w_in, w_out, b, w_ar):
        full = wait(c10d.all_gather_into_tensor(x, 8, group))  # [s, b, h] gathered on s
        h = (full.view(-1, 512) @ w_in).view(32, 4, 512)
        scattered = wait(c10d.reduce_scatter_tensor(h.view(-1, 512) @ w_out, "sum", 8, group))
        return wait(c10d.all_reduce(torch.addmm(b, scattered, w_ar), "sum", group))

    gm = make_fx(f, tracing_mode="fake")(empty(4, 4, 512), empty(512, 512), empty(512, 512), empty(256),
                                         empty(512, 256))
    opts = config.Options(target="npu-sim", overlap=False)  # every site within the constraints is fused
    assert mc2_stage(gm, opts, "forward", hcom=HCOM) == []
    assert_calls_bind(gm)
    assert {n.target._schema.name.split("::")[1] for n in gm.graph.nodes
            if getattr(n.target, "namespace", None) == "npu"} == set(MC2)
