"""The one way this package changes megatron-core: reversible, version-checked patches.

- `PatchSet` records every change one patch makes: `replace` (an existing attribute), `replace_everywhere`
  (the attribute and every megatron module's by-name binding of the same object: `from x import f` copies
  f into the importer, so patching x.f alone would miss it), `add` (an attribute the target lacks),
  `shadow` (one object's own attribute over its class's) and `add_module` (a sys.modules entry). `restore()` undoes them in reverse order.
- All sets share one ledger, so undo is last-in-first-out per attribute whatever order the patches are
  removed in: when two patches wrap the same function and the earlier one is removed first, the later
  one's saved original is re-pointed past it instead of being resurrected on restore.
- `MegatronPatch` is the base of every patch module's one object: `install(*options)` checks the
  megatron-core version, then applies; installing again with equal options does nothing, with other
  options it re-installs; `uninstall()` restores megatron-core.
"""
from __future__ import annotations

import importlib.metadata
import inspect
import sys
from dataclasses import dataclass

SUPPORTED_MEGATRON_CORE = ((0, 19),)  # (major, minor) series whose internals the patches were written for
_MISSING = object()  # the value of an attribute `add` created (restore deletes it)


class PatchError(RuntimeError):
    """A patch cannot be applied to the installed megatron-core."""


def megatron_core_version() -> str:
    try:
        return importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError:
        raise PatchError(
            "megatron-core is not installed; megatron-zero-bubble needs megatron-core 0.19.x "
            "(pip install megatron-core==0.19.2)"
        ) from None


def _supported() -> str:
    return ", ".join(f"{a}.{b}.x" for a, b in SUPPORTED_MEGATRON_CORE)


def check_megatron_core_version(version: str | None = None) -> str:
    version = version or megatron_core_version()
    try:
        major_minor = tuple(int(x) for x in version.split(".")[:2])
    except ValueError:
        major_minor = None
    if major_minor not in SUPPORTED_MEGATRON_CORE:
        raise PatchError(
            f"megatron-core {version} is installed, but megatron-zero-bubble's patches support {_supported()}; "
            f"install a supported release (pip install megatron-core==0.19.2)"
        )
    return version


@dataclass(eq=False)  # a change is itself (the ledger finds it by identity), whatever its owner's __eq__
class _Change:
    owner: object  # a module, class or object; sys.modules for add_module
    attr: str
    original: object  # _MISSING when the change added the attribute
    new: object
    patch_set: "PatchSet"

    def read(self):
        if self.owner is sys.modules:
            return sys.modules.get(self.attr, _MISSING)
        return getattr(self.owner, self.attr, _MISSING)

    def write(self, value) -> None:
        if self.owner is sys.modules:
            if value is _MISSING:
                sys.modules.pop(self.attr, None)
            else:
                sys.modules[self.attr] = value
        elif value is _MISSING:
            if self.attr in getattr(self.owner, "__dict__", {}):
                delattr(self.owner, self.attr)
        else:
            setattr(self.owner, self.attr, value)


_LEDGER: list[_Change] = []  # every change in force, oldest first, across all patch sets


