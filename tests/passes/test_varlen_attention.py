"""The varlen_attention rule: megatron-core's GPTModel given packed documents as lengths (PackedSeqParams "sbhd",
the compiled job's --reset-attention-mask) trains compiled exactly as eager Megatron does over its dense reset
mask; the compiled graphs hold no s×s tensor; a batch with another number of documents compiles nothing new;
calls the rule leaves dense say why."""

import pytest
import torch

from megatron_glue.capture.adaptations import megatron_core_in
from megatron_glue.capture.testing import megatron_cpu  # noqa: F401  (fixture)
from npu_compile.debug.report import collect
from npu_compile.ops.varlen_attention import cu_seqlens_from_eod
from tests.lowering.cases import lowered_graphs


VOCAB, SEQ, BATCH, EOD = 128, 32, 2, 0
# documents per row differ from step to step (a row of one document, rows of several)
EOD_RATES = (0.0, 0.1, 0.3)


def batches():
    for step, rate in enumerate(EOD_RATES):
        g = torch.Generator().manual_seed(step)
        tokens = torch.randint(1, VOCAB, (BATCH, SEQ + 1), generator=g)
        tokens[torch.rand(BATCH, SEQ + 1, generator=g) < rate] = EOD
        yield tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def dense_megatron_mask(tokens):
    """megatron-core's GPTDataset mask with reset_attention_mask, row by row: [b, 1, s, s]."""
    from megatron.core.datasets.gpt_dataset import _get_ltor_masks_and_position_ids

    return torch.stack([_get_ltor_masks_and_position_ids(row, EOD, False, True, False, True)[0] for row in tokens])


def train(model, packed: bool):
    from megatron.core.packed_seq_params import PackedSeqParams

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    history = []
    for tokens, labels in batches():
        opt.zero_grad(set_to_none=True)
        positions = torch.arange(SEQ).expand(BATCH, SEQ)
        if packed:
            cu = cu_seqlens_from_eod(tokens, EOD, pad_to=BATCH * SEQ)
            params = PackedSeqParams(qkv_format="sbhd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=SEQ,
                                     max_seqlen_kv=SEQ)
            loss = model(tokens, positions, None, labels=labels, packed_seq_params=params)
        else:
            loss = model(tokens, positions, dense_megatron_mask(tokens), labels=labels)
        loss.mean().backward()
        history.append((loss.detach(), {n.removeprefix("_orig_mod."): p.grad for n, p in model.named_parameters()}))
        opt.step()
    return history


@pytest.mark.skipif(not megatron_core_in(">=0.13"), reason="megatron-core 0.12 takes any PackedSeqParams for THD; "
                    "the job passes the dense mask there (megatron_glue.training.gpt.passes_lengths)")
@pytest.mark.parametrize("make_config", ["gpt", "llama_gqa"])
def test_packed_documents_train_compiled_as_megatron_eager(make_config, megatron_cpu, rel_error):
    from megatron_glue.capture.models import build_gpt_model, gpt_config, llama_config

    config = {"gpt": lambda: gpt_config(hidden_size=64),
              "llama_gqa": lambda: llama_config(hidden_size=64, num_query_groups=2)}[make_config]
    assert any(len(cu_seqlens_from_eod(t, EOD).unique()) > BATCH for t, _ in batches())  # rows hold documents
    torch._dynamo.reset()
    with torch._dynamo.config.patch(disable=True):  # Megatron's jit_fuser is torch.compile: keep eager eager
        expected = train(build_gpt_model(config(), VOCAB, SEQ, seed=0), packed=False)
    with collect() as reports, lowered_graphs() as graphs:
        compiled = torch.compile(build_gpt_model(config(), VOCAB, SEQ, seed=0), backend="ascend",
                                 options={"target": "reference"})
        got = train(compiled, packed=True)
    torch._dynamo.reset()
    # one graph for every number of documents, the rule taking every layer's attention
    (report,) = reports
    assert report.graph_breaks == 0
    assert report.fusions["varlen_attention"] == 2 and report.fusions["attention"] == 2
    assert report.lowered_ops["npu_compile.varlen_attention"] == 2
    assert report.lowered_ops["npu_compile.varlen_attention_backward"] == 2
    assert "npu_compile.document_mask" not in report.lowered_ops and "npu_compile.fused_attention" not in (
        report.lowered_ops)
    # no s×s tensor anywhere in the compiled graphs
    square = [(n.name, tuple(n.meta["val"].shape)) for gm in graphs for n in gm.graph.nodes
              if isinstance(n.meta.get("val"), torch.Tensor) and n.meta["val"].dim() >= 2
              and tuple(n.meta["val"].shape[-2:]) == (SEQ, SEQ)]
    assert graphs and not square, square
    for step, ((loss0, grads0), (loss1, grads1)) in enumerate(zip(expected, got)):
        assert rel_error(loss1, loss0) <= 1e-5, step
        assert grads1.keys() == grads0.keys()
        bad = {n: rel_error(grads1[n], grads0[n]) for n in grads0 if rel_error(grads1[n], grads0[n]) > 1e-5}
        assert not bad, (step, bad)


def test_the_rule_needs_the_document_mask():
    """Switched off, the dense fused attention keeps the s×s mask, and the report says why."""
    q, k, v = (torch.randn(16, 2, 4, 8, requires_grad=True) for _ in range(3))
    cu = torch.tensor([5, 16, 20, 32])

    def fn(q, k, v, cu):
        mask = torch.ops.npu_compile.document_mask(cu, 2, 16)
        return torch.ops.npu_compile.fused_attention(q, k, v, mask, layout="sbnd", fill=-10000.0)[0]

    for fusions, fired in ((["varlen_attention"], 1), ([], 0)):
        torch._dynamo.reset()
        with collect() as reports:
            out = torch.compile(fn, backend="ascend", options={"fusions": fusions})(q, k, v, cu)
        (report,) = reports
        assert report.fusions.get("varlen_attention", 0) == fired
        expected = torch.ops.npu_compile.varlen_attention(q, k, v, cu)[0]
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    assert {"op": "npu_compile.fused_attention.default", "rule": "varlen_attention",
            "reason": "rule 'varlen_attention' is switched off by options['fusions']"}.items() <= {
        **next(u for u in report.unfused if u["rule"] == "varlen_attention")}.items()


def test_dropout_stays_dense_with_its_reason():
    q, k, v = (torch.randn(16, 2, 4, 8, requires_grad=True) for _ in range(3))
    cu = torch.tensor([5, 16, 20, 32])

    def fn(q, k, v, cu):
        mask = torch.ops.npu_compile.document_mask(cu, 2, 16)
        seed = torch.tensor([1, 0])
        return torch.ops.npu_compile.fused_attention(q, k, v, mask, None, seed, layout="sbnd", fill=-10000.0,
                                                     dropout_p=0.1)[0]

    torch._dynamo.reset()
    with collect() as reports:
        torch.compile(fn, backend="ascend", options={"fusions": ["varlen_attention"]})(q, k, v, cu)
    (report,) = reports
    assert report.fusions["varlen_attention"] == 0
    (site,) = [u for u in report.unfused if u["rule"] == "varlen_attention"]
    assert site["reason"].startswith("dropout: varlen_attention takes none")
