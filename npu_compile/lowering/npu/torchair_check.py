"""torchair's own conversion of target npu's lowered graphs, run on a CPU from the pinned torch-npu wheel.

In graph mode target npu hands each lowered graph to ``torchair.get_compiler(config)(gm, example_inputs)``
(graph_modes.torchair_compile). torchair is Python apart from four native libraries (``torchair/core/*.so``), and
its conversion of an FX graph into a GE GraphDef reaches native code in one module only,
``torchair.core._torchair``. :func:`check` runs that very call on a machine without CANN: torchair's package is
extracted from the pinned wheel without its ``.so`` files, ``torchair.core._torchair`` is replaced by a stub
that gives conservative answers, and each graph goes through the mode its plan (graph_modes.plan_graph) chose:

  ge        torchair's FX passes, its converters node by node (each op's ``_ge_converter``), and its GE-graph
            passes, which build the GraphDef that GE would load: every op, attribute and wire. A graph
            torchair rejects is a failure naming the op, its arguments and torchair's message.
  aclgraph  torchair's FX passes and its code generation (the module that would capture the graph; the capture
            itself needs a device).
  eager     nothing to check: op by op.

The stub's answers: the graph engine starts (no-ops); ``check_cann_compat`` accepts the optional inputs and
attributes of the ~50 GE builders that ask; ``get_registered_ir_def`` says no AscendIR exists, so an op for which
torchair would have CANN generate a converter (no converter of its own) does NOT convert here. Loading,
compiling and running a graph (``TorchNpuGraphBase.load``/``compile``/``run``) raise: they are GE on a device.

Where the wheel comes from: ``$NPU_COMPILE_TORCH_NPU_WHEEL``, else ``.cache/torch_npu/<wheel>`` at the repository
root (where the tests' schema check downloads it, tests/lowering/wheel.py). protobuf must be importable (the
``test`` extra installs it). Without either, every graph is ``unchecked`` with the one-line reason, never
``checked``.

Importing torchair patches torch.distributed's traceable collectives, defines torch.library namespaces and
installs signal handlers and an atexit hook, so the conversion runs in a child process. The child is forked:
it holds the very graphs, their FakeTensor example inputs (symbolic sizes and their shape environment
included) and the process groups their collectives name, none of which a fresh interpreter could rebuild.
One child converts a whole batch (importing torchair costs seconds, a graph well under one).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import io
import logging
import multiprocessing
import os
import shutil
import sys
import traceback
import types
import warnings
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger("npu_compile")

VERSION = "2.13.0"
# One pinned wheel on every machine: torchair's Python is the same in every platform's wheel.
WHEEL = f"torch_npu-{VERSION}-cp311-cp311-manylinux_2_28_x86_64.whl"
WHEEL_ENV = "NPU_COMPILE_TORCH_NPU_WHEEL"
CACHE = Path(__file__).resolve().parents[3] / ".cache" / "torch_npu"
TORCHAIR_IN_WHEEL = "torch_npu/dynamo/torchair/"

CHECKED, FAILED, UNCHECKED = "checked", "failed", "unchecked"


@dataclasses.dataclass
class Graph:
    """One lowered graph as the executor gets it, and what torchair's conversion of it would see around it."""

    name: str
    gm: torch.fx.GraphModule
    example_inputs: Sequence[Any]
    graph_mode: str  # planned: ge / aclgraph / eager
    # aot_autograd compiles a forward with its fake mode active and a backward (lazily, at the first
    # .backward()) without it; torchair's aclgraph conversion runs ops outside its own fake pass, so it matters
    in_fake_mode: bool = False
    reasons: tuple[tuple[str, str], ...] = ()  # the plan's demotions: (op, why)

    @classmethod
    def at_executor(cls, name: str, gm: torch.fx.GraphModule, example_inputs: Sequence[Any],
                    graph_mode: str, reasons: tuple[tuple[str, str], ...] = ()) -> "Graph":
        """Called where the executor is: records whether a fake mode is active."""
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

        active = any(isinstance(m, FakeTensorMode) for m in _get_current_dispatch_mode_stack())
        return cls(name, gm, list(example_inputs), graph_mode, active, reasons)


@dataclasses.dataclass
class Verdict:
    """What torchair made of one graph."""

    name: str
    graph_mode: str  # as planned: ge / aclgraph / eager
    status: str  # checked / failed / unchecked
    detail: str = ""  # failed: the op, its arguments and torchair's message; unchecked: why
    ge_text: str | None = None  # ge: the GraphDef torchair hands to GE, in protobuf text format
    ge_summary: str | None = None  # ge: the same, one line per op (:func:`summarize`)
    ge_ops: list[str] = dataclasses.field(default_factory=list)  # ge: GE op types, in graph order
    aclgraph_code: str | None = None  # aclgraph: the module torchair generates

    def to_json(self) -> dict[str, Any]:
        return {"torchair_check": self.status, **({"reason": self.detail} if self.detail else {})}


