import re
import sys
import types

import pytest
import torch

import megatron_glue
from megatron_glue.adaptations import Adaptation, Registry, registry


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


# -- the real registry -------------------------------------------------------------------------------------

def test_every_adaptation_cites_megatron_and_resolves(megatron_cpu):
    from megatron_glue.adaptations import resolve

    assert set(registry.groups()) >= {"cpu", "compile", "tp_compile", "sp"}
    for name in registry.known():
        adaptation = registry.get(name)
        # torch.* only where Megatron reaches the attribute through torch (torch.distributed.all_reduce, ...)
        assert adaptation.target.startswith(("megatron.", "torch.")), name
        assert re.search(r"\w+\.py:\d+", adaptation.reason), name
        resolve(adaptation.target)


def test_adapt_applies_cpu_and_compile_and_leaves_torch_compile_alone(megatron_cpu):
    compile_before = torch.compile
    applied = megatron_glue.adapt()
    assert set(registry.known("cpu") + registry.known("compile")) <= set(applied)
    assert megatron_glue.adapt() == applied  # idempotent
    assert torch.compile is compile_before


def test_quiet_tp_group_reaches_every_megatron_module_that_imported_it(megatron_cpu):
    import megatron.core.utils as mu

    quiet = mu.get_tensor_model_parallel_group_if_none
    holders = [m for n, m in sys.modules.items()
               if n.startswith("megatron.") and "get_tensor_model_parallel_group_if_none" in vars(m)]
    assert len(holders) > 5  # layers, mappings, embeddings, mlp, ...
    assert all(m.get_tensor_model_parallel_group_if_none is quiet for m in holders)


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
