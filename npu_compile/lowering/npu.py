"""Target ``npu``: every fused op becomes the torch_npu call Ascend runs, and torchair runs the graph.

:data:`TABLE` maps each ``npu_compile`` op to one :class:`Mapping`: a check (can the NPU take this node? if
not, why) and an emitter (the ``torch.ops.npu`` calls, plus the views and casts that fit them to the op's
outputs). A node whose check fails keeps its reference kernel, which is plain torch and runs on the NPU too;
the reason goes to report.json ``unfused``. npu-sim (npu_sim.py) lowers with this very table, so the graph
proven on the CPU is the graph the NPU runs.

Semantics of the torch_npu ops: shared/research/anchors.md section C. Decisions:

- **Attention, forward and backward lowered graph by graph.** Our ``fused_attention`` already returns what
  npu_fusion_attention_grad needs from the forward: out (its attention_in), softmax_max and softmax_sum with the
  device's definitions (row max of the masked, scaled scores; Σ exp(s − max)), and the seed tensor the backward
  op takes. The partitioner therefore saves exactly the grad's inputs, and each half maps 1:1: the forward keeps
  column 0 of the device's [B, N, Sq, 8] statistics (a view, so the saved statistics still hold all 8
  columns), the backward broadcasts it back to 8 columns (a view; the 8 columns are copies of one value). No lse translation is involved and the min-cut partition is
  untouched. Dropout: the device returns its Philox (seed, offset) as host ints, which cannot cross from one
  compiled graph to the other (torch_npu's meta kernel even folds them to 0). Both halves instead read our seed
  tensor on the host and pass it as npu_fusion_attention's ``seed`` (offset 0) and the grad's ``seed``/``offset``
  with ``numels`` = B·N·Sq·Skv: the same stream each way. Those inputs are new in torch_npu 2.13 and their
  effect on the device kernel is not documented; npu-sim honours them. The host read rules out graph capture:
  such graphs run eagerly (see :func:`plan_graph`).
- **Layouts.** sbnd (Megatron's [s, b, n, d]) → SBH as a free view; bsnd → BSH (the same bytes as BSND, and
  one of the two layouts torchair's GE converter takes); bnsd → BNSD.
- **Masks.** Causal without a mask → sparse_mode 2 with the compressed 2048×2048 upper-triangular mask, as
  MindSpeed does. An explicit bool mask (True = masked, our polarity) → sparse_mode 0, broadcast to one of the
  forms the kernel takes (SS, 11SS, B1SS, BNSS), or-ed with the causal triangle when both apply
  (next_tockens 0). Megatron's ``fill`` (−10000) is taken as removal: exp(fill − max) underflows to exactly 0
  in fp32 once a row has a visible score above fill + 104 (any real score), so the two agree everywhere
  except on fully masked rows, where Megatron averages all values and the device has no such mode. With an explicit mask we cannot prove there is
  no such row, so those calls pass inner_precise=2 (the kernel's "invalid row" computation, an empty row's
  output is 0 rather than undefined); causal-only calls have none and keep inner_precise 0.
- **attn_bias** becomes pse = attn_bias / scale (the device adds pse before scaling). Its gradient stays on
  the reference kernel: torch_npu's meta kernel gives dpse no shape. A bias with dropout is left alone in both
  halves, so the forward and backward never draw their dropout from different generators.
- **Norms.** npu_add_rms_norm has no backward in torch_npu: ours is npu_rms_norm_backward plus the gradient
  reaching the sum. npu_add_layer_norm_backward takes x1 and x2 but our op saves only their sum: x2 is a
  broadcast zero (no memory). dgamma comes back in fp32 and is cast to the weight's dtype.
- **GeLU.** bias_gelu → add + npu_gelu with the same ``approximate``. npu_fast_gelu (x·σ(1.702x)) is another
  function: only with the option ``fast_gelu=True``.
- **bias_dropout_add** has no torch_npu op: with p == 0 it becomes plain adds; with p > 0 it keeps its
  reference kernel (its mask is regenerated from our seed by our counter RNG, which no device call reproduces).
  Either way report.json says so.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.fx import GraphModule, Node
from torch.fx.experimental.symbolic_shapes import statically_known_true, sym_or
from torch.fx.node import map_arg

import npu_compile.ops  # noqa: F401  (registers torch.ops.npu_compile, the ops lowered from)
from npu_compile.executor import boxed_executor
from npu_compile.sizes import SizeNodes, hint, is_static

aten = torch.ops.aten
fused = torch.ops.npu_compile

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
NPU_LAYOUT = {"sbnd": "SBH", "bsnd": "BSH", "bnsd": "BNSD"}
MAX_TOKENS = 2147483647  # pre_tockens / next_tockens: unbounded
COMPRESSED_MASK_SIZE = 2048
FILL_AS_REMOVAL = -1.0e4  # a fill at or below this leaves exp(fill − max) == 0 in fp32 (see module doc)
PLAN_META = "npu_compile_graph_plan"


def npu_op(name: str) -> torch._ops.OpOverload:
    """``torch.ops.npu.<name>.default``: torch_npu's op on the NPU, npu-sim's emulation elsewhere."""
    return getattr(torch.ops.npu, name).default


# ==== the call being lowered, and the emitter of its replacement ===============================================

class Call:
    """A fused-op node's arguments by schema name (defaults filled in) and their FakeTensor values."""

    def __init__(self, node: Node):
        self.node = node
        self.args: dict[str, Any] = {}
        for i, arg in enumerate(node.target._schema.arguments):
            if not arg.kwarg_only and i < len(node.args):
                self.args[arg.name] = node.args[i]
            elif arg.name in node.kwargs:
                self.args[arg.name] = node.kwargs[arg.name]
            else:
                self.args[arg.name] = arg.default_value if arg.has_default_value() else None

    def __getitem__(self, name: str) -> Any:
        return self.args[name]

    def val(self, name: str) -> Any:
        """The argument's FakeTensor (tensor arguments) or its value."""
        arg = self.args[name]
        return arg.meta.get("val") if isinstance(arg, Node) else arg

    def missing_metadata(self) -> bool:
        return any(isinstance(a, Node) and not isinstance(a.meta.get("val"), torch.Tensor) for a in self.args.values())


