"""CPU backend: run megatron-core (and optionally megatron.training) on a machine without CUDA, with gloo.

    from megatron.zero_bubble.patches import cpu_backend
    cpu_backend.install()               # core: schedules, GPTModel, DDP, optimizer
    cpu_backend.install(training=True)  # also Megatron's training loop (imports megatron.training)

The patches live in cpu_backend_core.py, cpu_backend_moe.py (MoE layers), cpu_backend_norm.py (the local
spec's norm under sequence parallelism), cpu_backend_training.py and, where Transformer Engine's Python runs over
the CPU kernel layer (te_cpu), cpu_backend_te.py (one PatchSet each), on top of the import shims in imports.py; `uninstall()` restores every replaced attribute. On a machine with CUDA,
`install()` raises PatchError unless `force=True`: GPU runs must not use it.
"""
from __future__ import annotations

import sys

from . import cpu_backend_core, cpu_backend_moe, cpu_backend_norm, cpu_backend_te
from .cpu_backend_core import cuda_available

__all__ = ["cuda_available", "install", "installed", "uninstall"]


def install(training: bool = False, force: bool = False) -> None:
    """Apply the core CPU patches, and with `training=True` the training-loop ones (idempotent)."""
    cpu_backend_core.install(force=force)
    cpu_backend_moe.install(force=force)
    cpu_backend_norm.install(force=force)
    if training:
        from . import cpu_backend_training  # imports megatron.training: only when asked for

        cpu_backend_training.install(force=force)
    if cpu_backend_te.te_on_cpu_kernels():  # last: megatron.training binds TE's kernels at its import too
        cpu_backend_te.install("megatron.training" in sys.modules)


def uninstall() -> None:
    """Undo everything `install()` applied (the Transformer Engine part first, the core part last)."""
    cpu_backend_te.uninstall()
    training = sys.modules.get(f"{__package__}.cpu_backend_training")
    if training is not None:
        training.uninstall()
    cpu_backend_norm.uninstall()
    cpu_backend_moe.uninstall()
    cpu_backend_core.uninstall()


def installed() -> bool:
    return cpu_backend_core.installed()
