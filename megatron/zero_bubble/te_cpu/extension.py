"""The module TE's Python imports as `transformer_engine_torch` (`tex`), made of the CPU kernels here.

Every name TE's Python reads exists: the enumerations, the kernels implemented here, a few queries answered as a
Hopper GPU with CUDA 12.9 libraries would answer them, and for every other kernel a stand-in that stops the run in one
line naming it (refusal.py).
"""
from __future__ import annotations

import types

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
    """A module of kernels on the CPU: what is not implemented is a kernel that refuses when called."""

    cpu_kernel_layer = True
    kernel_prefix = ""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        kernel = missing_kernel(self.kernel_prefix + name)
        setattr(self, name, kernel)
        return kernel


def refusing_module(name: str, kernel_prefix: str = "") -> CpuKernelModule:
    module = CpuKernelModule(name, "Kernels with no CPU implementation (megatron-zero-bubble): each refuses when called")
    module.kernel_prefix = kernel_prefix
    return module


def build() -> CpuKernelModule:
    module = CpuKernelModule(MODULE_NAME, "Transformer Engine's kernels in torch on the CPU (megatron-zero-bubble)")
    module.__file__ = __file__
    contents = {**enums.ENUMS, **QUERIES, **norms.kernels(), **activations.kernels(), **softmax.kernels(),
                "generic_gemm": generic_gemm, "te_general_grouped_gemm": te_general_grouped_gemm}
    for name, value in contents.items():
        setattr(module, name, value)
    module.__all__ = sorted(contents)
    return module
