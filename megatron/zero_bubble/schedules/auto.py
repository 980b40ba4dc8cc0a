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

import heapq
import math
from dataclasses import dataclass
from typing import Callable, Sequence

from .costs import Costs
from .memory import rank_memory_limits
from .schedule import Pass, Schedule, ScheduleError

# A planned pass on one stage: (op, microbatch) with op in "F", "B", "W".
Step = tuple[str, int]

_TOLERANCE = 1e-9


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


def greedy(problem: Problem, caps: Sequence[int], rule: Rule) -> Plan:
    """List-schedule F and B in time order with the real costs, placing W as the module docstring says.

    caps[s] bounds stage s's F passes not yet followed by their B (its warm-up, and what it keeps in
    flight afterwards). Strict rules alternate B and F after the warm-up, 1F1B-style; eager rules run
    whichever of B (first) and F is ready. Caps that never increase along the pipeline keep strict
    rules deadlock-free; eager rules are deadlock-free for any caps of at least 1.
    """
    p, m, tc = problem.stages, problem.microbatches, problem.t_comm
    end_f = [[-1.0] * m for _ in range(p)]
    end_b = [[-1.0] * m for _ in range(p)]
    orders: list[list[Step]] = [[] for _ in range(p)]
    free, start, idle, held = [0.0] * p, [-1.0] * p, [0.0] * p, [0.0] * p
    nf, nb, nw = [0] * p, [0] * p, [0] * p
    # Decision points (time, stage): a stage decides when it gets free or when an input arrives.
    events = [(0.0, s) for s in range(p)]
    most_idle = 0.0
    while events:
        now, s = heapq.heappop(events)
        if nb[s] == m or free[s] > now + _TOLERANCE * (1.0 + now):
            continue
        j, k = nb[s], nf[s]
        b_arrival = -1.0  # when B(j) can start on s; -1 while the stage after has not run it
        if j < k:
            if s == p - 1:
                b_arrival = end_f[s][j]
            elif end_b[s + 1][j] >= 0:
                b_arrival = max(end_f[s][j], end_b[s + 1][j] + tc)
        slack = _TOLERANCE * (1.0 + now)
        b_ready = 0 <= b_arrival <= now + slack
        f_ready = k < m and k - j < caps[s] and (s == 0 or 0 <= end_f[s - 1][k] and end_f[s - 1][k] + tc <= now + slack)
        if rule.strict:  # 1F1B order: F while under the cap, else B
            if k - j < caps[s] and k < m:
                b_ready = False
            else:
                f_ready = False
        elif f_ready and not b_ready and s > 0 and 0 <= b_arrival < now + rule.wait(j) * problem.t_f[s]:
            f_ready = False  # B arrives soon and the stages before wait for it: an F now would delay it
        if b_ready and f_ready and rule.prefer_f:
            b_ready = False
        if b_ready:
            op, mb, delta, length = "B", j, problem.m_w[s] - problem.m_f[s], problem.t_b[s]
        elif f_ready:
            op, mb, delta, length = "F", k, problem.m_f[s], problem.t_f[s]
        else:
            continue  # wait: the next arrival is another decision point
        t = free[s] if start[s] >= 0 else now
        tw, mw = problem.t_w[s], problem.m_w[s]
        # W passes: those the memory limit forces, those that fit in the idle gap, then maybe one more.
        while nw[s] < j and (not problem.fits(s, held[s] + delta) or t + tw <= now + slack):
            orders[s].append(("W", nw[s]))
            nw[s], t, held[s] = nw[s] + 1, t + tw, held[s] - mw
        gap = now - t
        if nw[s] < j and gap > slack and rule.overhang(gap, tw, idle[s], most_idle):
            orders[s].append(("W", nw[s]))
            nw[s], t, held[s] = nw[s] + 1, t + tw, held[s] - mw
        if start[s] < 0:
            start[s] = now
        elif now > t:
            idle[s] += now - t
            most_idle = max(most_idle, idle[s])
        t = max(t, now)
        orders[s].append((op, mb))
        free[s] = t + length
        held[s] += delta
        if op == "F":
            end_f[s][mb] = free[s]
            nf[s] += 1
            if s + 1 < p:
                heapq.heappush(events, (free[s] + tc, s + 1))
        else:
            end_b[s][mb] = free[s]
            nb[s] += 1
            if s > 0:
                heapq.heappush(events, (free[s] + tc, s - 1))
        heapq.heappush(events, (free[s], s))
    if any(nb[s] < m for s in range(p)):
        raise ScheduleError("the automatic planner's caps deadlock; strict rules need caps that never increase")
    spans = []
    for s in range(p):
        orders[s] += [("W", i) for i in range(nw[s], m)]
        spans.append(free[s] + (m - nw[s]) * problem.t_w[s] - start[s])
    return Plan(orders, max(spans), f"caps {list(caps)}, {rule}")


