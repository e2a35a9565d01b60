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

import collections
import contextlib
import copy
import dataclasses
import functools
import hashlib
import inspect
import itertools
import logging
import time
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch._functorch.aot_autograd import aot_function, make_boxed_func
from torch._inductor.fx_passes.joint_graph import early_patterns
from torch._inductor.fx_passes.post_grad import remove_noop_ops
from torch._inductor.pattern_matcher import (
    CallFunction,
    Ignored,
    Match,
    MultiOutputPattern,
    PatternExpr,
    PatternMatcherPass,
    joint_fwd_bwd,
    register_replacement,
    stable_topological_sort,
)
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.checkpoint import CheckpointPolicy

from npu_compile import cache

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
    """The joint forward+backward graph of ``fn``, normalized like :func:`normalize` does to model graphs.

    With no input that needs grad, ``fn``'s ops sit in a training graph without a backward (a norm of a frozen
    embedding's output scaled by a trained weight further on): its forward graph, normalized alike."""
    if not any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
        return _trace_forward(fn, args, get_decomp_fn=get_decomp_fn)
    return joint_fwd_bwd(fn, _ints_as_floats(args), get_decomp_fn=get_decomp_fn)


def _ints_as_floats(args: Sequence[Any]) -> list[Any]:
    """A rule's scalars are traced as floats (their magic values); one read from a graph as an int (Megatron's
    layer-number ``coeff``: ``mul(scores, 2)``) is re-traced as that float, which matches the same node. An int
    input would become a SymInt of the graph's shape environment in aot_autograd, with guards that name no
    source. SymInts (the sizes of the exact re-trace) stay."""
    return [float(a) if type(a) is int else a for a in args]


def _trace_forward(fn: Callable, args: Sequence[Any], *, get_decomp_fn: Callable[[], dict] = decompositions):
    """The forward graph of ``fn`` on inputs none of which needs grad, as a joint graph holds such ops."""
    captured: list[torch.fx.GraphModule] = []

    def keep(gm: torch.fx.GraphModule, _: Any) -> Callable:
        captured.append(gm)
        return make_boxed_func(gm)

    with torch._guards.tracing(None):
        aot_function(fn, keep, decompositions=get_decomp_fn(), keep_inference_input_mutations=True)(*_ints_as_floats(args))
    (gm,) = captured
    remove_noop_ops(gm.graph)
    early_patterns.apply(gm.graph)
    gm.graph._codegen = torch.fx.graph.CodeGen()
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return gm


def trace_inference(fn: Callable, args: Sequence[Any], *, get_decomp_fn: Callable[[], dict] = decompositions):
    """The functionalized forward graph aot_autograd hands our inference compiler for ``fn``."""
    captured: list[torch.fx.GraphModule] = []

    def keep(gm: torch.fx.GraphModule, _: Any) -> Callable:
        captured.append(gm)
        return make_boxed_func(gm)

    with torch.no_grad(), torch._guards.tracing(None):
        aot_function(fn, keep, decompositions=get_decomp_fn(), keep_inference_input_mutations=True)(*_ints_as_floats(args))
    (gm,) = captured
    remove_noop_ops(gm.graph)
    fold_view_round_trips(gm.graph)
    gm.graph._codegen = torch.fx.graph.CodeGen()  # plain positional placeholders, as patterns expect
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return gm


def normalize(graph: torch.fx.Graph, mode: str) -> None:
    """Bring a model graph into the form patterns are traced in. Every step is needed, in this order: leaving
    one out, or reordering them, loses matches (a dead ``new_empty_strided`` left by functionalization blocks
    view folding)."""
    canonical_sizes(graph)
    scalar_constants_as_full(graph)
    remove_noop_ops(graph)
    fold_full_slice_backwards(graph)
    if mode == TRAINING:
        early_patterns.apply(graph)
    else:
        fold_view_round_trips(graph)
    graph.eliminate_dead_code()


def scalar_constants_as_full(graph: torch.fx.Graph) -> None:
    """Replace ``lift_fresh_copy(get_attr c)`` of a 0-dim constant (Dynamo's ``x[mask] = 0``: Megatron's loss) by
    ``full([], c)`` of its dtype and device, the same value: torch's matcher cannot hold get_attr nodes, so a
    pattern writes the value as ``torch.full((), v, dtype=...)``."""
    owner = graph.owning_module
    for node in graph.find_nodes(op="call_function", target=torch.ops.aten.lift_fresh_copy.default):
        src = node.args[0]
        if owner is None or not (isinstance(src, torch.fx.Node) and src.op == "get_attr"):
            continue
        const = getattr(owner, src.target, None)
        if not isinstance(const, torch.Tensor) or const.dim() != 0:
            continue
        with torch._subclasses.fake_tensor.unset_fake_temporarily():  # the backend runs under the fake mode
            value = const.item()
        with graph.inserting_before(node):
            full = graph.call_function(torch.ops.aten.full.default, ([], value),
                                       {"dtype": const.dtype, "device": const.device, "pin_memory": False})
        full.meta = dict(node.meta)
        node.replace_all_uses_with(full)
        graph.erase_node(node)


def fold_view_round_trips(graph: torch.fx.Graph) -> None:
    """Replace a chain of ``_unsafe_view`` nodes that ends in the shape and strides it started from by its start.

    Functionalization writes such chains where a model mutates a reshaped tensor in place (inference graphs:
    training keeps autograd's out-of-place ops): Megatron's eval-mode bias-dropout-add, ``out.add_(residual)``
    on a matmul output seen through views, becomes add → _unsafe_view → _unsafe_view, which hides the add from
    the norm patterns. Chains with a plain ``view`` stay: a pattern may begin with one."""
    unsafe_view = torch.ops.aten._unsafe_view.default
    for node in graph.nodes:
        if node.target != unsafe_view:
            continue
        start = node.args[0]
        while isinstance(start, torch.fx.Node) and start.target == unsafe_view:
            start = start.args[0]
        a, b = (start.meta.get("val") if isinstance(start, torch.fx.Node) else None), node.meta.get("val")
        if (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and _same_sizes(a.shape, b.shape) and _same_sizes(a.stride(), b.stride())):
            node.replace_all_uses_with(start)


