"""Attention rules: Megatron core attention, F.scaled_dot_product_attention and attention written out become
npu_compile.fused_attention (forward and backward) in training and inference, and the compiled results equal
eager; dropout regenerates its masks from a seed the graph saves (memory budgets included); sites left unfused
are reported with their reasons.
The 2-layer megatron-core training runs (one compile per model and budget): test_megatron_models.py."""

import dataclasses
import math
import random

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_glue.capture.testing import megatron_cpu  # noqa: F401  (fixture)
from npu_compile.debug.report import collect
from npu_compile.ops.attention import attention_dropout_keep_mask
from npu_compile.passes.attention import draw_seed

RULES = ("attention",)
FUSED = "npu_compile.fused_attention"
UNFUSED_OPS = {"aten._softmax", "aten._softmax_backward_data", "aten._safe_softmax", "aten.native_dropout",
               "aten._scaled_dot_product_flash_attention_for_cpu", "aten.baddbmm"}


def gpt():
    from megatron_glue.capture.models import gpt_config

    return gpt_config(hidden_size=64)


def llama():
    from megatron_glue.capture.models import llama_config

    return llama_config(hidden_size=64, num_query_groups=2)


def attention_unfused(report):
    return [u for u in report.unfused if u["rule"] == "attention"]


# ==== megatron-core GPTModel, 2 layers (trained at budgets 1.0 and 0.3: test_megatron_models.py) ==============

def _batch_args(batch, mask=True):
    """GPTModel's positional arguments: input_ids, position_ids, attention_mask, decoder_input, labels."""
    return batch["input_ids"], batch["position_ids"], batch["attention_mask"] if mask else None, None, batch["labels"]


@pytest.mark.parametrize("case", ["default_causal_mask", "bf16", "inference", "inference_dropout"])
def test_megatron_variants_fused_and_equal_to_eager(case, megatron_cpu, against_eager, rel_error):
    """attention_mask=None (Megatron builds its causal mask in the graph), bf16 (softmax in fp32 between casts;
    the loss and every parameter gradient against float64), and inference graphs, with dropout too (a model in
    training mode under no_grad)."""
    from megatron_glue.capture.models import build_gpt_model, gpt_config, llama_config, synthetic_batch

    config = {
        "bf16": lambda: gpt_config(hidden_size=64, bf16=True, params_dtype=torch.bfloat16),
        "inference_dropout": lambda: llama_config(hidden_size=64, num_query_groups=2, attention_dropout=0.5),
    }.get(case, gpt)()
    model = build_gpt_model(config, 128, 32).to(config.params_dtype)  # bf16: the embeddings too
    args = _batch_args(synthetic_batch(2, 32, 128), mask=case != "default_causal_mask")
    if case == "inference_dropout":  # dropout drops: compare the graph, not the numbers
        with collect() as reports, torch.no_grad():
            torch.compile(model, backend="ascend", options={"fusions": list(RULES)})(*args)
        (report,) = reports
    elif case == "bf16":
        report = _bf16_training_against_float64(model, args, rel_error)
    else:
        report = against_eager(model, *args, rules=RULES, no_grad=case.startswith("inference")).report
    assert report.fusions == {"attention": 2}
    assert not UNFUSED_OPS & set(report.lowered_ops) and attention_unfused(report) == []
    if case.startswith("inference"):
        assert report.graphs == ["inference"] and "npu_compile.fused_attention_backward" not in report.lowered_ops


