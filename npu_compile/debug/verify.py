"""``verify=True``: on the first call, run the captured (unfused, eager) graph beside the compiled one and compare
outputs and, when the graph is differentiable, gradients.

The eager run sees clones of the inputs (graphs may mutate them) and the same RNG state as the compiled run;
graphs with dropout still differ where a fused op draws its own random numbers, which the report states.
Gradients: the compiled graph's forward and backward run once more on clones, as does the eager graph, both
with the same upstream gradient (drawn from a fixed seed), and the gradients of every input that requires grad
are compared. The user's own step then runs on the compiled graph as it would without ``verify``.

Half precision (bf16 / fp16): compiled and eager both round, differently — a fused op keeping fp32 statistics is
often the closer of the two — so both are also measured against the captured graph run in float64 (its dtype
literals raised to float64), and a half-precision tensor passes when the compiled error is within
:data:`HALF_FACTOR` times eager's own error, or within its dtype's tolerance of eager.

Tolerance follows the dtype of each tensor: a difference ``d`` passes when ``d <= rtol * (|eager| + mean|eager|)``,
i.e. within ``rtol`` of the element, or of the tensor's typical magnitude where the element is near zero (sums
that cancel), with ``rtol`` from :data:`RTOL` — 1e-5 in fp32 (the fused-op bar of the tests), torch.testing's defaults for half types.
The comparison goes to report.json ``verify`` and the log; it never raises.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch
import torch.utils._pytree as pytree

from npu_compile.debug.dump import GraphDump
from npu_compile.debug.report import Report

log = logging.getLogger("npu_compile")

# Relative tolerance per dtype: fp32 as the fused-op tests hold it; bf16 / fp16 as torch.testing.assert_close's
# defaults (1.6e-2 is two bf16 ulps at 1.0, 1e-3 two fp16 ulps at 1.0).
RTOL = {torch.float64: 1e-7, torch.float32: 1e-5, torch.bfloat16: 1.6e-2, torch.float16: 1e-3}
HALF_FACTOR = 2.0  # a half-precision result passes within this factor of eager's own error against float64
GRAD_SEED = 20241  # the upstream gradient of the gradient check is drawn from this seed


def _tensors(tree: object) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]


def compare(expected: object, actual: object, what: str = "output", exact: object = None) -> dict[str, object]:
    """Max absolute and relative difference over matching tensor leaves of two results, and whether every
    element is within its dtype's tolerance; with ``exact`` (the same result in float64), a half-precision tensor
    also passes when its error against ``exact`` is within :data:`HALF_FACTOR` of eager's."""
    exp, act = _tensors(expected), _tensors(actual)
    ref = _tensors(exact) if exact is not None else []
    if len(ref) != len(exp):
        ref = []
    if len(exp) != len(act):
        return {"ok": False, "why": f"{len(exp)} tensor {what}s eager, {len(act)} compiled"}
    max_abs = max_rel = 0.0
    ok = True
    tolerances: dict[str, float] = {}
    against_exact: list[dict[str, float]] = []
    worst: str | None = None
    for i, (e, a) in enumerate(zip(exp, act)):
        if e.shape != a.shape or e.dtype != a.dtype:
            return {"ok": False, "why": f"{what} {i}: {tuple(e.shape)} {e.dtype} eager, {tuple(a.shape)} {a.dtype} compiled"}
        if not e.is_floating_point():
            if not torch.equal(e, a):
                ok, worst = False, worst or f"{what} {i} ({e.dtype}) differs"
            continue
        rtol = RTOL.get(e.dtype, 1e-5)
        tolerances[str(e.dtype).removeprefix("torch.")] = rtol
        e, a = e.detach().double(), a.detach().double()
        if not e.numel():
            continue
        d = (e - a).abs()
        max_abs = max(max_abs, d.max().item())
        max_rel = max(max_rel, (d / e.abs().clamp_min(1e-12)).max().item())
        bound = rtol * (e.abs() + e.abs().mean())
        bad = ~(d <= bound)  # NaN compares false: a NaN on one side only fails
        bad &= ~(torch.isnan(e) & torch.isnan(a))
        if bad.any() and ref and exp[i].dtype in HALF and ref[i].shape == e.shape:
            r = ref[i].detach().double()
            err_c, err_e = (a - r).abs().max().item(), (e - r).abs().max().item()
            result_vs = {"compiled_err_vs_float64": err_c, "eager_err_vs_float64": err_e}
            against_exact.append(result_vs)
            if err_c <= HALF_FACTOR * err_e:
                continue
        if bad.any():
            ok = False
            if worst is None:
                j = int(bad.flatten().nonzero()[0])
                worst = (f"{what} {i} {tuple(e.shape)}: element {j} is {a.flatten()[j].item():.6g} compiled, "
                         f"{e.flatten()[j].item():.6g} eager (tolerance {bound.flatten()[j].item():.3g})")
    result: dict[str, object] = {"ok": ok, "max_abs_diff": max_abs, "max_rel_diff": max_rel,
                                 "tolerance": tolerances}
    if against_exact:
        result["against_float64"] = {k: max(x[k] for x in against_exact) for k in against_exact[0]}
    if worst is not None:
        result["why"] = worst
    return result


