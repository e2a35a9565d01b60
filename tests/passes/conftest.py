"""Shared set-up for the pass tests: the comparison of a function compiled with ascend against eager that the rule
families' property tests make (Hypothesis profiles and the fuzz switch are in tests/conftest.py)."""

import pytest
import torch

from npu_compile.debug.report import collect


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual − expected| over max |expected|: the error relative to the tensor's scale (an elementwise
    ratio would blow up where values cross zero)."""
    expected, actual = expected.detach().double(), actual.detach().double()
    if expected.numel() == 0:
        return 0.0
    return ((actual - expected).abs().max() / expected.abs().max().clamp_min(1e-30)).item()


# fp32: the project's 1e-5 against eager. Lower precisions: eager rounds after every op and the fused ops once
# from fp32, so the compiled result is held to the float64 result instead: no further from it than eager is,
# plus two ulps (bf16: 2^-8 each, fp16: 2^-11) of the tensor's scale.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2 * 2.0**-8, torch.float16: 2 * 2.0**-11}


class Comparison:
    """What one compiled-against-eager run found: the graph's report and the largest relative error."""

    def __init__(self, report, errors: dict[str, float]):
        self.report, self.errors = report, errors
        self.fusions = report.fusions

    @property
    def max_error(self) -> float:
        return max(self.errors.values(), default=0.0)


def compare_with_eager(fn, *inputs, rules, no_grad=False, fp32_against_float64=False) -> Comparison:
    """Run ``fn`` eagerly and compiled with backend="ascend" (only ``rules`` switched on) on fresh copies of
    ``inputs`` (requires_grad kept), and check the outputs and, unless ``no_grad``, the gradients of every input
    that needs one (see TOLERANCE). The gradient seed is a fixed random tensor, so elements weigh differently.
    ``fp32_against_float64``: hold fp32 results to float64 as well, for results that eager fp32 itself gets
    only to ~1e-5 (attention's q/k gradients when a row sees few keys come from cancellation)."""

    def fresh(dtype=None):
        # only floating-point inputs change dtype: bool masks and integer ids stay what they are
        return [t.detach().to(dtype if dtype and t.is_floating_point() else t.dtype).requires_grad_(t.requires_grad)
                if isinstance(t, torch.Tensor) else t for t in inputs]

    def run(f, args, seed_dtype=None):
        if no_grad:
            with torch.no_grad():
                return [f(*args)]
        out = f(*args)
        # the float64 run takes the very seed values the bf16/fp32 runs do (rounded to their dtype first)
        seed = torch.randn(out.shape, generator=torch.Generator().manual_seed(0)).to(seed_dtype or out.dtype)
        out.backward(seed.to(out.dtype))
        return [out, *(a.grad for a in args if isinstance(a, torch.Tensor) and a.requires_grad)]

    torch._dynamo.reset()
    with torch._dynamo.config.patch(disable=True):  # Megatron's jit_fuser is torch.compile: keep eager eager
        expected = run(fn, fresh())
        exact = expected
        if expected[0].dtype != torch.float32 or fp32_against_float64:
            exact = run(fn, fresh(torch.float64), seed_dtype=expected[0].dtype)
    with collect() as reports:
        got = run(torch.compile(fn, backend="ascend", options={"fusions": list(rules)}), fresh())
    torch._dynamo.reset()
    assert len(reports) == 1, f"{len(reports)} graphs compiled"
    names = ["out", *(f"grad {i}" for i in range(len(expected) - 1))]
    errors, bad, tol = {}, {}, TOLERANCE[expected[0].dtype]
    for name, g, e, x in zip(names, got, expected, exact):
        assert g.dtype == e.dtype and g.shape == e.shape, name
        errors[name] = relative_error(g, x)
        allowed = tol + (relative_error(e, x) if x is not e else 0.0)
        if errors[name] > allowed:
            bad[name] = f"{errors[name]:.2e} > {allowed:.2e}"
    assert not bad, f"relative errors: {bad}"
    return Comparison(reports[0], errors)


