"""The persistent compile cache: a second process compiling the same graph with the same options loads what the
backend's passes made instead of running them again.

What is cached is each step of the backend that costs: the fusion rules and min-cut partition of a joint graph
(the partitioned forward and backward, with the rules' counts), and the aten stages and lowering of each forward /
backward / inference graph (the lowered graph, with its report figures). Each entry is keyed by everything that
shapes it (:func:`graph_key`):

- the graph it starts from, as aot_autograd hands it over: its code (which names each collective's c10d group),
  the metadata of its inputs and constants, and each subgraph it calls (a region's forward or backward) the same
  way, whatever class it has (a subgraph loaded from this cache is a ``GraphModuleImpl``);
- every option but those ``config.UNKEYED`` lists (where the dumps go, whether to verify, whether to cache);
- the fusion rules registered now, in order, each by name and a digest of what defines it (its pattern,
  replacement, checks and example inputs: their source, defaults and closures), a user's rules included;
- the device profile the cost model reads (``device.profile.load()``);
- each process group the graph names: its size, its ranks, its backend, and the string the target bakes into the
  graph for its communicator (the HCCL communicator name on target ``npu``);
- the versions of torch, megatron-core and this package (its version and a digest of its source).

Dynamo and aot_autograd still trace (they build the guards and the runtime wrappers, and are what hands over those
graphs); the rest is skipped on a hit.

Graphs are stored with torch's ``GraphPickler`` (what Inductor's FX graph cache uses for graph modules), under
``$NPU_COMPILE_CACHE_DIR``, else ``npu_compile/`` in torch's compile cache dir (``$TORCHINDUCTOR_CACHE_DIR``, by
default ``/tmp/torchinductor_<user>``). torch's own AOTAutograd / FX graph caches hold Inductor's output only: a
custom backend's compiler is not a ``SerializableAOTDispatchCompiler`` and its result is no ``OutputCode``.

An entry is trusted only after its checksum, its key and its graphs have been checked; one that fails any check
or fails to load is logged, removed and rebuilt. A failure to write an entry is logged and never stops a compile.
``options={"cache": False}`` switches the cache off.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import hashlib
import inspect
import json
import logging
import os
import pickle
import re
import types
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx._graph_pickler import GraphPickler, Options as PicklerOptions

log = logging.getLogger("npu_compile")

CACHE_DIR_ENV = "NPU_COMPILE_CACHE_DIR"
FORMAT = 1
_MAGIC = b"npu_compile-cache\n"


def root() -> Path:
    env = os.environ.get(CACHE_DIR_ENV)
    if env:
        return Path(env)
    from torch._inductor.runtime.runtime_utils import cache_dir

    return Path(cache_dir()) / "npu_compile"


@functools.lru_cache(maxsize=1)
def versions() -> tuple[str, ...]:
    """torch, megatron-core (when installed) and npu_compile: its version and a digest of its source files."""
    from importlib.metadata import PackageNotFoundError, version

    def installed(name: str) -> str:
        try:
            return version(name)
        except PackageNotFoundError:
            return "-"

    package = Path(__file__).parent
    digest = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        digest.update(str(path.relative_to(package)).encode() + b"\0" + path.read_bytes() + b"\0")
    return (f"torch {torch.__version__}", f"megatron-core {installed('megatron-core')}",
            f"npu_compile {installed('npu_compile')} {digest.hexdigest()}")


def _meta(value: Any, subgraphs: dict[int, str] | None = None) -> str:
    if isinstance(value, torch.Tensor):
        return (f"T({tuple(value.shape)},{value.stride()},{value.storage_offset()},{value.dtype},{value.device.type},"
                f"{value.requires_grad},{type(value).__name__ == 'Parameter'})")
    if isinstance(value, torch.fx.GraphModule):
        # a higher-order op's subgraph (a region's forward or backward, a cond branch): what it computes, not its
        # class, which differs for the same graph once reloaded (an unpickled GraphModule is a GraphModuleImpl)
        subgraphs = {} if subgraphs is None else subgraphs
        if id(value) not in subgraphs:  # a region called N times is N get_attr nodes of one module
            subgraphs[id(value)] = _graph_digest(value, subgraphs)
        return f"GraphModule({subgraphs[id(value)]})"
    return repr(value)


def _graph_digest(gm: torch.fx.GraphModule, subgraphs: dict[int, str]) -> str:
    """A digest of ``gm``'s code, its inputs' metadata and its attributes (a subgraph by its own digest, worked out
    once per module in ``subgraphs``)."""
    h = hashlib.sha256(gm.code.encode())
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            h.update(f"{node.name}:{_meta(node.meta.get('val'))};".encode())
        elif node.op == "get_attr":
            attr = getattr(gm, str(node.target), None)
            h.update(f"{node.target}:{_meta(attr, subgraphs)};".encode())
            if isinstance(attr, torch.Tensor) and not attr.is_meta and type(attr) is torch.Tensor:
                h.update(_tensor_bytes(attr))
    return h.hexdigest()


def keyed_options(opts: Any) -> dict[str, Any]:
    """The options in the key: every field of ``config.Options`` but ``config.UNKEYED`` (a new option is keyed
    unless it is listed there)."""
    from npu_compile import config

    return {f.name: getattr(opts, f.name) for f in dataclasses.fields(opts) if f.name not in config.UNKEYED}


def graph_key(stage: str, gm: torch.fx.GraphModule, opts: Any,
              communicator: Callable[[Any], str] | None = None) -> str:
    """The key of the ``stage`` step on ``gm`` under ``opts``: a sha256 hex digest. ``communicator``: the target's
    name for a process group's communicator, which its lowering bakes into the graph (None: it bakes none)."""
    from npu_compile.device.profile import load as load_profile

    h = hashlib.sha256()
    profile = json.dumps(dataclasses.asdict(load_profile()), sort_keys=True)
    h.update(repr((FORMAT, stage, versions(), keyed_options(opts), rules_digest(), profile,
                   groups(gm, communicator))).encode())
    h.update(_graph_digest(gm, {}).encode())
    return h.hexdigest()


