"""One forward-backward call of one pipeline rank: walk its lowered program, move the tensors between passes.

An `Iteration` never decides order: it runs the items of the program `lower` produced and the model of NCCL
proved (a warm-up, compute passes, and the batches of sends and receives between them), waits for each pass's input
before the pass's clock starts, and hands each compute pass to a `PassCompute`, the public hook that says what F, B, BW
and W do: `megatron_passes.MegatronPasses` runs megatron's forward_step / backward_step (training), the
rehearsal (tools/rehearsal.py) waits for the planned duration. An observer, when given, sees every pass with
its start and end (profiling, tests, the rehearsal's record); replayed passes are not shown to it.

With optimizer post-validation, the S pass after the rank's last pass adds its gradient statistics to the
partial sums of the step, and the V pass validates the previous step and, when that step had to be redone,
replays this rank's passes from the start; the iteration reaches the controller through `StepValidation`.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch

from ..schedules.comm import Batch, Send, Warmup, consumed, lower, produced
from ..schedules.costs import Costs
from ..schedules.ops import Kind, Op
from ..schedules.nccl_model import check_lowering
from ..schedules.post_validation import check_rollback, rollback_programs
from ..schedules.schedule import Pass, Schedule, ScheduleError
from .faults import Faults
from .memory_probe import HeldMemory, MemoryProbe
from .p2p import PipelineTransport
from .replay import Rewind
from .wgrad_store import WeightGradStore


class StepValidation(Protocol):
    """What an iteration needs of optimizer post-validation (post_validation.PostValidation)."""

    size: int  # elements of the summaries that the S and V passes send
    has_pending: bool  # a speculative step waits for its validation

    def statistics(self, partial: torch.Tensor | None, final: bool, tokens: torch.Tensor | None = None) -> torch.Tensor:
        """S: this rank's gradient statistics added to the partial sums (None: first of the chain); tokens: the
        loss stage's token count on the device (per-token loss; p2p.PipelineTransport.token_counts)."""

    def receive_result(self, result: torch.Tensor | None) -> tuple[torch.Tensor, bool]:
        """V: the full sums (None: this rank holds them) -> (the sums to pass on, replay?)."""

    def settle(self) -> bool:
        """Apply the verdict of the last V (once the sums went on); False (a no-op) when there is none."""

    def flush(self) -> None:
        """Validate a pending step outside an iteration (every rank at the same point)."""


class PassCompute(Protocol):
    """What the compute passes of one iteration do (see the module docstring)."""

    forward_only: bool

    def forward(self, p: Pass, vstage: int, input_tensor, is_last_stage: bool):
        """F: returns the output (sent on, unless this is the last virtual stage)."""

    def release_output(self, output) -> None:
        """An F's output was sent (or is not needed): free what it holds that backward does not need."""

    def backward(self, p: Pass, vstage: int, input_tensor, output, output_grad, store: WeightGradStore,
                 last: bool):
        """B (W deferred into `store`) or BW; `last`: the chunk's last backward. Returns the input's gradient."""

    def weight(self, p: Pass, store: WeightGradStore) -> None:
        """W: the store's oldest deferred microbatch, which must be p.mb."""

    def finish_backward(self) -> None:
        """After the rank's last backward pass: reduce the gradients (once, before S or at the end)."""

    def restart(self) -> None:
        """A replay starts the iteration over: forget what the passes so far handed megatron."""

    def loss_scale_changed(self) -> None:
        """A validation moved the loss scale after forward passes handed the old one on."""

    def pass_timer(self, clock: Callable[[], float]):
        """What times an observed pass's compute (pass_timer.py): start(), stop() -> (start, end) on `clock`, or with
        `deferred` set, stop() -> None and read() -> every stopped pass's (start, end) since the last read."""

    def token_count(self) -> torch.Tensor:
        """The tokens this call's loss functions counted on this rank (0 where there is no loss), on the device:
        reading it on the host would stop the host until the GPU gets there."""


PassObserver = Callable[[Pass, float, float], None]  # (pass, start, end), times of the iteration's clock
# An observer sees each pass when it ends where the timer knows its times at once (the host clock); a CUDA timer's
# are read after the run's last pass (pass_timer.py), and the observer sees every pass then, in the order they ran.


