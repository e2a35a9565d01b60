"""Rule grouped_matmul on experts written as megatron-core's SequentialMLP writes them: a split by data-dependent
token counts (``.tolist()``: unbacked symbols under Dynamo), one fc1 → activation → fc2 per expert, a cat. The
megatron-core layers themselves: tests/megatron_glue/test_moe_fusions.py."""

import re

import pytest
import torch
import torch.nn.functional as F

from npu_compile.debug.report import collect

H, FFN, EXPERTS, TOKENS = 16, 24, 4, 20


class Experts(torch.nn.Module):
    """fc1 [(2)F, H] and fc2 [H, F] per expert, applied as ``linear`` (mm with the weight's t()), as Megatron's
    linears are; ``glu``: silu(a)·b over fc1's halves (SwiGLU), else gelu. ``chain``: the second expert's input
    is scaled by the first expert's output sum (a dependency between experts, which the rule must not group)."""

    def __init__(self, glu: bool, ffn: int = FFN, widths: tuple[int, ...] | None = None, chain: bool = False):
        super().__init__()
        widths = widths or (ffn,) * EXPERTS
        self.glu, self.chain = glu, chain
        self.fc1 = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(w * (2 if glu else 1), H) / 4) for w in widths])
        self.fc2 = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(H, w) / 4) for w in widths])

    def forward(self, x, tokens_per_expert):
        outs = []
        for i, tokens in enumerate(torch.split(x, tokens_per_expert.tolist())):
            if self.chain and outs:
                tokens = tokens * outs[-1].sum()
            h = F.linear(tokens, self.fc1[i])
            if self.glu:
                a, b = torch.chunk(h, 2, dim=-1)
                h = F.silu(a) * b
            else:
                h = F.gelu(h)
            outs.append(F.linear(h, self.fc2[i]))
        return torch.cat(outs)


def _inputs(counts=(7, 0, 9, 4), seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(sum(counts), H, generator=gen, requires_grad=True), torch.tensor(counts)


def _run(module, x, counts):
    out = module(x, counts)
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(1)))
    grads = [x.grad, *(p.grad for p in module.parameters())]
    return out.detach(), [g.clone() for g in grads]


def _compiled(module, target="reference", fusions=("grouped_matmul",)):
    return torch.compile(module, backend="ascend", fullgraph=True,
                         options={"target": target, "fusions": list(fusions), "cache": False})


@pytest.fixture
def scalars(fresh_dynamo):
    with torch._dynamo.config.patch(capture_scalar_outputs=True, capture_dynamic_output_shape_ops=True):
        yield


def _compare(module, target="reference", counts=(7, 0, 9, 4)):
    x, c = _inputs(counts)
    want, want_grads = _run(module, x, c)
    module.zero_grad(set_to_none=True)
    x2, _ = _inputs(counts)
    with collect() as reports:
        got, got_grads = _run(_compiled(module, target), x2, c)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    (report,) = reports
    return report


@pytest.mark.parametrize("glu", [True, False])
def test_experts_take_one_grouped_matmul_per_layer_and_direction(scalars, glu):
    """fc1 and fc2 forward, and both inputs' gradients: four grouped matmuls; the weights' gradients (a sum over
    each expert's tokens) stay one mm per expert, with the reason; output and every gradient equal eager."""
    torch.manual_seed(0)
    report = _compare(Experts(glu))
    assert report.fusions["grouped_matmul"] == 4
    assert report.lowered_ops.get("npu_compile.grouped_matmul") == 4
    assert report.lowered_ops.get("aten.mm") == 2 * EXPERTS  # the weight gradients
    (declined,) = [u for u in report.unfused if u["rule"] == "grouped_matmul"]
    assert declined["reason"].startswith(f"{2 * EXPERTS} weight-gradient matmuls of the experts (u")
    assert report.graph_breaks == 0


def test_fc1_and_fc2_of_one_shape_are_grouped_apart(scalars):
    """Without GLU and F = H, fc1's and fc2's weights have one shape: the k-th matmul of each expert are grouped
    together (fc1 with fc1), never one expert's fc1 with another's fc2."""
    torch.manual_seed(0)
    report = _compare(Experts(False, ffn=H))
    assert report.fusions["grouped_matmul"] == 4


