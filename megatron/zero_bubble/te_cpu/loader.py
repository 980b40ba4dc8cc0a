"""Puts the CPU kernel module in front of Transformer Engine's Python, before anything imports TE.

TE's `transformer_engine/common/__init__.py` loads CUDA libraries at import unless `NVTE_PROJECT_BUILDING` is set, and
`transformer_engine/pytorch/__init__.py` then calls `load_framework_extension("torch")`, which loads the compiled
extension into `sys.modules["transformer_engine_torch"]`. An import hook wraps the loading of
`transformer_engine.common`: it runs with `NVTE_PROJECT_BUILDING=1` (restored after), and its
`load_framework_extension` is replaced by one that registers the CPU module instead. TE's own files are not touched;
`uninstall()` removes the hook (a TE already imported stays as it is).
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import os
import sys

COMMON = "transformer_engine.common"
TRITON_KERNELS = "transformer_engine.pytorch.triton"  # TE's Triton kernels: a package of refusing stand-ins here


def te_python_version() -> str | None:
    """The installed `transformer-engine` release, or None."""
    try:
        return importlib.metadata.version("transformer-engine")
    except importlib.metadata.PackageNotFoundError:
        return None


def te_extension_installed() -> bool:
    """Whether TE's compiled PyTorch extension (a GPU install) is there: then nothing here is used."""
    try:
        importlib.metadata.version("transformer-engine-torch")
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


class _CommonLoader(importlib.abc.Loader):
    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        saved = {name: os.environ.get(name) for name in ("NVTE_PROJECT_BUILDING", "NVTE_RELEASE_BUILD")}
        os.environ["NVTE_PROJECT_BUILDING"] = "1"  # no CUDA libraries loaded by ctypes
        os.environ.pop("NVTE_RELEASE_BUILD", None)
        try:
            self.loader.exec_module(module)
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
        module.load_framework_extension = _load_cpu_extension


def _load_cpu_extension(framework: str) -> None:
    """TE's `load_framework_extension`, for the CPU: the torch extension is the CPU kernel module; no other."""
    if framework != "torch":
        raise ImportError(f"Transformer Engine on the CPU: only the torch extension is provided, not {framework}")
    from . import extension  # torch, only once TE is imported

    sys.modules.setdefault(extension.MODULE_NAME, extension.build())


class _TritonKernelsLoader(importlib.abc.Loader):
    """TE's Triton kernels need triton and a GPU: each module of that package is one whose kernels refuse."""

    def create_module(self, spec):
        from . import extension

        return extension.refusing_module(spec.name, kernel_prefix=f"triton.{spec.name.rpartition('.')[2]}.")

    def exec_module(self, module):
        module.__path__ = []  # a package: its submodules come through the same loader


class _Finder(importlib.abc.MetaPathFinder):
    hidden = False  # TE not wanted in this process: it imports as if not installed

    def find_spec(self, name, path, target=None):
        if self.hidden and name.split(".")[0] in ("transformer_engine", "transformer_engine_torch"):
            raise ModuleNotFoundError(f"No module named {name!r} (Transformer Engine is hidden on the CPU: megatron's "
                                      f"local layers were asked for)", name=name)
        if name == TRITON_KERNELS or name.startswith(TRITON_KERNELS + "."):
            return importlib.util.spec_from_loader(name, _TritonKernelsLoader(), is_package=True)
        if name != COMMON:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None:
            spec.loader = _CommonLoader(spec.loader)
        return spec


_FINDER = _Finder()


def install(hidden: bool = False) -> bool:
    """Install the hook where TE's Python is there without its extension; True when TE will run on CPU kernels.

    hidden: TE imports as if it were not installed (megatron then binds what it binds without TE, and the process is
    spared TE's import), for processes that run megatron's local layers. Must run before anything imports
    transformer_engine (megatron-core does, at its own import)."""
    if te_python_version() is None or te_extension_installed():
        return False
    if "transformer_engine" in sys.modules and not installed():
        raise RuntimeError("Transformer Engine was imported before its CPU kernel layer was installed")
    _FINDER.hidden = hidden
    # TE's fusions (jit_fuser) as the plain functions they wrap, as megatron's are on the CPU: torch.compile costs
    # each process tens of seconds there for no gain (a value already set is kept)
    os.environ.setdefault("NVTE_TORCH_COMPILE", "0")
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)
    return not hidden


def installed() -> bool:
    return _FINDER in sys.meta_path


def uninstall() -> None:
    if _FINDER in sys.meta_path:
        sys.meta_path.remove(_FINDER)