def wheel() -> Path | None:
    """The pinned torch-npu wheel on this machine, or None (this module never downloads)."""
    if os.environ.get(WHEEL_ENV):
        path = Path(os.environ[WHEEL_ENV])
        return path if path.is_file() else None
    path = CACHE / WHEEL
    return path if path.is_file() else None


def unavailable(wheel_path: Path | None = None) -> str | None:
    """Why the check cannot run here (one line), or None when it can."""
    if importlib.util.find_spec("torch_npu") is not None or "torch_npu" in sys.modules:
        return ("torch_npu is installed: torchair converts for real when the graph first runs; this CPU check "
                "needs npu-sim's emulation of the npu ops, which cannot load beside torch_npu")
    path = wheel_path or wheel()
    if path is None or not path.is_file():
        where = os.environ.get(WHEEL_ENV) or CACHE / WHEEL
        return (f"no torch-npu {VERSION} wheel at {where} (set {WHEEL_ENV}, or run the tests once with network: "
                f"tests/lowering/wheel.py downloads it)")
    try:
        protobuf = importlib.util.find_spec("google.protobuf")
    except ModuleNotFoundError:  # no ``google`` package at all
        protobuf = None
    if protobuf is None:
        return "protobuf is not installed (torchair builds its GE GraphDef with it): pip install 'npu_compile[test]'"
    return None


