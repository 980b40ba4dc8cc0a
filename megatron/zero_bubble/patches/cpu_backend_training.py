"""CPU backend, training-loop part: Megatron's own `pretrain()` (megatron.training) on CPU with gloo.

Installs the core part first (cpu_backend_core.py), then:
- `initialize.py` sees a `torch` whose `torch.cuda` reports one device: `initialize_megatron` asserts
  CUDA unless `allow_no_cuda=True` (which `pretrain()` never passes), and with zero devices
  `_initialize_distributed` silently skips `initialize_model_parallel` and the model-parallel seed;
- `set_jit_fusion_options` is skipped: it warms the fused kernels up on CUDA tensors;
- the modules in `TRAINING_MODULES_SEEING_CPU_AS_CUDA` see the CPU as the device (device='cuda'
  literals, `torch.cuda.Stream` / `torch.cuda.stream` around DDP construction, CUDA RNG state);
- `get_model` and the model builder's chunk preparation run with `.cuda()` as identity (they move the
  model with `model_module.cuda(...)`);
- `get_device_arch_version` (asked when TP > 1) answers 0: no GPU architecture, so the
  pre-Blackwell rules apply (export CUDA_DEVICE_MAX_CONNECTIONS=1 for TP > 1).
"""
from __future__ import annotations

import importlib

from . import cpu_backend_core
from ._patching import MegatronPatch, module_functions
from .cpu_backend_core import see_cpu_as_cuda
from .cpu_backend_torch import CpuTorch, with_cuda_calls_on_cpu

TRAINING_MODULES_SEEING_CPU_AS_CUDA = (
    "megatron.training.training",  # device='cuda' literals, streams around DDP, memory reports
    "megatron.training.models.dist_utils",  # streams around DDP in the model-builder path
    "megatron.training.checkpointing",  # CUDA RNG state saved / restored, iteration all-reduce
    "megatron.training.utils.common_utils",  # loss and norm reductions on device='cuda'
    # torch_dist checkpoint save / load (fully parallel *load* with .cuda() calls is not covered):
    "megatron.core.dist_checkpointing.strategies.filesystem_async",  # synchronize before writing
    "megatron.core.dist_checkpointing.strategies.fully_parallel",  # synchronize around the exchange
    "megatron.core.dist_checkpointing.strategies.state_dict_saver",  # verification flags on 'cuda'
    "megatron.core.dist_checkpointing.strategies.async_utils",  # liveness flags, synchronize
)
NO_GPU_ARCH_VERSION = 0


class TrainingCpuBackend(MegatronPatch):
    """The training-loop part (after the core part); `install(force)` is idempotent."""

    name = "cpu_backend_training"

    def apply(self, force: bool = False) -> None:
        cpu_backend_core.install(force=force)
        self._see_cpu_as_cuda()
        self._skip_cuda_only_setup()
        self._keep_models_on_cpu()
        arguments = importlib.import_module("megatron.training.arguments")
        self.patches.replace(arguments, "get_device_arch_version", lambda: NO_GPU_ARCH_VERSION)

    def _see_cpu_as_cuda(self) -> None:
        see_cpu_as_cuda(self.patches, TRAINING_MODULES_SEEING_CPU_AS_CUDA, CpuTorch())
        # Only initialisation is told that there is a device; elsewhere is_available() stays False.
        see_cpu_as_cuda(self.patches, ("megatron.training.initialize",), CpuTorch(report_device=True))

    def _skip_cuda_only_setup(self) -> None:
        initialize = importlib.import_module("megatron.training.initialize")
        training = importlib.import_module("megatron.training.training")

        def skipped(*args, **kwargs) -> None:
            return None

        # pretrain() calls the name bound in training.py; initialize.py keeps its own for other callers.
        self.patches.replace(initialize, "set_jit_fusion_options", skipped)
        self.patches.replace(training, "set_jit_fusion_options", skipped)

    def _keep_models_on_cpu(self) -> None:
        training = importlib.import_module("megatron.training.training")
        dist_utils = importlib.import_module("megatron.training.models.dist_utils")
        for module, name in ((training, "get_model"), (dist_utils, "prepare_existing_model_chunks_for_distributed_training")):
            self.patches.replace(module, name, with_cuda_calls_on_cpu(getattr(module, name)))


install, uninstall, installed = module_functions(TrainingCpuBackend())
