"""`npu-compile doctor` on fake installations (dist-info metadata, a CANN toolkit tree, no devices) and on this
machine; the job's check at start."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_glue.training import compatibility, doctor

pytestmark = pytest.mark.any_megatron_line


def _dist(site: Path, name: str, version: str, requires=(), files=()):
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    lines = ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}"]
    lines += [f"Requires-Dist: {r}" for r in requires]
    (info / "METADATA").write_text("\n".join(lines) + "\n")
    (info / "RECORD").write_text("".join(f"{f},,\n" for f in files))


def _cann(root: Path, version: str, hccl: bool = True) -> Path:
    home = root / "Ascend" / "ascend-toolkit" / "latest"
    (home / "x86_64-linux").mkdir(parents=True)
    # the layout of a toolkit's install record: package, version, then an inner version that also says "version"
    (home / "x86_64-linux" / "ascend_toolkit_install.info").write_text(
        f"package_name=Ascend-cann-toolkit\nversion={version}\ninnerversion=V100R001C00SPC001B001\narch=x86_64\n")
    if hccl:
        (home / "lib64").mkdir()
        (home / "lib64" / "libhccl.so").write_bytes(b"")
    return home


def _install(tmp_path, *, torch="2.13.0", torch_npu=None, npu_pin=None, megatron="0.16.1", cann=None):
    site = tmp_path / "site"
    site.mkdir(parents=True)
    if torch:
        _dist(site, "torch", torch)
    if torch_npu:
        _dist(site, "torch_npu", torch_npu, requires=[f"torch=={npu_pin}", "numpy"],
              files=["torch_npu/__init__.py", "torch_npu/dynamo/torchair/__init__.py"])
    if megatron:
        _dist(site, "megatron-core", megatron)
    environ = {}
    if cann:
        environ["ASCEND_HOME_PATH"] = str(_cann(tmp_path, cann))
        environ["ASCEND_OPP_PATH"] = environ["ASCEND_HOME_PATH"] + "/opp"  # as set_env.sh sets both
    (tmp_path / "sys").mkdir()  # an empty sysfs: no devices
    return dict(environ=environ, paths=[str(site)], sysfs_root=str(tmp_path),
                default_ascend_home=str(tmp_path / "absent"))


def _findings(**kw):
    return {f.what: f for f in doctor.diagnose(doctor.probe(**kw))}


def test_torch_npu_built_for_another_torch(tmp_path):
    found = _findings(**_install(tmp_path, torch="2.12.0", torch_npu="2.13.0", npu_pin="2.13.0.*", cann="9.1.0"))
    assert found["torch"].status == "FAIL"
    assert found["torch"].text == ("torch_npu 2.13.0 is built for torch==2.13.0.*, but torch 2.12.0 is installed: "
                                   "pip install 'torch==2.13.0.*'")
    # torch_npu 2.13.0 is not in the published table yet: said, not guessed
    assert found["CANN"].status == "warn"
    assert found["CANN"].text == (f"9.1.0: torch_npu 2.13.0 is not in the published table ({compatibility.SOURCE}); "
                                  "the pairing cannot be checked")


def test_cann_too_old_for_torch_npu(tmp_path):
    found = _findings(**_install(tmp_path, torch="2.9.0", torch_npu="2.9.0.post6", npu_pin="2.9.0", cann="8.5.0"))
    assert found["CANN"].status == "FAIL"
    assert found["CANN"].text == (
        f"CANN 8.5.0 is older than torch_npu 2.9.0.post6 is released for (CANN 9.1.0, {compatibility.SOURCE}): "
        "install CANN 9.1.0, or pip install torch-npu==2.9.0 (the torch 2.9 release for CANN 8.5.0)")
    assert found["torch"].status == "ok"


def test_megatron_core_outside_the_lines(tmp_path):
    found = _findings(**_install(tmp_path, megatron="0.11.0"))
    assert found["megatron-core"].line() == (
        "FAIL  megatron-core         megatron-core 0.11.0 is older than the lines the job speaks (0.12 on, tested: "
        "0.12.1 and 0.16.1): pip install megatron-core==0.16.1")
    assert _findings(**_install(tmp_path / "b", megatron="0.14.0"))["megatron-core"].status == "warn"
    assert _findings(**_install(tmp_path / "c", megatron="0.12.1"))["megatron-core"].status == "ok"


def test_a_fitting_installation(tmp_path):
    found = _findings(**_install(tmp_path, torch="2.9.0", torch_npu="2.9.0.post6", npu_pin="2.9.0", cann="9.1.0"))
    assert {f.status for f in found.values()} <= {"ok", "info"}
    assert found["CANN"].text == "9.1.0 (the release torch_npu 2.9.0.post6 is published for)"
    assert found["torchair"].text == "bundled with torch_npu 2.9.0.post6 (torch_npu/dynamo/torchair)"
    assert found["HCCL"].status == "ok"
    assert found["devices"].status == "info"


def test_torch_npu_without_cann_and_a_toolkit_without_hccl(tmp_path):
    found = _findings(**_install(tmp_path, torch="2.9.0", torch_npu="2.9.0.post6", npu_pin="2.9.0"))
    assert found["CANN"].text == (
        f"torch_npu 2.9.0.post6 is installed but no CANN toolkit is (ASCEND_HOME_PATH unset, "
        f"{doctor.DEFAULT_ASCEND_HOME} absent): install CANN 9.1.0 and source /usr/local/Ascend/ascend-toolkit/set_env.sh")
    kw = _install(tmp_path / "b", torch="2.9.0", torch_npu="2.9.0.post6", npu_pin="2.9.0")
    kw["environ"]["ASCEND_HOME_PATH"] = str(_cann(tmp_path / "b", "9.1.0", hccl=False))
    assert _findings(**kw)["HCCL"].status == "warn"


def test_the_job_stops_on_what_concerns_it(tmp_path):
    kw = _install(tmp_path, torch="2.9.0", torch_npu="2.9.0.post6", npu_pin="2.9.0", cann="8.5.0")
    line = doctor.check_at_start("nccl", **kw)
    assert line.startswith("pretrain_gpt: error: CANN 8.5.0 is older than torch_npu 2.9.0.post6")
    assert line.endswith("(npu-compile doctor shows the whole installation)")
    assert doctor.check_at_start("gloo", **kw) is None  # gloo does not use the NPU stack
    kw = _install(tmp_path / "b", megatron="0.11.0")
    assert "megatron-core 0.11.0 is older" in doctor.check_at_start("gloo", **kw)


def test_cann_versions_order():
    order = ["6.3.RC3", "6.3.RC3.1", "8.0.RC1", "8.0.RC3", "8.0.0", "8.3.RC1", "8.5.0.alpha003", "8.5.0", "9.1.0"]
    assert sorted(reversed(order), key=compatibility.cann_key) == order
    with pytest.raises(ValueError, match="'8.x' is not a CANN version"):
        compatibility.cann_key("8.x")


def test_every_published_cann_parses():
    for npu, torch, cann in compatibility.TORCH_NPU_RELEASES:
        compatibility.cann_key(cann)
    assert compatibility.cann_for("2.12.0") == compatibility.cann_for("2.12.0+git1a2b3c") == "9.1.0"
    assert compatibility.cann_for("2.13.0") is None


def test_doctor_on_this_machine(capsys):
    from npu_compile.__main__ import main

    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "info  devices               no Ascend NPU on this machine" in out
    assert "ok    megatron-core" in out
    assert out.rstrip().endswith("nothing known not to work")


def test_the_job_stops_at_start(monkeypatch, tmp_path, capsys):
    from megatron_glue.training import gpt
    from pretrain_runs import TINY

    fake = doctor.probe(**{k: v for k, v in _install(tmp_path, megatron="0.11.0").items() if k != "environ"})
    monkeypatch.setattr(doctor, "probe", lambda *a, **k: fake)
    from hf_models import process_state_kept

    with process_state_kept():  # the job ends the process group: the session's own (megatron_cpu) comes back after
        assert gpt.main([*TINY, "--train-iters", "1"]) == 2
    err = capsys.readouterr().err
    assert err == ("pretrain_gpt: error: megatron-core 0.11.0 is older than the lines the job speaks (0.12 on, tested:"
                   " 0.12.1 and 0.16.1): pip install megatron-core==0.16.1 (npu-compile doctor shows the whole "
                   "installation)\n")


def _fake_torch_npu(root: Path, body: str) -> dict:
    pkg = root / "torch_npu"
    (pkg / "npu").mkdir(parents=True)
    (pkg / "__init__.py").write_text(body)
    (pkg / "npu" / "__init__.py").write_text("def device_count():\n    return 8\n\n"
                                             "def get_device_name(i):\n    return 'Ascend910B2'\n")
    return {"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"}


def test_what_torch_npu_sees(tmp_path):
    found = doctor.ask_torch_npu(environ=_fake_torch_npu(tmp_path / "a", "from . import npu\n"))
    assert (found.status, found.text) == ("ok", "8 NPU(s), Ascend910B2")
    # without CANN torch_npu fails at import on libhccl.so: that line, and what to do
    broken = _fake_torch_npu(tmp_path / "b", "raise OSError('libhccl.so: cannot open shared object file: No such file"
                                             " or directory')\n")
    found = doctor.ask_torch_npu(environ=broken)
    assert found.line() == ("FAIL  torch_npu sees        torch_npu cannot be imported (OSError: libhccl.so: cannot open "
                            "shared object file: No such file or directory): source "
                            "/usr/local/Ascend/ascend-toolkit/set_env.sh, or install the CANN release its table names")


def test_a_half_sourced_cann_environment(tmp_path):
    kw = _install(tmp_path, torch="2.9.0", torch_npu="2.9.0.post6", npu_pin="2.9.0", cann="9.1.0")
    del kw["environ"]["ASCEND_OPP_PATH"]
    found = _findings(**kw)["ASCEND_OPP_PATH"]
    home = Path(kw["environ"]["ASCEND_HOME_PATH"])
    assert found.text == ("ASCEND_HOME_PATH is set but ASCEND_OPP_PATH is not, and torch_npu stops at import without "
                          f"it: source {home.parent / 'set_env.sh'}")
    kw["environ"]["ASCEND_HOME_PATH"] = str(tmp_path / "gone")
    assert _findings(**kw)["CANN"].text.startswith(
        f"torch_npu 2.9.0.post6 is installed but no CANN toolkit is (ASCEND_HOME_PATH={tmp_path / 'gone'} does not "
        "exist): install CANN 9.1.0")


def test_the_real_torch_npu_wheel_metadata(tmp_path):
    """torch_npu 2.13.0's own dist-info (read from the pinned wheel, not installed): its version, its pin of torch
    and the torchair it bundles, as the doctor reads them."""
    import zipfile

    from lowering.wheel import wheel_path

    site = tmp_path / "site"
    with zipfile.ZipFile(wheel_path()) as whl:
        for name in whl.namelist():
            if name.startswith("torch_npu-2.13.0.dist-info/"):
                whl.extract(name, site)
    _dist(site, "torch", "2.12.0")
    _dist(site, "megatron-core", "0.16.1")
    inst = doctor.probe(environ={}, paths=[str(site)], sysfs_root=str(tmp_path),
                        default_ascend_home=str(tmp_path / "absent"))
    assert (inst.torch_npu, inst.torch_npu_requires_torch, inst.torch_npu_torchair) == ("2.13.0", "torch==2.13.0.*",
                                                                                      True)
    found = {f.what: f for f in doctor.diagnose(inst)}
    assert found["torch"].text == ("torch_npu 2.13.0 is built for torch==2.13.0.*, but torch 2.12.0 is installed: "
                                   "pip install 'torch==2.13.0.*'")
    assert found["CANN"].text == ("torch_npu 2.13.0 is installed but no CANN toolkit is (ASCEND_HOME_PATH unset, "
                                  "/usr/local/Ascend/ascend-toolkit/latest absent): install CANN and source "
                                  "/usr/local/Ascend/ascend-toolkit/set_env.sh")