class Emitter:
    """Inserts the replacement of one node in front of it, giving each new node its FakeTensor value.

    Sizes may be SymInts (a graph with dynamic shapes): each one in the arguments becomes a node computing it
    from the graph's inputs (``sizes``, shared by the graph's emitters), so emitters write sizes as they read
    them off FakeTensors."""

    def __init__(self, gm: GraphModule, node: Node, fake_mode: Any, sizes: SizeNodes | None = None):
        self.gm, self.node, self.fake_mode = gm, node, fake_mode
        self.sizes = sizes if sizes is not None else SizeNodes(gm.graph)
        self.emitted: list[Node] = []
        self.host_values: dict[Node, int] = {}  # stand-ins, for shape propagation only, of ints read on the host

    def __call__(self, target: Callable, *args: Any, **kwargs: Any) -> Node:
        args, kwargs = self.sizes.materialize(args), self.sizes.materialize(kwargs)
        with self.gm.graph.inserting_before(self.node):
            new = self.gm.graph.call_function(target, args, kwargs)
        for key in ("stack_trace", "nn_module_stack", "source_fn_stack", "seq_nr"):
            if key in self.node.meta:
                new.meta[key] = self.node.meta[key]
        val = self._fake(target, args, kwargs)
        if val is not None:
            new.meta["val"] = val
        self.emitted.append(new)
        return new

    def _fake(self, target: Callable, args: tuple, kwargs: dict) -> Any:
        if self.fake_mode is None and target is not operator.getitem:
            return None
        missing = []

        def value(n: Node) -> Any:
            if n in self.host_values:
                return self.host_values[n]
            if "val" not in n.meta:
                missing.append(n)
            return n.meta.get("val")

        fake_args, fake_kwargs = map_arg((args, kwargs), value)
        if missing:
            return None
        if target is operator.getitem:
            return target(*fake_args)
        if getattr(target, "namespace", None) == "npu":
            # torch_npu's schemas type sizes such as numels as int, not SymInt: a SymInt there would be
            # specialized (a guard fixing the length); no output shape depends on them, so the hint stands in
            fake_args, fake_kwargs = (tuple(_hinted(a) for a in fake_args),
                                      {k: _hinted(v) for k, v in fake_kwargs.items()})
        with self.fake_mode:
            return target(*fake_args, **fake_kwargs)

    def outputs(self, node: Node, count: int) -> list[Node]:
        return [self(operator.getitem, node, i) for i in range(count)]

    def host_int(self, tensor: Node) -> Node:
        """The Python int inside a 0-dim tensor (a host read: the graph can no longer be captured)."""
        with self.gm.graph.inserting_before(self.node):
            new = self.gm.graph.call_function(aten._local_scalar_dense.default, (tensor,))
        self.host_values[new] = 0
        self.emitted.append(new)
        return new

    def constant(self, name: str, make: Callable[[torch.device], torch.Tensor], device: torch.device) -> Node:
        """A tensor the graph module holds (one per name), e.g. the compressed causal mask."""
        if not hasattr(self.gm, name):
            from torch._subclasses.fake_tensor import unset_fake_temporarily

            with unset_fake_temporarily():
                self.gm.register_buffer(name, make(device))
        with self.gm.graph.inserting_before(self.node):
            new = self.gm.graph.get_attr(name)
        if self.fake_mode is not None:
            new.meta["val"] = self.fake_mode.from_tensor(getattr(self.gm, name), static_shapes=True)
        self.emitted.append(new)
        return new

    def cast(self, node: Node, dtype: torch.dtype) -> Node:
        if node.meta["val"].dtype == dtype:
            return node
        return self(aten._to_copy.default, node, dtype=dtype)

    def sum_to(self, node: Node, shape: Sequence[int], dtype: torch.dtype) -> Node:
        """``node`` summed (in fp32) down to ``shape``, which broadcasts to it, then cast to ``dtype``."""
        src = tuple(node.meta["val"].shape)
        lead = len(src) - len(shape)
        dims = list(range(lead)) + [lead + i for i, s in enumerate(shape) if s == 1 and src[lead + i] != 1]
        acc = torch.float64 if node.meta["val"].dtype == torch.float64 else torch.float32
        total = self(aten.sum.dim_IntList, node, dims, True, dtype=acc) if dims else self.cast(node, acc)
        if tuple(total.meta["val"].shape) != tuple(shape):
            total = self(aten.view.default, total, list(shape))
        if total is node:  # nothing summed, nothing cast: a gradient must be a tensor of its own
            total = self(aten.clone.default, node)
        return self.cast(total, dtype)

    def drop_unused(self) -> None:
        """Remove emitted nodes nobody reads (e.g. statistics an inference graph never saves)."""
        for n in reversed(self.emitted):
            if not n.users and n.graph is self.gm.graph:
                self.gm.graph.erase_node(n)


