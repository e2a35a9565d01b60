"""torch.compile(gpt_model, backend="ascend") after megatron_glue.adapt(), whose "layer_frames" group leaves the
TransformerBlock's loop to Python: each layer is a frame of its own, compiled once for every layer of its
structure, so the number of graphs does not grow with the layers; training equals eager (losses and every
gradient). At TP > 1 or with MoE layers the block is inlined: one graph."""

import pytest
import torch

from megatron_glue.capture.adaptations import groups_for, registry
from megatron_glue.capture.models import build_gpt_model, gpt_config, llama_config, synthetic_batch
from npu_compile.debug.report import collect
from whole_model import BATCH, SEQ, VOCAB
from whole_model import assert_moe_gpt_is_whole_and_trains_as_eager, groups_applied
from whole_model import assert_same as _assert_same
from whole_model import train as _train


@pytest.fixture
def layer_frames(megatron_cpu, fresh_dynamo):
    """The "layer_frames" group applied for the test, taken off after it (the session keeps "cpu" and "compile")."""
    with groups_applied("layer_frames"):
        yield


def test_the_default_groups_take_layer_frames_and_one_graph_takes_regions():
    assert "layer_frames" in groups_for() and "regions" not in groups_for()
    assert "regions" in groups_for(one_graph=True) and "layer_frames" not in groups_for(one_graph=True)
    training = groups_for(training=True)
    assert "layer_frames" not in training and "regions" not in training


@pytest.mark.parametrize("layers", [2, 4])
@pytest.mark.parametrize("make", [gpt_config, llama_config], ids=["gpt", "llama"])
def test_each_layer_is_one_frame_compiled_once_and_trains_as_eager(layer_frames, make, layers, tmp_path):
    config = lambda: make(hidden_size=64, num_layers=layers,  # noqa: E731
                          **({"num_query_groups": 2} if make is llama_config else {}))
    eager = build_gpt_model(config(), VOCAB, SEQ, seed=0)
    model = build_gpt_model(config(), VOCAB, SEQ, seed=0)
    expected = _train(eager, eager)
    torch._dynamo.utils.counters.clear()
    with collect() as reports:
        got = _train(torch.compile(model, backend="ascend", options={"dump_dir": str(tmp_path)}), model)
    _assert_same(expected, got)
    # the same graphs at 2 and 4 layers: the embedding's, the layer's, the output layer's with the loss (and the
    # rotary table's, computed without grad), none compiled again for a later layer or step
    counters = torch._dynamo.utils.counters
    assert counters["stats"]["unique_graphs"] == len(reports) == 4, [r.graph_id for r in reports]
    assert not counters["recompiles"]
    (layer,) = [r for r in reports if r.fusions["attention"]]
    assert layer.reused_by == layers and layer.fusions["attention"] == 1
    assert layer.graphs == ["forward", "backward"]
    assert f'"reused_by": {layers}' in (tmp_path / layer.graph_id / "report.json").read_text()
    # the graph break is the block's frame, left to Python; the layers' own frames have none
    assert layer.graph_breaks == 0
    assert sum(r.graph_breaks for r in reports) == 1


def test_moe_blocks_are_inlined_as_one_graph(layer_frames):
    """An MoE router reads its layer_number, on which a frame of its own would guard (a recompile per layer): the
    block is traced whole, as without the group."""
    assert_moe_gpt_is_whole_and_trains_as_eager("allgather", graphs=1)


def test_taken_off_the_block_is_traced_whole_again(layer_frames):
    registry.revert("block_layers_as_frames")
    model = build_gpt_model(gpt_config(hidden_size=64, num_layers=2), VOCAB, SEQ, seed=0)
    torch._dynamo.utils.counters.clear()
    torch.compile(model, backend="aot_eager")(**synthetic_batch(BATCH, SEQ, VOCAB, seed=0)).mean().backward()
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    assert not torch._dynamo.utils.counters["graph_break"]


def test_the_whole_models_warm_start_entry_says_it_needs_one_graph(layer_frames, tmp_path, monkeypatch, caplog):
    """npu_compile.precompile stores a frame captured whole; with the layers as frames of their own the model's
    frame breaks at the block, so it runs under plain torch.compile and the marker names the adaptation and what
    gives one graph."""
    import logging

    from npu_compile import cache, precompile

    monkeypatch.setenv(cache.CACHE_DIR_ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(precompile, "_artifacts", {})
    monkeypatch.setattr(precompile, "counts", type(precompile.counts)())
    model = build_gpt_model(gpt_config(hidden_size=64, num_layers=2), VOCAB, SEQ, seed=0)
    eager = build_gpt_model(gpt_config(hidden_size=64, num_layers=2), VOCAB, SEQ, seed=0)
    with caplog.at_level(logging.INFO, logger="npu_compile"):
        got = _train(precompile.compile(model, {"cache": True}), model, steps=1)
    assert precompile.counts["fallback"] == 1 and not precompile.counts["stored"]
    (marker,) = (tmp_path / "cache" / "precompiled").rglob(precompile._FALLBACK)
    assert "'block_layers_as_frames' (group 'layer_frames')" in marker.read_text()
    assert "megatron_glue.adapt(groups_for(one_graph=True))" in marker.read_text()
    assert "GPTModel.forward runs under plain torch.compile" in caplog.text
    _assert_same(_train(eager, eager, steps=1), got)


def test_fullgraph_is_refused_with_what_gives_one_graph(layer_frames):
    model = build_gpt_model(gpt_config(hidden_size=64, num_layers=2), VOCAB, SEQ, seed=0)
    with pytest.raises(torch._dynamo.exc.Unsupported) as refused:
        torch.compile(model, backend="aot_eager", fullgraph=True)(**synthetic_batch(BATCH, SEQ, VOCAB, seed=0))
    assert ("adaptation 'block_layers_as_frames' (group 'layer_frames'): each layer is compiled as a frame of its "
            "own; for one graph, megatron_glue.adapt(groups_for(one_graph=True)) in a fresh process"
            ) in str(refused.value)



def test_the_blocks_frame_is_skipped_without_a_callback_so_guards_can_be_skipped(layer_frames):
    """The block's own frame is marked skipped once (a code object of the adaptation's own): Dynamo's callback never
    sees it again, so after the first step the steps run under set_stance(skip_guard_eval_unsafe=True), which
    refuses any frame handed to the callback as a recompile; they train as eager."""
    import contextlib

    def train(model, compiled):
        opt, history = torch.optim.SGD(model.parameters(), lr=0.1), []
        for step in range(3):
            opt.zero_grad(set_to_none=True)
            stance = torch.compiler.set_stance("default", skip_guard_eval_unsafe=True) if step else \
                contextlib.nullcontext()
            with stance:
                out = compiled(**synthetic_batch(BATCH, SEQ, VOCAB, seed=step))
                out.mean().backward()
            history.append((out.detach().clone(), {n: p.grad.clone() for n, p in model.named_parameters()}))
            opt.step()
        return history

    eager = build_gpt_model(gpt_config(hidden_size=64, num_layers=2), VOCAB, SEQ, seed=0)
    model = build_gpt_model(gpt_config(hidden_size=64, num_layers=2), VOCAB, SEQ, seed=0)
    _assert_same(train(eager, eager), train(model, torch.compile(model, backend="ascend")))
