"""Attention on the npu targets: ``fused_attention`` / ``_backward`` → ``npu_fusion_attention`` / ``_grad``, or
their graph-mode versions ``npu_fusion_attention_v3`` / ``_grad_v3``, chosen by the requested graph mode; ring
attention's step ``attention_with_lse`` / ``_backward`` → the same pair (lse = softmax_max + log(softmax_sum); the
backward's lse gradient through a padded attention_in, :func:`emit_lse_backward`).

Semantics of the torch_npu ops: docs/npu_ops.md. Decisions:

- **Per graph mode** (:func:`attention_variant`; forward and backward choose alike, the choice lands in
  report.json ``unfused`` as a note on each fused op, except in eager):

  - ``eager`` → npu_fusion_attention in SBH / BSH / BNSD (free views of sbnd / bsnd / bnsd), as before.
  - ``ge`` → npu_fusion_attention in BSH or BNSD, where torchair's GE converter takes the call: torchair has a
    converter for npu_fusion_attention / _grad only, none for the _v3 pair
    (torch_npu/dynamo/torchair/_ge_concrete_graph/ge_converter/custom/npu_fusion_attention.py), and it takes
    input_layout BSH or BNSD with keep_prob == 1 and passes no pse (real_shift / pse_shift None). sbnd is
    therefore transposed to BSH in the graph. A call with dropout or pse is out of the converter's reach: it
    takes the aclgraph choice below, and plan_graph demotes the graph to aclgraph (no GE converter for _v3).
  - ``aclgraph`` → npu_fusion_attention_v3 / _grad_v3 in BNSD (transposes in the graph): the constraints of
    npu_fusion_attention say it supports neither graph mode nor aclgraph, and npu_fusion_attention_v3 is
    documented as its graph-mode version, aclgraph supporting input_layout BNSD (torch_npu/_op_plugin_docs.py,
    the entries npu_fusion_attention, 约束说明, and npu_fusion_attention_v3, 功能描述).
  - **Dropout under aclgraph (and ge)**: npu_fusion_attention_v3 takes no seed or offset; it returns the
    Philox seed and offset its generator drew as tensors (its outputs 5 and 6), which npu_fusion_attention_grad_v3
    takes. Lowering runs graph by graph after the partitioner fixed what the forward saves, so the pair travels in
    a slot the partition already has: the call's dropout state. The attention rules draw it as an int64
    (seed, offset) pair (passes.attention.draw_seed) and the partitioner saves it for the backward; the lowered
    forward returns v3's pair in that slot instead (:func:`_save_state`), and the lowered backward passes its two
    halves to grad_v3 as seed and offset. No host read: the graphs stay captured. Where the state cannot carry
    the pair (a 0-dim seed, or one state feeding several calls; :func:`carries_state` decides alike in both
    halves), the call keeps npu_fusion_attention with its seed read on the host (below); plan_graph runs those
    graphs eagerly, and the note says why.
- **Forward and backward lowered graph by graph.** Our ``fused_attention`` already returns what
  npu_fusion_attention_grad needs from the forward: out (its attention_in), softmax_max and softmax_sum with the
  device's definitions (row max of the masked, scaled scores; Σ exp(s − max)), and the seed tensor the backward
  op takes. The partitioner therefore saves exactly the grad's inputs, and each half maps 1:1: the forward keeps
  column 0 of the device's [B, N, Sq, 8] statistics (a view, so the saved statistics still hold all 8
  columns), the backward broadcasts it back to 8 columns (a view; the 8 columns are copies of one value). No
  lse translation is involved and the min-cut partition is untouched. Dropout: the device returns its Philox
  (seed, offset) as host ints, which cannot cross from one compiled graph to the other (torch_npu's meta kernel
  even folds them to 0). Both halves instead read our seed tensor on the host and pass it as
  npu_fusion_attention's ``seed`` (offset 0) and the grad's ``seed``/``offset`` with ``numels`` = B·N·Sq·Skv: the
  same stream each way. Those inputs are new in torch_npu 2.13 and their effect on the device kernel is not
  documented; npu-sim honours them. The host read rules out graph capture: such graphs run eagerly (see
  graph_modes.py).
- **Layouts.** eager: sbnd (Megatron's [s, b, n, d]) → SBH as a free view; bsnd → BSH (the same bytes as BSND,
  and one of the two layouts torchair's GE converter takes); bnsd → BNSD. ge: sbnd → BSH (a transpose, made
  contiguous). v3: all → BNSD. Outputs and gradients are transposed back, contiguous.
- **Masks.** Causal without a mask → sparse_mode 2 with the compressed 2048×2048 upper-triangular mask, as
  MindSpeed does. An explicit bool mask (True = masked, our polarity) → sparse_mode 0, broadcast to one of the
  forms the kernel takes (SS, 11SS, B1SS, BNSS), or-ed with the causal triangle when both apply
  (next_tockens 0). Megatron's ``fill`` (−10000) is taken as removal: exp(fill − max) underflows to exactly 0
  in fp32 once a row has a visible score above fill + 104 (any real score), so the two agree everywhere
  except on fully masked rows, where Megatron averages all values and the device has no such mode. With an
  explicit mask we cannot prove there is no such row, so those calls pass inner_precise=2 (the kernel's
  "invalid row" computation, an empty row's output is 0 rather than undefined); causal-only calls have none and
  keep inner_precise 0.
- **attn_bias** becomes pse = attn_bias / scale (the device adds pse before scaling). Its gradient stays on
  the reference kernel: torch_npu's meta kernel gives dpse no shape. A bias with dropout is left alone in both
  halves, so the forward and backward never draw their dropout from different generators.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from typing import Any

import torch
from torch.fx import Node
from torch.fx.experimental.symbolic_shapes import statically_known_true, sym_or
from npu_compile.config import Options
from npu_compile.lowering.npu.emit import Call, Emitter, Mapping, Outputs, dtype_problem, fused, npu_op, op_name
from npu_compile.ops.layout import bnsd_shape
from npu_compile.ops.varlen_attention import DEVICE_MAX_DOCUMENTS

aten = torch.ops.aten

NPU_LAYOUT = {"sbnd": "SBH", "bsnd": "BSH", "bnsd": "BNSD"}  # eager: each a free view of ours
GE_LAYOUT = {"sbnd": "BSH", "bsnd": "BSH", "bnsd": "BNSD"}  # ge: the layouts torchair's GE converter takes
MAX_TOKENS = 2147483647  # pre_tockens / next_tockens: unbounded
COMPRESSED_MASK_SIZE = 2048
FILL_AS_REMOVAL = -1.0e4  # a fill at or below this leaves exp(fill − max) == 0 in fp32 (see module doc)


@dataclasses.dataclass(frozen=True)
class _Dims:
    b: int
    nq: int
    sq: int
    d: int
    nkv: int
    sk: int
    dv: int


def _attention_dims(c: Call) -> _Dims:
    layout = c["layout"]
    b, nq, sq, d = bnsd_shape(c.val("query").shape, layout)
    _, nkv, sk, _ = bnsd_shape(c.val("key").shape, layout)
    dv = c.val("value").shape[-1]
    return _Dims(b, nq, sq, d, nkv, sk, dv)


def check_attention(c: Call) -> str | None:
    q = c.val("query")
    dims = _attention_dims(c)
    if problem := dtype_problem("npu_fusion_attention", q.dtype):
        return problem
    if dims.d > 768 or dims.dv > dims.d:
        return f"npu_fusion_attention needs head dims Dk >= Dv, Dk <= 768; got Dk={dims.d}, Dv={dims.dv}"
    if dims.nq > 256:
        return f"npu_fusion_attention takes at most 256 query heads, got {dims.nq}"
    if dims.sq > 1 << 20 or dims.sk > 1 << 20:  # symbolic: a guard, the graph serves lengths up to 1M
        return f"npu_fusion_attention takes sequences up to 1M, got {dims.sq}, {dims.sk}"
    fill = c["fill"]
    if fill is not None and fill > FILL_AS_REMOVAL:
        return (f"fill={fill} gives masked positions real weight; npu_fusion_attention removes them, which equals "
                f"a fill only at or below {FILL_AS_REMOVAL}")
    bias = c.val("attn_bias")
    if bias is not None:
        if bias.dtype != q.dtype:
            return f"npu_fusion_attention's pse must have the query's dtype {q.dtype}, got {bias.dtype}"
        if c["dropout_p"] > 0.0:
            return ("attn_bias with dropout: the bias gradient stays on the reference kernel, and its dropout "
                    "mask must come from the same generator as the forward's")
    if c.args.get("bias_grad"):
        return "the gradient of attn_bias (npu_fusion_attention_grad's dpse has no shape in torch_npu's meta kernel)"
    return None


# Each device layout as the order of our 4-D dims (the H layouts then merge n and d).
_DEVICE_ORDER = {"SBH": "sbnd", "BSH": "bsnd", "BNSD": "bnsd"}


def _to_device(em: Emitter, t: Node, layout: str, device_layout: str) -> Node:
    """Our [.., n, d] tensor in ``layout`` as the device's ``device_layout``: a view where the layouts agree on
    the dim order (a copy first where the strides do not allow it), else a transpose made contiguous."""
    order = _DEVICE_ORDER[device_layout]
    if order != layout:
        t = em(aten.permute.default, t, [layout.index(ch) for ch in order])
        t = em(aten.clone.default, t, memory_format=torch.contiguous_format)
    if device_layout == "BNSD":
        return t
    val = t.meta["val"]
    x, y, n, d = val.shape
    # a view needs the n and d dims to merge; with symbolic strides, only where that is provable (no guard)
    if not statically_known_true(sym_or(n == 1, d == 1, val.stride(2) == d * val.stride(3))):
        t = em(aten.clone.default, t, memory_format=torch.contiguous_format)
    return em(aten.view.default, t, [x, y, n * d])


def _from_device(em: Emitter, t: Node, layout: str, device_layout: str, like: torch.Tensor) -> Node:
    """The inverse of :func:`_to_device` for a contiguous device output: ``like``'s shape, contiguous."""
    order = _DEVICE_ORDER[device_layout]
    if device_layout != "BNSD":
        t = em(aten.view.default, t, [like.shape[layout.index(ch)] for ch in order])
    if order != layout:
        t = em(aten.permute.default, t, [order.index(ch) for ch in layout])
        t = em(aten.clone.default, t, memory_format=torch.contiguous_format)
    return t


