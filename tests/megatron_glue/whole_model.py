"""Training a whole megatron-core GPT under test against eager: a few SGD steps' per-token losses and gradients,
adaptation groups applied for a test, the MoE GPT traced whole (test_compile_regions.py,
test_compile_layer_frames.py)."""

import contextlib

import torch

from megatron_glue.capture import adapt
from megatron_glue.capture.adaptations import registry
from megatron_glue.capture.models import build_gpt_model, llama_config, synthetic_batch

VOCAB, SEQ, BATCH = 128, 32, 2


def train(model, seed_model, steps=2):
    """Per-token losses and gradients of ``steps`` SGD steps of ``model`` (``seed_model`` holds its parameters:
    the model itself, or the one a compiled wrapper runs), every draw of the dropout masks seeded alike."""
    opt = torch.optim.SGD(seed_model.parameters(), lr=0.1)
    history = []
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        torch.manual_seed(100 + step)
        out = model(**synthetic_batch(BATCH, SEQ, VOCAB, seed=step))
        out.mean().backward()
        history.append((out.detach().clone(), {n: p.grad.clone() for n, p in seed_model.named_parameters()}))
        opt.step()
    return history


def assert_same(expected, got):
    """Every step's losses and every parameter's gradient within 1e-5."""
    for step, ((out0, grads0), (out1, grads1)) in enumerate(zip(expected, got, strict=True)):
        torch.testing.assert_close(out1, out0, rtol=1e-5, atol=1e-5, msg=lambda m: f"step {step} loss: {m}")
        assert grads1.keys() == grads0.keys()
        for n in grads0:
            torch.testing.assert_close(grads1[n], grads0[n], rtol=1e-5, atol=1e-5,
                                       msg=lambda m: f"step {step} grad of {n}: {m}")


@contextlib.contextmanager
def groups_applied(*groups):
    """Adaptation ``groups`` applied for the block, and what they added taken off after it."""
    before = set(registry.applied())
    adapt(groups)
    try:
        yield
    finally:
        registry.revert(*[n for n in registry.applied() if n not in before])


def assert_moe_gpt_is_whole_and_trains_as_eager(dispatcher, graphs):
    """A 2-layer MoE Llama (4 experts top-2, aux loss on) under torch.compile (aot_eager): no graph break, ``graphs``
    graphs, and its losses and every gradient as eager's."""
    from megatron_glue.training.training import moe_dynamo_config

    with groups_applied("sp", "moe"):  # "sp": the current-device stand-in the router asks (docs/moe.md)
        config = lambda: llama_config(hidden_size=32, num_layers=2, num_moe_experts=4, moe_router_topk=2,  # noqa: E731
                                      moe_ffn_hidden_size=32, moe_aux_loss_coeff=0.1,
                                      moe_token_dispatcher_type=dispatcher)
        eager = build_gpt_model(config(), VOCAB, SEQ, seed=0)
        model = build_gpt_model(config(), VOCAB, SEQ, seed=0)
        expected = train(eager, eager)
        moe_dynamo_config()
        torch._dynamo.utils.counters.clear()
        got = train(torch.compile(model, backend="aot_eager"), model)
        assert sum(torch._dynamo.utils.counters["graph_break"].values()) == 0
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs
        for (out, grads), (want_out, want_grads) in zip(got, expected):
            torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-6)
            for name, grad in want_grads.items():
                torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-6, msg=name)