HALF = (torch.bfloat16, torch.float16)


def float64_twin(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of ``gm`` computing in float64: every floating dtype literal in its calls raised to float64."""
    import copy

    twin = copy.deepcopy(gm)
    floats = (torch.float32, torch.bfloat16, torch.float16)
    raise_ = lambda v: torch.float64 if v in floats else v  # noqa: E731
    for n in twin.graph.nodes:
        n.args = torch.fx.node.map_aggregate(n.args, raise_)
        n.kwargs = torch.fx.node.map_aggregate(n.kwargs, raise_)
    twin.recompile()
    return twin.double()


def _as_float64(args: Sequence[object]) -> list[object]:
    return [a.detach().double().requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor) and a.is_floating_point()
            else (a.detach().clone() if isinstance(a, torch.Tensor) else a) for a in args]


def _clone(args: Sequence[object]) -> list[object]:
    return [a.detach().clone().requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor) else a for a in args]


def _grads(fn: Callable, args: Sequence[object], upstream: list[torch.Tensor] | None):
    """Gradients of ``fn(*args)`` w.r.t. the inputs that require grad, with ``upstream`` (drawn when None)."""
    out = _tensors(fn(*args))
    diff = [o for o in out if o.requires_grad and o.is_floating_point()]
    wrt = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    if not diff or not wrt:
        return None, upstream
    if upstream is None:
        g = torch.Generator().manual_seed(GRAD_SEED)
        upstream = [torch.randn(o.shape, generator=g, dtype=torch.float32).to(o.dtype).to(o.device) for o in diff]
    grads = torch.autograd.grad(diff, wrt, upstream, allow_unused=True)
    return [None if g is None else g.detach() for g in grads], upstream


def verified(compiled: Callable, eager_gm: torch.fx.GraphModule, report: Report, dump: GraphDump) -> Callable:
    """``compiled``, comparing its first call against ``eager_gm`` on the same inputs."""
    done = False

    def run(*args: object) -> object:
        nonlocal done
        if done:
            return compiled(*args)
        done = True
        rng = torch.get_rng_state()
        verdict: dict[str, object]
        try:
            with torch.no_grad():
                expected = eager_gm(*_clone(args))
        except Exception as e:  # verification is an aid: report, never fail the user's step
            verdict, expected = {"ok": False, "why": f"eager run failed: {type(e).__name__}: {e}"}, None
        half = expected is not None and any(t.dtype in HALF for t in _tensors(expected) + _tensors(args))
        exact = twin = None
        if half:
            try:
                twin = float64_twin(eager_gm)
                torch.set_rng_state(rng)
                with torch.no_grad():
                    exact = twin(*_as_float64(args))
            except Exception as e:  # the plain comparison still runs
                log.info("graph %s verify: no float64 reference (%s: %s)", report.graph_id, type(e).__name__, e)
                twin = None
        torch.set_rng_state(rng)
        grads = None
        if expected is not None and torch.is_grad_enabled() and any(
                isinstance(a, torch.Tensor) and a.requires_grad for a in args):
            grads = _compare_grads(compiled, eager_gm, twin, args, rng)
            torch.set_rng_state(rng)
        out = compiled(*args)
        if expected is not None:
            verdict = compare(expected, out, exact=exact)
            if grads is not None:
                verdict["gradients"] = grads
                verdict["ok"] = bool(verdict["ok"] and grads.get("ok"))
                if "why" not in verdict and "why" in grads:
                    verdict["why"] = grads["why"]
        report.verify = verdict
        log.log(logging.INFO if verdict.get("ok") else logging.WARNING, "graph %s verify: %s", report.graph_id, verdict)
        dump.report(report.to_json())
        return out

    return run


def _compare_grads(compiled: Callable, eager_gm: torch.fx.GraphModule, twin: torch.fx.GraphModule | None,
                   args: Sequence[object], rng: torch.Tensor) -> dict[str, object]:
    exact = None
    try:
        torch.set_rng_state(rng)
        actual, upstream = _grads(compiled, _clone(args), None)
        if actual is None:
            return {"ok": True, "why": "no output requires grad"}
        torch.set_rng_state(rng)
        expected, _ = _grads(eager_gm, _clone(args), upstream)
        if twin is not None:
            torch.set_rng_state(rng)
            exact, _ = _grads(twin, _as_float64(args), [u.double() for u in upstream])
    except Exception as e:
        return {"ok": False, "why": f"gradient check failed: {type(e).__name__}: {e}"}
    # an input one side leaves without gradient has a zero gradient there
    wrt = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    fill = lambda gs: [torch.zeros_like(w) if g is None else g for g, w in zip(gs, wrt)]  # noqa: E731
    return compare(fill(expected), fill(actual), what="gradient", exact=None if exact is None else fill(exact))