def torchair_root(wheel_path: Path) -> Path:
    """A folder holding ``torchair/``, extracted once per wheel from ``wheel_path`` without native libraries."""
    stat = wheel_path.stat()
    dest = CACHE / f"torchair-{VERSION}-{stat.st_size}-{int(stat.st_mtime)}"
    if (dest / "torchair" / "__init__.py").is_file():
        return dest
    from filelock import FileLock  # torch's own dependency

    CACHE.mkdir(parents=True, exist_ok=True)
    with FileLock(str(CACHE / "torchair.lock")):
        if (dest / "torchair" / "__init__.py").is_file():
            return dest
        tmp = dest.with_name(dest.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        with zipfile.ZipFile(wheel_path) as zf:
            for member in zf.namelist():
                if member.startswith(TORCHAIR_IN_WHEEL) and not member.endswith((".so", "/")):
                    target = tmp / "torchair" / member[len(TORCHAIR_IN_WHEEL):]
                    target.parent.mkdir(parents=True, exist_ok=True)
                    target.write_bytes(zf.read(member))
        shutil.rmtree(dest, ignore_errors=True)
        os.replace(tmp, dest)
    return dest


# ---- the child: stubs, torchair, conversions -------------------------------------------------------------------

class _NoDevice(RuntimeError):
    pass


class _GraphBase:
    """Stands in for ``_torchair.TorchNpuGraphBase``: a graph can be built, never loaded or run (GE on a device)."""

    def __init__(self, name: str = "", *args: Any) -> None:
        self.name = name

    def _device(self, *args: Any, **kwargs: Any) -> Any:
        raise _NoDevice("loading, compiling or running a GE graph needs CANN and a device")

    load = compile = run = auto_tune = summary = _device


def _stub_module() -> types.ModuleType:
    """``torchair.core._torchair`` with conservative answers (module doc); anything else it is asked is missing."""
    m = types.ModuleType("torchair.core._torchair")
    m.TorchNpuGraphBase = _GraphBase
    for name in ("InitializeGraphEngine", "FinalizeGraphEngine", "SetDebugLogPath", "InitDeviceStdoutChannel"):
        setattr(m, name, lambda *args, **kwargs: None)
    m.check_cann_compat = lambda *args: ""  # "" = this CANN takes those optional inputs / attributes
    m.get_registered_ir_def = lambda name: ("NOT_FOUND", {}, {}, {})  # no AscendIR to generate a converter from
    # read at import (llm_datadist/_tensor_utils.py): names only, never used for a conversion
    m.TorchDataType = type("TorchDataType", (), {"__getattr__": lambda self, key: key})()
    return m


def _torch_npu_stub() -> types.ModuleType:
    """A bare ``torch_npu`` for aclgraph's code generation (fx2acl_converter imports it and asks for a device)."""
    m = types.ModuleType("torch_npu")
    npu = types.SimpleNamespace(
        current_device=lambda: 0, _get_deterministic_level=lambda: 0, get_device_name=lambda *a: "Ascend910B1",
        matmul=types.SimpleNamespace(allow_hf32=False), conv=types.SimpleNamespace(allow_hf32=False),
        graph_pool_handle=lambda: (0, 0))
    m.npu = npu
    m.float4_e2m1fn_x2 = None
    return m


def _float4_names_stub() -> types.ModuleType:
    """The bare ``torch_npu`` of aclgraph's code generation (an Atlas A2 device name, so torchair's ``is_arch35()``
    answers False as it does without torch_npu), with both fp4 dtype names."""
    m = _torch_npu_stub()
    m.float4_e1m2fn_x2 = None
    return m


# Converters of the wheel that ``import torch_npu`` while they run (ge_converter/custom/grouped_matmul.py: the fp4
# dtype names, compared only with the x_dtype / weight_dtype arguments, which we never pass; and, through
# _utils/check_platform.is_arch35, the device name). torch_npu is put in sys.modules for the converter's call alone:
# torchair switches its pattern passes on when it finds it there, and those need npu ops npu-sim does not define.
NEEDS_TORCH_NPU_NAMES = ("npu_grouped_matmul",)


def _with_torch_npu_names(torchair: Any) -> None:
    for name in NEEDS_TORCH_NPU_NAMES:
        op = getattr(torch.ops.npu, name).default
        wrapped = getattr(op, "_ge_converter", None)
        if wrapped is None:
            continue
        wheel_converter = getattr(wrapped, "__wrapped__", wrapped)

        def converter(*args: Any, meta_outputs: Any = None, _wheel: Any = wheel_converter, **kwargs: Any) -> Any:
            added = "torch_npu" not in sys.modules
            if added:
                sys.modules["torch_npu"] = _float4_names_stub()
            try:
                return _wheel(*args, meta_outputs=meta_outputs, **kwargs)
            finally:
                if added:
                    sys.modules.pop("torch_npu", None)

        torchair.register_fx_node_ge_converter(op)(converter)


def _import_torchair(root: Path) -> Any:
    sys.path.insert(0, str(root))
    sys.modules["torchair.core._torchair"] = _stub_module()
    executor = types.ModuleType("torchair.core._npu_graph_executor")
    sys.modules[executor.__name__] = executor
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import torchair  # noqa: PLC0415

    for name in ("torchair", "torchair.core.utils"):
        logging.getLogger(name).setLevel(logging.ERROR)
    with contextlib.suppress(Exception):
        from torchair.core.utils import logger as torchair_logger  # noqa: PLC0415

        torchair_logger.setLevel(logging.ERROR)
    return torchair


def _describe(value: Any) -> str:
    if isinstance(value, torch.fx.Node):
        val = value.meta.get("val")
        if isinstance(val, torch.Tensor):
            return f"{value.name}: {str(val.dtype).removeprefix('torch.')}{list(val.shape)}"
        return value.name
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_describe(v) for v in value) + "]"
    return repr(value)


def node_call(node: torch.fx.Node) -> str:
    """``op(arg, ..., key=value)`` with each tensor argument's dtype and shape."""
    args = [_describe(a) for a in node.args] + [f"{k}={_describe(v)}" for k, v in node.kwargs.items()]
    return f"{node.target}({', '.join(args)})"


def _message(e: BaseException) -> str:
    """torchair's message, without the traceback and node dump its error wrapper may add."""
    text = str(e).split("\n\nWhile executing")[0].split("\nTraceback (most recent call last)")[0].strip()
    return f"{type(e).__name__}: {text}"


def _compile_context(g: Graph) -> contextlib.AbstractContextManager:
    """What surrounds torchair's conversion when the executor runs: aot_autograd's tracing context (whose fake
    mode torchair's per-node pass takes), and the fake mode itself where a forward is compiled."""
    from torch._guards import TracingContext, detect_fake_mode, tracing

    stack = contextlib.ExitStack()
    fake_mode = detect_fake_mode(g.example_inputs)
    if fake_mode is not None:
        stack.enter_context(tracing(TracingContext(fake_mode)))
        if g.in_fake_mode:
            stack.enter_context(fake_mode)
    return stack


