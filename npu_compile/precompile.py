"""Warm start: a second process runs a compiled function without Dynamo's, aot_autograd's or the backend's work.

torch 2.13's precompile (``torch.compile(fn, fullgraph=True).aot_compile((args, kwargs))``, saved with
``AOTCompiledFunction.serialize`` and loaded with ``torch.compiler.load_compiled_function``'s deserializer) holds
what a frame's compile made: Dynamo's guards (serialized guard state, rebuilt into a guard manager), the bytecode
that calls the compiled graph, and the backend's output. For the output it takes aot_autograd's bundled cache entry
(``BundledAOTAutogradResult``: the runtime wrappers' metadata and the compiled forward / backward), which holds a
compiled graph only as an Inductor ``OutputCode`` (torch/_functorch/_aot_autograd/autograd_cache.py,
``AOTAutogradCache.make_entry``: ``unwrap_output_code`` raises ``AssertionError: expected OutputCode, got <class
'function'>`` for any other callable). So the backend hands aot_autograd its compiled graphs as
:class:`AscendOutputCode`: the lowered graph, pickled with ``GraphPickler`` as the persistent cache stores it, and
on load given back to its target's executor.

:func:`compile` is ``torch.compile(fn, backend="ascend", options=...)`` behind the ``cache`` option: on a call it
runs the first stored artifact whose Dynamo guards accept the arguments; when none does, it compiles one with
``aot_compile`` and stores it. Artifacts sit under ``precompiled/<key>/`` in the cache dir, where the key covers what
Dynamo's guards do not see (``precompile_key``): the options, the versions and source digest of this package, the
registered fusion rules, Dynamo's and functorch's configs, the traced function, and the process-group layout.
Dynamo's guards cover shapes, dtypes, strides, grad mode and the module attributes read while tracing; on load every
source file Dynamo traced is checked against the digest it stored, and the guards torch cannot store are checked
here (``_Artifact.accepts``): those on process groups (by group name), and identity guards (the function a module
calls, e.g. megatron-core's ``config.activation_func``, a hook, a class) by a description another process computes
alike (``_identity``: a function by its name, bytecode, defaults and closed-over values). A function Dynamo cannot capture whole (a graph break) runs
under plain ``torch.compile`` from then on (remembered in the same folder); an artifact whose guard state torch
cannot load back is not stored (``_Artifacts.store``).
"""

from __future__ import annotations

import builtins
import collections
import contextlib
import copy
import functools
import hashlib
import importlib
import inspect
import logging
import os
import pickle
import types
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch._dynamo.aot_compile import AOTCompiledFunction
from torch._inductor.output_code import OutputCode

from npu_compile import cache, config, passes

log = logging.getLogger("npu_compile")

FORMAT = 2  # 2: identity guards kept beside the process groups
# Artifacts per key before plain torch.compile takes over (Dynamo's own recompile_limit is 8).
LIMIT = 8
_FALLBACK = "fallback.txt"


