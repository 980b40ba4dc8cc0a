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


# What an MoE router's training forward adds to, and megatron zeroes after the iteration's last backward
# (finalize_model_grads: reset_model_temporary_tensors): tokens per expert for the expert-bias update, the
# global aux loss's tokens and steps, quantile balancing's per-microbatch quantiles.
ROUTER_ACCUMULATORS = ("local_tokens_per_expert", "global_tokens_per_expert", "ga_steps", "qb_beta_accum",
                       "qb_beta_count")


def forward_accumulators(model_chunks):
    """What megatron's training forward passes accumulate into (MoE routers' running counts and the MoE metrics
    tracker's per-layer losses), kept as it is now; returns `restore()`, which puts it back (replay.Rewind).
    A metric the tracker starts after this call is zeroed: its entry would have been made from zeros."""
    import torch
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

    kept = [(tensor, tensor.clone()) for chunk in model_chunks for module in chunk.modules()
            for name in ROUTER_ACCUMULATORS if torch.is_tensor(tensor := getattr(module, name, None))]
    tracker = get_moe_metrics_tracker()
    metrics = {name: entry.values.clone() for name, entry in tracker.metrics.items()}

    def restore() -> None:
        for tensor, value in kept:
            tensor.copy_(value)
        for name, entry in tracker.metrics.items():
            if name in metrics:
                entry.values.copy_(metrics[name])
            else:
                entry.values.zero_()

    return restore


def reset_forward_loss_scales(config, num_microbatches: int, cp_size: int) -> None:
    """Set again what megatron's forward_step hands from the loss scale to the backward passes that follow it:
    the MoE auxiliary losses' gradient scale (MoEAuxLossAutoScaler, a class attribute each forward sets from
    config.grad_scale_func). Post-validation may change the loss scale between a forward and those passes."""
    if getattr(config, "num_moe_experts", None) is None:
        return
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.transformer.moe.router import MoEAuxLossAutoScaler

    moe_loss_scale = _require(schedules, "_get_moe_loss_scale", "megatron.core.pipeline_parallel.schedules")
    scale = moe_loss_scale(config, _device())
    MoEAuxLossAutoScaler.set_loss_scale(scale if config.calculate_per_token_loss else scale * cp_size / num_microbatches)


def _device():
    import torch

    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
