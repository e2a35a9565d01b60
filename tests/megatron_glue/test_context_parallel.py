"""Context parallelism's attention (megatron_glue.capture.context_parallel) in one process: the ring's merge of
partial attentions with their fp32 statistics, and the Ulysses reordering, against full causal attention over
the whole sequence, values and gradients; the layer spec it swaps into; the door's checks. The job over gloo
processes: tests/megatron_glue/test_context_parallel_job.py."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from megatron_glue.capture import context_parallel as cp
from megatron_glue.training.arguments import ArgumentError, parse_args
from pretrain_runs import TINY


def full_causal(q, k, v, scale):
    """Causal softmax attention over the whole sequence, [s, b, n, d] (GQA by repeating k/v heads)."""
    n, g = q.size(2), k.size(2)
    k, v = k.repeat_interleave(n // g, 2), v.repeat_interleave(n // g, 2)
    scores = torch.einsum("sbnd,tbnd->bnst", q, k) * scale
    s = scores.size(-1)
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("bnst,tbnd->sbnd", torch.softmax(scores, -1), v)


def split_like_megatron(x, size):
    """megatron-core's get_batch_on_this_cp_rank on a [s, ...] tensor (sequence first): chunks r and 2·size-1-r
    of 2·size for each rank r."""
    from unittest import mock

    from megatron.core import utils

    get_batch_on_this_cp_rank = utils.get_batch_on_this_cp_rank  # on 0.12 cp_batch_split_on_its_device's
    parts = []
    for r in range(size):
        with mock.patch("megatron.core.parallel_state.get_context_parallel_world_size", return_value=size), \
                mock.patch("megatron.core.parallel_state.get_context_parallel_rank", return_value=r):
            # megatron's batch is [b, s, ...]: move the sequence to dim 1 and back
            parts.append(get_batch_on_this_cp_rank({"x": x.transpose(0, 1)})["x"].transpose(0, 1))
    return parts


def ring_over_ranks(q, k, v, scale, size):
    """ring_attention_local on each of `size` simulated ranks, each rank's exchange answering the previous rank's
    K/V of that step (the originals: the gradient reaches them through the exchange as through the collective)."""
    qs, ks, vs = (split_like_megatron(t, size) for t in (q, k, v))
    kvs = [torch.cat([a, b], dim=-1) for a, b in zip(ks, vs)]
    outs = []
    for r in range(size):
        calls = []

        def exchange(kv, r=r, calls=calls):
            calls.append(kv)
            return kvs[(r - len(calls)) % size]

        outs.append(cp.ring_attention_local(qs[r], ks[r], vs[r], scale, r, size, exchange))
    # back to the sequence order: rank r's halves are chunks r and 2·size-1-r
    c = q.size(0) // (2 * size)
    chunks = [None] * (2 * size)
    for r, out in enumerate(outs):
        chunks[r], chunks[2 * size - 1 - r] = out[:c], out[c:]
    return torch.cat(chunks)


@st.composite
def cases(draw):
    size = draw(st.integers(1, 4))
    c = draw(st.integers(1, 3))
    b = draw(st.integers(1, 2))
    n, g = draw(st.sampled_from([(1, 1), (2, 2), (4, 2), (4, 1)]))
    d = draw(st.sampled_from([2, 4]))
    return size, 2 * size * c, b, n, g, d


@given(cases(), st.integers(0, 2**16))
def test_ring_attention_equals_full_causal_attention(megatron_cpu, case, seed):
    """The load-balanced ring over simulated ranks: merged partial attentions (ring_attention_update) equal
    causal attention over the whole sequence, and so do the gradients of q, k and v (fp64, 1e-10)."""
    size, s, b, n, g, d = case
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(s, b, h, d, generator=gen, dtype=torch.float64, requires_grad=True)
               for h in (n, g, g))
    scale = 1 / math.sqrt(d)
    weights = torch.randn(s, b, n, d, generator=gen, dtype=torch.float64)
    ring = ring_over_ranks(q, k, v, scale, size).to(torch.float64)
    ring_grads = torch.autograd.grad((ring * weights).sum(), (q, k, v))
    full = full_causal(q, k, v, scale)
    full_grads = torch.autograd.grad((full * weights).sum(), (q, k, v))
    torch.testing.assert_close(ring, full, rtol=1e-10, atol=1e-10)
    for name, a, e in zip("qkv", ring_grads, full_grads):
        torch.testing.assert_close(a, e, rtol=1e-10, atol=1e-10, msg=lambda m, name=name: f"d{name}: {m}")


def test_the_merge_is_npu_ring_attention_updates():
    """Two halves of the keys merged give the attention over all of them, statistics included: max of the maxima,
    sum of the rescaled sums (torch_npu's npu_ring_attention_update outputs)."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(5, 2, 3, 4, generator=gen, dtype=torch.float64) for _ in range(3))
    whole = cp.attention_with_statistics(q, k, v, 0.5, causal=False)
    left = cp.attention_with_statistics(q, k[:2], v[:2], 0.5, causal=False)
    right = cp.attention_with_statistics(q, k[2:], v[2:], 0.5, causal=False)
    merged = cp.ring_attention_update(*left, *right)
    for a, e in zip(merged, whole):
        torch.testing.assert_close(a, e, rtol=1e-12, atol=1e-12)
    assert all(t.dtype == torch.float32 for t in cp.attention_with_statistics(q.half(), k.half(), v.half(), 0.5,
                                                                                True))


def test_the_ring_masks_no_block_but_the_first():
    """Megatron's chunking: after the first step each block is whole or absent for each query chunk (no mask,
    no query row without keys), and over the steps each rank sees every rank's K/V once."""
    for size in (2, 3, 4):
        for rank in range(size):
            steps = list(cp.ring_steps(rank, size))
            assert sorted(source for _, source, _, _ in steps) == list(range(size))
            for _, source, queries, keys in steps[1:]:
                assert (queries, keys) == (("all", "first") if source < rank else ("second", "all"))


@pytest.mark.parametrize("attend", ["fused_step", "attention_with_statistics"])
def test_the_compiled_rings_saved_activations_hold_no_score_block(attend):
    """Rank 0 of a CP 2 ring compiled for target reference (the other rank's K/V an input standing in for the
    exchange): with the fused step the graph holds npu_compile.attention_with_lse and the backward saves q, k, v,
    out and lse (O(s/CP) each), far under one [b, n, s/CP, s/CP] fp32 block; the written-out step saves its
    weights, blocks of that size (the case shows the bar sees them)."""
    from npu_compile.debug.report import collect

    c, b, n, d = 64, 1, 2, 4  # this rank's 2c = 128 tokens; the first step's block is 2c x 2c
    block = b * n * (2 * c) * (2 * c) * 4
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2 * c, b, n, d, generator=gen, requires_grad=True) for _ in range(3))
    other = torch.randn(2 * c, b, n, 2 * d, generator=gen, requires_grad=True)
    step = getattr(cp, attend)

    def rank0(q, k, v, other):
        return cp.ring_attention_local(q, k, v, 0.5, 0, 2, lambda kv: other, attend=step)

    expected = rank0(q, k, v, other)
    expected_grads = torch.autograd.grad(expected.sum(), (q, k, v, other))
    torch._dynamo.reset()
    with collect() as reports:
        got = torch.compile(rank0, backend="ascend", options={"target": "reference"})(q, k, v, other)
        grads = torch.autograd.grad(got.sum(), (q, k, v, other))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    for a, e in zip(grads, expected_grads):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5)
    (report,) = reports
    saved = report.memory["saved_activation_bytes"]
    if attend == "fused_step":
        assert report.lowered_ops.get("npu_compile.attention_with_lse") == 2, report.lowered_ops
        assert report.lowered_ops.get("npu_compile.attention_with_lse_backward") == 2, report.lowered_ops
        assert 0 < saved < block / 4, (saved, block)
    else:
        assert "npu_compile.attention_with_lse" not in report.lowered_ops
        assert saved >= block, (saved, block)


