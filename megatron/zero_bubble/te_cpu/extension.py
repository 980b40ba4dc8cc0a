"""The module TE's Python imports as `transformer_engine_torch` (`tex`), made of the CPU kernels here.

Every name TE's Python reads exists: the enumerations, the kernels implemented here, a few queries answered as a
Hopper GPU with CUDA 12.9 libraries would answer them, and for every other kernel a stand-in that stops the run in one
line naming it (refusal.py).
"""
from __future__ import annotations

import functools
import importlib.util
import re
import types
from pathlib import Path

from . import activations, enums, norms, softmax
from .gemm import generic_gemm, te_general_grouped_gemm
from .refusal import missing_kernel

MODULE_NAME = "transformer_engine_torch"

# Library queries: the versions of the CUDA 12.9 libraries TE 2.20 is built against on Hopper.
QUERIES = {
    "get_cublasLt_version": lambda: 120905,
    "get_cudnn_version": lambda: 91000,
    "get_num_cublas_streams": lambda: 4,
    "get_stream_priority_range": lambda *args: (0, -1),
    "ubuf_built_with_mpi": lambda: False,
    "device_supports_multicast": lambda *args: False,
}


class CpuKernelModule(types.ModuleType):
    """A module of kernels on the CPU: a kernel TE's Python names that is not implemented refuses when called; a name
    TE's Python does not use is missing, as from TE's own extension (a `hasattr` probe answers False)."""

    cpu_kernel_layer = True
    kernel_prefix = ""
    names_used: frozenset | None = None  # None: any name (a stand-in package of TE's Triton kernels)

    def __getattr__(self, name: str):
        if name.startswith("__") or (self.names_used is not None and name not in self.names_used):
            raise AttributeError(f"module {self.__name__!r} has no attribute {name!r}")
        kernel = missing_kernel(self.kernel_prefix + name)
        setattr(self, name, kernel)
        return kernel


@functools.lru_cache(maxsize=None)
def names_te_uses() -> frozenset:
    """Every name of `transformer_engine_torch` that the installed TE's Python refers to (`tex.NAME`, or imported
    from it): read from its sources once, so that the layer follows the release installed."""
    spec = importlib.util.find_spec("transformer_engine")  # located, not imported
    root = Path(spec.origin).parent / "pytorch"
    names = set()
    for path in root.rglob("*.py"):
        text = path.read_text(errors="replace")
        names.update(re.findall(r"\btex\.(\w+)", text))
        for imported in re.findall(r"from transformer_engine_torch import \(?([\w\s,]+)\)?", text):
            names.update(word for word in re.split(r"[\s,]+", imported) if word and word != "as")
    return frozenset(names)


def refusing_module(name: str, kernel_prefix: str = "") -> CpuKernelModule:
    module = CpuKernelModule(name, "Kernels with no CPU implementation (megatron-zero-bubble): each refuses when called")
    module.kernel_prefix = kernel_prefix
    return module


def build() -> CpuKernelModule:
    module = CpuKernelModule(MODULE_NAME, "Transformer Engine's kernels in torch on the CPU (megatron-zero-bubble)")
    module.__file__ = __file__
    module.names_used = names_te_uses()
    contents = {**enums.ENUMS, **QUERIES, **norms.kernels(), **activations.kernels(), **softmax.kernels(),
                "generic_gemm": generic_gemm, "te_general_grouped_gemm": te_general_grouped_gemm}
    for name, value in contents.items():
        setattr(module, name, value)
    module.__all__ = sorted(contents)
    return module