def test_npu_sim_runs_npu_grouped_matmul(scalars):
    torch.manual_seed(0)
    report = _compare(Experts(True), target="npu-sim")
    assert report.lowered_ops.get("npu.npu_grouped_matmul") == 4
    assert "npu_compile.grouped_matmul" not in report.lowered_ops


def test_new_token_counts_reuse_the_graph(scalars):
    """The counts are data: another routing runs the same compiled graph, grouped, equal to eager."""
    import torch._dynamo.utils as dynamo_utils

    torch.manual_seed(0)
    module = Experts(True)
    compiled = _compiled(module)
    dynamo_utils.counters.clear()
    for counts in ((7, 0, 9, 4), (1, 12, 0, 7), (0, 0, 0, 20)):
        x, c = _inputs(counts)
        want, want_grads = _run(module, x, c)
        module.zero_grad(set_to_none=True)
        got, got_grads = _run(compiled, _inputs(counts)[0], c)
        module.zero_grad(set_to_none=True)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        for g, w in zip(got_grads, want_grads):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    assert dynamo_utils.counters["stats"]["unique_graphs"] == 1


def test_inference_graph_groups_the_forward(scalars):
    torch.manual_seed(0)
    module = Experts(True)
    x, c = _inputs()
    with torch.no_grad(), collect() as reports:
        got = _compiled(module)(x, c)
        want = module(x, c)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    (report,) = reports
    assert report.fusions["grouped_matmul"] == 2


def test_experts_of_different_widths_are_declined_with_the_reason(scalars):
    torch.manual_seed(0)
    report = _compare(Experts(True, widths=(FFN, FFN, FFN, 8)))
    assert report.fusions["grouped_matmul"] == 0
    reasons = {u["reason"] for u in report.unfused if u["rule"] == "grouped_matmul"}
    assert any(r.startswith("the experts of (u") and "do not all have a matmul with a [48, 16] weight "
               "(per expert: [1, 1, 1, 0])" in r for r in reasons), reasons


def test_a_matmul_feeding_another_experts_is_declined_not_a_cycle(scalars):
    torch.manual_seed(0)
    report = _compare(Experts(True, chain=True))
    reasons = {u["reason"] for u in report.unfused if u["rule"] == "grouped_matmul"}
    assert any("one expert's matmul feeds another's" in r for r in reasons), reasons
    assert report.fusions["grouped_matmul"] < 4


def test_the_switch(scalars):
    torch.manual_seed(0)
    module = Experts(True)
    x, c = _inputs()
    with collect() as reports:
        _run(torch.compile(module, backend="ascend", options={"fusions": {"grouped_matmul": False}, "cache": False}),
             x, c)
    (report,) = reports
    assert report.fusions.get("grouped_matmul", 0) == 0
    assert "npu_compile.grouped_matmul" not in report.lowered_ops


def test_under_a_memory_budget_the_grouped_graph_still_equals_eager(scalars):
    """memory_budget 0.3: the min-cut may recompute around the grouped matmuls (priced as matmuls by the cost
    model); the result is eager's."""
    torch.manual_seed(0)
    module = Experts(True)
    x, c = _inputs()
    want, want_grads = _run(module, x, c)
    module.zero_grad(set_to_none=True)
    compiled = torch.compile(module, backend="ascend", fullgraph=True,
                             options={"fusions": ["grouped_matmul"], "memory_budget": 0.3, "cache": False})
    with collect() as reports:
        got, got_grads = _run(compiled, _inputs()[0], c)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    (report,) = reports
    assert report.fusions["grouped_matmul"] == 4


