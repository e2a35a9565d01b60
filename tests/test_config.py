"""Options are validated at the door: the exact errors a user sees."""

import re

import pytest
import torch

import npu_compile
from npu_compile import config


def test_defaults_match_design_table():
    opts = config.validate({})
    assert (opts.target, opts.graph_mode, opts.fusions, opts.memory_budget, opts.overlap, opts.mc2, opts.dump_dir,
            opts.verify) == ("auto", "ge", "all", 1.0, True, "auto", None, False)
    assert config.KEYS == ("target", "graph_mode", "fusions", "memory_budget", "device_memory", "resident_memory",
                           "activation_copies", "recompute", "offload", "overlap", "mc2", "dump_dir", "verify",
                           "fast_gelu", "cache", "pattern_cache", "torchair_check")
    assert (opts.device_memory, opts.resident_memory, opts.activation_copies) == (None, 0, 1)


def test_unknown_key_names_valid_keys():
    with pytest.raises(ValueError) as e:
        config.validate({"targett": "npu"})
    assert str(e.value) == (
        "unknown npu_compile option(s) 'targett'; valid options are "
        "target, graph_mode, fusions, memory_budget, device_memory, resident_memory, activation_copies, recompute, "
        "offload, overlap, mc2, dump_dir, verify, fast_gelu, cache, pattern_cache, torchair_check"
    )


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("target", "gpu", "npu_compile option 'target' got 'gpu'; valid values are 'auto', 'npu', 'npu-sim', 'reference'"),
        ("graph_mode", "max-autotune", "npu_compile option 'graph_mode' got 'max-autotune'; valid values are 'ge', 'aclgraph', 'eager'"),
        ("memory_budget", 1.5, "npu_compile option 'memory_budget' got 1.5; it takes a float in [0, 1] or \"auto\""),
        ("memory_budget", True, "npu_compile option 'memory_budget' got True; it takes a float in [0, 1] or \"auto\""),
        ("overlap", "yes", "npu_compile option 'overlap' got 'yes'; it takes True or False"),
        ("mc2", "always", "npu_compile option 'mc2' got 'always'; valid values are 'auto', 'on', 'off'"),
        ("mc2", True, "npu_compile option 'mc2' got True; valid values are 'auto', 'on', 'off'"),
        ("verify", 1, "npu_compile option 'verify' got 1; it takes True or False"),
        ("dump_dir", 3, "npu_compile option 'dump_dir' got 3; it takes a path (str or os.PathLike) or None"),
        ("fusions", 7, "npu_compile option 'fusions' got 7; it takes \"all\", a list of rule names, or {rule name: bool}"),
    ],
)
def test_bad_value_names_key_and_valid_values(key, value, message):
    with pytest.raises(ValueError) as e:
        config.validate({key: value})
    assert str(e.value) == message


def test_unknown_fusion_rule_lists_known_rules():
    with pytest.raises(ValueError, match=r"npu_compile option 'fusions' names unknown rule\(s\) 'no_such_rule'; known rules are"):
        config.validate({"fusions": ["no_such_rule"]})
    with pytest.raises(ValueError, match="names unknown rule"):
        config.validate({"fusions": {"no_such_rule": False}})


def test_bad_option_fails_at_compile_call_as_itself():
    m = torch.nn.Linear(4, 4)
    with pytest.raises(config.OptionError) as e:
        torch.compile(m, backend="ascend", options={"budget": 0.5})(torch.randn(2, 4))
    # not wrapped in Dynamo's BackendCompilerFailed: the message is ours, first
    assert type(e.value) is config.OptionError and isinstance(e.value, ValueError)
    assert str(e.value).startswith("unknown npu_compile option(s) 'budget'; valid options are target, graph_mode,")
    assert "backend='ascend' raised" not in str(e.value)
    with pytest.raises(config.TargetUnavailable, match="^npu_compile option target='npu' needs torch_npu"):
        torch.compile(m, backend="ascend", options={"target": "npu"})(torch.randn(2, 4))


def test_auto_target_is_reference_without_torch_npu():
    assert config.resolve({}).target == "reference"


def test_npu_target_without_torch_npu_says_how_to_get_it():
    with pytest.raises(RuntimeError) as e:
        config.resolve({"target": "npu"})
    msg = str(e.value)
    assert msg.startswith("npu_compile option target='npu' needs torch_npu with an Ascend device, which is not usable here (")
    assert "pip install 'npu_compile[npu]' (torch-npu==2.13.0)" in msg
    assert "use target='npu-sim'" in msg


def test_dump_dir_from_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("NPU_COMPILE_DUMP_DIR", str(tmp_path))
    assert config.resolve({}).dump_dir == str(tmp_path)
    assert config.resolve({"dump_dir": "/elsewhere"}).dump_dir == "/elsewhere"


def test_patch_changes_defaults_for_a_block_only():
    with config.patch(memory_budget=0.5, verify=True) as opts:
        assert opts.memory_budget == 0.5 and config.resolve({}).verify is True
        assert config.resolve({"verify": False}).verify is False
    assert config.defaults.memory_budget == 1.0 and config.defaults.verify is False
    with pytest.raises(ValueError, match="valid options are"):
        with config.patch(nope=1):
            pass


def test_mode_is_refused_with_a_pointer_to_options():
    gm = torch.fx.symbolic_trace(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"the ascend backend takes no torch.compile mode \(got 'max-autotune'\)"):
        npu_compile.ascend(gm, [torch.randn(1, 2)], mode="max-autotune")
