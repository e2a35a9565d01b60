"""Cross-entropy on the npu targets: linear_cross_entropy (and its backward) → per chunk of tokens, the logits'
matmul and npu_cross_entropy_loss (npu_cross_entropy_loss_backward), so that no more than one chunk's fp32
logits and log-probabilities live at a time.

Semantics of the torch_npu ops: docs/npu_ops.md. The graph is unrolled over the chunks (static token counts
only). Each chunk's kernel runs with reduction "none" and our op's reduction is applied after it; the kernel's
loss for an ignored token is 0 and its gradient row 0 where ignore_index >= 0. A negative ignore_index means "no
ignored class" to the kernel (while F.cross_entropy's default -100 ignores targets of -100), so then those
targets are replaced by 0 for the kernel and their loss and gradient zeroed here. The forward's lse output is
logit − log-probability of class 0 (one subtraction; the kernel returns no lse). The backward recomputes each
chunk's log-probabilities with the forward kernel, then its gradient; grad_weight is accumulated in fp32.
"""

from __future__ import annotations

import operator

import torch

from npu_compile.config import Options
from npu_compile.lowering.npu.emit import Call, Emitter, Mapping, Outputs, dtype_problem, fused, npu_op
from npu_compile.ops.cross_entropy import chunk_rows

aten = torch.ops.aten
MAX_TOKENS = 200_000  # npu_cross_entropy_loss's N limit


def check(c: Call) -> str | None:
    hidden = c.val("hidden")
    if problem := dtype_problem("npu_cross_entropy_loss", hidden.dtype):
        return problem
    if not all(isinstance(s, int) for s in hidden.shape) or not all(isinstance(s, int) for s in c.val("weight").shape):
        return "symbolic token or vocab counts: the lowering unrolls the chunks at compile time"
    if not 0.0 <= c["label_smoothing"] < 1.0:
        return f"label_smoothing {c['label_smoothing']} is outside npu_cross_entropy_loss's [0, 1)"
    if c["ignore_index"] >= c.val("weight").shape[0]:
        return f"ignore_index {c['ignore_index']} is not below the vocab size, as npu_cross_entropy_loss needs"
    return None


class _Chunks:
    """The flattened operands and the per-chunk pieces both directions share."""

    def __init__(self, em: Emitter, c: Call):
        self.em, self.c = em, c
        hidden, weight = c.val("hidden"), c.val("weight")
        self.n, self.h, self.vocab = hidden.numel() // hidden.shape[-1], hidden.shape[-1], weight.shape[0]
        self.hidden = em(aten.view.default, c["hidden"], [self.n, self.h])
        self.target = em(aten.view.default, c["target"], [self.n])
        self.weight_t = em(aten.t.default, c["weight"])
        self.masked = c["ignore_index"] < 0  # the kernel ignores nothing: mask here
        self.kernel_ignore = -1 if self.masked else c["ignore_index"]
        self.step = min(chunk_rows(self.n, self.vocab, c["chunk_size"]), MAX_TOKENS)

    def ranges(self):
        return [(s, min(s + self.step, self.n)) for s in range(0, self.n, self.step)]

    def rows(self, node, start, end):
        return self.em(aten.slice.Tensor, node, 0, start, end)

    def valid(self, target):
        return self.em(aten.ne.Scalar, target, self.c["ignore_index"])

    def log_prob(self, start, end):
        """(fp32 logits, kernel loss, log-probabilities, the kernel's target, valid mask or None) of one chunk."""
        em = self.em
        h = self.rows(self.hidden, start, end)
        logits = em.cast(em(aten.mm.default, h, self.weight_t), torch.float32)
        target = self.rows(self.target, start, end)
        valid = None
        if self.masked:
            valid = self.valid(target)
            target = em.where_zero(valid, target)
        loss, log_prob, _, _ = em.outputs(em(npu_op("npu_cross_entropy_loss"), logits, target, None, "none",
                                             self.kernel_ignore, self.c["label_smoothing"]), 4)
        return h, logits, loss, log_prob, target, valid


def emit_forward(em: Emitter, c: Call, opts: Options) -> Outputs:
    ch = _Chunks(em, c)
    losses, lses = [], []
    for start, end in ch.ranges():
        _, logits, loss, log_prob, _, valid = ch.log_prob(start, end)
        if valid is not None:
            loss = em.where_zero(valid, loss)
        losses.append(loss)
        lses.append(em(aten.sub.Tensor, em(aten.select.int, logits, 1, 0), em(aten.select.int, log_prob, 1, 0)))
    loss = em(aten.cat.default, losses) if len(losses) > 1 else losses[0]
    lse = em(aten.cat.default, lses) if len(lses) > 1 else lses[0]
    target_shape = list(c.val("target").shape)
    if c["reduction"] == "none":
        loss = em(aten.view.default, loss, target_shape)
    else:
        loss = em(aten.sum.default, loss)
        if c["reduction"] == "mean":
            loss = em(aten.div.Tensor, loss, em(aten.sum.default, ch.valid(ch.target)))
    return [loss, em(aten.view.default, lse, target_shape)]