def fold_full_slice_backwards(graph: torch.fx.Graph) -> None:
    """Replace a ``slice_backward`` whose gradient already has the input's shape (the slice took the whole dim)
    by that gradient.

    A model's ``x[:, :, ::2]`` slices every dim; on a static dim the full slice is skipped when the index is
    applied, but on a symbolic one it is recorded, so a graph with a dynamic dim holds ``slice(x, 0, 0, max)``,
    which remove_noop_ops drops, and in the backward ``slice_backward(g, [s0, ...], 0, 0, max, 1)``, which it
    keeps: one node more than the pattern, traced with int sizes, has. Equal shapes mean the slice was the
    identity (a dim of n elements out of n, step ≥ 1, starts at 0 and takes each); equal strides and dtype keep
    the layout later nodes were traced with. A graph output is not made an alias of a graph input."""
    slice_backward = torch.ops.aten.slice_backward.default
    outputs = set(graph.output_node().args[0]) if graph.output_node() is not None else set()
    for node in list(graph.find_nodes(op="call_function", target=slice_backward)):
        grad = node.args[0]
        a, b = (grad.meta.get("val") if isinstance(grad, torch.fx.Node) else None), node.meta.get("val")
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and _same_sizes(a.shape, b.shape) and _same_sizes(a.stride(), b.stride())):
            continue
        if grad.op == "placeholder" and node in outputs:
            continue
        node.replace_all_uses_with(grad)
        graph.erase_node(node)