@dataclass
class IterationStats:
    """What one iteration held, to check the planner's memory model against reality."""

    peak_activations: int = 0  # (microbatch, chunk) pairs whose F ran and whose B has not
    peak_in_flight: int = 0  # pairs whose F ran and whose W (or BW) has not
    peak_wgrad_bytes: int = 0  # bytes kept for deferred W (inputs and output gradients of linear layers)
    memory: HeldMemory | None = None  # allocated bytes after each compute pass (profiled calls; memory_probe.py)
    wgrad_bytes: list = field(default_factory=list)  # (chunk, bytes its store grew by) of each observed B, in order


@dataclass(frozen=True)
class LoweredRun:
    """A schedule as one call runs it: the passes (F only for evaluation), every rank's program and, with a V
    pass, every rank's rollback program."""

    schedule: Schedule
    programs: list
    rollbacks: list | None
    _consumers: dict = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def of(cls, schedule: Schedule, forward_only: bool = False) -> LoweredRun:
        """Lowered and checked once: what runs is exactly what was checked. Messages are ordered by the
        schedule's own costs when it carries them (the plan was checked on those)."""
        run = forward_only_schedule(schedule) if forward_only else schedule
        costs = Costs.from_dict(schedule.info["costs"]) if "costs" in schedule.info else None
        programs = lower(run, costs)
        check_lowering(run, programs)
        rollbacks = None
        if run.has_post_validation():
            check_rollback(run, programs)
            rollbacks = rollback_programs(run, programs)
        return cls(run, programs, rollbacks)

    def rollback(self, rank: int):
        return self.rollbacks[rank] if self.rollbacks else None

    def consumers(self, rank: int) -> dict:
        """Message -> the pass of this rank that needs it (what the watchdog names)."""
        found = self._consumers.get(rank)
        if found is None:
            found = self._consumers[rank] = {consumed(self.schedule, rank, p): p for p in self.schedule.ranks[rank]}
            found.pop(None, None)
        return found


def forward_only_schedule(schedule: Schedule) -> Schedule:
    """The same schedule with only its F passes (evaluation; no V: a pending step is validated before)."""
    ranks = [[p for p in passes if p.op == Op.F] for passes in schedule.ranks]
    return Schedule(schedule.stages, schedule.chunks, schedule.microbatches, schedule.layout, ranks, schedule.name)


# The method of each compute pass, by name: bound methods kept on the iteration would make it a reference cycle, left
# for the garbage collector with all it holds (megatron's data iterators among them) after its call.
_COMPUTE_PASS = {Op.F: "forward", Op.B: "backward", Op.BW: "backward", Op.W: "weight"}


