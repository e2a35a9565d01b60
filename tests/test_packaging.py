"""Installing the package prints nothing of ours: setuptools builds its metadata without a deprecation warning."""

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_metadata_builds_without_warnings(tmp_path):
    """What `pip install` runs first (PEP 517 prepare_metadata_for_build_wheel), on a copy of the project's
    pyproject.toml; every warning shown, none from our configuration."""
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    shutil.copy(ROOT / "README.md", tmp_path)
    for package in ("npu_compile", "megatron_glue"):
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
    out = tmp_path / "metadata"
    out.mkdir()
    code = ("import sys; from setuptools import build_meta; "
            "print(build_meta.prepare_metadata_for_build_wheel(sys.argv[1]))")
    run = subprocess.run([sys.executable, "-W", "always", "-c", code, str(out)], cwd=tmp_path, capture_output=True,
                         text=True, check=True)
    assert not re.search(r"warn|deprecat", run.stderr, re.IGNORECASE), run.stderr
    metadata = (out / run.stdout.split()[-1] / "METADATA").read_text()
    assert "License-Expression: Apache-2.0" in metadata


def test_build_system_has_a_setuptools_that_takes_an_spdx_license():
    """A `license` string is an SPDX expression from setuptools 77 on (PEP 639); older ones refuse it."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    build = tomllib.loads((ROOT / "pyproject.toml").read_text())["build-system"]["requires"]
    (floor,) = [int(m.group(1)) for r in build if (m := re.fullmatch(r"setuptools>=(\d+)(\.\d+)*", r))]
    assert floor >= 77
