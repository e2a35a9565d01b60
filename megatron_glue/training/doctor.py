"""`npu-compile doctor`: what is installed, and whether it fits together; the job runs the same check at start.

Each component is read from its own records, never by importing it (torch_npu cannot be imported without CANN):
- Python: the running interpreter; torch, torch_npu, megatron-core, torchair: their distributions' metadata
  (`importlib.metadata`), torch_npu's pin of torch from its `Requires-Dist` (the 2.13.0 wheel: `torch==2.13.0.*`);
  torchair as torch_npu bundles it (`torch_npu/dynamo/torchair/` in the wheel) or a distribution of its own.
- CANN: the toolkit under `$ASCEND_HOME_PATH` (set by CANN's `set_env.sh`), else the default install path
  `/usr/local/Ascend/ascend-toolkit/latest` (torch_npu's README: `source /usr/local/Ascend/ascend-toolkit/set_env.sh`);
  its version from an `ascend_*_install.info` file there, the `version=` line, as torch_npu reads it itself
  (torch_npu 2.13.0 wheel, torch_npu/utils/collect_env.py:75-89, `get_cann_version`). HCCL: `lib64/libhccl.so`
  in that toolkit (what `import torch_npu` fails on without CANN).
- devices: Ascend NPUs on the PCI bus from sysfs (`megatron_glue.training.affinity`), so it says "none" here.
- the published torch_npu <-> torch <-> CANN table (`megatron_glue.training.compatibility`, with its source).

A finding is "ok", "warn" (worth knowing, the job runs) or "FAIL" (known not to work: the job stops at start with
that one line). FAIL is kept for what the sources say cannot work: torch_npu built for another torch, a CANN older
than the one the table pairs with the installed torch_npu, torch_npu without any CANN, megatron-core missing or
older than the lines the job speaks (0.12 on; megatron_glue/training/versions.py). A pairing the table does not
list (a newer CANN, a torch_npu the table does not have yet, megatron-core 0.13-0.15 or above 0.16) is a warn.
"""

from __future__ import annotations

import argparse
import importlib.metadata as metadata
import os
import platform
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

from megatron_glue.training import affinity, compatibility, hccl

DEFAULT_ASCEND_HOME = "/usr/local/Ascend/ascend-toolkit/latest"
MEGATRON_TESTED_LINES = ("0.12", "0.16")  # make test-mcore012, make test
MEGATRON_OLDEST = (0, 12)
# What the job reads from the environment besides HCCL's (docs/operating.md)
JOB_ENVIRONMENT = ("ASCEND_HOME_PATH", "ASCEND_OPP_PATH", "ASCEND_RT_VISIBLE_DEVICES", "CPU_AFFINITY_CONF",
                   "TORCH_DEVICE_BACKEND_AUTOLOAD", "NPU_COMPILE_CACHE_DIR", "NPU_COMPILE_DUMP_DIR",
                   "NPU_COMPILE_RANK_WATCHDOG_S")


@dataclass(frozen=True)
class Finding:
    what: str
    status: str            # "ok", "warn", "FAIL", "info"
    text: str
    npu_stack: bool = False  # about torch_npu / CANN: does not stop a job on --distributed-backend gloo

    def line(self) -> str:
        return f"{self.status:5s} {self.what:21s} {self.text}"


@dataclass
class Installation:
    python: str
    torch: str | None = None
    torch_npu: str | None = None
    torch_npu_requires_torch: str | None = None
    torch_npu_torchair: bool = False
    torchair: str | None = None
    megatron_core: str | None = None
    cann_home: str | None = None
    cann: str | None = None
    cann_file: str | None = None
    hccl_lib: str | None = None
    devices: list = field(default_factory=list)
    environ: dict = field(default_factory=dict)


def _normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _distributions(names, paths) -> dict:
    """{name: distribution} for those of `names` installed (the first found on the path, as import finds it)."""
    want, found = {_normalized(n): n for n in names}, {}
    for dist in (metadata.distributions(path=paths) if paths is not None else metadata.distributions()):
        name = want.get(_normalized(dist.metadata["Name"] or ""))
        if name is not None and name not in found:
            found[name] = dist
    return found


def read_cann_version(home: str) -> tuple[str | None, str | None]:
    """(version, file) from the toolkit's ascend_*_install.info (the toolkit's own first, two levels deep)."""
    base = Path(home)
    candidates = sorted(base.glob("ascend_*_install.info")) + sorted(base.glob("*/ascend_*_install.info"))
    candidates.sort(key=lambda p: p.name != "ascend_toolkit_install.info")
    for path in candidates:
        try:
            for raw in path.read_text(errors="replace").splitlines():
                key, _, value = raw.partition("=")
                if key.strip() == "version" and value.strip():
                    return value.strip(), str(path)
        except OSError:
            continue
    return None, None


