"""torch.compile(gpt_model, backend="ascend") with megatron_glue's "regions" group: the transformer layers are one
nested compile region, traced and compiled once, and training still equals eager (losses and every gradient)."""

import json
from unittest import mock

import pytest
import torch
import torch._dynamo.variables.invoke_subgraph as dynamo_regions

from megatron_glue.capture.adaptations import registry
from megatron_glue.capture.models import build_gpt_model, gpt_config, llama_config, synthetic_batch
from npu_compile.debug.report import collect
from whole_model import BATCH, SEQ, VOCAB
from whole_model import assert_moe_gpt_is_whole_and_trains_as_eager, groups_applied
from whole_model import assert_same as _assert_same
from whole_model import train as _train

LAYERS = 3
# Dynamo's timer around each reuse of a traced region (torch/_dynamo/variables/invoke_subgraph.py)
REUSE = "invoke_subgraph_reuse_stamp_out"
CONFIGS = {
    "gpt": lambda **kw: gpt_config(hidden_size=64, num_layers=LAYERS, **kw),
    "llama": lambda **kw: llama_config(hidden_size=64, num_layers=LAYERS, num_query_groups=2, **kw),
}


@pytest.fixture
def regions(megatron_cpu, fresh_dynamo):
    """The "regions" group applied for the test, taken off after it (the session keeps "cpu" and "compile")."""
    with groups_applied("regions"):
        yield


def _compiled(model, tmp_path, warm=False):
    compiled = torch.compile(model, backend="ascend", options={"dump_dir": str(tmp_path), "cache": False})
    if warm:  # compile here: compiling draws from torch's generator too (tracing rules' example inputs)
        compiled(**synthetic_batch(BATCH, SEQ, VOCAB, seed=99)).mean().backward()
        model.zero_grad(set_to_none=True)
    return compiled


@pytest.mark.parametrize("name", CONFIGS)
def test_layers_compile_once_and_train_as_eager(regions, name, tmp_path):
    eager = build_gpt_model(CONFIGS[name](), VOCAB, SEQ, seed=0)
    model = build_gpt_model(CONFIGS[name](), VOCAB, SEQ, seed=0)
    expected = _train(eager, eager)
    torch._dynamo.utils.counters.clear()
    torch._dynamo.utils.compilation_time_metrics.pop(REUSE, None)
    with collect() as reports, mock.patch.object(dynamo_regions, "build_fingerprint_with_pytree",
                                                 wraps=dynamo_regions.build_fingerprint_with_pytree) as flatten:
        got = _train(_compiled(model, tmp_path), model)
    # Dynamo traced the first layer and stamped it out for the others, rather than tracing each layer again
    assert len(torch._dynamo.utils.compilation_time_metrics.get(REUSE, [])) == LAYERS - 1
    # each reuse fingerprinted the layer's arguments as flat leaves, without tracing pytree.tree_flatten over them
    assert flatten.call_count == 0

    _assert_same(expected, got)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    (report,) = reports
    assert report.graph_breaks == 0 and report.graphs == ["forward", "backward"]
    # one region for the N layers: its rules ran once, and report.json counts them per call
    assert len(report.regions) == 1, report.regions
    ((region_name, region),) = report.regions.items()
    assert region["calls"] == LAYERS
    assert region["fusions"]["attention"] == 1
    assert report.fusions["attention"] == LAYERS
    on_disk = json.loads((tmp_path / "0_0" / "report.json").read_text())
    assert on_disk["regions"] == report.regions and on_disk["fusions"] == report.fusions
    # the region's forward and backward are lowered once each, and run at every call
    assert report.lowered_ops["higher_order.invoke_subgraph"] == 2 * LAYERS
    assert report.lowered_ops["npu_compile.fused_attention"] == LAYERS
    assert report.lowered_ops["npu_compile.fused_attention_backward"] == LAYERS
    lowered = sorted(p.name.split("_", 1)[1] for p in (tmp_path / "0_0" / "regions").glob("*_lowered_*"))
    assert lowered == [f"{region_name}_backward_lowered_reference.py", f"{region_name}_forward_lowered_reference.py"]


def test_with_dropout_the_regions_train_as_eager_within_its_band(regions):
    """With dropout the fused ops draw other masks than eager, so losses are compared as a band, as
    passes/test_dropout_add.py does for the whole model (2 % per step; two eager seeds differ by up to 0.5 %)."""
    config = CONFIGS["gpt"](hidden_dropout=0.1, attention_dropout=0.1)
    batch = synthetic_batch(BATCH, SEQ, VOCAB, seed=0)

    def train(model, steps=5):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        losses = []
        for _ in range(steps):
            opt.zero_grad(set_to_none=True)
            loss = model(**batch).mean()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses

    torch.manual_seed(0)
    eager = train(build_gpt_model(config, VOCAB, SEQ, seed=0))
    with collect() as reports:
        compiled = train(torch.compile(build_gpt_model(config, VOCAB, SEQ, seed=0), backend="ascend",
                                       options={"cache": False}))
    (report,) = reports
    ((_, region),) = report.regions.items()
    assert region["calls"] == LAYERS and region["fusions"]["attention"] == 1
    assert report.fusions["attention"] == LAYERS and report.fusions["bias_dropout_add"] == 2 * LAYERS
    # the seeds of the fused dropouts are drawn in the region, once per call: 3 draws per layer
    assert report.lowered_ops["aten.randint"] == 3 * LAYERS
    assert compiled[-1] < compiled[0] - 0.1, compiled
    worst = max(abs(c - e) / e for c, e in zip(compiled, eager))
    assert worst < 0.02, (eager, compiled)


@pytest.mark.skipif(not registry.applies("linear_impl_by_weight_0_13_ColumnParallelLinear"),
                    reason="megatron-core >= 0.14 chooses its linear function in a method, without a store")
def test_a_frozen_weight_still_takes_the_frozen_linear_under_the_descriptor(regions):
    # 0.12/0.13 store the choice per call; the descriptor keeps the choice (what backward computes) and drops the
    # store: a frozen weight gets no gradient, the input still does
    from megatron.core.tensor_parallel import layers

    model = build_gpt_model(CONFIGS["gpt"](), VOCAB, SEQ, seed=0)
    linear = model.decoder.layers[0].self_attention.linear_qkv
    linear.weight.requires_grad_(False)
    x = torch.randn(SEQ, BATCH, 64, requires_grad=True)
    out, _ = linear(x)
    out.sum().backward()
    assert linear.weight.grad is None and x.grad is not None
    assert linear._forward_impl is not layers.linear_with_frozen_weight  # the dispatching function, not a store
    with pytest.raises(AttributeError, match=r"ColumnParallelLinear._forward_impl is chosen per call from the "
                                             r"weight \(adaptation 'linear_impl_by_weight_0_13_ColumnParallelLinear'"):
        linear._forward_impl = print


@pytest.mark.parametrize("dispatcher,graphs", [("allgather", 1), ("alltoall", 2)])
def test_moe_layers_are_inlined_and_train_as_eager(regions, dispatcher, graphs):
    """An MoE layer is no region: its token dispatcher keeps one call's tensors on itself, which Dynamo cannot take
    out of a region ("an intermediate tensor ... aliases an input or output"); inlined, the whole MoE GPT is one
    graph with the aux loss on (alltoall: a second once the dispatcher's cuda_sync_point, set by its first call,
    is read as set) and trains as eager."""
    assert_moe_gpt_is_whole_and_trains_as_eager(dispatcher, graphs)