def _causal_triangle(em: Emitter, sq: Any, sk: Any, device: torch.device) -> Node:
    """The [sq, sk] bool mask above the diagonal, made in the graph (ones, then triu: Fill and Triu in GE). Not a
    buffer of the graph module: torchair's per-node fake pass (npu_fx_compiler.py, _NpuGraphConverter._wrap)
    refuses a real tensor beside the fake ones, in GE and aclgraph alike."""
    ones = em(aten.ones.default, [sq, sk], dtype=torch.bool, device=device)
    return em(aten.triu.default, ones, 1)


def _device_mask(em: Emitter, mask: Node, dims: _Dims) -> Node:
    """A bool mask broadcastable to [b, nq, sq, sk], in one of the forms the kernel takes: SS, 11SS, B1SS, BNSS."""
    shape = tuple(mask.meta["val"].shape)
    if shape == (dims.sq, dims.sk):
        return mask
    shape4 = (1,) * (4 - len(shape)) + shape
    if shape4 != shape:
        mask = em(aten.view.default, mask, list(shape4))
    target = [dims.b, dims.nq, dims.sq, dims.sk] if shape4[1] != 1 else [shape4[0], 1, dims.sq, dims.sk]
    return mask if list(shape4) == target else em(aten.expand.default, mask, target)