class PatchSet:
    """The changes one patch makes to megatron-core (see the module docstring)."""

    def __init__(self, name: str):
        self.name = name
        self._changes: list[_Change] = []

    @property
    def installed(self) -> bool:
        return bool(self._changes)

    def _record(self, owner, attr: str, original, new) -> None:
        change = _Change(owner, attr, original, new, self)
        change.write(new)
        self._changes.append(change)
        _LEDGER.append(change)

    def replace(self, owner: object, attr: str, new: object) -> object:
        """Set owner.attr = new and return the original; the target must exist."""
        if not hasattr(owner, attr):
            where = getattr(owner, "__name__", type(owner).__name__)
            raise PatchError(
                f"patch '{self.name}': {where}.{attr} does not exist in megatron-core "
                f"{megatron_core_version()}; this patch was written for {_supported()}"
            )
        original = owner.__dict__[attr] if attr in getattr(owner, "__dict__", {}) else getattr(owner, attr)
        self._record(owner, attr, original, new)
        return original

    def replace_everywhere(self, source: object, attr: str, new: object) -> object:
        """Replace source.attr and every binding of the same object in an imported megatron module (ours
        excepted). Modules imported later bind `new`, so it must fall back to the original itself once
        uninstalled. Returns the original."""
        original = getattr(source, attr)
        self.replace(source, attr, new)
        for name, module in list(sys.modules.items()):
            namespace = getattr(module, "__dict__", None)
            if module is source or namespace is None or not name.startswith("megatron."):
                continue
            if name.startswith("megatron.zero_bubble"):
                continue
            for binding, value in list(namespace.items()):
                if value is original:
                    self.replace(module, binding, new)
        return original

    def add(self, owner: object, attr: str, value: object) -> None:
        """Give owner an attribute it lacks (e.g. typing.override on Python 3.11); restore deletes it."""
        if hasattr(owner, attr):
            raise PatchError(f"patch '{self.name}': {getattr(owner, '__name__', owner)}.{attr} exists already")
        self._record(owner, attr, _MISSING, value)

    def shadow(self, instance: object, attr: str, value: object) -> None:
        """Give one object its own `attr`, hiding its class's (a method, say); restore deletes it again."""
        if attr in getattr(instance, "__dict__", {}):
            raise PatchError(f"patch '{self.name}': {type(instance).__name__} object has its own {attr} already")
        if not hasattr(type(instance), attr):
            raise PatchError(f"patch '{self.name}': {type(instance).__name__}.{attr} does not exist in megatron-core "
                             f"{megatron_core_version()}; this patch was written for {_supported()}")
        self._record(instance, attr, _MISSING, value)

    def add_module(self, name: str, module: object) -> None:
        """Put a module under `name` in sys.modules (a stand-in for one that cannot import here)."""
        if name in sys.modules:
            raise PatchError(f"patch '{self.name}': module {name} is imported already")
        self._record(sys.modules, name, _MISSING, module)

    def original(self, owner: object, attr: str) -> object:
        """What owner.attr was before this set replaced it (the current value if it did not)."""
        for change in self._changes:
            if change.owner is owner and change.attr == attr:
                return change.original
        return getattr(owner, attr)

    def restore(self) -> None:
        """Undo this set's changes, newest first. Where another set changed the same attribute later, its
        saved original now skips ours, so removing the sets in any order leaves megatron-core as it was."""
        for change in reversed(self._changes):
            position = _LEDGER.index(change)
            later = next((c for c in _LEDGER[position + 1:] if c.owner is change.owner and c.attr == change.attr), None)
            if later is not None:
                later.original = change.original
            else:
                change.write(change.original)
            del _LEDGER[position]
        self._changes.clear()


class MegatronPatch:
    """Base of each patch module's single object: subclasses set `name` and implement `apply`.

    `install(*options)`: equal options again -> nothing; other options -> uninstall, then apply anew.
    A failing `apply` leaves nothing behind.
    """

    name = "patch"

    def __init__(self):
        self.patches = PatchSet(self.name)
        self.options: tuple | None = None

    @property
    def installed(self) -> bool:
        return self.options is not None

    def install(self, *options) -> None:
        if self.installed and self.options == options:
            return
        if self.installed:
            self.uninstall()
        check_megatron_core_version()
        try:
            self.apply(*options)
        except BaseException:
            self.patches.restore()
            raise
        self.options = options

    def uninstall(self) -> None:
        self.patches.restore()
        self.options = None

    def apply(self, *options) -> None:
        raise NotImplementedError


def module_functions(patch: MegatronPatch):
    """A patch module's `install(...)` (the arguments of its patch's `apply`, by position or name, defaults filled
    in), `uninstall()` and `installed()`, for its one patch object."""
    signature = inspect.signature(patch.apply)

    def install(*options, **named) -> None:
        bound = signature.bind(*options, **named)
        bound.apply_defaults()
        patch.install(*bound.args)

    def uninstall() -> None:
        patch.uninstall()

    def installed() -> bool:
        return patch.installed

    return install, uninstall, installed
