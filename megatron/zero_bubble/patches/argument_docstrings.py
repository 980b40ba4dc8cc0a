"""Megatron's argument parser reads its config classes' help texts once per process instead of once per parse.

megatron.training's `parse_args` builds its flags from config dataclasses (TransformerConfig and a dozen more)
through `ArgumentGroupFactory`, whose `_get_field_docstrings` takes each class's help texts from its source:
`inspect.getsource`, which tokenizes the class in Python, then `ast.parse`. That happens on every call, and a
start-up parses three times (ours with the zero-bubble flags, megatron's validation, its fault-tolerance set-up):
80 ms of each later parse on a 2-core machine is this re-reading, on every rank; a process that starts training
many times (the test driver, the start-up checks of many command lines) pays it each time. A class's source does
not change while the process runs, so its help texts are read once and handed out as copies.

`install()` replaces the method on the class (megatron-core 0.19's only reader of it); `uninstall()` restores it.
"""
from __future__ import annotations

from ._patching import MegatronPatch


class ArgumentDocstringCache(MegatronPatch):
    name = "argument docstrings"

    def apply(self) -> None:
        from megatron.training.argument_utils import ArgumentGroupFactory

        read = ArgumentGroupFactory._get_field_docstrings
        known: dict[type, dict[str, str]] = {}

        def field_docstrings_read_once(factory, src_cfg_class: type) -> dict[str, str]:
            if src_cfg_class not in known:
                known[src_cfg_class] = read(factory, src_cfg_class)
            return dict(known[src_cfg_class])

        self.patches.replace(ArgumentGroupFactory, "_get_field_docstrings", field_docstrings_read_once)


_PATCH = ArgumentDocstringCache()


def install() -> None:
    """Read each config class's help texts once in this process (idempotent)."""
    _PATCH.install()


def uninstall() -> None:
    _PATCH.uninstall()


def installed() -> bool:
    return _PATCH.installed