def probe(environ=None, paths=None, sysfs_root: str = "/", default_ascend_home: str = DEFAULT_ASCEND_HOME
          ) -> Installation:
    """What is installed. `paths`: where to look for distributions (default sys.path); the rest injectable too,
    so that fake installations test it."""
    environ = dict(os.environ if environ is None else environ)
    inst = Installation(python=platform.python_version(), environ=environ)
    attrs = {"torch": "torch", "torch_npu": "torch_npu", "megatron-core": "megatron_core", "torchair": "torchair"}
    for name, dist in _distributions(attrs, paths).items():
        setattr(inst, attrs[name], dist.version)
        if name == "torch_npu":
            pins = [r for r in (dist.requires or []) if re.match(r"torch\s*[=<>~!]", r)]
            inst.torch_npu_requires_torch = pins[0].replace(" ", "") if pins else None
            inst.torch_npu_torchair = any(str(f).startswith("torch_npu/dynamo/torchair/") for f in dist.files or [])
    home = environ.get("ASCEND_HOME_PATH") or default_ascend_home
    if Path(home).is_dir():
        inst.cann_home = home
        inst.cann, inst.cann_file = read_cann_version(home)
        lib = Path(home, "lib64", "libhccl.so")
        inst.hccl_lib = str(lib) if lib.exists() else None
    inst.devices = affinity.ascend_devices(sysfs_root)
    return inst


def _line(version: str) -> str:
    return ".".join(version.split(".")[:2])


def _check_torch(inst: Installation) -> list[Finding]:
    if inst.torch is None:
        return [Finding("torch", "FAIL", "torch is not installed: pip install torch==2.13.0 (the release torch_npu "
                                         "2.13.0 is built for)")]
    out = [Finding("torch", "ok", inst.torch)]
    if inst.torch_npu is None:
        return out
    from packaging.requirements import Requirement

    if inst.torch_npu_requires_torch:
        spec = Requirement(inst.torch_npu_requires_torch).specifier
        if not spec.contains(inst.torch, prereleases=True):
            out = [Finding("torch", "FAIL", f"torch_npu {inst.torch_npu} is built for {inst.torch_npu_requires_torch},"
                                            f" but torch {inst.torch} is installed: pip install "
                                            f"'{inst.torch_npu_requires_torch}'", npu_stack=True)]
    return out


def _check_python(inst: Installation) -> list[Finding]:
    if inst.torch is None:
        return [Finding("python", "ok", inst.python)]
    line = _line(inst.torch.split("+")[0])
    pythons = compatibility.PYTHON_FOR_TORCH.get(line)
    if pythons is not None and _line(inst.python) not in pythons:
        return [Finding("python", "warn", f"{inst.python}: torch_npu publishes torch {line} wheels for Python "
                                          f"{', '.join(pythons)} ({compatibility.SOURCE})")]
    return [Finding("python", "ok", inst.python)]


def _check_npu_stack(inst: Installation) -> list[Finding]:
    out = []
    if inst.torch_npu is None:
        out.append(Finding("torch_npu", "info", "not installed: the job runs on the CPU (gloo); for an Ascend NPU, "
                                                "install CANN, then pip install 'npu_compile[npu]' (torch-npu==2.13.0)"))
    else:
        out.append(Finding("torch_npu", "ok", f"{inst.torch_npu} (built for {inst.torch_npu_requires_torch or '?'})"))
    home = inst.environ.get("ASCEND_HOME_PATH")
    where = f"ASCEND_HOME_PATH={home} does not exist" if home else f"ASCEND_HOME_PATH unset, {DEFAULT_ASCEND_HOME} absent"
    if inst.cann_home is None:
        if inst.torch_npu is not None:
            needed = compatibility.cann_for(inst.torch_npu)
            out.append(Finding("CANN", "FAIL", f"torch_npu {inst.torch_npu} is installed but no CANN toolkit is "
                                               f"({where}): install CANN{' ' + needed if needed else ''} and source "
                                               "/usr/local/Ascend/ascend-toolkit/set_env.sh", npu_stack=True))
        else:
            out.append(Finding("CANN", "info", f"no toolkit ({where})"))
        return out
    if inst.torch_npu is not None and home and not inst.environ.get("ASCEND_OPP_PATH"):
        # torch_npu stops at import when ASCEND_HOME_PATH is set without ASCEND_OPP_PATH (2.13.0 wheel,
        # torch_npu/_init/registry/registry_manager.py:28-32)
        out.append(Finding("ASCEND_OPP_PATH", "FAIL", "ASCEND_HOME_PATH is set but ASCEND_OPP_PATH is not, and "
                                                      "torch_npu stops at import without it: source "
                                                      f"{Path(home).parent / 'set_env.sh'}", npu_stack=True))
    if inst.cann is None:
        out.append(Finding("CANN", "warn", f"toolkit at {inst.cann_home} has no ascend_*_install.info with a "
                                           "version= line: its version cannot be checked", npu_stack=True))
    else:
        out.extend(_check_cann_pairing(inst))
    if inst.hccl_lib is None:
        out.append(Finding("HCCL", "warn", f"no lib64/libhccl.so under {inst.cann_home}: torch_npu cannot load "
                                           "HCCL; reinstall the CANN toolkit", npu_stack=True))
    else:
        out.append(Finding("HCCL", "ok", inst.hccl_lib))
    return out


