"""npu_compile::grouped_matmul (and its weight-gradient op) against one torch.mm per expert, in fp64."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.library import opcheck

import npu_compile.ops  # noqa: F401  (importing registers the ops)

from .helpers import assert_matches, fuzz_settings

ops = torch.ops.npu_compile


@st.composite
def expert_cases(draw):
    experts = draw(st.integers(1, 5))
    return dict(
        rows=draw(st.lists(st.integers(0, 9), min_size=experts, max_size=experts)),  # an expert may get no token
        k=draw(st.sampled_from([3, 8, 16])),  # 3: rows of an odd width (12 bytes in fp32)
        n=draw(st.sampled_from([5, 8, 24])),
        transpose=draw(st.booleans()),
        dtype=draw(st.sampled_from([torch.float32, torch.bfloat16])),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


def _inputs(case):
    gen = torch.Generator().manual_seed(case["seed"])
    k, n = case["k"], case["n"]
    x = [torch.randn(r, k, generator=gen) for r in case["rows"]]
    w = [torch.randn(*((n, k) if case["transpose"] else (k, n)), generator=gen) for _ in case["rows"]]
    return x, w


def check_grouped_matmul(case):
    x, w = _inputs(case)
    dtype, transpose = case["dtype"], case["transpose"]
    xs = [t.to(dtype).requires_grad_() for t in x]
    ws = [t.to(dtype).requires_grad_() for t in w]
    ys = ops.grouped_matmul(xs, ws, transpose_weight=transpose)
    # the reference: one mm per expert in fp64 on the same (rounded) inputs
    x64 = [t.detach().double().requires_grad_() for t in xs]
    w64 = [t.detach().double().requires_grad_() for t in ws]
    refs = [a @ (b.t() if transpose else b) for a, b in zip(x64, w64)]
    assert len(ys) == len(refs)
    for y, ref in zip(ys, refs):
        assert y.dtype == dtype and y.shape == ref.shape and y.is_contiguous()
        assert_matches(y, ref, dtype, "y")
    grads = [torch.randn(r.shape, generator=torch.Generator().manual_seed(case["seed"] + 1), dtype=torch.float64)
             for r in refs]
    got = torch.autograd.grad(ys, xs + ws, [g.to(dtype) for g in grads], allow_unused=True)
    want = torch.autograd.grad(refs, x64 + w64, grads, allow_unused=True)
    for g, want_g, inp in zip(got, want, xs + ws):
        assert g is not None and g.dtype == dtype and g.shape == inp.shape
        assert_matches(g, want_g, dtype, "grad")


@settings(max_examples=30)
@given(expert_cases())
def test_grouped_matmul_is_one_mm_per_expert(case):
    check_grouped_matmul(case)


@pytest.mark.fuzz
@fuzz_settings()
@given(expert_cases())
def test_grouped_matmul_is_one_mm_per_expert_fuzz(case):
    check_grouped_matmul(case)


@pytest.mark.parametrize("transpose", [False, True])
def test_grouped_matmul_gradcheck_and_opcheck(transpose):
    gen = torch.Generator().manual_seed(0)
    shape = (6, 4) if transpose else (4, 6)
    x = [torch.randn(r, 4, generator=gen, dtype=torch.float64, requires_grad=True) for r in (3, 0, 2)]
    w = [torch.randn(*shape, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(3)]
    f = lambda *t: tuple(ops.grouped_matmul(list(t[:3]), list(t[3:]), transpose_weight=transpose))  # noqa: E731
    assert torch.autograd.gradcheck(f, (*x, *w))
    x32 = [t.detach().float().requires_grad_() for t in x]
    w32 = [t.detach().float().requires_grad_() for t in w]
    opcheck(ops.grouped_matmul, (x32, w32), {"transpose_weight": transpose})
    opcheck(ops.grouped_matmul_weight_grad, ([t.detach() for t in x32], [torch.randn(r, 6) for r in (3, 0, 2)]),
            {"transpose_weight": transpose})


def _aten_calls(fn):
    """fn's result and the aten ops it ran, by name (the profiler sees inside the custom op's kernel)."""
    from collections import Counter

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        out = fn()
    return out, Counter(e.name for e in prof.events() if e.name.startswith("aten::"))


_COPIES = ("aten::cat", "aten::stack", "aten::clone", "aten::copy_", "aten::_grouped_mm", "aten::contiguous")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("transpose", [False, True])
def test_grouped_matmul_reference_is_torchs_grouped_mm_without_copies(dtype, transpose):
    """The CPU reference kernel gives torch._grouped_mm's values bit for bit (its CPU path is one mm per group) in
    one mm per expert and nothing else: no weight stack, no row concatenation, no output copies (they made the
    compiled MoE step slower than eager, docs/moe.md)."""
    gen = torch.Generator().manual_seed(0)
    rows, k, n = (3, 0, 5), 8, 16
    x = [torch.randn(r, k, generator=gen).to(dtype) for r in rows]
    w = [torch.randn(*((n, k) if transpose else (k, n)), generator=gen).to(dtype) for _ in rows]
    offs = torch.tensor(rows).cumsum(0).to(torch.int32)
    stacked = torch.stack(w).transpose(1, 2) if transpose else torch.stack(w)
    ys, calls = _aten_calls(lambda: ops.grouped_matmul(x, w, transpose_weight=transpose))
    assert calls["aten::mm"] == len(rows) and not [c for c in _COPIES if calls[c]], calls
    assert [tuple(y.shape) for y in ys] == [(r, n) for r in rows]
    assert torch.equal(torch.cat(ys), torch._grouped_mm(torch.cat(x), stacked, offs=offs))
    # the weights' gradients: g_i = x_iᵀ @ grad_y_i (grad_y_iᵀ @ x_i with transpose), grouped along the rows
    grad_y = [torch.randn(r, n, generator=gen).to(dtype) for r in rows]
    gs, calls = _aten_calls(lambda: ops.grouped_matmul_weight_grad(x, grad_y, transpose_weight=transpose))
    assert calls["aten::mm"] == len(rows) and not [c for c in _COPIES if calls[c]], calls
    a, b = (grad_y, x) if transpose else (x, grad_y)
    want = torch._grouped_mm(torch.cat(a).t(), torch.cat(b), offs=offs)
    assert torch.equal(torch.stack(gs), want) and not gs[1].any()  # the expert without tokens: zeros


def test_bad_inputs_name_what_is_wrong():
    x, w = [torch.randn(3, 4)], [torch.randn(4, 5), torch.randn(4, 5)]
    with pytest.raises(ValueError, match=r"one weight per input: 1 inputs, 2 weights"):
        ops.grouped_matmul(x, w)
    with pytest.raises(ValueError, match=r"weights of one shape and dtype: weight\[1\] is \(4, 6\)"):
        ops.grouped_matmul(x * 2, [torch.randn(4, 5), torch.randn(4, 6)])
    with pytest.raises(ValueError, match=r"x\[0\] \(3, 4\) torch.float32 must be \[rows, 5\] torch.float32"):
        ops.grouped_matmul(x, [torch.randn(4, 5)], transpose_weight=True)


# -- unpermute_tokens against megatron-core's own unpermute ----------------------------------------------------------

@st.composite
def routed_cases(draw):
    experts = draw(st.integers(1, 6))
    return dict(
        tokens=draw(st.integers(1, 12)),
        experts=experts,
        topk=draw(st.integers(1, experts)),
        local=draw(st.integers(1, experts)),  # the experts of this rank (allgather at EP > 1: a map's first columns)
        hidden=draw(st.sampled_from([1, 8, 24])),
        dtype=draw(st.sampled_from([torch.float32, torch.bfloat16])),
        deterministic=draw(st.booleans()),  # megatron-core 0.16.1 sums with index_add_ then, else scatter_add_
        seed=draw(st.integers(0, 2**31 - 1)),
    )


def check_unpermute(case):
    """megatron-core's permute of random tokens by a top-k routing map, the experts' rows, then its unpermute
    (``moe_utils.unpermute``, no probs: as every dispatcher calls it) and ours on the same rows and indices:
    output and the rows' gradient."""
    from megatron.core.transformer.moe.moe_utils import permute, unpermute

    gen = torch.Generator().manual_seed(case["seed"])
    tokens, experts, hidden, dtype = case["tokens"], case["experts"], case["hidden"], case["dtype"]
    chosen = torch.rand(tokens, experts, generator=gen).argsort(dim=1)[:, :case["topk"]]
    routing_map = torch.zeros(tokens, experts, dtype=torch.bool).scatter(1, chosen, True)[:, :case["local"]]
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    permuted, *rest = permute(x, routing_map)
    sorted_indices = rest[-1]
    rows = torch.randn(permuted.shape, generator=gen).to(dtype)
    grad = torch.randn(tokens, hidden, generator=gen).to(dtype)
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(case["deterministic"])
    try:
        mine, theirs = rows.clone().requires_grad_(), rows.clone().requires_grad_()
        want = unpermute(theirs, sorted_indices, restore_shape=torch.Size((tokens, hidden)), routing_map=routing_map)
        # topk where every token has its topk rows (a router's map over all experts), as the rule passes it
        got = ops.unpermute_tokens(mine, sorted_indices, tokens, case["topk"] if case["local"] == experts else 0)
        (want_grad,) = torch.autograd.grad(want, theirs, grad)
        (got_grad,) = torch.autograd.grad(got, mine, grad)
    finally:
        torch.use_deterministic_algorithms(before)
    assert got.dtype == dtype and got.shape == (tokens, hidden) and got.is_contiguous()
    # each token is the sum of at most topk rows: the same additions in fp32, the same roundings in bf16
    assert_matches(got, want.float(), torch.float32 if dtype == torch.float32 else dtype, "out")
    assert got_grad.dtype == dtype and torch.equal(got_grad, want_grad)  # a row gather: exact


