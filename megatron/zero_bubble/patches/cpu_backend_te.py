"""CPU backend, Transformer Engine part: TE's own Python (over te_cpu's kernels) and megatron's TE wrappers see the
CPU as "the GPU".

TE's modules check `torch.cuda.is_available()`, place tensors on `torch.cuda.current_device()` or `device="cuda"`,
ask for the device's compute capability (which decides what TE supports, FP8 among it) and open streams and NVTX
ranges. Every module of `transformer_engine` that is loaded when this installs, and megatron's
`megatron.core.extensions.transformer_engine*`, gets a `CpuTorch` for its global `torch` whose `cuda` answers as one
Hopper GPU (compute capability 9.0, the GPU most users train on) that is the CPU. torch itself is not changed, but
for the duration of the TE methods that check their inputs' `is_cuda` (`CHECK_INPUTS_ON_CUDA`). TE frees storages by
pointing them at an empty tensor of its own: a CPU one here. And megatron keeps its own optimizer and multi-tensor
loops (it binds TE's when TE imports). Installs only where TE runs on the CPU kernel layer, never over a real TE.
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import sys
import types

import torch

from ._patching import MegatronPatch, PatchError, module_functions
from .cpu_backend_torch import CpuCuda, CpuTorch

COMPUTE_CAPABILITY = (9, 0)
# TE's methods that refuse inputs whose `is_cuda` is False: they run with every tensor reporting CUDA.
CHECK_INPUTS_ON_CUDA = (
    ("transformer_engine.pytorch.module.base", "TransformerEngineBaseModule", "prepare_forward"),
    ("transformer_engine.pytorch.attention.dot_product_attention.dot_product_attention", "DotProductAttention",
     "forward"),
)
TE_PACKAGES = ("transformer_engine.", "megatron.core.extensions.transformer_engine")


class _NoNvtx:
    @staticmethod
    def range_push(msg):
        return 0

    @staticmethod
    def range_pop():
        return 0

    @staticmethod
    def range(msg, *args, **kwargs):
        return contextlib.nullcontext()


class HopperOnCpu(CpuCuda):
    """`torch.cuda` for TE on the CPU: one device, compute capability 9.0, no graphs, no NVTX."""

    nvtx = _NoNvtx()

    def __init__(self):
        super().__init__(report_device=True)

    def get_device_capability(self, device=None):
        return COMPUTE_CAPABILITY

    def get_device_properties(self, device=None):
        major, minor = COMPUTE_CAPABILITY
        return types.SimpleNamespace(name="CPU (Transformer Engine over CPU kernels)", major=major, minor=minor,
                                     multi_processor_count=132, total_memory=0)

    def is_current_stream_capturing(self) -> bool:
        return False

    def empty_cache(self) -> None:
        pass

    def is_bf16_supported(self, including_emulation: bool = True) -> bool:
        return True


def te_on_cpu_kernels() -> bool:
    """Whether TE's Python is loaded over te_cpu's kernel module."""
    return getattr(sys.modules.get("transformer_engine_torch"), "cpu_kernel_layer", False)


@contextlib.contextmanager
def tensors_report_cuda():
    """While the block runs, every tensor answers `is_cuda` True (TE's modules check their input's, once per forward).

    Like `cuda_calls_stay_on_cpu`, a change to torch confined to one wrapped call of TE's, undone when it exits."""
    own = torch.Tensor.__dict__.get("is_cuda")  # None: the C base class's descriptor
    torch.Tensor.is_cuda = property(lambda self: True)
    try:
        yield
    finally:
        if own is None:
            del torch.Tensor.is_cuda
        else:
            torch.Tensor.is_cuda = own


def _with_tensors_reporting_cuda(function):
    @functools.wraps(function)
    def call(*args, **kwargs):
        with tensors_report_cuda():
            result = function(*args, **kwargs)
        if hasattr(result, "__enter__") and not torch.is_tensor(result):  # a context manager (TE before 2.x)
            return _EnteredReportingCuda(result)
        return result

    return call