def emit_backward(em: Emitter, c: Call, opts: Options) -> Outputs:
    ch = _Chunks(em, c)
    grad = em.cast(c["grad_loss"], torch.float32)
    if c["reduction"] == "mean":
        grad = em(aten.div.Tensor, grad, em(aten.sum.default, ch.valid(ch.target)))
    if c["reduction"] == "none":
        grad = em(aten.view.default, grad, [ch.n])
    dtype = c.val("hidden").dtype
    grads_h, grad_w = [], None
    for start, end in ch.ranges():
        h, _, _, log_prob, target, valid = ch.log_prob(start, end)
        if c["reduction"] == "none":
            g = ch.rows(grad, start, end)
        else:
            g = em(aten.expand.default, em(aten.view.default, grad, [1]), [end - start])
        if valid is not None:
            g = em.where_zero(valid, g)
        grad_logits = em(npu_op("npu_cross_entropy_loss_backward"), g, log_prob, target, None, None, None, "none",
                         ch.kernel_ignore, c["label_smoothing"])
        grad_logits = em.cast(grad_logits, dtype)
        grads_h.append(em(aten.mm.default, grad_logits, c["weight"]))
        if c["weight_grad"]:
            part = em.cast(em(aten.mm.default, em(aten.t.default, grad_logits), h), torch.float32)
            grad_w = part if grad_w is None else em(aten.add.Tensor, grad_w, part)
    grad_h = em(aten.cat.default, grads_h) if len(grads_h) > 1 else grads_h[0]
    grad_h = em(aten.view.default, grad_h, list(c.val("hidden").shape))
    return [grad_h, em.cast(grad_w, c.val("weight").dtype) if grad_w is not None else None]


ROWS = {
    fused.linear_cross_entropy.default: Mapping(("npu_cross_entropy_loss",), check, emit_forward),
    fused.linear_cross_entropy_backward.default: Mapping(
        ("npu_cross_entropy_loss", "npu_cross_entropy_loss_backward"), check, emit_backward),
}


# ==== vocab_parallel_linear_cross_entropy: Megatron's loss, per chunk in aten ops ==========================
#
# No torch_npu kernel takes the all-reduced max and sum-exp between the matmul and the loss (the max-sum pair
# of docs/npu_ops.md is not emitted), so each chunk is the reference kernel's computation in aten ops and
# functional collectives (HCCL on the device): mm → fp32 → max, all-reduce → exp-sum and the target's logit,
# all-reduce → loss. The backward recomputes the chunk's softmax from the saved lse. Report.json says so.

_c10d = torch.ops._c10d_functional


def check_vocab_parallel(c: Call) -> str | None:
    hidden = c.val("hidden")
    if problem := dtype_problem("npu_cross_entropy_loss", hidden.dtype):
        return problem
    if not all(isinstance(s, int) for s in hidden.shape) or not all(isinstance(s, int) for s in c.val("weight").shape):
        return "symbolic token or vocab counts: the lowering unrolls the chunks at compile time"
    return None


def note_vocab_parallel(c: Call) -> str | None:
    return ("no torch_npu kernel takes Megatron's all-reduced max and sum-exp: lowered per chunk to aten ops and "
            "(the forward's three) functional all-reduces over the TP group")


class _VocabChunks:
    def __init__(self, em: Emitter, c: Call):
        self.em, self.c = em, c
        hidden, weight = c.val("hidden"), c.val("weight")
        self.n, self.h, self.vocab = hidden.numel() // hidden.shape[-1], hidden.shape[-1], weight.shape[0]
        # any layout (Megatron's labels come transposed): reshape copies where a view cannot be taken
        self.hidden = em(aten.reshape.default, c["hidden"], [self.n, self.h])
        self.target = em(aten.reshape.default, c["target"], [self.n])
        self.weight_t = em(aten.t.default, c["weight"])
        self.step = chunk_rows(self.n, self.vocab, c["chunk_size"])

    def ranges(self):
        return [(s, min(s + self.step, self.n)) for s in range(0, self.n, self.step)]

    def rows(self, node, start, end):
        return self.em(aten.slice.Tensor, node, 0, start, end)

    def chunk(self, start, end):
        """(hidden rows, fp32 logits, in the shard, the target's column in the shard or 0) of one chunk."""
        em, start_id = self.em, self.c["vocab_start"]
        h = self.rows(self.hidden, start, end)
        logits = em.cast(em(aten.mm.default, h, self.weight_t), torch.float32)
        t = self.rows(self.target, start, end)
        inside = em(aten.bitwise_and.Tensor, em(aten.ge.Scalar, t, start_id),
                    em(aten.lt.Scalar, t, start_id + self.vocab))
        column = em.where_zero(inside, em(aten.sub.Tensor, t, start_id))
        return h, logits, inside, column

    def all_reduce(self, node, op):
        return self.em(_c10d.wait_tensor.default, self.em(_c10d.all_reduce.default, node, op, self.c["group_name"]))


