"""Comm/compute overlap on one Megatron TP=8 + SP transformer layer, under the Ascend cost model.

The same forward and backward graphs (hidden 4096, 32 heads, seq 4096, micro-batch 1, bf16, TP=8 with sequence
parallelism) are scored by one simulator (npu_compile.comm) in these ways:

    none             the order as captured: every collective waited on at once
    ours             npu_compile.comm.schedule_overlap
    inductor         torch._inductor's schedule_overlap_bucketing, fed the same cost model
    mc2              the MC2 rewrite for target npu-sim (npu_compile.lowering.npu.mc2), in the captured order
    mc2 + ours       the MC2 rewrite of every site, then our scheduler
    mc2 + inductor   the MC2 rewrite of every site, then Inductor's scheduler
    mc2 chosen + ours  what the npu targets' stages do: MC2 on the sites the cost model picks
                     (npu_compile.lowering.npu.mc2.choose_mc2: the least simulated time among all MC2, no MC2, MC2
                     but the comm-bound sites, and greedy single-site flips), then our scheduler
    limit            the physical limit max(compute, comm), and the dependency limit of each graph (as captured,
                     MC2-rewritten, and as the stage chose)

Writes bench/results/overlap.md (tables) and a timeline PNG per graph source (overlap.png: handmade,
overlap_captured.png: captured).

    python -m bench.overlap [--graph captured,handmade]

The graphs come from one process with torch's fake process group (8 ranks, no real communication):
``captured`` is Megatron's own layer as megatron_glue.capture.layer captures it (aot_autograd's graphs, before any
npu_compile stage); ``handmade`` builds graphs with the collectives and matmul shapes of Megatron's SP layer and
npu_compile's fused attention, in the order Megatron's autograd functions run them. Both run by default.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
from pathlib import Path
from unittest import mock

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.fx.experimental.proxy_tensor import make_fx  # noqa: E402

import npu_compile.ops  # noqa: E402,F401  (npu_compile.fused_attention)
from bench.harness import write_result  # noqa: E402
from npu_compile import comm, config, device, lowering  # noqa: E402
from npu_compile.comm.schedule import MAX_EXTRA_BYTES, peak_bytes  # noqa: E402
from npu_compile.device import cost  # noqa: E402
from npu_compile.device.nodes import fused_collective, is_collective  # noqa: E402
from npu_compile.lowering import npu_sim  # noqa: E402
from npu_compile.lowering.npu.mc2 import SITE, choose_mc2, rewrite_mc2  # noqa: E402

TP, HIDDEN, HEADS, SEQ, BATCH, DTYPE = 8, 4096, 32, 4096, 1, torch.bfloat16
FFN = 4 * HIDDEN
c10d = torch.ops._c10d_functional
aten = torch.ops.aten
RESULTS = Path(__file__).parent / "results"


# -- the layer ---------------------------------------------------------------------------------------------


def _fake_world() -> str:
    """Torch's fake process group of TP ranks; returns its name."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if not dist.is_initialized():
        dist.init_process_group("fake", rank=0, world_size=TP, store=FakeStore())
    return dist.group.WORLD.group_name


def _wait(t):
    return c10d.wait_tensor(t)


def _shapes():
    s, h, heads, hd = SEQ, HIDDEN, HEADS // TP, HIDDEN // HEADS
    return s, s // TP, h, heads, hd, FFN // TP


