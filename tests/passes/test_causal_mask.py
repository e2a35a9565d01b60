"""Fusion rule causal_mask (npu_compile/passes/causal_mask.py): megatron-core's default causal mask folded into
the fused attention's causal flag; the compiled graphs hold no s×s tensor."""

from __future__ import annotations

import pytest
import torch

from megatron_glue.capture.testing import megatron_cpu  # noqa: F401  (fixture)
from npu_compile.debug.report import collect
from tests.lowering.cases import lowered_graphs

VOCAB, SEQ, BATCH = 128, 32, 2


def _step(model):
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    positions = torch.arange(SEQ).expand(BATCH, SEQ)
    loss = model(tokens, positions, None, labels=torch.roll(tokens, -1, 1))  # no mask: megatron's default causal
    loss.mean().backward()
    return loss.detach(), {n.removeprefix("_orig_mod."): p.grad.clone() for n, p in model.named_parameters()}


def _square(graphs):
    return [(n.name, tuple(n.meta["val"].shape)) for gm in graphs for n in gm.graph.nodes
            if isinstance(n.meta.get("val"), torch.Tensor) and n.meta["val"].dim() >= 2
            and tuple(n.meta["val"].shape[-2:]) == (SEQ, SEQ)]


@pytest.mark.parametrize("target", ["reference", "npu-sim"])
def test_default_causal_mask_becomes_the_causal_flag(target, megatron_cpu, rel_error):
    """A 2-layer Llama-style megatron-core GPT without an attention mask: the rule takes both layers' attention
    (forward and backward calls), no s×s tensor is left in the compiled graphs (with the rule off, the mask is
    there), loss and every gradient equal eager within 1e-5 (fp32)."""
    from megatron_glue.capture.models import build_gpt_model, llama_config

    with torch._dynamo.config.patch(disable=True):  # Megatron's jit_fuser is torch.compile: keep eager eager
        want, want_grads = _step(build_gpt_model(llama_config(hidden_size=64), VOCAB, SEQ, seed=0))
    runs = {}
    for on in (True, False):
        torch._dynamo.reset()
        with collect() as reports, lowered_graphs() as graphs:
            model = build_gpt_model(llama_config(hidden_size=64), VOCAB, SEQ, seed=0)
            got, got_grads = _step(torch.compile(model, backend="ascend", options={
                "target": target, "cache": False, "fusions": {"causal_mask": on}}))
        runs[on] = (reports[0], _square(graphs))
        assert rel_error(got, want) <= 1e-5
        bad = {n: rel_error(got_grads[n], g) for n, g in want_grads.items() if rel_error(got_grads[n], g) > 1e-5}
        assert not bad, (on, bad)
    torch._dynamo.reset()
    (report, square), (report_off, square_off) = runs[True], runs[False]
    assert report.fusions["causal_mask"] == 2 and report.fusions["attention"] == 2
    assert not square, square
    assert square_off  # the rule is what removed it