def test_ulysses_reorder_is_the_sequence_order(megatron_cpu):
    """The chunks the CP ranks hold, gathered rank after rank, put back in sequence order and split again."""
    size, s = 3, 12
    x = torch.arange(s, dtype=torch.float64).view(s, 1, 1, 1)
    parts = split_like_megatron(x, size)
    gathered = torch.cat(parts)
    c = s // (2 * size)
    slot = {chunk: i for i, chunk in enumerate(cp._chunk_order(size))}
    ordered = torch.cat([gathered[slot[g] * c:(slot[g] + 1) * c] for g in range(2 * size)])
    assert ordered.view(-1).tolist() == list(range(s))


def test_the_layer_spec_takes_the_cp_attention_in_place_of_dot_product_attention():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    spec = get_gpt_layer_local_spec()
    for algorithm, module in cp.MODULES.items():
        swapped = cp.cp_layer_spec(spec, algorithm)
        assert swapped.submodules.self_attention.submodules.core_attention is module
        assert swapped.submodules.self_attention.submodules.linear_qkv is \
            spec.submodules.self_attention.submodules.linear_qkv
    assert spec.submodules.self_attention.submodules.core_attention is DotProductAttention


# -- the door ----------------------------------------------------------------------------------------------------

def error(argv, world_size) -> str:
    with pytest.raises(ArgumentError) as info:
        parse_args(argv, world_size=world_size)
    return info.value.message


