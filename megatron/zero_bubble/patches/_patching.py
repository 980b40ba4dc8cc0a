"""Reversible, version-checked replacement of megatron-core attributes.

Every patch module owns one `Patcher`: `install()` replaces attributes through it (refusing targets that
the installed megatron-core lacks) and `uninstall()` puts the originals back.
"""
from __future__ import annotations

import importlib.metadata

SUPPORTED_MEGATRON_CORE = ((0, 19),)  # (major, minor) series whose internals the patches were written for


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


def check_megatron_core_version(version: str | None = None) -> str:
    version = version or megatron_core_version()
    try:
        major_minor = tuple(int(x) for x in version.split(".")[:2])
    except ValueError:
        major_minor = None
    if major_minor not in SUPPORTED_MEGATRON_CORE:
        supported = ", ".join(f"{a}.{b}.x" for a, b in SUPPORTED_MEGATRON_CORE)
        raise PatchError(
            f"megatron-core {version} is installed, but megatron-zero-bubble's patches support {supported}; "
            f"install a supported release (pip install megatron-core==0.19.2)"
        )
    return version


class Patcher:
    """Records each replaced attribute so that `restore()` puts megatron-core back exactly."""

    def __init__(self, name: str):
        self.name = name
        self._originals: list[tuple[object, str, object]] = []

    @property
    def installed(self) -> bool:
        return bool(self._originals)

    def replace(self, owner: object, attr: str, new: object) -> object:
        """Set owner.attr = new and return the original; the target must exist."""
        if not hasattr(owner, attr):
            where = getattr(owner, "__name__", type(owner).__name__)
            raise PatchError(
                f"patch '{self.name}': {where}.{attr} does not exist in megatron-core "
                f"{megatron_core_version()}; this patch was written for "
                + ", ".join(f"{a}.{b}.x" for a, b in SUPPORTED_MEGATRON_CORE)
            )
        original = owner.__dict__[attr] if attr in getattr(owner, "__dict__", {}) else getattr(owner, attr)
        self._originals.append((owner, attr, original))
        setattr(owner, attr, new)
        return original

    def original(self, owner: object, attr: str) -> object:
        for o, a, value in self._originals:
            if o is owner and a == attr:
                return value
        return getattr(owner, attr)

    def restore(self) -> None:
        for owner, attr, original in reversed(self._originals):
            setattr(owner, attr, original)
        self._originals.clear()
