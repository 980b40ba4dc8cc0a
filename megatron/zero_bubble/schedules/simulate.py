"""Simulate a schedule under a cost model: start and end of every pass, bubble rate, peak memory.

Each rank runs its passes in the given order; a pass starts when its rank is free and its
dependencies have ended (plus T_comm when the dependency ran on another rank). Dependencies and
durations are the rows of ops.TABLE: F(mb, s) after F(mb, s-1); B(mb, s) after F(mb, s) and
B(mb, s+1); W(mb, s) after B(mb, s); a BW is a B and a W at once. The once-per-rank passes of
post-validation take no time: V waits for the V of the rank before it in the validation chain, S (after
a rank's last pass) for the S of the rank before it in the statistics chain. Spans and the makespan count
the passes that take time: a rank waiting at its S for the statistics of the others is not in its
iteration's span (it waits for them only before stepping, while the next iteration's warm-up starts).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import NamedTuple

from .costs import Costs
from .memory import memory_profile
from .ops import TABLE, Op, PassKey, facts
from .schedule import Pass, Schedule, ScheduleError


def provides(p: Pass, vstage: int) -> tuple[PassKey, ...]:
    """What the pass counts as for the passes that need it (a BW is a B and a W)."""
    return tuple((op, p.mb, vstage) for op in facts(p.op).completes)


def requires(p: Pass, vstage: int, num_vstages: int, stages: int) -> tuple[PassKey, ...]:
    return facts(p.op).needs_at(p.mb, vstage, num_vstages, stages)


def duration(p: Pass, vstage: int, costs: Costs) -> float:
    return facts(p.op).duration(costs, vstage)


class TimedPass(NamedTuple):  # a tuple: planners time hundreds of thousands of passes
    rank: int
    vstage: int
    op: Pass
    start: float
    end: float


@dataclass
class Timeline:
    schedule: Schedule
    costs: Costs
    ranks: list[list[TimedPass]]
    peak_memory: list[float]
    # sequence[rank][pos]: when the simulator timed that pass, counted over all ranks: an order in which every pass
    # comes after what it waited for, even among passes of the same time (comm.lower breaks ties by it)
    sequence: list[list[int]] | None = None

    def timed_ends(self, rank: int) -> tuple[TimedPass, TimedPass] | None:
        """The rank's first and last pass that takes time (V and S do not), None if it has none."""
        passes = self.ranks[rank]
        first = next((t for t in passes if facts(t.op.op).takes_time), None)
        last = next((t for t in reversed(passes) if facts(t.op.op).takes_time), None)
        return None if first is None else (first, last)

    @property
    def makespan(self) -> float:
        ends = (self.timed_ends(r) for r in range(len(self.ranks)))
        return max((e[1].end for e in ends if e is not None), default=0.0)

    def span(self, rank: int) -> float:
        ends = self.timed_ends(rank)
        return ends[1].end - ends[0].start if ends is not None else 0.0

    def busy(self, rank: int) -> float:
        return self._busy[rank]

    @cached_property
    def _busy(self) -> list[float]:  # worked out once: planners score many timelines of large plans
        return [sum(t.end - t.start for t in passes) for passes in self.ranks]

    @cached_property
    def _longest_span(self) -> float:
        return max(self.span(r) for r in range(len(self.ranks)))

    @property
    def bubble_time(self) -> float:
        """Paper's measure: longest per-rank span (own first to own last pass) minus the busiest rank's work (never
        below 0: a rank busy all its span can sum its passes a rounding error above its span)."""
        return max(0.0, self._longest_span - max(self._busy))

    @property
    def bubble_rate(self) -> float:
        cost = self._longest_span
        return self.bubble_time / cost if cost > 0 else 0.0

    @property
    def bubble_rate_from_zero(self) -> float:
        """Bubble rate with every rank measured from time 0 to the makespan (start-up counted as idle)."""
        cost = self.makespan
        return (cost - max(self._busy)) / cost if cost > 0 else 0.0