def _tensor_bytes(t: torch.Tensor) -> bytes:
    # a real constant (Megatron's loss lifts a 0-dim one), read outside the compiling graph's fake mode
    with torch._subclasses.fake_tensor.unset_fake_temporarily():
        return t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes()


# -- the process groups a graph names ------------------------------------------------------------------------------

_GROUP_ARGS = ("group_name", "group", "hcom")


def groups(gm: torch.fx.GraphModule, communicator: Callable[[Any], str] | None = None) -> list[tuple]:
    """Each process group ``gm``'s ops name (a collective's ``group_name``): (name, size, global ranks, backend,
    the target's communicator name). The name alone is the c10d registry's, given in creation order: the same name
    is another group in a job of another layout, and its HCCL communicator has another name in another job."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group

    names: dict[str, None] = {}
    for node in gm.graph.nodes:
        target = node.target
        if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
            continue
        schema_args = target._schema.arguments
        bound = dict(zip((a.name for a in schema_args), node.args)) | dict(node.kwargs)
        for arg in _GROUP_ARGS:
            if isinstance(bound.get(arg), str):
                names[bound[arg]] = None
    out = []
    for name in names:
        try:
            pg = _resolve_process_group(name)
        except (ValueError, RuntimeError, KeyError):
            out.append((name, "unresolved"))
            continue
        entry = [name, pg.size(), tuple(dist.get_process_group_ranks(pg)), str(dist.get_backend(pg))]
        if communicator is not None:
            try:
                entry.append(communicator(pg))
            except (ValueError, RuntimeError) as e:  # the lowering declines the group's MC2 sites for this reason
                entry.append(f"no communicator: {e}")
        out.append(tuple(entry))
    return out


# -- the registered fusion rules -----------------------------------------------------------------------------------

def rules_digest() -> str:
    """A digest of the fusion rules registered now, in the order they apply: names and what defines each (this
    package's own by their place in the registry, ``passes.builtin_place``)."""
    from npu_compile.passes import GRAPH_RULES, RULES, builtin_place

    h = hashlib.sha256()
    for name, rules in RULES.items():
        h.update(f"{name}\0{len(rules)}\0".encode())
        for rule in rules:
            place = builtin_place(rule)
            if place is not None:  # this package's own: its source digest is in the key
                h.update(f"builtin {place}\0".encode())
            else:
                h.update(rule_digest(rule).encode())
    for name, graph_rule in GRAPH_RULES.items():  # after the pattern rules, as they apply
        h.update(f"graph rule {name}\0{rule_digest(graph_rule)}\0".encode())
    return h.hexdigest()


_rule_digests: dict[int, tuple[Any, str]] = {}  # id(rule) -> (rule, digest): the rule kept, so its id stays its own


def rule_digest(rule: Any) -> str:
    """A digest of one ``passes.Rule`` (or ``GraphRule``): every field, functions by their source (or code), defaults and closures."""
    known = _rule_digests.get(id(rule))
    if known is None or known[0] is not rule:
        fields = {f.name: _stable(getattr(rule, f.name), set()) for f in dataclasses.fields(rule)}
        known = _rule_digests[id(rule)] = (rule, hashlib.sha256(repr(sorted(fields.items())).encode()).hexdigest())
    return known[1]


def describe(value: Any) -> str:
    """``value`` as the keys describe it: the same text in every process where it means the same (functions by
    their source, defaults and closures; this package's and torch's by name, their versions being in the key)."""
    return _stable(value, set())


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")
_SCALARS = (type(None), bool, int, float, complex, str, bytes)
_SCALAR_TYPES = frozenset(_SCALARS)
# Functions of these packages are named, not read: their versions (and this package's source digest) are in the key.
_VERSIONED = ("torch", "npu_compile", "builtins", "operator", "math", "functools")


def _stable(value: Any, seen: set[int]) -> str:
    """A description of ``value`` that is the same in every process where it means the same (no addresses)."""
    if type(value) in _SCALAR_TYPES or isinstance(value, _SCALARS):  # most of what rules hold: by type first
        return repr(value)
    if isinstance(value, enum.Enum):
        return f"{type(value).__qualname__}.{value.name}"
    if isinstance(value, (torch.dtype, torch.device, torch.layout, torch.memory_format, torch.Size)):
        return str(value)
    if isinstance(value, (torch._ops.OpOverload, torch._ops.OpOverloadPacket, torch._ops.HigherOrderOperator)):
        return f"op:{value}"
    if isinstance(value, torch.Tensor):
        text = f"tensor{_meta(value)}"
        if type(value) is torch.Tensor and not value.is_meta and value.numel() <= 4096:
            text += hashlib.sha256(_tensor_bytes(value)).hexdigest()
        return text
    if id(value) in seen:  # a value inside itself (a recursive function, a list holding itself)
        return f"<recursion {type(value).__qualname__}>"
    seen.add(id(value))
    try:
        return _described(value, seen)
    finally:
        seen.discard(id(value))


def _described(value: Any, seen: set[int]) -> str:
    if isinstance(value, (list, tuple)):
        if all(type(v) in _SCALAR_TYPES for v in value):
            return f"{type(value).__name__}({','.join(map(repr, value))})"
        return f"{type(value).__name__}({','.join(_stable(v, seen) for v in value)})"
    if isinstance(value, (set, frozenset)):
        return f"{type(value).__name__}({','.join(sorted(_stable(v, seen) for v in value))})"
    if isinstance(value, Mapping):
        items = sorted((_stable(k, seen), _stable(v, seen)) for k, v in value.items())
        return f"{type(value).__name__}({items})"
    if isinstance(value, functools.partial):
        return f"partial({_stable(value.func, seen)},{_stable(value.args, seen)},{_stable(value.keywords, seen)})"
    if isinstance(value, types.MethodType):
        return f"method({_stable(value.__func__, seen)},{type(value.__self__).__qualname__})"
    if isinstance(value, types.FunctionType):
        return _function(value, seen)
    if isinstance(value, (type, types.ModuleType, types.BuiltinFunctionType)) or callable(value) and hasattr(
            value, "__qualname__"):
        return f"{getattr(value, '__module__', '')}.{getattr(value, '__qualname__', getattr(value, '__name__', ''))}"
    if dataclasses.is_dataclass(value):
        fields = {f.name: _stable(getattr(value, f.name), seen) for f in dataclasses.fields(value)}
        return f"{type(value).__qualname__}({sorted(fields.items())})"
    return f"{type(value).__qualname__}:{_ADDRESS.sub('', repr(value))}"


_versioned_functions: dict[int, tuple[types.FunctionType, str]] = {}  # id -> (function, description)


def _function(fn: types.FunctionType, seen: set[int]) -> str:
    module = fn.__module__ or ""
    versioned = module.split(".")[0] in _VERSIONED
    if versioned:  # the rule families share their helpers: each described once per process
        known = _versioned_functions.get(id(fn))
        if known is not None and known[0] is fn:
            return known[1]
    text = _function_text(fn, versioned, seen)
    if versioned:
        _versioned_functions[id(fn)] = (fn, text)
    return text


def _function_text(fn: types.FunctionType, versioned: bool, seen: set[int]) -> str:
    module = fn.__module__ or ""
    parts = [f"{module}.{fn.__qualname__}"]
    code = fn.__code__
    if versioned:
        parts.append(str(code.co_firstlineno))  # its source is in the versions; a lambda is told by its line
    else:
        try:
            parts.append(inspect.getsource(fn))
        except (OSError, TypeError):  # defined where no source is kept (exec, a REPL): its compiled code
            parts.append(_code(code))
        # the module-level helpers and constants it reads, which its own source does not show
        for name in sorted(_names(code)):
            if name in fn.__globals__:
                parts.append(f"{name}={_global(fn.__globals__[name], seen)}")
    parts.append(_stable(fn.__defaults__, seen))
    parts.append(_stable(fn.__kwdefaults__, seen))
    for cell in fn.__closure__ or ():
        try:
            parts.append(_stable(cell.cell_contents, seen))
        except ValueError:  # a cell not filled yet
            parts.append("<empty cell>")
    return f"fn({'|'.join(parts)})"


_DATA = (*_SCALARS, list, tuple, set, frozenset, dict, enum.Enum, torch.dtype, torch.Tensor, functools.partial,
         types.FunctionType, torch._ops.OpOverload, torch._ops.OpOverloadPacket)


def _global(value: Any, seen: set[int]) -> str:
    """A module-level name a user's rule reads: helpers and plain data by content; modules, classes and other
    objects (a model, a logger) by their type only."""
    if isinstance(value, _DATA):
        return _stable(value, seen)
    if isinstance(value, types.ModuleType):
        return f"module {value.__name__}"
    return f"<{type(value).__module__}.{type(value).__qualname__}>"


def _names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _names(const)
    return names


def _code(code: types.CodeType) -> str:
    consts = [_code(c) if isinstance(c, types.CodeType) else repr(c) for c in code.co_consts]
    return f"code({code.co_code.hex()},{consts},{code.co_names})"


class CorruptEntry(Exception):
    pass


def _path(key: str, kind: str = "graph") -> Path:
    """Where an entry goes: a compiled graph's ``<root>/ab/<key>.bin``, a rule's pattern trace (kind ``pattern``,
    passes/engine.py TraceCache) ``<root>/patterns/ab/<key>.trace``."""
    if kind == "pattern":
        return root() / "patterns" / key[:2] / f"{key}.trace"
    return root() / key[:2] / f"{key}.bin"


# Any op (the target's own ops are registered before a graph is loaded); node metadata without the module stacks
# (they hold classes and live objects) and without the inputs aot_autograd keeps for custom ops (``eager_input_vals``,
# fake tensors of the trace, read by Inductor only).
_UNPICKLED_META = ("source_fn_stack", "nn_module_stack", "fwd_source_fn_stack", "eager_input_vals")
_PICKLE_GRAPHS = PicklerOptions(ops_filter=None, node_metadata_key_filter=lambda key: key not in _UNPICKLED_META)


def _dump_graph(gm: torch.fx.GraphModule) -> bytes:
    """GraphPickler's bytes of ``gm`` and of the region subgraphs it holds. Some views' FakeTensors do not pickle
    (their base holds live state): they go as a plain FakeTensor of the same shape, strides and dtype (the loaded
    graph's memory figures then count such a view as its own buffer). A region call the executor took over
    (``regions.call_region``, a function of this package, which GraphPickler does not pickle: it takes torch's,
    builtins', math's and operator's functions by name, torch 2.13 torch/fx/_graph_pickler.py:746 and :840) goes as
    the ``invoke_subgraph`` it was; the executor takes it over again when the graph is loaded
    (``regions.run_compiled``). ``gm`` is left as it was, its code too."""
    from npu_compile import regions

    swapped, calls = [], []
    try:
        for module in gm.modules():
            if not isinstance(module, torch.fx.GraphModule):
                continue
            for node in module.graph.nodes:
                if node.op == "call_function" and node.target is regions.call_region:
                    calls.append(node)
                    node.target = torch.ops.higher_order.invoke_subgraph
                val = node.meta.get("val")
                if isinstance(val, FakeTensor) and val._is_view():
                    try:
                        GraphPickler.dumps(val, _PICKLE_GRAPHS)
                    except Exception:
                        with val.fake_mode:
                            plain = torch.empty_strided(val.shape, val.stride(), dtype=val.dtype, device=val.device)
                        swapped.append((node, val))
                        node.meta["val"] = plain
        return GraphPickler.dumps(gm, _PICKLE_GRAPHS)
    finally:
        for node, val in swapped:
            node.meta["val"] = val
        for node in calls:
            node.target = regions.call_region
        for module in {id(n.graph.owning_module): n.graph.owning_module for n in calls}.values():
            module.recompile()  # GraphPickler recompiled it with the swapped targets


def _encode(value: dict[str, Any]) -> bytes:
    parts = {}
    for name, v in value.items():
        if isinstance(v, torch.fx.GraphModule):
            parts[name] = ("graph", _dump_graph(v), pickle.dumps(dict(v.meta)))
        else:
            parts[name] = ("value", v)
    return pickle.dumps(parts)


def _decode(data: bytes, fake_mode) -> dict[str, Any]:
    out = {}
    for name, part in pickle.loads(data).items():
        if part[0] == "graph":
            with warnings.catch_warnings():
                # torch 2.13's own unpickler of a graph's pytree specs warns of its own deprecated LeafSpec check
                warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
                                        category=FutureWarning)
                gm = GraphPickler.loads(part[1], fake_mode)
            if not isinstance(gm, torch.fx.GraphModule):
                raise CorruptEntry(f"{name} is no GraphModule")
            gm.meta.update(pickle.loads(part[2]))
            gm.graph.lint()
            gm.recompile()
            out[name] = gm
        else:
            out[name] = part[1]
    return out


