"""Hooks in megatron.training's loop for --enable-optimizer-post-validation.

- `setup_model_and_optimizer`: once the model, optimizer and LR scheduler exist they go to `attach`, which
  builds the PostValidation that owns the step.
- `save_checkpoint_and_time` and the end of `train`: the pending step is validated first, so checkpoints
  and the final model hold validated weights.
- The iteration line gains " number of optimizer rollbacks: N |" after megatron's skipped-iterations count:
  the steps since the last line that some stage had to roll back.
"""
from __future__ import annotations

import re
from typing import Callable

from ._patching import MegatronPatch

_SKIPPED = re.compile(r"( number of skipped iterations: *\d+ \|)")


class PostValidationTraining(MegatronPatch):
    name = "post_validation_training"

    def apply(self, attach: Callable) -> None:
        from megatron.training import training

        state = {"controller": None, "logged_rollbacks": 0}
        setup_original = training.setup_model_and_optimizer

        def setup_model_and_optimizer(*args, **kwargs):
            model, optimizer, scheduler = setup_original(*args, **kwargs)
            state["controller"] = attach(model, optimizer, scheduler)
            return model, optimizer, scheduler

        def validated_first(original):
            def wrapper(*args, **kwargs):
                if state["controller"] is not None and state["controller"].has_pending:
                    state["controller"].flush()
                return original(*args, **kwargs)

            return wrapper

        train_original = training.train

        def train(*args, **kwargs):
            result = train_original(*args, **kwargs)
            if state["controller"] is not None and state["controller"].has_pending:
                state["controller"].flush()
            return result

        print_original = training.print_rank_last

        def print_rank_last(message):
            controller = state["controller"]
            if controller is not None and isinstance(message, str) and _SKIPPED.search(message):
                count = controller.rolled_back_steps - state["logged_rollbacks"]
                state["logged_rollbacks"] = controller.rolled_back_steps
                message = _SKIPPED.sub(lambda m: f"{m.group(1)} number of optimizer rollbacks: {count:3d} |", message)
            return print_original(message)

        self.patches.replace(training, "setup_model_and_optimizer", setup_model_and_optimizer)
        self.patches.replace(training, "save_checkpoint_and_time", validated_first(training.save_checkpoint_and_time))
        self.patches.replace(training, "train", train)
        self.patches.replace(training, "print_rank_last", print_rank_last)


_PATCH = PostValidationTraining()


def install(attach: Callable) -> None:
    """attach(model, optimizer, opt_param_scheduler) -> PostValidation; called once the optimizer exists."""
    _PATCH.install(attach)


def uninstall() -> None:
    _PATCH.uninstall()


def installed() -> bool:
    return _PATCH.installed