@settings(max_examples=30)
@given(routed_cases())
def test_unpermute_tokens_is_megatron_cores_unpermute(case):
    check_unpermute(case)


@pytest.mark.fuzz
@fuzz_settings()
@given(routed_cases())
def test_unpermute_tokens_is_megatron_cores_unpermute_fuzz(case):
    check_unpermute(case)


def test_unpermute_tokens_gradcheck_opcheck_and_errors():
    rows = torch.randn(7, 3, dtype=torch.float64, requires_grad=True)
    index = torch.tensor([4, 0, 2, 4, 1, 0, 2])
    torch.autograd.gradcheck(lambda r: ops.unpermute_tokens(r, index, 6), (rows,))
    opcheck(ops.unpermute_tokens, (rows.detach().float().requires_grad_(), index.int(), 6))
    assert ops.unpermute_tokens(rows, index, 6)[[3, 5]].abs().sum() == 0  # tokens no row routes to: zeros
    with pytest.raises(ValueError, match=r"sorted_indices must be a 1-D int64 or int32 tensor \[rows\], got "
                                         r"\(7,\) torch.float32"):
        ops.unpermute_tokens(rows, index.float(), 6)
    with pytest.raises(ValueError, match=r"permuted_tokens must be a 2-D float tensor \[rows, hidden\], got \(7,\)"):
        ops.unpermute_tokens(rows[:, 0], index, 6)
    with pytest.raises(RuntimeError, match="one index per row: 6 indices, 7 rows"):
        ops.unpermute_tokens(rows, index[:6], 6)
    # topk: every token has exactly topk rows (checked), what the npu lowering's slot layout needs
    pairs = torch.tensor([2, 0, 1, 2, 1, 0])
    torch.testing.assert_close(ops.unpermute_tokens(rows[:6], pairs, 3, 2), ops.unpermute_tokens(rows[:6], pairs, 3))
    opcheck(ops.unpermute_tokens, (rows[:6].detach().float().requires_grad_(), pairs, 3, 2))
    with pytest.raises(ValueError, match=r"every one of the 6 tokens must have topk=2 rows, got \[0, 1, 2\]"):
        ops.unpermute_tokens(rows, index, 6, 2)
    with pytest.raises(ValueError, match=r"topk must be >= 0 \(0: rows per token not known\), got -1"):
        ops.unpermute_tokens(rows, index, 6, -1)