def _device_pse(em: Emitter, bias: Node, dims: _Dims, scale: float) -> Node:
    """pse = attn_bias / scale, broadcast to one of BNSS, BN1Skv, 1NSS."""
    shape = tuple(bias.meta["val"].shape)
    shape4 = (1,) * (4 - len(shape)) + shape
    pse = em(aten.div.Tensor, bias, scale)
    if shape4 != shape:
        pse = em(aten.view.default, pse, list(shape4))
    if shape4[0] == 1:
        target = [1, dims.nq, dims.sq, dims.sk]
    else:
        target = [dims.b, dims.nq, 1 if shape4[2] == 1 else dims.sq, dims.sk]
    return pse if list(shape4) == target else em(aten.expand.default, pse, target)


def _attention_arguments(em: Emitter, c: Call, dims: _Dims, scale: float, v3: bool = False) -> dict[str, Any]:
    """The arguments npu_fusion_attention and its grad share: mask, sparse mode, pse, dropout (for the v3 pair
    the caller passes the generator state)."""
    kw: dict[str, Any] = {}
    mask, causal, device = c["attn_mask"], c["causal"], c.val("query").device
    if mask is None and causal:
        kw["atten_mask"] = _causal_triangle(em, COMPRESSED_MASK_SIZE, COMPRESSED_MASK_SIZE, device)
        kw.update(sparse_mode=2, pre_tockens=MAX_TOKENS, next_tockens=0)
    elif mask is not None:
        atten_mask = _device_mask(em, mask, dims)
        if causal:
            triangle = _causal_triangle(em, dims.sq, dims.sk, device)
            atten_mask = em(aten.bitwise_or.Tensor, atten_mask, triangle)
        kw.update(atten_mask=atten_mask, sparse_mode=0, pre_tockens=MAX_TOKENS,
                  next_tockens=0 if causal else MAX_TOKENS, inner_precise=2)
    if c["attn_bias"] is not None:
        kw["pse"] = _device_pse(em, c["attn_bias"], dims, scale)
    p = c["dropout_p"]
    kw["keep_prob"] = 1.0 - p
    if p > 0.0 and not v3:
        seed = c["seed"]
        if tuple(c.val("seed").shape) == (2,):  # a (seed, offset) state (passes.attention.draw_seed)
            kw.update(seed=em.host_int(em(aten.select.int, seed, 0, 0)),
                      offset=em.host_int(em(aten.select.int, seed, 0, 1)))
        else:
            kw.update(seed=em.host_int(seed), offset=0)
    return kw


