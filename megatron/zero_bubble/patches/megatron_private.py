"""The megatron-core private functions and methods the runtime calls, in one place (checked for 0.19.x).

Only `patches/` touches megatron's internals. The runtime never imports this module: the patches that put
an executor or a post-validation controller into megatron (schedule_selection, optimizer_step) hand it over
as their `megatron_internals`. Each function names what it needs, and a megatron-core without it raises
PatchError naming the version instead of an AttributeError deep inside a training step.
"""
from __future__ import annotations

from ._patching import PatchError, megatron_core_version


def _require(owner, name: str, where: str):
    method = getattr(owner, name, None)
    if method is None:
        raise PatchError(f"megatron-core {megatron_core_version()}: {where} has no {name}; the zero-bubble runtime "
                         f"was written for 0.19.x")
    return method


def default_pg_collection():
    """The process groups megatron's pipeline schedules use when the caller passes none."""
    from megatron.core.pipeline_parallel import schedules

    return _require(schedules, "_build_default_pg_collection", "megatron.core.pipeline_parallel.schedules")()


def has_main_params(optimizer) -> bool:
    """Whether a leaf optimizer keeps fp32 main params apart from the model's (fp16 / bf16 training)."""
    return hasattr(optimizer, "_copy_model_grads_to_main_grads")


def copy_model_grads_to_main_grads(optimizer) -> None:
    _require(optimizer, "_copy_model_grads_to_main_grads", type(optimizer).__name__)()


def main_grads_for_unscaling(optimizer) -> list:
    """The main gradients megatron checks for inf/NaN and unscales, as its prepare_grads collects them."""
    return _require(optimizer, "_collect_main_grad_data_for_unscaling", type(optimizer).__name__)()


def copy_main_params_to_model_params(optimizer) -> None:
    """After the main params changed outside a step (a rollback): the model's copies follow (no-op in fp32)."""
    method = getattr(optimizer, "_copy_main_params_to_model_params", None)
    if method is not None:
        method()


def grad_ready_hook(model_chunk):
    """For a megatron DistributedDataParallel chunk, `ready(param)`: what DDP's per-parameter hook does with a
    gradient accumulated into main_grad under overlap_grad_reduce, for gradients the W passes accumulate:
    register the parameter with its bucket group (`register_grad_ready`, counted once megatron's no_sync is
    left), which starts the group's reduction once all its parameters are in. None for anything else."""
    groups = getattr(model_chunk, "param_to_bucket_group", None)
    if groups is None:
        return None

    def ready(param) -> None:
        group = groups.get(param)
        if group is not None:
            group.register_grad_ready(param, getattr(model_chunk, "force_all_reduce", False))

    return ready
