"""The only place that touches megatron-core internals: one module per patched target.

Each module has `install()` (idempotent, version-checked) and `uninstall()` (restores megatron-core).
"""
from ._patching import PatchError, check_megatron_core_version, megatron_core_version

__all__ = ["PatchError", "check_megatron_core_version", "megatron_core_version"]
