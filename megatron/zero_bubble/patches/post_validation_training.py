"""Hooks in megatron.training's loop for --enable-optimizer-post-validation.

- `setup_model_and_optimizer`: once the model, optimizer and LR scheduler exist they go to `attach`, which
  builds the PostValidation that owns the step.
- `save_checkpoint_and_time` and the end of `train`: the pending step is validated first, so checkpoints
  and the final model hold validated weights.
- The iteration line gains " number of optimizer rollbacks: N |" after megatron's skipped-iterations count:
  the steps since the last line that some stage had to roll back.
- MoE metrics: `training_log` reports them every iteration with an all-reduce over the pipeline group, a
  barrier across stages that would hold every stage until the last one ends the iteration. Here they are
  reported at the iterations that print (where megatron's own interval timer synchronises every rank anyway)
  and at the end of `train`: each waiting iteration's values are reported in turn, with that iteration's
  arguments, so what is printed, accumulated and written to TensorBoard is what megatron's report gives.
"""
from __future__ import annotations

import inspect
import re
from typing import Callable

from ._patching import MegatronPatch, module_functions

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

        moe_reports = IntervalMoEReports(training.get_moe_metrics_tracker)
        log_original = training.training_log
        log_arguments = inspect.signature(log_original)

        def training_log(*args, **kwargs):
            given = log_arguments.bind(*args, **kwargs).arguments
            moe_reports.printing = (given["iteration"] % training.get_args().log_interval == 0
                                    or given.get("is_first_iteration", False))
            return log_original(*args, **kwargs)

        train_original = training.train

        def train(*args, **kwargs):
            result = train_original(*args, **kwargs)
            if state["controller"] is not None and state["controller"].has_pending:
                state["controller"].flush()
            moe_reports.catch_up()
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
        self.patches.replace(training, "training_log", training_log)
        self.patches.replace(training, "get_moe_metrics_tracker", lambda: moe_reports)


class IntervalMoEReports:
    """megatron's MoE metrics tracker as training_log sees it: `report` waits (a copy of this iteration's
    values, the tracker cleared as report clears it) unless the iteration prints; then, and at `catch_up`,
    the waiting iterations are reported in order. Everything else goes to megatron's tracker."""

    def __init__(self, tracker: Callable):
        self.tracker = tracker  # megatron's get_moe_metrics_tracker
        self.printing = True  # whether training_log prints at this iteration
        self.waiting: list = []  # (args, kwargs of report, {metric: per-layer values}) per iteration

    def __getattr__(self, name):
        return getattr(self.tracker(), name)

    def report(self, *args, **kwargs) -> str:
        tracker = self.tracker()
        self.waiting.append((args, kwargs, {name: entry.values.clone() for name, entry in tracker.metrics.items()}))
        if not self.printing:
            tracker.clear()
            return ""
        return self.catch_up()

    def catch_up(self) -> str:
        """Report every waiting iteration in turn; returns the last one's log string."""
        tracker, line = self.tracker(), ""
        waiting, self.waiting = self.waiting, []
        for args, kwargs, values in waiting:
            for name, entry in tracker.metrics.items():
                if name in values:
                    entry.values.copy_(values[name])
                else:  # made since: it held zeros then
                    entry.values.zero_()
            line = tracker.report(*args, **kwargs)
        return line


install, uninstall, installed = module_functions(PostValidationTraining())
