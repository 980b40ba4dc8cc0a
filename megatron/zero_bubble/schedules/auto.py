"""The automatic zero-bubble planner (paper section 3): a greedy heuristic, then an ILP refinement.

ZB-1p and ZB-2p are this planner under a memory limit of p and 2p in-flight microbatches (p M_B, 2p M_B).

The heuristic is list scheduling with the real costs (T_F, T_B, T_W per stage, T_comm between ranks):
each stage warms up with F passes (up to a cap on F without their B, within the memory limit), then
runs B and F as they arrive, and places W passes as it goes: into every idle gap of at least T_W, into
a smaller gap when leaving it idle would make that stage the most idle one so far, and before an F or
B whenever the memory limit demands; the tail runs the W still pending. Each stage runs W in microbatch
order, which keeps the accumulated weight gradients bit-identical to 1F1B. Because W has no successors,
placing a W changes only its own stage's timeline, so W can be placed in a gap once the gap's end is
known. A few cap shapes and rule variants are simulated, the caps of the best are tuned one stage at a
time, and the shortest longest-stage span (the paper's cost) wins.
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Callable, Sequence

from .auto_problem import TOLERANCE, Plan, Problem, Step, span_lower_bound, to_schedule
from .costs import Costs
from .ilp import refine
from .problem import MemoryLimit
from .schedule import Schedule, ScheduleError

__all__ = ["Plan", "Problem", "Rule", "Step", "best_heuristic", "default_memory_limit", "greedy",
           "span_lower_bound", "to_schedule", "zb_auto"]

# Passes the heuristic may simulate in all (about half a second of CPU): p=32, m=256 gets 16 runs.
PASS_BUDGET = 400_000


@dataclass(frozen=True)
class Rule:
    """Knobs of one greedy variant.

    strict: B and F alternate after the warm-up, 1F1B-style (else B first, F whenever ready and under
      the cap); strict needs caps that never increase along the pipeline to be deadlock-free.
    fill: a W also goes into an idle gap of at least fill * T_W, delaying the next pass by T_W - gap.
    bubble: also insert such a W when leaving the gap idle would make this stage the most idle so far.
    patience, warmup_patience: after / before a stage's first B, do not start an F when the next B
      arrives within that many T_F (an F then would delay the B the stages before wait for).
    """

    strict: bool = False
    fill: float = 1.0
    bubble: bool = True
    patience: float = 0.0
    warmup_patience: float = 0.0

    def __str__(self) -> str:
        order = "strict 1F1B order" if self.strict else "eager B/F"
        bubble = " + bubble rule" if self.bubble else ""
        return f"{order}, W fill {self.fill:g}{bubble}, patience {self.patience:g}/{self.warmup_patience:g}"


def greedy(problem: Problem, caps: Sequence[int], rule: Rule) -> Plan:
    """Schedule F and B in time order with the real costs, placing W as the module docstring says."""
    p, m, tc = problem.stages, problem.microbatches, problem.t_comm
    t_f, t_b, t_w, m_f, m_w = problem.t_f, problem.t_b, problem.t_w, problem.m_f, problem.m_w
    room = [x * (1 + TOLERANCE) + TOLERANCE for x in problem.limits]
    strict, fill, bubble = rule.strict, rule.fill, rule.bubble
    end_f = [[-1.0] * m for _ in range(p)]
    end_b = [[-1.0] * m for _ in range(p)]
    orders: list[list[Step]] = [[] for _ in range(p)]
    free, start, idle, held = [0.0] * p, [-1.0] * p, [0.0] * p, [0.0] * p
    nf, nb, nw = [0] * p, [0] * p, [0] * p
    events = [(0.0, s) for s in range(p)]  # (time, stage): decide when free or when an input arrives
    push, pop = heapq.heappush, heapq.heappop
    most_idle = 0.0
    while events:
        now, s = pop(events)
        slack = TOLERANCE * (1.0 + now)
        if nb[s] == m or free[s] > now + slack:
            continue
        j, k = nb[s], nf[s]
        b_arrival = -1.0  # when B(j) can start on s; -1 while the next stage has not run it
        if j < k:
            if s == p - 1:
                b_arrival = end_f[s][j]
            elif end_b[s + 1][j] >= 0:
                b_arrival = max(end_f[s][j], end_b[s + 1][j] + tc)
        b_ready = 0 <= b_arrival <= now + slack
        under_cap = k < m and k - j < caps[s]
        f_ready = under_cap and (s == 0 or 0 <= end_f[s - 1][k] and end_f[s - 1][k] + tc <= now + slack)
        if strict:  # F while under the cap, else B
            b_ready = b_ready and not under_cap
            f_ready = f_ready and under_cap
        elif f_ready and not b_ready and s > 0 and 0 <= b_arrival:
            wait = rule.warmup_patience if j == 0 else rule.patience
            f_ready = b_arrival >= now + wait * t_f[s]
        if b_ready:
            op, mb, delta, length = "B", j, m_w[s] - m_f[s], t_b[s]
        elif f_ready:
            op, mb, delta, length = "F", k, m_f[s], t_f[s]
        else:
            continue  # wait: the next arrival is another decision point
        order, tw = orders[s], t_w[s]
        t = free[s] if start[s] >= 0 else now
        # W passes the memory limit forces, then those that fit in the idle gap, then maybe one more.
        while nw[s] < j and (held[s] + delta > room[s] or t + tw <= now + slack):
            order.append(("W", nw[s]))
            nw[s] += 1
            t += tw
            held[s] -= m_w[s]
        gap = now - t
        if nw[s] < j and gap > slack and (gap >= fill * tw or (bubble and idle[s] + gap > most_idle)):
            order.append(("W", nw[s]))
            nw[s] += 1
            t += tw
            held[s] -= m_w[s]
        if start[s] < 0:
            start[s] = now
        elif now > t:
            idle[s] += now - t
            most_idle = max(most_idle, idle[s])
            t = now
        order.append((op, mb))
        end = free[s] = t + length
        held[s] += delta
        if op == "F":
            end_f[s][mb] = end
            nf[s] += 1
            if s + 1 < p:
                push(events, (end + tc, s + 1))
        else:
            end_b[s][mb] = end
            nb[s] += 1
            if s > 0:
                push(events, (end + tc, s - 1))
        push(events, (end, s))
    if any(nb[s] < m for s in range(p)):
        raise ScheduleError("the automatic planner's caps deadlock; strict rules need caps that never increase")
    spans = []
    for s in range(p):
        orders[s] += [("W", i) for i in range(nw[s], m)]
        spans.append(free[s] + (m - nw[s]) * t_w[s] - start[s])
    return Plan(orders, max(spans), f"caps {list(caps)}, {rule}")


def ideal_warmups(problem: Problem) -> list[float]:
    """F a stage can run before B of microbatch 0 returns to it (the paper's k for stage 0)."""
    p, tc, m = problem.stages, problem.t_comm, problem.microbatches
    out = []
    for s in range(p):
        round_trip = sum(problem.t_f[t] + problem.t_b[t] + 2 * tc for t in range(s + 1, p))
        out.append(1 + round_trip / problem.t_f[s] if problem.t_f[s] > 0 else float(m))
    return out


def cap_shapes(problem: Problem) -> dict[str, tuple[int, ...]]:
    """Candidate caps by name, each within memory and m and never increasing along the pipeline."""
    p = problem.stages
    limit = [problem.memory_cap(s) for s in range(p)]
    ideal = ideal_warmups(problem)
    shapes = {"ideal-ceil": [math.ceil(k - 1e-9) for k in ideal], "ideal-floor": [math.floor(k) for k in ideal]}
    shapes["ideal-ceil-1"] = [k - 1 for k in shapes["ideal-ceil"]]
    shapes["ideal-ceil+1"] = [k + 1 for k in shapes["ideal-ceil"]]
    for threshold in (0.1, 0.25, 0.5):  # round the ideal down when its fraction is below threshold
        shapes[f"ideal-round{threshold:g}"] = [math.floor(k) + (k - math.floor(k) >= threshold) for k in ideal]
    for less in (0, 1):
        shapes[f"1f1b-{less}"] = [limit[0] - less - s for s in range(p)]  # one F fewer per stage
    shapes["memory"] = limit
    return {name: _monotone(shape, limit, problem.microbatches) for name, shape in shapes.items()}


def _monotone(shape: Sequence[int], limit: Sequence[int], microbatches: int) -> tuple[int, ...]:
    caps, previous = [], microbatches
    for want, most in zip(shape, limit):
        previous = max(1, min(want, most, previous))
        caps.append(previous)
    return tuple(caps)


# Tried first, in this order: together they matched the best of all variants on a grid of small
# pipelines and on the paper's rows; the full product follows while the budget lasts.
FAVOURITES = (
    ("ideal-floor", Rule(warmup_patience=0.25)),
    ("1f1b-0", Rule(strict=True, bubble=False)),
    ("ideal-round0.5", Rule(strict=True, fill=0.5)),
    ("ideal-ceil", Rule(fill=0.0, patience=0.25, warmup_patience=0.1)),
    ("ideal-round0.25", Rule(strict=True)),
    ("ideal-ceil", Rule()),
    ("1f1b-0", Rule(warmup_patience=0.5)),
    ("ideal-round0.1", Rule(strict=True, fill=0.5)),
)
RULES = tuple(Rule(False, fill, bubble, patience, warmup)
              for fill in (1.0, 0.5, 0.0) for bubble in (True, False)
              for patience in (0.0, 0.25) for warmup in (0.0, 0.1, 0.25, 0.5)) + tuple(
    Rule(True, fill, bubble) for fill in (1.0, 0.5, 0.0) for bubble in (True, False))


def best_heuristic(problem: Problem, budget: int = PASS_BUDGET) -> Plan:
    """Favourite variants, then caps tuned one stage at a time, then the rest, within `budget` passes."""
    shapes = cap_shapes(problem)
    cost = 3 * problem.stages * problem.microbatches
    enough = span_lower_bound(problem) * (1 + TOLERANCE)
    tried: dict[tuple[tuple[int, ...], Rule], Plan] = {}

    def run(caps: tuple[int, ...], rule: Rule) -> Plan:
        nonlocal budget
        if (caps, rule) not in tried:
            budget -= cost
            tried[(caps, rule)] = greedy(problem, caps, rule)
        return tried[(caps, rule)]

    best = None
    for name, rule in FAVOURITES:
        plan = run(shapes[name], rule)
        best = plan if best is None or plan.span < best.span else best
        if best.span <= enough or budget < cost:
            return best
    caps, rule = next(key for key, plan in tried.items() if plan is best)
    most = [min(problem.memory_cap(s), problem.microbatches) for s in range(problem.stages)]
    improved = True
    while improved and budget >= cost:
        improved = False
        for s in range(problem.stages):
            # one stage's cap, or the caps of it and all later stages together, one up or down
            for step, stop in ((1, s + 1), (-1, s + 1), (-1, problem.stages), (1, problem.stages)):
                trial = tuple(max(1, min(c + step, most[t])) if s <= t < stop else c for t, c in enumerate(caps))
                if (rule.strict and trial != _monotone(trial, trial, problem.microbatches)) or budget < cost:
                    continue
                plan = run(trial, rule)
                if plan.span < best.span * (1 - 1e-12):
                    best, caps, improved = plan, trial, True
    for shape in shapes.values():
        for rule in RULES:
            if best.span <= enough or budget < cost:
                return best
            plan = run(shape, rule)
            best = plan if plan.span < best.span * (1 - 1e-12) else best
    return best


def default_memory_limit(stages: int) -> float:
    """ZB-2p: twice 1F1B's peak, in in-flight microbatches (the registry, planners.SCHEDULES, reads it here)."""
    return 2 * stages


def zb_auto(
    stages: int,
    microbatches: int,
    costs: Costs,
    memory_limit: MemoryLimit | float | None = None,
    memory_limit_absolute: float | None = None,
    ilp_time_limit: float = 10.0,
    progress: Callable[[str], None] | None = None,
) -> Schedule:
    """ZB-1p (memory_limit=p), ZB-2p (memory_limit=2p, the default) or any other limit.

    memory_limit is a MemoryLimit or a count of in-flight microbatches (multiples of each rank's M_B);
    memory_limit_absolute, the older spelling of an absolute limit, is in the costs' memory unit.
    ilp_time_limit (seconds, 0 skips) bounds the ILP refinement, whose result replaces the heuristic's
    only when it simulates to a shorter longest-stage span. progress(line) hears from the ILP about once
    a second when it runs longer than that.
    """
    if stages < 1 or microbatches < 1:
        raise ScheduleError(f"the automatic planner needs a stage and a microbatch, got {stages} and {microbatches}")
    if costs.num_virtual_stages != stages:
        raise ScheduleError(f"costs describe {costs.num_virtual_stages} stages but the pipeline has {stages}")
    limit = MemoryLimit.of(memory_limit, memory_limit_absolute)
    if limit is None:
        limit = MemoryLimit(default_memory_limit(stages))
    limits = limit.per_rank(stages, 1, "single", costs)
    problem = Problem.from_costs(stages, microbatches, costs, limits)
    for s in range(stages):
        need = max(problem.m_f[s], problem.m_w[s])
        if not problem.fits(s, need):
            raise ScheduleError(
                f"memory limit {limits[s]:.4g} on rank {s} is below one microbatch's activations ({need:.4g})"
            )
    plan = best_heuristic(problem)
    notes = {**limit.to_info(), "heuristic": plan.label, "heuristic_span": plan.span}
    if ilp_time_limit and ilp_time_limit > 0:
        plan, notes["ilp"] = refine(problem, plan, ilp_time_limit, progress)  # imports highspy only now
    notes["span"] = plan.span
    return to_schedule(problem, plan, {"planner": notes})
