"""A sweep over random megatron-core GPT configurations, compiled with backend="ascend" on every CPU target.

Each example draws a model — layers, widths, heads and query groups, odd head dims, LayerNorm or RMSNorm, GeLU or
SwiGLU, biases or not, qk-layernorm, rotary or learned positions, an odd sequence length, fp32 or bf16 — and a
target (reference or npu-sim), runs one training step compiled and eagerly, and asserts: no crash, one graph
and no break, attention fused in every layer, and the loss and every gradient as eager's (fp32: within 1e-4 of
the model's scale; bf16: the compiled error against an fp32 run of the same weights — relative L2 for gradients —
within a small factor of eager's own, plus a bf16 ulp). `make test` runs a few derandomized examples; `make fuzz` runs 120 random ones.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron.core.transformer.module import Float16Module

from megatron_glue.capture.models import build_gpt_model, gpt_config, llama_config, synthetic_batch
from npu_compile.debug.report import collect

VOCAB, BATCH = 96, 2
HALF_FACTOR = 2.0  # bf16: compiled error vs fp32 within this factor of eager's error (plus a bf16 ulp of scale)


@dataclasses.dataclass(frozen=True)
class Case:
    layers: int
    heads: int
    groups: int
    head_dim: int
    llama: bool  # RMSNorm + SwiGLU, else LayerNorm + GeLU
    bias: bool
    qk_layernorm: bool
    rope: bool
    seq: int
    bf16: bool
    target: str

    def config(self, dtype: torch.dtype):
        make = llama_config if self.llama else gpt_config
        return make(num_layers=self.layers, hidden_size=self.heads * self.head_dim, num_attention_heads=self.heads,
                    num_query_groups=self.groups, add_bias_linear=self.bias, qk_layernorm=self.qk_layernorm,
                    params_dtype=dtype, bf16=dtype == torch.bfloat16)

    def model(self, dtype: torch.dtype):
        """The GPTModel; in bf16 inside Megatron's Float16Module, as the training job runs it (every parameter
        bf16, fp32 logits out)."""
        config = self.config(dtype)
        model = build_gpt_model(config, VOCAB, self.seq, seed=1,
                                position_embedding_type="rope" if self.rope else "learned_absolute")
        return Float16Module(config, model) if dtype == torch.bfloat16 else model


@st.composite
def cases(draw) -> Case:
    heads = draw(st.sampled_from([1, 2, 3, 4, 6]))
    groups = draw(st.sampled_from([g for g in (1, 2, 3, 6) if heads % g == 0]))
    return Case(
        layers=draw(st.integers(1, 3)),
        heads=heads,
        groups=groups,
        head_dim=draw(st.sampled_from([8, 12, 16, 20, 24, 40])),
        llama=draw(st.booleans()),
        bias=draw(st.booleans()),
        qk_layernorm=draw(st.booleans()),
        rope=draw(st.booleans()),
        seq=draw(st.sampled_from([7, 16, 33, 50, 64])),
        bf16=draw(st.booleans()),
        target=draw(st.sampled_from(["reference", "npu-sim"])),
    )


def _step(model, batch):
    loss = model(**batch).float().mean()
    loss.backward()
    grads = {n.removeprefix("_orig_mod.").removeprefix("module."): p.grad.detach().float().clone() for n, p in model.named_parameters()
             if p.grad is not None}
    return loss.detach(), grads


def _scaled_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max|a - b| over the typical magnitude of b."""
    return ((a - b).abs().max() / b.abs().mean().clamp_min(1e-12)).item()


def _rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


def check(case: Case) -> None:
    torch._dynamo.reset()
    dtype = torch.bfloat16 if case.bf16 else torch.float32
    batch = synthetic_batch(BATCH, case.seq, VOCAB, seed=2)
    eager = case.model(dtype)
    compiled_model = case.model(dtype)
    with collect() as reports:
        got_loss, got = _step(torch.compile(compiled_model, backend="ascend", options={"target": case.target}), batch)
    want_loss, want = _step(eager, batch)
    torch._dynamo.reset()

    assert len(reports) == 1 and reports[0].graph_breaks == 0, [r.graph_break_reason for r in reports]
    (report,) = reports
    assert report.fusions.get("attention") == case.layers, (report.fusions, report.unfused)
    assert got.keys() == want.keys()
    if not case.bf16:
        assert _scaled_err(got_loss, want_loss) < 1e-4
        for name in want:
            assert _scaled_err(got[name], want[name]) < 1e-4, name
        return
    # bf16: both against the fp32 model with the very same (bf16-rounded) weights
    exact = case.model(torch.float32)
    with torch.no_grad():
        for p32, p16 in zip(exact.parameters(), eager.parameters()):
            p32.copy_(p16.float())
    exact_loss, exact_grads = _step(exact, batch)
    err = lambda a, b: (a - b).abs().max().item()  # noqa: E731
    assert err(got_loss, exact_loss) <= HALF_FACTOR * err(want_loss, exact_loss) + 2**-8 * exact_loss.abs().item()
    for name in want:  # relative L2 error: a gradient's max element is noise in bf16 (each sum rounds its way)
        c, e = _rel_l2(got[name], exact_grads[name]), _rel_l2(want[name], exact_grads[name])
        assert c <= HALF_FACTOR * e + 2**-7, (name, c, e)


_SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


@settings(max_examples=4, **_SETTINGS)
@given(case=cases())
def test_random_megatron_configs(case, megatron_cpu):
    check(case)


@pytest.mark.fuzz
@settings(max_examples=120, derandomize=False, **_SETTINGS)
@given(case=cases())
def test_random_megatron_configs_fuzz(case, megatron_cpu):
    check(case)


@pytest.mark.parametrize("case", [
    Case(2, 4, 2, 16, llama=True, bias=False, qk_layernorm=False, rope=True, seq=64, bf16=True, target="reference"),
    Case(2, 4, 4, 16, llama=False, bias=True, qk_layernorm=False, rope=False, seq=64, bf16=True, target="npu-sim"),
], ids=["llama-bf16", "gpt-bf16"])
def test_megatron_bf16(case, megatron_cpu):
    check(case)
