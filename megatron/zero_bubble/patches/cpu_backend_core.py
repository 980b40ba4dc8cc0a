"""CPU backend, core part: megatron-core's schedules, GPTModel, DDP and optimizer on CPU with gloo.

Patches (each needed on some CPU code path, each proven necessary by switching it off):
- the module global `torch` of the modules listed in `MODULES_SEEING_CPU_AS_CUDA` becomes a `CpuTorch`
  (cpu_backend_torch.py): `torch.cuda.current_device()` -> cpu, `synchronize()` -> no-op,
  `current_stream()` / `Stream` / `stream()` -> do-nothing streams, `device="cuda"` factories -> cpu;
- the RNG tracker's `_get_cuda_rng_state` / `_set_cuda_rng_state` act on the CPU generator (its `add`
  already goes through the patched `torch.cuda` of tensor_parallel/random.py);
- `clip_grad_by_total_norm_fp32` without its `torch.cuda.FloatTensor` type assert;
- the bf16/fp16 and distributed optimizers' constructors see CUDA type names for their CPU parameters (they
  sort params by them): each parameter gets a `type` of its own while the constructor runs;
- `LanguageModule.setup_embeddings_and_output_layer` runs with `.cuda()` as identity (tied embeddings
  across pipeline stages move the output-layer copy with `weight.data.cuda()`);
- the tracker's warning "CPU RNG state changed within GPU RNG context" is filtered out of its logger:
  here the device generator *is* the CPU one, so every forked draw (weight init, dropout) would warn;
- megatron's gradient-accumulation fusion (its default; the layers' fused weight-gradient GEMM into `main_grad`)
  gets apex's `fused_weight_gradient_mlp_cuda`, emulated on the CPU (`ApexWgradOnCpu`, labelled as such).

torch itself is not modified (except inside that one call, see `cuda_calls_stay_on_cpu`): only names
inside megatron modules are rebound, and `uninstall()` puts every one of them back.
"""
from __future__ import annotations

import functools
import importlib
import logging

import torch

from . import imports
from ._patching import MegatronPatch, PatchError, PatchSet, module_functions
from .cpu_backend_torch import CpuTorch, with_cuda_calls_on_cpu

RNG_TRACKER_LOGGER = "megatron.core.tensor_parallel.random"
CUDA_TYPE_NAMES_IN_CONSTRUCTORS = (
    ("megatron.core.optimizer.optimizer", "Float16OptimizerWithFloat16Params"),
    ("megatron.core.optimizer.distrib_optimizer", "DistributedOptimizer"),
)
RNG_FORK_WARNING = "CPU RNG state changed within GPU RNG context"
# megatron modules that call apex's fused_weight_gradient_mlp_cuda by its global name
GRADIENT_ACCUMULATION_FUSION_USERS = ("megatron.core.tensor_parallel.layers",)

# Modules whose functions on the CPU path use torch.cuda.* or device="cuda"; why, in one line each.
MODULES_SEEING_CPU_AS_CUDA = (
    "megatron.core.pipeline_parallel.schedules",  # total_num_tokens counters on device="cuda"
    "megatron.core.pipeline_parallel.p2p_communication",  # receive buffers, synchronize after batched p2p
    "megatron.core.transformer.utils",  # default causal mask, built on middle stages
    "megatron.core.tensor_parallel.layers",  # weights created on current_device() (no CPU initialisation)
    "megatron.core.tensor_parallel.random",  # tracker.add seeds and reads the "cuda" generator
    "megatron.core.tensor_parallel.mappings",  # sequence-parallel gathers / scatters, MoE all-to-all outputs
    "megatron.core.utils",  # GlobalMemoryBuffer (p2p shapes), local l2 norm result
    "megatron.core.timers",  # synchronize and all-gather buffer when the training loop times things
    "megatron.core.distributed.param_and_grad_buffer",  # grad buffers, current_stream() in grad sync
    "megatron.core.optimizer.optimizer",  # found_inf / scale flags on device="cuda"
    "megatron.core.optimizer.clip_grads",  # norm accumulators on device="cuda"
    "megatron.core.optimizer.distrib_optimizer",  # shard buffers and checkpoint gathers on the current device
    "megatron.core.optimizer.grad_scaler",  # the fp16 loss scale and its counters on device="cuda"
    "megatron.core.rerun_state_machine",  # result checks on device="cuda", CUDA RNG state save/restore
    "megatron.core.models.common.embeddings.rotary_pos_embedding",  # RoPE's inv_freq on current_device()
    "megatron.core.transformer.multi_token_prediction",  # MTP loss trackers on current_device()
    "megatron.core.models.common.embeddings.yarn_rotary_pos_embedding",  # YaRN RoPE (MLA): inv_freq likewise
)