def test_the_cost_model_counts_a_grouped_matmul_as_its_experts_matmuls():
    from npu_compile.device.cost import flops

    graph = torch.fx.Graph()
    xs = [graph.placeholder(f"x{i}") for i in range(2)]
    ws = [graph.placeholder(f"w{i}") for i in range(2)]
    for node, val in zip(xs + ws, [torch.empty(3, 8), torch.empty(5, 8), torch.empty(16, 8), torch.empty(16, 8)]):
        node.meta["val"] = val
    gmm = graph.call_function(torch.ops.npu_compile.grouped_matmul.default, (xs, ws), {"transpose_weight": True})
    gmm.meta["val"] = [torch.empty(3, 16), torch.empty(5, 16)]
    grad = graph.call_function(torch.ops.npu_compile.grouped_matmul_weight_grad.default, (xs, xs),
                               {"transpose_weight": False})
    grad.meta["val"] = [torch.empty(8, 8), torch.empty(8, 8)]
    assert flops(gmm) == 2 * (3 + 5) * 8 * 16
    assert flops(grad) == 2 * (3 + 5) * 8 * 8


# -- rule unpermute: megatron-core's own permute and unpermute (moe_utils), compiled ----------------------------------

def _dispatch(x, probs_logits, w, deterministic: bool):
    """Route by top-2 of the logits, megatron-core's permute, one expert matmul, its unpermute."""
    from megatron.core.transformer.moe.moe_utils import permute, unpermute

    top = probs_logits.topk(2, dim=1).indices
    routing_map = torch.zeros_like(probs_logits, dtype=torch.int32).scatter(1, top, 1).bool()
    permuted, _, sorted_indices = permute(x, routing_map)
    y = permuted @ w
    return unpermute(y, sorted_indices, restore_shape=x.shape, routing_map=routing_map)


@pytest.mark.parametrize("deterministic", [False, True])
def test_megatron_unpermute_becomes_one_op_each_way(scalars, deterministic):
    """scatter_add into zeros (megatron-core's unpermute; index_add_ under deterministic algorithms on 0.16.1) and
    the permute's input gradient (index_add into zeros): two unpermute_tokens, output and gradients eager's."""
    from npu_compile.passes.moe import apply_unpermute  # noqa: F401  (the rule registered)

    gen = torch.Generator().manual_seed(3)
    x, logits, w = (torch.randn(TOKENS, H, generator=gen), torch.randn(TOKENS, EXPERTS, generator=gen),
                    torch.randn(H, H, generator=gen))
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(deterministic)
    try:
        runs = []
        for fn in (_dispatch, torch.compile(_dispatch, backend="ascend", fullgraph=True,
                                            options={"target": "reference", "fusions": ["unpermute"],
                                                     "cache": False})):
            xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
            with collect() as reports:
                out = fn(xs, logits, ws, deterministic)
                out.backward(torch.ones_like(out))
            runs.append((out.detach(), xs.grad, ws.grad, reports))
    finally:
        torch.use_deterministic_algorithms(before)
    (want, *want_grads, _), (got, *got_grads, reports) = runs
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for g, w_ in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w_, rtol=1e-5, atol=1e-6)
    (report,) = reports
    assert report.fusions["unpermute"] == 2
    assert report.lowered_ops.get("aten.scatter_add", 0) == 0 and report.lowered_ops.get("aten.index_add", 0) == 0


def test_unpermute_declines_what_it_cannot_show_is_one(scalars):
    """Rows summed into a tensor that is not fresh zeros, and an index_add with alpha 2: declined with the
    reason; a scatter_add along dim 1 is no candidate (nothing said)."""
    def fn(base, rows, index):
        a = base.index_add(0, index, rows)  # into the input: not zeros
        b = torch.zeros_like(base).index_add(0, index, rows, alpha=2.0)
        c = torch.zeros_like(base).scatter_add(1, index[:4].view(1, 4).expand(base.shape[0], 4), base[:, :4])
        return a + b + c

    base, rows, index = torch.randn(6, H), torch.randn(9, H), torch.tensor([0, 5, 2, 2, 1, 0, 3, 5, 4])
    with collect() as reports:
        out = torch.compile(fn, backend="ascend", fullgraph=True,
                            options={"target": "reference", "fusions": ["unpermute"], "cache": False})(base, rows, index)
    torch.testing.assert_close(out, fn(base, rows, index))
    (report,) = reports
    assert report.fusions.get("unpermute", 0) == 0
    reasons = sorted(u["reason"] for u in report.unfused if u.get("rule") == "unpermute")
    prefix = "not megatron-core's unpermute (rows summed into zeros by one token index): "
    assert reasons == [prefix + "index_add with alpha=2.0",
                       prefix + "the rows are summed into an existing tensor: arg0_1 is not a fresh zeros tensor"], \
        reasons


