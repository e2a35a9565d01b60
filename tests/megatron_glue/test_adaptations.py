import importlib.util
import re
import sys
import types

import pytest
import torch

import megatron_glue
from megatron_glue.capture.adaptations import Adaptation, Registry, megatron_core_in, registry


def _original(x):
    return f"original {x}"


def _other(x):
    return f"other {x}"


@pytest.fixture
def fake_modules():
    """fake_lib defines things; fake_user did `from fake_lib import f`; fake_bystander has its own `f`."""
    class Base:
        def inherited(self):
            return "base"

    class Owner(Base):  # a fresh class per test: adaptations on it must not leak between tests
        def method(self):
            return "method"

    lib, user, bystander = (types.ModuleType(n) for n in ("fake_lib", "fake_user", "fake_bystander"))
    lib.f, lib.Owner = _original, Owner
    user.f = _original
    bystander.f = _other
    sys.modules.update(fake_lib=lib, fake_user=user, fake_bystander=bystander)
    yield lib, user, bystander
    for name in ("fake_lib", "fake_user", "fake_bystander"):
        del sys.modules[name]


def _registry():
    reg = Registry()

    @reg.replaces("replace_f", "fake_lib.f", "cpu", reason="f needs CUDA (fake.py:1)")
    def f(x):
        return f"new {x}"

    @reg.wraps("wrap_method", "fake_lib.Owner.method", "compile", reason="method breaks graphs (fake.py:2)")
    def wrap(method):
        return lambda self: "wrapped " + method(self)

    return reg


def test_apply_replaces_the_original_wherever_it_is_held(fake_modules):
    lib, user, bystander = fake_modules
    reg = _registry()
    reg.apply("replace_f")
    assert lib.f("x") == "new x"
    assert user.f is lib.f  # the module that imported the original by name gets the replacement too
    assert bystander.f is _other  # same name, different object: untouched


def test_wrapper_stacks_on_the_original_class_method(fake_modules):
    lib, _, _ = fake_modules
    reg = _registry()
    reg.apply("wrap_method")
    assert lib.Owner().method() == "wrapped method"


def test_apply_is_idempotent(fake_modules):
    lib, _, _ = fake_modules
    reg = _registry()
    reg.apply("wrap_method")
    wrapped = vars(lib.Owner)["method"]
    reg.apply("wrap_method")
    reg.apply_groups(["compile"])
    assert vars(lib.Owner)["method"] is wrapped
    assert lib.Owner().method() == "wrapped method"  # not "wrapped wrapped method"
    assert list(reg.applied()) == ["wrap_method"]


def test_applied_lists_reasons_in_order(fake_modules):
    reg = _registry()
    assert reg.applied() == {}
    reg.apply_groups(["compile", "cpu"])
    assert reg.applied() == {
        "wrap_method": "method breaks graphs (fake.py:2)",
        "replace_f": "f needs CUDA (fake.py:1)",
    }


def test_revert_all_restores_owner_and_holders(fake_modules):
    lib, user, bystander = fake_modules
    reg = _registry()
    reg.apply("replace_f", "wrap_method")
    late = types.ModuleType("fake_late")  # imported after the apply: took the replacement by name
    late.f = lib.f
    sys.modules["fake_late"] = late
    try:
        reg.revert_all()
    finally:
        del sys.modules["fake_late"]
    assert lib.f is _original and user.f is _original and late.f is _original and bystander.f is _other
    assert lib.Owner().method() == "method"
    assert reg.applied() == {}
    reg.apply("replace_f")  # and can be applied again
    assert user.f("x") == "new x"


def test_revert_of_an_inherited_attribute_uncovers_the_base_one(fake_modules):
    lib, _, _ = fake_modules
    reg = Registry()
    reg.replaces("own_inherited", "fake_lib.Owner.inherited", "cpu", reason="r (fake.py:3)")(lambda self: "own")
    reg.apply("own_inherited")
    assert lib.Owner().inherited() == "own"
    reg.revert_all()
    assert "inherited" not in vars(lib.Owner) and lib.Owner().inherited() == "base"


