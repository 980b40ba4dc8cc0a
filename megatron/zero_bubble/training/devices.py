"""Which device each rank computes on, chosen explicitly.

- CUDA where it exists: megatron puts local rank i on GPU i.
- `--zero-bubble-cpu`: the CPU backend and gloo, only when asked for; without it a machine where torch sees no CUDA
  device stops at start-up (a GPU node with a broken driver would otherwise train on the CPU without a word).
- `--zero-bubble-share-gpus`: more ranks on a node than GPUs, rank i on GPU (i mod GPUs). NCCL refuses two ranks
  of one communicator on one GPU, so every group is gloo (`--distributed-backend gloo`), and the runtime's
  pipeline messages travel through host copies (runtime/p2p.py `wire_device`). Compute, the split, the stores,
  the optimizer and memory stay on CUDA. Meant for checking a pipeline on fewer GPUs than ranks (one lent GPU:
  `scripts/gpu_check.sh`), not for speed: the ranks take turns on the GPU.
"""
from __future__ import annotations

import importlib.util

import os

from .flags import ON_CPU, SHARE_GPUS, StartupRefusal, cuda_available

# Parallelism whose collectives the shared mode has not run (gloo has no reduce-scatter for CUDA tensors).
_NOT_SHARED = {"tensor_model_parallel_size": "--tensor-model-parallel-size",
               "context_parallel_size": "--context-parallel-size",
               "expert_model_parallel_size": "--expert-model-parallel-size"}


def check_device_choice(args, cuda: bool | None = None) -> None:
    """The CPU only when asked for; `cuda`: whether torch sees a CUDA device (default: ask torch)."""
    cpu = getattr(args, "zero_bubble_cpu", False)
    if cpu and getattr(args, "zero_bubble_share_gpus", False):
        raise StartupRefusal(f"{ON_CPU} and {SHARE_GPUS} ask for different devices; keep one of them")
    if not cpu and not (cuda_available() if cuda is None else cuda):
        raise StartupRefusal(f"no CUDA device here (torch.cuda.is_available() is False: check the driver and "
                             f"CUDA_VISIBLE_DEVICES); to train on the CPU with gloo (slow), add {ON_CPU}")


def hide_gpus_if_asked(argv: list[str]) -> None:
    """With --zero-bubble-cpu, torch sees no GPU: set before torch first asks CUDA for its devices."""
    if ON_CPU in argv:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""


# megatron's defaults that need apex's kernels with --transformer-impl local (each stopped a run on a GPU without apex:
# an assert, or a missing module, inside megatron).
_APEX_DEFAULTS = {"--no-persist-layer-norm": lambda args: not args.no_persist_layer_norm,
                  "--no-masked-softmax-fusion": lambda args: args.masked_softmax_fusion,
                  "--no-gradient-accumulation-fusion": lambda args: args.gradient_accumulation_fusion}


def transformer_engine_asked_for(argv) -> bool:
    """Whether the command line leaves megatron's default layers, Transformer Engine's, in place (no `--transformer-impl
    local`): read before megatron is imported, which decides on the CPU whether TE's Python is loaded or hidden."""
    for i, word in enumerate(argv):
        value = word.partition("=")[2] if word.startswith("--transformer-impl=") else (
            argv[i + 1] if word == "--transformer-impl" and i + 1 < len(argv) else None)
        if value is not None:
            return value != "local"
    return True


def check_gpu_kernels(args, apex: bool | None = None, transformer_engine: bool | None = None) -> None:
    """On CUDA: the layer implementation asked for is installed, and megatron's local layers are not asked for apex's
    kernels where apex is missing (`apex`, `transformer_engine`: whether installed; default: look)."""
    from ..patches.te_wgrad import installed_version

    te_installed = installed_version() is not None if transformer_engine is None else transformer_engine
    if args.transformer_impl == "transformer_engine":
        if not te_installed:
            raise StartupRefusal("--transformer-impl transformer_engine (megatron's default) needs transformer-engine, "
                                 "which is not installed; install it or add --transformer-impl local")
        return
    if _rotary(args) and getattr(args, "apply_rope_fusion", False) and not te_installed:
        raise StartupRefusal("--position-embedding-type rope: megatron's RoPE fusion (on unless --no-rope-fusion) is "
                             "Transformer Engine's kernel, which is not installed; add --no-rope-fusion (or install "
                             "transformer-engine)")
    if apex if apex is not None else importlib.util.find_spec("apex") is not None:
        return
    missing = [flag for flag, asks_for_apex in _APEX_DEFAULTS.items() if asks_for_apex(args)]
    if missing:
        raise StartupRefusal(f"--transformer-impl local without apex: megatron's defaults ask for apex's kernels; add "
                             f"{' '.join(missing)} (or install apex)")


def _rotary(args) -> bool:
    """Rotary position embeddings, as megatron reads the flags (the legacy --use-rotary-position-embeddings too)."""
    return getattr(args, "position_embedding_type", None) == "rope" or getattr(args, "use_rotary_position_embeddings",
                                                                             False)


def check_shared_gpus(args, through_runtime: bool, cuda: bool | None = None) -> None:
    """Refuse what the shared mode cannot run, in one line naming the flag (`cuda`: whether there are GPUs; default:
    ask torch)."""
    if not getattr(args, "zero_bubble_share_gpus", False):
        return
    if not (cuda_available() if cuda is None else cuda):
        raise StartupRefusal(f"{SHARE_GPUS} shares GPUs, and this machine has none; drop the flag")
    if args.distributed_backend != "gloo":
        raise StartupRefusal(f"{SHARE_GPUS} needs --distributed-backend gloo (NCCL refuses two ranks on one GPU); "
                             f"add it")
    if not through_runtime:
        raise StartupRefusal(f"{SHARE_GPUS}: megatron's own schedules send CUDA tensors, which gloo cannot; add a "
                             f"zero-bubble schedule, or --enable-zb-runtime for 1F1B through the runtime")
    for name, flag in _NOT_SHARED.items():
        if (getattr(args, name, 1) or 1) > 1:
            raise StartupRefusal(f"{SHARE_GPUS} runs pipeline and data parallelism only; drop {flag}")
    if args.overlap_grad_reduce or args.overlap_param_gather:
        raise StartupRefusal(f"{SHARE_GPUS} reduces gradients synchronously (gloo cannot coalesce CUDA collectives); "
                             f"drop --overlap-grad-reduce / --overlap-param-gather")
    if args.use_distributed_optimizer:
        raise StartupRefusal(f"{SHARE_GPUS} cannot run --use-distributed-optimizer (gloo has no reduce-scatter for "
                             f"CUDA tensors); drop one of them")


def place_ranks(args) -> None:
    """With shared GPUs: the GPU megatron sets for this rank (it sets GPU `args.local_rank`), and megatron's gradient
    reduction one collective at a time (gloo reduces CUDA tensors, but not coalesced: patches/gloo_on_cuda.py)."""
    if getattr(args, "zero_bubble_share_gpus", False):
        import torch

        from ..patches import gloo_on_cuda

        args.local_rank %= torch.cuda.device_count()
        gloo_on_cuda.install()