def cuda_available() -> bool:
    """Whether this process sees a CUDA device (the CPU backend is meant for machines that do not)."""
    return torch.cuda.is_available()


def see_cpu_as_cuda(patches: PatchSet, module_names, cpu_torch: CpuTorch) -> None:
    """Give each named megatron module `cpu_torch` as its global `torch` (every part of the CPU backend does so)."""
    for name in module_names:
        module = importlib.import_module(name)
        if module.__dict__.get("torch") is not torch:
            raise PatchError(f"patch '{patches.name}': {name}.torch is not the torch module")
        patches.replace(module, "torch", cpu_torch)


class CoreCpuBackend(MegatronPatch):
    """The core part; `install(force)` is idempotent, `uninstall()` restores megatron-core."""

    name = "cpu_backend_core"

    def __init__(self):
        super().__init__()
        self.rng_warning_filter = lambda record: record.getMessage() != RNG_FORK_WARNING

    def apply(self, force: bool = False) -> None:
        if cuda_available() and not force:
            raise PatchError(
                "CUDA is available: the CPU backend is for machines without a GPU (pass force=True to use it anyway)"
            )
        imports.ensure_installed()  # megatron.core must import before it can be patched
        see_cpu_as_cuda(self.patches, MODULES_SEEING_CPU_AS_CUDA, CpuTorch())
        self._patch_rng_tracker()
        self._patch_clip_grads()
        self._patch_tied_embedding_setup()
        self._patch_cuda_type_names()
        self._patch_gradient_accumulation_fusion()
        logging.getLogger(RNG_TRACKER_LOGGER).addFilter(self.rng_warning_filter)

    def uninstall(self) -> None:
        logging.getLogger(RNG_TRACKER_LOGGER).removeFilter(self.rng_warning_filter)
        super().uninstall()

    def _patch_rng_tracker(self) -> None:
        # The originals go through torch.cuda.default_generators and _lazy_call, which on a CPU build
        # silently never runs the setter: the tracker's fork would not switch states at all.
        random = importlib.import_module("megatron.core.tensor_parallel.random")

        def get_rng_state(device="cuda", clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
            return torch.get_rng_state()  # a fresh tensor already, so `clone` needs nothing more

        def set_rng_state(new_state: torch.Tensor, device=-1, graph_safe: bool = False) -> None:
            torch.set_rng_state(new_state)

        self.patches.replace(random, "_get_cuda_rng_state", get_rng_state)
        self.patches.replace(random, "_set_cuda_rng_state", set_rng_state)

    def _patch_clip_grads(self) -> None:
        # The original asserts `param.grad.type() == 'torch.cuda.FloatTensor'`, a Tensor method that no
        # name rebinding can reach; this copy checks for fp32 instead and scales with megatron's own
        # multi-tensor applier. It is bound by name in optimizer.py, so it is replaced there too.
        clip_grads = importlib.import_module("megatron.core.optimizer.clip_grads")
        optimizer = importlib.import_module("megatron.core.optimizer.optimizer")
        original = clip_grads.clip_grad_by_total_norm_fp32

        @functools.wraps(original)
        def clip_grad_by_total_norm_fp32(parameters, max_norm, total_norm, use_decoupled_grad: bool = False):
            if use_decoupled_grad:
                return original(parameters, max_norm, total_norm, use_decoupled_grad=True)
            grads = [clip_grads.to_local_if_dtensor(p.grad).detach() for p in parameters if p.grad is not None]
            if any(g.dtype != torch.float32 for g in grads):
                raise PatchError("clip_grad_by_total_norm_fp32 expects fp32 gradients")
            clip_coeff = max_norm / (total_norm + 1.0e-6)
            if clip_coeff < 1.0:
                overflow_flag = torch.zeros(1, dtype=torch.int)
                clip_grads.multi_tensor_applier(
                    clip_grads.multi_tensor_scale_impl, overflow_flag, [grads, grads], clip_coeff
                )

        self.patches.replace(clip_grads, "clip_grad_by_total_norm_fp32", clip_grad_by_total_norm_fp32)
        self.patches.replace(optimizer, "clip_grad_by_total_norm_fp32", clip_grad_by_total_norm_fp32)

    def _patch_tied_embedding_setup(self) -> None:
        language_module = importlib.import_module("megatron.core.models.common.language_module.language_module")
        module_class = language_module.LanguageModule
        wrapped = with_cuda_calls_on_cpu(module_class.setup_embeddings_and_output_layer)
        self.patches.replace(module_class, "setup_embeddings_and_output_layer", wrapped)

    def _patch_gradient_accumulation_fusion(self) -> None:
        # megatron binds apex's module at import where apex is built (never on a CPU machine) and refuses
        # gradient_accumulation_fusion without it; its layers call it by that global name
        for name in GRADIENT_ACCUMULATION_FUSION_USERS:
            module = importlib.import_module(name)
            if "fused_weight_gradient_mlp_cuda" not in vars(module):
                self.patches.add(module, "fused_weight_gradient_mlp_cuda", ApexWgradOnCpu)
        layers = importlib.import_module("megatron.core.tensor_parallel.layers")
        self.patches.replace(layers, "_grad_accum_fusion_available", True)

    def _patch_cuda_type_names(self) -> None:
        # The mixed-precision and distributed optimizers sort parameters by `param.type()` names
        # ('torch.cuda.BFloat16Tensor', ...) in their constructors, which CPU tensors never have; inside those
        # constructors alone, type() reports the CUDA name of a CPU tensor's type.
        for module_name, class_name in CUDA_TYPE_NAMES_IN_CONSTRUCTORS:
            owner = getattr(importlib.import_module(module_name), class_name)
            self.patches.replace(owner, "__init__", _with_cuda_type_names(owner.__init__))


class ApexWgradOnCpu:
    """EMULATION of apex's `fused_weight_gradient_mlp_cuda` on the CPU: the weight gradient d_output^T @ input (both
    flattened to 2-D) formed in float32 and added into `d_weight` (megatron's main_grad), as apex's GEMM does with
    cuBLAS's float32 compute type and beta = 1; rounded once into a 16-bit main_grad."""

    @staticmethod
    def _product(input: torch.Tensor, d_output: torch.Tensor) -> torch.Tensor:
        return d_output.reshape(-1, d_output.shape[-1]).float().t() @ input.reshape(-1, input.shape[-1]).float()

    @staticmethod
    def wgrad_gemm_accum_fp32(input: torch.Tensor, d_output: torch.Tensor, d_weight: torch.Tensor) -> None:
        if d_weight.dtype != torch.float32:
            raise TypeError(f"wgrad_gemm_accum_fp32: d_weight is {d_weight.dtype}, expected float32")
        d_weight.add_(ApexWgradOnCpu._product(input, d_output))

    @staticmethod
    def wgrad_gemm_accum_fp16(input: torch.Tensor, d_output: torch.Tensor, d_weight: torch.Tensor) -> None:
        if d_weight.dtype not in (torch.float16, torch.bfloat16):
            raise TypeError(f"wgrad_gemm_accum_fp16: d_weight is {d_weight.dtype}, expected float16 or bfloat16")
        d_weight.copy_(d_weight.float() + ApexWgradOnCpu._product(input, d_output))


def _with_cuda_type_names(function):
    """The constructor, with each parameter of its torch optimizer (its first argument) reporting the CUDA name
    of its type while it runs: a `type` of that one object's own, removed afterwards; torch is left alone."""
    @functools.wraps(function)
    def wrapper(self, optimizer, *args, **kwargs):
        names = PatchSet("cuda type names")
        for group in getattr(optimizer, "param_groups", ()):
            for param in group["params"]:
                if param.device.type == "cpu" and "type" not in vars(param):
                    names.shadow(param, "type", functools.partial(_cuda_type_name, param))
        try:
            return function(self, optimizer, *args, **kwargs)
        finally:
            names.restore()

    return wrapper


def _cuda_type_name(tensor, *type_args, **type_kwargs):
    name = torch.Tensor.type(tensor, *type_args, **type_kwargs)
    return name if type_args or type_kwargs else name.replace("torch.", "torch.cuda.", 1)


install, uninstall, installed = module_functions(CoreCpuBackend())
