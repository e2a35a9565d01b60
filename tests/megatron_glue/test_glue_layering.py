"""megatron_glue's rooms, checked on the source: which room may import which, and no reach into private names.

    capture/    what makes megatron-core capturable (the one adaptation registry, multi-process set-up, small
                models, layer capture, test fixtures): imports no other room
    data/       tokenizers, datasets, preprocessing, the demo corpus: imports capture only
    training/   the training job: imports capture and data, never the converter
    convert/    HF <-> Megatron checkpoints of the job's model: imports capture, data and the job (its argument
                surface, model provider and checkpoint layout)

Above the rooms stand the package's face (`__init__.py`: adapt, compile_layers, quiet_megatron), its doors (the modules run with
`-m`: pretrain_gpt, posttrain_gpt, demo) and the two paths the README documents (adaptations, distributed); they may
import any room, no room imports them. Every other module lives in a room. No module takes a private name (`_x`) of another
module of the package, by `from ... import _x` or by `module._x`.
"""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "megatron_glue"

MAY_IMPORT = {
    "capture": {"capture"},
    "data": {"capture", "data"},
    "training": {"capture", "data", "training"},
    "convert": {"capture", "data", "training", "convert"},
}
TOP = {"__init__.py", "pretrain_gpt.py", "posttrain_gpt.py", "demo.py", "adaptations.py", "distributed.py"}


def _imports(path: Path) -> list[ast.stmt]:
    """Every import statement of ``path`` that names megatron_glue, at any depth (function-level imports too)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "megatron_glue" for a in node.names):
            found.append(node)
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "megatron_glue":
            found.append(node)
    return found


def _imported_modules(path: Path) -> set[str]:
    names = set()
    for node in _imports(path):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        else:
            names |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return {n for n in names if n.startswith("megatron_glue")}


def _room_of(module: str, package: Path) -> str | None:
    """The room a dotted name lies in; None for the package's face or a top-level module."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and (package / parts[1]).is_dir() else None


def room_violations(package: Path) -> dict[str, list[str]]:
    """module path -> the megatron_glue modules it imports that its room may not."""
    out = {}
    for room, allowed in MAY_IMPORT.items():
        for path in sorted((package / room).rglob("*.py")):
            bad = sorted(m for m in _imported_modules(path) if _room_of(m, package) not in allowed)
            if bad:
                out[str(path.relative_to(package))] = bad
    return out


def private_reaches(package: Path) -> dict[str, list[str]]:
    """module path -> the private names of other megatron_glue modules it takes."""
    out = {}
    for path in sorted(package.rglob("*.py")):
        tree = ast.parse(path.read_text())
        modules = {}  # local name -> megatron_glue module it stands for
        bad = []
        for node in _imports(path):
            if isinstance(node, ast.ImportFrom):
                for a in node.names:
                    if a.name.startswith("_"):
                        bad.append(f"{node.module}.{a.name}")
                    dotted = f"{node.module}.{a.name}"
                    if (package.parent / (dotted.replace(".", "/") + ".py")).exists() or \
                            (package.parent / dotted.replace(".", "/")).is_dir():
                        modules[a.asname or a.name] = dotted
            else:
                for a in node.names:
                    if a.asname:
                        modules[a.asname] = a.name
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules
                    and node.attr.startswith("_") and not node.attr.startswith("__")):
                bad.append(f"{modules[node.value.id]}.{node.attr}")
        if bad:
            out[str(path.relative_to(package))] = sorted(set(bad))
    return out


def test_each_room_imports_only_the_rooms_below_it():
    assert room_violations(PACKAGE) == {}


def test_no_module_takes_another_modules_private_names():
    assert private_reaches(PACKAGE) == {}


def test_every_module_lives_in_a_room():
    """Top level: the face, the doors and the documented paths only; the rooms are the ones the rules name."""
    assert {p.name for p in PACKAGE.glob("*.py")} == TOP
    assert {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()} == set(MAY_IMPORT)


def test_the_documented_paths_are_the_capture_rooms_modules():
    """`megatron_glue.adaptations` and `megatron_glue.distributed` (README) are those modules, not copies: one
    registry, one watchdog state."""
    import megatron_glue.adaptations
    import megatron_glue.capture.adaptations
    import megatron_glue.capture.distributed
    import megatron_glue.distributed
    from megatron_glue.adaptations import registry

    assert megatron_glue.adaptations is megatron_glue.capture.adaptations
    assert megatron_glue.distributed is megatron_glue.capture.distributed
    assert registry is megatron_glue.capture.adaptations.registry


def test_the_check_sees_an_offender(tmp_path):
    """The rules are not vacuous: a function-level import of the job from data, an import of the face from a room,
    and a private name reached through a module are each found."""
    package = tmp_path / "megatron_glue"
    for room in MAY_IMPORT:
        (package / room).mkdir(parents=True)
        (package / room / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "training" / "arguments.py").write_text("def _hidden():\n    pass\n")
    (package / "data" / "datasets.py").write_text(
        "def f():\n    from megatron_glue.training import arguments\n    return arguments._hidden()\n")
    (package / "capture" / "models.py").write_text("from megatron_glue import adapt\n")
    (package / "convert" / "core.py").write_text("from megatron_glue.training import arguments\n")
    assert room_violations(package) == {
        "capture/models.py": ["megatron_glue", "megatron_glue.adapt"],
        "data/datasets.py": ["megatron_glue.training", "megatron_glue.training.arguments"],
    }
    assert private_reaches(package) == {"data/datasets.py": ["megatron_glue.training.arguments._hidden"]}
