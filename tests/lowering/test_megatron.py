"""megatron-core GPTModel compiled for npu-sim: the fused ops become torch_npu calls that bind to the real
schemas, nothing of npu_compile's vocabulary is left, and three training steps equal eager's."""

import pytest
import torch

from megatron_glue.capture.models import build_gpt_model, gpt_config, llama_config, synthetic_batch
from npu_compile.debug.report import collect

from .cases import lowered_graphs
from .wheel import assert_calls_bind

VOCAB, SEQ, BATCH = 128, 64, 2
CONFIGS = {
    "gpt": lambda: gpt_config(hidden_size=64),  # LayerNorm, GeLU, biases, learned positions
    "llama": lambda: llama_config(hidden_size=64, num_query_groups=2),  # RMSNorm, SwiGLU, RoPE, no bias, GQA
}
# The rules each config must fire, and the torch_npu calls each rule's sites become.
REQUIRED_RULES = {
    "gpt": ("attention", "bias_gelu", "add_layer_norm"),
    "llama": ("attention", "add_rms_norm", "rms_norm", "swiglu", "rotary"),
}
RULE_CALLS = {
    "attention": ("npu.npu_fusion_attention", "npu.npu_fusion_attention_grad"),
    "rms_norm": ("npu.npu_rms_norm", "npu.npu_rms_norm_backward"),
    "add_rms_norm": ("npu.npu_add_rms_norm", "npu.npu_rms_norm_backward"),
    "add_layer_norm": ("npu.npu_add_layer_norm", "npu.npu_add_layer_norm_backward"),
    "bias_gelu": ("npu.npu_gelu", "npu.npu_gelu_backward"),
    "swiglu": ("npu.npu_swiglu", "npu.npu_swiglu_backward"),
    "rotary": ("npu.npu_rotary_mul", "npu.npu_rotary_mul_backward"),
}


def _train(model, steps=3):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    history = []
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = model(**synthetic_batch(BATCH, SEQ, VOCAB, seed=step)).mean()
        loss.backward()
        grads = {n.removeprefix("_orig_mod."): p.grad.clone() for n, p in model.named_parameters()}
        history.append((loss.detach(), grads))
        opt.step()
    return history


@pytest.mark.slow
@pytest.mark.parametrize("name", CONFIGS)
def test_megatron_gpt_lowered_for_npu_sim_trains_like_eager(name, megatron_cpu):
    expected = _train(build_gpt_model(CONFIGS[name](), VOCAB, SEQ, seed=0))
    with collect() as reports, lowered_graphs() as graphs:
        model = torch.compile(build_gpt_model(CONFIGS[name](), VOCAB, SEQ, seed=0), backend="ascend",
                              options={"target": "npu-sim"})
        got = _train(model)
    (report,) = reports
    fired = {rule for rule, count in report.fusions.items() if count}
    missing_rules = set(REQUIRED_RULES[name]) - fired
    assert not missing_rules, f"rules that should fire on {name} did not: {missing_rules} ({report.unfused})"
    ops = report.lowered_ops
    for rule in fired:
        assert set(RULE_CALLS.get(rule, ())) <= ops.keys(), (rule, ops)
    assert not [op for op in ops if op.startswith("npu_compile.")], (ops, report.unfused)
    assert_calls_bind(*graphs)
    for step, ((loss0, grads0), (loss1, grads1)) in enumerate(zip(expected, got)):
        torch.testing.assert_close(loss1, loss0, rtol=1e-5, atol=0, msg=lambda m: f"step {step} loss: {m}")
        assert grads1.keys() == grads0.keys()
        for n in grads0:
            torch.testing.assert_close(grads1[n], grads0[n], rtol=1e-5, atol=1e-7,
                                       msg=lambda m: f"step {step} {n}: {m}")
