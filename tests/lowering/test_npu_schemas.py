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
DYNAMIC_CASES = ("attention_sbnd_causal_gqa", "attention_bnsd_mask_causal_bias", "attention_lse_sbnd_causal_gqa",
                 "rms_norm", "add_rms_norm",
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