def _bf16_training_against_float64(model, args, rel_error):
    """The bf16 model's per-token loss and every parameter gradient, eager and compiled, each held to the same
    weights in float64 (tests/passes/conftest.py's rule): the compiled result no further from it than eager bf16
    is, plus two bf16 ulps of the tensor's scale. The loss of a fresh model sits near ln V whatever attention
    gives; the gradients of everything after attention scale with its output. Returns the compiled report."""
    from megatron_glue.capture.models import build_gpt_model

    def run(m):
        model.zero_grad(set_to_none=True)
        exact_model.zero_grad(set_to_none=True)
        loss = m(*args)
        loss.backward(torch.rand(loss.shape, generator=torch.Generator().manual_seed(0)).to(loss.dtype))
        params = exact_model if m is exact_model else model
        return {"loss": loss.detach(), **{n: p.grad.clone() for n, p in params.named_parameters()}}

    # fp32 config: with bf16=True Megatron's softmax casts its probabilities back to bf16, in a float64 model too
    exact_model = build_gpt_model(gpt(), 128, 32)
    exact_model.load_state_dict(model.state_dict())
    exact_model.double()
    with torch._dynamo.config.patch(disable=True):  # Megatron's jit_fuser is torch.compile: keep eager eager
        exact, expected = run(exact_model), run(model)
    with collect() as reports:
        got = run(torch.compile(model, backend="ascend", options={"fusions": list(RULES)}))
    (report,) = reports
    assert got.keys() == expected.keys() == exact.keys() and len(got) > 10
    errors = {name: (rel_error(got[name], exact[name]), rel_error(expected[name], exact[name])) for name in got}
    bad = {name: f"{g:.2e} > {e:.2e} + 2 ulps" for name, (g, e) in errors.items() if g > e + 2 * 2.0**-8}
    assert not bad, f"relative errors against float64 (compiled > eager bf16 + 2 ulps): {bad}"
    return report


def test_megatron_attention_dropout_trains_like_eager(megatron_cpu):
    """attention_dropout=0.1: the fused op drops other elements than eager does, so the loss curves are compared
    as curves: both fall by more than a quarter over 20 steps, and their last-5-step means agree within 10%."""
    from megatron_glue.capture.models import build_gpt_model, gpt_config, synthetic_batch, train_step

    steps, batch = 20, synthetic_batch(2, 32, 128, seed=0)

    def curve(model):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        return [train_step(model, batch, opt) for _ in range(steps)]

    def config():
        return gpt_config(hidden_size=64, attention_dropout=0.1)

    torch.manual_seed(0)
    with torch._dynamo.config.patch(disable=True):  # Megatron's jit_fuser is torch.compile: keep eager eager
        eager = curve(build_gpt_model(config(), 128, 32, seed=0))
    torch.manual_seed(0)
    with collect() as reports:
        compiled = curve(torch.compile(build_gpt_model(config(), 128, 32, seed=0), backend="ascend",
                                       options={"fusions": list(RULES)}))
    (report,) = reports
    assert report.fusions == {"attention": 2}
    assert report.lowered_ops["aten.randint"] == 2 and not UNFUSED_OPS & set(report.lowered_ops)
    tail_eager, tail_compiled = sum(eager[-5:]) / 5, sum(compiled[-5:]) / 5
    assert tail_eager < 0.75 * eager[0] and tail_compiled < 0.75 * compiled[0], (eager, compiled)
    assert abs(tail_compiled - tail_eager) < 0.1 * tail_eager, (eager, compiled)


# ==== dropout: forward and backward drop the same elements, whatever the partitioner recomputes ==============

P, SEED = 0.3, 1234