class _EnteredReportingCuda:
    """A context manager of TE's whose entry checks `is_cuda` (`prepare_forward` in older releases)."""

    def __init__(self, manager):
        self.manager = manager

    def __enter__(self):
        with tensors_report_cuda():
            return self.manager.__enter__()

    def __exit__(self, *exc):
        return self.manager.__exit__(*exc)


class TeCpuBackend(MegatronPatch):
    name = "cpu_backend_te"

    def apply(self, with_training: bool = False) -> None:
        """with_training: megatron.training is imported (its bindings of TE's kernels are replaced too)."""
        if not te_on_cpu_kernels():
            raise PatchError("patch 'cpu_backend_te': Transformer Engine is not loaded over the CPU kernel layer")
        cpu_torch = CpuTorch()
        cpu_torch.cuda = HopperOnCpu()
        for name, module in sorted(sys.modules.items()):
            if name.startswith(TE_PACKAGES) and module is not None and module.__dict__.get("torch") is torch:
                self.patches.replace(module, "torch", cpu_torch)
        arguments = sys.modules.get("megatron.training.arguments")  # --moe-grouped-gemm asks the compute capability
        if with_training and arguments is not None and arguments.__dict__.get("torch") is torch:
            self.patches.replace(arguments, "torch", cpu_torch)
        for module_name, class_name, method in CHECK_INPUTS_ON_CUDA:
            owner = getattr(importlib.import_module(module_name), class_name)
            self.patches.replace(owner, method, _with_tensors_reporting_cuda(getattr(owner, method)))
        self._torch_optimizer_in_megatron()
        # TE frees a tensor's storage by pointing its data at an empty CUDA tensor: an empty CPU one here.
        self._replace_in_te(importlib.import_module("transformer_engine.pytorch.utils"), "_empty_tensor",
                            lambda: torch.Tensor())

    def _torch_optimizer_in_megatron(self) -> None:
        """megatron binds TE's fused optimizers and multi-tensor kernels at import when TE imports; on the CPU it keeps
        what it binds without TE and apex (torch's optimizers, its own multi-tensor loops), as before TE's Python was
        installed: TE's optimizer kernels are not emulated. Modules not imported yet are left alone."""
        from megatron.core import utils

        local = {"multi_tensor_applier": utils.local_multi_tensor_applier,
                 "multi_tensor_scale_impl": utils.local_multi_tensor_scale}
        without_te = {
            "megatron.core.optimizer": {"Adam": torch.optim.AdamW, "SGD": torch.optim.SGD,
                                        "USING_PYTORCH_OPTIMIZER": True},
            "megatron.core.optimizer.distrib_optimizer": {"Adam": torch.optim.Adam, "USING_TE_OPTIMIZER": False,
                                                          "HAVE_APEX_OR_TE": False},
            "megatron.core.optimizer.optimizer": local,
            "megatron.core.optimizer.clip_grads": {**local, "l2_norm_impl": utils.local_multi_tensor_l2_norm,
                                                   "multi_tensor_scale_tensor_impl": None},
            "megatron.training.utils.common_utils": {"multi_tensor_applier": utils.local_multi_tensor_applier,
                                                     "multi_tensor_l2norm": utils.local_multi_tensor_l2_norm},
        }
        for module_name, bindings in without_te.items():
            module = sys.modules.get(module_name)
            for name, value in bindings.items() if module is not None else ():
                self.patches.replace(module, name, value)

    def _replace_in_te(self, source, attr: str, new) -> None:
        """source.attr and every TE module's by-name binding of the same object."""
        original = getattr(source, attr)
        for name, module in sorted(sys.modules.items()):
            if name.startswith(TE_PACKAGES) and module is not None and module.__dict__.get(attr) is original:
                self.patches.replace(module, attr, new)


install, uninstall, installed = module_functions(TeCpuBackend())