def _hinted(value: Any) -> Any:
    return hint(value) if isinstance(value, torch.SymInt) else value


Outputs = Sequence[Node | None]  # one per fused-op output; None: an empty [0] placeholder (a grad not asked for)


@dataclasses.dataclass(frozen=True)
class Mapping:
    """One fused op on the NPU: the torch_npu ops it becomes, when it can, and how."""

    calls: tuple[str, ...]
    check: Callable[[Call], str | None]  # None: take it; else why not
    emit: Callable[[Emitter, Call, Any], Outputs]  # (emitter, call, options) -> the op's outputs
    note: Callable[[Call], str | None] = lambda c: None  # said in report.json even when taken


def _dtype_problem(name: str, dtype: torch.dtype) -> str | None:
    if dtype not in FLOAT_DTYPES:
        return f"{name} takes float16, bfloat16 or float32, got {dtype}"
    return None


# ==== attention ================================================================================================

@dataclasses.dataclass(frozen=True)
class _Dims:
    b: int
    nq: int
    sq: int
    d: int
    nkv: int
    sk: int
    dv: int


def _bnsd_shape(t: torch.Tensor, layout: str) -> tuple[int, int, int, int]:
    s = tuple(t.shape)
    return {"bnsd": s, "sbnd": (s[1], s[2], s[0], s[3]), "bsnd": (s[0], s[2], s[1], s[3])}[layout]


def _attention_dims(c: Call) -> _Dims:
    layout = c["layout"]
    b, nq, sq, d = _bnsd_shape(c.val("query"), layout)
    _, nkv, sk, _ = _bnsd_shape(c.val("key"), layout)
    dv = c.val("value").shape[-1]
    return _Dims(b, nq, sq, d, nkv, sk, dv)


def check_attention(c: Call) -> str | None:
    q = c.val("query")
    dims = _attention_dims(c)
    if problem := _dtype_problem("npu_fusion_attention", q.dtype):
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


def _heads_flat(em: Emitter, t: Node, layout: str) -> Node:
    """[x, y, n, d] → [x, y, n·d] for the H layouts (a view where the strides allow, else a copy first)."""
    if layout == "bnsd":
        return t
    val = t.meta["val"]
    x, y, n, d = val.shape
    # a view needs the n and d dims to merge; with symbolic strides, only where that is provable (no guard)
    if not statically_known_true(sym_or(n == 1, d == 1, val.stride(2) == d * val.stride(3))):
        t = em(aten.clone.default, t, memory_format=torch.contiguous_format)
    return em(aten.view.default, t, [x, y, n * d])


def _heads_split(em: Emitter, t: Node, layout: str, like: torch.Tensor) -> Node:
    """The inverse of :func:`_heads_flat` for a contiguous device output: the shape of ``like``."""
    return t if layout == "bnsd" else em(aten.view.default, t, list(like.shape))


def _causal_triangle(sq: int, sk: int) -> Callable[[torch.device], torch.Tensor]:
    return lambda device: torch.ones(sq, sk, dtype=torch.bool, device=device).triu(1)


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


def _attention_arguments(em: Emitter, c: Call, dims: _Dims, scale: float) -> dict[str, Any]:
    """The arguments npu_fusion_attention and its grad share: mask, sparse mode, pse, dropout."""
    kw: dict[str, Any] = {}
    mask, causal, device = c["attn_mask"], c["causal"], c.val("query").device
    if mask is None and causal:
        kw["atten_mask"] = em.constant(
            "npu_compressed_causal_mask", _causal_triangle(COMPRESSED_MASK_SIZE, COMPRESSED_MASK_SIZE), device)
        kw.update(sparse_mode=2, pre_tockens=MAX_TOKENS, next_tockens=0)
    elif mask is not None:
        atten_mask = _device_mask(em, mask, dims)
        if causal:
            if is_static(dims.sq) and is_static(dims.sk):
                triangle = em.constant(f"npu_causal_mask_{dims.sq}x{dims.sk}", _causal_triangle(int(dims.sq), int(dims.sk)),
                                       device)
            else:  # sizes known only at run time: the triangle is made there
                ones = em(aten.ones.default, [dims.sq, dims.sk], dtype=torch.bool, device=device)
                triangle = em(aten.triu.default, ones, 1)
            atten_mask = em(aten.bitwise_or.Tensor, atten_mask, triangle)
        kw.update(atten_mask=atten_mask, sparse_mode=0, pre_tockens=MAX_TOKENS,
                  next_tockens=0 if causal else MAX_TOKENS, inner_precise=2)
    if c["attn_bias"] is not None:
        kw["pse"] = _device_pse(em, c["attn_bias"], dims, scale)
    p = c["dropout_p"]
    kw["keep_prob"] = 1.0 - p
    if p > 0.0:
        kw.update(seed=em.host_int(c["seed"]), offset=0)
    return kw


