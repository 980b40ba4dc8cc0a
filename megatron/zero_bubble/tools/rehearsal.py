"""Rehearsal: the real executor, lowering and p2p transport with each pass replaced by a wait.

One process per pipeline rank (gloo on this machine). Every rank runs the same per-iteration interpreter
as training (`runtime.iteration.Iteration` over the program `lower` produced and `check_lowering` proved),
posts the same receives and sends through `PipelineTransport`, with payloads of a chosen size, but its
compute passes (`RehearsalPasses`, the iteration's public PassCompute hook) only wait: an F,
B, W or BW pass waits for its planned duration: a sleep to 0.3 ms before its end, then a spin to the
end (sleep alone overshoots by about 0.2 ms here). Sleeping ranks cost no CPU, so p = 32 fits on two cores.

What it shows: whether the runtime keeps the simulator's timeline. A receive posted late, a send that
blocks, a pass that waits for a message it does not need: each makes passes start later than planned,
reported per pass (planned and actual start) and as `max_pass_lateness`. Times in the result are in the
schedule's time unit; one unit lasts `unit_ms` milliseconds of wall time.

Data parallelism (`DataParallel`): the gradient reduction over data-parallel replicas, modelled on one
pipeline (the replicas run the same plan): each chunk's weights are `layers` pieces, B/BW/W passes wait
for them piece by piece, and the runtime's own WeightGradStore defers, re-cuts (the layer-by-layer tail)
and reports them as the executor does in training. Megatron DDP's buckets are modelled as training has
them: several on the first pipeline stage and one elsewhere (megatron-core 0.19), several on every stage
under a split schedule (patches/ddp_bucketing.py); with overlap a bucket's reduction starts when its last
weight is complete, without it they all start after the rank's last pass. Reductions
run one after another on a modelled communication stream, each taking its share of `seconds`; the rank
waits for the last at the end of its backward, and `dp_exposed` reports how long after its last pass.
"""
from __future__ import annotations

import math
import os
import statistics
import tempfile
import time
from collections import Counter
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..runtime.iteration import Iteration, LoweredRun
from ..runtime.links import PipelineLinks
from ..runtime.pass_timer import ClockPassTimer
from ..runtime.p2p import PipelineTransport, TorchP2P
from ..runtime.wgrad_store import WeightGradStore
from ..schedules.comm import Recv
from ..schedules.costs import Costs
from ..schedules.ops import Op, facts
from ..schedules.schedule import Pass, Schedule
from ..schedules.simulate import duration, simulate
from .local_ranks import init_group, run_ranks
from .strict_p2p import StrictP2P

DEFAULT_MESSAGE_KIB = 64


@dataclass
class RehearsalOptions:
    unit_ms: float = 1.0  # wall milliseconds per unit of the schedule's costs
    message_kib: float = DEFAULT_MESSAGE_KIB  # size of each activation / gradient message
    recv_delay_ms: float = 0.0  # a deliberately slow transport: sleep before posting each receive (tests)
    delayed_rank: int | None = None  # the rank whose transport is slowed (None: every rank)
    timeout_s: float = 300.0
    # messages as NCCL runs them (tools/strict_p2p.py: the rules of schedules/nccl_model.py); False: gloo's own
    # operations
    strict_p2p: bool = True
    # Several iterations and the optimizer step between them, in the schedule's time unit. Without V passes
    # the step is megatron's synchronous one: a real all-reduce over all ranks (everyone waits for the
    # slowest), a modelled all-reduce time, then the step. With V passes (post-validation) each rank steps
    # on its own right after its last pass; the sums travel in the next iteration's V passes.
    iterations: int = 1
    optimizer_step: float = 0.0
    allreduce: float = 0.0
    data_parallel: "DataParallel | None" = None


