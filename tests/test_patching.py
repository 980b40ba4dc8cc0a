"""PatchSet and MegatronPatch, the one mechanism every patch of megatron-core goes through (no megatron)."""
from __future__ import annotations

import sys
import types

import pytest

from megatron.zero_bubble.patches._patching import MegatronPatch, PatchError, PatchSet


def _module(name: str, **attrs) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__dict__.update(attrs)
    return module


def original():
    return "megatron"


@pytest.fixture
def fake_megatron(monkeypatch):
    """A source module and one that imported its function by name, as megatron's modules do."""
    source = _module("megatron.fake_source", f=original)
    user = _module("megatron.fake_user", f=original, g=original)
    ours = _module("megatron.zero_bubble.fake", f=original)
    for module in (source, user, ours):
        monkeypatch.setitem(sys.modules, module.__name__, module)
    return source, user, ours


@pytest.mark.parametrize("first_removed", ["earlier", "later"])
def test_two_sets_wrapping_one_function_restore_it_in_either_order(fake_megatron, first_removed):
    source, _, _ = fake_megatron
    earlier, later = PatchSet("earlier"), PatchSet("later")
    wrapped_once = earlier.replace(source, "f", lambda: "earlier(" + original() + ")")
    assert wrapped_once is original
    saved_by_later = later.replace(source, "f", lambda: "later")
    assert saved_by_later is not original  # the later set wrapped the earlier one's function
    (earlier if first_removed == "earlier" else later).restore()
    assert source.f is not original  # the other set is still in force
    (later if first_removed == "earlier" else earlier).restore()
    assert source.f is original


def test_replace_everywhere_rebinds_megatron_modules_but_not_ours(fake_megatron):
    source, user, ours = fake_megatron
    patches = PatchSet("everywhere")

    def new():
        return "new"

    assert patches.replace_everywhere(source, "f", new) is original
    assert source.f is new and user.f is new and user.g is new  # every binding of the same object
    assert ours.f is original  # megatron.zero_bubble modules keep megatron's function
    patches.restore()
    assert source.f is original and user.f is original and user.g is original


def test_additions_are_removed_and_replacing_a_missing_target_is_refused(fake_megatron):
    source, _, _ = fake_megatron
    patches = PatchSet("additions")
    patches.add(source, "extra", 1)
    patches.add_module("megatron.fake_stub", _module("megatron.fake_stub"))
    assert source.extra == 1 and "megatron.fake_stub" in sys.modules
    with pytest.raises(PatchError, match="exists already"):
        patches.add(source, "f", None)
    with pytest.raises(PatchError, match="does not exist"):
        patches.replace(source, "no_such_function", None)
    patches.restore()
    assert not hasattr(source, "extra") and "megatron.fake_stub" not in sys.modules


class _CountingPatch(MegatronPatch):
    name = "counting"

    def __init__(self, source):
        super().__init__()
        self.source, self.applied = source, 0

    def apply(self, value, fail=False):
        self.applied += 1
        self.patches.replace(self.source, "f", lambda: value)
        if fail:
            raise RuntimeError("apply failed half-way")


def test_installing_again_is_a_no_op_with_equal_options_and_a_reinstall_with_others(fake_megatron):
    source, _, _ = fake_megatron
    patch = _CountingPatch(source)
    patch.install("a")
    patch.install("a")
    assert patch.applied == 1 and source.f() == "a"
    patch.install("b")
    assert patch.applied == 2 and source.f() == "b"
    patch.uninstall()
    assert source.f is original and not patch.installed


def test_a_failing_install_leaves_megatron_as_it_was(fake_megatron):
    source, _, _ = fake_megatron
    patch = _CountingPatch(source)
    with pytest.raises(RuntimeError, match="half-way"):
        patch.install("a", True)
    assert source.f is original and not patch.installed


def test_shadowing_a_method_on_one_object_is_undone_by_deleting_it_and_refused_twice_or_without_the_method():
    class Layer:
        def forward_impl(self):
            return "megatron"

    layer, other = Layer(), Layer()
    patches = PatchSet("shadow")
    patches.shadow(layer, "forward_impl", lambda: "ours")
    assert layer.forward_impl() == "ours" and other.forward_impl() == "megatron"  # that one object only
    with pytest.raises(PatchError, match="has its own forward_impl already"):
        PatchSet("again").shadow(layer, "forward_impl", lambda: "twice")
    with pytest.raises(PatchError, match="Layer.no_such_method does not exist"):
        patches.shadow(other, "no_such_method", None)
    patches.restore()
    assert "forward_impl" not in vars(layer) and layer.forward_impl() == "megatron"
