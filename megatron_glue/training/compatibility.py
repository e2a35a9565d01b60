"""Which torch_npu goes with which torch and CANN, as Ascend publishes it: data for `npu-compile doctor`.

Source: Ascend/pytorch `COMPATIBILITY.en.md` at commit 9e73e708ab9350d203475609f36f8a43f6a0c2ab (2026-08-21),
"TorchNPU version mapping table" (lines 18-46) and its historical table (lines 50-87): each torch_npu package
version with the PyTorch version it is built for and the one CANN version it is released for; and "PyTorch and
Python versions" (lines 93-106). The same README text ships in each torch_npu wheel's METADATA (the 2.13.0 wheel's
"Ascend Auxiliary Software" table stops at 2.12.0rc1 / CANN 8.5.0). torch_npu 2.13.0, the version this project
pins, is not in either table yet: the doctor says so rather than guess.
"""

from __future__ import annotations

import re

SOURCE = ("Ascend/pytorch COMPATIBILITY.en.md (commit 9e73e70, https://github.com/Ascend/pytorch/blob/"
          "9e73e708ab9350d203475609f36f8a43f6a0c2ab/COMPATIBILITY.en.md)")

# (torch_npu package version, PyTorch version, CANN version), in the table's order
TORCH_NPU_RELEASES: tuple[tuple[str, str, str], ...] = (
    ("2.12.0", "2.12.0", "9.1.0"),
    ("2.11.0", "2.11.0", "9.1.0"),
    ("2.10.0.post4", "2.10.0", "9.1.0"),
    ("2.9.0.post6", "2.9.0", "9.1.0"),
    ("2.7.1.post8", "2.7.1", "9.1.0"),
    ("2.9.0.post2", "2.9.0", "9.0.0"),
    ("2.8.0.post4", "2.8.0", "9.0.0"),
    ("2.7.1.post4", "2.7.1", "9.0.0"),
    ("2.9.0", "2.9.0", "8.5.0"),
    ("2.8.0.post2", "2.8.0", "8.5.0"),
    ("2.7.1.post2", "2.7.1", "8.5.0"),
    ("2.6.0.post5", "2.6.0", "8.5.0"),
    ("2.8.0", "2.8.0", "8.3.RC1"),
    ("2.7.1", "2.7.1", "8.3.RC1"),
    ("2.6.0.post3", "2.6.0", "8.3.RC1"),
    ("2.1.0.post17", "2.1.0", "8.3.RC1"),
    ("2.6.0", "2.6.0", "8.2.RC1"),
    ("2.5.1.post1", "2.5.1", "8.2.RC1"),
    ("2.1.0.post13", "2.1.0", "8.2.RC1"),
    ("2.5.1", "2.5.1", "8.1.RC1"),
    ("2.4.0.post4", "2.4.0", "8.1.RC1"),
    ("2.3.1.post6", "2.3.1", "8.1.RC1"),
    ("2.1.0.post12", "2.1.0", "8.1.RC1"),
    ("2.4.0.post2", "2.4.0", "8.0.0"),
    ("2.3.1.post4", "2.3.1", "8.0.0"),
    ("2.1.0.post10", "2.1.0", "8.0.0"),
    ("2.4.0", "2.4.0", "8.0.RC3"),
    ("2.3.1.post2", "2.3.1", "8.0.RC3"),
    ("2.1.0.post8", "2.1.0", "8.0.RC3"),
    ("2.3.1", "2.3.1", "8.0.RC2"),
    ("2.2.0.post2", "2.2.0", "8.0.RC2"),
    ("2.1.0.post6", "2.1.0", "8.0.RC2"),
    ("1.11.0.post14", "1.11.0", "8.0.RC2"),
    ("2.2.0", "2.2.0", "8.0.RC1"),
    ("2.1.0.post4", "2.1.0", "8.0.RC1"),
    ("1.11.0.post11", "1.11.0", "8.0.RC1"),
    ("2.1.0", "2.1.0", "7.0.0"),
    ("2.0.1.post1", "2.0.1", "7.0.0"),
    ("1.11.0.post8", "1.11.0", "7.0.0"),
    ("2.1.0.rc1", "2.1.0", "7.0.RC1"),
    ("2.0.1", "2.0.1", "7.0.RC1"),
    ("1.11.0.post4", "1.11.0", "7.0.RC1"),
    ("1.11.0.post3", "1.11.0", "6.3.RC3.1"),
    ("1.11.0.post2", "1.11.0", "6.3.RC3"),
    ("2.0.1.rc1", "2.0.1", "6.3.RC2"),
    ("1.11.0.post1", "1.11.0", "6.3.RC2"),
    ("1.8.1.post2", "1.8.1", "6.3.RC2"),
    ("1.11.0", "1.11.0", "6.3.RC1"),
    ("1.8.1.post1", "1.8.1", "6.3.RC1"),
    ("1.5.0.post8", "1.5.0", "6.0.1"),
    ("1.8.1", "1.8.1", "6.0.1"),
    ("1.11.0.rc2", "1.11.0", "6.0.1"),
    ("1.5.0.post7", "1.5.0", "6.0.RC1"),
    ("1.8.1.rc3", "1.8.1", "6.0.RC1"),
    ("1.11.0.rc1", "1.11.0", "6.0.RC1"),
    ("1.5.0.post6", "1.5.0", "5.1.RC2"),
    ("1.8.1.rc2", "1.8.1", "5.1.RC2"),
    ("1.5.0.post5", "1.5.0", "5.1.RC1"),
    ("1.8.1.rc1", "1.8.1", "5.1.RC1"),
    ("1.5.0.post4", "1.5.0", "5.0.4"),
    ("1.5.0.post3", "1.8.1", "5.0.3"),
    ("1.5.0.post2", "1.5.0", "5.0.2"),
)

