"""Undoing one speculative optimizer step of post-validation (post_validation.py), leaf optimizer by leaf.

Before a speculative step, `keep()` keeps what the undo needs: a snapshot of parameters and optimizer state
(exact rollback) or a record for the in-place inverse (optimizer_rollback.py), plus an exact copy of the tied
word embedding. `restore()` puts the step back with the learning rate and weight decay it was taken with (the
scheduler moved on since), has the model's fp16/bf16 copies follow the main params and, with the distributed
optimizer, gathers the restored shards. `scheduler_increment()` takes back the LR scheduler's step for a step
that did not happen.
"""
from __future__ import annotations

import contextlib

import torch

from . import optimizer_rollback


class StepUndo:
    """For the leaf optimizers of one rank (megatron's; `megatron`: the adapter to megatron-core)."""

    def __init__(self, leaves: list, megatron, exact: bool, scheduler=None):
        self.leaves = leaves
        self.megatron = megatron
        self.exact = exact
        self.scheduler = scheduler

    def keep(self) -> list:
        """Per leaf, what `restore` needs to undo the step about to be taken (None for a stub leaf)."""
        return [self._keep(leaf.torch_optimizer) for leaf in self.leaves]

    def _keep(self, torch_optimizer):
        if torch_optimizer is None:  # a stub (no parameters on this rank)
            return None
        if self.exact:
            return optimizer_rollback.snapshot(torch_optimizer)
        return optimizer_rollback.prepare(torch_optimizer), _copy_of_tied_embedding(torch_optimizer)

    def restore(self, kept: list, hyperparameters: list, gather: bool = True) -> None:
        """Undo the step `kept` was kept for, taken with `hyperparameters` (see `hyperparameters()`)."""
        with self.hyperparameters_of(hyperparameters):
            for leaf, kept_of_leaf in zip(self.leaves, kept):
                if kept_of_leaf is None:
                    continue
                if self.exact:
                    optimizer_rollback.restore(leaf.torch_optimizer, kept_of_leaf)
                else:
                    record, tied = kept_of_leaf
                    optimizer_rollback.invert(leaf.torch_optimizer, record)
                    _restore_tied_embedding(leaf.torch_optimizer, tied)
                leaf.main_params_changed(gather)

    def hyperparameters(self) -> list:
        """Per leaf, [(lr, weight_decay)] per param group, as they are now."""
        return [[(float(g["lr"]), float(g.get("weight_decay", 0.0))) for g in _groups(leaf)] for leaf in self.leaves]

    @contextlib.contextmanager
    def hyperparameters_of(self, values: list):
        """Re-step or undo with the learning rate and weight decay of the step (the scheduler moved on since)."""
        now = self.hyperparameters()
        self._set_hyperparameters(values)
        try:
            yield
        finally:
            self._set_hyperparameters(now)

    def _set_hyperparameters(self, values: list) -> None:
        for leaf, groups in zip(self.leaves, values):
            for group, (lr, wd) in zip(_groups(leaf), groups):
                _set(group, "lr", lr)
                if "weight_decay" in group:
                    _set(group, "weight_decay", wd)

    def scheduler_increment(self, steps_before: int | None) -> None:
        """train_step advanced the LR schedule for a step that, in the end, did not happen."""
        if self.scheduler is None or steps_before is None:
            return
        increment = self.scheduler.num_steps - steps_before
        if increment:
            self.scheduler.step(increment=-increment)


def _groups(leaf) -> list:
    return leaf.torch_optimizer.param_groups if leaf.torch_optimizer is not None else []


def _set(group: dict, key: str, value: float) -> None:
    if isinstance(group[key], torch.Tensor):  # a tensor-valued hyperparameter is updated in place by schedulers
        group[key].fill_(value)
    else:
        group[key] = value


def _copy_of_tied_embedding(torch_optimizer) -> list:
    """Exact copies of the tied word-embedding parameter(s) and their state.

    The first stage's copy may be undone, the last stage's never is (it steps knowing the full sums), and
    megatron keeps the two equal only by stepping them identically: an in-place undo an ulp off would
    part them for good. So this one tensor is restored exactly; it is small next to the model."""
    copies = []
    for group in torch_optimizer.param_groups:
        for p in group["params"]:
            if getattr(p, "shared", False) or getattr(p, "shared_embedding", False):
                state = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in torch_optimizer.state.get(p, {}).items()}
                copies.append((p, p.detach().clone(), state))
    return copies


def _restore_tied_embedding(torch_optimizer, copies: list) -> None:
    for p, data, state in copies:
        p.data.copy_(data)
        if state:
            torch_optimizer.state[p] = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}
        else:
            torch_optimizer.state.pop(p, None)