def reference_attention(q, k, v, *, scale, masked=None, fill=None, keep=None, p=0.0):
    """softmax(scale · q kᵀ, masked) v on [b, n, s, d], kv heads repeated; dropout applies ``keep``."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = scale * q @ k.transpose(-2, -1)
    if masked is not None:
        scores = scores.masked_fill(masked, -math.inf if fill is None else fill)
    probs = scores.softmax(dim=-1)
    if keep is not None:
        probs = probs * keep / (1 - p)
    return probs @ v


def _written_out(q, k, v):
    scores = (q @ k.repeat_interleave(2, dim=1).transpose(-2, -1)) / math.sqrt(q.shape[-1])
    return F.dropout(scores.softmax(dim=-1), p=P, training=True) @ v.repeat_interleave(2, dim=1)


def _sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, dropout_p=P, is_causal=True, scale=0.3, enable_gqa=True)


def _megatron_core_attention(dropout):
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron_glue.capture.models import gpt_config

    config = gpt_config(hidden_size=4 * 8, num_attention_heads=4, num_query_groups=2, attention_dropout=dropout)
    return DotProductAttention(config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")


def dropout_case(style, s, d):
    """(attention with dropout P, its input layout from [b, n, s, d], extra inputs, and the reference's cells
    masked, fill and scale)."""
    causal = torch.ones(s, s, dtype=torch.bool).triu(1)
    if style == "written_out":
        return _written_out, (lambda t: t), (), dict(masked=None, fill=None, scale=1 / math.sqrt(d))
    if style == "sdpa":
        return _sdpa, (lambda t: t), (), dict(masked=causal, fill=None, scale=0.3)
    # Megatron: [s, b, n, d] in, [s, b, n·d] out, masked scores filled with -10000
    return (_megatron_core_attention(P), lambda t: t.permute(2, 0, 1, 3), (causal[None, None],),
            dict(masked=causal, fill=-1e4, scale=1 / math.sqrt(d)))


@pytest.mark.parametrize("budget", [1.0, 0.3])
@pytest.mark.parametrize("style", ["written_out", "sdpa", "megatron"])
def test_dropout_masks_regenerate_from_the_saved_seed(style, budget, megatron_cpu, tmp_path):
    """Eager attention with fused_attention's own keep mask for the seed the compiled graph drew equals the
    compiled step, forward and every gradient. Under a memory budget the partitioner may run the fused forward
    again in the backward; it must reuse the forward's seed, never draw a new one."""
    b, nq, nkv, s, d = 2, 4, 2, 6, 8
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, n, s, d, generator=g) for n in (nq, nkv, nkv))
    fn, laid_out, extra, reference = dropout_case(style, s, d)
    inputs = [laid_out(t).contiguous().requires_grad_() for t in (q, k, v)]
    with collect() as reports:
        compiled = torch.compile(fn, backend="ascend", options={"fusions": list(RULES), "memory_budget": budget,
                                                                 "dump_dir": str(tmp_path)})
        torch.manual_seed(SEED)
        out = compiled(*inputs, *extra)
        grad_out = torch.randn(out.shape, generator=g)
        out.backward(grad_out)
    assert reports[0].fusions == {"attention": 1} and "aten.native_dropout" not in reports[0].lowered_ops
    (backward,) = (tmp_path / reports[0].graph_id / "backward").glob("*_lowered_*.py")
    assert "aten.randint" not in backward.read_text()  # the seed comes in saved

    torch.manual_seed(SEED)
    keep = attention_dropout_keep_mask(draw_seed("cpu"), P, b, nq, s, s)
    ref_inputs = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    expected = reference_attention(*ref_inputs, **reference, keep=keep, p=P)
    if style == "megatron":
        expected = expected.permute(2, 0, 1, 3).reshape(s, b, nq * d)
    expected.backward(grad_out)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    for got, want in zip(inputs, ref_inputs):
        torch.testing.assert_close(got.grad, laid_out(want.grad), rtol=1e-5, atol=1e-5)


# ==== properties: spellings, shapes, masks, dtypes; compiled against eager ===================================
#
# Each structure (a spelling with its dtype, mode, heads, mask kind and layout) compiles once, with its sequence
# lengths symbolic (mark_dynamic); Hypothesis then draws the lengths, the values and the masks' cells, and every
# example runs that one graph. The structures of a family are a fixed sample of all its combinations, every
# value of every axis among them (see structures); the fuzz twin takes more of them, with longer lengths.

