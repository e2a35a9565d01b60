"""Small graphs that call the fused ops directly, compiled for npu-sim and run beside eager.

Each case is compiled once per test session (:func:`run`): the numerics tests, the report tests and the schema
test (every npu call in these graphs binds to torch-npu's real schemas) share the result. Eager runs the fused
ops' reference kernels, so a case compares the lowered NPU graph, run by the emulator, with an independent
implementation of the same op.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterator
from typing import Any
from unittest import mock

import torch

import npu_compile.ops  # noqa: F401
from npu_compile import lowering
from npu_compile.debug.report import Report, collect
from npu_compile.lowering.npu import graph_modes, torchair_check

F = torch.ops.npu_compile
S, B, N, NKV, D, H = 16, 2, 4, 2, 16, 32


@dataclasses.dataclass(frozen=True)
class Case:
    fn: Callable[..., Any]
    inputs: Callable[[], list]
    lowered_to: tuple[str, ...]  # npu ops the lowered graphs must hold (empty: the case stays unlowered)
    options: dict = dataclasses.field(default_factory=dict)
    eager: Callable[..., Any] | None = None  # what the compiled graph must equal; default fn itself
    tolerance: float = 1e-5  # rtol = atol; bf16 cases round differently in a few places (e.g. dx before + dsum)


@dataclasses.dataclass
class Run:
    report: Report
    graphs: list[torch.fx.GraphModule]
    outputs: list[torch.Tensor]
    grads: list[torch.Tensor | None]
    expected_outputs: list[torch.Tensor]
    expected_grads: list[torch.Tensor | None]
    calls: list[torchair_check.Graph]  # the graphs as target npu's executor would get them, with their plans


def _t(*shape: int, grad: bool = True, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, dtype=dtype).requires_grad_(grad)


def _mask(*shape: int, empty_row: int | None = None) -> torch.Tensor:
    """A random bool mask (True = masked) whose rows all keep their diagonal key, or one row fully masked."""
    mask = torch.rand(*shape) < 0.4
    mask &= ~torch.eye(shape[-2], shape[-1], dtype=torch.bool)
    if empty_row is not None:
        mask[..., empty_row, :] = True
    return mask


def _attention(layout: str, **kw: Any) -> Callable:
    def fn(q, k, v, mask=None, bias=None):
        return F.fused_attention(q, k, v, mask, bias, layout=layout, **kw)[0]
    return fn


def _attention_lse(layout: str, **kw: Any) -> Callable:
    """Both outputs, so the backward gets a gradient of lse (ring attention's merge gives it one); a row with no
    visible key has lse -inf, taken out of the loss."""
    def fn(q, k, v, mask=None):
        out, lse = F.attention_with_lse(q, k, v, mask, layout=layout, **kw)
        return out, torch.where(torch.isinf(lse), 0.0, lse)
    return fn


def _qkv(layout: str, dv: int = D, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    shape = {"sbnd": lambda n, d: (S, B, n, d), "bsnd": lambda n, d: (B, S, n, d), "bnsd": lambda n, d: (B, n, S, d)}
    return [_t(*shape[layout](n, d), dtype=dtype) for n, d in ((N, D), (NKV, D), (NKV, dv))]


def _fast_gelu_eager(x, bias):
    z = x + bias
    return z * torch.sigmoid(1.702 * z)


def _rotary_inputs(rotated: int, grad: bool) -> list[torch.Tensor]:
    angles = torch.rand(S, 1, 1, rotated) * 3
    return [_t(S, B, N, D), angles.cos().requires_grad_(grad), angles.sin().requires_grad_(grad)]


def _ce_inputs(ignore_index: int, dtype: torch.dtype = torch.float32) -> list:
    """[S, B, H] hidden states, a [V = 40, H] output weight, and targets with every third token ignored."""
    target = torch.randint(0, 40, (S, B))
    target.view(-1)[::3] = ignore_index
    return [_t(S, B, H, dtype=dtype), (_t(40, H, grad=False, dtype=dtype) / 4).requires_grad_(), target]


CROSS_ENTROPY = ("npu.npu_cross_entropy_loss", "npu.npu_cross_entropy_loss_backward")


ATTENTION = ("npu.npu_fusion_attention", "npu.npu_fusion_attention_grad")
V3 = ("npu.npu_fusion_attention_v3", "npu.npu_fusion_attention_grad_v3")  # the graph-mode versions (aclgraph)
ACLGRAPH, EAGER = {"graph_mode": "aclgraph"}, {"graph_mode": "eager"}
LAYER_NORM_GE = ("aten.native_layer_norm", "aten.native_layer_norm_backward")
def _varlen(layout: str) -> Callable:
    def fn(q, k, v, cu):
        return F.varlen_attention(q, k, v, cu, layout=layout, scale=0.3)[0]
    return fn


def _documents() -> torch.Tensor:
    """Cumulative ends over B·S = 32 tokens: documents of 3, 9 and 4 in row 0, one of 16 in row 1, an empty one
    (a repeated end), padded with repeats of 32 to a fixed length."""
    return torch.tensor([3, 12, 12, 16, 32, 32, 32, 32])


def _grouped_matmul(transpose: bool) -> Callable:
    def fn(*tensors):
        half = len(tensors) // 2
        return tuple(F.grouped_matmul(list(tensors[:half]), list(tensors[half:]), transpose_weight=transpose))
    return fn


def _experts(rows: tuple[int, ...], transpose: bool, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    """Tokens per expert (rows), hidden H, expert width 2H: x_i [rows_i, H], weights [2H, H] (transposed) or
    [H, 2H]."""
    shape = (2 * H, H) if transpose else (H, 2 * H)
    return [*(_t(r, H, dtype=dtype) for r in rows), *((_t(*shape, dtype=dtype) / 4).detach().requires_grad_()
                                                     for _ in rows)]


GROUPED_MATMUL = ("npu.npu_grouped_matmul",)
UNPERMUTE = ("npu.npu_moe_token_unpermute_with_routing_map",)
TOPK_SOFTMAX = ("npu.npu_moe_gating_top_k_softmax_v2",)
TOPK_GATING = ("npu.npu_moe_gating_top_k",)


def _routed(tokens: int, topk: int, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    """megatron-core's permuted rows: each token's topk copies in expert order (the rows of a routing map's
    columns), [tokens * topk, H], and each row's token (int64, as masked_select gives)."""
    experts = 4
    chosen = torch.rand(tokens, experts).argsort(dim=1)[:, :topk]
    routing_map = torch.zeros(tokens, experts, dtype=torch.bool).scatter(1, chosen, True)
    index = torch.arange(tokens).unsqueeze(0).expand(experts, -1).masked_select(routing_map.t())
    return [_t(tokens * topk, H, dtype=dtype), index]


PERMUTE = ("npu.npu_moe_token_permute_with_routing_map",
           "npu.npu_moe_token_unpermute_with_routing_map")  # the backward's sum of rows into tokens


def _permute_inputs(tokens: int, topk: int, dtype: torch.dtype = torch.float32,
                    probs_dtype: torch.dtype | None = None) -> list[torch.Tensor | None]:
    """Tokens [tokens, H], a router's top-k routing map over 4 experts, and probs of the map's shape (or None)."""
    chosen = torch.rand(tokens, 4).argsort(dim=1)[:, :topk]
    routing_map = torch.zeros(tokens, 4, dtype=torch.bool).scatter(1, chosen, True)
    return [_t(tokens, H, dtype=dtype), routing_map, _t(tokens, 4, dtype=probs_dtype) if probs_dtype else None]


CASES: dict[str, Case] = {
    "permute_tokens": Case(lambda x, m, p: F.permute_tokens(x, m, 12, p, 2),
                           lambda: _permute_inputs(6, 2, probs_dtype=torch.float32), PERMUTE),
    "permute_tokens_bf16": Case(lambda x, m, p: F.permute_tokens(x, m, 15, p, 3),  # float32 probs (DOCS allow)
                                lambda: _permute_inputs(5, 3, torch.bfloat16, torch.float32), PERMUTE,
                                tolerance=2e-2),
    "permute_tokens_no_probs": Case(lambda x, m: F.permute_tokens(x, m, 6, None, 1)[0],
                                    lambda: _permute_inputs(6, 1)[:2], PERMUTE),
    "grouped_matmul_transposed_weights": Case(
        _grouped_matmul(True), lambda: _experts((5, 0, 11, 3), True), GROUPED_MATMUL),
    "grouped_matmul_bf16": Case(
        _grouped_matmul(False), lambda: _experts((4, 9, 2), False, torch.bfloat16), GROUPED_MATMUL, tolerance=2e-2),
    "unpermute_tokens": Case(lambda x, i: F.unpermute_tokens(x, i, 6, 2), lambda: _routed(6, 2), UNPERMUTE),
    "unpermute_tokens_bf16": Case(lambda x, i: F.unpermute_tokens(x, i, 5, 3), lambda: _routed(5, 3, torch.bfloat16),
                                  UNPERMUTE, tolerance=2e-2),
    "topk_softmax": Case(lambda x: F.topk_softmax(x, 2)[0], lambda: [_t(8, 6)], TOPK_SOFTMAX),
    "topk_softmax_bf16": Case(lambda x: F.topk_softmax(x, 3)[0], lambda: [_t(7, 8, dtype=torch.bfloat16)],
                              TOPK_SOFTMAX, tolerance=2e-2),
    # probs and every expert's score (what megatron-core's backward reads): DeepSeek-V3's router scaled down
    "topk_gating_sigmoid_bias_groups": Case(
        lambda x, b: torch.cat(F.topk_gating(x, 4, b, "sigmoid", 4, 2, 2)[0::2], 1),
        lambda: [_t(8, 16), _t(16, grad=False)], TOPK_GATING),
    "topk_gating_pre_softmax": Case(lambda x: torch.cat(F.topk_gating(x, 3, None, "softmax", 0, 0, 0)[0::2], 1),
                                    lambda: [_t(9, 6)], TOPK_GATING),
    "varlen_attention_sbnd_gqa": Case(_varlen("sbnd"), lambda: [*_qkv("sbnd"), _documents()], V3),
    "varlen_attention_bsnd_eager": Case(_varlen("bsnd"), lambda: [*_qkv("bsnd", dv=8), _documents()], V3, EAGER),
    "attention_sbnd_causal_gqa": Case(_attention("sbnd", causal=True), lambda: _qkv("sbnd"), ATTENTION),
    "attention_bsnd_mask_megatron_fill": Case(
        _attention("bsnd", fill=-10000.0), lambda: [*_qkv("bsnd"), _mask(B, 1, S, S)], ATTENTION),
    "attention_bnsd_mask_causal_bias": Case(  # graph_mode ge: GE's converter drops pse, so v3 for aclgraph
        _attention("bnsd", causal=True, scale=0.3),
        lambda: [*_qkv("bnsd", dv=8), _mask(S, S), _t(1, N, S, S, grad=False)], V3),
    "attention_bnsd_mask_causal_bias_eager": Case(
        _attention("bnsd", causal=True, scale=0.3),
        lambda: [*_qkv("bnsd", dv=8), _mask(S, S), _t(1, N, S, S, grad=False)], ATTENTION, EAGER),
    "attention_sbnd_causal_gqa_eager": Case(
        _attention("sbnd", causal=True), lambda: _qkv("sbnd"), ATTENTION, EAGER),
    "attention_sbnd_causal_gqa_aclgraph": Case(_attention("sbnd", causal=True), lambda: _qkv("sbnd"), V3, ACLGRAPH),
    "attention_bsnd_mask_megatron_fill_aclgraph": Case(
        _attention("bsnd", fill=-10000.0), lambda: [*_qkv("bsnd"), _mask(B, 1, S, S)], V3, ACLGRAPH),
    "attention_bnsd_empty_row": Case(
        _attention("bnsd"), lambda: [*_qkv("bnsd"), _mask(B, 1, S, S, empty_row=3)], ATTENTION),
    "attention_sbnd_causal_bf16": Case(
        _attention("sbnd", causal=True), lambda: _qkv("sbnd", dtype=torch.bfloat16), ATTENTION, tolerance=2e-2),
    "attention_bias_grad": Case(  # the forward lowers; the backward keeps its reference kernel
        _attention("bnsd"), lambda: [*_qkv("bnsd"), None, _t(B, N, S, S)], ("npu.npu_fusion_attention_v3",)),
    "attention_lse_sbnd_causal_gqa": Case(_attention_lse("sbnd", causal=True, scale=0.3), lambda: _qkv("sbnd"),
                                          ATTENTION),
    "attention_lse_bsnd_mask_empty_row_eager": Case(
        _attention_lse("bsnd"), lambda: [*_qkv("bsnd"), _mask(B, 1, S, S, empty_row=5)], ATTENTION, EAGER),
    "attention_lse_sbnd_mask_causal_aclgraph": Case(
        _attention_lse("sbnd", causal=True), lambda: [*_qkv("sbnd"), _mask(S, S)], V3, ACLGRAPH),
    "attention_lse_sbnd_causal_bf16": Case(
        _attention_lse("sbnd", causal=True), lambda: _qkv("sbnd", dtype=torch.bfloat16), ATTENTION, tolerance=2e-2),
    "attention_small_fill": Case(_attention("sbnd", fill=-1.0), lambda: [*_qkv("sbnd"), _mask(S, S)], ()),
    "rms_norm": Case(lambda x, w: F.rms_norm(x, w, 1e-5)[0], lambda: [_t(S, B, H), _t(H)],
                     ("npu.npu_rms_norm", "npu.npu_rms_norm_backward")),
    "add_rms_norm": Case(
        lambda x, r, w: (lambda y, _, total: (y, total * 0.5))(*F.add_rms_norm(x, r, w, 1e-5)),
        lambda: [_t(S, B, H), _t(S, B, H), _t(H)], ("npu.npu_add_rms_norm", "npu.npu_rms_norm_backward")),
    "add_rms_norm_bf16": Case(
        lambda x, r, w: (lambda y, _, total: (y, total * 0.5))(*F.add_rms_norm(x, r, w, 1e-5)),
        lambda: [_t(S, B, H, dtype=torch.bfloat16), _t(S, B, H, dtype=torch.bfloat16), _t(H, dtype=torch.bfloat16)],
        ("npu.npu_add_rms_norm", "npu.npu_rms_norm_backward"), tolerance=2e-2),
    # graph_mode aclgraph: the npu kernels; ge: the sum and aten's layer norm (torchair converts those, not these)
    "add_layer_norm": Case(
        lambda x, r, w, b: (lambda y, _m, _r, total: (y, total * 0.5))(*F.add_layer_norm(x, r, w, b, 1e-5)),
        lambda: [_t(S, B, H), _t(S, B, H), _t(H), _t(H)],
        ("npu.npu_add_layer_norm", "npu.npu_add_layer_norm_backward"), ACLGRAPH),
    "add_layer_norm_no_bias": Case(
        lambda x, r, w: F.add_layer_norm(x, r, w, None, 1e-5)[0], lambda: [_t(S, B, H), _t(S, B, H), _t(H)],
        ("npu.npu_add_layer_norm", "npu.npu_add_layer_norm_backward"), ACLGRAPH),
    "add_layer_norm_ge": Case(
        lambda x, r, w, b: (lambda y, _m, _r, total: (y, total * 0.5))(*F.add_layer_norm(x, r, w, b, 1e-5)),
        lambda: [_t(S, B, H), _t(S, B, H), _t(H), _t(H)], LAYER_NORM_GE),
    "add_layer_norm_ge_bf16_no_bias": Case(
        lambda x, r, w: F.add_layer_norm(x, r, w, None, 1e-5)[0],
        lambda: [_t(S, B, H, dtype=torch.bfloat16), _t(S, B, H, dtype=torch.bfloat16), _t(H, dtype=torch.bfloat16)],
        LAYER_NORM_GE, tolerance=2e-2),
    # a weight of another dtype than x (Megatron's bf16 norms beside an fp32 stream, or the reverse): the kernel
    # runs in the wider dtype, both casts exact
    "rms_norm_bf16_x_fp32_weight": Case(
        lambda x, w: F.rms_norm(x, w, 1e-5)[0], lambda: [_t(S, B, H, dtype=torch.bfloat16), _t(H)],
        ("npu.npu_rms_norm", "npu.npu_rms_norm_backward"), tolerance=2e-2),
    "rms_norm_fp32_x_bf16_weight": Case(
        lambda x, w: F.rms_norm(x, w, 1e-5)[0], lambda: [_t(S, B, H), _t(H, dtype=torch.bfloat16)],
        ("npu.npu_rms_norm", "npu.npu_rms_norm_backward"), tolerance=2e-2),
    "bias_gelu_erf": Case(lambda x, b: F.bias_gelu(x, b, "none"), lambda: [_t(S, B, H), _t(H)],
                          ("npu.npu_gelu", "npu.npu_gelu_backward")),
    "bias_gelu_tanh": Case(lambda x, b: F.bias_gelu(x, b, "tanh"), lambda: [_t(S, B, H), _t(H)],
                           ("npu.npu_gelu", "npu.npu_gelu_backward")),
    "bias_gelu_fast_opt_in": Case(
        lambda x, b: F.bias_gelu(x, b, "tanh"), lambda: [_t(S, B, H), _t(H)],
        ("npu.npu_fast_gelu", "npu.npu_fast_gelu_backward"), {"fast_gelu": True}, eager=_fast_gelu_eager),
    "swiglu": Case(lambda x: F.swiglu(x, -1), lambda: [_t(S, B, 2 * H)], ("npu.npu_swiglu", "npu.npu_swiglu_backward")),
    "swiglu_not_contiguous": Case(
        lambda x: F.swiglu(x, -1), lambda: [torch.randn(2 * H, B, S).transpose(0, 2).requires_grad_()], ()),
    "rotary_half": Case(lambda x, c, s: F.rotary(x, c, s, "half"), lambda: _rotary_inputs(D, grad=False),
                        ("npu.npu_rotary_mul", "npu.npu_rotary_mul_backward")),
    "rotary_interleave_partial_cos_grad": Case(
        lambda x, c, s: F.rotary(x, c, s, "interleave"), lambda: _rotary_inputs(D // 2, grad=True),
        ("npu.npu_rotary_mul", "npu.npu_rotary_mul_backward")),
    "linear_cross_entropy_mean_smoothed_chunked": Case(  # ignore_index -100: masked around the kernel
        lambda h, w, t: F.linear_cross_entropy(h, w, t, -100, 0.1, "mean", 7)[0], lambda: _ce_inputs(-100),
        CROSS_ENTROPY),
    "linear_cross_entropy_none_ignore_0": Case(  # ignore_index >= 0: the kernel's own
        lambda h, w, t: F.linear_cross_entropy(h, w, t, 0, 0.0, "none", 0)[0], lambda: _ce_inputs(0), CROSS_ENTROPY),
    "linear_cross_entropy_sum_bf16": Case(
        lambda h, w, t: F.linear_cross_entropy(h, w, t, -1, 0.0, "sum", 10)[0],
        lambda: _ce_inputs(-1, torch.bfloat16), CROSS_ENTROPY, tolerance=2e-2),
    "bias_dropout_add_p0": Case(
        lambda x, b, r: F.bias_dropout_add(x, b, r, 0.0), lambda: [_t(S, B, H), _t(H), _t(S, B, H)], ()),
    "bias_dropout_add_p": Case(
        lambda x, b, r, seed: F.bias_dropout_add(x, b, r, 0.1, seed),
        lambda: [_t(S, B, H), _t(H), _t(S, B, H), torch.tensor(7)], ()),
}


@contextlib.contextmanager
def lowered_graphs(calls: list[torchair_check.Graph] | None = None) -> Iterator[list[torch.fx.GraphModule]]:
    """Every graph lowered inside the block, as it runs (recorded where the backend hands it to its executor);
    ``calls`` gets each one as target npu's executor would get it, with the graph mode target npu plans for it
    (what torchair_check converts)."""
    graphs: list[torch.fx.GraphModule] = []
    target_of = lowering.target

    def recording(name):
        target = target_of(name)

        def record(gm, example_inputs, opts):
            graphs.append(gm)
            if calls is not None:
                plan = graph_modes.plan_graph(gm, opts.graph_mode)
                calls.append(torchair_check.Graph.at_executor(f"graph {len(calls)}", gm, example_inputs,
                                                              plan.graph_mode, plan.reasons))
            return target.executor(gm, example_inputs, opts)

        return dataclasses.replace(target, executor=record)

    with mock.patch.object(lowering, "target", recording):
        yield graphs


def _forward_backward(fn: Callable, inputs: list) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
    out = fn(*inputs)
    outs = list(out) if isinstance(out, tuple) else [out]
    weights = torch.Generator().manual_seed(1)
    loss = sum((o * torch.randn(o.shape, generator=weights)).sum() for o in outs)
    loss.backward()
    return [o.detach() for o in outs], [t.grad if isinstance(t, torch.Tensor) else None for t in inputs]


def _copy(inputs: list) -> list:
    return [t.detach().clone().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) and t.is_floating_point()
            else t for t in inputs]


@functools.cache
def run(name: str, dynamic: bool = False) -> Run:
    """The case compiled for npu-sim and run forward and backward; ``dynamic``: every size symbolic
    (``torch.compile(dynamic=True)``), the last graph compiled being the case's."""
    case = CASES[name]
    torch.manual_seed(0)
    inputs = case.inputs()
    expected = _forward_backward(case.eager or case.fn, _copy(inputs))
    torch._dynamo.reset()
    calls: list[torchair_check.Graph] = []
    with collect() as reports, lowered_graphs(calls) as graphs:
        compiled = torch.compile(case.fn, backend="ascend", dynamic=True if dynamic else None,
                                 options={"target": "npu-sim", **case.options})
        outputs, grads = _forward_backward(compiled, inputs)
    if dynamic:
        # Dynamo may first compile a frame with no tensor ops (its report lowers nothing); the case's is last
        reports = [r for r in reports if r.lowered_ops][-1:]
    (report,) = reports
    for call in calls:
        call.name = f"{name}{' (dynamic)' if dynamic else ''}: {call.name}"
    return Run(report, graphs, outputs, grads, *expected, calls)


def lowered_ops(r: Run) -> set[str]:
    return set(r.report.lowered_ops)