def _scale(c: Call, dims: _Dims) -> float:
    return 1.0 / math.sqrt(dims.d) if c["scale"] is None else c["scale"]


@dataclasses.dataclass(frozen=True)
class Variant:
    """Which torch_npu attention op pair a call becomes under a graph mode, in which layout, and why."""

    forward: str
    backward: str
    layout: str  # the device's input_layout
    why: str | None  # said in report.json; None: the op's own mode, nothing to explain

    @property
    def v3(self) -> bool:
        return self.forward == "npu_fusion_attention_v3"


_V3_DOC = ("npu_fusion_attention does not support graph mode or aclgraph; npu_fusion_attention_v3 is its graph-mode "
           "version, aclgraph for BNSD only: torch_npu/_op_plugin_docs.py, npu_fusion_attention and "
           "npu_fusion_attention_v3 constraints")
_V3_DROPOUT = ("npu_fusion_attention_v3 takes no seed: it returns the (seed, offset) its generator drew, which "
               "reaches npu_fusion_attention_grad_v3 only through a (seed, offset) state the forward saves for "
               "this call alone")
_GE_DOC = "torchair's GE converter for npu_fusion_attention (ge_converter/custom/npu_fusion_attention.py)"


def carries_state(c: Call) -> bool:
    """Whether the call's dropout state can carry v3's (seed, offset) from forward to backward: an int64 pair
    (passes.attention.draw_seed) that feeds this one attention call of its graph (forward or backward alike), so
    the forward can save the pair its generator drew in that slot (:func:`_save_state`)."""
    seed = c["seed"]
    if not isinstance(seed, Node) or tuple(c.val("seed").shape) != (2,):
        return False
    return sum(u.op == "call_function" and u.target in ROWS for u in seed.users) == 1


def _aclgraph_variant(c: Call, mode: str) -> Variant:
    if c["dropout_p"] > 0.0 and not carries_state(c):
        return Variant("npu_fusion_attention", "npu_fusion_attention_grad", NPU_LAYOUT[c["layout"]],
                       f"graph_mode '{mode}': npu_fusion_attention with its seed read on the host, so the graph "
                       f"runs eagerly ({_V3_DROPOUT})")
    carried = ("; its (seed, offset) saved for npu_fusion_attention_grad_v3 in the call's dropout state"
               if c["dropout_p"] > 0.0 else "")
    return Variant("npu_fusion_attention_v3", "npu_fusion_attention_grad_v3", "BNSD",
                   f"graph_mode '{mode}': npu_fusion_attention_v3 in BNSD, for aclgraph ({_V3_DOC}){carried}")