def store(key: str, value: dict[str, Any], kind: str = "graph") -> bool:
    """Write one entry (graphs and plain values); False, logged, when it cannot be written."""
    try:
        payload = pickle.dumps((FORMAT, key, _encode(value)))
    except Exception as e:  # something in the graph that does not pickle: compile on without caching
        log.info("npu_compile cache: not storing %s (%s: %s)", key[:12], type(e).__name__, e)
        return False
    path = _path(key, kind)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_bytes(_MAGIC + hashlib.sha256(payload).hexdigest().encode() + b"\n" + payload)
        os.replace(tmp, path)  # atomic: a reader sees the old entry or the new, never half of one
        return True
    except OSError as e:
        log.warning("npu_compile cache: cannot write %s (%s); compiling on without it", path, e)
        return False


def load(key: str, fake_mode, kind: str = "graph") -> tuple[str, dict[str, Any] | None]:
    """("hit", value), ("miss", None), or ("rebuilt", None) for an entry that failed a check (removed)."""
    path = _path(key, kind)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return "miss", None
    except OSError as e:
        log.warning("npu_compile cache: cannot read %s (%s); compiling", path, e)
        return "miss", None
    try:
        if not raw.startswith(_MAGIC):
            raise CorruptEntry("not a cache entry")
        digest, _, payload = raw[len(_MAGIC):].partition(b"\n")
        if hashlib.sha256(payload).hexdigest().encode() != digest:
            raise CorruptEntry("checksum mismatch")
        fmt, stored_key, data = pickle.loads(payload)
        if (fmt, stored_key) != (FORMAT, key):
            raise CorruptEntry("written for another key or format")
        return "hit", _decode(data, fake_mode)
    except Exception as e:
        log.warning("npu_compile cache: ignoring entry %s (%s: %s); rebuilding it", path, type(e).__name__, e)
        with contextlib.suppress(OSError):
            path.unlink()
        return "rebuilt", None


def fake_mode_of(inputs) -> Any:
    from torch._guards import detect_fake_mode
    from torch._subclasses.fake_tensor import FakeTensorMode

    return detect_fake_mode(inputs) or FakeTensorMode()