@dataclass(frozen=True)
class DataParallel:
    """The modelled data-parallel gradient reduction (see the module docstring); times in schedule units."""

    reduce_time: float  # to reduce all of one rank's gradients
    overlap: bool = True  # megatron's --overlap-grad-reduce
    buckets: int = 8  # bucket groups of a bucketed stage
    # Which stages have `buckets` (the others one): None as training has it (megatron buckets the first stage
    # only; the runtime buckets every stage under a split schedule, patches/ddp_bucketing.py), or forced.
    every_stage: bool | None = None
    layers: int = 8  # weights per chunk, in the order their gradients complete (the last layer's first)


class _ModelledReduction:
    """One rank's gradient buckets and its communication stream, as megatron DDP with overlap_grad_reduce."""

    def __init__(self, model: DataParallel, rank: int, chunks: int, unit_s: float, split_backward: bool):
        self.model = model
        self.weights = [[torch.nn.Parameter(torch.empty(1)) for _ in range(model.layers)] for _ in range(chunks)]
        every_stage = split_backward if model.every_stage is None else model.every_stage
        buckets_of_chunk = [model.buckets if (k == 0 and (rank == 0 or every_stage)) else 1 for k in range(chunks)]
        self.bucket_of = {id(w): (k, i * buckets_of_chunk[k] // model.layers)
                          for k, weights in enumerate(self.weights) for i, w in enumerate(weights)}
        self.size = Counter(self.bucket_of.values())  # bucket -> its weights
        self.seconds_per_weight = model.reduce_time * unit_s / (chunks * model.layers)
        self.reset()

    def reset(self) -> None:
        self.missing = dict(self.size)  # bucket -> weights not complete yet
        self.started: set = set()
        self.stream_free = 0.0  # monotonic time at which the communication stream has done all it was given

    def ready(self, weight) -> None:
        bucket = self.bucket_of[id(weight)]
        self.missing[bucket] -= 1
        if self.missing[bucket] == 0 and self.model.overlap:
            self._start(bucket)

    def _start(self, bucket) -> None:
        self.started.add(bucket)
        self.stream_free = max(time.monotonic(), self.stream_free) + self.size[bucket] * self.seconds_per_weight

    def finish(self) -> float:
        """Start what has not started, wait for the stream to finish; returns when it did (monotonic)."""
        for bucket in sorted(set(self.size) - self.started):
            self._start(bucket)
        _sleep_until(self.stream_free)
        return self.stream_free


class _PassClock:
    """Waits within one pass, piece after piece, against the pass's own start (sleep overshoots do not add up)."""

    def __init__(self):
        self.cursor = 0.0

    def start(self) -> float:
        self.cursor = time.monotonic()
        return self.cursor

    def wait(self, seconds: float) -> None:
        self.cursor += seconds
        _sleep_until(self.cursor)


@dataclass
class _WaitWork:
    """A deferred weight gradient that only waits (wgrad_store.DeferredWork)."""

    weight: torch.nn.Parameter
    seconds: float
    clock: _PassClock
    nbytes: int = 0

    def __call__(self) -> None:
        self.clock.wait(self.seconds)


class _DelayedTransport(PipelineTransport):
    """A transport that posts every receive late, to prove the rehearsal exposes it."""

    def __init__(self, *args, delay_s: float, **kwargs):
        super().__init__(*args, **kwargs)
        self.delay_s = delay_s

    def post_batch(self, batch, outgoing, tokens=None) -> None:
        if any(type(post) is Recv for post in batch.ops):
            time.sleep(self.delay_s)
        super().post_batch(batch, outgoing, tokens)


class RehearsalPasses:
    """The compute passes of a rehearsal (iteration.PassCompute): each waits for its planned duration. With
    data parallelism modelled, B, BW and W go piece by piece through the chunk's weights and the real
    WeightGradStore, and the end of the backward waits for the modelled reduction."""

    forward_only = False

    def __init__(self, costs: Costs, unit_s: float, payload: torch.Tensor, reduction: "_ModelledReduction | None",
                 record: "_Record", virtual_stage):
        self.costs, self.unit_s, self.payload, self.reduction, self.record = costs, unit_s, payload, reduction, record
        self.virtual_stage = virtual_stage  # chunk -> this rank's virtual stage
        self.clock = _PassClock()

    def _wait(self, p: Pass, vstage: int) -> None:
        _sleep_until(time.monotonic() + duration(p, vstage, self.costs) * self.unit_s)

    def forward(self, p: Pass, vstage: int, input_tensor, is_last_stage: bool):
        self._wait(p, vstage)
        return self.payload

    def backward(self, p: Pass, vstage: int, input_tensor, output, output_grad, store: WeightGradStore,
                 last: bool):
        if self.reduction is None:
            self._wait(p, vstage)
            return self.payload
        weights = self.reduction.weights[p.chunk]
        t_b, t_w = (self.costs.t_b[vstage] * self.unit_s / len(weights),
                    self.costs.t_w[vstage] * self.unit_s / len(weights))
        self.clock.start()
        with store.split_backward() if p.op == Op.B else store.fused_backward(last):
            for weight in weights:
                self.clock.wait(t_b)
                store.hand_over(_WaitWork(weight, t_w, self.clock))
        if p.op == Op.B:
            store.close_microbatch(p.mb, last=last)
        return self.payload

    def weight(self, p: Pass, store: WeightGradStore) -> None:
        if self.reduction is None:
            self._wait(p, self.virtual_stage(p.chunk))
            return
        self.clock.start()
        store.run_next(p.mb)

    def finish_backward(self) -> None:
        """The data-parallel reduction, when modelled: the rank waits for its last bucket."""
        if self.reduction is None:
            return
        done = self.reduction.finish()
        self.record.reduction(done)

    def release_output(self, output) -> None:
        pass

    def restart(self) -> None:
        pass

    def loss_scale_changed(self) -> None:
        pass

    def pass_timer(self, clock):
        return ClockPassTimer(clock)

    def token_count(self) -> torch.Tensor:
        return torch.zeros(1, dtype=torch.int64)


class _Record:
    """A rank's passes as (op, mb, chunk, start, end) in schedule units from the common start t0 (the observer
    of its iterations), its optimizer steps ("step") and its modelled reduction ("dp")."""

    def __init__(self, t0: float, unit_s: float):
        self.t0, self.unit_s, self.entries = t0, unit_s, []

    def _units(self, t: float) -> float:
        return (t - self.t0) / self.unit_s

    def __call__(self, p: Pass, start: float, end: float) -> None:
        if not facts(p.op).takes_time:
            start = end  # a post-validation pass takes no time of its own; what it waited for is not its
        self.entries.append((p.op, p.mb, p.chunk, self._units(start), self._units(end)))

    def reduction(self, done: float) -> None:
        last_pass = max(entry[4] for entry in self.entries if entry[0] != "step")
        self.entries.append(("dp", 0, 0, last_pass, self._units(done)))

    def step(self, step: int) -> None:
        now = self._units(time.monotonic())
        self.entries.append(("step", step, 0, now, now))


@dataclass
class _ModelledValidation:
    """Post-validation's summaries travel as in training; the step never needs a rollback (iteration.StepValidation)."""

    size: int = 2
    has_pending: bool = False

    def statistics(self, partial, final: bool, tokens=None) -> torch.Tensor:
        return torch.zeros(self.size) if partial is None else partial

    def receive_result(self, result) -> tuple[torch.Tensor, bool]:
        return (torch.zeros(self.size) if result is None else result), False

    def settle(self) -> bool:
        return False

    def flush(self) -> None:
        return None


SPIN_S = 3e-4  # sleep can overshoot its deadline: sleep to this much before it, then spin


def _sleep_until(deadline: float) -> None:
    left = deadline - time.monotonic()
    if left > SPIN_S:
        time.sleep(left - SPIN_S)
    while time.monotonic() < deadline:
        pass


def _wait(seconds: float) -> None:
    if seconds > 0:
        _sleep_until(time.monotonic() + seconds)


def _rank_main(rank: int, world: int, result_dir: str, schedule_json: str, costs: Costs,
               options: RehearsalOptions) -> None:
    torch.set_num_threads(1)
    init_group("gloo", rank, world, result_dir)
    try:
        schedule = Schedule.from_json(schedule_json)
        lowered = LoweredRun.of(schedule)  # the lowering training runs
        validation = _ModelledValidation()
        group = dist.group.WORLD
        numel = max(1, int(options.message_kib * 1024 // 4))
        delayed = options.recv_delay_ms > 0 and options.delayed_rank in (None, rank)
        transport_type = _DelayedTransport if delayed else PipelineTransport
        extra = {"delay_s": options.recv_delay_ms / 1e3} if delayed else {}
        # the pipeline group, its batches run as NCCL runs them (in order, rendezvous, one kernel each)
        links = PipelineLinks(group)
        ops = StrictP2P(options.timeout_s) if options.strict_p2p else TorchP2P()
        transport = transport_type(links, (numel,), torch.float32, torch.device("cpu"),
                                   validation_numel=validation.size, ops=ops, **extra)
        unit_s = options.unit_ms / 1e3
        reduction, ready = None, None
        if options.data_parallel is not None:
            reduction = _ModelledReduction(options.data_parallel, rank, schedule.chunks, unit_s,
                                           schedule.uses_split_backward())
            ready = reduction.ready if options.data_parallel.overlap else None
        stores = [WeightGradStore(f"chunk {k}", grad_ready=ready) for k in range(schedule.chunks)]
        # Everyone starts at one agreed instant (CLOCK_MONOTONIC is shared by the processes of a machine).
        start = torch.tensor([time.monotonic() + 0.2 + 0.01 * world], dtype=torch.float64)
        dist.broadcast(start, src=0)
        record = _Record(float(start.item()), unit_s)
        compute = RehearsalPasses(costs, unit_s, torch.zeros(numel, dtype=torch.float32), reduction, record,
                                  lambda chunk: schedule.virtual_stage(rank, chunk))
        _sleep_until(record.t0)
        synchronous = not schedule.has_post_validation()
        flag = torch.zeros(1)
        for step in range(options.iterations):
            if reduction is not None and step:
                reduction.reset()
            iteration = Iteration(schedule=lowered.schedule, rank=rank, compute=compute, transport=transport,
                                  stores=stores, validation=validation, observer=record, clock=time.monotonic)
            iteration.run(lowered.programs[rank])
            iteration.finish_backward()
            if options.iterations > 1:
                if synchronous:
                    dist.all_reduce(flag, group=group)  # the grad-norm / inf check every rank waits for
                    _wait(options.allreduce * unit_s)
                _wait(options.optimizer_step * unit_s)
                record.step(step)
        torch.save(record.entries, os.path.join(result_dir, f"rank{rank}.pt"))
        if options.strict_p2p:
            ops.close()
        dist.barrier()
    finally:
        dist.destroy_process_group()


def rehearse(schedule: Schedule, costs: Costs, options: RehearsalOptions | None = None) -> dict:
    """Run `schedule` once on schedule.stages local processes; returns the report (see the module docstring)."""
    options = options or RehearsalOptions()
    timeline = simulate(schedule, costs)
    world = schedule.stages
    with tempfile.TemporaryDirectory(prefix="zb_rehearsal_") as result_dir:
        run_ranks(_rank_main, world, result_dir, (schedule.to_json(), costs, options), options.timeout_s,
                  "fork" if not dist.is_initialized() else "spawn", "the rehearsal")
        records = [torch.load(os.path.join(result_dir, f"rank{r}.pt"), weights_only=False) for r in range(world)]
    return _report(schedule, timeline, records, options.unit_ms)


def _first_iteration(record: list[tuple]) -> list[tuple]:
    """A rank's record up to its first optimizer step (all of it when it ran one iteration)."""
    steps = [i for i, entry in enumerate(record) if entry[0] == "step"]
    return record[:steps[0]] if steps else record


def _report(schedule: Schedule, timeline, records: list[list[tuple]], unit_ms: float = 1.0) -> dict:
    """Planned against measured for the first iteration; with several, also the time they took in all."""
    total = max((r[-1][4] for r in records if r), default=0.0)
    steps = sum(1 for r in records[0] if r[0] == "step")
    records = [_first_iteration(r) for r in records]
    reductions = [next((entry for entry in r if entry[0] == "dp"), None) for r in records]
    records = [[entry for entry in r if entry[0] != "dp"] for r in records]
    per_rank, lateness, spans, busy, gaps = [], 0.0, [], [], []
    measured_end = 0.0
    for rank, (planned, actual) in enumerate(zip(timeline.ranks, records)):
        passes = []
        for timed, (op, mb, chunk, start, end) in zip(planned, actual):
            if (timed.op.op, timed.op.mb, timed.op.chunk) != (op, mb, chunk):
                raise RuntimeError(f"rank {rank} ran {op}{mb}.{chunk} where the plan has {timed.op}")
            late = start - timed.start
            lateness = max(lateness, late)
            passes.append({"op": op, "mb": mb, "chunk": chunk, "planned_start": timed.start, "actual_start": start,
                           "actual_end": end, "lateness": late})
        work = [a for a in actual if facts(a[0]).takes_time]
        span = (work[-1][4] - work[0][3]) if work else 0.0
        spans.append(span)
        busy.append(sum(a[4] - a[3] for a in work))
        # The executor's own time per pass: between two passes planned back to back on this rank, the first
        # ending after the second was due (so the second waited on nothing but the executor), everything
        # between one's end and the next one's start.
        for (before, after), (done, started) in zip(zip(planned, planned[1:]), zip(actual, actual[1:])):
            back_to_back = after.start - before.end < 1e-9 and done[4] >= after.start
            if back_to_back and facts(done[0]).takes_time and facts(started[0]).takes_time:
                gaps.append((started[3] - done[4]) * unit_ms * 1e3)
        measured_end = max(measured_end, max((a[4] for a in actual), default=0.0))
        per_rank.append({"rank": rank, "measured_span": span, "simulated_span": timeline.span(rank),
                         "max_lateness": max((p["lateness"] for p in passes), default=0.0), "passes": passes})
        if reductions[rank] is not None:  # from the rank's last pass to its last bucket reduced
            per_rank[-1]["dp_exposed"] = reductions[rank][4] - reductions[rank][3]
    longest = max(spans, default=0.0)
    measured_bubble = (longest - max(busy, default=0.0)) / longest if longest > 0 else 0.0
    dp = {}
    if all(r is not None for r in reductions):
        # what the reduction adds to the iteration: its last bucket against the last pass of any rank
        dp = {"dp_exposed": max(r[4] for r in reductions) - measured_end,
              "dp_exposed_per_rank": [r[4] - r[3] for r in reductions]}
    return {**dp,
        "schedule": schedule.name or "(from file)",
        "stages": schedule.stages,
        "microbatches": schedule.microbatches,
        "simulated_makespan": timeline.makespan,
        "measured_makespan": measured_end,
        "ratio": measured_end / timeline.makespan if timeline.makespan > 0 else math.nan,
        "simulated_bubble_rate": timeline.bubble_rate,
        "measured_bubble_rate": measured_bubble,
        "max_pass_lateness": lateness,
        "executor_us_per_pass": statistics.median(gaps) if gaps else None,
        "iterations": max(1, steps),
        "measured_time_per_iteration": total / steps if steps else measured_end,
        "per_rank": per_rank,
    }