CP2 = [*TINY, "--train-iters", "2", "--context-parallel-size", "2"]


def test_context_parallel_sizes_the_data_parallel_group():
    args = parse_args([*CP2, "--context-parallel-algo", "megatron_cp_algo"], world_size=4)
    assert (args.context_parallel_size, args.data_parallel_size) == (2, 2)
    args = parse_args([*CP2, "--tensor-model-parallel-size", "2"], world_size=4)
    assert args.data_parallel_size == 1 and args.context_parallel_algo == "ulysses_cp_algo"
    assert error(CP2, world_size=3) == ("pretrain_gpt: error: world size 3 is not divisible by "
                                        "--tensor-model-parallel-size 1 x --pipeline-model-parallel-size 1 x "
                                        "--context-parallel-size 2; use sizes whose product divides 3")


def test_the_door_checks_heads_and_sequence_for_the_algorithm():
    assert error([*CP2, "--context-parallel-size", "8", "--global-batch-size", "2"], world_size=8) == (
        "pretrain_gpt: error: --num-attention-heads 4 is not divisible by --tensor-model-parallel-size 1 x "
        "--context-parallel-size 8 (ulysses_cp_algo gives each CP rank heads / CP of them); use a multiple of 8, "
        "or --context-parallel-algo megatron_cp_algo")
    assert error([*CP2, "--context-parallel-algo", "megatron_cp_algo", "--seq-length", "34",
                  "--max-position-embeddings", "34"], world_size=2) == (
        "pretrain_gpt: error: --seq-length 34 is not divisible by 2 x --context-parallel-size 2 (megatron-core splits "
        "the sequence into 2 x CP chunks for causal load balancing); use a multiple of 4")
    assert error([*CP2, "--context-parallel-algo", "megatron_cp_algo", "--attention-dropout", "0.1"],
                 world_size=2).endswith(
        "--attention-dropout 0.1: attention dropout under ring attention (megatron_cp_algo) is not implemented "
        "here; give --attention-dropout 0, or use ulysses_cp_algo")


def test_what_context_parallelism_refuses_says_why():
    message = error([*CP2, "--context-parallel-algo", "hybrid_cp_algo", "--ulysses-degree-in-cp", "2",
                     "--cp-window-size", "2", "--reset-attention-mask"], world_size=2)
    assert ("--context-parallel-algo hybrid_cp_algo: MindSpeed's hybrid (Ulysses x ring) context parallelism is "
            "not implemented here; use ulysses_cp_algo or megatron_cp_algo") in message
    assert ("--ulysses-degree-in-cp: the Ulysses degree of MindSpeed's hybrid context parallelism, which is not "
            "implemented here") in message
    assert ("--cp-window-size 2: MindSpeed's double-ring attention (windows of the CP ring) is not implemented here; "
            "give --cp-window-size 1 (one ring)") in message
    assert "--reset-attention-mask" not in message  # packed rows under CP: test_cp_packed_documents.py
    for algo, what in (("adaptive_cp_algo", "adaptive"), ("hybrid_adaptive_cp_algo", "hybrid adaptive"),
                       ("kvallgather_cp_algo", "K/V all-gather")):
        assert error([*CP2, "--context-parallel-algo", algo], world_size=2).endswith(
            f"--context-parallel-algo {algo}: MindSpeed's {what} context parallelism is not implemented here; use "
            "ulysses_cp_algo or megatron_cp_algo")


def test_mindspeeds_cp_flags_with_their_meanings():
    args = parse_args([*CP2, "--context-parallel-algo", "megatron_cp_algo", "--use-cp-send-recv-overlap",
                       "--cp-window-size", "1", "--cp-attention-mask-type", "causal"], world_size=2)
    assert args.use_cp_send_recv_overlap and args.cp_window_size == 1 and args.attention_mask_type == "causal"
    assert parse_args([*CP2, "--cp-attention-mask-type", "general"], world_size=2).attention_mask_type == "general"
    # at size 1 the algorithm and its flags configure nothing, as in MindSpeed
    parse_args([*TINY, "--train-iters", "2", "--context-parallel-algo", "hybrid_cp_algo", "--use-cp-send-recv-overlap"])