def attention_variant(c: Call, opts: Options) -> Variant:
    """The ops a forward or backward call becomes under ``opts.graph_mode`` (both halves choose alike)."""
    mode = opts.graph_mode
    if mode == "eager":
        return Variant("npu_fusion_attention", "npu_fusion_attention_grad", NPU_LAYOUT[c["layout"]], None)
    if mode == "ge":
        blockers = [f"keep_prob {1.0 - c['dropout_p']}" if c["dropout_p"] > 0.0 else None,
                    "pse (it drops it)" if c["attn_bias"] is not None else None]
        blockers = [b for b in blockers if b]
        if not blockers:
            layout = GE_LAYOUT[c["layout"]]
            return Variant("npu_fusion_attention", "npu_fusion_attention_grad", layout,
                           f"graph_mode 'ge': npu_fusion_attention in {layout} ({_GE_DOC} takes input_layout BSH or "
                           f"BNSD with keep_prob 1)")
        fallback = _aclgraph_variant(c, "ge")
        return dataclasses.replace(fallback, why=f"{fallback.why}; {_GE_DOC} takes keep_prob 1 without pse, not "
                                                 f"{' and '.join(blockers)}")
    return _aclgraph_variant(c, mode)


NOTES_META = "npu_compile_attention_notes"


def _note(em: Emitter, c: Call, variant: Variant) -> None:
    if variant.why is not None:
        notes = em.gm.meta.setdefault(NOTES_META, {})
        notes[(op_name(c.node.target), f"npu: {variant.why}")] = None


def mode_notes(gm: torch.fx.GraphModule) -> list[dict[str, str]]:
    """report.json ``unfused`` entries saying which attention op each graph mode got, once per (op, reason)."""
    return [{"op": op, "reason": why} for op, why in gm.meta.pop(NOTES_META, {})]


def _save_state(em: Emitter, c: Call, call: Node) -> None:
    """v3's (seed, offset) outputs (its 5th and 6th) as the call's (seed, offset) state, in the slot the forward
    graph returns for the backward: the saved state is what the device drew, and the backward's grad_v3 reads it
    there. In a graph that saves no state (an inference graph) nothing is returned."""
    seed, offset = (em(aten.view.default, em(operator.getitem, call, i), [1]) for i in (4, 5))
    state = em(aten.cat.default, [em.cast(seed, torch.int64), em.cast(offset, torch.int64)])
    (output,) = em.gm.graph.find_nodes(op="output")
    output.args = torch.fx.node.map_arg(output.args, lambda n: state if n is c["seed"] else n)


def emit_attention(em: Emitter, c: Call, opts: Options) -> Outputs:
    layout, dims = c["layout"], _attention_dims(c)
    variant = attention_variant(c, opts)
    _note(em, c, variant)
    scale = _scale(c, dims)
    q, k, v = (_to_device(em, c[n], layout, variant.layout) for n in ("query", "key", "value"))
    call = em(npu_op(variant.forward), q, k, v, dims.nq, variant.layout, scale=scale,
              **_attention_arguments(em, c, dims, scale, v3=variant.v3))
    out, softmax_max, softmax_sum = em.outputs(call, 3)
    if variant.v3 and c["dropout_p"] > 0.0:
        _save_state(em, c, call)
    # Our statistics are [b, n, sq]: column 0 of the device's 8 equal columns.
    return (_from_device(em, out, layout, variant.layout, c.node.meta["val"][0]),
            em(aten.select.int, softmax_max, -1, 0), em(aten.select.int, softmax_sum, -1, 0))