def sp_layer_forward(group, x, ln1_w, ln1_b, w_qkv, w_proj, ln2_w, ln2_b, w_fc1, w_fc2):
    """Megatron's GPT layer with SP, as aot_autograd's forward graph: what it computes and what it saves."""
    s, s_tp, h, heads, hd, f_tp = _shapes()
    ln1, mean1, rstd1 = aten.native_layer_norm(x, [h], ln1_w, ln1_b, 1e-5)
    ln1_full = _wait(c10d.all_gather_into_tensor(ln1.view(s_tp, h), TP, group))  # SP → TP: gather the sequence
    qkv = ln1_full @ w_qkv.t()  # ColumnParallel: [s, 3h/tp]
    q, k, v = qkv.view(s, BATCH, heads, 3 * hd).split(hd, dim=-1)
    attn, smax, ssum = torch.ops.npu_compile.fused_attention(q, k, v, layout="sbnd", causal=True)
    proj = attn.view(s, heads * hd) @ w_proj.t()  # RowParallel: partial sums [s, h]
    proj_rs = _wait(c10d.reduce_scatter_tensor(proj, "sum", TP, group))  # TP → SP: reduce and scatter
    h1 = x + proj_rs.view(s_tp, BATCH, h)
    ln2, mean2, rstd2 = aten.native_layer_norm(h1, [h], ln2_w, ln2_b, 1e-5)
    ln2_full = _wait(c10d.all_gather_into_tensor(ln2.view(s_tp, h), TP, group))
    fc1 = ln2_full @ w_fc1.t()  # [s, 4h/tp]
    act = aten.gelu(fc1, approximate="tanh")
    fc2 = act @ w_fc2.t()
    fc2_rs = _wait(c10d.reduce_scatter_tensor(fc2, "sum", TP, group))
    out = h1 + fc2_rs.view(s_tp, BATCH, h)
    # Megatron saves the sequence-parallel LN outputs and gathers them again in the backward.
    return out, (x, ln1, mean1, rstd1, q, k, v, attn, smax, ssum, h1, ln2, mean2, rstd2, fc1, act)


def sp_layer_backward(group, grad, saved, ln1_w, ln1_b, w_qkv, w_proj, ln2_w, ln2_b, w_fc1, w_fc2):
    """The backward graph, in the order Megatron's autograd functions run it (each collective waited at once)."""
    s, s_tp, h, heads, hd, f_tp = _shapes()
    x, ln1, mean1, rstd1, q, k, v, attn, smax, ssum, h1, ln2, mean2, rstd2, fc1, act = saved
    # fc2 (RowParallel after SP): gather the incoming gradient, then dgrad and wgrad
    g2 = _wait(c10d.all_gather_into_tensor(grad.view(s_tp, h), TP, group))
    d_act = g2 @ w_fc2
    dw_fc2 = g2.t() @ act
    d_fc1 = aten.gelu_backward(d_act, fc1, approximate="tanh")
    # fc1 (ColumnParallel with SP): re-gather its input, dgrad, reduce-scatter it, wgrad
    ln2_full = _wait(c10d.all_gather_into_tensor(ln2.view(s_tp, h), TP, group))
    d_ln2_full = d_fc1 @ w_fc1
    d_ln2 = _wait(c10d.reduce_scatter_tensor(d_ln2_full, "sum", TP, group))
    dw_fc1 = d_fc1.t() @ ln2_full
    d_h1_ln, dln2_w, dln2_b = aten.native_layer_norm_backward(
        d_ln2.view(s_tp, BATCH, h), h1, [h], mean2, rstd2, ln2_w, ln2_b, [True, True, True])
    d_h1 = grad + d_h1_ln
    # proj (RowParallel)
    g1 = _wait(c10d.all_gather_into_tensor(d_h1.view(s_tp, h), TP, group))
    d_attn = g1 @ w_proj
    dw_proj = g1.t() @ attn.view(s, heads * hd)
    dq, dk, dv, _ = torch.ops.npu_compile.fused_attention_backward(
        d_attn.view(s, BATCH, heads, hd), q, k, v, attn, smax, ssum, layout="sbnd", causal=True)
    d_qkv = torch.cat([dq, dk, dv], dim=-1).view(s, 3 * heads * hd)
    # qkv (ColumnParallel with SP)
    ln1_full = _wait(c10d.all_gather_into_tensor(ln1.view(s_tp, h), TP, group))
    d_ln1_full = d_qkv @ w_qkv
    d_ln1 = _wait(c10d.reduce_scatter_tensor(d_ln1_full, "sum", TP, group))
    dw_qkv = d_qkv.t() @ ln1_full
    d_x_ln, dln1_w, dln1_b = aten.native_layer_norm_backward(
        d_ln1.view(s_tp, BATCH, h), x, [h], mean1, rstd1, ln1_w, ln1_b, [True, True, True])
    d_x = d_h1 + d_x_ln
    return d_x, dln1_w, dln1_b, dw_qkv, dw_proj, dln2_w, dln2_b, dw_fc1, dw_fc2


