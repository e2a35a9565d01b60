"""compile_model on a GPT of identical layers: the layer graph is compiled once and run by every layer (no
recompile, report.json reused_by = the layer count), the loss fused with the output layer, with losses and grads
equal to the model run eagerly."""

import types

import pytest
import torch
from torch._dynamo.utils import counters

from megatron_glue.capture.models import build_gpt_model, gpt_config, synthetic_batch
from megatron_glue.training.training import compile_model
from npu_compile.debug.report import collect

pytestmark = pytest.mark.filterwarnings("ignore:Dynamo detected a call to a `functools.lru_cache`")

VOCAB, SEQ, LAYERS = 128, 16, 4


def test_identical_layers_compile_once_and_equal_eager(megatron_cpu, fresh_dynamo, tmp_path):
    config = gpt_config(hidden_size=32, num_attention_heads=4, num_layers=LAYERS)
    eager = build_gpt_model(config, VOCAB, SEQ, seed=0)
    model = build_gpt_model(config, VOCAB, SEQ, seed=0)
    compile_model(model, types.SimpleNamespace(npu_compile_options={"dump_dir": str(tmp_path)}))
    counters.clear()
    batch = synthetic_batch(2, SEQ, VOCAB)
    with collect() as reports:
        loss = model(**batch)
        loss.mean().backward()
    expected = eager(**batch)
    expected.mean().backward()

    # embedding, one layer graph, output layer with the loss: three graphs whatever the layer count
    assert len(reports) == 3, [r.graph_id for r in reports]
    # megatron-core 0.16 runs the output layer and the loss in GPTModel._postprocess: compiled, the loss fuses
    fused = [r for r in reports if r.fusions.get("vocab_parallel_cross_entropy")]
    assert len(fused) == hasattr(model, "_postprocess"), [r.fusions for r in reports]
    assert counters["stats"]["unique_graphs"] == 3 and not counters["recompiles"]
    by_users = sorted(r.reused_by for r in reports)
    assert by_users == [1, 1, LAYERS]
    layer = next(r for r in reports if r.reused_by == LAYERS)
    assert layer.reused and layer.graphs == ["forward", "backward"]
    assert f'"reused_by": {LAYERS}' in (tmp_path / layer.graph_id / "report.json").read_text()
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-5)
    for (name, p), q in zip(eager.named_parameters(), model.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-5, msg=name)


def test_memory_budget_auto_plans_for_every_layer_and_the_model_state(megatron_cpu, fresh_dynamo):
    from megatron_glue.training.training import model_state_bytes

    config = gpt_config(hidden_size=32, num_attention_heads=4, num_layers=LAYERS)
    model = build_gpt_model(config, VOCAB, SEQ, seed=0)
    args = types.SimpleNamespace(npu_compile_options={"memory_budget": "auto"}, bf16=False, fp16=False,
                                 optimizer="adam", use_distributed_optimizer=False)
    compile_model(model, args)
    with collect() as reports:
        model(**synthetic_batch(2, SEQ, VOCAB)).mean().backward()
    n = sum(p.numel() for p in model.parameters())
    assert model_state_bytes(model, args) == n * (4 + 4 + 8)  # fp32 params and grads, Adam's two moments
    budgets = {r.reused_by: r.budget for r in reports}
    layer = budgets[LAYERS]
    assert layer["activation_copies"] == LAYERS and layer["resident_memory"] == n * 16 and layer["chosen"] == 1.0
    assert all(b["activation_copies"] == 1 for users, b in budgets.items() if users != LAYERS)
