"""MC2 rewrite (npu_compile/lowering/npu/mc2.py) and its npu-sim emulation over a real 2-process gloo group.

One spawn runs every case: aten graphs (make_fx of functional collectives) with all-gather → mm,
mm → reduce-scatter and mm / addmm → all-reduce, 2-D and Megatron's 3-D view → mm → view form, rewritten for
npu-sim and run against the unrewritten graph; sites outside torch_npu's constraints (k < 256, fp32) declined
with reasons; and a module compiled end to end with backend="ascend", target npu-sim, forward and backward."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.multiprocessing as mp
from torch.fx.experimental.proxy_tensor import make_fx

from npu_compile.lowering.npu import mc2
from npu_compile.lowering.npu_sim import c10d_group_name as HCOM  # npu-sim's communicator names

WORLD = 2
BF16 = torch.bfloat16


def _graph(f, *inputs):
    return make_fx(f, tracing_mode="fake")(*inputs)


def _ops(gm):
    return [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]


def _case(f, inputs, expect_op, declined=None):
    """Rewrite make_fx(f) for npu-sim; it must hold ``expect_op`` (or decline with ``declined`` in the reason)
    and give exactly what the unrewritten graph gives."""
    want = _graph(f, *inputs)(*inputs)
    gm = _graph(f, *inputs)
    unfused = mc2.rewrite_mc2(gm, HCOM)
    ops = _ops(gm)
    if declined is None:
        assert unfused == [], unfused
        assert f"npu.{expect_op}.default" in ops, ops
        assert not any("_c10d_functional" in o for o in ops), ops
    else:
        assert len(unfused) == 1 and declined in unfused[0]["reason"], unfused
        assert unfused[0]["op"] == f"npu.{expect_op}"
        assert not any(o.startswith("npu.") for o in ops), ops
    got = gm(*inputs)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def graph_cases(rank, group):
    g = torch.Generator().manual_seed(rank)
    r = lambda *s, dtype=BF16: torch.randn(*s, generator=g).to(dtype)  # noqa: E731
    w = torch.randn(256, 64, generator=torch.Generator().manual_seed(7)).to(BF16)  # same on every rank

    # all-gather → mm (2-D), and the gathered tensor also read elsewhere (gather_out)
    _case(lambda x, w: funcol.all_gather_single(x, 0, group) @ w, [r(8, 256), w], "npu_all_gather_base_mm")

    def ag_also_read(x, w):
        full = funcol.all_gather_single(x, 0, group)
        return full @ w, full.sum(0)
    _case(ag_also_read, [r(8, 256), w], "npu_all_gather_base_mm")

    # Megatron SP: [s/tp, b, h] gathered on s, then view → mm → view
    _case(lambda x, w: torch.nn.functional.linear(funcol.all_gather_single(x, 0, group), w.t()),
          [r(4, 2, 256), w], "npu_all_gather_base_mm")

    # mm → reduce-scatter, 2-D and 3-D (Megatron's row-parallel with SP)
    _case(lambda x, w: funcol.reduce_scatter_tensor(x @ w, "sum", 0, group), [r(8, 256), w],
          "npu_mm_reduce_scatter_base")
    _case(lambda x, w: funcol.reduce_scatter_tensor(torch.nn.functional.linear(x, w.t()), "sum", 0, group),
          [r(4, 2, 256), w], "npu_mm_reduce_scatter_base")

    # mm → all-reduce, with a bias added on each rank before the reduce (addmm), and 3-D
    _case(lambda x, w: funcol.all_reduce(x @ w, "sum", group), [r(8, 256), w], "npu_mm_all_reduce_base")
    _case(lambda x, w, b: funcol.all_reduce(torch.addmm(b, x, w), "sum", group), [r(8, 256), w, r(64)],
          "npu_mm_all_reduce_base")
    _case(lambda x, w: funcol.all_reduce(torch.nn.functional.linear(x, w.t()), "sum", group), [r(4, 2, 256), w],
          "npu_mm_all_reduce_base")

    # declined: k < 256 (AG and RS), fp32 (all three), bias on a reduce-scatter
    w128 = r(128, 64)
    _case(lambda x, w: funcol.all_gather_single(x, 0, group) @ w, [r(8, 128), w128], "npu_all_gather_base_mm",
          declined="k must be in [256, 65535), got 128")
    _case(lambda x, w: funcol.reduce_scatter_tensor(x @ w, "sum", 0, group), [r(8, 128), w128],
          "npu_mm_reduce_scatter_base", declined="k must be in [256, 65535), got 128")
    _case(lambda x, w: funcol.all_reduce(x @ w, "sum", group), [r(8, 256, dtype=torch.float32), w.float()],
          "npu_mm_all_reduce_base", declined="float16 or bfloat16")
    _case(lambda x, w: funcol.all_gather_single(x, 0, group) @ w, [r(8, 256, dtype=torch.float32), w.float()],
          "npu_all_gather_base_mm", declined="float16 or bfloat16")
    _case(lambda x, w, b: funcol.reduce_scatter_tensor(torch.addmm(b, x, w), "sum", 0, group),
          [r(8, 256), w, r(64)], "npu_mm_reduce_scatter_base", declined="bias is not supported")


class _TensorParallelMLP(torch.nn.Module):
    """Megatron TP=2 + SP MLP: all-gather(s) → column-parallel fc1 → gelu → row-parallel fc2 → reduce-scatter(s)."""

    def __init__(self, group):
        super().__init__()
        self.group = group
        gen = torch.Generator().manual_seed(3 + dist.get_rank())
        self.fc1 = torch.nn.Parameter(torch.randn(512, 256, generator=gen).to(BF16) * 0.05)
        self.fc2 = torch.nn.Parameter(torch.randn(256, 512, generator=gen).to(BF16) * 0.05)

    def forward(self, x):
        full = funcol.all_gather_single(x, 0, self.group)
        h = torch.nn.functional.gelu(torch.nn.functional.linear(full, self.fc1))
        return funcol.reduce_scatter_tensor(torch.nn.functional.linear(h, self.fc2), "sum", 0, self.group)


def compiled_case(rank, group, overlap, dynamic=False):
    """Without the overlap stage, lowering fuses every site; with it (the default), the stage's cost model leaves
    these tiny sites plain (each chunk of an MC2 op pays the link latency again) and says so once per site.
    ``dynamic``: the sequence dim is marked dynamic, and the one graph runs a second length too."""
    from npu_compile.debug.report import collect

    m = _TensorParallelMLP(group)
    torch._dynamo.reset()
    with collect() as reports:
        cm = torch.compile(m, backend="ascend", options={"target": "npu-sim", "overlap": overlap}, fullgraph=True)
        for s in ((6, 4) if dynamic else (4,)):
            x = torch.randn(s, 2, 256, generator=torch.Generator().manual_seed(10 + rank)).to(BF16)
            m.zero_grad()
            xc = x.clone().requires_grad_()
            if dynamic:
                torch._dynamo.mark_dynamic(xc, 0)
            got = cm(xc)
            got.float().square().sum().backward()
    got_grads = [xc.grad] + [p.grad.clone() for p in m.parameters()]
    m.zero_grad()
    xe = x.clone().requires_grad_()
    want = m(xe)
    want.float().square().sum().backward()
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    for g, w in zip(got_grads, [xe.grad] + [p.grad for p in m.parameters()]):
        torch.testing.assert_close(g, w, rtol=1e-2, atol=1e-2)
    (report,) = reports
    ops = report.lowered_ops
    if not overlap:
        # forward: AG → fc1, fc2 → RS; backward: AG(grad) → fc2ᵀ, fc1ᵀ → RS (the weight grads read gather_out)
        assert ops.get("npu.npu_all_gather_base_mm", 0) == 2, ops
        assert ops.get("npu.npu_mm_reduce_scatter_base", 0) == 2, ops
        assert not any(k.startswith("_c10d_functional") for k in ops), ops
        assert report.unfused == [], report.unfused
        return
    assert not any(k.startswith("npu.npu_") and "mm" in k for k in ops), ops
    assert (ops.get("_c10d_functional.all_gather_into_tensor", 0), ops.get("_c10d_functional.reduce_scatter_tensor", 0)
            ) == (2, 2), ops
    assert report.unfused == TINY_SITES_NOT_TAKEN, report.unfused


# The stage's reasons for the MLP's four sites (forward, then backward), on the default profile over 2 ranks.
def _not_taken(op, mc2_us, plain_us):
    return {"op": f"npu.{op}", "reason": "npu: MC2 not taken: the cost model finds the graph faster with this "
                                         f"collective left to the overlap scheduler (exposed {mc2_us} µs as MC2 vs "
                                         f"{plain_us} µs scheduled)"}


TINY_SITES_NOT_TAKEN = [
    _not_taken(mc2.OP_AG, "6.1", "4.1"), _not_taken(mc2.OP_RS, "6.1", "4.1"),  # forward: MC2 on either site
    _not_taken(mc2.OP_AG, "5.7", "3.8"), _not_taken(mc2.OP_RS, "6.0", "3.8"),  # backward: the best with one fused
]


PROFILE = {  # slow matmuls and links, so that tensors a CPU multiplies at once cost like a layer's
    "matrix_flops": {"bfloat16": 1e9}, "vector_flops": {"bfloat16": 1e15}, "hbm_bytes_per_s": 1e15,
    "link_bytes_per_s": 1.5e6, "link_latency_us": 0.0,
}


def chosen_case(rank, group):
    """The overlap stage's choice over 2 ranks: all-gather → mm1 is comm-bound (2097 µs matmul, 2731 µs gather) with
    y @ wy (4194 µs) beside it, so it stays plain and hides; the gather of mm1's output before mm2 (16777 µs) is
    fused. As MC2 the first site would expose 1365.3 + 1048.6 + 1365.3 − 2097.2 = 1682.1 µs. The chosen graph gives
    exactly what the unrewritten one gives."""
    from npu_compile import config
    from npu_compile.comm import overlap_stage, simulate

    c10d = torch.ops._c10d_functional

    def f(x, w1, w2, y, wy):
        h = c10d.wait_tensor(c10d.all_gather_into_tensor(x, WORLD, group)) @ w1  # [16, 256]
        return c10d.wait_tensor(c10d.all_gather_into_tensor(h.view(8, 512), WORLD, group)) @ w2, y @ wy

    g = torch.Generator().manual_seed(20 + rank)
    inputs = [torch.randn(*s, generator=g).to(BF16) for s in ((8, 256), (256, 256), (512, 1024), (16, 256), (256, 512))]
    want = _graph(f, *inputs)(*inputs)
    gm = _graph(f, *inputs)
    opts = config.Options(target="npu-sim", overlap=True)
    unfused = mc2.mc2_stage(gm, opts, "forward", hcom=HCOM, profile=PROFILE)
    overlap_stage(gm, opts, "forward", profile=PROFILE)
    ops = _ops(gm)
    plain, fused = "_c10d_functional.all_gather_into_tensor.default", "npu.npu_all_gather_base_mm.default"
    assert (ops.count(plain), ops.count(fused)) == (1, 1), ops
    t = simulate(gm, PROFILE)
    chunk = 16 * 512 * 2 / 2 / (2 * 1.5e6) * 1e6  # half of the second gather: 2730.67 µs, the MC2 op's fill
    assert (t.collectives, t.mc2) == (1, 1) and abs(t.exposed_comm_us - chunk) < 1e-6, t.summary()
    assert unfused == [{"op": "npu.npu_all_gather_base_mm", "reason": (
        "npu: MC2 not taken: the cost model finds the graph faster with this collective left to the overlap "
        "scheduler (exposed 4412.8 µs as MC2 vs 2730.7 µs scheduled)")}], unfused
    torch.testing.assert_close(gm(*inputs), want, rtol=0, atol=0)


def worker(rank, store_path):
    os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
    store = dist.FileStore(store_path, WORLD)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD)
    try:
        from npu_compile.lowering import npu_sim

        npu_sim.register()
        group = dist.group.WORLD.group_name
        graph_cases(rank, group)
        chosen_case(rank, group)
        compiled_case(rank, group, overlap=False)
        compiled_case(rank, group, overlap=False, dynamic=True)
        compiled_case(rank, group, overlap=True)
    finally:
        dist.destroy_process_group()


@pytest.mark.gloo
def test_mc2_rewrite_and_emulation_over_gloo(tmp_path):
    mp.spawn(worker, args=(str(tmp_path / "store"),), nprocs=WORLD, join=True)


# ---- option mc2 on a TP=2 + SP graph, as report.json says (a fake group of 2: compiled, not communicating) ------

SITES = {"npu.npu_all_gather_base_mm": 2, "npu.npu_mm_reduce_scatter_base": 2}  # forward and backward, each
PLAIN = {"_c10d_functional.all_gather_into_tensor": 2, "_c10d_functional.reduce_scatter_tensor": 2}
SWITCHED_OFF = [{"op": f"npu.{op}", "reason": "npu: MC2 not taken: switched off by options['mc2']"}
                for op in (mc2.OP_AG, mc2.OP_RS, mc2.OP_AG, mc2.OP_RS)]


@pytest.mark.parametrize("mode, overlap, fused, unfused", [
    ("auto", True, {}, TINY_SITES_NOT_TAKEN),  # the cost model leaves these tiny sites to the overlap scheduler
    ("on", True, SITES, []),  # every site, whatever the cost model finds (--use-ascend-mc2)
    ("off", True, {}, SWITCHED_OFF),
    ("auto", False, SITES, []),  # no overlap scheduler to leave a collective to: every site
    ("off", False, {}, SWITCHED_OFF),
])
def test_option_mc2_on_a_tensor_and_sequence_parallel_mlp(mode, overlap, fused, unfused, tmp_path):
    import json

    from megatron_glue.capture.testing import fake_process_group
    from npu_compile.lowering import npu_sim

    npu_sim.register()
    torch._dynamo.reset()
    with fake_process_group(WORLD) as group:
        m = _TensorParallelMLP(group.group_name)
        cm = torch.compile(m, backend="ascend", fullgraph=True, options={
            "target": "npu-sim", "mc2": mode, "overlap": overlap, "dump_dir": str(tmp_path)})
        x = torch.randn(4, 2, 256).to(BF16).requires_grad_()
        cm(x).float().square().sum().backward()
    (path,) = tmp_path.glob("*/report.json")
    report = json.loads(path.read_text())
    ops = report["lowered_ops"]
    assert {k: v for k, v in ops.items() if k in SITES} == fused, ops
    assert {k: v for k, v in ops.items() if k in PLAIN} == ({} if fused else PLAIN), ops
    assert report["unfused"] == unfused


# ---- constraint checks, directly (no process group needed) -------------------------------------------------

def _t(*shape, dtype=BF16):
    return torch.empty(*shape, dtype=dtype)


@pytest.mark.parametrize("op", [mc2.OP_AG, mc2.OP_RS])
def test_all_gather_and_reduce_scatter_constraints(op):
    assert mc2.check_ag_rs(op, _t(8, 256), _t(256, 64), 2) is None
    assert mc2.check_ag_rs(op, _t(8, 65534), _t(65534, 64), 8) is None
    assert "world size must be 2, 4 or 8, got 3" in mc2.check_ag_rs(op, _t(9, 256), _t(256, 64), 3)
    assert "got 16" in mc2.check_ag_rs(op, _t(16, 256), _t(256, 64), 16)
    assert "k must be in [256, 65535), got 255" in mc2.check_ag_rs(op, _t(8, 255), _t(255, 64), 2)
    assert "got 65535" in mc2.check_ag_rs(op, _t(8, 65535), _t(65535, 64), 2)
    assert "float16 or bfloat16" in mc2.check_ag_rs(op, _t(8, 256, dtype=torch.float32), _t(256, 64), 2)
    assert "x1's dtype" in mc2.check_ag_rs(op, _t(8, 256), _t(256, 64, dtype=torch.float16), 2)
    assert "2-D" in mc2.check_ag_rs(op, _t(2, 4, 256), _t(256, 64), 2)
    assert "bias" in mc2.check_ag_rs(op, _t(8, 256), _t(256, 64), 2, bias=_t(64))
    assert "transposed" in mc2.check_ag_rs(op, _t(256, 8).t(), _t(256, 64), 2)
    assert mc2.check_ag_rs(op, _t(8, 256), _t(64, 256).t(), 2) is None  # x2 may be transposed


def test_reduce_scatter_needs_m_divisible_by_world_size():
    assert "m must be divisible" in mc2.check_ag_rs(mc2.OP_RS, _t(6, 256), _t(256, 64), 4)
    assert mc2.check_ag_rs(mc2.OP_AG, _t(6, 256), _t(256, 64), 4) is None  # the gathered m is 24


def test_all_reduce_constraints():
    assert mc2.check_ar(_t(8, 64), _t(64, 32), 2) is None  # no k limit documented for mm_all_reduce
    assert mc2.check_ar(_t(2, 8, 64), _t(64, 32), 8, bias=_t(32)) is None
    assert "1, 2, 4 or 8, got 3" in mc2.check_ar(_t(8, 64), _t(64, 32), 3)
    assert "reduce_op must be 'sum'" in mc2.check_ar(_t(8, 64), _t(64, 32), 2, reduce_op="max")
    assert "bias must be 1-D of size n = 32" in mc2.check_ar(_t(8, 64), _t(64, 32), 2, bias=_t(8, 32))
    assert "bias must have x1's dtype" in mc2.check_ar(_t(8, 64), _t(64, 32), 2, bias=_t(32, dtype=torch.float32))
    assert "2-D or 3-D" in mc2.check_ar(_t(1, 2, 8, 64), _t(64, 32), 2)
    assert "float16 or bfloat16" in mc2.check_ar(_t(8, 64, dtype=torch.float32), _t(64, 32), 2)


def test_no_collectives_no_change():
    gm = _graph(lambda x, w: x @ w, _t(8, 256), _t(256, 64))
    before = _ops(gm)
    assert mc2.rewrite_mc2(gm, HCOM) == [] and _ops(gm) == before