def _check_cann_pairing(inst: Installation) -> list[Finding]:
    cann = inst.cann
    try:
        compatibility.cann_key(cann)
    except ValueError as e:
        return [Finding("CANN", "warn", f"{inst.cann_file}: {e}", npu_stack=True)]
    if inst.torch_npu is None:
        return [Finding("CANN", "ok", f"{cann} ({inst.cann_file})")]
    needed = compatibility.cann_for(inst.torch_npu)
    if needed is None:
        return [Finding("CANN", "warn", f"{cann}: torch_npu {inst.torch_npu} is not in the published table "
                                        f"({compatibility.SOURCE}); the pairing cannot be checked", npu_stack=True)]
    key, need = compatibility.cann_key(cann), compatibility.cann_key(needed)
    if key < need:
        line = _line(inst.torch_npu)
        fits = compatibility.torch_npu_for(cann, line)
        instead = f", or pip install torch-npu=={fits[-1]} (the torch {line} release for CANN {cann})" if fits else ""
        return [Finding("CANN", "FAIL", f"CANN {cann} is older than torch_npu {inst.torch_npu} is released for "
                                        f"(CANN {needed}, {compatibility.SOURCE}): install CANN {needed}{instead}",
                        npu_stack=True)]
    if key > need:
        return [Finding("CANN", "warn", f"{cann}: newer than CANN {needed}, the release torch_npu {inst.torch_npu} "
                                        "is published for; the pairing is not in the table", npu_stack=True)]
    return [Finding("CANN", "ok", f"{cann} (the release torch_npu {inst.torch_npu} is published for)")]


def _check_torchair(inst: Installation) -> list[Finding]:
    if inst.torchair is not None:
        return [Finding("torchair", "ok", inst.torchair)]
    if inst.torch_npu_torchair:
        return [Finding("torchair", "ok", f"bundled with torch_npu {inst.torch_npu} (torch_npu/dynamo/torchair)")]
    return [Finding("torchair", "info", "not installed (it comes with torch_npu); graph modes ge/aclgraph need it "
                                        "on an NPU")]


def _check_megatron(inst: Installation) -> list[Finding]:
    version = inst.megatron_core
    if version is None:
        return [Finding("megatron-core", "FAIL", "megatron-core is not installed: pip install 'npu_compile[megatron]'"
                                                 " (megatron-core==0.16.1)")]
    nums = tuple(int(x) for x in re.findall(r"\d+", version)[:2])
    line = _line(version)
    if nums < MEGATRON_OLDEST:
        return [Finding("megatron-core", "FAIL", f"megatron-core {version} is older than the lines the job speaks "
                                                 "(0.12 on, tested: 0.12.1 and 0.16.1): pip install "
                                                 "megatron-core==0.16.1")]
    if line not in MEGATRON_TESTED_LINES:
        return [Finding("megatron-core", "warn", f"{version}: between or after the tested lines (0.12.1, 0.16.1); "
                                                 "pip install megatron-core==0.16.1 for a tested one")]
    return [Finding("megatron-core", "ok", f"{version} (the {line} line)")]


def _check_devices(inst: Installation) -> list[Finding]:
    if not inst.devices:
        return [Finding("devices", "info", "no Ascend NPU on this machine (no Huawei processing accelerator on the "
                                           "PCI bus): the job runs on the CPU with gloo")]
    kinds = sorted({f"19e5:{d.device_id:04x}" for d in inst.devices})
    nodes = sorted({d.numa_node for d in inst.devices})
    return [Finding("devices", "ok", f"{len(inst.devices)} Ascend NPU(s), PCI id {', '.join(kinds)}, NUMA node(s) "
                                     f"{', '.join(map(str, nodes))}")]


