"""Simulate a schedule under a cost model: start and end of every pass, bubble rate, peak memory.

Each rank runs its passes in the given order; a pass starts when its rank is free and its
dependencies have ended (plus T_comm when the dependency ran on another rank).
Dependencies: F(mb, s) after F(mb, s-1); B(mb, s) after F(mb, s) and B(mb, s+1); W(mb, s) after B(mb, s).
A BW pass is a B and a W at once. The post-validation pass V (single layout, vstage = rank) takes no
time and waits for the V of the next rank: the validation result travels from rank p-1 down to rank 0.
"""
from __future__ import annotations

from dataclasses import dataclass

from .costs import Costs
from .memory import memory_profile
from .schedule import Pass, Schedule, ScheduleError

# A pass's identity across ranks: (kind, microbatch, virtual stage), kind in F, B, W, V.
PassKey = tuple[str, int, int]


def provides(p: Pass, vstage: int) -> tuple[PassKey, ...]:
    if p.op == "BW":
        return (("B", p.mb, vstage), ("W", p.mb, vstage))
    return ((p.op, p.mb, vstage),)


def requires(p: Pass, vstage: int, num_vstages: int) -> tuple[PassKey, ...]:
    if p.op == "V":
        return (("V", 0, vstage + 1),) if vstage < num_vstages - 1 else ()
    if p.op == "F":
        return (("F", p.mb, vstage - 1),) if vstage > 0 else ()
    if p.op in ("B", "BW"):
        later = (("B", p.mb, vstage + 1),) if vstage < num_vstages - 1 else ()
        return (("F", p.mb, vstage),) + later
    return (("B", p.mb, vstage),)  # W


def duration(p: Pass, vstage: int, costs: Costs) -> float:
    if p.op == "V":
        return 0.0  # only a message's latency (T_comm); the re-step after a rollback is not planned for
    if p.op == "F":
        return costs.t_f[vstage]
    if p.op == "B":
        return costs.t_b[vstage]
    if p.op == "W":
        return costs.t_w[vstage]
    return costs.t_b[vstage] + costs.t_w[vstage]


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

    @property
    def makespan(self) -> float:
        return max((r[-1].end for r in self.ranks if r), default=0.0)

    def span(self, rank: int) -> float:
        passes = self.ranks[rank]
        return passes[-1].end - passes[0].start if passes else 0.0

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
    progressed = True
    while progressed:
        progressed = False
        for rank in range(p):
            passes = schedule.ranks[rank]
            while pos[rank] < len(passes):
                op = passes[pos[rank]]
                vs = schedule.virtual_stage(rank, op.chunk)
                deps = requires(op, vs, nv)
                if any(d not in ended for d in deps):
                    break
                ready = max(
                    (ended[d][0] + (costs.t_comm if ended[d][1] != rank else 0.0) for d in deps), default=0.0
                )
                start = max(free[rank], ready)
                end = start + duration(op, vs, costs)
                timed[rank].append(TimedPass(rank, vs, op, start, end))
                for key in provides(op, vs):
                    ended[key] = (end, rank)
                free[rank] = end
                pos[rank] += 1
                progressed = True
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
    missing = next(d for d in requires(op, schedule.virtual_stage(rank, op.chunk), nv) if d not in ended)
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
