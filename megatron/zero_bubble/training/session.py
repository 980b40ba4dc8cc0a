"""One object for what a zero-bubble run installs into megatron-core, and takes out again.

    with ZeroBubbleSession(pipeline, split_backward=True, v_stages=None, bucket_every_stage=False) as session:
        ...  # megatron's get_forward_backward_func now hands out `pipeline`
        session.attach_post_validation(controller, model)  # once the optimizer exists, if wanted

Installed in this order (V placement first: it must be in place before megatron makes its process
groups), removed in the reverse order, also when an install fails half way. `training/setup.py` builds
one from the command line; tests build one around a PipelineExecutor of their own.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable


@dataclass
class ZeroBubbleSession:
    pipeline: object | None  # a PipelineExecutor or ReplanningPipeline; None: megatron's own schedule
    split_backward: bool = False  # the linear layers' B/W split (schedules with W passes)
    v_stages: int | None = None  # ZB-V: place the V-shaped layers for this many pipeline ranks
    bucket_every_stage: bool = False  # megatron DDP buckets every stage's gradients (overlapped reduction)
    _installed: list = field(default_factory=list, init=False, repr=False)

    def install(self) -> "ZeroBubbleSession":
        from ..patches import ddp_bucketing, linear_wgrad, schedule_selection, vshape_layout

        try:
            if self.v_stages is not None:
                self._install(vshape_layout, self.v_stages)
            if self.split_backward:
                self._install(linear_wgrad)
            if self.bucket_every_stage:
                self._install(ddp_bucketing)
            if self.pipeline is not None:
                self._install(schedule_selection, self.pipeline)
        except BaseException:
            self.close()
            raise
        return self

    def on_optimizer_built(self, attach: Callable) -> None:
        """megatron.training: call `attach(model, optimizer, scheduler)` once setup_model_and_optimizer built
        them (and validate a pending step before checkpoints and at the end of training)."""
        from ..patches import post_validation_training

        self._install(post_validation_training, attach)

    def attach_post_validation(self, controller, model) -> None:
        """The optimizer's step goes through `controller` (PostValidation); the executor runs its V passes."""
        from ..patches import optimizer_step

        self._install(optimizer_step, controller, model)
        self.executor.post_validation = controller

    @property
    def executor(self):
        return getattr(self.pipeline, "executor", self.pipeline)

    def close(self) -> None:
        """Everything installed, removed last-in first-out; the pipeline lets go of its buffers."""
        if self.pipeline is not None:
            self.pipeline.release()
        while self._installed:
            self._installed.pop().uninstall()

    def _install(self, patch_module, *options) -> None:
        patch_module.install(*options)
        if patch_module not in self._installed:
            self._installed.append(patch_module)

    def __enter__(self) -> "ZeroBubbleSession":
        return self.install()

    def __exit__(self, *exc) -> None:
        self.close()