def _scale(c: Call, dims: _Dims) -> float:
    return 1.0 / math.sqrt(dims.d) if c["scale"] is None else c["scale"]


def emit_attention(em: Emitter, c: Call, opts: Any) -> Outputs:
    layout, dims = c["layout"], _attention_dims(c)
    scale = _scale(c, dims)
    q, k, v = (_heads_flat(em, c[n], layout) for n in ("query", "key", "value"))
    call = em(npu_op("npu_fusion_attention"), q, k, v, dims.nq, NPU_LAYOUT[layout], scale=scale,
              **_attention_arguments(em, c, dims, scale))
    out, softmax_max, softmax_sum = em.outputs(call, 3)
    # Our statistics are [b, n, sq]: column 0 of the device's 8 equal columns.
    return (_heads_split(em, out, layout, c.node.meta["val"][0]),
            em(aten.select.int, softmax_max, -1, 0), em(aten.select.int, softmax_sum, -1, 0))


def emit_attention_backward(em: Emitter, c: Call, opts: Any) -> Outputs:
    layout, dims = c["layout"], _attention_dims(c)
    scale = _scale(c, dims)
    q, k, v, dy, out = (_heads_flat(em, c[n], layout) for n in ("query", "key", "value", "grad_out", "out"))
    stats = [dims.b, dims.nq, dims.sq, 8]
    softmax_max, softmax_sum = (em(aten.expand.default, em(aten.unsqueeze.default, c[n], -1), stats)
                                for n in ("softmax_max", "softmax_sum"))
    kw = _attention_arguments(em, c, dims, scale)
    if c["dropout_p"] > 0.0:
        kw.update(numels=dims.b * dims.nq * dims.sq * dims.sk)
    call = em(npu_op("npu_fusion_attention_grad"), q, k, v, dy, dims.nq, NPU_LAYOUT[layout],
              softmax_max=softmax_max, softmax_sum=softmax_sum, attention_in=out, scale_value=scale, **kw)
    grads = em.outputs(call, 3)
    return (*(_heads_split(em, g, layout, c.val(n)) for g, n in zip(grads, ("query", "key", "value"))), None)


# ==== norms ====================================================================================================

def _norm_check(x: torch.Tensor, *params: torch.Tensor | None) -> str | None:
    if problem := _dtype_problem("the npu norm kernels", x.dtype):
        return problem
    for p in params:
        if p is not None and p.dtype != x.dtype:
            return f"weight/bias dtype {p.dtype} differs from x's {x.dtype}; the npu norm kernels take one dtype"
    return None


def check_rms_norm(c: Call) -> str | None:
    return _norm_check(c.val("x"), c.val("weight"))


def check_add_norm(c: Call) -> str | None:
    x = c.val("x") if "x" in c.args else c.val("total")  # the backward ops take the saved sum
    if "residual" in c.args and c.val("residual").dtype != x.dtype:  # an fp32 residual stream
        return (f"x {x.dtype} and residual {c.val('residual').dtype} differ; the npu add-norm kernels take one "
                "dtype for both summands")
    bias = c.val("bias") if "bias" in c.args else None
    return _norm_check(x, c.val("weight"), bias)


def emit_rms_norm(em: Emitter, c: Call, opts: Any) -> Outputs:
    return em.outputs(em(npu_op("npu_rms_norm"), c["x"], c["weight"], c["eps"]), 2)


def emit_rms_norm_backward(em: Emitter, c: Call, opts: Any) -> Outputs:
    grad_x, grad_weight = em.outputs(
        em(npu_op("npu_rms_norm_backward"), c["grad_y"], c["x"], c["weight"], c["rstd"]), 2)
    return grad_x, em.cast(grad_weight, c.val("weight").dtype)  # the device gives dgamma in fp32


def emit_add_rms_norm(em: Emitter, c: Call, opts: Any) -> Outputs:
    return em.outputs(em(npu_op("npu_add_rms_norm"), c["x"], c["residual"], c["weight"], c["eps"]), 3)


def emit_add_rms_norm_backward(em: Emitter, c: Call, opts: Any) -> Outputs:
    grad_x, grad_weight = em.outputs(
        em(npu_op("npu_rms_norm_backward"), c["grad_y"], c["total"], c["weight"], c["rstd"]), 2)
    if c["grad_sum"] is not None:  # the gradient that reached the sum from the next block
        grad_x = em(aten.add.Tensor, grad_x, c["grad_sum"])
    return grad_x, em.cast(grad_weight, c.val("weight").dtype)