class AscendOutputCode(OutputCode):
    """One lowered graph as aot_autograd keeps it: callable (boxed, one list of inputs), and serializable for
    precompile (``prepare_for_serialization`` pickles the graph; ``post_compile`` loads it and builds its executor
    again)."""

    def __init__(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any], opts: Any, target: Any):
        super().__init__()
        self._gm: torch.fx.GraphModule | None = gm
        self._opts = opts
        self._target_name = target.name
        self._serialized: bytes | None = None
        self._boxed_call = True
        self._run: Callable | None = target.executor(gm, example_inputs, opts)

    def __call__(self, inputs: list[Any]) -> Any:
        run = self._run
        return run(inputs) if getattr(run, "_boxed_call", False) else run(*inputs)

    def prepare_for_serialization(self) -> None:
        # called on a shallow copy (aot_autograd's pre_save): the live graph and executor stay with the original
        if self._gm is not None:
            self._serialized = cache._dump_graph(self._gm)
        self._gm, self._run = None, None

    def post_compile(self, example_inputs: Sequence[Any], constants: Any, graph_kwargs: Any) -> None:
        if self._run is not None:
            return
        from npu_compile import lowering

        target = lowering.target(self._target_name)
        target.prepare()  # the target's ops exist before its graph is loaded
        gm = cache.GraphPickler.loads(self._serialized, cache.fake_mode_of(example_inputs))  # code made here
        if not example_inputs:  # precompile's loader passes none: the graph's own placeholders are its examples
            example_inputs = [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"]
        self._gm = gm
        self._run = target.executor(gm, example_inputs, self._opts)

    def set_triton_bundle(self, triton_bundle: Any) -> None:
        pass

    def __deepcopy__(self, memo: dict) -> AscendOutputCode:
        # aot_autograd deep-copies a loaded entry to keep a clean one for re-serializing: graph bytes only
        new = copy.copy(self)
        if self._gm is not None and self._serialized is None:
            new._serialized = cache._dump_graph(self._gm)
        new._gm, new._run = None, None
        return new


# -- the key: what shapes an artifact and is not in Dynamo's guards


_PLAIN = frozenset({str, int, float, bool, type(None), bytes, torch.dtype})


def _digest(value: Any, h: Any, depth: int = 0) -> None:
    """Feed ``h`` a process-independent description of ``value``: a function by its bytecode, constants, defaults
    and closed-over values (this package's own functions by name: their code is in ``versions()``' digest);
    containers by their items (sets sorted); anything else by a repr without addresses."""
    kind = type(value)
    if kind in _PLAIN or (kind in (list, tuple) and all(type(v) in _PLAIN for v in value)):
        h.update(f"{kind.__name__}:{value!r};".encode())
    elif depth > 6:
        h.update(kind.__qualname__.encode())
    elif isinstance(value, functools.partial) or isinstance(getattr(value, "__code__", None), types.CodeType):
        h.update(_part_digest(value, depth))
    elif isinstance(value, (list, tuple)):
        h.update(f"{type(value).__name__}{len(value)}(".encode())
        for item in value:
            _digest(item, h, depth + 1)
        h.update(b")")
    elif isinstance(value, dict):
        h.update(f"dict{len(value)}(".encode())
        for k in sorted(value, key=repr):
            _digest((k, value[k]), h, depth + 1)
        h.update(b")")
    elif isinstance(value, (set, frozenset)):
        h.update(repr(sorted(map(repr, value))).encode())
    else:
        text = repr(value)
        h.update((type(value).__qualname__ if " at 0x" in text else text).encode())


_digests: dict[int, tuple[Any, bytes]] = {}  # id -> (the function, kept alive so the id stays its own; its digest)


def _part_digest(value: Any, depth: int = 0) -> bytes:
    got = _digests.get(id(value))
    if got is not None and got[0] is value:
        return got[1]
    h = hashlib.sha256()
    if isinstance(value, functools.partial):
        _digest(value.func, h, depth + 1)
        _digest((value.args, value.keywords), h, depth + 1)
    else:
        h.update(f"{value.__module__}.{value.__qualname__}".encode())
        if not str(value.__module__).startswith("npu_compile."):
            _digest_code(value.__code__, h)
        _digest(getattr(value, "__defaults__", None), h, depth + 1)
        for cell in getattr(value, "__closure__", None) or ():
            _digest(cell.cell_contents, h, depth + 1)
    _digests[id(value)] = (value, h.digest())
    return _digests[id(value)][1]


def _digest_code(code: types.CodeType, h: Any) -> None:
    h.update(code.co_code)
    h.update(repr(code.co_names).encode())
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            _digest_code(const, h)
        else:
            h.update(repr(const).encode())


def _config_digest(module: Any) -> str:
    """A torch config module's values that shape a compile (``get_hash`` pickles sets, so it differs by process)."""
    h = hashlib.sha256()
    values = module.get_config_copy()
    for name in sorted(set(values) - set(module._compile_ignored_keys)):
        _digest((name, values[name]), h)
    return h.hexdigest()


_rules_digest: list = [None, ""]  # (the registry's rule objects when last digested, that digest)


def rules_digest() -> str:
    """A digest of every registered fusion rule, in registration order: this package's own by name and position,
    any other (a user's) by its data and its functions' bytecode and closed-over values. Computed again only when
    the registry changed."""
    from npu_compile.passes import RULES

    registered = [(name, rule) for name, rules in RULES.items() for rule in rules]
    if _rules_digest[0] is not None and len(_rules_digest[0]) == len(registered) and all(
            a[0] == b[0] and a[1] is b[1] for a, b in zip(_rules_digest[0], registered)):
        return _rules_digest[1]
    h = hashlib.sha256()
    for name, rules in RULES.items():
        for rule in rules:
            place = passes.builtin_place(rule)
            if place is not None:  # this package's own: its source digest is in the key
                h.update(f"{name}\0builtin {place}\0".encode())
                continue
            h.update(f"{name}\0{rule.scalars!r}\0{rule.modes!r}\0{rule.anchors!r}\0{rule.shared_inputs!r}\0"
                     f"{rule.grad_optional!r}\0".encode())
            _digest((rule.pattern, rule.replacement, rule.example_inputs, rule.extra_check, rule.site,
                     rule.wanted), h)
    _rules_digest[:] = [registered, h.hexdigest()]
    return _rules_digest[1]


def _process_groups() -> tuple:
    """The process groups a traced graph may name (their names and global ranks), and this process's rank."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return ()
    from torch.distributed.distributed_c10d import _world

    groups = sorted((str(name), tuple(sorted(_world.pg_group_ranks.get(pg, {}))))
                    for pg, name in _world.pg_names.items())
    return (dist.get_rank(), dist.get_world_size(), dist.get_backend(), tuple(groups))


@functools.lru_cache(maxsize=1)
def _empty_graph() -> torch.fx.GraphModule:
    graph = torch.fx.Graph()
    graph.output(None)
    return torch.fx.GraphModule(torch.nn.Module(), graph)


def precompile_key(fn: Callable, opts: Any) -> str:
    """The folder key of ``fn``'s artifacts under ``opts``: everything that shapes them besides what Dynamo guards.
    The backend's own cache key of a graph-free step brings the options, versions and package digest (and whatever
    else that key covers); then the fusion rules, Dynamo's and aot_autograd's configs, the traced function, and the
    process groups."""
    traced, _ = torch._dynamo.convert_frame.get_traced_fn(fn)
    h = hashlib.sha256()
    h.update(repr((FORMAT, cache.graph_key("precompile", _empty_graph(), opts), rules_digest(),
                   _config_digest(torch._dynamo.config), _config_digest(torch._functorch.config),
                   traced.__module__, traced.__qualname__, _process_groups())).encode())
    return h.hexdigest()


# -- the store: one folder per key, one file per artifact (one per guard set: a shape, grad mode, ...)

_MAGIC = b"npu_compile-precompiled\n"


def folder(key: str) -> Path:
    return cache.root() / "precompiled" / key


def _write(path: Path, payload: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(_MAGIC + hashlib.sha256(payload).hexdigest().encode() + b"\n" + payload)
    os.replace(tmp, path)  # atomic: a reader sees the whole artifact or none


def _read(path: Path) -> bytes:
    raw = path.read_bytes()
    if not raw.startswith(_MAGIC):
        raise cache.CorruptEntry("not a precompiled artifact")
    digest, _, payload = raw[len(_MAGIC):].partition(b"\n")
    if hashlib.sha256(payload).hexdigest().encode() != digest:
        raise cache.CorruptEntry("checksum mismatch")
    return payload


def _sources_unchanged(fn: Any) -> str | None:
    """None when every source Dynamo traced for ``fn`` still reads as it did, else the first that changed."""
    from torch._dynamo.package import _hash_sourcelines

    for code in fn.source_info().inlined_sources:
        try:
            module = importlib.import_module(code.module)
            if _hash_sourcelines(module, code.firstlineno, code.lastlineno) == code.checksum:
                continue
        except Exception:
            pass
        return f"{code.module} lines {code.firstlineno}-{code.lastlineno}"
    return None


# -- process groups: Dynamo guards on a module's group (its type, its name), but its guard serializer stores every
# ProcessGroup as a placeholder (torch/_dynamo/guards.py, _get_unsupported_types -> _Missing("unsupported")), so those
# guards, rebuilt at load from the stored scope, test the placeholder: the type check never passes and
# ``group.group_name == '7'`` raises AttributeError. They are left out of the stored guards and checked here
# instead, by the same path from the arguments: the object there is a process group of the same name.


def _is_group(value: Any) -> bool:
    import torch.distributed as dist

    from torch._library.fake_class_registry import FakeScriptObject

    if isinstance(value, FakeScriptObject):
        value = value.real_obj
    return dist.is_available() and isinstance(value, dist.ProcessGroup)


def _source_value(name: str, f_locals: dict, f_globals: dict | None = None) -> Any:
    # a guard source: L[...] / G[...] and attribute or item reads
    return eval(name, {"__builtins__": {}}, {"L": f_locals, "G": f_globals or {}})


# Guards torch drops from a stored compile because they compare object identities (CheckFunctionManager's
# UNSUPPORTED_SERIALIZATION_GUARD_TYPES); the object's description is stored in their stead (``_identity``).
_IDENTITY_GUARDS = frozenset({"ID_MATCH", "FUNCTION_MATCH", "CLASS_MATCH", "MODULE_MATCH", "CLOSURE_MATCH"})


def _guard_filter(f_locals: dict, checks: dict[str, tuple[str, str]], f_globals: dict | None = None) -> Callable:
    """torch's filter for precompile (none of the guard types it cannot serialize), with what those guards checked
    kept in ``checks`` (source -> (kind, value)) for ``_Artifact.accepts``: a guard that reads through a process
    group, which torch cannot store, as ("group", its name); an identity guard (the function a module calls, e.g.
    megatron-core's ``config.activation_func``, a hook, a class, a module) as ("identity", a description of the
    object that another process computes alike). Dropped with nothing kept: guards on globals other than those
    identities, and the rest of the unsupported types (dict versions, weakrefs, nn.Module ids: what they watch is
    read through guards that are kept)."""
    from torch._dynamo.guards import CheckFunctionManager

    def keep(entry: Any) -> bool:
        source = entry.orig_guard.originating_source
        while source is not None:
            name = source.name
            if name.startswith("L["):
                try:
                    value = _source_value(name, f_locals)
                except Exception:
                    value = None
                if _is_group(value):
                    checks[name] = ("group", _group_name(value))
                    return False
            source = getattr(source, "base", None)
        if entry.guard_type in _IDENTITY_GUARDS or "ID_MATCH" in entry.derived_guard_types:
            name = entry.orig_guard.name
            # not Dynamo's own globals (G['__import_...']: modules it installs when the compiled code first runs)
            if name.startswith("L[") or (name.startswith("G[") and not name.startswith("G['__")):
                try:
                    checks.setdefault(name, ("identity", _identity(_source_value(name, f_locals, f_globals))))
                except Exception:
                    pass
            return False
        return not (entry.is_global or entry.guard_type in CheckFunctionManager.UNSUPPORTED_SERIALIZATION_GUARD_TYPES)

    return lambda entries: [keep(e) for e in entries]


_identities: dict[int, tuple[Any, str]] = {}  # id -> (the object, kept alive so the id stays its own; its text)


def _identity(value: Any) -> str:
    """What an identity guard checked, as another process sees it: a function by its name, bytecode, defaults and
    closed-over values (``_digest``), a bound method by its function and its object's type, a class or a module by
    its name, anything else by its type and a repr without addresses."""
    got = _identities.get(id(value))
    if got is not None and got[0] is value:
        return got[1]
    h = hashlib.sha256()
    if isinstance(value, types.MethodType):
        _digest((value.__func__, type(value.__self__).__qualname__), h)
    elif isinstance(value, type):
        h.update(f"class {value.__module__}.{value.__qualname__}".encode())
    elif isinstance(value, types.ModuleType):
        h.update(f"module {value.__name__}".encode())
    else:
        h.update(f"{type(value).__module__}.{type(value).__qualname__}:".encode())
        _digest(value, h)
    _identities[id(value)] = (value, h.hexdigest())
    return _identities[id(value)][1]


def _group_name(value: Any) -> str:
    from torch._library.fake_class_registry import FakeScriptObject

    return (value.real_obj if isinstance(value, FakeScriptObject) else value).group_name


class _Artifact:
    """One stored compile: torch's AOTCompiledFunction, the process groups its guards left to us, and the
    report.json of each graph it compiled (given again, ``cache`` "precompiled", the first time it runs in a
    process: ``npu_compile.debug.report.collect`` and the dump dir see a loaded compile as they see a new one)."""

    def __init__(self, fn: Any, checks: dict[str, tuple[str, str]], reports: list[dict], f_globals: dict):
        self.fn, self.checks, self.reports, self.f_globals = fn, checks, reports, f_globals
        self.published = False
        self._paths = {name: builtins.compile(name, "<guard kept by npu_compile>", "eval") for name in checks}

    def publish(self, dump_dir: str | None) -> None:
        from npu_compile.debug.dump import GraphDump
        from npu_compile.debug.report import Report, publish

        self.published = True
        for content in self.reports:
            # nothing was spent compiling here: compile_s is this process's
            report = Report(**{**content, "cache": dict.fromkeys(content["cache"] or ("graph",), "precompiled"),
                               "compile_s": {}})
            publish(report)
            GraphDump(dump_dir, report.graph_id).report(report.to_json())

    def accepts(self, args: tuple, kwargs: dict) -> bool:
        if not self.fn.guard_check(*args, **kwargs):
            return False
        if not self.checks:
            return True
        scope = {"L": self.fn.prepare_f_locals(*args, **kwargs), "G": self.f_globals}
        for name, path in self._paths.items():
            try:
                value = eval(path, {"__builtins__": {}}, scope)
            except Exception:
                return False
            kind, want = self.checks[name]
            if kind == "group":
                if not _is_group(value) or _group_name(value) != want:
                    return False
            elif _identity(value) != want:
                return False
        return True


class _Artifacts:
    """The artifacts of one key in this process: loaded once, shared by every wrapper with that key (N identical
    layers run one)."""

    def __init__(self, key: str, f_globals: dict):
        self.key, self.dir = key, folder(key)
        self.loaded: list[_Artifact] = []
        self.fallback: str | None = None
        try:
            self.fallback = (self.dir / _FALLBACK).read_text() or "unknown"
        except OSError:
            pass
        for path in sorted(self.dir.glob("*.bin")) if self.fallback is None else ():
            try:
                checks, reports, data = pickle.loads(_read(path))
                fn = AOTCompiledFunction.deserialize(data, f_globals)
                changed = _sources_unchanged(fn)
                if changed:
                    raise cache.CorruptEntry(f"traced source changed: {changed}")
            except Exception as e:  # stale or damaged: removed, and compiled again when its guards are wanted
                log.warning("npu_compile precompile: ignoring %s (%s: %s); it will be compiled again", path,
                            type(e).__name__, e)
                with contextlib.suppress(OSError):
                    path.unlink()
                continue
            self.loaded.append(_Artifact(fn, checks, reports, f_globals))
        if self.loaded:
            counts["loaded"] += len(self.loaded)

    def store(self, artifact: _Artifact) -> None:
        try:
            from torch._dynamo.package import load_guards_state

            # Dynamo's guard state can hold what it cannot load back (a tensor it stored as a placeholder inside an
            # object the scope reaches, e.g. an optimizer's state through Megatron's config callbacks): tried here,
            # so that no later process pays for an artifact that cannot load
            load_guards_state(artifact.fn._artifacts.guards_state)
            payload = pickle.dumps((artifact.checks, artifact.reports,
                                    AOTCompiledFunction.serialize(artifact.fn).serialized_data))
            _write(self.dir / f"{hashlib.sha256(payload).hexdigest()[:32]}.bin", payload)
            counts["stored"] += 1
        except Exception as e:  # not storable: this process still runs it
            counts["unstorable"] += 1
            log.info("npu_compile precompile: cannot store an artifact of %s (%s: %s)", self.key[:12],
                        type(e).__name__, e)

    def give_up(self, reason: str) -> None:
        self.fallback = reason
        with contextlib.suppress(OSError):
            self.dir.mkdir(parents=True, exist_ok=True)
            (self.dir / _FALLBACK).write_text(reason)


_artifacts: dict[str, _Artifacts] = {}
counts: collections.Counter = collections.Counter()  # loaded, stored, hit (calls run by a loaded artifact), ...


@contextlib.contextmanager
def _never_torchs_autograd_cache() -> Any:
    """aot_compile looks the graph up in torch's AOTAutograd cache (on disk, shared by processes), whose key knows
    nothing of this backend (its options, its rules): a hit there is another compile's graphs. With the FX graph
    cache off, that key is refused (autograd_cache.py, ``check_cacheable``) and aot_compile keys the entry by a
    nonce, ``str(random.random())`` (``autograd_cache_key``), drawn from Python's global ``random``, which training
    seeds: every run would draw the same nonces and hit the last run's entries. So the nonce is drawn from a fresh
    seed, and the caller's ``random`` stream is given back as it was (a compile consumes none of it)."""
    import random

    state = random.getstate()
    random.seed(os.urandom(16))
    try:
        with torch._inductor.config.patch(fx_graph_cache=False):
            yield
    finally:
        random.setstate(state)