def handmade_layer_graphs() -> dict[str, torch.fx.GraphModule]:
    """Forward and backward graphs of the layer, traced with fake tensors (no memory is allocated)."""
    group = _fake_world()
    s, s_tp, h, heads, hd, f_tp = _shapes()

    def empty(*shape):
        return torch.empty(*shape, dtype=DTYPE)

    weights = (empty(h), empty(h), empty(3 * heads * hd, h), empty(h, heads * hd), empty(h), empty(h),
               empty(f_tp, h), empty(h, f_tp))
    x = empty(s_tp, BATCH, h)
    forward = make_fx(functools.partial(sp_layer_forward, group), tracing_mode="fake")(x, *weights)
    with torch._subclasses.FakeTensorMode(allow_non_fake_inputs=True):
        _, saved = sp_layer_forward(group, x, *weights)
    saved = [torch.empty_strided(t.shape, t.stride(), dtype=t.dtype) for t in saved]
    backward = make_fx(
        lambda grad, *rest: sp_layer_backward(group, grad, rest[:16], *rest[16:]), tracing_mode="fake"
    )(empty(s_tp, BATCH, h), *saved, *weights)
    return {"forward": forward, "backward": backward}


def captured_layer_graphs() -> dict[str, torch.fx.GraphModule]:
    """Megatron's own TP=8 + SP GPT layer (local spec), captured by megatron_glue in this process over the fake
    process group: the forward and backward graphs aot_autograd hands the backend's compilers (no fusion rules
    applied, so attention is Megatron's unfused bmm + softmax)."""
    from megatron_glue.capture.layer import capture_layer_here

    capture = capture_layer_here(tp=TP, sp=True, hidden=HIDDEN, heads=HEADS, seq=SEQ, micro_batch=BATCH, dtype=DTYPE)
    return {"forward": capture.forward, "backward": capture.backward}


GRAPHS = {"handmade": handmade_layer_graphs, "captured": captured_layer_graphs}


# -- the schedulers ----------------------------------------------------------------------------------------