def test_an_added_class_attribute_is_removed_again_on_revert(fake_modules):
    lib, _, _ = fake_modules
    reg = Registry()
    reg.replaces("add_size", "fake_lib.Owner.size", "cpu", reason="r (fake.py:5)", adds=True)(property(lambda s: 3))
    reg.apply("add_size")
    assert lib.Owner().size == 3
    reg.revert_all()
    assert not hasattr(lib.Owner, "size")


def test_adding_an_attribute_the_class_has_is_refused(fake_modules):
    reg = Registry()
    reg.replaces("add_method", "fake_lib.Owner.method", "cpu", reason="r (fake.py:6)", megatron_versions="<0.14",
                 adds=True)(lambda self: "added")
    reg._megatron_version = "0.12.1"
    with pytest.raises(RuntimeError, match=r"adaptation 'add_method' adds fake_lib.Owner.method, which "
                                           r"megatron-core .* already has: its range \(<0.14\) is wrong"):
        reg.apply("add_method")
    assert reg.applied() == {}


def test_a_constant_is_replaced_on_its_owner_only(fake_modules):
    lib, user, _ = fake_modules
    lib.Owner.warned, user.warned = False, False  # equal constants are one object: identity proves nothing
    reg = Registry()
    reg.add(Adaptation("set_flag", "fake_lib.Owner.warned", "cpu", reason="r (fake.py:4)", build=lambda old: True))
    reg.apply("set_flag")
    assert lib.Owner.warned is True and user.warned is False
    reg.revert_all()
    assert lib.Owner.warned is False


def test_stacked_adaptations_revert_in_reverse_order_only(fake_modules):
    lib, _, _ = fake_modules
    reg = Registry()
    reg.wraps("first", "fake_lib.f", "cpu", reason="r1")(lambda f: lambda x: "1" + f(x))
    reg.wraps("second", "fake_lib.f", "npu", reason="r2")(lambda f: lambda x: "2" + f(x))
    reg.apply("first", "second")
    assert lib.f("x") == "21original x"
    with pytest.raises(RuntimeError, match=re.escape("cannot revert 'first': fake_lib.f was replaced again since")):
        reg.revert("first")
    reg.revert_all()
    assert lib.f is _original


def test_unknown_name_is_a_value_error_naming_the_known_ones(fake_modules):
    reg = _registry()
    message = "unknown adaptation 'nope'; known: replace_f, wrap_method"
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        reg.apply("replace_f", "nope")
    assert reg.applied() == {}  # nothing half-applied
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        reg.revert("nope")


def test_unknown_group_is_a_value_error_naming_the_known_ones():
    message = "unknown adaptation group 'gpu'; known: cpu, compile"
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        _registry().apply_groups(["gpu"])


def test_duplicate_name_is_refused():
    reg = _registry()
    with pytest.raises(ValueError, match=re.escape("adaptation 'replace_f' is already registered")):
        reg.replaces("replace_f", "fake_lib.g", "cpu", reason="r")(_other)


@pytest.mark.parametrize("target, message", [
    ("fake_lib.missing", "target 'fake_lib.missing' does not exist: fake_lib has no attribute 'missing'"),
    ("fake_lib.Owner.missing",
     "target 'fake_lib.Owner.missing' does not exist: fake_lib.Owner has no attribute 'missing'"),
    ("fake_lib.Nope.method", "target 'fake_lib.Nope.method' does not exist: fake_lib has no attribute 'Nope'"),
    ("no_such_package_xyz.f", "target 'no_such_package_xyz.f' does not exist: no module of it can be imported"),
])
def test_missing_target_names_the_dotted_path(fake_modules, target, message):
    reg = Registry()
    reg.replaces("bad", target, "cpu", reason="r")(_other)
    with pytest.raises(AttributeError, match=f"^{re.escape(message)}$"):
        reg.apply("bad")
    assert reg.applied() == {}