@contextlib.contextmanager
def _grads_set_aside(values: Any) -> Any:
    """The ``.grad`` of the arguments' tensors and of their modules' parameters set to None while Dynamo saves its
    guard state: it stores a tensor's grad as a placeholder (torch/_dynamo/guards.py, ``GuardsStatePickler``:
    a tensor outside the guard tree becomes ``_Missing``) and loading it assigns that placeholder back
    (``_unpickle_tensor``: ``ret.grad = grad``), which raises "TypeError: assigned grad expected to be a Tensor or
    None but got grad of type _Missing" once a training step has filled the grads (an evaluation compiled after
    it). The compile traces with fake tensors and reads no grad here (a guard on one would test None)."""
    tensors = []
    for value in values:
        if isinstance(value, torch.nn.Module):
            tensors += list(value.parameters())
        elif isinstance(value, torch.Tensor):
            tensors.append(value)
    held = [(t, t.grad) for t in tensors if t.is_leaf and t.grad is not None]
    try:
        for t, _ in held:
            t.grad = None
        yield
    finally:
        for t, grad in held:
            t.grad = grad


def _torchs_autograd_cache_off() -> str | None:
    """Why aot_compile cannot make a storable compile in this process, or None. aot_autograd makes the bundled
    entry aot_compile serializes only where its local cache is on (torch/_functorch/aot_autograd.py:1204-1216,
    ``should_use_local_autograd_cache``); else every compile fails to store with "RuntimeError: Compiled function
    type <class 'function'> ... does not implement SerializableCallable." (torch/_dynamo/aot_compile.py:416-425).
    ``TORCHINDUCTOR_AUTOGRAD_CACHE`` is read over any ``config.patch`` (``env_name_force``,
    torch/_functorch/config.py:71-75), so it is a setting of the process, not of the function: no fallback marker is
    written, and a process without it stores and loads again."""
    if torch.compiler.config.force_disable_caches:
        return "torch.compiler.config.force_disable_caches is set (TORCHINDUCTOR_FORCE_DISABLE_CACHES)"
    if not torch._functorch.config.enable_autograd_cache:
        return ("torch's AOTAutograd cache is off (TORCHINDUCTOR_AUTOGRAD_CACHE=0), and aot_compile stores only what "
                "it bundles; unset it to start warm")
    return None


