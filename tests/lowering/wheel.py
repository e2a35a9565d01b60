"""The real torch-npu 2.13.0 op schemas, read from the wheel as data, and a check that a call binds to one.

The wheel is never installed or imported: ``pip download --no-deps`` fetches it once into ``.cache/torch_npu/``
(git-ignored) and the yaml inside is read from the zip. ``NPU_COMPILE_TORCH_NPU_WHEEL`` may name a local copy
instead (machines without network). Without either, the tests fail and say how to fix it: a schema check that
quietly skips would prove nothing.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from filelock import FileLock

from npu_compile.lowering.npu.torchair_check import CACHE, VERSION, WHEEL, WHEEL_ENV

# One pinned wheel, whatever machine runs the tests: the schemas are the same in every platform's wheel. Where it
# is kept (and the torchair conversion check finds it): npu_compile/lowering/npu/torchair_check.py.
YAML_PATH = "torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml"


def wheel_path() -> Path:
    if os.environ.get(WHEEL_ENV):
        path = Path(os.environ[WHEEL_ENV])
        if not path.is_file():
            pytest.fail(f"{WHEEL_ENV}={path} is not a file; point it at a torch-npu {VERSION} wheel")
        return path
    path = CACHE / WHEEL
    if path.is_file():
        return path
    CACHE.mkdir(parents=True, exist_ok=True)
    with FileLock(str(CACHE / "download.lock")):  # make test's workers (pytest-xdist) fetch it once
        if not path.is_file():
            _download(path)
    return path


def _download(path: Path) -> None:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--platform", "manylinux_2_28_x86_64", "--python-version", "3.11", "--implementation", "cp",
           "--abi", "cp311", f"torch-npu=={VERSION}", "-d", str(CACHE)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if result.returncode != 0 or not path.is_file():
        pytest.fail(
            f"could not download the torch-npu {VERSION} wheel, whose op schemas this test checks against "
            f"({' '.join(cmd)} exited {result.returncode}: {result.stderr.strip()[-500:]}). With no network, "
            f"set {WHEEL_ENV} to a local copy of {WHEEL}.")


@functools.cache
def real_schemas() -> dict[str, dict[str, Any]]:
    """name -> the yaml entry (``func`` string, ``tags``, ...) of every op in the wheel's codegen yaml."""
    with zipfile.ZipFile(wheel_path()) as wheel:
        data = yaml.safe_load(wheel.read(YAML_PATH))
    entries = {}
    for section in data.values():
        if isinstance(section, list):
            for entry in section:
                if isinstance(entry, dict) and "func" in entry:
                    entries[entry["func"].split("(")[0]] = entry
    return entries


def real_schema(name: str) -> torch._C.FunctionSchema:
    return torch._C.parse_schema(real_schemas()[name]["func"])


def describe(schema: torch._C.FunctionSchema) -> dict[str, Any]:
    """Everything two schemas must agree on: name, overload, each argument's name, type, default and
    keyword-only flag, and the return types."""
    return {
        "name": schema.name.split("::")[-1],  # the yaml names no namespace; ours is npu::
        "overload": schema.overload_name,
        "arguments": [(a.name, str(a.type), repr(a.default_value) if a.has_default_value() else None, a.kwarg_only)
                      for a in schema.arguments],
        "returns": [str(r.type) for r in schema.returns],
    }


def _fits(value: Any, schema_type: torch._C.JitType) -> bool:
    """Whether a call's argument (an FX Node or a constant) can be of ``schema_type``."""
    if isinstance(schema_type, torch._C.OptionalType):
        return value is None or _fits(value, schema_type.getElementType())
    type_str = str(schema_type)
    if isinstance(value, torch.fx.Node):
        if type_str == "Tensor":
            return isinstance(value.meta.get("val"), torch.Tensor)
        # a host int read in the graph (the dropout seed) has no FakeTensor; a symbolic size is a SymInt node
        return type_str in ("int", "SymInt") and (value.target is torch.ops.aten._local_scalar_dense.default
                                                  or isinstance(value.meta.get("val"), torch.SymInt))
    if type_str == "List[Tensor]":  # npu_grouped_matmul's lists
        return isinstance(value, (list, tuple)) and all(
            isinstance(v, torch.fx.Node) and isinstance(v.meta.get("val"), torch.Tensor) for v in value)
    if type_str in ("List[int]", "List[SymInt]"):
        return isinstance(value, (list, tuple)) and all(
            _fits(v, torch._C.IntType.get()) if isinstance(v, torch.fx.Node) else
            isinstance(v, int) and not isinstance(v, bool) for v in value)
    expected = {"int": int, "float": (float, int), "bool": bool, "str": str, "ScalarType": torch.dtype}.get(type_str)
    if expected is None or (expected is int and isinstance(value, bool)):
        return False
    return isinstance(value, expected)


def binding_problems(name: str, args: tuple, kwargs: dict) -> list[str]:
    """How a call ``name(*args, **kwargs)`` fails to bind to the real schema (empty when it binds)."""
    schema = real_schema(name)
    positional = [a for a in schema.arguments if not a.kwarg_only]
    problems = []
    if len(args) > len(positional):
        problems.append(f"{len(args)} positional arguments, the schema takes {len(positional)}")
    bound = dict(zip((a.name for a in positional), args))
    for key, value in kwargs.items():
        if key in bound:
            problems.append(f"{key} given twice")
        bound[key] = value
    known = {a.name: a for a in schema.arguments}
    problems += [f"unknown argument {key!r}" for key in bound if key not in known]
    for arg in schema.arguments:
        if arg.name not in bound:
            if not arg.has_default_value():
                problems.append(f"required argument {arg.name!r} missing")
        elif not _fits(bound[arg.name], arg.type):
            problems.append(f"{arg.name}={bound[arg.name]!r} is not a {arg.type}")
    return problems


def npu_calls(*graphs: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """The ``npu::`` calls in ``graphs``."""
    return [n for gm in graphs for n in gm.graph.nodes
            if n.op == "call_function" and getattr(n.target, "namespace", None) == "npu"]


def assert_calls_bind(*graphs: torch.fx.GraphModule) -> None:
    calls = npu_calls(*graphs)
    assert calls, "no npu calls in these graphs"
    failures = [(n.format_node(), p) for n in calls
                if (p := binding_problems(n.target._schema.name.split("::")[1], n.args, n.kwargs))]
    assert not failures, f"calls that do not bind to torch-npu {VERSION}'s schemas: {failures}"
