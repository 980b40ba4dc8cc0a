"""The module TE's Python imports as `transformer_engine_torch` (`tex`), made of the CPU kernels here.

Every name TE's Python reads exists: the enumerations, the kernels implemented here, a few queries answered as a
Hopper GPU with CUDA 12.9 libraries would answer them, and for every other kernel a stand-in that stops the run in one
line naming it (refusal.py).
"""
from __future__ import annotations

import enum
import functools
import importlib.machinery
import re
import types
from pathlib import Path

from . import activations, enums, fp8, norms, padding, softmax
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
def _te_sources() -> str:
    spec = importlib.machinery.PathFinder.find_spec("transformer_engine")  # located (past our hook), not imported
    root = Path(spec.origin).parent / "pytorch"
    return "\n".join(path.read_text(errors="replace") for path in sorted(root.rglob("*.py")))


@functools.lru_cache(maxsize=None)
def names_te_uses() -> frozenset:
    """Every name of `transformer_engine_torch` that the installed TE's Python refers to (`tex.NAME`, or imported
    from it): read from its sources once, so that the layer follows the release installed."""
    return frozenset(re.findall(r"\btex\.(\w+)", _te_sources())) | _imported_names()


@functools.lru_cache(maxsize=None)
def _imported_names() -> frozenset:
    """The names TE's Python imports from transformer_engine_torch by name (`from transformer_engine_torch import X`)."""
    names = set()
    for imported in re.findall(r"from transformer_engine_torch import \(?([\w\s,]+)\)?", _te_sources()):
        names.update(word for word in re.split(r"[\s,]+", imported) if word and word != "as")
    return frozenset(names)


def enumerations() -> dict:
    """The enumerations the installed release uses: ours (enums.py), each with the members its Python names added
    (releases differ: 2.12's fused-attention backends include NVTE_F16_max512_seqlen), and one made for each other
    name it reads members of (2.5's Float8BlockScaleTensorFormat)."""
    text, made = _te_sources(), {}
    read: dict[str, set] = {}  # name -> the members TE's Python reads of it (tex.NAME.MEMBER, or NAME.MEMBER imported)
    pairs = re.findall(r"\btex\.(\w+)\.([A-Za-z]\w*)\b", text)
    if _imported_names():  # one pass over the sources for all of them
        pairs += re.findall(rf"\b({'|'.join(sorted(_imported_names()))})\.([A-Za-z]\w*)\b", text)
    for name, member in pairs:
        read.setdefault(name, set()).add(member)
    for name in sorted(names_te_uses()):
        named = read.get(name, set()) - {"cast"}
        base = enums.ENUMS.get(name)
        if name in enums.CLOSED or (base is None and not (named and name[0].isupper()
                                                          and not name.startswith("CommOverlap"))):
            continue
        members = {m.name: m.value for m in base} if base is not None else {}
        for member in sorted(named - set(members)):
            members[member] = max(members.values(), default=-1) + 1
        made[name] = enum.IntEnum(name, members) if base is None or len(members) > len(base) else base
    return {**enums.ENUMS, **made}


def refusing_module(name: str, kernel_prefix: str = "") -> CpuKernelModule:
    module = CpuKernelModule(name, "Kernels with no CPU implementation (megatron-zero-bubble): each refuses when called")
    module.kernel_prefix = kernel_prefix
    return module


def build() -> CpuKernelModule:
    module = CpuKernelModule(MODULE_NAME, "Transformer Engine's kernels in torch on the CPU (megatron-zero-bubble)")
    module.__file__ = __file__
    module.names_used = names_te_uses()
    contents = {**enumerations(), **QUERIES, **norms.kernels(), **activations.kernels(), **softmax.kernels(),
                **fp8.kernels(), **padding.kernels(),
                "generic_gemm": generic_gemm, "te_general_grouped_gemm": te_general_grouped_gemm}
    for name, value in contents.items():
        setattr(module, name, value)
    module.__all__ = sorted(contents)
    return module
