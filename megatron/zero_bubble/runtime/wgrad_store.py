"""Deferred weight-gradient work of one model chunk: the W passes of zero-bubble schedules.

Zero-bubble schedules split a layer's backward into B (gradient w.r.t. the input, on the critical
path, time T_B) and W (gradient w.r.t. the weights, time T_W, movable into bubbles). While a B pass runs
inside `split_backward()`, the patched linear layers (`patches/linear_wgrad.py`) hand their weight
gradient GEMM to `defer()` instead of running it. `close_microbatch(mb)` files that work under the
microbatch; the W pass calls `run_next(mb)`, which runs the oldest filed microbatch (FIFO) and checks it is
`mb`. Until then the work keeps its input activation and output gradient alive: that is M_W, reported by
`pending_bytes`.

The store is reached from the weights it owns (an attribute on each Parameter), never from thread-local
or global state: autograd runs CUDA backward on a device thread, where the caller's thread-locals and
context variables are invisible, but an attribute on the parameter is not.
"""
from __future__ import annotations

from collections import deque
from contextlib import contextmanager
from typing import Callable, Iterator, Protocol

import torch

from ..schedules.schedule import ScheduleError

STORE_ATTRIBUTE = "zero_bubble_wgrad_store"  # set on each weight Parameter whose W the store defers


class DeferredWork(Protocol):
    """One deferred weight-gradient computation (one linear layer, one microbatch)."""

    nbytes: int  # memory the work keeps alive until it runs (activations and gradients)
    weight: torch.nn.Parameter  # the weight whose gradient it accumulates

    def __call__(self) -> None: ...