@dataclass
class Iteration:
    """The state of one forward-backward call of one rank: tensors in flight between its passes."""

    schedule: Schedule  # what runs (LoweredRun.schedule)
    rank: int
    compute: PassCompute
    transport: PipelineTransport
    stores: list[WeightGradStore]  # one per chunk
    validation: StepValidation | None = None
    rollback: object = None  # this rank's RollbackProgram when the schedule has a V pass
    rewind: Rewind | None = None  # set when a step is pending, so the passes before V can be replayed
    observer: PassObserver | None = None
    memory: MemoryProbe | None = None  # reads the allocator after each compute pass (profiled calls only)
    faults: Faults = field(default_factory=Faults)  # injected on purpose (tests of clean stops: faults.py)
    timer: object = None  # times observed compute passes (pass_timer.py), made at the first observed pass
    observed: list = field(default_factory=list)  # (pass, (start, end) or None: the timer's) not yet seen
    clock: Callable[[], float] = time.perf_counter
    backward_finished: bool = False
    replaying: bool = False
    saved: dict = field(default_factory=dict)  # (mb, chunk) -> (input, output) kept for B
    outgoing: dict = field(default_factory=dict)  # Message -> (tensor, on_done) for the next Send
    handoff: dict = field(default_factory=dict)  # tensors crossing between two chunks of this rank (a V's turn)
    received: dict = field(default_factory=dict)  # Message -> tensor, waited for before its pass (_await_inputs)
    in_flight: int = 0
    stats: IterationStats = field(default_factory=IterationStats)

    def __post_init__(self):
        self.last_vstage = self.schedule.num_virtual_stages - 1
        # each chunk's last backward pass: megatron's gradient sync for the chunk starts right before it
        self.last_backward = {p.chunk: p for p in self.schedule.ranks[self.rank] if p.op in (Op.B, Op.BW)}

    def run(self, program: list) -> None:
        settle = self.settle
        lost = self.faults.lost_send(program) if self.faults else None
        for item in program:
            if type(item) is Batch:
                self.transport.post_batch(self._without(item, lost), self._outgoing_of, self._tokens)
                settle()  # right after V's result went on (a no-op otherwise)
            elif type(item) is Warmup:
                self.transport.warm_up(item.peers)
            elif item.op == Op.V:
                if self._observed(item, self.validate_step):
                    self._deliver_observed()
                    self.replay()
                    return
            elif item.op == Op.S:
                self._observed(item, self.step_statistics)
            else:
                settle()  # no pass may run on weights that are not validated yet
                if self.faults and self.faults.delay_s:
                    time.sleep(self.faults.delay_s)  # a slow rank, on purpose
                self.transport.reap()
                self._await_inputs(item)
                self._observed(item, getattr(self, _COMPUTE_PASS[item.op]), compute=True)
                self._account(item)
        settle()
        self.transport.finish()
        self._deliver_observed()
        for store in self.stores:
            if store.pending_count:
                raise ScheduleError(f"{store.name}: W passes missing for microbatches {store.pending_microbatches}")

    def _outgoing_of(self, msg) -> tuple:
        return self.outgoing.pop(msg)

    def _tokens(self) -> torch.Tensor | None:
        return self.tokens_known() if self.transport.token_counts else None

    def _without(self, batch: Batch, lost) -> Batch:
        """The batch without the send lost on purpose (as if sent: the peer waits for it until its watchdog fires)."""
        if lost is None or Send(lost) not in batch.ops:
            return batch
        _, on_done = self.outgoing.pop(lost)
        if on_done is not None:
            on_done()
        return Batch([post for post in batch.ops if post != Send(lost)], batch.group)

    def _observed(self, p: Pass, run: Callable, compute: bool = False):
        """Run a pass; an observer sees its start and end (a compute pass's as its timer reads them)."""
        observer = None if self.replaying else self.observer
        if observer is None:
            return run(p)
        if self.timer is None:
            self.timer = self.compute.pass_timer(self.clock)
        if not compute:
            start = self.clock()
            result = run(p)
            self._seen(p, (start, self.clock()))
            return result
        held = self.stores[p.chunk].pending_bytes if p.op == Op.B else 0
        self.timer.start()
        result = run(p)
        self._seen(p, self.timer.stop())
        if p.op == Op.B:
            self.stats.wgrad_bytes.append((p.chunk, self.stores[p.chunk].pending_bytes - held))
        return result

    def _seen(self, p: Pass, times: tuple[float, float] | None) -> None:
        if self.timer.deferred:
            self.observed.append((p, times))
        else:
            self.observer(p, *times)

    def _deliver_observed(self) -> None:
        """The observer sees the passes a deferred timer timed, now that their times can be read."""
        if not self.observed:
            return
        readings = iter(self.timer.read())
        for p, times in self.observed:
            self.observer(p, *(times or next(readings)))
        self.observed.clear()

    def finish_backward(self) -> None:
        """Reduce the gradients, once: before S, whose statistics need them reduced, or at the end."""
        if self.compute.forward_only or self.backward_finished:
            return
        self.backward_finished = True
        self.compute.finish_backward()

    # -- the post-validation passes (post_validation.py) -----------------------------------------------
    def _summary_link(self, p: Pass) -> tuple[torch.Tensor | None, object]:
        """What a once-per-rank pass receives (None: it is first of its chain) and the message it sends on
        (None: it is last)."""
        need = consumed(self.schedule, self.rank, p)
        incoming = self.transport.wait_recv(need) if need is not None else None
        return incoming, produced(self.schedule, self.rank, p)

    def step_statistics(self, p: Pass) -> None:
        """S: after the gradients are reduced, add this rank's statistics to the step's partial sums."""
        self.finish_backward()
        partial, out = self._summary_link(p)
        sums = self.validation.statistics(partial, final=out is None, tokens=self.tokens_known())
        if out is not None:
            self.outgoing[out] = (sums, None)

    def validate_step(self, p: Pass) -> bool:
        """V: receive the previous step's full sums and pass them on; True when this iteration must replay what
        it ran so far. The verdict is settled after the sums went on (or at once when this rank is last)."""
        result, out = self._summary_link(p)
        summary, replay = self.validation.receive_result(result)
        if out is not None:
            self.outgoing[out] = (summary, None)
        else:
            self.settle()
        return replay

    def settle(self) -> None:
        """Apply a verdict that waits. It may move the loss scale, which the forward passes before V already
        handed on (MoE auxiliary losses) for the backward passes that follow: the compute hands on the new one."""
        if self.validation is not None and self.validation.settle():
            self.compute.loss_scale_changed()

    def replay(self) -> None:
        """The step was redone, so what ran before V used wrong weights: drain the stale messages, start over."""
        if self.rewind is None:
            raise ScheduleError("post-validation asked for a replay, but no step was pending when the iteration began")
        settle = self.settle
        for batch in self.rollback.after_validation:  # the result on, and the stale messages received and dropped
            self.transport.post_batch(batch, self._outgoing_of)
            settle()
            for post in batch.ops:
                if type(post) is not Send:
                    self.transport.wait_recv(post.msg)
        settle()
        self.transport.finish()
        for held in (self.outgoing, self.saved, self.handoff, self.received):
            held.clear()
        self.compute.restart()
        self.in_flight = 0
        self.rewind.rewind()
        self.replaying = True  # replayed passes would skew measured costs
        try:
            self.run(self.rollback.restart)
        finally:
            self.replaying = False

    def tokens_known(self) -> torch.Tensor:
        """The loss stage's token count as far as this rank knows it, on the device: its own count on the loss
        stage, else the largest that came with a gradient (complete by the rank's last backward; p2p.py)."""
        received = self.transport.tokens_received
        return torch.maximum(self.compute.token_count().reshape(1).to(received.device, received.dtype), received)

    def _account(self, p: Pass) -> None:
        s = self.stats
        s.peak_activations = max(s.peak_activations, len(self.saved))
        s.peak_in_flight = max(s.peak_in_flight, self.in_flight)
        s.peak_wgrad_bytes = max(s.peak_wgrad_bytes, sum(st.pending_bytes for st in self.stores))
        if self.memory is not None:
            self.memory.sample(p)

    # -- messages --------------------------------------------------------------------------------------
    def _await_inputs(self, p: Pass) -> None:
        """Wait, before the pass's clock starts (measured costs are its compute alone), for the message it
        consumes and, for a backward, for the send of its forward's output (freed before megatron's backward)."""
        need = consumed(self.schedule, self.rank, p)
        if need is not None:
            self.received[need] = self.transport.wait_recv(need)
        if p.op in (Op.B, Op.BW):
            sent = produced(self.schedule, self.rank, Pass(Op.F, p.mb, p.chunk))
            if sent is not None:
                self.transport.complete_send(sent)

    def _incoming(self, p: Pass, kind: str, vstage: int):
        need = consumed(self.schedule, self.rank, p)
        return self.received.pop(need) if need is not None else self.handoff.pop((kind, p.mb, vstage))

    def _outgoing(self, p: Pass, kind: str, tensor, to_vstage: int, on_done=None) -> None:
        msg = produced(self.schedule, self.rank, p)
        if msg is not None:
            self.outgoing[msg] = (tensor, on_done)
        else:  # the next stage is on this rank: hand over a fresh leaf, as a receive would
            self.handoff[(kind, p.mb, to_vstage)] = tensor.detach().requires_grad_()
            if on_done is not None:
                on_done()

    # -- the compute passes ----------------------------------------------------------------------------
    def forward(self, p: Pass) -> None:
        vs = self.schedule.virtual_stage(self.rank, p.chunk)
        input_tensor = None if vs == 0 else self._incoming(p, Kind.ACT, vs)
        output = self.compute.forward(p, vs, input_tensor, is_last_stage=vs == self.last_vstage)
        free = None
        if not self.compute.forward_only:
            self.saved[(p.mb, p.chunk)] = (input_tensor, output)
            self.in_flight += 1
            free = lambda: self.compute.release_output(output)
        if vs < self.last_vstage:
            self._outgoing(p, Kind.ACT, output, vs + 1, on_done=free)
        elif free is not None:
            free()

    def backward(self, p: Pass) -> None:
        vs = self.schedule.virtual_stage(self.rank, p.chunk)
        input_tensor, output = self.saved.pop((p.mb, p.chunk))
        output_grad = None if vs == self.last_vstage else self._incoming(p, Kind.GRAD, vs)
        last = p == self.last_backward[p.chunk]
        input_grad = self.compute.backward(p, vs, input_tensor, output, output_grad, self.stores[p.chunk], last)
        if p.op == Op.BW:
            self.in_flight -= 1
        if vs > 0:
            self._outgoing(p, Kind.GRAD, input_grad, vs - 1)

    def weight(self, p: Pass) -> None:
        self.compute.weight(p, self.stores[p.chunk])
        self.in_flight -= 1
