"""Packed documents under context parallelism (docs/context_parallel.md "Packed documents"): the ring's blocks
masked by document over simulated ranks equal document-masked attention over the whole rows (values and q/k/v
gradients), from the documents' lengths and from Megatron's dense mask alike; the door takes
--reset-attention-mask at CP > 1 and --attention-mask-type general. The job over gloo processes:
test_cp_packed_job.py."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_glue.capture import context_parallel as cp
from pretrain_runs import parse_tiny
from test_context_parallel import split_like_megatron


def documents_attention(q, k, v, scale, cu, batch):
    """Reference: softmax attention over the whole rows [s, b, n, d] under npu_compile's document_mask (Megatron's
    reset mask: causal within each document), fully masked entries removed."""
    n, g = q.size(2), k.size(2)
    k, v = k.repeat_interleave(n // g, 2), v.repeat_interleave(n // g, 2)
    scores = torch.einsum("sbnd,tbnd->bnst", q, k) * scale
    mask = torch.ops.npu_compile.document_mask(cu, batch, q.size(0))
    return torch.einsum("bnst,tbnd->sbnd", torch.softmax(scores.masked_fill(mask, float("-inf")), -1), v)


def ring_over_ranks(q, k, v, scale, size, hidden_of):
    """ring_attention_local on `size` simulated ranks (each exchange answers the previous rank's K/V of that step),
    `hidden_of(c)` the ranks' document mask provider; the outputs put back in sequence order."""
    qs, ks, vs = (split_like_megatron(t, size) for t in (q, k, v))
    kvs = [torch.cat([a, b], dim=-1) for a, b in zip(ks, vs)]
    c = q.size(0) // (2 * size)
    chunks = [None] * (2 * size)
    for r in range(size):
        calls = []

        def exchange(kv, r=r, calls=calls):
            calls.append(kv)
            return kvs[(r - len(calls)) % size]

        out = cp.ring_attention_local(qs[r], ks[r], vs[r], scale, r, size, exchange, hidden=hidden_of(c))
        chunks[r], chunks[2 * size - 1 - r] = out[:c], out[c:]
    return torch.cat(chunks)


def random_documents(gen, batch, seq):
    """Cumulative document ends over the b·s tokens (each row end one of them), padded with b·s repeats as the
    job pads them: documents of 1 to seq tokens, some shorter than a chunk, some across several."""
    ends = []
    for row in range(batch):
        cuts = sorted(set(torch.randint(1, seq, (int(torch.randint(0, 5, (1,), generator=gen)),),
                                        generator=gen).tolist()))
        ends += [row * seq + e for e in cuts] + [(row + 1) * seq]
    return torch.tensor(ends + [batch * seq] * 3, dtype=torch.int64)


@pytest.mark.parametrize("size", [1, 2, 3, 4])
@pytest.mark.parametrize("given_as", ["lengths", "mask"])
def test_ring_over_documents_equals_document_attention(megatron_cpu, size, given_as):
    """Packed rows on the ring: each block masked by document (a query whose document begins after the block's
    keys sees none of them: weight 0 in the merge) gives document-masked attention over the whole rows, and the
    same q/k/v gradients (fp64, 1e-10), GQA, several random packings per CP size."""
    import npu_compile.ops  # noqa: F401  (document_mask)

    for seed in range(4):
        gen = torch.Generator().manual_seed(100 * size + seed)
        b, c = 2, 3
        s, (n, g), d = 2 * size * c, [(2, 2), (4, 2), (4, 1), (1, 1)][seed], 4
        q, k, v = (torch.randn(s, b, h, d, generator=gen, dtype=torch.float64, requires_grad=True)
                   for h in (n, g, g))
        cu = random_documents(gen, b, s)
        if given_as == "lengths":
            def hidden_of(c, cu=cu, b=b, s=s):
                return cp.documents_hidden(cp.document_ids(cu, b, s), c)
        else:
            mask = torch.ops.npu_compile.document_mask(cu, b, s)

            def hidden_of(c, mask=mask):
                return cp.mask_hidden(mask, c)
        scale = 1 / math.sqrt(d)
        weights = torch.randn(s, b, n, d, generator=gen, dtype=torch.float64)
        ring = ring_over_ranks(q, k, v, scale, size, hidden_of).to(torch.float64)
        expected = documents_attention(q, k, v, scale, cu, b)
        torch.testing.assert_close(ring, expected, rtol=1e-10, atol=1e-10)
        got = torch.autograd.grad((ring * weights).sum(), (q, k, v))
        want = torch.autograd.grad((expected * weights).sum(), (q, k, v))
        for name, a, e in zip("qkv", got, want):
            assert torch.isfinite(a).all()
            torch.testing.assert_close(a, e, rtol=1e-10, atol=1e-10, msg=lambda m, name=name: f"d{name}: {m}")


def test_a_block_a_query_sees_nothing_of_weighs_nothing():
    """A block whose keys all belong to earlier documents: out 0, sum 0, max -inf; merged into a partial result it
    changes nothing (and its gradient is 0, not NaN)."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(3, 1, 2, 4, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(3))
    hidden = torch.tensor([[True] * 3, [False] * 3, [True, False, True]]).view(1, 1, 3, 3)
    out, top, total = cp.attention_with_statistics(q, k, v, 0.5, causal=False, hidden=hidden)
    assert out[0].abs().max() == 0 and total[..., 0].eq(0).all() and torch.isneginf(top[..., 0]).all()
    mine = cp.attention_with_statistics(q, q, v, 0.5, causal=True)
    merged = cp.ring_attention_update(*mine, out, top, total)
    torch.testing.assert_close(merged[0][0], mine[0][0], rtol=0, atol=0)
    grads = torch.autograd.grad(merged[0].sum(), (q, k, v))
    assert all(torch.isfinite(g).all() for g in grads)


def test_document_ids_are_the_document_masks_documents():
    import npu_compile.ops  # noqa: F401

    cu = torch.tensor([2, 4, 5, 8, 11, 16, 16, 16])
    ids = cp.document_ids(cu, 2, 8)
    assert ids.tolist() == [[0, 0, 1, 1, 2, 3, 3, 3], [4, 4, 4, 5, 5, 5, 5, 5]]
    whole = cp.documents_hidden(ids, 2)(range(4), range(4))
    assert torch.equal(whole, torch.ops.npu_compile.document_mask(cu, 2, 8))


@pytest.mark.parametrize("algorithm", ["ulysses_cp_algo", "megatron_cp_algo"])
def test_the_door_takes_packed_rows_under_cp_and_either_mask_type(algorithm):
    flags = ["--context-parallel-size", "2", "--context-parallel-algo", algorithm, "--reset-attention-mask",
             "--reset-position-ids", "--eod-mask-loss"]
    for kind in ("causal", "general"):
        args = parse_tiny(*flags, "--attention-mask-type", kind, world_size=2)
        assert args.reset_attention_mask and args.attention_mask_type == kind
        assert parse_tiny(*flags, "--cp-attention-mask-type", kind, world_size=2).attention_mask_type == kind
    assert parse_tiny("--attention-mask-type", "general").attention_mask_type == "general"


def test_the_help_says_what_each_mask_type_means(capsys):
    from megatron_glue.training.arguments import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "'causal' its accelerated kernels" in text and "'general' its baseline over the full mask" in text
    assert "Here both give the same attention" in text


def test_the_census_scales_a_cp_script_to_cp2_on_its_2_processes():
    """bench.mindspeed_census.scale_down: a CP 4 script (the flags of MindSpeed-LLM's
    qwen25/pretrain_qwen25_72b_32k_ptd.sh that set its layout) runs at CP 2 with its algorithm, TP and PP 1, and
    leaves out what needs pipeline stages or TP (the door refuses them there); the job's check admits it."""
    from bench.mindspeed_census import scale_down

    script = ["--context-parallel-size", "4", "--context-parallel-algo", "megatron_cp_algo",
              "--tensor-model-parallel-size", "8", "--pipeline-model-parallel-size", "4", "--sequence-parallel",
              "--use-ascend-mc2", "--num-layers", "80", "--num-layer-list", "17,20,22,21", "--hidden-size", "8192",
              "--num-attention-heads", "64", "--seq-length", "32768", "--max-position-embeddings", "32768",
              "--micro-batch-size", "1", "--global-batch-size", "32", "--train-iters", "2000", "--mock-data",
              "--attention-dropout", "0.0", "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000",
              "--lr", "1e-6"]
    argv = scale_down(script)
    flags = dict(zip(argv, argv[1:]))
    assert (flags["--context-parallel-size"], flags["--context-parallel-algo"]) == ("2", "megatron_cp_algo")
    assert (flags["--tensor-model-parallel-size"], flags["--pipeline-model-parallel-size"]) == ("1", "1")
    assert "--num-layer-list" not in argv and "--use-ascend-mc2" not in argv and "--sequence-parallel" in argv
    from megatron_glue.training.arguments import parse_args

    args = parse_args(argv, world_size=2)
    assert (args.context_parallel_size, args.tensor_model_parallel_size, args.pipeline_model_parallel_size) == (2, 1, 1)
    # without CP nothing changes: TP scripts keep TP 2 (and MC2)
    tp = scale_down(["--tensor-model-parallel-size", "8", "--use-ascend-mc2", "--num-layers", "80"])
    assert tp == ["--tensor-model-parallel-size", "2", "--use-ascend-mc2", "--num-layers", "4"]


def test_batches_cut_to_their_longest_sample_must_split_over_cp():
    """posttrain_gpt --no-pad-to-seq-lengths pads each batch to a multiple of --pad-to-multiple-of (MindSpeed-LLM's
    default 8); under CP the length must split into 2 x CP chunks."""
    from megatron_glue.training.sft import posttrain_refusal

    def refusal(cp, *flags):
        args = parse_tiny("--stage", "sft", "--is-instruction-dataset", "--prompt-type", "qwen",
                          "--no-pad-to-seq-lengths", "--context-parallel-size", str(cp), "--context-parallel-algo",
                          "megatron_cp_algo", *flags, world_size=cp)
        args.mock_data = False  # the instruction data's path is not the point here
        return posttrain_refusal(args)

    assert refusal(2) is None and refusal(4) is None  # 8 splits into 4 and 8 chunks
    assert refusal(8) == ("--no-pad-to-seq-lengths at --context-parallel-size 8: each batch is padded to a multiple "
                          "of 8 (--pad-to-multiple-of), and megatron-core splits its sequence into 2 x CP = 16 "
                          "chunks; give --pad-to-multiple-of a multiple of 16")
    assert refusal(8, "--pad-to-multiple-of", "16") is None


def test_moe_at_cp_is_taken_where_megatron_core_scales_its_aux_loss_by_cp():
    """MoE at CP > 1 (test_cp_moe_job.py: equal to CP 1 on 0.16); megatron-core 0.12's schedule leaves the
    aux-loss gradient unscaled by CP (1/CP of CP 1's, measured 7e-5 relative in the grad norm), so there a
    load-balancing loss under CP is refused, and MoE without one runs."""
    from megatron_glue.capture.adaptations import megatron_core_in
    from pretrain_runs import parse_error

    moe = ["--num-experts", "4", "--moe-router-topk", "2", "--disable-bias-linear", "--context-parallel-size", "2"]
    assert parse_tiny(*moe, "--moe-aux-loss-coeff", "0", world_size=2).num_experts == 4
    with_loss = [*moe, "--moe-aux-loss-coeff", "0.01"]
    if megatron_core_in(">=0.13"):
        assert parse_tiny(*with_loss, world_size=2).context_parallel_size == 2
    else:
        assert parse_error(*with_loss, world_size=2).endswith(
            "--num-experts with a load-balancing loss at --context-parallel-size 2: on megatron-core 0.12 the "
            "schedule scales the router's aux-loss gradient by 1 / micro-batches only (0.12.1 "
            "pipeline_parallel/schedules.py:321), not also by CP as 0.13 on do (0.16.1 schedules.py:292), so the "
            "router would learn 1/CP of what it learns at CP 1; use megatron-core 0.13 or later, or "
            "--moe-aux-loss-coeff 0")
