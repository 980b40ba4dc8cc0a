"""On CPU, megatron-core is imported without compiling anything: `torch.compile` passes functions through while
megatron's modules are first imported, and megatron's own switch (`megatron.core.jit.disable_jit_fuser`) keeps its
`jit_fuser` a no-op for modules imported later.

megatron-core 0.19.2 decorates some forty functions with `torch.compile` at import (`megatron.core.jit.jit_fuser`,
and the MoE router's `_apply_expert_bias` directly). None of them runs compiled on CPU: the CPU defaults switch
megatron's fusions off and cpu_backend_moe runs the router's method plain, for the compilation costs seconds per
process and Inductor's C++ build needs a compiler. Each decoration still imports TorchDynamo and Inductor into every
rank, which is what passing the functions through saves.

    with uncompiled_import():        # CPU only (prepare_process decides)
        import megatron.training     # and whatever it imports
    # torch.compile is torch's own again here

On CUDA nothing changes: megatron's kernels are compiled as megatron asks.
"""
from __future__ import annotations

import contextlib
import sys

import torch

from ._patching import MegatronPatch, module_functions


def _passthrough(model=None, **options):
    """torch.compile's signature, no compilation: `@torch.compile` and `@torch.compile(...)` return the function."""
    return (lambda function: function) if model is None else model


class UncompiledImport(MegatronPatch):
    name = "uncompiled_import"

    def apply(self) -> None:
        self.patches.replace(torch, "compile", _passthrough)


install, uninstall, installed = module_functions(UncompiledImport())


@contextlib.contextmanager
def uncompiled_import():
    """megatron imported inside compiles nothing; megatron's jit_fuser stays its no-op after (see the module)."""
    install()
    try:
        yield
    finally:
        jit = sys.modules.get("megatron.core.jit")
        if jit is not None:  # its jit_fuser was bound to the pass-through: megatron's own no-op from here on
            jit.disable_jit_fuser()
        uninstall()