def emit_add_layer_norm(em: Emitter, c: Call, opts: Any) -> Outputs:
    beta = c["bias"] if c["bias"] is not None else em(aten.zeros_like.default, c["weight"])
    x = c.val("x")
    if x.dtype in (torch.bfloat16, torch.float16):
        # The kernel normalizes its fp32-internal sum but returns the sum rounded, and the backward sees only
        # that rounded sum: its x̂ would disagree with the saved mean / rstd by the rounding, which the mean's
        # subtraction amplifies (a bf16 GPT's gradients came out 2-3x eager's error against fp32). So in half
        # precision the sum is rounded first, as eager and our op do, and the kernel normalizes that.
        total = em(aten.add.Tensor, c["x"], c["residual"])
        zero = em(aten.expand.default, em(aten.new_zeros.default, total, []), list(x.shape))
        y, mean, rstd, _ = em.outputs(
            em(npu_op("npu_add_layer_norm"), total, zero, c["weight"], beta, c["eps"], True), 4)
        return [y, mean, rstd, total]
    call = em(npu_op("npu_add_layer_norm"), c["x"], c["residual"], c["weight"], beta, c["eps"], True)
    return em.outputs(call, 4)  # (y, mean, rstd, x1 + x2): our op's order


def emit_add_layer_norm_backward(em: Emitter, c: Call, opts: Any) -> Outputs:
    total = c.val("total")
    zero = em(aten.expand.default, em(aten.new_zeros.default, c["total"], []), list(total.shape))
    call = em(npu_op("npu_add_layer_norm_backward"), c["grad_y"], c["total"], zero, c["rstd"], c["mean"],
              c["weight"], c["grad_sum"])
    grad_x, _, grad_weight, grad_bias = em.outputs(call, 4)
    dtype = c.val("weight").dtype
    return grad_x, em.cast(grad_weight, dtype), em.cast(grad_bias, dtype) if c["bias_grad"] else None


# ==== activations ==============================================================================================

def check_gelu(c: Call) -> str | None:
    return _dtype_problem("npu_gelu", c.val("x").dtype)


def emit_bias_gelu(em: Emitter, c: Call, opts: Any) -> Outputs:
    z = c["x"] if c["bias"] is None else em(aten.add.Tensor, c["x"], c["bias"])
    if opts.fast_gelu:
        return (em(npu_op("npu_fast_gelu"), z),)
    return (em(npu_op("npu_gelu"), z, approximate=c["approximate"]),)


def emit_bias_gelu_backward(em: Emitter, c: Call, opts: Any) -> Outputs:
    z = c["x"] if c["bias"] is None else em(aten.add.Tensor, c["x"], c["bias"])
    if opts.fast_gelu:
        grad_z = em(npu_op("npu_fast_gelu_backward"), c["grad_y"], z)
    else:
        grad_z = em(npu_op("npu_gelu_backward"), c["grad_y"], z, approximate=c["approximate"])
    bias = c.val("bias")
    return grad_z, em.sum_to(grad_z, bias.shape, bias.dtype) if c["bias_grad"] else None


def check_swiglu(c: Call) -> str | None:
    x, dim = c.val("x"), c["dim"]
    if problem := _dtype_problem("npu_swiglu", x.dtype):
        return problem
    if not x.is_contiguous():
        return f"npu_swiglu takes a contiguous input; x has strides {tuple(x.stride())}"
    if x.shape[dim] % 2:
        return f"npu_swiglu needs an even size along dim {dim}, got {tuple(x.shape)}"
    return None


def emit_swiglu(em: Emitter, c: Call, opts: Any) -> Outputs:
    return (em(npu_op("npu_swiglu"), c["x"], c["dim"]),)


def emit_swiglu_backward(em: Emitter, c: Call, opts: Any) -> Outputs:
    return (em(npu_op("npu_swiglu_backward"), c["grad_y"], c["x"], c["dim"]),)


# ==== rotary ===================================================================================================

# The positions of cos/sin's non-broadcast leading dims that npu_rotary_mul takes, with the possible S positions:
# half mode: 11SD/B1SD/BNSD (x BNSD), 1S1D/BS1D/BSND (x BSND), S11D/SB1D/SBND (x SBND); interleave: 11SD/1S1D/S11D.
_ROTARY_FORMS = {
    "half": {(2,): (2,), (0, 2): (2,), (1,): (1,), (0, 1): (0, 1), (0,): (0,), (0, 1, 2): (0, 1, 2)},
    "interleave": {(2,): (2,), (1,): (1,), (0,): (0,)},
}