def ours(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    comm.schedule_overlap(gm)
    return gm


@contextlib.contextmanager
def _inductor_on_our_cost_model():
    """Inductor's overlap scheduler with our costs: its roofline estimator needs triton, so it is replaced by
    ours; its memory tracker ignores CPU tensors, so it is made to count them (both only inside this block)."""
    from torch._inductor.fx_passes import memory_estimator, overlap_scheduling

    def roofline_ms(node):
        return cost.node_us(node) / 1e3

    def counting_cpu(graph, *args, **kwargs):
        kwargs.setdefault("device_filter", lambda device: True)
        return memory_estimator.MemoryTracker(graph, *args, **kwargs)

    with mock.patch.object(overlap_scheduling, "estimate_roofline_runtime_ms", roofline_ms), \
            mock.patch.object(overlap_scheduling, "MemoryTracker", counting_cpu):
        yield


def our_costs_ms(node: torch.fx.Node, override_size: int | None) -> float:
    """Inductor's custom_runtime_estimation interface (milliseconds; ``override_size`` resizes a collective)."""
    if is_collective(node):
        return cost.comm_us(node, device.load(), nbytes=override_size) / 1e3
    return cost.node_us(node) / 1e3


def inductor(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    from torch._inductor.fx_passes.overlap_scheduling import schedule_overlap_bucketing

    with _inductor_on_our_cost_model():
        return schedule_overlap_bucketing(
            gm,
            custom_runtime_estimation=our_costs_ms,
            collective_estimator="analytical",
            compute_estimator="analytical",  # "benchmark" would time kernels on a GPU and sync ranks
            max_memory_increase_gb=MAX_EXTRA_BYTES / 2**30,  # the same memory cap as ours
            max_memory_increase_ratio=None,
        )


def mc2(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """The MC2 rewrite for target npu-sim (its ops defined by npu-sim's emulation); declined sites are kept in
    ``gm.meta["bench_mc2_declined"]``."""
    npu_sim.register()
    gm.meta["bench_mc2_declined"] = rewrite_mc2(gm, npu_sim.c10d_group_name)
    return gm


def mc2_chosen(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """What the backend runs for target npu-sim between memory ordering and lowering: its MC2 stage (the sites the
    cost model chooses), then the overlap stage (our scheduler); the sites the MC2 stage leaves plain or declines
    are kept in ``gm.meta["bench_mc2_declined"]``."""
    target = lowering.target("npu-sim")
    target.prepare()
    opts = config.Options(target="npu-sim", overlap=True)
    gm.meta["bench_mc2_declined"] = [e for _, stage in target.stages for e in stage(gm, opts, "bench") or []]
    comm.overlap_stage(gm, opts, "bench")
    return gm


SCHEDULERS = {
    "none": lambda gm: gm,
    "ours": ours,
    "inductor": inductor,
    "mc2": mc2,
    "mc2 + ours": lambda gm: ours(mc2(gm)),
    "mc2 + inductor": lambda gm: inductor(mc2(gm)),
    "mc2 chosen + ours": mc2_chosen,
}
CHOSEN = "mc2 chosen + ours"


# -- scoring and reporting ---------------------------------------------------------------------------------


def copy_graph(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy each scheduler may rewrite (node metadata shared)."""
    graph = torch.fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    return torch.fx.GraphModule(gm, graph)


def measure(graphs: dict[str, torch.fx.GraphModule]) -> dict:
    """Timelines per scheduler and graph kind, peak live bytes per scheduler, dependency limits per kind."""
    timelines: dict[str, dict[str, comm.Timeline]] = {}
    peaks: dict[str, int] = {}
    chosen: dict[str, torch.fx.GraphModule] = {}
    for name, schedule in SCHEDULERS.items():
        timelines[name] = {}
        peaks[name] = 0
        for kind, original in graphs.items():
            gm = schedule(copy_graph(original))
            gm.graph.lint()
            timelines[name][kind] = comm.simulate(gm)
            peaks[name] = max(peaks[name], peak_bytes(gm.graph, gm.graph.nodes))
            if name == CHOSEN:
                chosen[kind] = gm
    choices = {kind: choose_mc2(gm, npu_sim.c10d_group_name) for kind, gm in graphs.items()}
    chosen_dependency = {kind: comm.exposed_comm_lower_bound(gm) for kind, gm in chosen.items()}
    not_taken = [(kind, d) for kind, gm in chosen.items() for d in gm.meta["bench_mc2_declined"]]
    dependency = {kind: comm.exposed_comm_lower_bound(gm) for kind, gm in graphs.items()}
    rewritten = {kind: mc2(copy_graph(gm)) for kind, gm in graphs.items()}
    mc2_dependency = {kind: comm.exposed_comm_lower_bound(gm) for kind, gm in rewritten.items()}
    mc2_ops = [(kind, n.target._opname, cost.mc2_cost(n), n.meta[SITE]) for kind, gm in rewritten.items()
               for n in gm.graph.nodes if fused_collective(n) is not None]
    declined = [d for gm in rewritten.values() for d in gm.meta["bench_mc2_declined"]]
    return {"timelines": timelines, "peaks": peaks, "dependency_limit_us": dependency, "choices": choices,
            "chosen_dependency_limit_us": chosen_dependency, "chosen_not_taken": not_taken,
            "mc2_dependency_limit_us": mc2_dependency, "mc2_ops": mc2_ops, "mc2_declined": declined}


def _exposed(by_kind: dict[str, comm.Timeline]) -> float:
    return sum(t.exposed_comm_us for t in by_kind.values())


def table(result: dict) -> str:
    timelines, peaks = result["timelines"], result["peaks"]
    dependency, mc2_dependency = result["dependency_limit_us"], result["mc2_dependency_limit_us"]
    none = timelines["none"]
    comm_us = sum(t.comm_us for t in none.values())
    compute_us = sum(t.compute_us for t in none.values())
    lines = [
        "| schedule | exposed comm µs | exposed / comm | step µs (fw+bw) | peak live MiB |",
        "|---|---|---|---|---|",
    ]
    for name, by_kind in timelines.items():
        total = sum(t.total_us for t in by_kind.values())
        exposed = _exposed(by_kind)
        lines.append(f"| {name} | {exposed:.1f} | {exposed / comm_us:.1%} | {total:.1f} | {peaks[name] / 2**20:.0f} |")
    physical = max(compute_us, comm_us) - compute_us
    lines.append(f"| limit: max(compute, comm) | {physical:.1f} | {physical / comm_us:.1%} | "
                 f"{max(compute_us, comm_us):.1f} | – |")
    dep = sum(dependency.values())
    lines.append(f"| limit: dependency chains | {dep:.1f} | {dep / comm_us:.1%} | {compute_us + dep:.1f} | – |")
    mc2_compute = sum(t.compute_us for t in timelines["mc2"].values())
    mdep = sum(mc2_dependency.values())
    lines.append(f"| limit: dependency chains, MC2 graph | {mdep:.1f} | {mdep / comm_us:.1%} | "
                 f"{mc2_compute + mdep:.1f} | – |")
    chosen_dependency = result["chosen_dependency_limit_us"]
    chosen_compute = sum(t.compute_us for t in timelines[CHOSEN].values())
    cdep = sum(chosen_dependency.values())
    lines.append(f"| limit: dependency chains, chosen graph | {cdep:.1f} | {cdep / comm_us:.1%} | "
                 f"{chosen_compute + cdep:.1f} | – |")
    names = [n for n in timelines if n != "none"]
    lines += [
        "",
        "| graph | collectives | MC2 ops | compute µs | comm µs | exposed: none | "
        + " | ".join(names) + " | dependency limit | MC2 graph's limit | chosen graph's limit |",
        "|---|---|---|---|---|---|" + "---|" * len(names) + "---|---|---|",
    ]
    for kind, t in none.items():
        cells = " | ".join(f"{timelines[n][kind].exposed_comm_us:.1f}" for n in names)
        lines.append(
            f"| {kind} | {t.collectives} | {timelines['mc2'][kind].mc2} | {t.compute_us:.1f} | {t.comm_us:.1f} | "
            f"{t.exposed_comm_us:.1f} | {cells} | {dependency[kind]:.1f} | {mc2_dependency[kind]:.1f} | "
            f"{chosen_dependency[kind]:.1f} |"
        )
    lines += [
        "",
        "| graph | MC2 op | site | matmul µs | comm µs | fused µs | exposed (fused − matmul) µs |",
        "|---|---|---|---|---|---|---|",
    ]
    for kind, op, part, site in result["mc2_ops"]:
        lines.append(f"| {kind} | {op} | {site} | {part.matmul_us:.1f} | {part.comm_us:.1f} | {part.fused_us:.1f} | "
                     f"{part.fused_us - part.matmul_us:.1f} |")
    lines += [
        "",
        "The MC2 stage's candidates (`choose_mc2`; each rewritten, then scheduled by ours, then simulated):",
        "",
        "| graph | candidate | MC2 ops | step µs | exposed comm µs | peak live MiB | |",
        "|---|---|---|---|---|---|---|",
    ]
    for kind, choice in result["choices"].items():
        for c in choice.candidates:
            mark = "chosen" if c is choice.chosen else ("over the memory cap" if not c.fits else "")
            lines.append(f"| {kind} | {c.label} | {len(choice.sites) - len(c.left)} | {c.total_us:.1f} | "
                         f"{c.exposed_comm_us:.1f} | {c.peak_bytes / 2**20:.0f} | {mark} |")
    return "\n".join(lines)


GOAL = 0.10  # the goal: exposed comm at most 10% of total comm (and no more than Inductor's)


def reading(result: dict) -> str:
    """What the figures say, from the figures."""
    timelines, dependency = result["timelines"], result["dependency_limit_us"]
    comm_us = sum(t.comm_us for t in timelines["none"].values())
    share = {name: _exposed(by_kind) / comm_us for name, by_kind in timelines.items()}
    exposed = {name: _exposed(by_kind) for name, by_kind in timelines.items()}
    floor, mc2_floor = sum(dependency.values()), sum(result["mc2_dependency_limit_us"].values())
    fw = timelines["none"]["forward"]
    parts = [part for _, _, part, _ in result["mc2_ops"]]
    comm_bound = [(kind, op, p) for kind, op, p, _ in result["mc2_ops"] if p.comm_bound]
    bound_exposed = sum(p.fused_us - p.matmul_us for _, _, p in comm_bound)
    bound_names = ", ".join(f"{kind} {op} ({p.matmul_us:.0f} µs matmul, {p.comm_us:.0f} µs comm)"
                            for kind, op, p in comm_bound)
    mc2_exposed = sum(p.fused_us - p.matmul_us for p in parts)
    best = min(share, key=share.get)
    verdict = (
        f"The best row, {best}, leaves {share[best]:.1%} exposed: "
        + ("the ≤ 10% goal is met" if share[best] <= GOAL else "the ≤ 10% goal is not met")
        + (f" and it is below Inductor's {share['inductor']:.0%}." if share[best] <= share["inductor"]
           else f", and it is above Inductor's {share['inductor']:.0%}.")
    )
    if share[best] > GOAL:
        verdict += " " + _lowest_candidates(result, comm_us)
    link_wait = sum(e.dur_us for t in timelines["mc2 + inductor"].values() for e in t.events
                    if e.name.startswith("link busy"))
    inductor_text = (
        f" Inductor's scheduler takes an MC2 op for plain compute: it issues the collectives left beside them ahead "
        f"of them, and the MC2 ops then wait {link_wait:.0f} µs for the link." if link_wait > 0 else "")
    declined = result["mc2_declined"]
    declined_text = (f" The rewrite declined {len(declined)} site(s): "
                     + "; ".join(sorted({d['reason'] for d in declined})) + "." if declined else "")
    return (
        f"Ours leaves {exposed['ours']:.0f} µs of {comm_us:.0f} µs comm exposed ({share['ours']:.0%}), Inductor "
        f"{exposed['inductor']:.0f} µs ({share['inductor']:.0%}). No order of these graphs can go below the "
        f"dependency limit, {floor:.0f} µs ({floor / comm_us:.0%}): in the forward, {dependency['forward']:.0f} "
        f"of its {fw.comm_us:.0f} µs comm sit on the layer's one chain (LN → all-gather → QKV → attention → proj → "
        f"reduce-scatter → LN → all-gather → fc1 → fc2 → reduce-scatter), with no independent compute beside "
        f"them.\n\n"
        f"MC2 changes the graph instead of its order: {len(parts)} all-gather → matmul and matmul → reduce-scatter "
        f"sites become one op each, which pipelines its collective with its matmul in one chunk per rank (the "
        f"cost model's estimate, `cost.mc2_cost`: the first chunk's comm and any comm longer than the matmul stay "
        f"exposed, and every chunk pays the link latency). That leaves {exposed['mc2']:.0f} µs "
        f"({share['mc2']:.0%}) exposed in the captured order, {exposed['mc2 + ours']:.0f} µs "
        f"({share['mc2 + ours']:.0%}) with our scheduler after it, {exposed['mc2 + inductor']:.0f} µs "
        f"({share['mc2 + inductor']:.0%}) with Inductor's; the MC2 graph's dependency limit is {mc2_floor:.0f} µs "
        f"({mc2_floor / comm_us:.0%}). Of the {mc2_exposed:.0f} µs the MC2 ops expose, {bound_exposed:.0f} µs come "
        f"from the {len(comm_bound)} comm-bound one(s), whose matmul is shorter than their collective "
        f"({bound_names or 'none'}), the rest from the pipelines' fill.{declined_text}{inductor_text} An MC2 op "
        f"holds the compute stream, so no order hides what it exposes; going lower needs finer chunks than one per "
        f"rank (each chunk pays the link latency again) or leaving sites to the scheduler where the graph has "
        f"independent compute beside them.\n\n{_chosen_text(result, comm_us)}\n\n{verdict}"
    )


def _beside(timeline: comm.Timeline, name: str) -> tuple[float, list[tuple[str, str, float]]]:
    """A collective's time on the link, and the compute that overlaps it: (node, op, µs), the most first."""
    (span,) = [e for e in timeline.events if e.stream == "comm" and e.name == name]
    end = span.start_us + span.dur_us
    over = [(e.name, e.op, min(end, e.start_us + e.dur_us) - max(span.start_us, e.start_us))
            for e in timeline.events if e.stream == "compute"]
    return span.dur_us, sorted([o for o in over if o[2] >= 1.0], key=lambda o: -o[2])


def _chosen_text(result: dict, comm_us: float) -> str:
    """What the MC2 stage chose, per graph, and where the collectives it left plain hide."""
    timelines, choices = result["timelines"], result["choices"]
    chosen = timelines[CHOSEN]
    total = _exposed(chosen)
    per_graph = "; ".join(
        f"{kind}: {c.chosen.label}, {len(c.sites) - len(c.chosen.left)} of {len(c.sites)} sites fused, "
        f"{c.chosen.exposed_comm_us:.1f} µs exposed" for kind, c in choices.items())
    hidden = []
    for kind, c in choices.items():
        for site in (s for s in c.sites if s in c.chosen.left):
            part = c.sites[site]
            if not any(e.stream == "comm" and e.name == site for e in chosen[kind].events):
                hidden.append(f"{kind} {site} (merged into a bucket)")
                continue
            dur, over = _beside(chosen[kind], site)
            spans = ", ".join(f"{name} ({op}) {us:.0f} µs" for name, op, us in over[:3]) or "no compute"
            hidden.append(f"{kind} {site} ({part.kind}, {part.matmul_us:.0f} µs matmul against {dur:.0f} µs comm) "
                          f"beside {spans}")
    not_taken = [d for _, d in result["chosen_not_taken"] if d["reason"].startswith("npu: MC2 not taken: ")]
    figures = "; ".join(f"{kind} {site}: {why[why.index('(') + 1:-1]}" for kind, c in choices.items()
                        for site, why in c.reasons.items())
    cdep = sum(result["chosen_dependency_limit_us"].values())
    return (
        f"The MC2 stage weighs, per graph, MC2 against leaving sites to our scheduler (mc2 chosen + ours: "
        f"`choose_mc2` simulates all MC2, no MC2, MC2 but the comm-bound sites, then flips one site at a time; "
        f"the least simulated time wins). It chooses {per_graph}. That leaves {total:.1f} µs of {comm_us:.0f} µs "
        f"comm exposed ({total / comm_us:.1%}), step {sum(t.total_us for t in chosen.values()):.1f} µs; the "
        f"chosen graphs' dependency limit is {cdep:.1f} µs ({cdep / comm_us:.1%}), a mix of plain and fused sites "
        f"being another graph than either above. "
        + (f"The collectives it leaves plain overlap: {'; '.join(hidden)}. The MC2 stage reports them in report.json "
           f"`unfused`, {len(not_taken)} entries for {len(hidden)} sites, as \"npu: MC2 not taken: the cost model "
           f"finds the graph faster with this collective left to the overlap scheduler (exposed X µs as MC2 vs Y µs "
           f"scheduled)\", the graph's exposed comm in the best candidate that fuses the site against the chosen "
           f"one's: {figures}." if hidden else "It leaves no site plain.")
    )


def _lowest_candidates(result: dict, comm_us: float) -> str:
    """The least exposed comm any candidate of the stage reaches, per graph, and what stays exposed in it."""
    parts, total = [], 0.0
    for kind, choice in result["choices"].items():
        low = min(choice.candidates, key=lambda c: (round(c.exposed_comm_us, 6), len(c.left)))
        total += low.exposed_comm_us
        fused = [s for s in choice.sites if s not in low.left]
        fill = sum(choice.sites[s].fused_us - choice.sites[s].matmul_us for s in fused if s not in choice.comm_bound)
        bound = [s for s in fused if s in choice.comm_bound]
        bound_us = sum(choice.sites[s].fused_us - choice.sites[s].matmul_us for s in bound)
        rest = low.exposed_comm_us - fill - bound_us
        alt = ""
        left_bound = [c for c in choice.candidates if c.left == frozenset(choice.comm_bound)]
        if bound and left_bound and left_bound[0] is not low:
            lb = left_bound[0]
            plain = lb.exposed_comm_us - sum(choice.sites[s].fused_us - choice.sites[s].matmul_us
                                             for s in choice.sites if s not in lb.left)
            plain_comm = sum(choice.sites[s].comm_us for s in bound)
            alt = (f" (left plain instead: {lb.exposed_comm_us:.1f} µs, {plain:.1f} of the plain collectives' "
                   f"{plain_comm:.1f} µs exposed"
                   + (", no independent compute beside them)" if plain >= plain_comm - 0.05 else ")"))
        parts.append(
            f"{kind} {low.exposed_comm_us:.1f} µs ({low.label}: {fill:.1f} µs of MC2 pipeline fill"
            + (f", {bound_us:.1f} µs from the comm-bound {', '.join(bound)}{alt}" if bound else "")
            + (f", {rest:.1f} µs from plain collectives" if rest > 0.05 else "") + ")")
    return (f"The least exposed comm any of the stage's candidates reaches is {total:.1f} µs ({total / comm_us:.1%}): "
            + "; ".join(parts) + ".")


def timeline_plot(result: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timelines = result["timelines"]
    colors = {"compute": "#4c72b0", "comm": "#dd8452", "exposed": "#c44e52", "mc2": "#8172b3"}
    fig, axes = plt.subplots(len(timelines), 1, figsize=(14, 1.6 * len(timelines) + 0.8), sharex=True)
    for ax, (name, by_kind) in zip(axes, timelines.items()):
        offset = 0.0
        for kind, t in by_kind.items():
            for stream, y in (("compute", 1), ("exposed", 1), ("comm", 0)):
                for color, mc2_op in ((colors[stream], False), (colors["mc2"], True)):
                    spans = [(offset + e.start_us, e.dur_us) for e in t.events
                             if e.stream == stream and (stream != "exposed" and e.op.startswith("npu.")) == mc2_op]
                    ax.broken_barh(spans, (y - 0.35, 0.7), facecolors=color, edgecolor="white", linewidth=0.3)
            ax.axvline(offset, color="black", linewidth=0.5)
            ax.text(offset + 5, 1.45, kind, fontsize=7, va="bottom")
            offset += t.total_us
        exposed = sum(t.exposed_comm_us for t in by_kind.values())
        ax.set_yticks([0, 1], ["comm", "compute"])
        ax.set_ylim(-0.6, 1.9)
        ax.set_title(f"{name}: step {offset:.0f} µs, exposed comm {exposed:.0f} µs", fontsize=9, loc="left")
    axes[-1].set_xlabel("µs (forward, then backward)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
    fig.legend(handles, ["compute", "comm", "compute waiting on comm", "MC2 op (matmul + its collective)"],
               loc="upper right", fontsize=8, ncol=4)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def header() -> str:
    profile = device.load()
    return (
        f"# Comm/compute overlap: one Megatron GPT layer, TP={TP} + SP\n\n"
        f"hidden {HIDDEN}, {HEADS} heads, seq {SEQ}, micro-batch {BATCH}, {str(DTYPE).removeprefix('torch.')}; "
        f"forward + backward of one layer on one rank. Costs: the npu_compile.device cost model, profile "
        f"`{profile.name}` (estimates: {profile.matrix_flops['bfloat16'] / 1e12:.0f} TFLOPS bf16 cube, "
        f"{profile.hbm_bytes_per_s / 1e12:.1f} TB/s HBM, HCCS {profile.link_bytes_per_s / 1e9:.0f} GB/s per link, "
        f"{profile.link_latency_us} µs per step, full-mesh collectives). Every row is scored by the same "
        f"simulator. Inductor: `schedule_overlap_bucketing` with our costs as `custom_runtime_estimation` "
        f"(and as its roofline), analytical estimators, its memory tracker counting these tensors, the same "
        f"{MAX_EXTRA_BYTES // 2**20} MiB memory cap as ours (its result is the same with its defaults, with "
        f"collective_bucketing=True, or with no cap). MC2 rows: the graphs rewritten by `rewrite_mc2` for target "
        f"npu-sim; an MC2 op is costed as its collective pipelined with its matmul, "
        f"{f'{profile.mc2_chunks} chunks' if profile.mc2_chunks else 'one chunk per rank'} (an estimate, "
        f"`cost.mc2_cost`), runs on the compute "
        f"stream holding the link, and counts fused − matmul as exposed comm. mc2 chosen + ours: the backend's "
        f"stages themselves (target npu-sim's MC2 stage, then `comm.overlap_stage`), which fuse the sites "
        f"`choose_mc2` picks by simulated time and schedule the rest with ours.\n"
    )


SOURCES = {
    "handmade": "Hand-made graphs: Megatron's SP layer with npu_compile's fused attention, each collective waited "
                "at once, in the order Megatron's autograd functions run.",
    "captured": "Captured graphs: Megatron's own TransformerLayer (local spec) captured by megatron_glue.capture.layer "
                "over the fake process group, as aot_autograd hands them over (no fusion rules: unfused attention; "
                "aot_autograd's CSE keeps the forward's gathered inputs, so the backward gathers only gradients).",
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--graph", default="captured,handmade",
                        help="comma-separated graph sources: captured (megatron_glue) and/or handmade")
    args = parser.parse_args(argv)
    sections = [header()]
    # The capture sets up the fake process group and Megatron's state itself, so it runs first.
    for source in sorted(args.graph.split(","), key=lambda s: s != "captured"):
        png = "overlap.png" if source == "handmade" else f"overlap_{source}.png"
        result = measure(GRAPHS[source]())
        timeline_plot(result, RESULTS / png)
        sections.append(
            f"## {source}\n\n{SOURCES[source]}\n\n{table(result)}\n\n{reading(result)}\n\n![{source}]({png})"
        )
    text = "\n\n".join(sections)
    write_result("overlap", text)
    print(text)


if __name__ == "__main__":
    main()
