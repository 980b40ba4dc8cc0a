"""The W work of one model chunk, whoever holds it: the W passes of zero-bubble schedules.

Zero-bubble schedules split a layer's backward into B (gradient w.r.t. the input, on the critical
path, time T_B) and W (gradient w.r.t. the weights, time T_W, movable into bubbles). The runtime asks a
chunk's store for "the W work of microbatch i" and never needs to know who holds it. Two kinds of layer
hand their work in, both through the adapter's `split_linear_layers` (see `attach`):
- megatron's own linear layers (`patches/linear_wgrad.py`) hand their weight-gradient work to `hand_over()`:
  while a B pass runs inside `split_backward()` it is deferred, in a fused BW pass (`fused_backward()`) it runs as
  the pass's backward ends, outside both at once. A weight used more than once in one backward (the LM head of a
  model with multi-token prediction computes the main logits and each MTP layer's) hands over one work per use:
  the store offers each to the same weight's earlier work of that backward (`absorb`), which sums their gradients
  before it accumulates, as autograd does before megatron DDP's hook sees the gradient;
- Transformer Engine's modules (`patches/te_wgrad.py`) keep their own per-module FIFO (`delay_wgrad_compute`)
  and `defer()` one work item per entry their backward queues during a B pass; running it calls the
  module's `backward_dw()`, which pops that module's oldest entry. In a BW pass they compute at once. `close_microbatch(mb)`
files the deferred work under the microbatch; the W pass calls `run_next(mb)`, which runs the oldest filed
microbatch (FIFO) and checks it is `mb`. Until then the work keeps its input activation and output gradient
alive: that is M_W, reported by `pending_bytes`.

Gradient readiness (for megatron DDP's overlapped reduction): with a `grad_ready` callback, each weight is
reported once its gradient of the iteration is complete, i.e. once the chunk's last microbatch's work for
it ran (`close_microbatch(mb, last=True)` after the last B, `fused_backward(last=True)` around the last
BW). After the last B the store knows all remaining work and runs it layer by layer instead of microbatch
by microbatch, in W passes of about equal cost: each weight still accumulates its microbatches in order
(bit-identical), but the last layers' gradients are complete after the first of those passes instead of
the last, so their reduction overlaps the rest.

A schedule may keep some layers' W inside B (`keep_in_b`; the output layer, where its deferred operands are large:
schedules/costs.py): their work is collected during the B pass as a BW pass collects it, and runs as the pass's
backward ends, so each such weight still accumulates its microbatches in order and keeps nothing for a W pass.

The store is handed to the layers whose weight gradients it holds (`attach`, through megatron's adapter;
undone by `detach`): a layer reaches its store through that hand-over, never through thread-local or global
state, which autograd's CUDA backward thread would not see.
"""
from __future__ import annotations

from collections import deque
from contextlib import ExitStack, contextmanager
from itertools import accumulate
from typing import Callable, Iterator, Protocol

import torch

from ..schedules.schedule import ScheduleError


class DeferredWork(Protocol):
    """One deferred weight-gradient computation (one linear layer, one microbatch).

    Optional attributes: `params`, the parameters whose gradient it completes (default: `weight` alone; a
    Transformer Engine module's W computes its biases too), `cost`, its relative cost when the tail is
    re-cut layer by layer (default: the weight's number of elements), and `absorb(later) -> bool`, which takes
    over a later work of the same backward (another use of the same weight) where it accumulates as one."""

    nbytes: int  # memory the work keeps alive until it runs (activations and gradients)
    weight: torch.nn.Parameter  # the weight whose gradient it accumulates (its layer's key: FIFO per layer)

    def __call__(self) -> None: ...


def completed_params(work: DeferredWork) -> tuple:
    return getattr(work, "params", None) or (work.weight,)


def _cost(work: DeferredWork) -> int:
    return getattr(work, "cost", None) or work.weight.numel()