def check_rotary(c: Call) -> str | None:
    x = c.val("grad_out") if "grad_out" in c.args else c.val("x")
    cos, mode = c.val("cos"), c["mode"]
    if problem := _dtype_problem("npu_rotary_mul", x.dtype):
        return problem
    if cos.dtype != x.dtype:
        return f"npu_rotary_mul takes cos/sin in x's dtype {x.dtype}, got {cos.dtype}"
    if x.dim() != 4 or cos.dim() > 4:
        return f"npu_rotary_mul takes 4-D x and cos/sin; got x {tuple(x.shape)}, cos {tuple(cos.shape)}"
    r = cos.shape[-1]
    if r % 2 or r >= 896:
        return f"npu_rotary_mul needs an even rotated dim below 896, got {r}"
    cos4 = (1,) * (4 - cos.dim()) + tuple(cos.shape)
    leading = tuple(i for i in range(3) if cos4[i] != 1)
    seq_positions = _ROTARY_FORMS[mode].get(leading)
    if seq_positions is None:
        return (f"cos/sin {cos4} is not one of npu_rotary_mul's broadcast forms for {mode} mode against "
                f"x {tuple(x.shape)}")
    # B and N are the leading dims of x other than S; where the form leaves S open, take the worst case.
    batch_heads = [[x.shape[i] for i in range(3) if i != s] for s in seq_positions]
    bn = max(b * n for b, n in batch_heads)
    if mode == "interleave" and bn >= 1000:
        return f"npu_rotary_mul in interleave mode needs B·N < 1000, got {bn}"
    if mode == "half" and max(max(pair) for pair in batch_heads) >= 1000:
        return f"npu_rotary_mul needs B, N < 1000, got x {tuple(x.shape)}"
    if c.args.get("cos_sin_grad") and bn > 1024:
        return f"npu_rotary_mul_backward computes cos/sin gradients only for B·N <= 1024, got {bn}"
    return None


def _rotary_parts(em: Emitter, c: Call, t: Node) -> tuple[Node, Node | None, Node, Node]:
    """(the rotated channels of t, the passed-through rest or None, cos, sin as 4-D)."""
    r, d = c.val("cos").shape[-1], t.meta["val"].shape[-1]
    rotated, rest = t, None
    if r < d:  # partial rotary: npu_rotary_mul sees the first r channels only
        rotated, rest = em(aten.slice.Tensor, t, -1, 0, r), em(aten.slice.Tensor, t, -1, r, d)
    cos_sin = []
    for n in ("cos", "sin"):
        shape = tuple(c.val(n).shape)
        cos_sin.append(c[n] if len(shape) == 4 else em(aten.view.default, c[n], [1] * (4 - len(shape)) + list(shape)))
    return rotated, rest, cos_sin[0], cos_sin[1]


def emit_rotary(em: Emitter, c: Call, opts: Any) -> Outputs:
    rotated, rest, cos, sin = _rotary_parts(em, c, c["x"])
    out = em(npu_op("npu_rotary_mul"), rotated, cos, sin, rotary_mode=c["mode"])
    return (out if rest is None else em(aten.cat.default, [out, rest], -1),)


def emit_rotary_backward(em: Emitter, c: Call, opts: Any) -> Outputs:
    grad, rest, cos, sin = _rotary_parts(em, c, c["grad_out"])
    # Without x (cos/sin need no gradient) the grad itself stands in: `self` feeds only dr1/dr2.
    x = grad if c["x"] is None else _rotary_parts(em, c, c["x"])[0]
    grad_x, grad_cos, grad_sin = em.outputs(
        em(npu_op("npu_rotary_mul_backward"), grad, x, cos, sin, rotary_mode=c["mode"]), 3)
    if rest is not None:
        grad_x = em(aten.cat.default, [grad_x, rest], -1)
    if not c["cos_sin_grad"]:
        return grad_x, None, None
    return (grad_x, *(em(aten.view.default, g, list(c.val(n).shape)) if c.val(n).dim() != 4 else g
                      for g, n in ((grad_cos, "cos"), (grad_sin, "sin"))))


# ==== bias-dropout-add: no torch_npu op ========================================================================

def check_bias_dropout_add(c: Call) -> str | None:
    if c["p"] > 0.0:
        return ("torch_npu has no bias-dropout-add kernel, and the op's dropout mask is regenerated from its seed by "
                "our counter RNG, which no device call reproduces: kept on its reference kernel (plain torch)")
    return None


def note_bias_dropout_add(c: Call) -> str | None:
    return "torch_npu has no bias-dropout-add kernel: lowered to plain aten adds (p == 0)"


def emit_bias_dropout_add(em: Emitter, c: Call, opts: Any) -> Outputs:
    x, residual = c.val("x"), c.val("residual")
    out_dtype = torch.promote_types(x.dtype, residual.dtype)
    acc = torch.float64 if out_dtype == torch.float64 else torch.float32
    branch = c["x"] if c["bias"] is None else em(aten.add.Tensor, c["x"], c["bias"])  # rounded to x's dtype
    total = em(aten.add.Tensor, em.cast(branch, acc), c["residual"])
    return (em.cast(total, out_dtype),)


def emit_bias_dropout_add_backward(em: Emitter, c: Call, opts: Any) -> Outputs:
    grad_out, x_dtype = c["grad_out"], c["x_dtype"]
    grad_x = em.cast(grad_out, x_dtype)
    if grad_x is grad_out:  # outputs of the op never alias its inputs
        grad_x = em(aten.clone.default, grad_out)
    bias = c.val("bias")
    return grad_x, em.sum_to(grad_out, bias.shape, bias.dtype) if c["bias_grad"] else None


# ==== the table ================================================================================================