def _unpickled_wrapper() -> None:
    return None


class Precompiled:
    """``torch.compile(fn, backend="ascend", options=options)`` that starts warm (module doc)."""

    def __init__(self, fn: Callable, options: dict | None):
        self._fn, self._options = fn, dict(options or {})
        self._plain: Callable | None = None
        self._artifacts: _Artifacts | None = None
        self._traced, self._self = torch._dynamo.convert_frame.get_traced_fn(fn)
        functools.update_wrapper(self, self._traced)
        self.__wrapped__ = fn  # inspect.signature(module.forward) stays the bound method's, as with torch.compile

    def __reduce__(self) -> tuple:
        # a module holding this wrapper (``module.forward``) is pickled into Dynamo's guard state; the wrapper's
        # loaded artifacts (guard managers) do not pickle and no guard reads them
        return _unpickled_wrapper, ()

    def _plain_compile(self) -> Callable:
        if self._plain is None:
            self._plain = torch.compile(self._fn, backend="ascend", options=dict(self._options))
        return self._plain

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._plain is not None:
            return self._plain(*args, **kwargs)
        if self._artifacts is None:
            opts = self._resolved = config.resolve(self._options)
            if not opts.cache or opts.verify:  # verify runs the graph beside eager: nothing to keep
                return self._plain_compile()(*args, **kwargs)
            off = _torchs_autograd_cache_off()
            if off:
                counts["fallback"] += 1
                log.warning("npu_compile precompile: %s runs under plain torch.compile, nothing stored: %s",
                            self._traced.__qualname__, off)
                return self._plain_compile()(*args, **kwargs)
            key = precompile_key(self._fn, opts)
            if key not in _artifacts:
                _artifacts[key] = _Artifacts(key, self._traced.__globals__)
            self._artifacts = _artifacts[key]
        store = self._artifacts
        if store.fallback is not None:
            return self._plain_compile()(*args, **kwargs)
        full = (self._self, *args) if self._self is not None else args
        for artifact in store.loaded:
            if artifact.accepts(full, kwargs):
                counts["hit"] += 1
                if not artifact.published:
                    artifact.publish(self._resolved.dump_dir)
                return artifact.fn.fn(*full, **kwargs)
        if store.loaded and log.isEnabledFor(logging.DEBUG):
            first = store.loaded[0].fn
            log.debug("npu_compile precompile: no artifact of %s takes these arguments; the first: %s",
                      self._traced.__qualname__,
                      first._artifacts.guard_manager.check_verbose(first.prepare_f_locals(*full, **kwargs)))
        if len(store.loaded) >= LIMIT:
            store.give_up(f"more than {LIMIT} guard sets")
            return self._plain_compile()(*args, **kwargs)
        artifact = self._aot_compile(full, args, kwargs)
        if artifact is None:
            return self._plain_compile()(*args, **kwargs)
        store.loaded.append(artifact)
        store.store(artifact)
        return artifact.fn.fn(*full, **kwargs)

    def _aot_compile(self, full: tuple, args: tuple, kwargs: dict) -> _Artifact | None:
        counts["compiled"] += 1
        checks: dict[str, tuple[str, str]] = {}
        f_locals = inspect.signature(self._traced).bind(*full, **kwargs).arguments
        f_globals = self._traced.__globals__
        options = {**self._options, "guard_filter_fn": _guard_filter(dict(f_locals), checks, f_globals)}
        # a module: what Dynamo traces of it (its forward, or __call__ with hooks), bound, since aot_compile is on
        # torch.compile's function wrapper only
        target = types.MethodType(self._traced, self._self) if isinstance(self._fn, torch.nn.Module) else self._fn
        compiled = torch.compile(target, backend="ascend", options=options, fullgraph=True)
        try:
            from npu_compile.debug.report import collect

            with _grads_set_aside(f_locals.values()), _never_torchs_autograd_cache(), collect() as reports:
                fn = compiled.aot_compile((args, kwargs))  # the backward too: aot_compile lowers it eagerly
            artifact = _Artifact(fn, checks, [r.to_json() for r in reports], f_globals)
            artifact.published = True  # this process has its reports already
            return artifact
        except (config.OptionError, config.TargetUnavailable):
            raise
        except Exception as e:  # a graph break, or an output that does not serialize: plain torch.compile
            lines = [line.strip() for line in str(e).strip().splitlines()]
            # Dynamo's own words on a graph break follow its first line, e.g. which disabled function and why
            why = next((line for line in lines[1:] if line.startswith("Explanation:")), "")
            reason = f"{type(e).__name__}: {' '.join(filter(None, lines[:1] + [why]))}"
            log.info("npu_compile precompile: %s runs under plain torch.compile (%s)", self._traced.__qualname__,
                     reason)
            self._artifacts.give_up(reason)
            counts["fallback"] += 1
            return None


def compile(fn: Callable, options: dict | None = None) -> Callable:  # noqa: A001 - torch.compile's name
    """``fn`` compiled with backend="ascend" and ``options``; with the ``cache`` option on (the default), its
    compiled form is stored and a later process loads it instead of tracing (module doc)."""
    return Precompiled(fn, options)
