"""What an exact replay of an iteration's first passes needs: the same data and the same random state.

When post-validation redoes the previous optimizer step, the passes that ran before the V pass used
speculative weights and are run again (iteration.Iteration.replay). The replay must consume the
microbatches those passes consumed (not the next ones), draw the same dropout masks and find the model's
running counts as they were (an MoE router adds each forward's tokens per expert to counts that its expert
bias and load-balancing loss read, and its losses to megatron's metrics), so the result equals a run that
never speculated.
"""
from __future__ import annotations

from typing import Callable

import torch


class _Recording:
    """An iterator that remembers what it handed out, and can hand it out again after `rewind()`."""

    def __init__(self, iterator):
        self.iterator = iterator
        self.seen: list = []
        self.position = 0

    def __iter__(self):
        return self

    def __next__(self):
        if self.position < len(self.seen):
            item = self.seen[self.position]
        else:
            item = next(self.iterator)
            self.seen.append(item)
        self.position += 1
        return item

    def rewind(self) -> None:
        self.position = 0


def _capture_rng(megatron) -> dict:
    state = {"cpu": torch.get_rng_state(), "tracker": megatron.rng_tracker_states()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _restore_rng(megatron, state: dict) -> None:
    torch.set_rng_state(state["cpu"])
    megatron.set_rng_tracker_states(state["tracker"])
    if "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])


class Rewind:
    """Taken at the start of an iteration; `rewind()` puts data, random state and the model's running counts
    back to that point. megatron: the adapter (its RNG tracker's states); restore_counts: puts back what the
    forward passes accumulate into, as it was when the Rewind was taken (the adapter's forward_accumulators)."""

    def __init__(self, iterators: list, megatron, restore_counts: Callable[[], None] | None = None):
        self.iterators = [None if it is None else _Recording(it) for it in iterators]
        self.megatron = megatron
        self.rng = _capture_rng(megatron)
        self.restore_counts = restore_counts

    def rewind(self) -> None:
        for it in self.iterators:
            if it is not None:
                it.rewind()
        _restore_rng(self.megatron, self.rng)
        if self.restore_counts is not None:
            self.restore_counts()
