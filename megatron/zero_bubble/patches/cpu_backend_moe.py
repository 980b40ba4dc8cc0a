"""CPU backend, MoE part: megatron-core's mixture-of-experts layers (router, token dispatcher, local
experts) on CPU with gloo.

The modules in `MOE_MODULES_SEEING_CPU_AS_CUDA` get a `CpuTorch` for their module global `torch`
(cpu_backend_torch.py), the same stand-in the core part uses:
- `token_dispatcher`: the alltoall dispatcher makes a `torch.cuda.Stream()` for its device-to-host copies
  when the first one is built (a class attribute), and switches to it with `torch.cuda.stream(...)`;
- `router`: the gate moves its weight to `torch.cuda.current_device()` before each forward and builds its
  expert-bias / global-aux-loss buffers there.
The router's `_apply_expert_bias` runs as the plain method megatron wrote, not as the `torch.compile` of it
that megatron's `jit_fuser` made at import: on CPU the compilation costs seconds per process for a few
additions, and dynamo's cache of it keeps every router it saw (and through them the process groups of
finished runs) alive. (The same reason the CPU defaults switch megatron's other fusions off.)
And the dispatcher's `maybe_move_tensor_to_cpu` (bound by name from moe_utils) turns a CPU tensor into a numpy
array when asked `as_numpy`, as its device-to-host copy does on a GPU: it leaves tensors already on the CPU
alone, and torch's all_to_all_single takes the split sizes as a sequence of ints, not as a tensor.

Megatron keeps the dispatcher's stream in a class attribute once made; `uninstall()` forgets it again when
it is ours (a do-nothing stream), so that a later run with CUDA would make a real one.

Installs the core part first (cpu_backend_core.py). The grouped experts (`--moe-grouped-gemm`: Transformer
Engine's TEGroupedMLP) run on TE's CPU kernel layer (te_cpu). Not covered, and refused at start-up by
pretrain_gpt.py on CPU: fused permutation (Transformer Engine's kernels), the flex dispatcher (DeepEP /
HybridEP), shared-expert overlap (a CUDA stream on purpose). MoE paged stashing needs triton (imports.py's stub
raises).
"""
from __future__ import annotations

import functools
import importlib

import torch

from . import cpu_backend_core
from ._patching import MegatronPatch, PatchError, module_functions
from .cpu_backend_core import see_cpu_as_cuda
from .cpu_backend_torch import CpuTorch, NullStream

MOE_MODULES_SEEING_CPU_AS_CUDA = (
    "megatron.core.transformer.moe.token_dispatcher",  # torch.cuda.Stream() for device-to-host copies
    "megatron.core.transformer.moe.router",  # gate weight and expert-bias buffers on current_device()
)
DISPATCHER = ("megatron.core.transformer.moe.token_dispatcher", "MoEAlltoAllTokenDispatcher", "cuda_dtoh_stream")


class MoeCpuBackend(MegatronPatch):
    """`install(force)` is idempotent; `uninstall()` restores megatron-core."""

    name = "cpu_backend_moe"

    def apply(self, force: bool = False) -> None:
        cpu_backend_core.install(force=force)  # refuses a machine with CUDA unless forced
        see_cpu_as_cuda(self.patches, MOE_MODULES_SEEING_CPU_AS_CUDA, CpuTorch())
        module_name, class_name, attribute = DISPATCHER
        dispatcher = importlib.import_module(module_name)
        if not hasattr(getattr(dispatcher, class_name), attribute):
            raise PatchError(f"patch 'cpu_backend_moe': {class_name}.{attribute} does not exist; written for 0.19.x")
        self._split_sizes_as_numpy(dispatcher)
        self._expert_bias_not_compiled()

    def _expert_bias_not_compiled(self) -> None:
        router = importlib.import_module("megatron.core.transformer.moe.router").TopKRouter
        compiled = router.__dict__.get("_apply_expert_bias")
        plain = getattr(compiled, "_torchdynamo_orig_callable", None)  # absent: jit_fuser did not compile it
        if plain is not None:
            self.patches.replace(router, "_apply_expert_bias", plain)

    def _split_sizes_as_numpy(self, dispatcher) -> None:
        original = self.patches.original(dispatcher, "maybe_move_tensor_to_cpu")

        @functools.wraps(original)
        def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
            if as_numpy and torch.is_tensor(tensor) and tensor.device.type == "cpu":
                return tensor.numpy()
            return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

        self.patches.replace(dispatcher, "maybe_move_tensor_to_cpu", maybe_move_tensor_to_cpu)

    def uninstall(self) -> None:
        if self.installed:
            module_name, class_name, attribute = DISPATCHER
            owner = getattr(importlib.import_module(module_name), class_name)
            if isinstance(getattr(owner, attribute, None), NullStream):
                setattr(owner, attribute, None)
        super().uninstall()


install, uninstall, installed = module_functions(MoeCpuBackend())