TABLE: dict[Any, Mapping] = {
    fused.fused_attention.default: Mapping(("npu_fusion_attention",), check_attention, emit_attention),
    fused.fused_attention_backward.default: Mapping(
        ("npu_fusion_attention_grad",), check_attention, emit_attention_backward),
    fused.rms_norm.default: Mapping(("npu_rms_norm",), check_rms_norm, emit_rms_norm),
    fused.rms_norm_backward.default: Mapping(("npu_rms_norm_backward",), check_rms_norm, emit_rms_norm_backward),
    fused.add_rms_norm.default: Mapping(("npu_add_rms_norm",), check_add_norm, emit_add_rms_norm),
    fused.add_rms_norm_backward.default: Mapping(
        ("npu_rms_norm_backward",), check_add_norm, emit_add_rms_norm_backward),
    fused.add_layer_norm.default: Mapping(("npu_add_layer_norm",), check_add_norm, emit_add_layer_norm),
    fused.add_layer_norm_backward.default: Mapping(
        ("npu_add_layer_norm_backward",), check_add_norm, emit_add_layer_norm_backward),
    fused.bias_gelu.default: Mapping(("npu_gelu", "npu_fast_gelu"), check_gelu, emit_bias_gelu),
    fused.bias_gelu_backward.default: Mapping(
        ("npu_gelu_backward", "npu_fast_gelu_backward"), check_gelu, emit_bias_gelu_backward),
    fused.swiglu.default: Mapping(("npu_swiglu",), check_swiglu, emit_swiglu),
    fused.swiglu_backward.default: Mapping(("npu_swiglu_backward",), check_swiglu, emit_swiglu_backward),
    fused.rotary.default: Mapping(("npu_rotary_mul",), check_rotary, emit_rotary),
    fused.rotary_backward.default: Mapping(("npu_rotary_mul_backward",), check_rotary, emit_rotary_backward),
    fused.bias_dropout_add.default: Mapping((), check_bias_dropout_add, emit_bias_dropout_add, note_bias_dropout_add),
    fused.bias_dropout_add_backward.default: Mapping(
        (), check_bias_dropout_add, emit_bias_dropout_add_backward, note_bias_dropout_add),
}


def _op_name(target: Any) -> str:
    return target._schema.name.replace("::", ".")


def _replace(em: Emitter, node: Node, outputs: Outputs) -> None:
    """Point every reader of ``node``'s outputs at their replacements, then drop ``node``."""
    if len(node.target._schema.returns) == 1:
        node.replace_all_uses_with(outputs[0])
    else:
        for user in list(node.users):
            index = user.args[1]
            new = outputs[index]
            if new is None:  # an empty gradient placeholder, made only where something reads it
                val = node.meta["val"][index]
                new = em(aten.empty.memory_format, list(val.shape), dtype=val.dtype, device=val.device)
            user.replace_all_uses_with(new)
            em.gm.graph.erase_node(user)
    em.gm.graph.erase_node(node)
    em.drop_unused()


def lower_fused_ops(gm: GraphModule, opts: Any) -> list[dict[str, str]]:
    """Rewrite every fused op ``gm`` holds into torch_npu calls where the NPU can take it; returns report.json
    ``unfused`` entries for the nodes left on their reference kernel (and for notes on taken ones)."""
    from torch._guards import detect_fake_mode

    fake_mode = detect_fake_mode([n.meta.get("val") for n in gm.graph.nodes])
    sizes = SizeNodes(gm.graph)
    unfused: list[dict[str, str]] = []
    for node in list(gm.graph.nodes):
        mapping = TABLE.get(node.target) if node.op == "call_function" else None
        if mapping is None:
            continue
        call = Call(node)
        why_not = "no FakeTensor metadata on its inputs" if call.missing_metadata() else mapping.check(call)
        if why_not is not None:
            unfused.append({"op": _op_name(node.target), "reason": f"npu: {why_not}"})
            continue
        if note := mapping.note(call):
            unfused.append({"op": _op_name(node.target), "reason": f"npu: {note}"})
        em = Emitter(gm, node, fake_mode, sizes)
        _replace(em, node, mapping.emit(em, call, opts))
    return unfused


# ==== MC2: matmul + collective → one torch_npu op (npu_compile/comm/mc2.py); targets npu and npu-sim ==========

def lower_mc2(gm: GraphModule, opts: Any) -> list[dict[str, str]]:
    """Fuse all-gather → mm, mm → reduce-scatter and mm → all-reduce into torch_npu's MC2 ops where torch_npu's
    constraints allow; the sites declined, with reasons, as report.json ``unfused`` entries."""
    from npu_compile.comm.mc2 import rewrite_mc2

    return rewrite_mc2(gm, opts.target)


# ==== how the lowered graph runs: torchair GE, torchair aclgraph (npugraph_ex), or op by op ====================