# -- permute_tokens against megatron-core's own permute -----------------------------------------------------------

@st.composite
def permute_cases(draw):
    experts = draw(st.integers(1, 6))
    return dict(
        tokens=draw(st.integers(1, 12)),
        experts=experts,
        topk=draw(st.integers(1, experts)),
        local=draw(st.integers(1, experts)),  # a rank's first experts (allgather at EP > 1): rows of uneven count
        hidden=draw(st.sampled_from([1, 8, 24])),
        dtype=draw(st.sampled_from([torch.float32, torch.bfloat16])),
        with_probs=draw(st.booleans()),  # the alltoall dispatchers permute the probs too
        seed=draw(st.integers(0, 2**31 - 1)),
    )


def check_permute(case):
    """megatron-core's ``permute`` (moe_utils, no capacity: as every dispatcher calls it) and ours on the same
    tokens, top-k routing map and probs: the permuted tokens and probs bit for bit (a gather), and the tokens' and
    probs' gradients (the rows' gradients summed back into their tokens: the same sums in fp32)."""
    from megatron.core.transformer.moe.moe_utils import permute

    gen = torch.Generator().manual_seed(case["seed"])
    tokens, experts, hidden, dtype, local = (case["tokens"], case["experts"], case["hidden"], case["dtype"],
                                             case["local"])
    chosen = torch.rand(tokens, experts, generator=gen).argsort(dim=1)[:, :case["topk"]]
    routing_map = torch.zeros(tokens, experts, dtype=torch.bool).scatter(1, chosen, True)[:, :local]
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    probs = torch.rand(tokens, local, generator=gen).to(dtype) if case["with_probs"] else None
    mine = [x.clone().requires_grad_(), probs.clone().requires_grad_() if probs is not None else None]
    theirs = [x.clone().requires_grad_(), probs.clone().requires_grad_() if probs is not None else None]
    want, want_probs, sorted_indices = permute(theirs[0], routing_map, probs=theirs[1])
    topk = case["topk"] if local == experts else 0  # a rank's slice holds uneven counts: not known
    got, got_probs = ops.permute_tokens(mine[0], routing_map, sorted_indices.shape[0], mine[1], topk)
    assert got.dtype == dtype and torch.equal(got, want) and got.is_contiguous()
    grad = torch.randn(want.shape, generator=gen).to(dtype)
    outs_w, outs_g, grads = [want], [got], [grad]
    if probs is not None:
        assert got_probs.dtype == dtype and torch.equal(got_probs, want_probs)
        outs_w.append(want_probs), outs_g.append(got_probs)
        grads.append(torch.randn(want_probs.shape, generator=gen).to(dtype))
    else:
        assert got_probs.shape == (0,)
    inputs_w, inputs_g = [t for t in theirs if t is not None], [t for t in mine if t is not None]
    want_grads = torch.autograd.grad(outs_w, inputs_w, grads)
    got_grads = torch.autograd.grad(outs_g, inputs_g, grads)
    # the tokens' gradient sums at most topk rows (megatron-core: index_select's backward, index_add)
    assert_matches(got_grads[0], want_grads[0].float(), torch.float32 if dtype == torch.float32 else dtype, "grad x")
    if probs is not None:
        assert torch.equal(got_grads[1], want_grads[1])  # a scatter: exact