def _same_sizes(a: Sequence[Any], b: Sequence[Any]) -> bool:
    """Whether two size tuples are provably equal: symbolic sizes are compared without adding a guard."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true, sym_eq

    return len(a) == len(b) and statically_known_true(sym_eq(tuple(a), tuple(b)))


_SIZE_READS = (torch.ops.aten.sym_size.int, torch.ops.aten.sym_stride.int, torch.ops.aten.sym_numel.default,
               torch.ops.aten.sym_storage_offset.default)


def canonical_sizes(graph: torch.fx.Graph) -> None:
    """Give every symbolic size of a graph with dynamic shapes one node, computed from the graph's inputs.

    A traced pattern takes the sizes it needs as inputs (torch's register_replacement traces it with the match's
    SymInts as placeholders), so where a model graph holds several nodes for one size, one pattern input meets
    two nodes and the match fails; and a size read off an intermediate tensor (functionalization's
    ``sym_stride(baddbmm, 0)`` for the strides of a copied-back view) is one more user of that tensor, outside
    any pattern, which stops a match from taking the tensor. Here every SymInt-valued node is replaced by the
    first node of the same expression, and a size read off a non-input tensor by that expression built from the
    inputs' symbols; a size input whose expression an earlier size input has (two sources Dynamo passes as two
    inputs, one symbol after a ``torch._check`` equated them) is read as that earlier one. A static graph has no
    SymInt nodes and is left as it is. Data-dependent sizes (unbacked
    symbols: an MoE layer's tokens per expert) are left as they are: each node reading one may be where the
    partitioner finds the symbol bound, and no pattern takes them as inputs."""
    from torch.fx.experimental.symbolic_shapes import free_symbols, free_unbacked_symbols

    from npu_compile.sizes import SizeNodes

    nodes = list(graph.nodes)
    if not any(isinstance(n.meta.get("val"), torch.SymInt) for n in nodes):
        return
    sizes = SizeNodes(graph)  # nodes it makes go at the top, so they serve every later node
    known = sizes.symbols()
    seen: dict[Any, torch.fx.Node] = {}  # expression -> the first node of the graph computing it
    for n in nodes:
        v = n.meta.get("val")
        if not isinstance(v, torch.SymInt) or free_unbacked_symbols(v):
            continue
        expr = v.node.expr
        if n.op == "placeholder":
            # a second size input of the same expression (Dynamo passes one per source: a key length the model's
            # torch._check equated with the value length stays an input of its own) reads as the first
            first = sizes.by_expr.get(expr)
            if isinstance(first, torch.fx.Node) and first is not n:
                n.replace_all_uses_with(first)
            continue
        same = sizes.get(v) if expr in sizes.by_expr else seen.get(expr)
        if same is None and n.target in _SIZE_READS and n.args[0].op != "placeholder" and free_symbols(v) <= known:
            same = sizes.get(v)  # built from the inputs' symbols
        if isinstance(same, torch.fx.Node):
            if same is not n:
                n.replace_all_uses_with(same)
            continue
        seen[expr] = n
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
    # Which anchor nodes are sites: True (reported when left unfused), False (not one, e.g. a gelu with no
    # bias add in front), or a string: a site the rule leaves unfused by design, and why. None: every anchor.
    site: Callable[[torch.fx.Node], bool | str] | None = None
    # Inputs that may also feed ops after the pattern (a block's input feeds its norm and the residual add).
    # Autograd adds the gradient from those later ops first, which changes the backward's shape; in training
    # such a rule is also traced in that form (see _sharing).
    shared_inputs: tuple[str, ...] = ()
    # Whether a graph may hold this rule's sites (a cheap look at the graph). A rule is traced only once a
    # graph wants it, so a family of many spellings pays only for those that occur. None: every graph.
    wanted: Callable[[torch.fx.Graph], bool] | None = None
    # Which of the rule's examples a graph may hold (a cheap look at the graph and at one example list): where
    # examples trace different graphs for reasons the graph shows (strides that make a matmul copy its operand,
    # a decode step's single query row), a graph traces only those that can match it. None: every example.
    wanted_example: Callable[[torch.fx.Graph, Sequence[Any]], bool] | None = None
    # Inputs whose gradient a training graph may or may not want (a norm's input after a frozen embedding, a
    # bias that is frozen while its weight trains): in training the rule is also traced with each subset of
    # those that need grad in an example switched off (see grad_variants). Each subset is its own joint graph.
    grad_optional: tuple[str, ...] = ()


RULES: dict[str, list[Rule]] = {}
_registered_patterns: dict[str, set[int]] = {}  # rule name -> id() of each pattern registered under it (a hint: RULES decides)


@dataclasses.dataclass(frozen=True)
class GraphRule:
    """A fusion no fixed pattern can state (a loop unrolled over a data-dependent number of pieces, such as an MoE
    layer's experts): a function that rewrites the graph itself. ``apply(graph, mode)`` returns (sites fused,
    ``unfused`` entries: each site it declined, with the reason). Same switch (``options["fusions"]``) and
    report.json key as a pattern rule; applied after every pattern rule."""

    name: str
    apply: Callable[[torch.fx.Graph, str], tuple[int, list[dict[str, str]]]]
    modes: tuple[str, ...] = (TRAINING, INFERENCE)


GRAPH_RULES: dict[str, GraphRule] = {}


def register_graph_rule(rule: GraphRule) -> GraphRule:
    if rule.name in RULES:
        raise ValueError(f"rule name {rule.name!r} is a pattern rule's already")
    GRAPH_RULES[rule.name] = rule
    return rule
_groups: dict[tuple[str, str], "_Group"] = {}  # the traced variants of each (rule name, mode), in rule order
_rejections: dict[str, str] = {}  # output node name -> why extra_check declined it (this apply only)


@dataclasses.dataclass
class Tracing:
    """Rule patterns traced in this process so far, and the seconds it took (report.json ``compile_s``)."""

    patterns: int = 0
    seconds: float = 0.0


TRACING = Tracing()


def register_rule(rule: Rule) -> Rule:
    """Add ``rule`` to the registry; cheap (tracing waits for the first graph that needs it)."""
    seen = _registered_patterns.setdefault(rule.name, set())
    # the same module imported twice; the set first: a family's thousands of spellings register under one name, and
    # scanning the list at each would make importing them quadratic
    if id(rule.pattern) in seen and any(r.pattern is rule.pattern for r in RULES.get(rule.name, ())):
        return rule
    seen.add(id(rule.pattern))
    RULES.setdefault(rule.name, []).append(rule)
    for mode in rule.modes:
        _groups.pop((rule.name, mode), None)  # rebuilt with the new variant on next use
    return rule


def unregister_rule(name: str) -> None:
    """Remove every registration under ``name`` (for rules added by tests or notebooks)."""
    RULES.pop(name, None)
    _registered_patterns.pop(name, None)
    for mode in (TRAINING, INFERENCE):
        _groups.pop((name, mode), None)


def rule_names() -> tuple[str, ...]:
    return (*RULES, *GRAPH_RULES)


def undecided_on_data_dependent_sizes(check: Callable[[Match], bool | str], match: Match) -> bool | str:
    """``check(match)``, or the reason it cannot decide: a check that compares a data-dependent size (an unbacked
    symbol, such as an MoE expert's token count) would add a guard Dynamo cannot give
    (GuardOnDataDependentSymNode); the site is declined, never the compile failed."""
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    try:
        return check(match)
    except GuardOnDataDependentSymNode as e:
        expression = str(e).splitlines()[0]
        return f"a data-dependent size decides the check ({expression}); declined"


def _checked(rule: Rule) -> Callable[[Match], bool]:
    def check(match: Match) -> bool:
        # every rule first: torch's matcher ignores keyword arguments its pattern lacks (see kwargs_as_traced)
        verdict = kwargs_as_traced(match)
        if verdict is True and rule.extra_check:
            verdict = undecided_on_data_dependent_sizes(rule.extra_check, match)
        if verdict is True:
            return True
        out = match.output_nodes()[0]
        if out is not None:
            _rejections[out.name] = verdict if isinstance(verdict, str) else f"rule {rule.name!r} declined the match"
        return False

    return check


@dataclasses.dataclass
class _Variant:
    """One traced form of a rule: a pattern with one list of example inputs, in a pass of its own (None until
    traced; None after tracing when it traced to a graph an earlier variant registered already)."""

    rule: Rule
    pattern: Callable[..., Any]
    replacement: Callable[..., Any]
    trace_fn: Callable[..., Any]
    example: list[Any]
    traced: bool = False
    pass_: PatternMatcherPass | None = None


class _Group:
    """The variants of one rule name in one mode, traced one at a time as graphs need them.

    A graph takes the variants in rule order, each applied as it comes, and stops once it holds no site of the
    rule (an anchor op whose ``site`` verdict is True): a later variant would find nothing to match, so it is
    not traced for that graph. A model whose attention is the first spelling pays for one trace, not for the
    dozens of spellings, dtypes and gradient subsets the rule holds. Variants that trace to the same graph
    register once (one set of seen patterns for the group)."""

    def __init__(self, name: str, mode: str):
        self.name, self.mode = name, mode
        self.variants: dict[int, list[_Variant]] = {}  # index in RULES[name] -> its variants, listed on first use
        self.seen_patterns: dict = collections.defaultdict(list)
        rules = [r for r in RULES[name] if mode in r.modes]
        self.anchors = {a for r in rules for a in r.anchors}
        # stopping early is sound only if every variant needs an anchor op: each traced one is checked
        self.stoppable = all(r.anchors for r in rules)

    def apply(self, graph: torch.fx.Graph) -> int:
        count = 0
        for index, rule in enumerate(RULES[self.name]):
            if self.mode not in rule.modes or (rule.wanted is not None and not rule.wanted(graph)):
                continue
            for variant in self._variants(index, rule):
                if self.stoppable and not self.open_sites(graph):
                    return count
                if rule.wanted_example is not None and not rule.wanted_example(graph, variant.example):
                    continue
                p = self._traced(variant)
                if p is not None:
                    count += p.apply(graph)
        return count

    def open_sites(self, graph: torch.fx.Graph) -> bool:
        """Whether ``graph`` still holds a site of this rule: an anchor op some rule calls a site."""
        for rule in RULES[self.name]:
            if self.mode not in rule.modes:
                continue
            for anchor in rule.anchors:
                for node in graph.find_nodes(op="call_function", target=anchor):
                    if rule.site is None or rule.site(node) is True:
                        return True
        return False

    def _variants(self, index: int, rule: Rule) -> list[_Variant]:
        if index not in self.variants:
            with torch._subclasses.fake_tensor.unset_fake_temporarily():
                # real example tensors, not fakes of the graph compiling now: they are kept for later graphs,
                # which compile under fake modes of their own (see _traced)
                self.variants[index] = self._list_variants(rule)
        return self.variants[index]

    def _list_variants(self, rule: Rule) -> list[_Variant]:
        trace = trace_training if self.mode == TRAINING else trace_inference
        forms = [(rule.pattern, rule.replacement, trace)]
        if self.mode == TRAINING and rule.shared_inputs:
            share = functools.partial(_sharing, names=rule.shared_inputs)
            forms.append((share(rule.pattern), share(rule.replacement), _trace_training_shared))
        variants = []
        for form, (pattern, replacement, trace_fn) in enumerate(forms):
            examples = rule.example_inputs()
            if self.mode == TRAINING and rule.grad_optional:
                # a shared input without grad takes no gradient from outside: the plain form traces it
                examples = grad_variants(rule.pattern, examples, rule.grad_optional,
                                         keep=rule.shared_inputs if form else ())
            variants += [_Variant(rule, pattern, replacement, trace_fn, list(e)) for e in examples]
        return variants

    def _traced(self, variant: _Variant) -> PatternMatcherPass | None:
        if variant.traced:
            return variant.pass_
        variant.traced = True
        p = PatternMatcherPass(pass_name=f"npu_compile_{self.name}_{self.mode}")
        p.seen_patterns = self.seen_patterns  # a graph an earlier variant traced to registers once
        example = variant.example
        if torch._guards.active_fake_mode() is not None:
            # traced while a graph compiles: the inputs made anew under its fake mode, as the graph's own tensors
            # (only their sizes, strides, dtypes and requires_grad are traced). Tracing runs the pattern once on
            # its inputs: on real ones, a pattern's collectives would run on the real group.
            example = [torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device=a.device)
                       .requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor) else a for a in example]
        start = time.perf_counter()
        registered = register_replacement(
            variant.pattern,
            variant.replacement,
            example,
            TRACE_CACHE.tracer(variant.rule, variant.pattern, variant.replacement, variant.trace_fn),
            p,
            extra_check=_checked(variant.rule),
            scalar_workaround=dict(variant.rule.scalars),
            skip_duplicates=True,
            get_decomp_fn=decompositions,
        )
        TRACING.patterns += 1
        TRACING.seconds += time.perf_counter() - start
        if not registered:
            return None
        _ignore_literal_lists(registered)
        if self.stoppable and not self.anchors & _targets(registered):
            log.warning("a %s pattern of rule %r holds none of its anchor ops %s: every variant of the rule is "
                        "traced for every graph from now on", self.mode, self.name, sorted(map(str, self.anchors)))
            self.stoppable = False
        for entries in p.patterns.values():
            for entry in entries:
                entry.extra_check = _sizes_as_values(entry.extra_check)
        variant.pass_ = p
        return p


# -- the exact re-trace of each match, cached ------------------------------------------------------------------


@dataclasses.dataclass
class TraceCache:
    """Traces that torch's exact check of a match makes, kept for the next match of the same key.

    register_replacement's check traces the rule's pattern again at each match's shapes (the first match ran
    with sizes ignored) and, for a match it takes, the replacement at those shapes; a model with one site per
    layer traces the same graphs once per layer, and each compile of the same shapes again. An entry's key is
    everything the traced graph depends on: the rule, which function (pattern, pattern with size inputs,
    replacement) and the trace function (mode, shared-input form), the decomposition table, grad mode and
    functorch's rng switch, and each argument's type, shape, strides, dtype, device, layout and requires_grad
    (scalars by value, as traced). A symbolic size is keyed by its expression within its shape environment only
    (a trace may add guards to that environment, and another one's ``s0`` is another size). A hit hands out a
    copy (torch rewrites the pattern graph's placeholders); a static entry reused under another fake mode gets
    its nodes' values made anew under that mode, as later passes compute with them. Arguments of any other kind
    are traced every time.

    While :meth:`persisting` is on (option ``pattern_cache``, the default), a static entry also goes to the
    persistent compile cache (``npu_compile.cache``), and a miss here looks there before tracing: a rule's
    patterns are traced once per machine, not once per process (every rank, every restart, every test worker).
    On disk an entry is keyed by what the trace depends on in any process: the rule by its digest (the compile
    cache's ``rule_digest``: its functions by source, defaults and closures, a user's rule included), the traced
    function, trace function and decomposition table by the same description, grad mode, functorch's rng switch,
    autocast, the default dtype, the arguments' key as above, and the versions of torch, megatron-core and this
    package (its source digest). Symbolic entries stay in memory only, and so do traces holding a collective (its
    group name is this process's: the vocab-parallel loss traces with the TP group of the first graph it meets).
    ``misses`` counts both (a trace or a load); ``loaded`` the entries read from disk, ``stored`` those written."""

    max_entries: int = 512
    hits: int = 0
    misses: int = 0
    loaded: int = 0
    stored: int = 0
    persist: bool = False
    entries: collections.OrderedDict = dataclasses.field(default_factory=collections.OrderedDict)

    def clear(self) -> None:
        self.entries.clear()
        self.hits = self.misses = self.loaded = self.stored = 0

    @contextlib.contextmanager
    def persisting(self, on: bool) -> Iterator[None]:
        """Static traces kept in (and read from) the persistent compile cache inside the block when ``on``."""
        saved, self.persist = self.persist, on
        try:
            yield
        finally:
            self.persist = saved

    def tracer(self, rule: Rule, pattern: Callable[..., Any], replacement: Callable[..., Any],
               trace_fn: Callable[..., Any]) -> Callable[..., Any]:
        """``trace_fn`` for one variant's register_replacement, with its traces cached."""

        def trace(fn: Callable[..., Any], args: Sequence[Any], *, get_decomp_fn: Callable[[], dict] = decompositions):
            if fn is pattern:
                role = "pattern"
            elif fn is replacement:
                role = "replacement"
            elif getattr(fn, "__name__", None) == "search_fn_new":
                role = "pattern with size inputs"  # torch's wrapper of the pattern taking the SymInts first
            else:
                role = None
            args_key = _trace_key(args) if role is not None else None
            if args_key is None:
                return trace_fn(fn, args, get_decomp_fn=get_decomp_fn)
            key = (rule.name, role, pattern, replacement, trace_fn, get_decomp_fn, torch.is_grad_enabled(),
                   bool(torch._functorch.config.functionalize_rng_ops), args_key)
            gm = self.entries.get(key)
            if gm is None:
                self.misses += 1
                disk_key = self._disk_key(rule, fn, trace_fn, get_decomp_fn, role, args_key) if self.persist else None
                gm = self._load(disk_key, args) if disk_key is not None else None
                if gm is None:
                    gm = trace_fn(fn, args, get_decomp_fn=get_decomp_fn)
                    if disk_key is not None and not _names_a_group(gm) \
                            and cache.store(disk_key, {"gm": gm}, kind="pattern"):
                        self.stored += 1
                self.entries[key] = gm
                if len(self.entries) > self.max_entries:
                    self.entries.popitem(last=False)
                return _graph_copy(gm, args)
            self.hits += 1
            self.entries.move_to_end(key)
            return _graph_copy(gm, args)

        return trace

    @staticmethod
    def _disk_key(rule: Rule, fn: Callable[..., Any], trace_fn: Callable[..., Any],
                  get_decomp_fn: Callable[..., Any], role: str, args_key: tuple) -> str | None:
        """The persistent cache's key of one trace, or None for a symbolic one (kept in memory only)."""
        if len(args_key) != 2:  # a shape environment's number follows the static part
            return None
        described = cache.describe((fn, trace_fn, get_decomp_fn))
        autocast = [(device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
                    for device in ("cpu", "cuda")]
        h = hashlib.sha256(repr((cache.FORMAT, "pattern trace", cache.versions(), cache.rule_digest(rule), role,
                                 described, torch.is_grad_enabled(),
                                 bool(torch._functorch.config.functionalize_rng_ops), autocast,
                                 torch.get_default_dtype(), args_key)).encode())
        return h.hexdigest()

    def _load(self, disk_key: str, args: Sequence[Any]) -> torch.fx.GraphModule | None:
        mode = torch._guards.detect_fake_mode(list(args)) or FakeTensorMode()
        _, entry = cache.load(disk_key, mode, kind="pattern")
        if entry is None or not isinstance(entry.get("gm"), torch.fx.GraphModule):
            return None
        self.loaded += 1
        return entry["gm"]


TRACE_CACHE = TraceCache()
# Ops whose arguments name a process group: a trace holding one depends on this process's groups (the vocab-parallel
# loss traces its pattern with the TP group of the graph it first met, passes/cross_entropy.py), so it is not stored.
_GROUP_NAMESPACES = frozenset({"_c10d_functional", "c10d_functional", "_c10d_functional_autograd", "c10d", "_dtensor"})


def _names_a_group(gm: torch.fx.GraphModule) -> bool:
    """Whether a trace holds something of this process's process groups: a c10d op, a string argument its op's
    schema names a group (``group_name: str``, as npu_compile::vocab_parallel_linear_cross_entropy takes), or a
    string that is the name of a group registered here. Group names are numbers handed out in creation order, so
    another process (another layout, another rank) reads the same name as another group or none."""
    registered: set[str] = set()
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        registered = {name for name in torch.distributed.distributed_c10d._world.pg_names.values()
                      if isinstance(name, str)}
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        op = getattr(n.target, "_opoverload", n.target)  # a torch.library.custom_op called as itself
        if isinstance(op, torch._ops.OpOverload):
            if op.namespace in _GROUP_NAMESPACES:
                return True
            for arg in op._schema.arguments:
                if "group" in arg.name and isinstance(arg.type, torch.StringType):
                    return True
        if registered and any(isinstance(v, str) and v in registered
                              for v in torch.utils._pytree.tree_leaves((n.args, n.kwargs))):
            return True
    return False


_shape_envs: "weakref.WeakKeyDictionary[Any, int]" = weakref.WeakKeyDictionary()  # shape env -> a number never reused


def _trace_key(args: Sequence[Any]) -> tuple | None:
    """What a trace of ``args`` depends on, or None where an argument is of a kind not keyed (traced each time)."""
    leaves, spec = torch.utils._pytree.tree_flatten(list(args))
    envs: set[int] = set()

    def size(v: Any) -> Any:
        if isinstance(v, torch.SymInt):
            env = v.node.shape_env
            if env not in _shape_envs:
                _shape_envs[env] = next(_env_numbers)
            envs.add(_shape_envs[env])
            return ("sym", str(v.node.expr))
        return int(v)

    key: list[Any] = []
    for a in leaves:
        if isinstance(a, torch.Tensor):
            if a.layout != torch.strided:
                return None  # no strides to key by (a sparse argument): traced each time
            key.append((type(a).__name__, tuple(map(size, a.shape)), tuple(map(size, a.stride())),
                        size(a.storage_offset()), a.dtype, a.device, a.layout, a.requires_grad))
        elif isinstance(a, torch.SymInt):
            key.append(size(a))
        elif a is None or type(a) in (bool, int, float, str, torch.dtype, torch.device, torch.layout,
                                      torch.memory_format):
            key.append((type(a).__name__, repr(a)))
        else:
            return None
    if len(envs) > 1:
        return None
    return (str(spec), tuple(key), *envs)


_env_numbers = itertools.count()


def _graph_copy(gm: torch.fx.GraphModule, args: Sequence[Any]) -> torch.fx.GraphModule:
    """A copy of a cached trace for one match, its node values made anew under ``args``' fake mode (a symbolic entry
    is only ever reused within its own shape environment). Anew under the same mode too: the replacement carries
    these values into the model graph, and two sites sharing one FakeTensor share its storage there, which the
    memory analysis reads as one buffer (a second layer's attention outputs and activation saved for free)."""
    copy_ = torch.fx.GraphModule(gm, copy.deepcopy(gm.graph))  # node.meta is copied shallowly: the same values
    mode = torch._guards.detect_fake_mode(list(args))
    if mode is None:
        return copy_

    def remade(v: Any) -> Any:
        if isinstance(v, torch._subclasses.FakeTensor):
            with mode:
                return torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=v.device)
        return v

    for node in copy_.graph.nodes:
        for field in ("val", "eager_input_vals"):  # the values torch's replacement carries into the model graph
            if field in node.meta:
                node.meta[field] = torch.utils._pytree.tree_map(remade, node.meta[field])
    return copy_


def _group(name: str, mode: str) -> _Group:
    if (name, mode) not in _groups:
        _groups[(name, mode)] = _Group(name, mode)
    return _groups[(name, mode)]


def _walk(pattern: PatternExpr, into_lists: bool = False) -> Iterator[PatternExpr]:
    """Each node of a traced pattern once (a MultiOutputPattern's outputs, not itself), children listed before the
    node is yielded; with ``into_lists`` also the patterns inside list arguments (``cat([a, b])``)."""
    seen: set[int] = set()
    stack = [pattern]
    while stack:
        node = stack.pop()
        if id(node) in seen or not isinstance(node, PatternExpr):
            continue
        seen.add(id(node))
        if isinstance(node, MultiOutputPattern):
            stack += node.outputs
            continue
        args = getattr(node, "args", ())
        stack += [a for a in (*args, *getattr(node, "kwargs", {}).values()) if isinstance(a, PatternExpr)]
        if into_lists:
            stack += [x for a in args if isinstance(a, (list, tuple)) for x in a]
        yield node


def _targets(pattern: PatternExpr) -> set[Any]:
    """The ops a traced pattern calls."""
    return {fn for node in _walk(pattern, into_lists=True) for fn in getattr(node, "fns", ())}


def grad_variants(pattern: Callable[..., Any], examples: Sequence[Sequence[Any]], names: Sequence[str],
                  keep: Sequence[str] = ()) -> list[list[Any]]:
    """Each example, then the same with the inputs ``names`` that need grad switched off, subset by subset (the
    most gradients first, so a pattern with more of them is tried before one with fewer); inputs in ``keep``
    stay as they are. Variants with the same inputs (shape, dtype, requires_grad) are listed once."""
    params = list(inspect.signature(pattern).parameters)
    unknown = [n for n in (*names, *keep) if n not in params]
    if unknown:
        raise ValueError(f"grad_optional/shared_inputs name {unknown}, which are not arguments of "
                         f"{pattern.__name__}{tuple(params)}")
    variants: list[list[Any]] = []
    seen: set[tuple] = set()
    for example in examples:
        example = list(example)
        optional = [params.index(n) for n in names if n not in keep and params.index(n) < len(example)
                    and isinstance(example[params.index(n)], torch.Tensor) and example[params.index(n)].requires_grad]
        subsets = sorted(itertools.product((True, False), repeat=len(optional)), key=lambda s: -sum(s))
        for grads in subsets:
            variant = list(example)
            for i, grad in zip(optional, grads):
                if not grad:
                    variant[i] = example[i].detach().requires_grad_(False)
            key = tuple((tuple(a.shape), a.dtype, a.requires_grad) if isinstance(a, torch.Tensor) else repr(a)
                        for a in variant)
            if key not in seen:
                seen.add(key)
                variants.append(variant)
    return variants


def _sizes_as_values(check: Callable[[Match], bool]) -> Callable[[Match], bool]:
    """torch's exact check of a match (register_replacement's check_fn, which retraces the pattern at the match's
    shapes) with every SymInt node the graph passes as an argument shown to it as a plain value.

    At symbolic shapes that retraced pattern takes the sizes as inputs, and a size such as ``s0`` feeds dozens of
    views. A pattern with several outputs finds its second and later outputs by walking users from nodes matched
    already, and torch's walk shares one visited set across its levels: each view that reads ``s0`` is visited
    first as a candidate one level too low, then skipped where it belongs, so the match fails ("no anchor found")
    or not depending on the order of users. As values, sizes are still compared (one pattern input, one size
    node), but give no path to walk. The graph is restored before anything is replaced."""

    def exact(match: Match) -> bool:
        node = match.output_nodes()[0]
        graph = node.graph if node is not None else None
        if graph is None:
            return check(match)
        marks: dict[torch.fx.Node, _Size] = {}
        saved: dict[torch.fx.Node, tuple] = {}
        for n in graph.nodes:
            # sizes read from the inputs; a size computed from them (2*s0 = mul(s0, 2)) stays a node, matched
            # by the pattern's own arithmetic on its size inputs
            if (isinstance(n.meta.get("val"), torch.SymInt) and n.users
                    and (n.op == "placeholder" or n.target in _SIZE_READS)):
                marks[n] = _Size(n)
        for n in marks:
            for user in n.users:
                saved.setdefault(user, (user.args, user.kwargs))
        try:
            for user, (args, kwargs) in saved.items():
                user.args, user.kwargs = torch.fx.map_arg((args, kwargs), lambda a: marks.get(a, a))
            return check(match)
        finally:
            for user, (args, kwargs) in saved.items():
                user.args, user.kwargs = args, kwargs

    exact.sizes_as_values = True
    return exact


class _Size:
    """A SymInt node seen as a value during an exact check (compared by identity, like the node)."""

    __slots__ = ("node",)

    def __init__(self, node: torch.fx.Node):
        self.node = node

    def __repr__(self) -> str:
        return f"size({self.node.name})"


def _ignore_literal_lists(pattern: PatternExpr) -> None:
    """Let the first, shape-free match of ``pattern`` ignore list arguments such as autograd's output masks
    (``native_layer_norm_backward(..., [8], ..., [True, True, True])``).

    That match ignores int lists (a size or dims: one Ignored in the pattern), but once a pattern node holds
    any other list, torch's matcher compares the arguments as trees, the graph's ``[8]`` unfolds while the
    pattern's Ignored does not, and the node never matches. The exact match that follows, traced with the
    real shapes, still compares every list."""
    for node in _walk(pattern):
        args = getattr(node, "args", ())
        literal = [isinstance(a, (list, tuple)) and not any(isinstance(x, PatternExpr) for x in a) for a in args]
        if any(literal) and any(isinstance(a, Ignored) for a in args):
            node.args = tuple(Ignored() if lit else a for a, lit in zip(args, literal))
            if not any(isinstance(a, (list, tuple, dict)) for a in (*node.args, *node.kwargs.values())):
                node.flatten = node.simple_flatten
            node.flat_args_kwargs = node.flatten(node.args, node.kwargs)


def _sharing(fn: Callable[..., Any], names: tuple[str, ...]) -> Callable[..., Any]:
    """``fn`` computing with a fork (a clone) of each input in ``names`` and returning the forks too: traced
    for training, a gradient from outside then reaches those inputs before fn's own, as it does in a model
    where they feed later ops as well. _trace_training_shared takes the forks out of the traced graph."""
    positions = [list(inspect.signature(fn).parameters).index(n) for n in names]

    @functools.wraps(fn)  # register_replacement reads the argument names from the signature
    def shared(*args: Any) -> tuple:
        args = list(args)
        for i in positions:
            args[i] = args[i].clone()
        out = fn(*args)
        return (*(out if isinstance(out, tuple) else (out,)), *(args[i] for i in positions))

    return shared


def _trace_training_shared(fn: Callable, args: Sequence[Any], *, get_decomp_fn: Callable[[], dict] = decompositions):
    """trace_training of a _sharing function, the forks removed: each input again, and no longer an output
    (its tangent stays, standing for the gradient from outside)."""
    gm = trace_training(fn, args, get_decomp_fn=get_decomp_fn)
    output = gm.graph.output_node()
    forks = [n for n in output.args[0] if isinstance(n, torch.fx.Node) and n.target is torch.ops.aten.clone.default
             and n.args[0].op == "placeholder"]
    output.args = ([n for n in output.args[0] if n not in forks],)
    for fork in forks:
        fork.replace_all_uses_with(fork.args[0])
        gm.graph.erase_node(fork)
    gm.recompile()
    return gm


def save_random_values(graph: torch.fx.Graph) -> None:
    """Random values (a fused op's dropout seed, native_dropout's mask and output) are saved for the backward,
    never recomputed: under a memory budget < 1 the min-cut partitioner lets its knapsack recompute even the
    nodes it bans as random, and a recomputed random node draws afresh, so the backward would drop other
    elements than the forward did. (At budget 0 torch saves only the graph inputs and cannot be told.)"""
    for node in graph.nodes:
        if isinstance(node.target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in node.target.tags:
            node.meta["recompute"] = CheckpointPolicy.MUST_SAVE


def apply_rules(gm: torch.fx.GraphModule, enabled: Callable[[str], bool], mode: str) -> tuple[dict, list]:
    """Apply every enabled rule to ``gm`` (in registration order); returns (sites per rule, unfused sites)."""
    normalize(gm.graph, mode)
    _rejections.clear()
    counts: dict[str, int] = {}
    for name in RULES:
        if enabled(name) and any(mode in r.modes for r in RULES[name]):
            with warnings.catch_warnings():
                # A pattern whose outputs repeat a node (one gradient for both summands of an add) makes torch's
                # replacement erase that node twice; the second time it only warns.
                warnings.filterwarnings("ignore", message=r"erase_node\(.*\) on an already erased node")
                counts[name] = _group(name, mode).apply(gm.graph)
    declined: list[dict[str, str]] = []
    for name, graph_rule in GRAPH_RULES.items():
        if mode in graph_rule.modes:
            if enabled(name):
                counts[name], unfused_here = graph_rule.apply(gm.graph, mode)
                declined += [{**u, "rule": name} for u in unfused_here]
    if any(counts.values()):
        stable_topological_sort(gm.graph)  # multi-output replacements can land before their inputs
        gm.graph.eliminate_dead_code()
    if mode == TRAINING:
        save_random_values(gm.graph)
    gm.graph.lint()
    gm.recompile()
    return counts, _unfused(gm.graph, enabled, mode) + declined


def _unfused(graph: torch.fx.Graph, enabled: Callable[[str], bool], mode: str) -> list[dict[str, str]]:
    sites = []
    for name, rules in RULES.items():
        anchors = {a for r in rules if mode in r.modes for a in r.anchors}
        for node in graph.nodes:
            if node.op != "call_function" or node.target not in anchors:
                continue
            verdicts = [r.site(node) if r.site else True for r in rules if mode in r.modes and node.target in r.anchors]
            if not any(verdicts):
                continue
            by_design = next((v for v in verdicts if isinstance(v, str)), None)
            if not enabled(name):
                reason = f"rule {name!r} is switched off by options['fusions']"
            else:
                reason = by_design or _rejection_near(node) or f"no {name} pattern matched the ops around it"
            sites.append({"op": str(node.target), "node": node.name, "rule": name, "reason": reason})
    return sites


# -- layouts: a replacement leaves each tensor it replaces with the strides later nodes were traced with -------


def stride_order(t: torch.Tensor) -> list[int]:
    """t's dims from outermost to innermost in memory: by stride (ties keep their order), with length-1 dims,
    whose strides mean nothing, left where they are."""
    longer = iter(sorted((d for d in range(t.dim()) if t.shape[d] > 1), key=lambda d: -t.stride(d)))
    return [d if t.shape[d] == 1 else next(longer) for d in range(t.dim())]


def in_layout_of(out: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``out`` (a fused op's contiguous output, shaped like ``like``) laid out densely in ``like``'s dim order,
    as elementwise aten ops lay out their results: ``out`` itself for the usual order, else a copy."""
    order = stride_order(like)
    if order == sorted(order):
        return out
    return out.permute(order).contiguous().permute(sorted(range(len(order)), key=order.__getitem__))


def bias_problem(x: torch.Tensor, bias: torch.Tensor, what: str = "the input") -> str | None:
    """Why a fused op that adds ``bias`` to ``x`` in x's dtype cannot replace an eager ``x + bias``, or None:
    eager's add promotes mixed dtypes and broadcasts x up to the bias's shape; the fused ops do neither."""
    if bias.dtype != x.dtype:
        return f"bias dtype {bias.dtype} differs from {what}'s {x.dtype} (the add promotes; the fused op does not)"
    if torch.broadcast_shapes(x.shape, bias.shape) != x.shape:
        return f"bias {tuple(bias.shape)} does not broadcast to {what} {tuple(x.shape)}"
    return None


def layout_check(like: str | None = None) -> Callable[[Match], bool | str]:
    """An extra_check for rules whose fused ops write contiguous tensors: every tensor the match replaces must
    be contiguous already, except the forward output when the replacement returns it as
    ``in_layout_of(output, match.kwargs[like])``: that one must be dense in ``like``'s dim order. (Strides of
    length-1 dims do not count.) Later nodes were traced with those strides, and a view among them may rely
    on them; a contiguous tensor takes any view."""

    def check(match: Match) -> bool | str:
        order = stride_order(match.kwargs[like].meta["val"]) if like else None
        for i, node in enumerate(match.output_nodes()):
            val = node.meta.get("val") if node is not None else None
            if not isinstance(val, torch.Tensor):
                continue
            want = _dense_strides(val.shape, order if i == 0 and order else range(val.dim()))
            if any(n > 1 and got != w for n, got, w in zip(val.shape, val.stride(), want)):
                return (f"{node.name} has strides {tuple(val.stride())} for shape {tuple(val.shape)}, not the "
                        f"{tuple(want)} the fused op gives, and later nodes were traced with them")
        return True

    return check


contiguous_outputs = layout_check()


def kwargs_as_traced(match: Match) -> bool | str:
    """An extra_check: torch's matcher drops a keyword argument that a graph node has and the pattern's node
    lacks, so ``gelu(x)`` traced without ``approximate`` also matches ``gelu(x, approximate="tanh")``, and
    ``add(x, b)`` matches ``add(x, b, alpha=2)``. Declines unless each such argument holds its default."""
    for pattern, node in match.ctx.pattern_to_node.items():
        if not (isinstance(pattern, CallFunction) and isinstance(node, torch.fx.Node)
                and isinstance(node.target, torch._ops.OpOverload)):
            continue
        defaults = {a.name: a.default_value for a in node.target._schema.arguments if a.has_default_value()}
        for key, value in node.kwargs.items():
            if key not in pattern.kwargs and not (key in defaults and defaults[key] == value):
                return f"{node.name} has {key}={value!r}, which the pattern does not take"
    return True


def _dense_strides(shape: Sequence[int], order: Sequence[int]) -> list[int]:
    """The strides of a dense tensor of ``shape`` whose dims lie in memory in ``order``, outermost first."""
    strides, step = [0] * len(shape), 1
    for d in reversed(list(order)):
        strides[d] = step
        step *= max(shape[d], 1)
    return strides


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