@dataclass(frozen=True)
class Rule:
    """Knobs of one greedy variant.

    strict: B and F alternate after the warm-up (else B first, F whenever ready and under the cap).
    fill: a W goes into an idle gap of at least fill * T_W (1.0: only gaps it fits in; the W then
      delays the next pass by T_W - gap).
    bubble: also insert a W when leaving the gap idle would make this stage the most idle one so far.
    patience: do not start an F when the next B arrives within patience * T_F.
    """

    strict: bool = False
    fill: float = 1.0
    bubble: bool = True
    patience: float = 0.0
    warmup_patience: float = 0.0
    prefer_f: bool = False

    def wait(self, b_done: int) -> float:
        return self.warmup_patience if b_done == 0 else self.patience

    def overhang(self, gap: float, t_w: float, idle: float, most_idle: float) -> bool:
        return gap >= self.fill * t_w or (self.bubble and idle + gap > most_idle)

    def __str__(self) -> str:
        order = "strict 1F1B order" if self.strict else "eager B/F"
        bubble = " + bubble rule" if self.bubble else ""
        return f"{order}, W fill {self.fill:g}{bubble}, patience {self.patience:g} (warm-up {self.warmup_patience:g})"


def ideal_warmups(problem: Problem) -> list[float]:
    """F a stage runs before B of microbatch 0 returns, if F never waited (the paper's k for stage 0)."""
    p, tc = problem.stages, problem.t_comm
    out = []
    for s in range(p):
        round_trip = sum(problem.t_f[t] + problem.t_b[t] + 2 * tc for t in range(s + 1, p))
        out.append(1 + round_trip / problem.t_f[s] if problem.t_f[s] > 0 else float(problem.microbatches))
    return out


def warmup_variants(problem: Problem) -> dict[str, tuple[int, ...]]:
    """Candidate caps by name, each within memory and m and made non-increasing over stages."""
    p = problem.stages
    caps = [problem.warmup_cap(s) for s in range(p)]
    ideal = ideal_warmups(problem)
    shapes = {f"ideal{shift:+d}": [math.ceil(k - 1e-9) + shift for k in ideal] for shift in (-1, 0, 1)}
    for threshold in (0.1, 0.25, 0.5, 1.0):  # round the ideal down when its fraction is below threshold
        shapes[f"ideal-round{threshold:g}"] = [math.floor(k) if k - math.floor(k) < threshold else math.ceil(k)
                                               for k in ideal]
    for less in (0, 1, 2):
        shapes[f"1f1b-{less}"] = [caps[0] - less - s for s in range(p)]  # one F fewer per stage
    shapes["memory"] = list(caps)
    variants = {}
    for name, shape in shapes.items():
        warmups, previous = [], problem.microbatches
        for s in range(p):
            warmups.append(max(1, min(shape[s], caps[s], previous)))
            previous = warmups[-1]
        variants[name] = tuple(warmups)
    return variants


RULES = tuple(
    Rule(strict, fill, bubble, patience)
    for strict in (False, True)
    for fill in (1.0, 0.5, 0.0)
    for bubble in (True, False)
    for patience in ((0.0,) if strict else (0.0, 0.1, 0.25, 0.5, 1.0))
)


def best_heuristic(problem: Problem, rules: Sequence[Rule] = RULES) -> Plan:
    """The shortest-span plan over the cap variants and greedy rules."""
    best, tried = None, set()
    for caps in warmup_variants(problem).values():
        for rule in rules:
            if (caps, rule) in tried:
                continue
            tried.add((caps, rule))
            plan = greedy(problem, caps, rule)
            if best is None or plan.span < best.span * (1 - 1e-12):
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