def emit_attention_backward(em: Emitter, c: Call, opts: Options) -> Outputs:
    layout, dims = c["layout"], _attention_dims(c)
    variant = attention_variant(c, opts)
    _note(em, c, variant)
    scale = _scale(c, dims)
    q, k, v, dy, out = (_to_device(em, c[n], layout, variant.layout)
                        for n in ("query", "key", "value", "grad_out", "out"))
    stats = [dims.b, dims.nq, dims.sq, 8]
    softmax_max, softmax_sum = (em(aten.expand.default, em(aten.unsqueeze.default, c[n], -1), stats)
                                for n in ("softmax_max", "softmax_sum"))
    kw = _attention_arguments(em, c, dims, scale, v3=variant.v3)
    if c["dropout_p"] > 0.0 and variant.v3:  # the state the forward's v3 drew (see _save_state)
        kw.update(seed=em(aten.slice.Tensor, c["seed"], 0, 0, 1), offset=em(aten.slice.Tensor, c["seed"], 0, 1, 2))
    elif c["dropout_p"] > 0.0:
        kw.update(numels=dims.b * dims.nq * dims.sq * dims.sk)
    call = em(npu_op(variant.backward), q, k, v, dy, dims.nq, variant.layout,
              softmax_max=softmax_max, softmax_sum=softmax_sum, attention_in=out, scale_value=scale, **kw)
    grads = em.outputs(call, 3)
    return (*(_from_device(em, g, layout, variant.layout, c.val(n)) for g, n in zip(grads, ("query", "key", "value"))),
            None)


# ---- varlen_attention: packed documents → input_layout "TND" ------------------------------------------------

VARLEN_MAX_DOCUMENTS = DEVICE_MAX_DOCUMENTS  # DOCS, npu_fusion_attention constraints: actual_seq_qlen's length
VARLEN_MAX_TOKENS = 1 << 20  # DOCS, same: T (B·S) in 1..1M in varlen
_VARLEN_WHY = ("varlen_attention → npu_fusion_attention_v3 / _grad_v3 in TND: their actual_seq_qlen / "
               "actual_seq_kvlen are tensors (npu_fusion_attention's are int lists, a host read each step); "
               "aclgraph is documented for BNSD only (torch_npu/_op_plugin_docs.py, npu_fusion_attention_v3), so "
               "the graph runs op by op")


def _varlen_dims(c: Call) -> _Dims:
    b, nq, s, d = bnsd_shape(c.val("query").shape, c["layout"])
    _, nkv, _, _ = bnsd_shape(c.val("key").shape, c["layout"])
    return _Dims(b, nq, s, d, nkv, s, c.val("value").shape[-1])


def check_varlen(c: Call) -> str | None:
    dims = _varlen_dims(c)
    if problem := dtype_problem("npu_fusion_attention_v3", c.val("query").dtype):
        return problem
    if dims.d > 768 or dims.dv > dims.d:
        return f"npu_fusion_attention_v3 needs head dims Dk >= Dv, Dk <= 768; got Dk={dims.d}, Dv={dims.dv}"
    if dims.nq > 256:
        return f"npu_fusion_attention_v3 takes at most 256 query heads, got {dims.nq}"
    documents = c.val("cu_seqlens").shape[0]
    if not statically_known_true(documents <= VARLEN_MAX_DOCUMENTS):
        return (f"npu_fusion_attention_v3 takes at most {VARLEN_MAX_DOCUMENTS} entries of actual_seq_qlen in "
                f"varlen, got {documents}")
    if not statically_known_true(dims.b * dims.sq <= VARLEN_MAX_TOKENS):
        return f"npu_fusion_attention_v3 takes T = B·S up to 1M in varlen, got {dims.b * dims.sq}"
    return None


def _to_tnd(em: Emitter, t: Node, layout: str) -> Node:
    """[s, b, n, d] or [b, s, n, d] → [b·s, n, d], row after row (the documents' token order)."""
    if layout == "sbnd":
        t = em(aten.permute.default, t, [1, 0, 2, 3])
    t = em(aten.clone.default, t, memory_format=torch.contiguous_format)
    b, s, n, d = t.meta["val"].shape
    return em(aten.view.default, t, [b * s, n, d])


def _from_tnd(em: Emitter, t: Node, layout: str, like: torch.Tensor) -> Node:
    b, n, s, _ = bnsd_shape(like.shape, layout)
    t = em(aten.view.default, t, [b, s, n, like.shape[-1]])
    if layout == "sbnd":
        t = em(aten.permute.default, t, [1, 0, 2, 3])
        t = em(aten.clone.default, t, memory_format=torch.contiguous_format)
    return t


