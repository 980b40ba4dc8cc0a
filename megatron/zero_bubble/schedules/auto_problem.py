"""What the automatic planner's heuristic (auto.py) and its ILP refinement (ilp.py) share.

The problem in plain per-stage tuples, a plan (one order of (op, microbatch) steps per stage) and the
lower bound on its span, which tells both when to stop. Its own module so that neither imports the other
in a circle.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from .costs import Costs
from .schedule import Pass, Schedule

Step = tuple[str, int]  # a pass on one stage: (op, microbatch) with op in "F", "B", "W"

TOLERANCE = 1e-9


@dataclass(frozen=True)
class Plan:
    """One order per stage and its longest stage span (own first pass to own last pass)."""

    orders: list[list[Step]]
    span: float
    label: str  # which variant produced it, for the schedule's info


@dataclass(frozen=True)
class Problem:
    """Everything the heuristic and the ILP need, in plain per-stage tuples."""

    stages: int
    microbatches: int
    t_f: tuple[float, ...]
    t_b: tuple[float, ...]
    t_w: tuple[float, ...]
    m_f: tuple[float, ...]  # M_B of the paper: what an F adds
    m_w: tuple[float, ...]  # M_W: what a B keeps for its W
    t_comm: float
    limits: tuple[float, ...]  # activation memory each rank may hold, in the costs' unit

    @classmethod
    def from_costs(cls, stages: int, microbatches: int, costs: Costs, limits: Sequence[float]) -> "Problem":
        return cls(stages, microbatches, costs.t_f, costs.t_b, costs.t_w, costs.m_f, costs.m_w, costs.t_comm,
                   tuple(limits))

    def fits(self, s: int, held: float) -> bool:
        return held <= self.limits[s] * (1 + TOLERANCE) + TOLERANCE

    def memory_cap(self, s: int) -> int:
        """Most F a stage can hold without their B: k M_B fits, and so does the B that follows."""
        k = self.microbatches
        while k > 1 and not (self.fits(s, k * self.m_f[s]) and self.fits(s, (k - 1) * self.m_f[s] + self.m_w[s])):
            k -= 1
        return k

    def busy(self, s: int) -> float:
        return self.microbatches * (self.t_f[s] + self.t_b[s] + self.t_w[s])


def span_lower_bound(problem: Problem) -> float:
    """No schedule that runs each stage's F, B and W in microbatch order has a shorter longest span.

    Chain: stage k runs all its F and B before its last B ends; that B travels back to stage i < k and
    is followed by its W there, while stage i's span starts when F of microbatch 0 reaches it.
    Memory: before B of microbatch 0 returns, a stage can only run the F its memory holds; after its
    last F it can only run the B and W of what it holds until the B of that last F returns.
    """
    p, m, tc = problem.stages, problem.microbatches, problem.t_comm
    t_f, t_b, t_w = problem.t_f, problem.t_b, problem.t_w
    first = [sum(t_f[:s]) + s * tc for s in range(p)]
    bound = 0.0
    for i in range(p):
        round_trip = sum(t_f[t] + t_b[t] + 2 * tc for t in range(i + 1, p))  # F leaves i, its B returns
        cap = min(problem.memory_cap(i), m)
        before_first_b = max(0.0, t_f[i] + round_trip - cap * t_f[i])
        tail_work = 0.0
        for held in range(1, cap + 1):  # F still without B when the last F ends
            room = problem.limits[i] * (1 + TOLERANCE) - held * problem.m_f[i]
            pending = m - held if problem.m_w[i] <= 0 else min(m - held, max(0, int(room / problem.m_w[i])))
            tail_work = max(tail_work, (held - 1) * (t_b[i] + t_w[i]) + pending * t_w[i])
        after_last_f = max(0.0, round_trip - tail_work)
        idle = before_first_b + after_last_f if m > cap else max(before_first_b, after_last_f)
        bound = max(bound, problem.busy(i) + idle)
    for k in range(1, p):
        ready = first[k] + m * (t_f[k] + t_b[k])
        for i in reversed(range(k)):
            ready += tc + t_b[i]
            bound = max(bound, ready + t_w[i] - first[i])
    return bound


def to_schedule(problem: Problem, plan: Plan, info: dict) -> Schedule:
    ranks = [[Pass(op, mb) for op, mb in order] for order in plan.orders]
    return Schedule(problem.stages, 1, problem.microbatches, "single", ranks, name="zb-auto", info=info)