def test_unpermute_with_a_symbolic_token_count_keeps_its_reference_kernel_on_npu(scalars):
    """dynamic=True: the token count is a symbol; the rule fuses, the npu lowering declines (restore_shape is
    int[] in torch_npu's schema) with that reason, and the graph stays eager-equal for another token count."""
    fn = torch.compile(_dispatch, backend="ascend", dynamic=True,
                       options={"target": "npu-sim", "fusions": ["unpermute"], "cache": False})
    for tokens in (TOKENS, 13):
        gen = torch.Generator().manual_seed(tokens)
        x, logits, w = (torch.randn(tokens, H, generator=gen), torch.randn(tokens, EXPERTS, generator=gen),
                        torch.randn(H, H, generator=gen))
        xs, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
        with collect() as reports:
            out = fn(xs, logits, w, False)
        out.backward(torch.ones_like(out))
        want = _dispatch(x2, logits, w, False)
        want.backward(torch.ones_like(want))
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(xs.grad, x2.grad, rtol=1e-5, atol=1e-6)
        if tokens == TOKENS:
            (report,) = reports
            assert report.fusions["unpermute"] == 2 and report.lowered_ops["npu_compile.unpermute_tokens"] == 2
            reasons = [u["reason"] for u in report.unfused if u["op"] == "npu_compile.unpermute_tokens"]
            assert len(reasons) == 2 and all(re.fullmatch(
                r"npu: npu_moe_token_unpermute_with_routing_map takes restore_shape as int\[\]: the token count and "
                r"hidden size must be static, got \[s\d+, s\d+\]", r) for r in reasons), reasons
        else:
            assert reports == []  # no recompile


# -- rule permute: megatron-core's own permute (moe_utils), compiled ------------------------------------------------

def _permute_dispatch(x, probs_logits, w, with_probs: bool, local: int):
    """Route by top-2 of the logits (megatron-core's scatter of ones at the top-k), its permute (with the probs, as
    the alltoall dispatchers; of a rank's first ``local`` experts, as allgather at EP > 1), one expert matmul
    weighted by the permuted probs, its unpermute."""
    from megatron.core.transformer.moe.moe_utils import permute, unpermute

    scores = probs_logits.softmax(dim=-1)
    top = scores.topk(2, dim=1).indices
    routing_map = torch.zeros_like(probs_logits, dtype=torch.int32).scatter(1, top, 1).bool()[:, :local]
    probs = scores[:, :local] if with_probs else None
    permuted, permuted_probs, sorted_indices = permute(x, routing_map, probs=probs)
    y = permuted @ w
    if with_probs:
        y = y * permuted_probs.unsqueeze(-1)
    return unpermute(y, sorted_indices, restore_shape=x.shape, routing_map=routing_map)


@pytest.mark.parametrize("with_probs,local,target", [(True, EXPERTS, "npu-sim"), (False, EXPERTS, "reference"),
                                                     (True, EXPERTS - 1, "npu-sim")])