def _varlen_arguments(em: Emitter, c: Call, dims: _Dims) -> dict[str, Any]:
    """Causal within each document: sparse_mode 2 (leftUpCausal) with the compressed mask, per document, as the
    causal calls above; with a document's query and key lengths equal (self-attention) 3 would be the same.
    softmax_layout "TND": statistics [T, N, 8] (META's shape for TND; DOCS, softmax_layout)."""
    mask = _causal_triangle(em, COMPRESSED_MASK_SIZE, COMPRESSED_MASK_SIZE, c.val("query").device)
    return dict(atten_mask=mask, sparse_mode=2, pre_tockens=MAX_TOKENS, next_tockens=0,
                actual_seq_qlen=c["cu_seqlens"], actual_seq_kvlen=c["cu_seqlens"], softmax_layout="TND")


def emit_varlen(em: Emitter, c: Call, opts: Options) -> Outputs:
    layout, dims = c["layout"], _varlen_dims(c)
    scale = _scale(c, dims)
    q, k, v = (_to_tnd(em, c[n], layout) for n in ("query", "key", "value"))
    call = em(npu_op("npu_fusion_attention_v3"), q, k, v, dims.nq, "TND", scale=scale,
              **_varlen_arguments(em, c, dims))
    out, softmax_max, softmax_sum = em.outputs(call, 3)
    stats = []
    for stat in (softmax_max, softmax_sum):  # [T, N, 8] → column 0 → [b, n, s]
        rows = em(aten.view.default, em(aten.select.int, stat, -1, 0), [dims.b, dims.sq, dims.nq])
        stats.append(em(aten.clone.default, em(aten.permute.default, rows, [0, 2, 1]),
                        memory_format=torch.contiguous_format))
    return (_from_tnd(em, out, layout, c.node.meta["val"][0]), *stats)


def emit_varlen_backward(em: Emitter, c: Call, opts: Options) -> Outputs:
    layout, dims = c["layout"], _varlen_dims(c)
    scale = _scale(c, dims)
    q, k, v, dy, out = (_to_tnd(em, c[n], layout) for n in ("query", "key", "value", "grad_out", "out"))
    stats = []
    for name in ("softmax_max", "softmax_sum"):  # [b, n, s] → [T, N, 8], the one value in every column
        rows = em(aten.clone.default, em(aten.permute.default, c[name], [0, 2, 1]),
                  memory_format=torch.contiguous_format)
        rows = em(aten.view.default, rows, [dims.b * dims.sq, dims.nq, 1])
        stats.append(em(aten.expand.default, rows, [dims.b * dims.sq, dims.nq, 8]))
    call = em(npu_op("npu_fusion_attention_grad_v3"), q, k, v, dy, dims.nq, "TND", softmax_max=stats[0],
              softmax_sum=stats[1], attention_in=out, scale_value=scale, **_varlen_arguments(em, c, dims))
    grads = em.outputs(call, 3)
    return tuple(_from_tnd(em, g, layout, c.val(n)) for g, n in zip(grads, ("query", "key", "value")))


# ---- attention_with_lse: ring attention's step, its lse a differentiable output ------------------------------

_LSE_WHY = ("attention_with_lse's backward → npu_fusion_attention_grad with the head dim padded by one column: "
            "D_i = rowsum(dO ∘ O)_i − dlse_i is passed through attention_in (the grad takes D from "
            "rowsum(dy ∘ attention_in)): q, k, v padded with 0, dy with 1, attention_in with −dlse, the padded "
            "gradient columns dropped")


def _as_attention(c: Call) -> Call:
    """attention_with_lse's call read as fused_attention's: no bias, no dropout, no fill."""
    for name, value in (("attn_bias", None), ("seed", None), ("dropout_p", 0.0), ("fill", None),
                        ("bias_grad", False)):
        c.args.setdefault(name, value)
    return c


def check_lse(c: Call) -> str | None:
    return check_attention(_as_attention(c))


def check_lse_backward(c: Call) -> str | None:
    if problem := check_lse(c):
        return problem
    dims = _attention_dims(c)
    if dims.d + 1 > 768:
        return (f"the lse gradient pads the head dim by one (D_i shifted through attention_in): Dk + 1 <= 768, "
                f"got Dk={dims.d}")
    return None