# PyTorch line -> the Python minor versions torch_npu publishes wheels for ("PyTorch and Python versions")
PYTHON_FOR_TORCH: dict[str, tuple[str, ...]] = {
    "2.13": ("3.10", "3.11", "3.12", "3.13", "3.14"),
    "2.12": ("3.10", "3.11", "3.12", "3.13", "3.14"),
    "2.11": ("3.10", "3.11", "3.12", "3.13", "3.14"),
    "2.10": ("3.10", "3.11", "3.12", "3.13"),
    "2.9": ("3.10", "3.11", "3.12", "3.13"),
    "2.8": ("3.9", "3.10", "3.11", "3.12", "3.13"),
    "2.7": ("3.9", "3.10", "3.11", "3.12", "3.13"),
    "2.6": ("3.9", "3.10", "3.11"),
    "2.5": ("3.9", "3.10", "3.11"),
    "2.4": ("3.8", "3.9", "3.10", "3.11"),
    "2.3": ("3.8", "3.9", "3.10", "3.11"),
    "2.2": ("3.8", "3.9", "3.10"),
    "2.1": ("3.8", "3.9", "3.10", "3.11"),
    "1.11": ("3.7", "3.8", "3.9", "3.10"),
}


def cann_key(version: str) -> tuple:
    """Order of CANN versions: 8.0.RC1 < 8.0.RC2 < 8.0.RC3 < 8.0.0 < 8.0.1 < 8.1.RC1; 6.3.RC3 < 6.3.RC3.1;
    8.5.0.alpha003 < 8.5.0 (a pre-release of it). ValueError on anything else."""
    m = re.fullmatch(r"(\d+)\.(\d+)\.(?:RC(\d+)|(\d+))(?:\.(?:(alpha|beta)(\d+)|(\d+)))?", version.strip(), re.I)
    if m is None:
        raise ValueError(f"{version!r} is not a CANN version (like 8.0.RC2, 8.5.0 or 9.1.0)")
    major, minor, rc, patch, pre, pre_n, post = m.groups()
    third = (0, int(rc)) if rc is not None else (1, int(patch))
    tail = (0, int(pre_n)) if pre else (1, int(post or 0))
    return (int(major), int(minor), third, tail)


def cann_for(torch_npu_version: str) -> str | None:
    """The CANN release the published table pairs with this torch_npu package version (a local build label,
    "+git...", ignored); None when not listed."""
    version = torch_npu_version.split("+")[0]
    for npu, _torch, cann in TORCH_NPU_RELEASES:
        if npu == version:
            return cann
    return None


def torch_npu_for(cann_version: str, torch_line: str) -> list[str]:
    """torch_npu package versions the table lists for this CANN release and PyTorch line ("2.9")."""
    return [npu for npu, torch, cann in TORCH_NPU_RELEASES
            if cann == cann_version and torch.rsplit(".", 1)[0] == torch_line]
