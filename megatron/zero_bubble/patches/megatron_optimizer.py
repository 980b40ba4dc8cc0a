"""megatron's leaf optimizers as optimizer post-validation uses them: the one place that reads their internals.

megatron's optimizer is a ChainedOptimizer of leaves (or one leaf): Float16OptimizerWithFloat16Params or the
distributed optimizer (fp32 main params beside the model's fp16/bf16 ones, a loss scaler in fp16), FP32Optimizer, or
a stub where a rank holds no parameters of that leaf. Post-validation runs megatron's step in pieces, stage-local
(runtime/post_validation.py): prepare the gradients without the model-parallel all-reduce, take their squared norm,
clip, step, update the loss scale, undo a step. `LeafOptimizer` offers exactly those pieces, by what they do.
"""
from __future__ import annotations

from ._patching import PatchError, megatron_core_version


def _require(owner, name: str):
    method = getattr(owner, name, None)
    if method is None:
        raise PatchError(f"megatron-core {megatron_core_version()}: {type(owner).__name__} has no {name}; the "
                         f"zero-bubble runtime was written for 0.19.x")
    return method


class LeafOptimizer:
    """One leaf of megatron's optimizer (see the module docstring)."""

    def __init__(self, leaf):
        self.leaf = leaf

    @property
    def is_stub(self) -> bool:
        """No parameters of this leaf on this rank."""
        return bool(getattr(self.leaf, "is_stub_optimizer", False))

    @property
    def torch_optimizer(self):
        """The torch optimizer that steps the (main) parameters; None for a stub."""
        return getattr(self.leaf, "optimizer", None)

    @property
    def clip_grad(self) -> float:
        return self.leaf.config.clip_grad

    @property
    def has_loss_scaler(self) -> bool:
        return getattr(self.leaf, "grad_scaler", None) is not None

    def prepare_grads(self, found_inf) -> None:
        """megatron's prepare_grads without its model-parallel all-reduce: main gradients in place, unscaled, and
        `found_inf` (a 0-d tensor) set where unscaling met inf/NaN on this rank."""
        leaf = self.leaf
        if not hasattr(leaf, "_copy_model_grads_to_main_grads"):  # FP32Optimizer: grad = main_grad, no communication
            leaf.prepare_grads()
            return
        leaf._copy_model_grads_to_main_grads()
        if self.has_loss_scaler:
            import torch

            leaf.found_inf.fill_(0.0)
            torch._amp_foreach_non_finite_check_and_unscale_(
                _require(leaf, "_collect_main_grad_data_for_unscaling")(), leaf.found_inf, leaf.grad_scaler.inv_scale)
            found_inf.copy_(leaf.found_inf.reshape(()))

    def grads_for_norm(self) -> list:
        return self.leaf.get_grads_for_grad_norm()

    def parameters(self) -> list:
        return self.leaf.get_parameters()

    def statistics_group(self):
        """The group megatron reduces this leaf's gradient statistics over (None: every rank)."""
        return self.leaf.get_grad_stats_parallel_group()

    def step(self) -> None:
        """Step on gradients that are ready, and copy the main params to the model's fp16/bf16 ones."""
        self.leaf.step_with_ready_grads()

    def update_loss_scale(self, overflowed: bool) -> None:
        if self.has_loss_scaler:
            self.leaf.grad_scaler.update(overflowed)

    def main_params_changed(self, gather: bool = True) -> None:
        """After a rollback changed the main params: the model's copies follow, and with the distributed optimizer
        (`gather`) every rank gathers the restored shards."""
        copy = getattr(self.leaf, "_copy_main_params_to_model_params", None)
        if copy is not None:
            copy()
        if gather and hasattr(self.leaf, "start_param_sync_for_bucket_group_subset"):
            self.leaf.start_param_sync_for_bucket_group_subset()

    def overlapped_gather_chunks(self) -> list:
        """The model chunks whose parameter all-gathers megatron overlaps with the next forward passes
        (--overlap-param-gather with the distributed optimizer)."""
        return [chunk for chunk in getattr(self.leaf, "model_chunks", [])
                if getattr(getattr(chunk, "ddp_config", None), "overlap_param_gather", False)]


def leaf_optimizers(optimizer) -> list[LeafOptimizer]:
    return [LeafOptimizer(leaf) for leaf in getattr(optimizer, "chained_optimizers", [optimizer])]