def emit_vocab_parallel_forward(em: Emitter, c: Call, opts: Options) -> Outputs:
    ch, smoothing = _VocabChunks(em, c), c["smoothing"]
    losses, lses = [], []
    for start, end in ch.ranges():
        _, logits, inside, column = ch.chunk(start, end)
        # max.dim, not amax: torchair converts max.dim (ArgMaxWithValue) and has no GE converter for amax
        logits_max = ch.all_reduce(em(operator.getitem, em(aten.max.dim, logits, 1), 0), "max")
        shifted = em(aten.sub.Tensor, logits, em(aten.unsqueeze.default, logits_max, 1))
        picked = em(aten.squeeze.dim, em(aten.gather.default, shifted, 1, em(aten.unsqueeze.default, column, 1)), 1)
        picked = ch.all_reduce(em.where_zero(inside, picked), "sum")
        sum_exp = ch.all_reduce(em(aten.sum.dim_IntList, em(aten.exp.default, shifted), [1]), "sum")
        log_sum = em(aten.log.default, sum_exp)
        loss = em(aten.sub.Tensor, log_sum, picked)
        if smoothing:
            mean_log_p = em(aten.sub.Tensor, em(aten.mean.dim, shifted, [1]), log_sum)
            loss = em(aten.sub.Tensor, em(aten.mul.Tensor, loss, 1.0 - smoothing),
                      em(aten.mul.Tensor, mean_log_p, smoothing))
        losses.append(loss)
        lses.append(em(aten.add.Tensor, logits_max, log_sum))
    target_shape = list(c.val("target").shape)
    loss = em(aten.cat.default, losses) if len(losses) > 1 else losses[0]
    lse = em(aten.cat.default, lses) if len(lses) > 1 else lses[0]
    return [em(aten.view.default, loss, target_shape), em(aten.view.default, lse, target_shape)]


def emit_vocab_parallel_backward(em: Emitter, c: Call, opts: Options) -> Outputs:
    ch, smoothing = _VocabChunks(em, c), c["smoothing"]
    grad = em(aten.reshape.default, em.cast(c["grad_loss"], torch.float32), [ch.n])
    lse = em(aten.reshape.default, c["lse"], [ch.n])
    dtype = c.val("hidden").dtype
    grads_h, grad_w = [], None
    for start, end in ch.ranges():
        h, logits, inside, column = ch.chunk(start, end)
        softmax = em(aten.exp.default, em(aten.sub.Tensor, logits,
                                          em(aten.unsqueeze.default, ch.rows(lse, start, end), 1)))
        hit = em(aten.mul.Tensor, em.cast(inside, torch.float32), -(1.0 - smoothing))
        g = em(aten.scatter_add.default, softmax, 1, em(aten.unsqueeze.default, column, 1),
               em(aten.unsqueeze.default, hit, 1))
        if smoothing:
            g = em(aten.sub.Tensor, g, smoothing / ch.vocab)
        g = em(aten.mul.Tensor, g, em(aten.unsqueeze.default, ch.rows(grad, start, end), 1))
        if c["logits_grad_dtype"] is not None:  # Megatron's fused loss: its logits' gradient in bf16
            g = em.cast(g, c["logits_grad_dtype"])
        grad_logits = em.cast(g, dtype)
        grads_h.append(em(aten.mm.default, grad_logits, c["weight"]))
        if c["weight_grad"]:
            part = em.cast(em(aten.mm.default, em(aten.t.default, grad_logits), h), torch.float32)
            grad_w = part if grad_w is None else em(aten.add.Tensor, grad_w, part)
    grad_h = em(aten.cat.default, grads_h) if len(grads_h) > 1 else grads_h[0]
    grad_h = em(aten.reshape.default, grad_h, list(c.val("hidden").shape))
    return [grad_h, em.cast(grad_w, c.val("weight").dtype) if grad_w is not None else None]


ROWS.update({
    fused.vocab_parallel_linear_cross_entropy.default: Mapping(
        (), check_vocab_parallel, emit_vocab_parallel_forward, note_vocab_parallel),
    fused.vocab_parallel_linear_cross_entropy_backward.default: Mapping(
        (), check_vocab_parallel, emit_vocab_parallel_backward, note_vocab_parallel),
})