# torch_npu ops with a GE converter in torchair 2.13 (torch_npu/dynamo/torchair/_ge_concrete_graph/ge_converter/
# custom/); npu_add_layer_norm and its backward have none.
GE_CONVERTERS = frozenset({
    "npu_fusion_attention", "npu_fusion_attention_grad", "npu_rms_norm", "npu_rms_norm_backward",
    "npu_add_rms_norm", "npu_gelu", "npu_gelu_backward", "npu_fast_gelu", "npu_fast_gelu_backward",
    "npu_swiglu", "npu_swiglu_backward", "npu_rotary_mul", "npu_rotary_mul_backward",
    # MC2: torchair 2.13 registers GE converters for all three (ge_converter/custom/all_gather_matmul.py,
    # matmul_reduce_scatter.py, matmul_all_reduce.py).
    "npu_all_gather_base_mm", "npu_mm_reduce_scatter_base", "npu_mm_all_reduce_base",
})
GE_ATTENTION_LAYOUTS = ("BSH", "BNSD")
TORCHAIR_MODES = {"ge": "max-autotune", "aclgraph": "npugraph_ex"}


@dataclasses.dataclass(frozen=True)
class GraphPlan:
    """How target npu runs one lowered graph: the graph mode after demotions, and why it was demoted."""

    requested: str
    graph_mode: str
    reasons: tuple[tuple[str, str], ...] = ()  # (op, why this graph left the requested mode)
    device: str = "npu"
    collectives: str = "hccl"  # functional collectives: HcomAllReduce & co. in GE, the HCCL process group otherwise

    def torchair_settings(self) -> dict[str, Any]:
        """torchair CompilerConfig fields (dotted names) for this plan; empty when the graph runs op by op."""
        if self.graph_mode == "eager":
            return {}
        return {"mode": TORCHAIR_MODES[self.graph_mode]}


def _ge_blockers(node: Node) -> list[str]:
    target = node.target
    if not isinstance(target, torch._ops.OpOverload):
        return []
    ns, name = target.namespace, target._schema.name.split("::")[-1]
    if ns == "npu_compile":
        return ["a reference kernel (Python custom op) has no GE converter"]
    if ns != "npu":
        return []
    if name not in GE_CONVERTERS:
        return [f"torchair has no GE converter for {name}"]
    if name.startswith("npu_fusion_attention"):
        call = dict(zip((a.name for a in target._schema.arguments), node.args)) | dict(node.kwargs)
        problems = []
        if call.get("input_layout") not in GE_ATTENTION_LAYOUTS:
            problems.append(
                f"torchair's GE converter takes input_layout BSH or BNSD only, got {call['input_layout']!r}")
        if call.get("keep_prob", 1.0) != 1.0:
            problems.append(f"torchair's GE converter takes keep_prob == 1 only, got {call['keep_prob']}")
        if call.get("pse") is not None:
            problems.append("torchair's GE converter drops pse")
        return problems
    return []


def _capture_blockers(node: Node) -> list[str]:
    target = node.target
    if target is aten._local_scalar_dense.default:
        return ["a host read of the dropout seed cannot be captured"]
    if getattr(target, "namespace", None) == "npu_compile":
        call = Call(node)
        if call.args.get("dropout_p", 0.0) > 0.0 or call.args.get("p", 0.0) > 0.0:
            return ["a reference kernel with dropout reads its seed on the host"]
    return []


def plan_graph(gm: GraphModule, graph_mode: str) -> GraphPlan:
    """``graph_mode`` for ``gm``, demoted ge → aclgraph → eager where the graph holds what the mode cannot run."""
    reasons: list[tuple[str, str]] = []
    mode = graph_mode
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    if mode == "ge":
        found = [(_op_name(n.target), why) for n in nodes for why in _ge_blockers(n)]
        if found:
            reasons += [(op, f"graph_mode 'ge' -> 'aclgraph': {why}") for op, why in dict.fromkeys(found)]
            mode = "aclgraph"
    if mode == "aclgraph":
        found = [(_op_name(n.target), why) for n in nodes for why in _capture_blockers(n)]
        if found:
            reasons += [(op, f"graph_mode 'aclgraph' -> 'eager': {why}") for op, why in dict.fromkeys(found)]
            mode = "eager"
    return GraphPlan(requested=graph_mode, graph_mode=mode, reasons=tuple(reasons))


def lower(gm: GraphModule, opts: Any) -> list[dict[str, str]]:
    unfused = lower_fused_ops(gm, opts) + lower_mc2(gm, opts)
    plan = plan_graph(gm, opts.graph_mode)
    gm.meta[PLAN_META] = plan
    return unfused + [{"op": op, "reason": f"npu: {why}"} for op, why in plan.reasons]


def torchair_compile(gm: GraphModule, example_inputs: Sequence[Any], plan: GraphPlan) -> Callable:
    """Hand ``gm`` to torchair's per-graph compiler (the one torchair's own backend gives aot_autograd)."""
    import torchair  # installed by torch_npu; only the npu target gets here

    config = torchair.CompilerConfig()
    for dotted, value in plan.torchair_settings().items():
        *path, leaf = dotted.split(".")
        owner = config
        for part in path:
            owner = getattr(owner, part)
        setattr(owner, leaf, value)
    return torchair.get_compiler(config)(gm, list(example_inputs))


def executor(gm: GraphModule, example_inputs: Sequence[Any]) -> Callable:
    plan: GraphPlan | None = gm.meta.get(PLAN_META)
    if plan is None or plan.graph_mode == "eager":
        return boxed_executor(gm)
    return torchair_compile(gm, example_inputs, plan)