def emit_lse(em: Emitter, c: Call, opts: Options) -> Outputs:
    """npu_fusion_attention, lse = softmax_max + log(softmax_sum) (a row that sees no key: sum 0, lse −inf)."""
    out, softmax_max, softmax_sum = emit_attention(em, _as_attention(c), opts)
    return out, em(aten.add.Tensor, softmax_max, em(aten.log.default, softmax_sum))


def _pad_column(em: Emitter, t: Node, column: Node | float) -> Node:
    """``t`` [.., d] with one more column: a constant (0 or 1) or the given [..., 1] node."""
    val = t.meta["val"]
    if not isinstance(column, Node):
        make = aten.new_zeros.default if column == 0.0 else aten.new_ones.default
        column = em(make, t, [*val.shape[:-1], 1])
    return em(aten.cat.default, [t, column], -1)


def _rows_in_layout(em: Emitter, rows: Node, layout: str) -> Node:
    """[b, n, s] per-row values → [.., 1] in ``layout``'s order (the shape of an output's column)."""
    order = {"sbnd": [2, 0, 1], "bsnd": [0, 2, 1], "bnsd": [0, 1, 2]}[layout]
    return em(aten.unsqueeze.default, em(aten.permute.default, rows, order), -1)


def emit_lse_backward(em: Emitter, c: Call, opts: Options) -> Outputs:
    """npu_fusion_attention_grad from (max, sum) = (lse, 1), so P = exp(S − lse), with the lse gradient as a
    shift of D through the padded attention_in (_LSE_WHY). An lse of −inf (no visible key) is clamped to fp32's
    lowest: every score of that row is removed, so P stays 0."""
    c = _as_attention(c)
    layout, dims = c["layout"], _attention_dims(c)
    variant = attention_variant(c, opts)
    _note(em, c, variant)
    scale = _scale(c, dims)
    out_dtype = c.val("out").dtype
    shift = em.cast(em(aten.neg.default, _rows_in_layout(em, c["grad_lse"], layout)), out_dtype)
    padded = {"query": _pad_column(em, c["query"], 0.0), "key": _pad_column(em, c["key"], 0.0),
              "value": _pad_column(em, c["value"], 0.0), "grad_out": _pad_column(em, c["grad_out"], 1.0),
              "out": _pad_column(em, c["out"], shift)}
    q, k, v, dy, out = (_to_device(em, padded[n], layout, variant.layout)
                        for n in ("query", "key", "value", "grad_out", "out"))
    stats = [dims.b, dims.nq, dims.sq, 8]
    lse = em(aten.clamp_min.default, c["lse"], torch.finfo(torch.float32).min)
    softmax_max = em(aten.expand.default, em(aten.unsqueeze.default, lse, -1), stats)
    softmax_sum = em(aten.new_ones.default, softmax_max, stats)
    kw = _attention_arguments(em, c, dims, scale, v3=variant.v3)
    call = em(npu_op(variant.backward), q, k, v, dy, dims.nq, variant.layout,
              softmax_max=softmax_max, softmax_sum=softmax_sum, attention_in=out, scale_value=scale, **kw)
    grads = []
    for g, name in zip(em.outputs(call, 3), ("query", "key", "value")):
        g = _from_device(em, g, layout, variant.layout, padded[name].meta["val"])
        width = c.val(name).shape[-1]
        grads.append(em(aten.clone.default, em(aten.slice.Tensor, g, -1, 0, width),
                        memory_format=torch.contiguous_format))
    return tuple(grads)


ROWS = {
    fused.varlen_attention.default: Mapping(("npu_fusion_attention_v3",), check_varlen, emit_varlen,
                                            note=lambda c: _VARLEN_WHY),
    fused.varlen_attention_backward.default: Mapping(("npu_fusion_attention_grad_v3",), check_varlen,
                                                     emit_varlen_backward, note=lambda c: _VARLEN_WHY),
    fused.fused_attention.default: Mapping(("npu_fusion_attention",), check_attention, emit_attention),
    fused.fused_attention_backward.default: Mapping(
        ("npu_fusion_attention_grad",), check_attention, emit_attention_backward),
    fused.attention_with_lse.default: Mapping(("npu_fusion_attention",), check_lse, emit_lse),
    fused.attention_with_lse_backward.default: Mapping(("npu_fusion_attention_grad",), check_lse_backward,
                                                       emit_lse_backward, note=lambda c: _LSE_WHY),
}
