"""Typed options of the ``ascend`` backend, validated at the door.

``torch.compile(model, backend="ascend", options={...})`` hands its dict to :func:`resolve`; every key not given
there falls back to :data:`defaults`, which users may change for a whole program (``npu_compile.config.defaults``)
or for a block (``with npu_compile.config.patch(target="npu-sim"): ...``). A wrong key or value raises
:class:`OptionError` (a ``ValueError``) naming the key and what would be right; nothing else in the package
validates options.

When they are checked: torch hands a custom backend its ``options`` only when it compiles the first graph, after
Dynamo has captured it — no earlier hook exists in torch 2.13 (``torch.compile`` stores them without calling the
backend). So the backend checks them first thing in that call, and the error is raised as itself, not wrapped in
Dynamo's ``BackendCompilerFailed``: its message is the last line of the traceback. Callers that know the options
before any tracing check them there: :func:`validate` up front, ``npu_compile.explain``, and the training job
(``--npu-compile-options`` is checked with the other flags).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import os
from collections.abc import Iterator, Mapping
from typing import Any, Literal, Union, get_args

from torch._dynamo.exc import ShortenTraceback

# The allowed values of the options that take one of a few, declared on Options' fields by these types.
TargetName = Literal["auto", "npu", "npu-sim", "reference"]
GraphMode = Literal["ge", "aclgraph", "eager"]
MC2Mode = Literal["auto", "on", "off"]
TARGETS: tuple[str, ...] = get_args(TargetName)
GRAPH_MODES: tuple[str, ...] = get_args(GraphMode)
MC2_MODES: tuple[str, ...] = get_args(MC2Mode)
DUMP_DIR_ENV = "NPU_COMPILE_DUMP_DIR"

Fusions = Union[Literal["all"], tuple[str, ...], Mapping[str, bool]]


class OptionError(ShortenTraceback, ValueError):
    """A wrong option key or value. Dynamo re-raises a ``ShortenTraceback`` from a backend as it is (other exceptions
    it wraps in ``BackendCompilerFailed`` with a bug-report text), so this message is what the user reads."""

    def __init__(self, message: str):
        super().__init__(message, first_useful_frame=None)


class TargetUnavailable(ShortenTraceback, RuntimeError):
    """``target="npu"`` on a machine where torch_npu or its device cannot be used; raised as itself, like
    :class:`OptionError`."""

    def __init__(self, message: str):
        super().__init__(message, first_useful_frame=None)


@dataclasses.dataclass(frozen=True)
class Options:
    """One compiled graph's settings. Field docs are the README's option table."""

    target: TargetName = "auto"  # where the graph runs (resolved: never "auto" past the door)
    graph_mode: GraphMode = "ge"  # how the npu targets run the lowered graph
    fusions: Fusions = "all"  # "all", a list of rule names, or {rule name: on/off}
    # activation memory budget for recompute, 1.0 = save everything; "auto": the least recompute that fits
    memory_budget: float | str = 1.0
    device_memory: int | None = None  # bytes; "auto"'s cap (None: the device profile's memory_bytes)
    resident_memory: int = 0  # bytes the job holds besides this graph's activations: params, grads, optimizer
    activation_copies: int = 1  # forwards of this graph whose saved activations are alive at once
    # ops whose outputs the backward always recomputes, whatever the budget: "activation" (the MLP's GeLU / SwiGLU,
    # MindSpeed's --recompute-activation-function)
    recompute: tuple[str, ...] = ()
    # modules (attribute names, e.g. "self_attention") whose saved activations the forward copies to host memory and
    # the backward prefetches back (MindSpeed's --swap-attention / --swap-modules); passes/offload.py
    offload: tuple[str, ...] = ()
    overlap: bool = True  # comm/compute overlap scheduling
    # npu targets: a matmul and its collective as one MC2 op: "auto" where the cost model finds it faster than the
    # overlap scheduler, "on" at every site torch_npu takes, "off" nowhere
    mc2: MC2Mode = "auto"
    dump_dir: str | None = None  # where graphs and report.json go (None: $NPU_COMPILE_DUMP_DIR, else nowhere)
    verify: bool = False  # run the unfused graph beside the compiled one on first call and compare
    # npu / npu-sim: lower GeLU to npu_fast_gelu, x·σ(1.702x) — a different function from GeLU, so opt-in only
    fast_gelu: bool = False
    cache: bool = True  # load / store compiled graphs in the persistent cache ($NPU_COMPILE_CACHE_DIR)
    # keep the fusion rules' pattern traces in the same place: each rule traced once per machine, not per process
    # (changes no graph: passes/engine.py TraceCache)
    pattern_cache: bool = True
    # npu / npu-sim: convert each lowered graph with torchair's own code on the CPU (lowering/npu/torchair_check.py,
    # the pinned torch-npu wheel): the verdict in report.json graph_modes, the GE graph text in the dump dir
    torchair_check: bool = False

    def fusion_enabled(self, rule: str) -> bool:
        """Whether rule ``rule`` runs under this ``fusions`` setting."""
        if self.fusions == "all":
            return True
        if isinstance(self.fusions, Mapping):
            return self.fusions.get(rule, True)
        return rule in self.fusions


KEYS = tuple(f.name for f in dataclasses.fields(Options))
# Options that change nothing the compile cache stores (where dumps go, the first call's check, the caches themselves):
# left out of its key. Every other option is in the key, a new one included unless it is listed here.
UNKEYED = frozenset({"dump_dir", "verify", "cache", "pattern_cache", "torchair_check"})

defaults = Options()


def _known_rules() -> tuple[str, ...]:
    from npu_compile.passes import rule_names  # late: rule families register when npu_compile.passes loads

    return rule_names()


def _check_choice(key: str, value: Any, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise OptionError(f"npu_compile option {key!r} got {value!r}; valid values are {', '.join(map(repr, choices))}")
    return value


def _check_bool(key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise OptionError(f"npu_compile option {key!r} got {value!r}; it takes True or False")
    return value


def _check_fusions(value: Any) -> Fusions:
    known = _known_rules()

    def check_names(names: Any) -> None:
        unknown = [n for n in names if n not in known]
        if unknown:
            raise OptionError(
                f"npu_compile option 'fusions' names unknown rule(s) {', '.join(map(repr, unknown))}; "
                f"known rules are {', '.join(map(repr, known)) or '(none registered)'}"
            )

    if value == "all":
        return "all"
    if isinstance(value, Mapping):
        check_names(value)
        bad = [k for k, v in value.items() if not isinstance(v, bool)]
        if bad:
            raise OptionError(f"npu_compile option 'fusions' maps {bad[0]!r} to {value[bad[0]]!r}; use True or False")
        return dict(value)
    if isinstance(value, (list, tuple, set, frozenset)) and all(isinstance(n, str) for n in value):
        check_names(value)
        return tuple(value)
    raise OptionError(
        f"npu_compile option 'fusions' got {value!r}; it takes \"all\", a list of rule names, or {{rule name: bool}}"
    )


def _check_budget(value: Any) -> float | str:
    if value == "auto":
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= float(value) <= 1.0:
        raise OptionError(f"npu_compile option 'memory_budget' got {value!r}; it takes a float in [0, 1] or \"auto\"")
    return float(value)


RECOMPUTE_KINDS = ("activation",)


def _check_recompute(value: Any) -> tuple[str, ...]:
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise OptionError(f"npu_compile option 'recompute' got {value!r}; it takes a list of op kinds from "
                          f"{', '.join(map(repr, RECOMPUTE_KINDS))}")
    unknown = [v for v in value if v not in RECOMPUTE_KINDS]
    if unknown:
        raise OptionError(f"npu_compile option 'recompute' names unknown op kind(s) {', '.join(map(repr, unknown))}; "
                          f"known kinds are {', '.join(map(repr, RECOMPUTE_KINDS))}")
    return tuple(dict.fromkeys(value))


def _check_offload(value: Any) -> tuple[str, ...]:
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) and v.isidentifier() for v in value):
        raise OptionError(f"npu_compile option 'offload' got {value!r}; it takes a list of module attribute names "
                          f"(e.g. [\"self_attention\"]) whose saved activations go to host memory")
    return tuple(dict.fromkeys(value))


def _check_bytes(key: str, least: int, none_ok: bool = False) -> Any:
    def check(value: Any) -> int | None:
        if value is None and none_ok:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            also = " or None" if none_ok else ""
            raise OptionError(f"npu_compile option {key!r} got {value!r}; it takes an int ≥ {least}{also}")
        return value

    return check


def _check_dump_dir(value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, (str, os.PathLike)) or not str(value):
        raise OptionError(f"npu_compile option 'dump_dir' got {value!r}; it takes a path (str or os.PathLike) or None")
    return os.fspath(value)


def _field_check(field: dataclasses.Field) -> Any:
    """The check of one field, from its declared type: a Literal's values, a bool, or the field's own check."""
    custom = {"fusions": _check_fusions, "memory_budget": _check_budget, "dump_dir": _check_dump_dir,
              "device_memory": _check_bytes("device_memory", 1, none_ok=True),
              "resident_memory": _check_bytes("resident_memory", 0),
              "activation_copies": _check_bytes("activation_copies", 1), "recompute": _check_recompute,
              "offload": _check_offload}
    if field.name in custom:
        return custom[field.name]
    kind = {"TargetName": TargetName, "GraphMode": GraphMode, "MC2Mode": MC2Mode, "bool": bool}[field.type]
    if kind is bool:
        return lambda v: _check_bool(field.name, v)
    return lambda v: _check_choice(field.name, v, get_args(kind))


_CHECKS = {f.name: _field_check(f) for f in dataclasses.fields(Options)}


def validate(options: Mapping[str, Any] | None, base: Options | None = None) -> Options:
    """``base`` (default: :data:`defaults`) updated by ``options``, every key and value checked."""
    options = dict(options or {})
    unknown = sorted(set(options) - set(KEYS))
    if unknown:
        raise OptionError(
            f"unknown npu_compile option(s) {', '.join(map(repr, unknown))}; valid options are {', '.join(KEYS)}"
        )
    checked = {k: _CHECKS[k](v) for k, v in options.items()}
    return dataclasses.replace(base or defaults, **checked)


def resolve(options: Mapping[str, Any] | None) -> Options:
    """Validated options with ``target="auto"`` and the dump dir made concrete for this machine."""
    opts = validate(options)
    dump_dir = opts.dump_dir if opts.dump_dir is not None else os.environ.get(DUMP_DIR_ENV) or None
    return dataclasses.replace(opts, target=resolve_target(opts.target), dump_dir=dump_dir)


def _torch_npu_error() -> Exception | None:
    """None when torch_npu imports and sees a device, else the reason it cannot be used."""
    try:
        torch_npu = importlib.import_module("torch_npu")
    except Exception as e:  # ImportError, or OSError from a missing CANN runtime (libhccl.so)
        return e
    if not torch_npu.npu.is_available():
        return RuntimeError("torch_npu imported but torch.npu.is_available() is False")
    return None


def resolve_target(target: str) -> str:
    """``auto`` → ``npu`` when torch_npu and a device are present, else ``reference``; ``npu`` is checked."""
    if target == "auto":
        return "npu" if _torch_npu_error() is None else "reference"
    if target == "npu":
        err = _torch_npu_error()
        if err is not None:
            raise TargetUnavailable(
                f"npu_compile option target='npu' needs torch_npu with an Ascend device, which is not usable here "
                f"({type(err).__name__}: {err}). Install it on a machine with Ascend CANN: "
                f"pip install 'npu_compile[npu]' (torch-npu==2.13.0). To run the same lowered NPU graph on the CPU, "
                f"use target='npu-sim'."
            )
    return target


@contextlib.contextmanager
def patch(**options: Any) -> Iterator[Options]:
    """Change :data:`defaults` inside a ``with`` block (validated like ``options=``)."""
    global defaults
    saved = defaults
    defaults = validate(options, base=saved)
    try:
        yield defaults
    finally:
        defaults = saved
