"""megatron-core GPTModel compiled with backend="ascend": one graph, no breaks, training equal to eager."""

import pytest
import torch

from megatron_glue.capture.models import build_gpt_model, gpt_config, llama_config, synthetic_batch
from npu_compile.debug.report import collect

VOCAB, SEQ, BATCH = 128, 64, 2
CONFIGS = {
    "gpt": lambda: gpt_config(hidden_size=64),  # LayerNorm, GeLU, biases, learned positions
    "llama": lambda: llama_config(hidden_size=64, num_query_groups=2),  # RMSNorm, SwiGLU, RoPE, no bias, GQA
}


def _train(model, steps=3):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    history = []
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        out = model(**synthetic_batch(BATCH, SEQ, VOCAB, seed=step))  # per-token loss [b, s]
        out.mean().backward()
        history.append((out.detach().clone(), {n.removeprefix("_orig_mod."): p.grad.clone() for n, p in model.named_parameters()}))
        opt.step()
    return history


@pytest.mark.parametrize("name", CONFIGS)
def test_one_graph_and_training_equal_to_eager(name, megatron_cpu, fresh_dynamo, tmp_path):
    eager = build_gpt_model(CONFIGS[name](), VOCAB, SEQ, seed=0)
    model = build_gpt_model(CONFIGS[name](), VOCAB, SEQ, seed=0)
    expected = _train(eager)
    torch._dynamo.utils.counters.clear()
    with collect() as reports:
        got = _train(torch.compile(model, backend="ascend", options={"dump_dir": str(tmp_path)}))

    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    assert len(reports) == 1 and reports[0].graph_breaks == 0 and reports[0].graphs == ["forward", "backward"]
    assert (tmp_path / "0_0" / "report.json").exists()
    for (out0, grads0), (out1, grads1) in zip(expected, got):
        torch.testing.assert_close(out1, out0, rtol=1e-6, atol=1e-6)
        assert grads1.keys() == grads0.keys() and len(grads0) == len(list(model.parameters()))
        for n in grads0:
            torch.testing.assert_close(grads1[n], grads0[n], rtol=1e-6, atol=1e-6, msg=lambda m: f"{n}: {m}")
