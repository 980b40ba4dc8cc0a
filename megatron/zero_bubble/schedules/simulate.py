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

from .costs import Costs
from .memory import memory_profile
from .ops import Op, PassKey, facts
from .schedule import Pass, Schedule, ScheduleError


def provides(p: Pass, vstage: int) -> tuple[PassKey, ...]:
    """What the pass counts as for the passes that need it (a BW is a B and a W)."""
    return tuple((op, p.mb, vstage) for op in facts(p.op).completes)


def requires(p: Pass, vstage: int, num_vstages: int, stages: int) -> tuple[PassKey, ...]:
    return facts(p.op).needs_at(p.mb, vstage, num_vstages, stages)


def duration(p: Pass, vstage: int, costs: Costs) -> float:
    return facts(p.op).duration(costs, vstage)


@dataclass(frozen=True)
class TimedPass:
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
        return sum(t.end - t.start for t in self.ranks[rank])

    @property
    def bubble_time(self) -> float:
        """Paper's measure: longest per-rank span (own first to own last pass) minus the busiest rank's work."""
        return max(self.span(r) for r in range(len(self.ranks))) - max(self.busy(r) for r in range(len(self.ranks)))

    @property
    def bubble_rate(self) -> float:
        cost = max(self.span(r) for r in range(len(self.ranks)))
        return self.bubble_time / cost if cost > 0 else 0.0

    @property
    def bubble_rate_from_zero(self) -> float:
        """Bubble rate with every rank measured from time 0 to the makespan (start-up counted as idle)."""
        cost = self.makespan
        return (cost - max(self.busy(r) for r in range(len(self.ranks)))) / cost if cost > 0 else 0.0


def simulate(schedule: Schedule, costs: Costs) -> Timeline:
    """Time every pass; raises ScheduleError naming the stuck ranks if the order deadlocks."""
    nv = schedule.num_virtual_stages
    if costs.num_virtual_stages != nv:
        raise ScheduleError(
            f"costs describe {costs.num_virtual_stages} virtual stages but the schedule has {nv}"
        )
    p = schedule.stages
    ended: dict[PassKey, tuple[float, int]] = {}
    timed: list[list[TimedPass]] = [[] for _ in range(p)]
    pos, free = [0] * p, [0.0] * p
    rows: dict[tuple[Op, int], tuple] = {}  # the table's row per (op, virtual stage), worked out once
    stage_of: dict[tuple[int, int], int] = {}  # (rank, chunk) -> virtual stage
    t_comm = costs.t_comm
    progressed = True
    while progressed:
        progressed = False
        for rank in range(p):
            passes, at, end = schedule.ranks[rank], pos[rank], free[rank]
            while at < len(passes):
                op = passes[at]
                vs = stage_of.get((rank, op.chunk))
                if vs is None:
                    vs = stage_of[rank, op.chunk] = schedule.virtual_stage(rank, op.chunk)
                row = rows.get((op.op, vs))
                if row is None:
                    f = facts(op.op)
                    row = rows[op.op, vs] = (f.needed_stages(vs, nv, p), f.duration(costs, vs), f.completes)
                needs, length, completes = row
                ready, mb = 0.0, op.mb
                for need, stage in needs:
                    done = ended.get((need, mb, stage))
                    if done is None:
                        break
                    arrives = done[0] + (t_comm if done[1] != rank else 0.0)
                    if arrives > ready:
                        ready = arrives
                else:  # every input has ended: the pass runs
                    start = end if end > ready else ready
                    end = start + length
                    timed[rank].append(TimedPass(rank, vs, op, start, end))
                    for work in completes:
                        ended[work, mb, vs] = (end, rank)
                    at += 1
                    progressed = True
                    continue
                break
            pos[rank], free[rank] = at, end
    if any(pos[r] < len(schedule.ranks[r]) for r in range(p)):
        raise ScheduleError(_deadlock_message(schedule, pos, ended))
    peaks = [max(profile, default=0.0) for profile in memory_profile(schedule, costs)]
    return Timeline(schedule, costs, timed, peaks)


def _deadlock_message(schedule: Schedule, pos: list[int], ended: dict) -> str:
    nv = schedule.num_virtual_stages
    where = {}
    for rank, position, op in schedule.passes():
        for key in provides(op, schedule.virtual_stage(rank, op.chunk)):
            where[key] = (rank, op)
    rank = next(r for r in range(schedule.stages) if pos[r] < len(schedule.ranks[r]))
    op = schedule.ranks[rank][pos[rank]]
    missing = next(d for d in requires(op, schedule.virtual_stage(rank, op.chunk), nv, schedule.stages)
                   if d not in ended)
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
