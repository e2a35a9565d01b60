"""Every op npu-sim defines, and every torch_npu call in a lowered graph, binds to torch-npu 2.13.0's real schema,
read from the wheel's codegen yaml (tests/lowering/wheel.py fetches and caches the wheel)."""

import pytest
import torch

from npu_compile.lowering import npu_sim
from npu_compile.lowering.npu.schemas import MC2, SCHEMAS, TAGS

from .cases import CASES, run
from .wheel import assert_calls_bind, binding_problems, describe, real_schema, real_schemas

npu_sim.register()


@pytest.mark.parametrize("name", SCHEMAS)
def test_registered_op_is_the_real_schema(name):
    entry = real_schemas()[name]
    assert SCHEMAS[name] == entry["func"]  # verbatim
    registered = getattr(torch.ops.npu, name).default
    assert describe(registered._schema) == describe(real_schema(name))
    real_tags = {t.strip() for t in entry.get("tags", "").split(",") if t.strip()}
    assert real_tags == {t.name for t in TAGS.get(name, ())} and all(
        getattr(torch.Tag, t) in registered.tags for t in real_tags)


def test_every_call_in_the_lowered_graphs_binds():
    graphs = [gm for name in CASES for gm in run(name).graphs]
    assert_calls_bind(*graphs)
    called = {n.target._schema.name.split("::")[1] for gm in graphs for n in gm.graph.nodes
              if getattr(n.target, "namespace", None) == "npu"}
    # the cases reach every mapping the lowering has
    assert called == (set(npu_sim.KERNELS) - set(MC2)), (set(npu_sim.KERNELS) - set(MC2)) - called


def test_the_binding_check_is_not_vacuous():
    assert binding_problems("npu_rms_norm", (1, 2), {"eps": 1e-6})  # wrong types and an unknown keyword
    assert binding_problems("npu_fusion_attention_grad", (), {})  # required arguments missing
    assert binding_problems("npu_gelu", (None, "tanh"), {})  # approximate is keyword-only


# One case per lowering, at symbolic sizes: the calls still bind (a size is then a SymInt node), and the graph
# lowers to the same torch_npu ops as at static sizes.
DYNAMIC_CASES = ("attention_sbnd_causal_gqa", "attention_bnsd_mask_causal_bias", "rms_norm", "add_rms_norm",
                 "add_layer_norm", "bias_gelu_erf", "bias_gelu_fast_opt_in", "swiglu",
                 "rotary_interleave_partial_cos_grad")


def test_every_call_binds_at_symbolic_sizes():
    runs = {name: run(name, dynamic=True) for name in DYNAMIC_CASES}
    graphs = [gm for r in runs.values() for gm in r.graphs]
    assert any(isinstance(n.meta.get("val"), torch.SymInt) for gm in graphs for n in gm.graph.nodes)
    assert_calls_bind(*graphs)
    for name, r in runs.items():
        lowered = {op for op in r.report.lowered_ops if op.startswith("npu.")}
        assert lowered == set(CASES[name].lowered_to), (name, lowered)
        for got, want in zip([*r.outputs, *r.grads], [*r.expected_outputs, *r.expected_grads]):
            if want is not None:
                torch.testing.assert_close(got, want, rtol=CASES[name].tolerance, atol=CASES[name].tolerance)


def test_every_mc2_call_the_stage_emits_binds():
    """The MC2 stage's calls go through the same check: all-gather → mm, mm → reduce-scatter, addmm → all-reduce
    (Megatron's 3-D view → mm → view forms), rewritten by target npu-sim's stage over a fake 8-rank group."""
    import torch.distributed as dist
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from npu_compile import config, lowering
    from npu_compile.lowering.npu.schemas import MC2

    c10d = torch.ops._c10d_functional
    bf16 = torch.bfloat16
    dist.init_process_group("fake", rank=0, world_size=8, store=FakeStore())
    try:
        group = dist.group.WORLD.group_name

        def f(x, w_in, w_out, b, w_ar):
            full = c10d.wait_tensor(c10d.all_gather_into_tensor(x, 8, group))  # [s, b, h] gathered on s
            h = (full.view(-1, 512) @ w_in).view(32, 4, 512)
            scattered = c10d.wait_tensor(c10d.reduce_scatter_tensor(h.view(-1, 512) @ w_out, "sum", 8, group))
            reduced = c10d.wait_tensor(c10d.all_reduce(torch.addmm(b, scattered, w_ar), "sum", group))
            return reduced

        empty = lambda *shape: torch.empty(*shape, dtype=bf16)  # noqa: E731
        gm = make_fx(f, tracing_mode="fake")(empty(4, 4, 512), empty(512, 512), empty(512, 512), empty(256),
                                             empty(512, 256))
        target = lowering.target("npu-sim")
        target.prepare()
        opts = config.Options(target="npu-sim", overlap=False)  # every site within the constraints is fused
        unfused = [e for _, stage in target.stages for e in stage(gm, opts, "forward") or []]
    finally:
        dist.destroy_process_group()
    assert unfused == []
    assert_calls_bind(gm)
    called = {n.target._schema.name.split("::")[1] for n in gm.graph.nodes
              if getattr(n.target, "namespace", None) == "npu"}
    assert called == set(MC2)
