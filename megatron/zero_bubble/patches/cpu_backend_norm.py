"""CPU backend, norm part: the local layer spec's norm under sequence parallelism.

Without apex or Transformer Engine, megatron-core's local spec builds its norms with `WrappedTorchNorm`,
which asserts `not config.sequence_parallel`. The norm itself does not care: LayerNorm and RMSNorm act on
each token alone, so on a sequence shard they compute what they compute on the whole sequence. What
sequence parallelism needs is that the norm's weight and bias gradients, partial sums over this rank's
tokens, are summed over the tensor-parallel ranks; megatron's fused norms ask for it by marking the
parameters `sequence_parallel = True`, which `finalize_model_grads` (`_allreduce_non_tensor_model_parallel_grads`)
reads.

`install()` wraps `WrappedTorchNorm.__new__`: with `config.sequence_parallel` it builds the very norm
megatron builds without it (megatron's own checks on the other options still run) and marks its
parameters as `FusedLayerNorm` does; without sequence parallelism nothing changes. The class is patched
in place, so every binding of it (`LNImpl` in the spec modules) sees the change. Installs the core part
first; on GPUs apex or Transformer Engine provide the norm and nothing of this applies.
"""
from __future__ import annotations

import importlib

from . import cpu_backend_core
from ._patching import MegatronPatch, PatchError, module_functions

NORM = ("megatron.core.transformer.torch_norm", "WrappedTorchNorm")


class _WithoutSequenceParallel:
    """A TransformerConfig seen with sequence_parallel off (for megatron's own checks and construction)."""

    def __init__(self, config):
        self._config = config

    sequence_parallel = False

    def __getattr__(self, name):
        return getattr(self._config, name)


class SequenceParallelNormCpu(MegatronPatch):
    """`install(force)` is idempotent; `uninstall()` restores megatron's class."""

    name = "cpu_backend_norm"

    def apply(self, force: bool = False) -> None:
        cpu_backend_core.install(force=force)  # refuses a machine with CUDA (apex / TE norms there) unless forced
        module_name, class_name = NORM
        owner = getattr(importlib.import_module(module_name), class_name)
        original = owner.__dict__.get("__new__")
        if original is None:
            raise PatchError(f"patch 'cpu_backend_norm': {class_name}.__new__ does not exist; written for 0.19.x")
        build = original.__func__ if isinstance(original, staticmethod) else original

        def __new__(cls, config, *args, **kwargs):
            if not getattr(config, "sequence_parallel", False):
                return build(cls, config, *args, **kwargs)
            norm = build(cls, _WithoutSequenceParallel(config), *args, **kwargs)
            for parameter in norm.parameters():
                parameter.sequence_parallel = True  # summed over TP ranks by finalize_model_grads
            return norm

        self.patches.replace(owner, "__new__", staticmethod(__new__))


install, uninstall, installed = module_functions(SequenceParallelNormCpu())