def _check_environment(inst: Installation) -> list[Finding]:
    out = []
    env = inst.environ
    for name, (what, _source) in hccl.OWNED.items():
        value = env.get(name)
        if value is None:
            when = ("when a tensor-parallel collective needs more than the default" if name == "HCCL_BUFFSIZE"
                    else "from --distributed-timeout-minutes")
            out.append(Finding(name, "ok", f"unset: the job sets it {when} ({what})"))
            continue
        bounds = {"HCCL_CONNECT_TIMEOUT": hccl.CONNECT_TIMEOUT_RANGE, "HCCL_EXEC_TIMEOUT": hccl.EXEC_TIMEOUT_RANGE,
                  "HCCL_BUFFSIZE": (1, None)}[name]
        if not value.strip().isdigit():
            out.append(Finding(name, "FAIL", f"{name}={value!r} is not an integer ({what}): unset it or give a "
                                             "number"))
        elif int(value) < bounds[0] or (bounds[1] is not None and int(value) > bounds[1]):
            out.append(Finding(name, "warn", f"{value} is outside {list(bounds)} ({what}): outside the range CANN documents"))
        else:
            out.append(Finding(name, "ok", f"{value} (the user's; the job keeps it)"))
    for name in hccl.REPORTED:
        if env.get(name):
            out.append(Finding(name, "ok", f"{env[name]} (the user's)"))
    if env.get("HCCL_ASYNC_ERROR_HANDLING"):
        out.append(Finding("HCCL_ASYNC_ERROR_HANDLING", "warn", "deprecated in torch_npu: set "
                                                               "TORCH_HCCL_ASYNC_ERROR_HANDLING instead"))
    for name in JOB_ENVIRONMENT:
        if env.get(name):
            out.append(Finding(name, "ok", env[name]))
    return out


# Asked of torch_npu in a child process (an import that fails or hangs without CANN stays there): the names are
# torch_npu's own (2.13.0 wheel, torch_npu/npu/__init__.py:492 device_count, :535 get_device_name).
_ASK_TORCH_NPU = ("import torch_npu\n"
                  "n = torch_npu.npu.device_count()\n"
                  "print(n, torch_npu.npu.get_device_name(0) if n else '-')\n")


def ask_torch_npu(python: str = sys.executable, environ=None, timeout: float = 120) -> Finding:
    """What torch_npu itself sees: its device count and the first device's name, or why it cannot say."""
    import subprocess

    env = dict(os.environ if environ is None else environ)
    try:
        done = subprocess.run([python, "-c", _ASK_TORCH_NPU], capture_output=True, text=True, timeout=timeout,
                              env=env)
    except subprocess.TimeoutExpired:
        return Finding("torch_npu sees", "FAIL", f"import torch_npu did not finish in {timeout:.0f} s", npu_stack=True)
    if done.returncode != 0:
        errors = [line for line in done.stderr.strip().splitlines() if line.strip()]
        last = errors[-1] if errors else f"exit status {done.returncode}"
        return Finding("torch_npu sees", "FAIL", f"torch_npu cannot be imported ({last}): source "
                                                 "/usr/local/Ascend/ascend-toolkit/set_env.sh, or install the CANN "
                                                 "release its table names", npu_stack=True)
    count, _, name = done.stdout.strip().splitlines()[-1].partition(" ")
    if count == "0":
        return Finding("torch_npu sees", "warn", "no NPU (torch_npu.npu.device_count() is 0): check the driver "
                                                 "(npu-smi info) and ASCEND_RT_VISIBLE_DEVICES", npu_stack=True)
    return Finding("torch_npu sees", "ok", f"{count} NPU(s), {name}")


def diagnose(inst: Installation) -> list[Finding]:
    return (_check_python(inst) + _check_torch(inst) + _check_npu_stack(inst) + _check_torchair(inst)
            + _check_megatron(inst) + _check_devices(inst) + _check_environment(inst))


def check_at_start(backend: str, environ=None, **probe_kwargs) -> str | None:
    """The job's check: the first FAIL that concerns this job as one line, or None. On gloo the NPU stack is not
    used, so its findings do not stop the job."""
    for finding in diagnose(probe(environ, **probe_kwargs)):
        if finding.status == "FAIL" and not (backend == "gloo" and finding.npu_stack):
            return f"pretrain_gpt: error: {finding.text} (npu-compile doctor shows the whole installation)"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="npu-compile doctor", description=__doc__.splitlines()[0])
    parser.add_argument("--sysfs-root", default="/", help="where sysfs is mounted (default /)")
    args = parser.parse_args(argv)
    inst = probe(sysfs_root=args.sysfs_root)
    findings = diagnose(inst)
    if inst.torch_npu is not None and inst.cann is not None:
        findings.append(ask_torch_npu())
    for finding in findings:
        print(finding.line())
    failed = [f for f in findings if f.status == "FAIL"]
    print(f"{len(failed)} problem(s)" if failed else "nothing known not to work")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