def train_with_eager(make_config, *, steps=3, memory_budget=1.0, batch=2, seq=32, vocab=128):
    """A 2-layer megatron-core GPTModel from ``make_config()`` trained ``steps`` SGD steps eagerly and compiled
    with ascend (all rules, ``memory_budget``) from the same weights on the same batches. Returns the compiled
    graph's report and the relative error of each step's per-token loss and of every gradient."""
    from megatron_glue.capture.models import build_gpt_model, synthetic_batch

    def train(model):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        history = []
        for step in range(steps):
            opt.zero_grad(set_to_none=True)
            loss = model(**synthetic_batch(batch, seq, vocab, seed=step))
            loss.mean().backward()
            history.append((loss.detach(), {n.removeprefix("_orig_mod."): p.grad for n, p in model.named_parameters()}))
            opt.step()
        return history

    torch._dynamo.reset()
    with torch._dynamo.config.patch(disable=True):  # Megatron's jit_fuser is torch.compile: keep eager eager
        expected = train(build_gpt_model(make_config(), vocab, seq, seed=0))
    with collect() as reports:
        compiled = torch.compile(build_gpt_model(make_config(), vocab, seq, seed=0), backend="ascend",
                                 options={"memory_budget": memory_budget})
        got = train(compiled)
    torch._dynamo.reset()
    assert len(reports) == 1 and reports[0].graph_breaks == 0
    errors = {}
    for step, ((loss0, grads0), (loss1, grads1)) in enumerate(zip(expected, got)):
        assert grads1.keys() == grads0.keys()
        errors[f"step {step} loss"] = relative_error(loss1, loss0)
        errors.update({f"step {step} grad {n}": relative_error(grads1[n], grads0[n]) for n in grads0})
    return Comparison(reports[0], errors)


def static_and_dynamic(fn, make_inputs, *, dynamic, rules, sizes=(12, 7)):
    """``fn`` compiled with ascend (only ``rules``) on ``make_inputs(n)`` for n in ``sizes``, once with static
    shapes and once with the dims ``dynamic`` ({input index: dim}) marked dynamic, forward and backward, each
    output and gradient checked against eager (fp32 within 1e-5 of float64 beyond eager's own error). The
    dynamic compilation must serve every size with one graph (its sizes are symbols, not guarded ints).
    Returns the fusions of the static and the dynamic graph (of the first size)."""

    def run(f, args):
        out = f(*args)
        out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(0), dtype=out.dtype))
        return [out, *(a.grad for a in args if isinstance(a, torch.Tensor) and a.requires_grad)]

    def fresh(inputs, dtype=None):
        return [t.detach().to(dtype or t.dtype).requires_grad_(t.requires_grad) for t in inputs]

    fusions = {}
    for is_dynamic in (False, True):
        torch._dynamo.reset()
        compiled = torch.compile(fn, backend="ascend", options={"fusions": list(rules)},
                                 dynamic=None if is_dynamic else False)
        with collect() as reports:
            for n in sizes:
                inputs = make_inputs(n)
                args = fresh(inputs)
                if is_dynamic:
                    for i, dim in dynamic.items():
                        torch._dynamo.mark_dynamic(args[i], dim)
                with torch._dynamo.config.patch(disable=True):
                    expected, exact = run(fn, fresh(inputs)), run(fn, fresh(inputs, torch.float64))
                got = run(compiled, args)
                for g, e, x in zip(got, expected, exact):
                    assert g.shape == e.shape and g.dtype == e.dtype
                    assert relative_error(g, x) <= 1e-5 + relative_error(e, x), (n, is_dynamic)
        if is_dynamic:
            assert len(reports) == 1, f"{len(reports)} graphs for sizes {sizes}: the dynamic dims were specialized"
        fusions[is_dynamic] = {k: v for k, v in reports[0].fusions.items() if v}
        assert reports[0].unfused == [], reports[0].unfused
    torch._dynamo.reset()
    return fusions[False], fusions[True]


@pytest.fixture(scope="session")
def static_then_dynamic():
    """``static_and_dynamic``, for the families' symbolic-shape tests."""
    return static_and_dynamic


@pytest.fixture(scope="session")
def against_eager():
    """``compare_with_eager``, for the families' property tests (pytest does not import conftest by name)."""
    return compare_with_eager


@pytest.fixture(scope="session")
def megatron_training():
    """``train_with_eager``; ask for ``megatron_cpu`` too."""
    return train_with_eager


@pytest.fixture(scope="session")
def rel_error():
    """``relative_error``: max |actual − expected| over max |expected|."""
    return relative_error
