"""Route megatron's optimizer step through post-update validation (--enable-optimizer-post-validation).

Instance-level and reversible: the optimizer's `step`/`zero_grad` and each DDP chunk's
`zero_grad_buffer` go through a `PostValidation` (zeroing waits for validation, since a re-step needs the
gradients), and megatron.training's two model-parallel reductions after the step (success flag and grad
norm, over a group that spans every pipeline stage) are kept within the stage.
"""
from __future__ import annotations

import sys

from ._patching import MegatronPatch, module_functions


class OptimizerStep(MegatronPatch):
    name = "optimizer_step"

    def apply(self, controller, model_chunks) -> None:
        optimizer = controller.optimizer
        zero_grad_original = optimizer.zero_grad
        self.patches.replace(optimizer, "step", controller.step)
        self.patches.replace(optimizer, "zero_grad",
                             lambda *a, **k: controller.defer_or_run(zero_grad_original, *a, **k))
        for chunk in model_chunks:
            if hasattr(chunk, "zero_grad_buffer"):
                original = chunk.zero_grad_buffer
                self.patches.replace(chunk, "zero_grad_buffer", lambda original=original: controller.defer_or_run(original))
        training = sys.modules.get("megatron.training.training")
        if training is not None:
            for name in ("logical_and_across_model_parallel_group", "reduce_max_stat_across_model_parallel_group"):
                self.patches.replace(training, name, _within_stage(getattr(training, name), controller))


def _within_stage(reduction, controller):
    """The same reduction over this stage's tensor-parallel ranks only: the last stage's values are final."""

    def reduce_within_stage(value, group=None):
        return reduction(value, group=controller.stage_group)

    return reduce_within_stage


install, uninstall, installed = module_functions(OptimizerStep())
