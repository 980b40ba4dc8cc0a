"""What the automatic planner's heuristic (auto.py) and its ILP refinement (ilp.py) share.

The problem (pipeline ranks, chunks per rank in a layout, microbatches, costs, per-rank memory limits) with
the facts both read worked out once from ops.TABLE: per virtual stage the duration and memory change of F,
B and W and what each needs (with the T_comm of each input); a plan (one order of passes per rank) and the
lower bound on its span, which tells both when to stop. Its own module so that neither imports the other in
a circle.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from .costs import Costs
from .ops import Op, facts
from .schedule import Pass, Schedule, rank_stages, stage_owner

Step = tuple[Op, int, int]  # a pass of one rank's plan: (op, microbatch, chunk), a Pass once planned
TOLERANCE = 1e-9
SPLIT = (Op.F, Op.B, Op.W)  # the passes the automatic planner places: a split backward


@dataclass(frozen=True)
class Plan:
    """One order per rank and its longest rank span (own first pass to own last pass)."""

    orders: list[list[Step]]
    span: float
    label: str  # which variant produced it, for the schedule's info


@dataclass(frozen=True)
class Problem:
    """Everything the heuristic and the ILP need; `stages` counts pipeline ranks, each holding `chunks`
    virtual stages of `layout` (one chunk: "single"; several: megatron's "interleaved", k*p + r)."""

    stages: int
    microbatches: int
    costs: Costs
    limits: tuple[float, ...]  # activation memory each rank may hold, in the costs' unit
    chunks: int = 1
    layout: str = "single"
    # Worked out from ops.TABLE in __post_init__; per virtual stage unless said otherwise.
    stage_of: tuple[tuple[int, ...], ...] = field(init=False, repr=False)  # [rank][chunk] -> virtual stage
    owner: tuple[int, ...] = field(init=False, repr=False)  # virtual stage -> rank
    chunk_of: tuple[int, ...] = field(init=False, repr=False)  # virtual stage -> chunk of its rank
    time: dict = field(init=False, repr=False)  # op -> durations
    memory: dict = field(init=False, repr=False)  # op -> memory change (negative: frees)
    needs: dict = field(init=False, repr=False)  # op -> per stage ((op, stage, T_comm of that input), ...)
    users: dict = field(init=False, repr=False)  # op -> per stage ((op, stage, T_comm), ...) that need it

    def __post_init__(self):
        n, costs = self.stages * self.chunks, self.costs
        owner = tuple(stage_owner(self.layout, self.stages, u)[0] for u in range(n))
        comm = lambda a, b: costs.t_comm if owner[a] != owner[b] else 0.0  # noqa: E731
        needs = {op: tuple(tuple((need, u, comm(u, v)) for need, u in facts(op).needed_stages(v, n, self.stages))
                           for v in range(n)) for op in SPLIT}
        users = {op: [[] for _ in range(n)] for op in SPLIT}
        for op in SPLIT:
            for v in range(n):
                for need, u, t in needs[op][v]:
                    users[need][u].append((op, v, t))
        setattr_ = object.__setattr__
        setattr_(self, "stage_of", tuple(rank_stages(self.layout, self.stages, self.chunks)))
        setattr_(self, "owner", owner)
        setattr_(self, "chunk_of", tuple(stage_owner(self.layout, self.stages, u)[1] for u in range(n)))
        setattr_(self, "time", {op: tuple(facts(op).duration(costs, v) for v in range(n)) for op in SPLIT})
        setattr_(self, "memory", {op: tuple(facts(op).memory_change(costs, v) for v in range(n)) for op in SPLIT})
        setattr_(self, "needs", needs)
        setattr_(self, "users", {op: tuple(map(tuple, rows)) for op, rows in users.items()})

    @classmethod
    def from_costs(cls, stages: int, microbatches: int, costs: Costs, limits: Sequence[float], chunks: int = 1,
                   layout: str | None = None) -> "Problem":
        return cls(stages, microbatches, costs, tuple(limits), chunks,
                   layout or ("single" if chunks == 1 else "interleaved"))

    @property
    def num_virtual_stages(self) -> int:
        return self.stages * self.chunks

    @property
    def t_comm(self) -> float:
        return self.costs.t_comm

    def fits(self, r: int, held: float) -> bool:
        return held <= self.limits[r] * (1 + TOLERANCE) + TOLERANCE

    def microbatch_memory(self, r: int) -> float:
        """Activations one microbatch leaves on rank r after its forwards on every chunk (its M_B)."""
        return sum(self.memory[Op.F][u] for u in self.stage_of[r])

    def backward_extra(self, r: int) -> float:
        """The most a B adds on rank r beyond the F it follows (positive only when M_W > M_B)."""
        return max(0.0, max(self.memory[Op.B][u] for u in self.stage_of[r]))

    def memory_cap(self, r: int) -> int:
        """Most microbatches a rank can hold without their B: k M_B fits, and so does the B that follows."""
        k, one, extra = self.microbatches, self.microbatch_memory(r), self.backward_extra(r)
        while k > 1 and not (self.fits(r, k * one) and self.fits(r, k * one + extra)):
            k -= 1
        return k

    def work(self, r: int) -> float:
        """One microbatch's F, B and W on every chunk of rank r."""
        return sum(self.time[op][u] for op in SPLIT for u in self.stage_of[r])

    def busy(self, r: int) -> float:
        return self.microbatches * self.work(r)


def span_lower_bound(problem: Problem) -> float:
    """No schedule that runs each rank's F, B and W in microbatch order (per chunk) has a shorter longest span.

    One chunk per rank: the chain and memory bounds below. Several: see interleaved_lower_bound.
    """
    if problem.chunks > 1:
        return interleaved_lower_bound(problem)
    p, m, tc = problem.stages, problem.microbatches, problem.t_comm
    t_f, t_b, t_w = (problem.time[op] for op in SPLIT)
    m_f, m_w = problem.memory[Op.F], [-x for x in problem.memory[Op.W]]
    first = [sum(t_f[:s]) + s * tc for s in range(p)]
    bound = 0.0
    for i in range(p):
        # Chain: stage k runs all its F and B before its last B ends; that B travels back to stage i < k and
        # is followed by its W there, while stage i's span starts when F of microbatch 0 reaches it.
        # Memory: before B of microbatch 0 returns, a stage can only run the F its memory holds; after its
        # last F it can only run the B and W of what it holds until the B of that last F returns.
        round_trip = sum(t_f[t] + t_b[t] + 2 * tc for t in range(i + 1, p))  # F leaves i, its B returns
        cap = min(problem.memory_cap(i), m)
        before_first_b = max(0.0, t_f[i] + round_trip - cap * t_f[i])
        tail_work = 0.0
        for held in range(1, cap + 1):  # F still without B when the last F ends
            room = problem.limits[i] * (1 + TOLERANCE) - held * m_f[i]
            pending = m - held if m_w[i] <= 0 else min(m - held, max(0, int(room / m_w[i])))
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


def interleaved_lower_bound(problem: Problem) -> float:
    """A lower bound on the longest rank span with several chunks per rank.

    Rank r's span starts with its first F (of chunk 0) and holds all its work. Before its first B can start,
    microbatch 0 runs forward through every later virtual stage and backward down to the rank's last chunk;
    until then the rank runs only forwards, and all of them stay in memory: at most its memory limit's worth,
    each F taking at most the rank's highest time per unit of memory. Symmetrically, after its last F (of its
    last chunk, microbatch m-1) the rank waits for that microbatch's backward to come down the later stages,
    filling the time with at most what its memory holds of B and W work.
    """
    n, m = problem.num_virtual_stages, problem.microbatches
    t_f, t_b, t_w = (problem.time[op] for op in SPLIT)
    bound = 0.0
    for r in range(problem.stages):
        own = problem.stage_of[r]
        first, last = own[0], own[-1]
        hops = lambda a, b: sum(problem.needs[Op.F][u][0][2] for u in range(a + 1, b + 1))  # noqa: E731
        # forward from the rank's first stage to the end, then backward down to its last chunk
        to_first_b = (sum(t_f[first:]) + hops(first, n - 1) + sum(t_b[last + 1:]) + hops(last, n - 1))
        per_memory = max(_ratio(t_f[u], problem.memory[Op.F][u]) for u in own)
        forwards = min(m * sum(t_f[u] for u in own), problem.limits[r] * per_memory)
        before = max(0.0, to_first_b - forwards)
        # after the last F of the last chunk: the rest of the chain down to the last B (chunk 0) of microbatch m-1
        after_last_f = sum(t_f[last + 1:]) + hops(last, n - 1) + sum(t_b[last + 1:]) + hops(last, n - 1)
        # B and W work per unit of the memory it frees: an activation (B then W) or what B keeps for W
        per_held = max(_ratio(t_b[u] + t_w[u], problem.memory[Op.F][u]) for u in own)
        per_held = max(per_held, max(_ratio(t_w[u], -problem.memory[Op.W][u]) for u in own))
        tail = min(problem.limits[r] * per_held, m * sum(t_b[u] + t_w[u] for u in own))
        after = max(0.0, after_last_f - tail)
        # the two waits are apart only when not every forward fits in memory before the first B
        apart = not problem.fits(r, m * problem.microbatch_memory(r))
        bound = max(bound, problem.busy(r) + (before + after if apart else max(before, after)))
    return bound


def _ratio(work: float, memory: float) -> float:
    return work / memory if memory > 0 else float("inf")


def to_schedule(problem: Problem, plan: Plan, info: dict) -> Schedule:
    return Schedule(problem.stages, problem.chunks, problem.microbatches, problem.layout,
                    [[Pass._make(step) for step in order] for order in plan.orders], name="zb-auto", info=info)