# -- keyed by megatron-core version -------------------------------------------------------------------------

def _versioned_registry(version):
    """One fix of fake_lib.f in two entries for two lines, and one adaptation for every version."""
    reg = Registry(megatron_version=version)
    reg.replaces("f_new_line", "fake_lib.f", "cpu", reason="r (fake.py:10)", megatron_versions=">=0.13")(
        lambda x: f"new line {x}")
    reg.replaces("f_0_12", "fake_lib.f", "cpu", reason="r (fake.py:5)", megatron_versions="<0.13")(
        lambda x: f"0.12 {x}")
    reg.wraps("wrap_method", "fake_lib.Owner.method", "cpu", reason="r (fake.py:2)")(
        lambda method: lambda self: "wrapped " + method(self))
    return reg


@pytest.mark.parametrize("version, applies, other", [
    ("0.12.1", "f_0_12", "f_new_line"),
    ("0.16.1", "f_new_line", "f_0_12"),
    ("0.16.0rc1", "f_new_line", "f_0_12"),  # a prerelease belongs to its line
])
def test_apply_groups_applies_the_entry_for_the_installed_line_only(fake_modules, version, applies, other):
    lib, _, _ = fake_modules
    reg = _versioned_registry(version)
    reg.apply_groups(["cpu"])
    assert list(reg.applied()) == [applies, "wrap_method"]
    assert lib.f("x") == ("0.12 x" if applies == "f_0_12" else "new line x")
    assert reg.known() == [applies, "wrap_method"] and reg.known("cpu") == [applies, "wrap_method"]
    assert reg.known(every_version=True) == ["f_new_line", "f_0_12", "wrap_method"]
    assert reg.applies(applies) and not reg.applies(other)
    spec = ">=0.13" if other == "f_new_line" else "<0.13"
    assert reg.skipped() == {other: f"for megatron-core {spec}; megatron-core {version} is installed"}
    assert reg.skipped("compile") == {}


def test_applying_an_entry_for_another_line_by_name_is_refused(fake_modules):
    lib, _, _ = fake_modules
    reg = _versioned_registry("0.12.1")
    message = "adaptation 'f_new_line' does not apply here: for megatron-core >=0.13; megatron-core 0.12.1 is installed"
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        reg.apply("wrap_method", "f_new_line")
    assert reg.applied() == {} and lib.f is _original  # nothing half-applied


def test_a_group_whose_entries_are_all_for_another_line_is_still_known(fake_modules):
    reg = Registry(megatron_version="0.12.1")
    reg.replaces("new_only", "fake_lib.f", "compile", reason="r (fake.py:1)", megatron_versions=">=0.13")(_other)
    reg.apply_groups(["compile"])  # not an unknown group: it has nothing for this line
    assert reg.groups() == ["compile"] and reg.applied() == {} and reg.known("compile") == []
    assert list(reg.skipped("compile")) == ["new_only"]


def test_without_megatron_core_versioned_entries_are_skipped(fake_modules):
    reg = _versioned_registry(None)
    reg.apply_groups(["cpu"])
    assert list(reg.applied()) == ["wrap_method"]
    assert reg.skipped() == {"f_new_line": "for megatron-core >=0.13; megatron-core is not installed",
                             "f_0_12": "for megatron-core <0.13; megatron-core is not installed"}


def test_the_version_range_is_checked_where_it_is_declared():
    from packaging.specifiers import InvalidSpecifier

    with pytest.raises(InvalidSpecifier):
        Registry().replaces("bad", "fake_lib.f", "cpu", reason="r", megatron_versions="0.13+")(_other)
    with pytest.raises(InvalidSpecifier):
        Adaptation("bad", "fake_lib.f", "cpu", "r", build=lambda f: f, megatron_versions="newer")