def _convert_one(torchair: Any, g: Graph) -> dict[str, Any]:
    from torchair import npu_fx_compiler  # noqa: PLC0415

    from npu_compile.lowering.npu import graph_modes  # noqa: PLC0415

    gm, inputs, mode = g.gm, g.example_inputs, g.graph_mode

    failing: list[torch.fx.Node] = []
    converter = npu_fx_compiler._NpuGraphConverter
    run_node = converter.run_node

    def recording(self, n):  # which node torchair was converting when it raised
        try:
            return run_node(self, n)
        except BaseException:
            if not failing:
                failing.append(n)
            raise

    settings = {}
    if mode == "aclgraph":
        # torchair's pattern passes switch on with torch_npu present (here the bare stub); their registration
        # needs npu ops npu-sim does not define (npu_dynamic_quant, ...)
        settings["experimental_config.pattern_fusion_pass"] = False
    converter.run_node = recording
    try:
        with _compile_context(g):
            compiled = graph_modes.torchair_compile(gm, inputs, graph_modes.GraphPlan(mode, mode), settings)
    except BaseException as e:  # noqa: BLE001  (any rejection is the verdict)
        where = f"{node_call(failing[0])}: " if failing else ""
        return {"status": FAILED, "detail": f"torchair rejects {where}{_message(e)}",
                "traceback": "".join(traceback.format_exception(e))[-4000:]}
    finally:
        converter.run_node = run_node
    runner = getattr(compiled, "runner", compiled)
    if mode == "ge":
        graph = runner.graph
        return {"status": CHECKED, "ge_text": str(graph), "ge_summary": summarize(graph),
                "ge_ops": [op.type for op in graph.op]}
    code = runner.codegen({}) if hasattr(runner, "codegen") else None
    return {"status": CHECKED, "aclgraph_code": code}


def _probe(op: torch._ops.OpOverload) -> str:
    """What torchair's converter for ``op`` says: "none" (no converter, so CANN would be asked), "rejects: <its
    message>" (it raises before looking at its arguments, as 1,402 of the wheel's aten/prims converters do), or
    "converts" (it got as far as reading its arguments)."""
    from torchair._ge_concrete_graph import fx2ge_converter  # noqa: PLC0415

    converter = getattr(op, "_ge_converter", None) or fx2ge_converter._CONVERTERS.get(op)
    if converter is None:
        return "none"
    params = [a for a in op._schema.arguments if not a.kwarg_only]
    try:
        converter(*[None] * len(params), meta_outputs=None)
    except (NotImplementedError, RuntimeError, ValueError) as e:
        if "ge_converter is not" in str(e):
            return f"rejects: {type(e).__name__}: {e}"
    except Exception:  # noqa: BLE001  (it read an argument: it converts something)
        pass
    return "converts"


_NUMPY = {"FLOAT": "<f4", "DOUBLE": "<f8", "INT32": "<i4", "INT64": "<i8", "BOOL": "?", "INT8": "i1", "UINT8": "u1"}


def _dtype(desc: Any) -> str:
    names = type(desc).DESCRIPTOR.fields_by_name["dtype"].enum_type.values_by_number
    return names[desc.dtype].name.removeprefix("DT_") if desc.dtype in names else str(desc.dtype)


def _attr(value: Any) -> str:
    kind = value.WhichOneof("value")
    if kind == "t":  # a Const's value: dtype, shape, and the numbers when there are few
        import numpy as np  # noqa: PLC0415

        dtype, dims = _dtype(value.t.desc), list(value.t.desc.shape.dim)
        data = value.t.data
        if dtype in _NUMPY and len(data) <= 64:
            return f"{dtype}{dims} {np.frombuffer(data, dtype=_NUMPY[dtype]).tolist()}"
        return f"{dtype}{dims} ({len(data)} bytes)"
    if kind == "list":
        items = [*value.list.s, *value.list.i, *value.list.f, *value.list.b]
        return "[" + ", ".join(v.decode() if isinstance(v, bytes) else f"{v:g}" if isinstance(v, float) else str(v)
                               for v in items) + "]"
    got = getattr(value, kind) if kind else None
    if isinstance(got, bytes):
        return repr(got.decode(errors="replace"))
    return f"{got:g}" if isinstance(got, float) else str(got)


def summarize(graph: Any) -> str:
    """A GE GraphDef one op per line: ``name = Type(input, ...) -> [output dtypes] {attr: value}``, with the
    shapes GE is given (its Data and NetOutput descriptors; inner ops' shapes GE infers on the device) and
    without torchair's bookkeeping attributes (those starting with ``_``)."""

    def desc(d: Any) -> str:
        dims = list(d.shape.dim)
        return f"{_dtype(d)}{dims if dims or d.shape.ByteSize() else ''}"

    lines = [f"graph {graph.name}"]
    for op in graph.op:
        inputs = ", ".join(i for i in op.input if i)
        attrs = ", ".join(f"{k}: {_attr(v)}" for k, v in sorted(op.attr.items()) if not k.startswith("_"))
        outs = ", ".join(desc(d) for d in op.output_desc) if op.type != "NetOutput" else ", ".join(
            desc(d) for d in op.input_desc)
        lines.append(f"{op.name} = {op.type}({inputs}) -> [{outs}]" + (f" {{{attrs}}}" if attrs else ""))
    return "\n".join(lines) + "\n"


