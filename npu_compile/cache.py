"""The persistent compile cache: a second process compiling the same graph with the same options loads what the
backend's passes made instead of running them again.

What is cached is each step of the backend that costs: the fusion rules and min-cut partition of a joint graph
(the partitioned forward and backward, with the rules' counts), and the aten stages and lowering of each forward /
backward / inference graph (the lowered graph, with its report figures). Each entry is keyed by the graph it starts
from, as aot_autograd hands it over (its code, the metadata of its inputs and constants), the options that shape the
result, and the versions of torch, megatron-core and this package (its version and a digest of its source). Dynamo
and aot_autograd still trace (they build the guards and the runtime wrappers, and are what hands over those graphs);
the rest is skipped on a hit.

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
import functools
import hashlib
import logging
import os
import pickle
from pathlib import Path
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx._graph_pickler import GraphPickler, Options as PicklerOptions

log = logging.getLogger("npu_compile")

CACHE_DIR_ENV = "NPU_COMPILE_CACHE_DIR"
FORMAT = 1
_MAGIC = b"npu_compile-cache\n"
# Options that change nothing in the compiled graphs: left out of the key.
_UNKEYED = ("dump_dir", "verify", "cache")


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


def _meta(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return (f"T({tuple(value.shape)},{value.stride()},{value.storage_offset()},{value.dtype},{value.device.type},"
                f"{value.requires_grad},{type(value).__name__ == 'Parameter'})")
    return repr(value)


def graph_key(stage: str, gm: torch.fx.GraphModule, opts: Any) -> str:
    """The key of the ``stage`` step on ``gm`` under ``opts``: a sha256 hex digest."""
    h = hashlib.sha256()
    keyed = {k: v for k, v in sorted(vars(opts).items()) if k not in _UNKEYED}
    h.update(repr((FORMAT, stage, versions(), keyed)).encode())
    h.update(gm.code.encode())
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            h.update(f"{node.name}:{_meta(node.meta.get('val'))};".encode())
        elif node.op == "get_attr":
            attr = getattr(gm, str(node.target), None)
            h.update(f"{node.target}:{_meta(attr)};".encode())
            if isinstance(attr, torch.Tensor) and not attr.is_meta and type(attr) is torch.Tensor:
                # a real constant (Megatron's loss lifts a 0-dim one), read outside the compiling graph's fake mode
                with torch._subclasses.fake_tensor.unset_fake_temporarily():
                    h.update(attr.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class CorruptEntry(Exception):
    pass


def _path(key: str) -> Path:
    return root() / key[:2] / f"{key}.bin"


# Any op (the target's own ops are registered before a graph is loaded); node metadata without the module stacks
# (they hold classes and live objects) and without the inputs aot_autograd keeps for custom ops (``eager_input_vals``,
# fake tensors of the trace, read by Inductor only).
_UNPICKLED_META = ("source_fn_stack", "nn_module_stack", "fwd_source_fn_stack", "eager_input_vals")
_PICKLE_GRAPHS = PicklerOptions(ops_filter=None, node_metadata_key_filter=lambda key: key not in _UNPICKLED_META)


def _dump_graph(gm: torch.fx.GraphModule) -> bytes:
    """GraphPickler's bytes of ``gm``. Some views' FakeTensors do not pickle (their base holds live state): they go
    as a plain FakeTensor of the same shape, strides and dtype (the loaded graph's memory figures then count such
    a view as its own buffer)."""
    swapped = []
    try:
        for node in gm.graph.nodes:
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


def store(key: str, value: dict[str, Any]) -> bool:
    """Write one entry (graphs and plain values); False, logged, when it cannot be written."""
    try:
        payload = pickle.dumps((FORMAT, key, _encode(value)))
    except Exception as e:  # something in the graph that does not pickle: compile on without caching
        log.info("npu_compile cache: not storing %s (%s: %s)", key[:12], type(e).__name__, e)
        return False
    path = _path(key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_bytes(_MAGIC + hashlib.sha256(payload).hexdigest().encode() + b"\n" + payload)
        os.replace(tmp, path)  # atomic: a reader sees the old entry or the new, never half of one
        return True
    except OSError as e:
        log.warning("npu_compile cache: cannot write %s (%s); compiling on without it", path, e)
        return False


def load(key: str, fake_mode) -> tuple[str, dict[str, Any] | None]:
    """("hit", value), ("miss", None), or ("rebuilt", None) for an entry that failed a check (removed)."""
    path = _path(key)
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
