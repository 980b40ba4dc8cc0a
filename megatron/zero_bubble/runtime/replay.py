"""The V pass of an iteration, and the exact replay of what ran before it.

When post-validation redoes the previous optimizer step, the passes that ran before the V pass used
speculative weights and are run again. The replay must consume the microbatches those passes consumed
(not the next ones) and draw the same dropout masks, so the result equals a run that never speculated.
"""
from __future__ import annotations

import torch

from ..schedules.comm import Send, consumed, produced
from ..schedules.schedule import ScheduleError


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


def _capture_rng() -> dict:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    state = {
        "cpu": torch.get_rng_state(),
        "tracker": {name: s.clone() for name, s in get_cuda_rng_tracker().get_states().items()},
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _restore_rng(state: dict) -> None:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    torch.set_rng_state(state["cpu"])
    get_cuda_rng_tracker().set_states({name: s.clone() for name, s in state["tracker"].items()})
    if "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])


class Rewind:
    """Taken at the start of an iteration; `rewind()` puts data and random state back to that point."""

    def __init__(self, iterators: list):
        self.iterators = [None if it is None else _Recording(it) for it in iterators]
        self.rng = _capture_rng()

    def rewind(self) -> None:
        for it in self.iterators:
            if it is not None:
                it.rewind()
        _restore_rng(self.rng)


class ValidationPass:
    """The V pass and the replay, as methods of the executor's per-iteration state (executor._Iteration)."""

    def validation_pass(self, p) -> bool:
        """Receive the previous step's full sums (the last rank has them) and decide whether to replay.

        The sums are passed on before this rank undoes or re-steps anything (`apply_validation` runs after
        the send is posted), so the ranks below do not wait for this rank's optimizer work."""
        controller = self.executor.post_validation
        need = consumed(self.schedule, self.rank, p)
        summary = self.transport.wait_recv(need) if need is not None else controller.own_summary()
        out = produced(self.schedule, self.rank, p)
        self.unvalidated = summary
        if out is not None:
            self.outgoing[out] = (summary, None)
        else:
            self.apply_validation()
        return controller.needs_replay(summary)

    def apply_validation(self) -> None:
        if self.unvalidated is not None:
            summary, self.unvalidated = self.unvalidated, None
            self.executor.post_validation.validate(summary)

    def replay(self) -> None:
        """The step was redone, so what ran before V used wrong weights: drain the stale messages, start over."""
        if self.rewind is None:
            raise ScheduleError("post-validation asked for a replay, but no step was pending when the iteration began")
        for item in self.rollback.after_validation:
            if isinstance(item, Send):
                tensor, on_done = self.outgoing.pop(item.msg)
                self.transport.post_send(item.msg, tensor, on_done)
                self.apply_validation()
            else:  # a message its sender computed before its own V: received and dropped
                self.transport.post_recv(item.msg)
                self.transport.wait_recv(item.msg)
        self.apply_validation()
        self.transport.reap_sends(block=True)
        for held in (self.outgoing, self.saved, self.handoff, self.forward_data_store, self.started_chunks):
            held.clear()
        self.total_num_tokens.zero_()
        self.in_flight = 0
        self.rewind.rewind()
        timer, self.executor.pass_timer = self.executor.pass_timer, None  # replays would skew measured costs
        try:
            self.run(self.rollback.restart)
        finally:
            self.executor.pass_timer = timer