class WeightGradStore:
    """Queue of deferred weight-gradient work for one model chunk, one entry per microbatch.

    on_weight_grad_ready(weight) is called after each deferred gradient has been accumulated into the
    weight (`main_grad` or `grad`). Megatron DDP's per-parameter hook cannot do this for deferred weights
    (autograd delivers no gradient to them during B); an executor that overlaps the gradient reduction
    (DDP overlap_grad_reduce) uses this callback to report readiness on the last microbatch instead.
    """

    def __init__(self, name: str = "chunk", on_weight_grad_ready: Callable[[torch.nn.Parameter], None] | None = None):
        self.name = name
        self.on_weight_grad_ready = on_weight_grad_ready
        self._active = False
        self._open: list[DeferredWork] = []  # deferred by the B pass now running (or just finished)
        self._queue: deque[tuple[int, list[DeferredWork]]] = deque()  # (microbatch, its work), oldest first
        self._weights: list[torch.nn.Parameter] = []
        self._pending_bytes = 0  # kept as work comes and goes: the executor reads it after every pass

    # -- ownership -----------------------------------------------------------------------------------
    def attach(self, module: torch.nn.Module) -> int:
        """Mark the weights of every tensor-parallel linear layer in `module`; returns how many.

        Only megatron-core's own ColumnParallelLinear / RowParallelLinear (including the LM head) are
        handled. Transformer Engine layers are not: TE has its own delay_wgrad_compute / backward_dw.
        A layer without its own weight (an output layer that borrows the tied embedding weight) is left
        alone, so its weight gradient is computed in B as megatron does.
        """
        from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

        marked = 0
        for layer in module.modules():
            if not isinstance(layer, (ColumnParallelLinear, RowParallelLinear)):
                continue
            weight = layer.weight
            if weight is None or not weight.requires_grad:
                continue
            owner = getattr(weight, STORE_ATTRIBUTE, None)
            if owner is not None and owner is not self:
                raise ScheduleError(
                    f"weight of {type(layer).__name__} is already attached to WeightGradStore "
                    f"{owner.name!r}; a weight can belong to one model chunk only"
                )
            if owner is None:
                setattr(weight, STORE_ATTRIBUTE, self)
                self._weights.append(weight)
                marked += 1
        return marked

    def detach(self) -> None:
        """Unmark every weight `attach` marked; the layers behave as megatron's own again."""
        self._require_idle("detach")
        for weight in self._weights:
            if getattr(weight, STORE_ATTRIBUTE, None) is self:
                delattr(weight, STORE_ATTRIBUTE)
        self._weights.clear()

    @property
    def weights(self) -> tuple[torch.nn.Parameter, ...]:
        return tuple(self._weights)

    # -- B pass --------------------------------------------------------------------------------------
    @property
    def active(self) -> bool:
        """True while a B pass runs inside `split_backward()`: weight gradients are then deferred."""
        return self._active

    @contextmanager
    def split_backward(self) -> Iterator[WeightGradStore]:
        """Run the enclosed backward as a B pass: the owned weights' gradients go to `defer()`."""
        if self._active:
            raise RuntimeError(f"WeightGradStore {self.name!r}: split_backward() is already active")
        self._active = True
        try:
            yield self
        finally:
            self._active = False

    def defer(self, work: DeferredWork) -> None:
        """Called by a patched linear layer's backward during B."""
        if not self._active:
            raise RuntimeError(f"WeightGradStore {self.name!r}: defer() called outside split_backward()")
        self._open.append(work)
        self._pending_bytes += work.nbytes

    def close_microbatch(self, mb: int) -> None:
        """File the work deferred since the last close under microbatch `mb` (empty work is filed too)."""
        if self._active:
            raise RuntimeError(f"WeightGradStore {self.name!r}: close_microbatch({mb}) inside split_backward()")
        if any(queued == mb for queued, _ in self._queue):
            raise ScheduleError(
                f"WeightGradStore {self.name!r}: microbatch {mb} already has pending weight-gradient work (B ran twice?)"
            )
        self._queue.append((mb, self._open))
        self._open = []

    # -- W pass --------------------------------------------------------------------------------------
    def run_next(self, mb: int) -> int:
        """Run the W pass of microbatch `mb`, which must be the oldest pending one; returns work items run."""
        if not self._queue:
            raise ScheduleError(
                f"WeightGradStore {self.name!r}: W of microbatch {mb} has no pending B (no weight-gradient work queued)"
            )
        oldest = self._queue[0][0]
        if oldest != mb:
            pending = [queued for queued, _ in self._queue]
            raise ScheduleError(
                f"WeightGradStore {self.name!r}: W of microbatch {mb} requested but W runs in B order and "
                f"microbatch {oldest} is next (pending: {pending})"
            )
        _, works = self._queue.popleft()
        return self._run(works)

    def flush(self) -> int:
        """Run all pending work, oldest first, including work not yet closed; returns work items run."""
        self._require_idle("flush")
        ran = 0
        while self._queue:
            ran += self.run_next(self._queue[0][0])
        if self._open:
            works, self._open = self._open, []
            ran += self._run(works)
        return ran

    def _run(self, works: list[DeferredWork]) -> int:
        # Pop before running so the activations are released as each GEMM finishes.
        count = len(works)
        works.reverse()
        while works:
            work = works.pop()
            self._pending_bytes -= work.nbytes
            work()
            if self.on_weight_grad_ready is not None:
                self.on_weight_grad_ready(work.weight)
        return count

    # -- accounting ----------------------------------------------------------------------------------
    @property
    def pending_microbatches(self) -> list[int]:
        """Microbatches filed by close_microbatch whose W has not run, oldest first."""
        return [mb for mb, _ in self._queue]

    @property
    def pending_count(self) -> int:
        """Deferred work items not yet run (filed and not yet filed)."""
        return len(self._open) + sum(len(works) for _, works in self._queue)

    @property
    def pending_bytes(self) -> int:
        """Bytes the pending work keeps alive (M_W summed over pending microbatches)."""
        return self._pending_bytes

    def _require_idle(self, what: str) -> None:
        if self._active:
            raise RuntimeError(f"WeightGradStore {self.name!r}: {what}() inside split_backward()")

    def __repr__(self) -> str:
        return (
            f"WeightGradStore({self.name!r}, weights={len(self._weights)}, pending={self.pending_microbatches}, "
            f"bytes={self.pending_bytes})"
        )
