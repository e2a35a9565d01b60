"""``verify=True``: on the first call, run the captured (unfused, eager) graph beside the compiled one and compare.

The eager run sees clones of the inputs (graphs may mutate them) and the same RNG state as the compiled run;
graphs with dropout still differ where a fused op draws its own random numbers, which the report states.
The comparison goes to report.json ``verify`` and the log; it never raises.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.utils._pytree as pytree

from npu_compile.debug.dump import GraphDump
from npu_compile.debug.report import Report

log = logging.getLogger("npu_compile")


def compare(expected: object, actual: object) -> dict[str, object]:
    """Max absolute and relative difference over matching tensor leaves of two outputs."""
    exp = [t for t in pytree.tree_leaves(expected) if isinstance(t, torch.Tensor)]
    act = [t for t in pytree.tree_leaves(actual) if isinstance(t, torch.Tensor)]
    if len(exp) != len(act):
        return {"ok": False, "why": f"{len(exp)} tensor outputs eager, {len(act)} compiled"}
    tol = 1e-5  # DESIGN.md: fused ops within 1e-5 relative of eager in fp32
    max_abs = max_rel = 0.0
    ok = True
    for e, a in zip(exp, act):
        if e.shape != a.shape or e.dtype != a.dtype:
            return {"ok": False, "why": f"output {tuple(e.shape)} {e.dtype} eager, {tuple(a.shape)} {a.dtype} compiled"}
        if not e.is_floating_point():
            ok = ok and torch.equal(e, a)
            continue
        e, a = e.detach().double(), a.detach().double()
        d = (e - a).abs()
        if d.numel():
            max_abs = max(max_abs, d.max().item())
            max_rel = max(max_rel, (d / e.abs().clamp_min(1e-12)).max().item())
            ok = ok and bool((d <= tol + tol * e.abs()).all())
    return {"ok": ok, "max_abs_diff": max_abs, "max_rel_diff": max_rel, "tolerance": tol}


def verified(compiled: Callable, eager_gm: torch.fx.GraphModule, report: Report, dump: GraphDump) -> Callable:
    """``compiled``, comparing its first call against ``eager_gm`` on the same inputs."""
    done = False

    def run(*args: object) -> object:
        nonlocal done
        if done:
            return compiled(*args)
        done = True
        clones = [a.detach().clone() if isinstance(a, torch.Tensor) else a for a in args]
        rng = torch.get_rng_state()
        try:
            with torch.no_grad():
                expected = eager_gm(*clones)
        except Exception as e:  # verification is an aid: report, never fail the user's step
            report.verify = {"ok": False, "why": f"eager run failed: {type(e).__name__}: {e}"}
            expected = None
        torch.set_rng_state(rng)
        out = compiled(*args)
        if expected is not None:
            report.verify = compare(expected, out)
        log.log(logging.INFO if report.verify.get("ok") else logging.WARNING, "graph %s verify: %s", report.graph_id, report.verify)
        dump.report(report.to_json())
        return out

    return run
