"""The fusion rule engine: rules as data, applied by torch's pattern matcher on our own passes.

A rule is a named pair of plain functions — ``pattern`` (the code as models write it) and ``replacement``
(usually one fused ``npu_compile`` op) — plus example inputs to trace them with. The engine traces each pattern
the way our backend produces graphs (aot_autograd, no decompositions; the joint forward+backward graph for
training, the functionalized forward for inference), so a rule fires on the aten ops a model really shows, and
in training the fused op's own backward replaces autograd's. Tracing happens on first use, never at import.

Every registration under one name is one switch in ``options["fusions"]`` and one count in report.json.
Sites a rule could have taken but did not (an *anchor* op of the rule left in the graph) are reported with
the reason. Inductor's global pattern tables and configs are never touched.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch._functorch.aot_autograd import aot_function, make_boxed_func
from torch._inductor.fx_passes.joint_graph import early_patterns
from torch._inductor.fx_passes.post_grad import remove_noop_ops
from torch._inductor.pattern_matcher import (
    Match,
    PatternMatcherPass,
    joint_fwd_bwd,
    register_replacement,
    stable_topological_sort,
)

log = logging.getLogger("npu_compile")

TRAINING, INFERENCE = "training", "inference"


def decompositions() -> dict:
    """The decomposition table of our aot_autograd call, shared with pattern tracing (they must agree).

    Empty: graphs keep the aten ops the model called (``native_layer_norm``, ``gelu``, ``_softmax``), which is
    what Ascend's fused kernels replace, and one traced pattern then matches fp32 and bf16 alike.
    """
    return {}


# -- tracing: patterns are traced exactly as the backend produces graphs --------------------------------------


def trace_training(fn: Callable, args: Sequence[Any], *, get_decomp_fn: Callable[[], dict] = decompositions):
    """The joint forward+backward graph of ``fn``, normalized like :func:`normalize` does to model graphs."""
    return joint_fwd_bwd(fn, args, get_decomp_fn=get_decomp_fn)


def trace_inference(fn: Callable, args: Sequence[Any], *, get_decomp_fn: Callable[[], dict] = decompositions):
    """The functionalized forward graph aot_autograd hands our inference compiler for ``fn``."""
    captured: list[torch.fx.GraphModule] = []

    def keep(gm: torch.fx.GraphModule, _: Any) -> Callable:
        captured.append(gm)
        return make_boxed_func(gm)

    with torch.no_grad(), torch._guards.tracing(None):
        aot_function(fn, keep, decompositions=get_decomp_fn(), keep_inference_input_mutations=True)(*args)
    (gm,) = captured
    remove_noop_ops(gm.graph)
    gm.graph._codegen = torch.fx.graph.CodeGen()  # plain positional placeholders, as patterns expect
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return gm


def normalize(graph: torch.fx.Graph, mode: str) -> None:
    """Bring a model graph into the form patterns are traced in (research: leaving out a step, or reordering
    them, loses matches: a dead ``new_empty_strided`` left by functionalization blocks view folding)."""
    remove_noop_ops(graph)
    if mode == TRAINING:
        early_patterns.apply(graph)
    graph.eliminate_dead_code()


# -- rules ------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Rule:
    """One pattern → replacement pair. Several may share a ``name`` (variants of one fusion)."""

    name: str
    pattern: Callable[..., Any]
    replacement: Callable[..., Any]
    # Each call returns the example-input lists to trace with: one per variant (dtype, layout, ...).
    # Tensors that need grad in training must say so (requires_grad=True); shapes only need the right rank.
    example_inputs: Callable[[], Sequence[Sequence[Any]]]
    # Float/int arguments: a magic value to trace with, so the real value is read from the match.
    scalars: Mapping[str, float | int] = dataclasses.field(default_factory=dict)
    # Returns True to take a match, or a string saying why not (it lands in report.json ``unfused``).
    extra_check: Callable[[Match], bool | str] | None = None
    modes: tuple[str, ...] = (TRAINING, INFERENCE)
    # Ops whose presence after the pass marks a site this rule could have taken.
    anchors: tuple[Any, ...] = ()


RULES: dict[str, list[Rule]] = {}
_passes: dict[tuple[str, str], PatternMatcherPass] = {}
_rejections: dict[str, str] = {}  # output node name -> why extra_check declined it (this apply only)


def register_rule(rule: Rule) -> Rule:
    """Add ``rule`` to the registry; cheap (tracing waits for the first graph that needs it)."""
    if rule.name in RULES and any(r.pattern is rule.pattern for r in RULES[rule.name]):
        return rule  # the same module imported twice
    RULES.setdefault(rule.name, []).append(rule)
    for mode in rule.modes:
        _passes.pop((rule.name, mode), None)  # rebuilt with the new variant on next use
    return rule


def unregister_rule(name: str) -> None:
    """Remove every registration under ``name`` (for rules added by tests or notebooks)."""
    RULES.pop(name, None)
    for mode in (TRAINING, INFERENCE):
        _passes.pop((name, mode), None)


def rule_names() -> tuple[str, ...]:
    return tuple(RULES)


def _checked(rule: Rule) -> Callable[[Match], bool]:
    def check(match: Match) -> bool:
        verdict = rule.extra_check(match) if rule.extra_check else True
        if verdict is True:
            return True
        out = match.output_nodes()[0]
        if out is not None:
            _rejections[out.name] = verdict if isinstance(verdict, str) else f"rule {rule.name!r} declined the match"
        return False

    return check


def _pass(name: str, mode: str) -> PatternMatcherPass:
    key = (name, mode)
    if key not in _passes:
        p = PatternMatcherPass(pass_name=f"npu_compile_{name}_{mode}")
        trace = trace_training if mode == TRAINING else trace_inference
        for rule in RULES[name]:
            if mode not in rule.modes:
                continue
            for example in rule.example_inputs():
                register_replacement(
                    rule.pattern,
                    rule.replacement,
                    list(example),
                    trace,
                    p,
                    extra_check=_checked(rule),
                    scalar_workaround=dict(rule.scalars),
                    skip_duplicates=True,  # variants that trace to the same graph register once
                    get_decomp_fn=decompositions,
                )
        _passes[key] = p
    return _passes[key]


def apply_rules(gm: torch.fx.GraphModule, enabled: Callable[[str], bool], mode: str) -> tuple[dict, list]:
    """Apply every enabled rule to ``gm`` (in registration order); returns (sites per rule, unfused sites)."""
    normalize(gm.graph, mode)
    _rejections.clear()
    counts: dict[str, int] = {}
    for name in RULES:
        if enabled(name) and any(mode in r.modes for r in RULES[name]):
            counts[name] = _pass(name, mode).apply(gm.graph)
    if any(counts.values()):
        stable_topological_sort(gm.graph)  # multi-output replacements can land before their inputs
        gm.graph.eliminate_dead_code()
    gm.graph.lint()
    gm.recompile()
    return counts, _unfused(gm.graph, enabled, mode)


def _unfused(graph: torch.fx.Graph, enabled: Callable[[str], bool], mode: str) -> list[dict[str, str]]:
    sites = []
    for name, rules in RULES.items():
        anchors = {a for r in rules if mode in r.modes for a in r.anchors}
        for node in graph.nodes:
            if node.op != "call_function" or node.target not in anchors:
                continue
            if not enabled(name):
                reason = f"rule {name!r} is switched off by options['fusions']"
            else:
                reason = _rejection_near(node) or f"no {name} pattern matched the ops around it"
            sites.append({"op": str(node.target), "node": node.name, "rule": name, "reason": reason})
    return sites


def _rejection_near(node: torch.fx.Node) -> str | None:
    """The extra_check verdict recorded for a match whose output is ``node`` or a close user of it."""
    frontier, seen = [node], set()
    for _ in range(8):
        nxt = []
        for n in frontier:
            if n.name in _rejections:
                return _rejections[n.name]
            seen.add(n)
            nxt += [u for u in n.users if u not in seen]
        frontier = nxt
    return None