def _child(conn: Any, root: str, items: list[Graph], probes: list[Any]) -> None:
    results: list[dict[str, Any]] = []
    try:
        sink = io.StringIO()
        with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
            torchair = _import_torchair(Path(root))
            from npu_compile.lowering.npu import ge_converters  # noqa: PLC0415

            ge_converters.register(torchair)
            _with_torch_npu_names(torchair)
            # ge graphs first, without torch_npu (with it, torchair's pattern passes would switch on and ask for
            # npu ops npu-sim does not define); then aclgraph's, which import it
            order = sorted(range(len(items)), key=lambda i: items[i].graph_mode == "aclgraph")
            answers: dict[int, dict[str, Any]] = {}
            for i in order:
                if items[i].graph_mode == "aclgraph" and "torch_npu" not in sys.modules:
                    sys.modules["torch_npu"] = stub = _torch_npu_stub()
                    torch.npu = stub.npu  # AclGraph.load asks torch.npu for a graph pool
                try:
                    answers[i] = _convert_one(torchair, items[i])
                except BaseException as e:  # noqa: BLE001
                    answers[i] = {"status": FAILED, "detail": f"the check itself failed: {_message(e)}"}
            results = [answers[i] for i in range(len(items))]
            probed = {str(op): _probe(op) for op in probes}
        conn.send((results, probed))
    except BaseException as e:  # noqa: BLE001
        conn.send({"error": f"{_message(e)}\n{traceback.format_exc()[-3000:]}"})
    finally:
        conn.close()


def check(graphs: Sequence[Graph], wheel_path: Path | None = None, timeout: float = 900) -> list[Verdict]:
    """torchair's conversion of each graph in the mode planned for it, all in one forked child.

    ``eager`` graphs are not converted (checked trivially: nothing of torchair runs them). Where the check
    cannot run, every graph is ``unchecked`` with the reason."""
    return run(graphs, (), wheel_path, timeout)[0]


def run(graphs: Sequence[Graph], probes: Sequence[torch._ops.OpOverload] = (), wheel_path: Path | None = None,
        timeout: float = 900) -> tuple[list[Verdict], dict[str, str] | str]:
    """:func:`check`, plus :func:`_probe` of each op in ``probes`` (torchair's converters asked directly), in the
    same child: (verdicts, {op: answer}, or the reason nothing could be asked)."""
    verdicts = [Verdict(g.name, g.graph_mode, CHECKED if g.graph_mode == "eager" else UNCHECKED) for g in graphs]
    todo = [(i, g) for i, g in enumerate(graphs) if g.graph_mode != "eager"]
    if not todo and not probes:
        return verdicts, {}
    path = wheel_path or wheel()
    reason = unavailable(path)
    if reason is None and "fork" not in multiprocessing.get_all_start_methods():
        reason = "this platform cannot fork, and the check needs the graphs as they are in this process"
    if reason is not None:
        for i, _ in todo:
            verdicts[i].detail = reason
        return verdicts, reason
    root = torchair_root(path)
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe(duplex=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork beside threads: the child touches none of them
        proc = ctx.Process(target=_child, args=(child, str(root), [g for _, g in todo], list(probes)),
                           daemon=True)
        proc.start()
    child.close()
    try:
        if not parent.poll(timeout):
            raise TimeoutError(f"torchair's conversion did not finish within {timeout:.0f} s")
        answer = parent.recv()
    except (EOFError, TimeoutError) as e:
        answer = {"error": f"the conversion process ended without an answer (exit code {proc.exitcode}): {e}"}
    finally:
        proc.join(5)
        if proc.is_alive():
            proc.kill()
            proc.join()
    if isinstance(answer, dict):  # the child could not set up torchair at all
        for i, _ in todo:
            verdicts[i].status, verdicts[i].detail = FAILED, f"torchair could not be set up: {answer['error']}"
        return verdicts, f"torchair could not be set up: {answer['error']}"
    results, probed = answer
    for (i, _), result in zip(todo, results):
        v = verdicts[i]
        v.status, v.detail = result["status"], result.get("detail", "")
        v.ge_text, v.ge_summary, v.ge_ops = result.get("ge_text"), result.get("ge_summary"), result.get("ge_ops", [])
        v.aclgraph_code = result.get("aclgraph_code")
    return verdicts, probed
