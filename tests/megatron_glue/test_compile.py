"""Whole GPTModel training under torch.compile: one graph, no breaks, and aot_eager equal to eager bit for bit."""

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters

from megatron_glue.capture.adaptations import registry
from megatron_glue.capture.models import build_gpt_model, gpt_config, llama_config, synthetic_batch
from megatron_glue.capture.testing import adaptations_reverted

# Dynamo traces through RotaryEmbedding.forward's lru_cache and says so; the cached value is a pure function of
# its arguments, so tracing it is exact.
pytestmark = pytest.mark.filterwarnings("ignore:Dynamo detected a call to a `functools.lru_cache`")

VOCAB, SEQ = 128, 32
CONFIGS = {"gpt": gpt_config, "llama": llama_config}


@pytest.mark.parametrize("kind", CONFIGS)
def test_compiled_training_is_one_graph_and_equals_eager(megatron_cpu, fresh_dynamo, kind):
    config = CONFIGS[kind](hidden_size=64, num_query_groups=2)
    eager = build_gpt_model(config, VOCAB, SEQ, seed=0)
    compiled_model = build_gpt_model(config, VOCAB, SEQ, seed=0)
    backend = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(compiled_model, backend=backend)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (eager, compiled_model)]
    counters.clear()

    for step in range(3):
        batch = synthetic_batch(2, SEQ, VOCAB, seed=step)
        per_token = []
        for model, optimizer in zip((eager, compiled), optimizers):
            optimizer.zero_grad(set_to_none=True)
            loss = model(**batch)  # labels given: per-token loss [b, s]
            loss.mean().backward()
            per_token.append(loss.detach())
        assert torch.equal(per_token[0], per_token[1]), f"step {step}: loss differs"
        for (name, p), q in zip(eager.named_parameters(), compiled_model.parameters()):
            assert torch.equal(p.grad, q.grad), f"step {step}: grad of {name} differs"
        for optimizer in optimizers:
            optimizer.step()

    assert backend.frame_count == 1  # one graph for all three steps: no break, no recompile
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert all(torch.equal(p, q) for p, q in zip(eager.parameters(), compiled_model.parameters()))


def test_dropout_and_no_mask_still_one_graph(megatron_cpu, fresh_dynamo):
    # Dropout goes through the RNG tracker's fork(); attention_mask=None through get_default_causal_mask.
    model = build_gpt_model(gpt_config(hidden_size=64, hidden_dropout=0.1, attention_dropout=0.1), VOCAB, SEQ)
    batch = dict(synthetic_batch(2, SEQ, VOCAB), attention_mask=None)
    explanation = torch._dynamo.explain(model)(**batch)
    assert (explanation.graph_count, explanation.graph_break_count) == (1, 0), explanation.break_reasons


@pytest.mark.filterwarnings("ignore:Warning. tp_group is None:DeprecationWarning")  # the warning under test
def test_without_the_compile_group_megatron_breaks_the_graph(megatron_cpu, fresh_dynamo):
    model = build_gpt_model(gpt_config(hidden_size=64), VOCAB, SEQ)
    batch = synthetic_batch(2, SEQ, VOCAB)
    with adaptations_reverted(*registry.known("compile")):
        explanation = torch._dynamo.explain(model)(**batch)
    if not registry.applies("quiet_default_tp_group"):
        # 0.12 passes no tp_group and so has no warning about it (no get_tensor_model_parallel_group_if_none,
        # 0.12.1: utils.py): the group's break-maker does not apply, and the model is one graph without the group
        # (its other entry, bias_dropout_add_in_grad_mode, matters under no_grad only: test_convert.py).
        assert "quiet_default_tp_group" in registry.skipped("compile")
        assert (explanation.graph_count, explanation.graph_break_count) == (1, 0), explanation.break_reasons
        return
    assert explanation.graph_break_count > 0 and explanation.graph_count > 1
    # The break sits in Megatron's warning about tp_group=None.
    where = [frame.filename for reason in explanation.break_reasons for frame in reason.user_stack]
    assert any(f.endswith("megatron/core/utils.py") for f in where), where
