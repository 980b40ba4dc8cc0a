"""The automatic zero-bubble planner (paper section 3): a greedy heuristic, then an ILP refinement.

ZB-1p and ZB-2p are this planner under a memory limit of p and 2p in-flight microbatches (p M_B, 2p M_B).

The heuristic fixes each stage's F/B order as a template (a warm-up of F passes, then B and F
alternating, then the remaining B) and places W passes while it simulates with the real costs
(T_F, T_B, T_W per stage, T_comm between ranks): a W goes into every idle gap of at least T_W, into a
smaller gap when leaving it idle would make that stage the most idle one so far, and before an F or
B whenever the memory limit demands; the tail runs the W still pending. W runs in microbatch order,
which keeps the accumulated weight gradients bit-identical to 1F1B. A handful of warm-up variants are
tried and the one with the shortest longest-stage span wins. Because W has no successors, placing it
changes only its own stage's timeline, so the simulation never has to look ahead.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

from .costs import Costs
from .memory import rank_memory_limits
from .schedule import Pass, Schedule, ScheduleError

# A planned pass on one stage: (op, microbatch) with op in "F", "B", "W".
Step = tuple[str, int]

_TOLERANCE = 1e-9
OVERHANG_RULES = ("never", "bubble", "always")


@dataclass(frozen=True)
class Plan:
    """One stage order per rank plus the figures the variants are compared by."""

    orders: list[list[Step]]
    span: float  # longest stage span, own first pass to own last pass (the paper's cost)
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
    m_w: tuple[float, ...]  # what a B keeps for its W
    t_comm: float
    limits: tuple[float, ...]  # activation memory each rank may hold, in the costs' unit

    @classmethod
    def from_costs(cls, stages: int, microbatches: int, costs: Costs, limits: Sequence[float]) -> "Problem":
        return cls(stages, microbatches, costs.t_f, costs.t_b, costs.t_w, costs.m_f, costs.m_w, costs.t_comm,
                   tuple(limits))

    def fits(self, s: int, held: float) -> bool:
        return held <= self.limits[s] * (1 + _TOLERANCE) + _TOLERANCE

    def warmup_cap(self, s: int) -> int:
        """Most F a stage can hold before its first B: k M_B fits, and the B after it too."""
        mf, mw = self.m_f[s], self.m_w[s]
        if mf <= 0:
            return self.microbatches
        k = self.microbatches
        while k > 1 and not (self.fits(s, k * mf) and self.fits(s, (k - 1) * mf + mw)):
            k -= 1
        return k

    def busy(self, s: int) -> float:
        return self.microbatches * (self.t_f[s] + self.t_b[s] + self.t_w[s])


def template(warmup: int, microbatches: int) -> list[Step]:
    """F/B order of one stage: `warmup` F, then B and F alternating, then the remaining B."""
    order: list[Step] = [("F", j) for j in range(warmup)]
    for j in range(microbatches):
        order.append(("B", j))
        if warmup + j < microbatches:
            order.append(("F", warmup + j))
    return order


def greedy(problem: Problem, warmups: Sequence[int], overhang: str) -> Plan:
    """Simulate the templates with the real costs, placing W as the module docstring says.

    warmups must not increase from one stage to the next (stage s never waits for a B that stage s+1
    can only run after an F that stage s has not sent), which makes the templates deadlock-free.
    """
    p, m, tc = problem.stages, problem.microbatches, problem.t_comm
    end_f = [[-1.0] * m for _ in range(p)]
    end_b = [[-1.0] * m for _ in range(p)]
    orders: list[list[Step]] = [[] for _ in range(p)]
    templates = [template(warmups[s], m) for s in range(p)]
    pos, free, start, idle, held = [0] * p, [0.0] * p, [-1.0] * p, [0.0] * p, [0.0] * p
    next_w, done_b = [0] * p, [0] * p
    progressed = True
    while progressed:
        progressed = False
        for s in range(p):
            tmpl, order = templates[s], orders[s]
            tw, mw = problem.t_w[s], problem.m_w[s]
            eps = _TOLERANCE * (1.0 + tw)
            while pos[s] < len(tmpl):
                op, j = tmpl[pos[s]]
                if op == "F":
                    ready = 0.0 if s == 0 else end_f[s - 1][j] + tc
                    if s > 0 and end_f[s - 1][j] < 0:
                        break
                    delta, length = problem.m_f[s], problem.t_f[s]
                else:
                    ready = end_f[s][j]
                    if s < p - 1:
                        if end_b[s + 1][j] < 0:
                            break
                        ready = max(ready, end_b[s + 1][j] + tc)
                    delta, length = mw - problem.m_f[s], problem.t_b[s]
                t = free[s] if start[s] >= 0 else ready
                # W passes: first those the memory limit forces, then those that fit in the idle gap.
                while next_w[s] < done_b[s] and (
                    not problem.fits(s, held[s] + delta) or t + tw <= ready + eps
                ):
                    order.append(("W", next_w[s]))
                    next_w[s] += 1
                    t += tw
                    held[s] -= mw
                gap = ready - t
                if next_w[s] < done_b[s] and gap > eps and _overhang(overhang, gap, s, idle):
                    order.append(("W", next_w[s]))
                    next_w[s] += 1
                    t += tw
                    held[s] -= mw
                if start[s] < 0:
                    start[s] = ready
                elif ready > t:
                    idle[s] += ready - t
                t = max(t, ready)
                order.append((op, j))
                free[s] = t + length
                held[s] += delta
                if op == "F":
                    end_f[s][j] = free[s]
                else:
                    end_b[s][j] = free[s]
                    done_b[s] += 1
                pos[s] += 1
                progressed = True
    if any(pos[s] < len(templates[s]) for s in range(p)):
        raise ScheduleError("the warm-up counts of the automatic planner deadlock; they must not increase")
    spans = []
    for s in range(p):
        while next_w[s] < m:
            orders[s].append(("W", next_w[s]))
            next_w[s] += 1
            free[s] += problem.t_w[s]
        spans.append(free[s] - start[s])
    label = f"warm-up {list(warmups)}, overhang {overhang}"
    return Plan(orders, max(spans), label)


def _overhang(rule: str, gap: float, s: int, idle: list[float]) -> bool:
    """Whether a W goes into a gap shorter than T_W (delaying the next pass by T_W - gap)."""
    if rule == "always":
        return True
    if rule == "bubble":
        return idle[s] + gap > max(idle)
    return False


def ideal_warmups(problem: Problem) -> list[float]:
    """F a stage runs before B of microbatch 0 returns, if F never waited (the paper's k for stage 0)."""
    p, tc = problem.stages, problem.t_comm
    out = []
    for s in range(p):
        round_trip = sum(problem.t_f[t] + problem.t_b[t] + 2 * tc for t in range(s + 1, p))
        out.append(1 + round_trip / problem.t_f[s] if problem.t_f[s] > 0 else float(problem.microbatches))
    return out


def warmup_variants(problem: Problem) -> list[tuple[int, ...]]:
    """Candidate warm-up vectors, each capped by memory and m and made non-increasing over stages."""
    p = problem.stages
    caps = [problem.warmup_cap(s) for s in range(p)]
    ideal = ideal_warmups(problem)
    shapes = []
    for shift in (-2, -1, 0, 1, 2):
        shapes.append([math.ceil(k - 1e-9) + shift for k in ideal])
    for base in (caps[0], caps[0] - 1, caps[0] - 2):
        shapes.append([base - s for s in range(p)])  # 1F1B-like: one F fewer per stage
    shapes.append(list(caps))
    variants = []
    for shape in shapes:
        warmups, previous = [], problem.microbatches
        for s in range(p):
            w = max(1, min(shape[s], caps[s], previous))
            warmups.append(w)
            previous = w
        if tuple(warmups) not in variants:
            variants.append(tuple(warmups))
    return variants


def best_heuristic(problem: Problem) -> Plan:
    """The shortest-span plan over the warm-up variants and W overhang rules."""
    best = None
    for warmups in warmup_variants(problem):
        for rule in OVERHANG_RULES:
            plan = greedy(problem, warmups, rule)
            if best is None or plan.span < best.span - 1e-12:
                best = plan
    return best


def to_schedule(problem: Problem, plan: Plan, info: dict) -> Schedule:
    ranks = [[Pass(op, mb) for op, mb in order] for order in plan.orders]
    return Schedule(problem.stages, 1, problem.microbatches, "single", ranks, name="zb-auto", info=info)


def zb_auto(
    stages: int,
    microbatches: int,
    costs: Costs,
    memory_limit: float | None = None,
    memory_limit_absolute: float | None = None,
    ilp_time_limit: float = 10.0,
    progress: Callable[[str], None] | None = None,
) -> Schedule:
    """ZB-1p (memory_limit=p), ZB-2p (memory_limit=2p, the default) or any other limit.

    memory_limit counts in-flight microbatches (multiples of each rank's M_B); memory_limit_absolute is
    in the costs' memory unit. ilp_time_limit (seconds, 0 skips) bounds the ILP refinement, whose
    result replaces the heuristic's only when it simulates to a shorter longest-stage span.
    """
    if stages < 1 or microbatches < 1:
        raise ScheduleError(f"the automatic planner needs at least 1 stage and 1 microbatch, got {stages} and {microbatches}")
    if costs.num_virtual_stages != stages:
        raise ScheduleError(f"costs describe {costs.num_virtual_stages} stages but the pipeline has {stages}")
    if memory_limit is None and memory_limit_absolute is None:
        memory_limit = 2 * stages
    limits = rank_memory_limits(stages, 1, "single", costs, memory_limit, memory_limit_absolute)
    problem = Problem.from_costs(stages, microbatches, costs, limits)
    for s in range(stages):
        need = max(problem.m_f[s], problem.m_w[s])
        if not problem.fits(s, need):
            raise ScheduleError(
                f"memory limit {limits[s]:.4g} on rank {s} is below one microbatch's activations ({need:.4g})"
            )
    plan = best_heuristic(problem)
    info = {"planner": {"memory_limit": memory_limit, "memory_limit_absolute": memory_limit_absolute,
                        "heuristic": plan.label, "heuristic_span": plan.span}}
    if ilp_time_limit and ilp_time_limit > 0:
        from .ilp import refine  # highspy is imported only when the refinement runs

        plan, note = refine(problem, plan, ilp_time_limit, progress)
        info["planner"]["ilp"] = note
    info["planner"]["span"] = plan.span
    return to_schedule(problem, plan, info)