@dataclasses.dataclass(frozen=True)
class Structure:
    """What one compiled graph is specialized to: everything but the sequence lengths, the values and which cells
    a padding mask hides."""

    dtype: torch.dtype
    training: bool
    b: int
    n_kv: int
    groups: int
    d: int
    mask: str  # none | causal | padding | additive (how each style spells it: see the builders)
    layout: str = "bnsd"
    # self: sk == sq, one symbol; decode: one query row (sq == 1, static), sk symbolic. (Cross-attention, a
    # symbolic sq beside another symbolic sk, is left unfused today: its properties are static, elsewhere.)
    lengths: str = "self"
    spelling: tuple = ()  # (name, value) pairs

    @property
    def n(self):
        return self.n_kv * self.groups

    @property
    def sp(self):
        return dict(self.spelling)

    def __str__(self):
        dtype = {torch.float32: "fp32", torch.bfloat16: "bf16"}[self.dtype]
        words = [dtype, "training" if self.training else "inference", f"b{self.b}", f"kv{self.n_kv}x{self.groups}",
                 f"d{self.d}", self.mask, self.layout, self.lengths, *(f"{k}={v}" for k, v in self.spelling)]
        return "-".join(str(w).replace(" ", "") for w in words)


@dataclasses.dataclass(frozen=True)
class Case:
    """One example: a structure at lengths sq, sk with the values (and padding cells) of ``seed``."""

    structure: Structure
    sq: int
    sk: int
    seed: int

    def tensors(self):
        """q, k, v in [b, n, s, d], and the cells a mask hides ([sq, sk] or broadcastable to [b, 1, sq, sk])."""
        shape, sp = self.structure, self.structure.sp
        g = torch.Generator().manual_seed(self.seed)
        q = torch.randn(shape.b, shape.n, self.sq, shape.d, generator=g)
        k, v = (torch.randn(shape.b, shape.n_kv, self.sk, shape.d, generator=g) for _ in range(2))
        if shape.mask == "padding":
            hidden = torch.rand(shape.b, 1, 1 if sp.get("per_key") else self.sq, self.sk, generator=g) < 0.4
            hidden[..., :2] = False  # every query sees two keys (eager's -inf rows would be NaN; see structures)
        else:
            hidden = torch.ones(self.sq, self.sk, dtype=torch.bool).triu(1)  # causal, top-left aligned
        bias = torch.randn(1 if sp.get("bias_1") else shape.b, 1, self.sq, self.sk, generator=g)
        cast = lambda t: t.to(shape.dtype)  # noqa: E731
        return cast(q), cast(k), cast(v), hidden, cast(bias)


# The axes of each family's structures, each a list of its values.
COMMON = {"mask": ["none", "causal", "padding", "additive"], "dtype": [torch.float32, torch.bfloat16],
          "training": [True, False], "b": [1, 2], "groups": [1, 2, 4], "per_key": [False, True],
          "bias_1": [False, True]}
AXES = {
    "written_out": {**COMMON, "layout": ["bnsd", "bsnd", "bnsd->bsnd"], "lengths": ["self", "decode"],
                    "repeat": ["repeat_interleave", "expand"], "key_dims": [(-2, -1), (2, 3)],
                    "divide": [False, True], "fill": ["-inf", "-1e4", "finfo.min", "additive"]},
    "sdpa": {**COMMON, "layout": ["bnsd", "bsnd"], "lengths": ["self", "decode"], "scale": [None, 0.3]},
    # Megatron: self-attention only, no additive masks
    "megatron": {**{a: vs for a, vs in COMMON.items() if a != "bias_1"}, "mask": ["none", "causal", "padding"],
                 "layout": ["bnsd"], "lengths": ["self"], "default_mask": [False, True]},
}
SPELLING_AXES = {"per_key", "bias_1", "repeat", "key_dims", "divide", "fill", "scale", "default_mask"}


def structure_of(style, values, heads=(1, 2), dims=(4, 8, 16)) -> Structure:
    """The structure that ``values`` (axis -> value; heads and dims: n_kv and d) name, made valid."""
    mask, lengths = values["mask"], values["lengths"]
    # Where every query sees one key, the gradients of q and k are exactly zero and eager's are rounding noise (no
    # relative error is defined), so some query sees two: causal masks take sq >= 2 (no decode step).
    if mask == "causal" and lengths == "decode":
        lengths = "self"
    # axes that only some structures have (a padding mask's broadcast, an additive one's, GQA's repeat, a bool
    # mask's fill): dropped elsewhere, so that structures differing only there are one
    relevant = {"per_key": mask == "padding", "bias_1": mask == "additive", "repeat": values["groups"] > 1,
                "fill": mask in ("causal", "padding"), "default_mask": mask == "none"}
    return Structure(
        dtype=values["dtype"], training=values["training"], b=values["b"], n_kv=values.get("n_kv", heads[0]),
        groups=values["groups"], d=values.get("d", dims[0]), mask=mask, layout=values["layout"], lengths=lengths,
        spelling=tuple((k, v) for k, v in values.items() if k in SPELLING_AXES and relevant.get(k, True)),
    )