def test_megatron_permute_becomes_one_op(scalars, monkeypatch, with_probs, local, target):
    """The permute (index_select of the tokens by the masked_select of their numbers, and the probs'
    masked_select by the same map) is one permute_tokens taking the probs, and topk where the map is the router's
    top-k over every expert; output and the tokens', probs' and weight's gradients eager's. npu-sim: a router's
    top-k map over every expert lowers to npu_moe_token_permute_with_routing_map; a rank's slice of the experts
    (rows of uneven count) keeps the reference kernel, with the reason."""
    from npu_compile.passes import engine, moe

    fused = []

    def recording(graph, mode):
        result = moe.apply_permute(graph, mode)
        fused.extend(n for n in graph.nodes if n.target is torch.ops.npu_compile.permute_tokens.default)
        return result

    monkeypatch.setitem(engine.GRAPH_RULES, "permute", engine.GraphRule("permute", recording))
    gen = torch.Generator().manual_seed(4)
    x, logits, w = (torch.randn(TOKENS, H, generator=gen), torch.randn(TOKENS, EXPERTS, generator=gen),
                    torch.randn(H, H, generator=gen))
    compiled = torch.compile(_permute_dispatch, backend="ascend", fullgraph=True,
                             options={"target": target, "fusions": ["permute"], "cache": False})
    runs = []
    for fn in (_permute_dispatch, compiled):
        xs, ls, ws = x.clone().requires_grad_(), logits.clone().requires_grad_(), w.clone().requires_grad_()
        with collect() as reports:
            out = fn(xs, ls, ws, with_probs, local)
            out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(5)))
        runs.append((out.detach(), xs.grad, ls.grad, ws.grad, reports))
    (want, *want_grads, _), (got, *got_grads, reports) = runs
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for g, w_ in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w_, rtol=1e-5, atol=1e-6)
    (report,) = reports
    assert report.fusions["permute"] == 1
    (op,) = fused
    assert (op.args[3] is not None) == with_probs and op.args[4] == (2 if local == EXPERTS else 0), op.args
    assert report.lowered_ops.get("aten.index_select", 0) == 0
    # the masked_selects stay: they bind the row counts (the index's also feeds the unpermute and the gradient)
    assert report.lowered_ops["aten.masked_select"] == (2 if with_probs else 1)
    if target == "reference":
        assert report.lowered_ops["npu_compile.permute_tokens"] == 1
    elif local == EXPERTS:
        assert report.lowered_ops["npu.npu_moe_token_permute_with_routing_map"] == 1
        assert "npu_compile.permute_tokens" not in report.lowered_ops
    else:
        assert report.lowered_ops["npu_compile.permute_tokens"] == 1
        reasons = [u["reason"] for u in report.unfused if u["op"] == "npu_compile.permute_tokens"]
        assert reasons == [
            "npu: npu_moe_token_permute_with_routing_map without drop_and_pad needs every routing-map row to hold "
            "the same number of experts (topK = num_out_tokens // tokens, DOCS), and this map is not known to (not "
            "a router's top-k scatter over all experts: a rank's slice of the experts, or gathered from other "
            "ranks)"], reasons


def _expert_choice_dispatch(x, logits, w, with_probs: bool, local: int):
    """Each expert takes its top-2 tokens (a top-k along the tokens: a token gets 0 to every expert's rows), then
    megatron-core's permute and unpermute by that map."""
    from megatron.core.transformer.moe.moe_utils import permute, unpermute

    routing_map = torch.zeros_like(logits, dtype=torch.int32).scatter(0, logits.topk(2, dim=0).indices, 1).bool()
    permuted, _, sorted_indices = permute(x, routing_map)
    return unpermute(permuted @ w, sorted_indices, restore_shape=x.shape, routing_map=routing_map)


UNPERMUTE_SLOTS = "npu: unpermute_tokens: sorted_indices in npu_moe_token_unpermute_with_routing_map's slot layout " \
                  "(int32): "