@settings(max_examples=30)
@given(permute_cases())
def test_permute_tokens_is_megatron_cores_permute(case):
    check_permute(case)


@pytest.mark.fuzz
@fuzz_settings()
@given(permute_cases())
def test_permute_tokens_is_megatron_cores_permute_fuzz(case):
    check_permute(case)


def test_permute_tokens_gradcheck_opcheck_and_errors():
    x = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    probs = torch.rand(5, 4, dtype=torch.float64, requires_grad=True)
    routing_map = torch.zeros(5, 4, dtype=torch.bool).scatter(1, torch.tensor([[0, 2], [1, 3], [2, 0], [3, 1],
                                                                              [0, 1]]), True)
    torch.autograd.gradcheck(lambda a, p: ops.permute_tokens(a, routing_map, 10, p, 2), (x, probs))
    opcheck(ops.permute_tokens, (x.detach().float().requires_grad_(), routing_map, 10, probs.detach().float(), 2))
    opcheck(ops.permute_tokens, (x.detach().float(), routing_map.to(torch.int8), 10, None, 0))
    with pytest.raises(ValueError, match=r"permute_tokens: num_out_tokens=9, but the routing map routes 10 copies"):
        ops.permute_tokens(x, routing_map, 9)
    with pytest.raises(ValueError, match=r"every routing-map row must route to topk=3 experts, got \[2\]"):
        ops.permute_tokens(x, routing_map, 10, topk=3)
    with pytest.raises(ValueError, match=r"routing_map must be a bool or int8 \[5, experts\] map, got \(5, 4\) "
                                         r"torch.float32"):
        ops.permute_tokens(x, routing_map.float(), 10)
    with pytest.raises(ValueError, match=r"probs must be a float tensor of the routing map's shape \(5, 4\), got "
                                         r"\(5, 3\)"):
        ops.permute_tokens(x, routing_map, 10, probs[:, :3])
    with pytest.raises(ValueError, match=r"tokens must be a 2-D float tensor \[tokens, hidden\], got \(5,\)"):
        ops.permute_tokens(x[:, 0], routing_map, 10)