def structures(style, count, heads=(1, 2), dims=(4, 8, 16)) -> list[Structure]:
    """``count`` structures of ``style``, each axis's value picked by a generator seeded with the family's name:
    the first such sample that holds every value of every axis (the same list every run)."""
    axes = {**AXES[style], "n_kv": list(heads), "d": list(dims)}
    for attempt in range(1000):
        pick = random.Random(f"attention structures {style} {count} {attempt}")
        chosen = []
        for _ in range(count):
            values = {a: pick.choice(vs) for a, vs in axes.items()}
            chosen.append(structure_of(style, values, heads=(values["n_kv"],), dims=(values["d"],)))
        if all({getattr(s, a) if hasattr(s, a) else s.sp.get(a) for s in chosen} >= set(vs) for a, vs in axes.items()):
            return chosen
    raise AssertionError(f"no {count} {style} structures found that hold every value of every axis: take more")


def cases(structure, sizes=(2, 8)):
    """Examples of ``structure``: lengths in ``sizes`` (sk >= 2 always; the written-out [b, s, n, d] graph of one
    key is also a form no spelling holds), and the seed of the values."""
    @st.composite
    def draw(draw):
        sq = sk = draw(st.integers(*sizes))
        if structure.lengths == "decode":
            sq = 1
        return Case(structure, sq, sk, draw(st.integers(0, 2**16)))

    return draw()


def written_out(structure):
    """The model code: softmax(q·kᵀ·scale [+ bias | masked_fill]) v, k/v repeated for GQA; in [b, s, n, d] or
    [b, n, s, d], and the heads merged into [b, s, h] as models do (but for the all-[b, n, s, d] layout)."""
    sp = structure.sp
    fill = {"-inf": -math.inf, "-1e4": -1e4, "finfo.min": torch.finfo(structure.dtype).min}.get(sp.get("fill"))
    groups = structure.groups

    def attention(q, k, v, mask):
        if structure.layout == "bsnd":
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if groups > 1 and sp["repeat"] == "repeat_interleave":
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        elif groups > 1:  # HF's repeat_kv
            b, n_kv, s, d = k.shape
            k = k[:, :, None, :, :].expand(b, n_kv, groups, s, d).reshape(b, n_kv * groups, s, d)
            v = v[:, :, None, :, :].expand(b, n_kv, groups, s, d).reshape(b, n_kv * groups, s, d)
        scores = q @ k.transpose(*sp["key_dims"])
        scores = scores / math.sqrt(q.shape[-1]) if sp["divide"] else scores * q.shape[-1] ** -0.5
        if mask is not None and mask.dtype == torch.bool:
            scores = scores.masked_fill(mask, fill)
        elif mask is not None:
            scores = scores + mask
        out = scores.softmax(dim=-1) @ v
        if structure.layout == "bnsd":
            return out
        b, n, s, d = out.shape
        return out.transpose(1, 2).reshape(b, s, n * d)

    def inputs(case):
        q, k, v, hidden, bias = case.tensors()
        if structure.mask == "additive":
            mask = bias
        elif structure.mask in ("causal", "padding"):
            # a bool mask for masked_fill, or the same cells as an additive 0/-inf mask
            mask = hidden if fill is not None else torch.zeros(hidden.shape, dtype=structure.dtype).masked_fill(
                hidden, -math.inf)
        else:
            mask = None
        return [*_laid_out(structure, q, k, v), mask]

    return attention, inputs