def test_the_default_registry_matches_the_installed_megatron_core():
    from importlib.metadata import version

    from megatron_glue.capture.adaptations import megatron_core_in, megatron_core_version

    assert Registry().megatron_version == megatron_core_version() == registry.megatron_version == version(
        "megatron-core")
    assert megatron_core_in(f"=={megatron_core_version()}") and not megatron_core_in("<0.1")


# -- the real registry -------------------------------------------------------------------------------------

def test_every_adaptation_cites_megatron_and_resolves(megatron_cpu):
    from megatron_glue.capture.adaptations import resolve

    assert set(registry.groups()) >= {"cpu", "compile", "tp_compile", "sp"}
    for name in registry.known(every_version=True):
        adaptation = registry.get(name)
        # torch.* only where Megatron reaches the attribute through torch (torch.distributed.all_reduce, ...)
        assert adaptation.target.startswith(("megatron.", "torch.")), name
        assert re.search(r"\w+\.py:\d+", adaptation.reason), name
    for name in registry.known():  # those for this megatron-core line resolve on it
        adaptation = registry.get(name)
        owner, attr = resolve(adaptation.target, absent_ok=adaptation.adds)
        assert hasattr(owner, attr) != adaptation.adds, name  # an added attribute is one this line lacks


# The fixes whose code differs between megatron-core lines: one entry per line, named <fix>_0_12 for 0.12's.
PER_LINE = {
    "inference_rng_tracker": ("inference_rng_tracker", "inference_rng_tracker_0_12"),
    "rope_stays_on_device": ("rope_stays_on_device", "rope_stays_on_device_0_12"),
    "interleaved_token_count_on_device": ("interleaved_token_count_on_device",
                                          "interleaved_token_count_on_device_0_12"),
    "1f1b_token_count_on_device": ("1f1b_token_count_on_device", "1f1b_token_count_on_device_0_12"),
    "alltoall_dispatcher_without_cuda_stream": ("alltoall_dispatcher_without_cuda_stream",
                                                "alltoall_dispatcher_without_cuda_stream_0_12"),
}
# Fixes that only one line needs: 0.12 has bugs 0.16 fixed, 0.16 functions 0.12 lacks.
ONE_LINE_ONLY = {"quiet_default_tp_group", "no_fp8_params_no_quantize", "checkpoint_writer_serialization_format",
                 "checkpoint_write_results_in_process",  # 0.15 made a synchronous save write in-process
                 "flattened_shard_coordinates_numpy2", "flattened_shard_validation_numpy2", "shard_size_numpy2",
                 "linear_impl_by_weight_0_13_ColumnParallelLinear", "linear_impl_by_weight_0_13_RowParallelLinear",
                 "packed_documents", "router_gemm_without_te", "alltoall_seq_without_cuda_sync_0_12",
                 "sliding_window_mask_on_default_device", "cp_batch_split_on_its_device",
                 # megatron-core's Gated DeltaNet arrived in 0.16
                 "gated_delta_net_without_fla", "gated_delta_rule_in_torch", "l2norm_in_torch",
                 "gated_norm_in_the_layer_graph"}


@pytest.mark.parametrize("version", ["0.12.1", "0.16.1"])  # the lines tested (make test-mcore012, make test)
def test_each_fix_has_exactly_one_entry_for_each_tested_line(version):
    pinned = Registry(megatron_version=version)
    for name in registry.known(every_version=True):
        pinned.add(registry.get(name))
    for fix, entries in PER_LINE.items():
        assert len([n for n in entries if pinned.applies(n)]) == 1, (fix, version)
    per_line = {n for entries in PER_LINE.values() for n in entries}
    assert set(pinned.skipped()) <= per_line | ONE_LINE_ONLY


