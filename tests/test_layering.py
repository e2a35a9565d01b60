"""The house's floors, checked on the source: which room may import which, and where targets are named.

    device/    the ground floor: the device model; imports only itself, the attention layout table (ops/layout) and
               the region lookup (regions.py: which subgraph a call node runs), which imports nothing of ours
    comm/      collectives for every target: imports no target (lowering/) and no pass, names no target
    passes/    rules and aten passes: import no target
    backend    composes what the target object declares: names no target
"""

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "npu_compile"


def _modules(room: str) -> list[Path]:
    return sorted((PACKAGE / room).rglob("*.py"))


def _imports(path: Path) -> set[str]:
    """Every npu_compile module ``path`` imports, at any depth of the file (function-level imports too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return {m for m in found if m.startswith("npu_compile")}


@pytest.mark.parametrize("room", ["comm", "passes"])
def test_no_module_of_comm_or_passes_imports_a_target(room):
    offenders = {p.name: sorted(m for m in _imports(p) if m.startswith("npu_compile.lowering"))
                 for p in _modules(room)}
    assert {k: v for k, v in offenders.items() if v} == {}


def test_device_imports_nothing_above_it():
    allowed = re.compile(r"npu_compile\.device(\.|$)|npu_compile\.ops\.layout(\.|$)|npu_compile\.ops$|"
                         r"npu_compile\.regions$|npu_compile$")
    offenders = {p.name: sorted(m for m in _imports(p) if not allowed.match(m)) for p in _modules("device")}
    assert {k: v for k, v in offenders.items() if v} == {}
    assert _imports(PACKAGE / "regions.py") == set()  # the ground floor's own ground


def test_backend_and_comm_name_no_target():
    named = re.compile(r'npu-sim|"npu"')
    paths = [PACKAGE / "backend.py", *_modules("comm")]
    hits = [f"{p.relative_to(PACKAGE)}:{i}" for p in paths for i, line in enumerate(p.read_text().splitlines(), 1)
            if named.search(line)]
    assert hits == []


def test_the_check_sees_an_offender(tmp_path):
    """The import scan is not vacuous: a function-level import of a target is found."""
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from npu_compile.lowering.npu import mc2\n")
    assert "npu_compile.lowering.npu" in _imports(module)