@pytest.mark.parametrize("routing", ["top-k", "a rank's experts", "expert choice"])
def test_unpermute_rows_per_token_and_the_npu_slot_layout(scalars, monkeypatch, routing):
    """The unpermute (and the permute's gradient) takes topk where its index is the masked_select of the token
    numbers by a router's top-k map over every expert, 0 where not (a rank's slice of the experts; a top-k along
    the tokens, with as many tokens as experts so the count alone would pass). npu-sim, which emulates
    npu_moe_token_unpermute_with_routing_map's slot layout: with topk the forward takes the lowered permute's
    sorted_indices and the backward a sort of the row tokens, without it the reference kernel stays with the
    reason; output and gradients eager's either way."""
    from npu_compile.passes import engine, moe

    unpermutes = []

    def recording(graph, mode):
        result = moe.apply_unpermute(graph, mode)
        unpermutes.extend(n for n in graph.nodes if n.target is torch.ops.npu_compile.unpermute_tokens.default)
        return result

    monkeypatch.setitem(engine.GRAPH_RULES, "unpermute", engine.GraphRule("unpermute", recording))
    tokens = EXPERTS if routing == "expert choice" else TOKENS
    fn = _expert_choice_dispatch if routing == "expert choice" else _permute_dispatch
    local = EXPERTS - 1 if routing == "a rank's experts" else EXPERTS
    gen = torch.Generator().manual_seed(6)
    x, logits, w = (torch.randn(tokens, H, generator=gen), torch.randn(tokens, EXPERTS, generator=gen),
                    torch.randn(H, H, generator=gen))
    compiled = torch.compile(fn, backend="ascend", fullgraph=True,
                             options={"target": "npu-sim", "fusions": ["permute", "unpermute"], "cache": False})
    runs = []
    for f in (fn, compiled):
        xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
        with collect() as reports:
            out = f(xs, logits, ws, False, local)
            out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(7)))
        runs.append((out.detach(), xs.grad, ws.grad, reports))
    (want, *want_grads, _), (got, *got_grads, reports) = runs
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for g, w_ in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w_, rtol=1e-5, atol=1e-6)
    (report,) = reports
    assert report.fusions["unpermute"] == 2
    reasons = [u["reason"] for u in report.unfused if u["op"] == "npu_compile.unpermute_tokens"]
    if routing == "top-k":
        assert [n.args[3] for n in unpermutes] == [2, 2]
        assert report.lowered_ops["npu.npu_moe_token_unpermute_with_routing_map"] == 2
        assert reasons == [UNPERMUTE_SLOTS + "the graph's npu_moe_token_permute_with_routing_map's",
                           UNPERMUTE_SLOTS + "a sort of megatron-core's row tokens"], reasons
    else:
        assert [n.args[3] for n in unpermutes] == [0, 0]
        assert report.lowered_ops["npu_compile.unpermute_tokens"] == 2
        assert report.lowered_ops["npu_compile.permute_tokens"] == 1  # topk 0 there too: uneven rows
        assert reasons == 2 * [
            "npu: npu_moe_token_unpermute_with_routing_map without drop_and_pad takes the rows as tokens x topK "
            "slots (sorted_indices: each slot's row, DOCS), and these rows are not known to be topK per token (not "
            "a router's top-k map over all experts: a rank's slice of the experts, or another index)"], reasons


def test_permute_declines_what_it_cannot_show_is_one(scalars):
    """Tokens gathered by a masked_select of something other than their numbers, or by a map over fewer tokens:
    declined with the reason; an index_select by any other index is no candidate (nothing said)."""
    def fn(x, mask, index):
        flipped = torch.arange(x.shape[0]).flip(0).unsqueeze(0).expand(mask.shape[0], -1).masked_select(mask)
        fewer = torch.arange(x.shape[0] - 1).unsqueeze(0).expand(mask.shape[0], -1).masked_select(mask[:, 1:])
        return x.index_select(0, flipped).sum(0) + x.index_select(0, fewer).sum(0) + x.index_select(0, index).sum(0)

    x, mask, index = torch.randn(6, H), torch.rand(3, 6) > 0.5, torch.tensor([0, 5, 2])
    with collect() as reports:
        out = torch.compile(fn, backend="ascend", fullgraph=True,
                            options={"target": "reference", "fusions": ["permute"], "cache": False})(x, mask, index)
    torch.testing.assert_close(out, fn(x, mask, index))
    (report,) = reports
    assert report.fusions.get("permute", 0) == 0
    reasons = sorted(u["reason"] for u in report.unfused if u.get("rule") == "permute")
    prefix = "not megatron-core's permute (tokens gathered by a routing map's masked_select): "
    assert reasons == [prefix + "the masked values (expand) are not each token's number (arange broadcast over "
                                "the experts)",
                       prefix + "the routing map (3, 5) torch.bool is not a bool [experts, tokens] mask over the 6 "
                                "tokens"], reasons