def test_adapt_applies_what_any_parallel_layout_needs_and_leaves_torch_compile_alone(megatron_cpu):
    compile_before = torch.compile
    before = set(registry.applied())
    try:
        applied = megatron_glue.adapt()
        # on this CPU machine: whatever TP and SP need too, so that adapt() alone is enough at any TP size
        assert set(registry.known("cpu") + registry.known("compile") + registry.known("tp_compile")
                   + registry.known("sp") + registry.known("moe")) <= set(applied)
        assert not set(registry.known("training")) & (set(applied) - before)
        assert not set(registry.skipped()) & set(applied)  # nothing for another megatron-core line
        assert megatron_glue.adapt() == applied  # idempotent
        assert torch.compile is compile_before
    finally:  # the session's other tests keep the fixture's groups only
        registry.revert(*[n for n in registry.applied() if n not in before])


LA = ("linear_attention",) if importlib.util.find_spec("fla") is None else ()  # no flash-linear-attention


@pytest.mark.parametrize("device, training, expected", [
    ("cpu", False, ("cpu", "compile", "tp_compile", "sp", "moe", *LA, "layer_frames")),
    (torch.device("cpu"), True, ("cpu", "compile", "tp_compile", "sp", "moe", *LA, "training")),
    ("meta", False, ("cpu", "compile", "tp_compile", "sp", "moe", *LA, "layer_frames")),
    ("npu:3", True, ("compile", "tp_compile", "sp", "moe", *LA, "training")),  # transfer_to_npu serves CUDA calls
    ("cuda", False, ("compile", "tp_compile", "sp", "moe", *LA, "layer_frames")),
])
def test_groups_for_a_device_are_the_same_at_every_parallel_layout(device, training, expected):
    from megatron_glue.capture.adaptations import groups_for

    assert groups_for(device, training=training) == expected
    assert set(expected) <= set(registry.groups())


def test_groups_for_this_machine():
    from megatron_glue.capture.adaptations import groups_for, machine_device

    assert machine_device() == torch.device("cuda" if torch.cuda.is_available() else "cpu")  # no torch_npu here
    assert groups_for() == groups_for(machine_device())


@pytest.mark.skipif(megatron_core_in(">=0.13"), reason="from megatron-core 0.13 the tp_group warning exists and "
                    "quiet_default_tp_group applies (tested below)")
def test_quiet_tp_group_is_skipped_where_megatron_has_no_such_function(megatron_cpu):
    # 0.12 passes no tp_group to its layers and has no get_tensor_model_parallel_group_if_none to warn in.
    import megatron.core.utils as mu

    assert not hasattr(mu, "get_tensor_model_parallel_group_if_none")
    assert "quiet_default_tp_group" in registry.skipped("compile")
    assert "quiet_default_tp_group" not in registry.applied()


@pytest.mark.skipif(not megatron_core_in(">=0.13"), reason="megatron-core before 0.13 has no "
                    "get_tensor_model_parallel_group_if_none (tested above)")
def test_quiet_tp_group_reaches_every_megatron_module_that_imported_it(megatron_cpu):
    import megatron.core.utils as mu

    quiet = mu.get_tensor_model_parallel_group_if_none
    holders = [m for n, m in sys.modules.items()
               if n.startswith("megatron.") and "get_tensor_model_parallel_group_if_none" in vars(m)]
    assert len(holders) > 5  # layers, mappings, embeddings, mlp, ...
    assert all(m.get_tensor_model_parallel_group_if_none is quiet for m in holders)


@pytest.mark.skipif(not megatron_core_in(">=0.13"), reason="megatron-core before 0.13 has no "
                    "get_tensor_model_parallel_group_if_none (tested above)")
def test_quiet_tp_group_returns_the_default_group_without_warning(megatron_cpu):
    import warnings

    from megatron.core import parallel_state
    from megatron.core.utils import get_tensor_model_parallel_group_if_none

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert get_tensor_model_parallel_group_if_none(None) is parallel_state.get_tensor_model_parallel_group()
        assert (get_tensor_model_parallel_group_if_none(None, is_expert=True)
                is parallel_state.get_expert_tensor_parallel_group())
        group = parallel_state.get_data_parallel_group()
        assert get_tensor_model_parallel_group_if_none(group) is group