def simulate(schedule: Schedule, costs: Costs) -> Timeline:
    """Time every pass; raises ScheduleError naming the stuck ranks if the order deadlocks."""
    nv = schedule.num_virtual_stages
    if costs.num_virtual_stages != nv:
        raise ScheduleError(
            f"costs describe {costs.num_virtual_stages} virtual stages but the schedule has {nv}"
        )
    p, m = schedule.stages, max(1, schedule.microbatches)
    # ended[op][stage][mb]: when (op, mb, stage) got done, -1 while it has not (lists: planners time big plans);
    # waiting[op][stage]: microbatch -> ranks stopped at a pass that needs it
    ended = {op: [[-1.0] * m for _ in range(nv)] for op in Op}
    waiting = {op: [{} for _ in range(nv)] for op in Op}
    rows = _rows(schedule, costs, ended, waiting)
    timed: list[list[TimedPass]] = [[] for _ in range(p)]
    sequence: list[list[int]] = [[] for _ in range(p)]
    pos, free, counted = [0] * p, [0.0] * p, 0
    # A rank runs its passes until one lacks an input; it then waits for that input and runs on once it ends.
    # Each pass is looked at about once, whichever way the dependencies point.
    runnable = list(reversed(range(p)))
    chunks, new = schedule.chunks, tuple.__new__  # a TimedPass from its fields, without a Python-level call
    while runnable:
        rank = runnable.pop()
        passes, at, end, row_of, out = schedule.ranks[rank], pos[rank], free[rank], rows[rank], timed[rank]
        order = sequence[rank]
        while at < len(passes):
            op = passes[at]
            kind, mb, chunk = op
            if not (0 <= mb < m and 0 <= chunk < chunks):
                raise ScheduleError(f"rank {rank} runs {op.describe()}, outside the schedule's chunks or "
                                    f"microbatches (the validator names such problems first)")
            vs, needs, length, completes = row_of[kind][chunk]
            ready = 0.0
            for done, comm, waiters in needs:
                arrives = done[mb]
                if arrives < 0:
                    waiters.setdefault(mb, []).append(rank)
                    break
                arrives += comm
                if arrives > ready:
                    ready = arrives
            else:  # every input has ended: the pass runs
                start = end if end > ready else ready
                end = start + length
                out.append(new(TimedPass, (rank, vs, op, start, end)))
                order.append(counted)
                counted += 1
                for work, waiters in completes:
                    work[mb] = end
                    if waiters and mb in waiters:
                        runnable += waiters.pop(mb)
                at += 1
                continue
            break
        pos[rank], free[rank] = at, end
    if any(pos[r] < len(schedule.ranks[r]) for r in range(p)):
        raise ScheduleError(_deadlock_message(schedule, pos, ended))
    peaks = [max(profile, default=0.0) for profile in memory_profile(schedule, costs)]
    return Timeline(schedule, costs, timed, peaks, sequence)


def _rows(schedule: Schedule, costs: Costs, ended: dict, waiting: dict) -> list[dict]:
    """Per rank, op and chunk the table's row: virtual stage, needs as (end times of the needed pass, T_comm to
    get here, who waits for it), duration, and the (end times, waiters) the pass fills in."""
    nv, p = schedule.num_virtual_stages, schedule.stages
    rows = []
    for rank in range(p):
        row_of = {op: [] for op in TABLE}
        for chunk in range(schedule.chunks):
            vs = schedule.virtual_stage(rank, chunk)
            for op, f in TABLE.items():
                needs = tuple((ended[need][u], costs.t_comm if schedule.owner(u)[0] != rank else 0.0, waiting[need][u])
                              for need, u in f.needed_stages(vs, nv, p))
                completes = tuple((ended[work][vs], waiting[work][vs]) for work in f.completes)
                row_of[op].append((vs, needs, f.duration(costs, vs), completes))
        rows.append(row_of)
    return rows


def _deadlock_message(schedule: Schedule, pos: list[int], ended: dict) -> str:
    nv = schedule.num_virtual_stages
    where = {}
    for rank, position, op in schedule.passes():
        for key in provides(op, schedule.virtual_stage(rank, op.chunk)):
            where[key] = (rank, op)
    rank = next(r for r in range(schedule.stages) if pos[r] < len(schedule.ranks[r]))
    op = schedule.ranks[rank][pos[rank]]
    missing = next(d for d in requires(op, schedule.virtual_stage(rank, op.chunk), nv, schedule.stages)
                   if ended[d[0]][d[2]][d[1]] < 0)
    if missing not in where:
        return (
            f"rank {rank} cannot run {op.describe()}: no rank runs {missing[0]} of microbatch {missing[1]} "
            f"at virtual stage {missing[2]}"
        )
    other, other_op = where[missing]
    stuck = schedule.ranks[other][pos[other]].describe() if pos[other] < len(schedule.ranks[other]) else "its end"
    return (
        f"deadlock: rank {rank} waits at {op.describe()} for {other_op.describe()} on rank {other}, "
        f"which is stuck at {stuck}"
    )
