"""megatron's gradient reduction on gloo groups with CUDA tensors (ranks sharing a GPU: --zero-bubble-share-gpus).

megatron DDP reduces its buckets inside `torch.distributed._coalescing_manager`, which hands gloo one
`allreduce_coalesced`; gloo refuses it for CUDA tensors ("ProcessGroupGloo::allreduce_coalesced: unsupported device
type cuda"), though it reduces CUDA tensors one collective at a time. While this
patch is installed, param_and_grad_buffer's manager issues each collective on its own (the same reductions, in the
same order). Synchronous reductions only: the shared mode refuses --overlap-grad-reduce, whose asynchronous
collectives the manager would have to collect.
"""
from __future__ import annotations

import contextlib
import importlib

from ._patching import MegatronPatch, module_functions


class _EachOnItsOwn:
    """What megatron reads of the coalescing manager: `wait()`, a no-op here (every collective was synchronous)."""

    def wait(self) -> None:
        return None


@contextlib.contextmanager
def one_collective_at_a_time(group=None, device=None, async_ops: bool = False):
    if async_ops:
        raise RuntimeError("gloo on CUDA tensors: asynchronous coalesced reductions are not supported; drop "
                           "--overlap-grad-reduce")
    yield _EachOnItsOwn()


class GlooOnCuda(MegatronPatch):
    name = "gloo_on_cuda"

    def apply(self) -> None:
        buffers = importlib.import_module("megatron.core.distributed.param_and_grad_buffer")
        self.patches.replace(buffers, "_coalescing_manager", one_collective_at_a_time)


install, uninstall, installed = module_functions(GlooOnCuda())