class WeightGradStore:
    """Queue of deferred weight-gradient work for one model chunk, one entry per microbatch.

    grad_ready(weight), when set, is called once per iteration for each weight, when its gradient is
    complete (see the module docstring); megatron DDP's per-parameter hook, which autograd would have
    called, is what an executor that overlaps the gradient reduction passes here.
    """

    def __init__(self, name: str = "chunk", grad_ready: Callable[[torch.nn.Parameter], None] | None = None):
        self.name = name
        self.grad_ready = grad_ready
        self._active = False
        self._fused: list[DeferredWork] | None = None  # handed over in the fused backward now running
        self._first_uses: dict[int, DeferredWork] = {}  # id(weight) -> its first work in the backward now running
        self._open: list[DeferredWork] = []  # deferred by the B pass now running (or just finished)
        self._queue: deque[tuple[int, list[DeferredWork]]] = deque()  # (microbatch, its work), oldest first
        self._final: set[int] = set()  # ids of the works that complete their weight's gradient
        self._weights: list[torch.nn.Parameter] = []
        self._undo: list = []  # what handed the weights to this store, to undo on release
        self._b_scopes: list[Callable] = []  # context factories entered around each B pass (attach's holders)
        self._pending_bytes = 0  # kept as work comes and goes: the executor reads it after every pass
        self._in_b: set[int] = set()  # ids of the weights whose W runs inside B (keep_in_b)
        self._in_b_works: list[DeferredWork] = []  # theirs, collected during the B pass now running
        self._in_b_ran: list[DeferredWork] = []  # theirs that ran as the last B pass ended (grad_ready)

    # -- ownership -----------------------------------------------------------------------------------
    def attach(self, module: torch.nn.Module, megatron) -> int:
        """Have the linear layers of `module` hand their weight gradients to this store; returns how many
        weights. megatron: the adapter (patches/megatron_adapter.py), whose `split_linear_layers` knows which
        layers are megatron's or Transformer Engine's and how to reroute them; `detach` undoes it."""
        weights, undo = megatron.split_linear_layers(module, self)
        self._weights.extend(weights)
        self._undo.append(undo)
        return len(weights)

    def around_b_passes(self, scope: Callable) -> None:
        """Enter `scope()` (a context manager) around every B pass of this chunk, until `detach`: what a holder
        of part of the chunk's W needs while its backward defers (attach's callers register it)."""
        self._b_scopes.append(scope)

    def detach(self) -> None:
        """Give every attached weight back: the layers behave as megatron's own again."""
        self._require_idle("detach")
        while self._undo:
            self._undo.pop().restore()
        self._weights.clear()
        self._b_scopes.clear()

    @property
    def weights(self) -> tuple[torch.nn.Parameter, ...]:
        return tuple(self._weights)

    def keep_in_b(self, weights) -> None:
        """Run these weights' W inside each B pass instead of deferring it (replaces the previous set); each must be
        one this store holds."""
        self._require_idle("keep_in_b")
        owned = {id(weight) for weight in self._weights}
        strangers = [tuple(weight.shape) for weight in weights if id(weight) not in owned]
        if strangers:
            raise ScheduleError(f"WeightGradStore {self.name!r}: cannot keep W in B for weights it does not hold "
                                f"(shapes {strangers})")
        self._in_b = {id(weight) for weight in weights}

    @property
    def kept_in_b(self) -> int:
        """How many weights run their W inside B."""
        return len(self._in_b)

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
        self._in_b_ran = []
        try:
            with ExitStack() as scopes:
                for scope in self._b_scopes:
                    scopes.enter_context(scope())
                yield self
            self._active = False
            works, self._in_b_works = self._in_b_works, []
            for work in works:  # as a BW pass runs them when its backward ends
                work()
            self._in_b_ran = works
        finally:
            self._active = False
            self._in_b_works = []
            self._first_uses.clear()

    @contextmanager
    def fused_backward(self, last: bool) -> Iterator[WeightGradStore]:
        """Run the enclosed backward as a BW pass (weight gradients at once); `last`: the chunk's last
        microbatch, so each weight's gradient is complete when its work has run (grad_ready)."""
        if self._active or self._fused is not None:
            raise RuntimeError(f"WeightGradStore {self.name!r}: fused_backward() inside another backward")
        self._fused = []
        try:
            yield self
            works, self._fused = self._fused, None
            for work in works:
                work()
                if last and self.grad_ready is not None:
                    for param in completed_params(work):
                        self.grad_ready(param)
        finally:
            self._fused = None
            self._first_uses.clear()

    def hand_over(self, work: DeferredWork) -> None:
        """Called by a patched linear layer's backward: deferred during B, run as a BW pass's backward ends, at
        once outside both (see the module docstring)."""
        if self._active:
            self.defer(work)
        elif self._fused is not None:
            self._add(self._fused, work)
        else:
            work()

    def defer(self, work: DeferredWork) -> None:
        """Keep the work for a W pass (during B)."""
        if not self._active:
            raise RuntimeError(f"WeightGradStore {self.name!r}: defer() called outside split_backward()")
        if id(work.weight) in self._in_b:
            self._add(self._in_b_works, work)
            return
        self._pending_bytes += work.nbytes  # before `_add`: an absorbing work's nbytes grows by the same
        self._add(self._open, work)

    def _add(self, works: list[DeferredWork], work: DeferredWork) -> None:
        """Append `work` to this backward's `works`, unless the same weight's first work in it absorbs it."""
        first = self._first_uses.setdefault(id(work.weight), work)
        if first is work or getattr(first, "absorb", None) is None or not first.absorb(work):
            works.append(work)

    def close_microbatch(self, mb: int, last: bool = False) -> None:
        """File the work deferred since the last close under microbatch `mb` (empty work is filed too);
        `last`: mb is the chunk's last microbatch (see grad_ready)."""
        if self._active:
            raise RuntimeError(f"WeightGradStore {self.name!r}: close_microbatch({mb}) inside split_backward()")
        if any(queued == mb for queued, _ in self._queue):
            raise ScheduleError(
                f"WeightGradStore {self.name!r}: microbatch {mb} already has pending weight-gradient work (B ran twice?)"
            )
        self._queue.append((mb, self._open))
        self._open = []
        if last and self.grad_ready is not None:
            for work in self._in_b_ran:  # complete with the last B
                for param in completed_params(work):
                    self.grad_ready(param)
            self._by_layer()

    def _by_layer(self) -> None:
        """Re-cut the remaining work layer by layer into as many W passes of about equal cost (see the module
        docstring), and mark each weight's last piece of work."""
        microbatches = [mb for mb, _ in self._queue]
        per_weight: dict[int, list[DeferredWork]] = {}  # in backward order of the weights, microbatches in order
        for _, works in self._queue:
            for work in works:
                per_weight.setdefault(id(work.weight), []).append(work)
        order = [work for works in per_weight.values() for work in works]
        self._final = {id(works[-1]) for works in per_weight.values()}
        costs = list(accumulate(_cost(work) for work in order))
        total, slices, start = (costs[-1] if costs else 0), [], 0
        for k in range(1, len(microbatches) + 1):
            end = start
            while end < len(order) and (k == len(microbatches) or costs[end] <= total * k / len(microbatches)):
                end += 1
            slices.append(order[start:end])
            start = end
        self._queue = deque(zip(microbatches, slices))

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
            if id(work) in self._final:
                self._final.discard(id(work))
                for param in completed_params(work):
                    self.grad_ready(param)
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
