"""Make `import megatron.core` and `import megatron.training` work on a CPU-only Python 3.11 machine.

Two shims, both additions rather than replacements (`PatchSet.add_module` and `PatchSet.add`):

- `megatron/core/transformer/moe/ops/paged_stash.py` does an unguarded `import triton` and is reached
  from `pipeline_parallel/schedules.py` and `models/gpt/gpt_model.py`. When triton is missing, a stub
  module with the three names its one importer reads (a block size and two kernels that raise) is put in
  `sys.modules` under that module's name. MoE paged stashing is never used on CPU.
- on a machine without CUDA where Transformer Engine's Python is installed without its compiled extension, TE's
  Python runs over the CPU kernel layer (te_cpu) when asked for (`install(transformer_engine=True)`), and is hidden
  otherwise (megatron then runs as without TE); the import hook goes in before megatron imports TE;
- `megatron/training/models/{base,gpt,hybrid}.py` use `typing.override` (Python 3.12+); on older Pythons
  it is aliased to `typing_extensions.override`.

`install()` must run before megatron.core / megatron.training are first imported, at the top of the entry
script: Megatron's checkpoint writer spawns a process that re-imports the main module.
"""
from __future__ import annotations

import importlib.util
import sys
import types
import typing

import torch

from .. import te_cpu
from ._patching import MegatronPatch, module_functions

TRITON_KERNEL_MODULE = "megatron.core.transformer.moe.ops.paged_stash"
PAGED_STASH_BLOCK_SIZE = 1024  # the value of GLOBAL_BLOCK_SIZE in megatron-core 0.19.2's triton module


class ImportShims(MegatronPatch):
    """Adds only what this interpreter lacks; `uninstall()` removes exactly that."""

    name = "imports"

    def apply(self, transformer_engine: bool = False) -> None:
        """transformer_engine: on a machine without CUDA, load TE's Python over the CPU kernel layer (where it is
        installed) rather than hide it (megatron's local layers, and TE's import spared)."""
        if TRITON_KERNEL_MODULE not in sys.modules and importlib.util.find_spec("triton") is None:
            self.patches.add_module(TRITON_KERNEL_MODULE, _triton_kernel_stub())
        if not torch.cuda.is_available():
            te_cpu.install(hidden=not transformer_engine)  # before megatron imports TE
        if sys.version_info < (3, 12) and not hasattr(typing, "override"):
            import typing_extensions

            self.patches.add(typing, "override", typing_extensions.override)

    def uninstall(self) -> None:
        te_cpu.uninstall()
        super().uninstall()


def _triton_kernel_stub() -> types.ModuleType:
    stub = types.ModuleType(TRITON_KERNEL_MODULE, "Stand-in for megatron-core's triton kernels (triton is missing).")

    def _needs_triton(*args, **kwargs):
        raise RuntimeError("MoE paged stashing needs triton, which is not installed (CPU backend)")

    stub.GLOBAL_BLOCK_SIZE = PAGED_STASH_BLOCK_SIZE
    stub.paged_stash_copy_kernel = _needs_triton
    stub.paged_stash_pop_kernel = _needs_triton
    stub.__all__ = ["GLOBAL_BLOCK_SIZE", "paged_stash_copy_kernel", "paged_stash_pop_kernel"]
    return stub


install, uninstall, installed = module_functions(ImportShims())


def ensure_installed() -> None:
    """The shims as the process installed them (whether TE is loaded or hidden stays the entry point's choice), or
    with their defaults where nothing installed them yet."""
    if not installed():
        install()