def sdpa(structure):
    """F.scaled_dot_product_attention with is_causal, a bool mask (True = attend), an additive mask or none."""
    scale = structure.sp["scale"]

    def attention(q, k, v, mask):
        if structure.layout == "bsnd":
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=structure.mask == "causal",
                                             scale=scale, enable_gqa=structure.groups > 1)
        return out.transpose(1, 2) if structure.layout == "bsnd" else out

    def inputs(case):
        q, k, v, hidden, bias = case.tensors()
        return [*_laid_out(structure, q, k, v), {"padding": ~hidden, "additive": bias}.get(structure.mask)]

    return attention, inputs


def megatron(structure):
    """megatron-core's DotProductAttention (local spec) on [s, b, n, d], with an explicit bool mask (causal or
    padding; True = masked) or none (Megatron's default causal mask). No additive masks in Megatron."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron_glue.capture.models import gpt_config

    def module(dtype):
        config = gpt_config(hidden_size=structure.n * structure.d, num_attention_heads=structure.n,
                            num_query_groups=structure.n_kv, bf16=dtype == torch.bfloat16, params_dtype=dtype)
        return DotProductAttention(config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")

    modules = {torch.bfloat16: module(torch.bfloat16), torch.float32: module(torch.float32)}

    def core_attention(q, k, v, mask):
        # a bf16 config casts its probabilities to bf16, so the float64 reference runs the fp32 config
        return modules.get(q.dtype, modules[torch.float32])(q, k, v, mask)

    def inputs(case):
        q, k, v, hidden, _ = case.tensors()
        if structure.mask == "padding":
            mask = hidden
        elif structure.mask == "none" and structure.sp.get("default_mask"):
            mask = None
        else:
            mask = hidden[None, None]
        return [*(t.permute(2, 0, 1, 3).contiguous().requires_grad_() for t in (q, k, v)), mask]

    return core_attention, inputs


def _laid_out(structure, q, k, v):
    if structure.layout == "bsnd":
        q, k, v = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    return (t.requires_grad_() for t in (q, k, v))


BUILDERS = {"written_out": written_out, "sdpa": sdpa, "megatron": megatron}
SEQUENCE_DIM = {"bnsd": 2, "bsnd": 1, "bnsd->bsnd": 2, "megatron": 0}


def mark_lengths_dynamic(style, case, inputs):
    """The sequence dims of k, v, the mask and (in self-attention) q: symbols in the compiled graph."""
    q, k, v, mask = inputs
    dim = SEQUENCE_DIM["megatron" if style == "megatron" else case.structure.layout]
    if case.structure.lengths == "self":
        torch._dynamo.mark_dynamic(q, dim)
    torch._dynamo.mark_dynamic(k, dim)
    torch._dynamo.mark_dynamic(v, dim)
    if mask is not None:
        for axis, length in ((-2, case.sq), (-1, case.sk)):
            if mask.size(axis) == length > 1:
                torch._dynamo.mark_dynamic(mask, mask.dim() + axis)


def check_structure(style, structure, hypothesis_settings, sizes=(2, 8)):
    """``structure`` compiled once; every example Hypothesis draws runs that graph and equals eager (outputs and
    gradients held to float64: no further from it than eager is, plus the dtype's tolerance), and the graph fused
    its one attention."""
    fn, inputs_of = BUILDERS[style](structure)
    dim = SEQUENCE_DIM["megatron" if style == "megatron" else structure.layout]

    def one_sequence(q, k, v, mask):
        # k and v have one length (and q too, in self-attention), as a model's projections of one sequence do;
        # mark_dynamic alone gives each input a symbol of its own
        torch._check(v.size(dim) == k.size(dim))
        if structure.lengths == "self":
            torch._check(q.size(dim) == k.size(dim))
        for axis, length in ((-1, k.size(dim)), (-2, q.size(dim))):  # and a mask built for them
            if mask is not None and mask.size(axis) != 1:
                torch._check(mask.size(axis) == length)
        return fn(q, k, v, mask)

    # Megatron's attention in training with a symbolic length is left unfused today (q/k/v leaves of [s, b, n, d]):
    # there each length compiles a graph of its own (sizes stays under dynamo's recompile limit)
    static = style == "megatron" and structure.training
    if static:
        sizes = (sizes[0], min(sizes[1], sizes[0] + 6))  # at most 7 lengths, 7 graphs
    compiled = torch.compile(one_sequence, backend="ascend", options={"fusions": list(RULES)},
                             dynamic=False if static else None)

    def run(f, args):
        with torch.set_grad_enabled(structure.training):
            out = f(*args)
            if not structure.training:
                return [out]
            seed = torch.randn(out.shape, generator=torch.Generator().manual_seed(0))
            out.backward(seed.to(out.dtype))
        return [out, *(a.grad for a in args if isinstance(a, torch.Tensor) and a.requires_grad)]

    def fresh(args, dtype=None):
        return [a.detach().to(dtype if dtype and a.is_floating_point() else a.dtype).requires_grad_(a.requires_grad)
                if isinstance(a, torch.Tensor) else a for a in args]

    @hypothesis_settings
    @given(case=cases(structure, sizes))
    def equals_eager(case):
        args = inputs_of(case)
        compiled_args = fresh(args)
        if not static:
            mark_lengths_dynamic(style, case, compiled_args)
        got = run(compiled, compiled_args)
        with torch._dynamo.config.patch(disable=True):  # Megatron's jit_fuser is torch.compile: keep eager eager
            eager, exact = run(fn, fresh(args)), run(fn, fresh(args, torch.float64))
        names = ["out", "grad q", "grad k", "grad v", "grad mask"][:len(got)]
        for name, g, e, x in zip(names, got, eager, exact, strict=True):
            assert g.dtype == e.dtype and g.shape == e.shape, name
            allowed = TOLERANCE[structure.dtype] + rel_error(e, x)
            assert rel_error(g, x) <= allowed, (name, case.sq, case.sk, rel_error(g, x), allowed)

    torch._dynamo.reset()
    with collect() as reports:
        equals_eager()
    torch._dynamo.reset()
    assert static or len(reports) == 1, f"{len(reports)} graphs: the sequence lengths were specialized"
    for report in reports:
        assert report.fusions == {"attention": 1}, f"{style} left unfused: {attention_unfused(report)}"
        assert not UNFUSED_OPS & set(report.lowered_ops)


# bf16: 2 ulps of the tensor's scale beyond eager's own error against float64, as in tests/passes/conftest.py
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2 * 2.0**-8}


def rel_error(a, b):
    a, b = a.detach().double(), b.detach().double()
    return 0.0 if b.numel() == 0 else ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


# structures × examples per structure: each family >= 200 examples, a compile per structure (its cost: an example
# after it is a run of the compiled graph at another length); every value of every axis held by some structure
FAMILY_RUNS = {"written_out": (12, 20), "sdpa": (16, 13), "megatron": (7, 30)}
STRUCTURES = {style: structures(style, count) for style, (count, _) in FAMILY_RUNS.items()}


# Gaps the structures above found, each a strict xfail (it fails today; a fix makes it pass and the mark must go):
KNOWN_GAPS = {
    # head dim 4, two keys, bf16: q's gradient 3.8e-2 from float64 where eager's is 1.7e-2 (allowed: eager's plus
    # 2 bf16 ulps, 2.4e-2); not diagnosed
    "bf16-training-b1-kv1x1-d4-none-bnsd-self-default_mask=False": "bf16 grad q at d 4 over 2 keys: over tolerance",
}


def _marked(structures: list) -> list:
    return [pytest.param(s, id=str(s), marks=[pytest.mark.xfail(strict=True, reason=KNOWN_GAPS[str(s)])]
                         if str(s) in KNOWN_GAPS else []) for s in structures]


def test_every_known_gap_is_a_structure_that_runs():
    """A gap whose structure is no longer drawn would mark nothing: its entry goes with it."""
    drawn = {str(s) for family in STRUCTURES.values() for s in family}
    assert set(KNOWN_GAPS) <= drawn, set(KNOWN_GAPS) - drawn


@pytest.mark.parametrize("structure", _marked(STRUCTURES["written_out"]))
def test_written_out_attention_equals_eager(structure):
    check_structure("written_out", structure, settings(max_examples=FAMILY_RUNS["written_out"][1], deadline=None))


@pytest.mark.parametrize("structure", STRUCTURES["sdpa"], ids=str)
def test_sdpa_equals_eager(structure):
    check_structure("sdpa", structure, settings(max_examples=FAMILY_RUNS["sdpa"][1], deadline=None))


@pytest.mark.parametrize("structure", _marked(STRUCTURES["megatron"]))
def test_megatron_core_attention_equals_eager(structure, megatron_cpu):
    check_structure("megatron", structure, settings(max_examples=FAMILY_RUNS["megatron"][1], deadline=None))


FUZZ_STRUCTURES = [(style, structure) for style in BUILDERS
                   for structure in structures(style, 60, heads=(1, 2, 3), dims=(4, 8, 16, 32, 64))]


@pytest.mark.fuzz
@pytest.mark.parametrize("style, structure", FUZZ_STRUCTURES, ids=lambda x: str(x))
def test_attention_equals_eager_fuzz(style, structure, megatron_cpu):
    """More structures (three kv heads, head dims to 64), each with 50 examples of lengths up to 40."""
    check_structure(style, structure, settings(settings.get_profile("fuzz"), max_examples=50), sizes=(2, 40))


# ==== sites left unfused, and why ============================================================================

def _written_out_inputs():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 6, 8, generator=g, requires_grad=True) for _ in range(3))
    return q, k, v, torch.randn(1, 1, 6, 6, generator=g)


def _compile_report(fn, *inputs, fusions=RULES):
    with collect() as reports:
        out = torch.compile(fn, backend="ascend", options={"fusions": list(fusions)})(*inputs)
        out.sum().backward()
    (report,) = reports
    return report


def test_switched_off_rule_reports_the_softmax():
    def attention(q, k, v, bias):
        return (q @ k.transpose(-2, -1) * 0.3 + bias).softmax(dim=-1) @ v

    report = _compile_report(attention, *_written_out_inputs(), fusions=())
    assert "attention" not in report.fusions
    assert attention_unfused(report) == [
        {"op": "aten._softmax.default", "node": "_softmax", "rule": "attention",
         "reason": "rule 'attention' is switched off by options['fusions']"}
    ]


def test_additive_mask_in_another_dtype_is_declined_with_the_reason():
    """fp32 scores + a bf16 mask: eager promotes, the op's additive mask (NPU pse) must be in the query's dtype."""

    def attention(q, k, v, bias):
        return (q @ k.transpose(-2, -1) * 0.3 + bias).softmax(dim=-1) @ v

    q, k, v, bias = _written_out_inputs()
    report = _compile_report(attention, q, k, v, bias.bfloat16())
    assert report.fusions == {"attention": 0}
    (site,) = attention_unfused(report)
    assert site["op"] == "aten._softmax.default"
    assert site["reason"] == "additive mask dtype torch.bfloat16 differs from the query's torch.float32"


def test_unknown_spelling_is_reported():
    """torch.where filling with a tensor constant (not a number) is a spelling no rule holds: the op's fill is a
    float, and the constant's value is not in the graph's ops."""

    def attention(q, k, v, bias):
        scores = q @ k.transpose(-2, -1) * 0.3
        return torch.where(bias > 0, scores, torch.tensor(-1e4)).softmax(dim=-1) @ v

    report = _compile_report(attention, *_written_out_inputs())
    assert report.fusions == {"attention": 0}
    (site,) = attention_unfused(report)
    assert site["reason"] == "no attention pattern matched the ops around it"


def test_one_switch_holds_every_family():
    from npu_compile.passes import RULES as registry

    names = {r.pattern.__name__.split("(")[0] for r in registry["attention"]}
    assert names == {"megatron_core_attention", "sdpa_attention", "written_out_attention"}
