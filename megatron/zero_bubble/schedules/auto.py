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
time, and the shortest longest-stage span (the paper's cost) wins. With one chunk per rank 1F1B (backward split),
ZB-H1 and ZB-H2 are candidates too where they fit the limit: the planner is never slower than a schedule of its
family it could have picked.
"""
from __future__ import annotations

import math
from dataclasses import replace
from typing import Callable, Sequence

from .auto_greedy import Rule, greedy
from .auto_problem import TOLERANCE, Plan, Problem, span_lower_bound, to_schedule
from .costs import Costs
from .baselines import interleaved_one_f_one_b, one_f_one_b
from .handcrafted import zb_h1, zb_h2
from .ilp import refine
from .memory import memory_profile
from .problem import MemoryLimit
from .ops import Op
from .schedule import Schedule, ScheduleError
from .simulate import simulate

__all__ = ["Plan", "Problem", "Rule", "best_heuristic", "default_memory_limit", "greedy",
           "interleaved_memory_limit", "span_lower_bound", "to_schedule", "zb_auto"]

# Passes the heuristic may simulate in all, which bounds its planning time: p=32, m=256 gets 16 runs.
PASS_BUDGET = 400_000


def ideal_warmups(problem: Problem) -> list[float]:
    """Microbatches a rank can start before B of microbatch 0 returns to it (the paper's k for stage 0): the
    time from the end of its first F until its first B can start, over one microbatch's F on all its chunks."""
    m, n, t_f, t_b = problem.microbatches, problem.num_virtual_stages, problem.time[Op.F], problem.time[Op.B]
    out = []
    for own in problem.stage_of:
        first, last = own[0], own[-1]
        round_trip = 0.0
        for u in range(first + 1, n):
            comm = problem.needs[Op.F][u][0][2]  # T_comm of the hop into u (0 within a rank)
            round_trip += t_f[u] + t_b[u] + 2 * comm if u > last else t_f[u] + comm
        forward = sum(t_f[u] for u in own)
        out.append(1 + round_trip / forward if forward > 0 else float(m))
    return out


def cap_shapes(problem: Problem) -> dict[str, tuple[int, ...]]:
    """Candidate caps (microbatches a rank holds without their B) by name, each within memory and m and never
    increasing along the pipeline. With several chunks "memory" is m: the memory rule of the greedy, which
    also admits a microbatch whose later chunks must wait for room, is the limit."""
    p = problem.stages
    limit = [problem.memory_cap(r) for r in range(p)]
    ideal = ideal_warmups(problem)
    shapes = {"ideal-ceil": [math.ceil(k - 1e-9) for k in ideal], "ideal-floor": [math.floor(k) for k in ideal]}
    shapes["ideal-ceil-1"] = [k - 1 for k in shapes["ideal-ceil"]]
    shapes["ideal-ceil+1"] = [k + 1 for k in shapes["ideal-ceil"]]
    for threshold in (0.1, 0.25, 0.5):  # round the ideal down when its fraction is below threshold
        shapes[f"ideal-round{threshold:g}"] = [math.floor(k) + (k - math.floor(k) >= threshold) for k in ideal]
    for less in (0, 1):
        shapes[f"1f1b-{less}"] = [limit[0] - less - s for s in range(p)]  # one F fewer per stage
    if problem.chunks > 1:
        limit = [problem.microbatches] * p
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
# With several chunks per rank: chosen greedily (each cuts the summed regret most) from a sweep of 6 rules x 4
# chunk orders x 2 forward waits x 4 cap shapes on the paper's 12 rows at v = 2 and 4, at interleaved 1F1B's
# peak and twice it; only the memory rule ever won, so every favourite leaves the caps to it. The fifth and
# sixth were the best of all 30 rules on the two rows where the first sweep's set stayed above half of
# interleaved 1F1B's bubble (1.5B/8/32 and 14.6B/16/128 at v = 4).
CHUNKED_FAVOURITES = tuple(("memory", rule) for rule in (
    Rule(warmup_patience=0.5, fill=0.5, f_order="deep", b_order="oldest", f_wait=0.5),
    Rule(warmup_patience=0.25, f_order="oldest", f_wait=0.5),
    Rule(warmup_patience=0.5, fill=0.5, f_order="oldest", f_wait=0.5),
    Rule(warmup_patience=0.5, b_order="oldest"),
    Rule(fill=0.0, patience=0.25, warmup_patience=0.25, f_wait=0.5),
    Rule(fill=0.5, patience=0.25, warmup_patience=0.5, f_wait=0.5),
    Rule(f_order="oldest"),
    Rule(warmup_patience=0.5, fill=0.5, f_order="oldest"),
    Rule(f_order="shallow"),
    Rule(warmup_patience=0.5),
))
CHUNKED_RUNS = 24  # most greedy runs with several chunks: favourites, then other rules and orders
# Up to this many passes the plan is also compared with interleaved 1F1B split into B and W (which the greedy can
# lose to with few microbatches per chunk, but never did on the paper's rows at v = 2 and 4); above it, only where
# megatron's bubble formula says the baseline may be shorter (may_lose_to_interleaved).
BASELINE_PASSES = 100_000


def favourites(problem: Problem) -> tuple[tuple[str, Rule], ...]:
    return FAVOURITES if problem.chunks == 1 else CHUNKED_FAVOURITES


def rules(problem: Problem) -> tuple[Rule, ...]:
    if problem.chunks == 1:
        return RULES
    return tuple(replace(rule, f_order=f, b_order=b, f_wait=wait) for rule in RULES for wait in (0.5, 0.0)
                 for f in ("oldest", "deep", "shallow") for b in ("deep", "oldest"))


def best_heuristic(problem: Problem, budget: int = PASS_BUDGET, beat: float | None = None) -> Plan | None:
    """Favourite variants, then caps tuned one stage at a time, then the rest, within `budget` passes (with
    several chunks: half of them, at most CHUNKED_RUNS runs, and no cap tuning, the memory rule being what
    limits). The first variant always runs. With `beat`, only a plan shorter than that span counts (None if
    no variant tried is): a run stops once it is sure to lose, as every run does against the best so far."""
    shapes = cap_shapes(problem)
    cost = 3 * problem.num_virtual_stages * problem.microbatches
    if problem.chunks > 1:  # longer runs, more to validate: half the passes, and the runs capped
        budget = min(budget // 2, CHUNKED_RUNS * cost)
    enough = span_lower_bound(problem) * (1 + TOLERANCE)
    tried: dict[tuple[tuple[int, ...], Rule], Plan] = {}

    def run(caps: tuple[int, ...], rule: Rule) -> Plan | None:
        nonlocal budget
        if (caps, rule) not in tried:  # None: deadlocked, or longer than the best then (which only shortens)
            budget -= cost
            tried[(caps, rule)] = greedy(problem, caps, rule, beat if best is None else best.span)
        return tried[(caps, rule)]

    def better(plan: Plan | None, than: Plan | None) -> bool:
        return plan is not None and (than is None or plan.span < than.span * (1 - 1e-12))

    best = None
    for name, rule in favourites(problem):
        plan = run(shapes[name], rule)
        best = plan if better(plan, best) else best
        if best is not None and (best.span <= enough or budget < cost):
            return best
        if best is None and beat is not None and budget < cost:
            return None
    if best is None:  # every favourite deadlocked (the eager rule under memory caps never does) or lost
        best = run(shapes["memory"], Rule())
        if best is None:
            return None
    caps, rule = next(key for key, plan in tried.items() if plan is best)
    most = [min(problem.memory_cap(r), problem.microbatches) for r in range(problem.stages)]
    improved = problem.chunks == 1
    while improved and budget >= cost:
        improved = False
        for s in range(problem.stages):
            # one stage's cap, or the caps of it and all later stages together, one up or down
            for step, stop in ((1, s + 1), (-1, s + 1), (-1, problem.stages), (1, problem.stages)):
                trial = tuple(max(1, min(c + step, most[t])) if s <= t < stop else c for t, c in enumerate(caps))
                if (rule.strict and trial != _monotone(trial, trial, problem.microbatches)) or budget < cost:
                    continue
                plan = run(trial, rule)
                if better(plan, best):
                    best, caps, improved = plan, trial, True
    for shape in (shapes.values() if problem.chunks == 1 else [shapes["memory"]]):
        for rule in rules(problem):
            if best.span <= enough or budget < cost:
                return best
            plan = run(shape, rule)
            best = plan if better(plan, best) else best
    return best


def _fitting_plan(problem: Problem, orders: list, label: str) -> Plan | None:
    """The plan of these per-rank orders if every rank's peak fits its limit, with its longest-rank span."""
    schedule = to_schedule(problem, Plan(orders, 0.0, ""), {})
    profiles = memory_profile(schedule, problem.costs)
    if any(not problem.fits(r, max(held, default=0.0)) for r, held in enumerate(profiles)):
        return None
    timeline = simulate(schedule, problem.costs)
    return Plan(orders, max(timeline.span(r) for r in range(problem.stages)), label)


def _split_orders(schedule: Schedule) -> list:
    """Per-rank orders of (op, microbatch, chunk), a fused backward run as B then W (same time and memory)."""
    return [[step for x in passes for step in
             (((Op.B, x.mb, x.chunk), (Op.W, x.mb, x.chunk)) if x.op is Op.BW else ((x.op, x.mb, x.chunk),))]
            for passes in schedule.ranks]


def family_baselines(problem: Problem) -> list[Plan]:
    """The fixed orders the one-chunk planner could have picked, where they fit the limits: 1F1B (its backward run
    as B then W), ZB-H1 and ZB-H2. The planner keeps the shortest of these and its own: never slower than a
    schedule of its family that fits the same budget."""
    plans = []
    for label, build in (("1F1B, backward split", one_f_one_b), ("ZB-H1", zb_h1), ("ZB-H2", zb_h2)):
        try:
            orders = _split_orders(build(problem.stages, problem.microbatches))
        except ScheduleError:
            continue
        plan = _fitting_plan(problem, orders, label)
        if plan is not None:
            plans.append(plan)
    return plans


def split_interleaved(problem: Problem) -> Plan | None:
    """Megatron's interleaved 1F1B with each fused backward run as B then W (same time and memory), if megatron
    can order these microbatches and it fits the limits: a plan at least as good as the schedule zb-auto
    replaces (with few microbatches per rank the greedy can do worse)."""
    try:
        baseline = interleaved_one_f_one_b(problem.stages, problem.microbatches, problem.chunks)
    except ScheduleError:
        return None
    return _fitting_plan(problem, _split_orders(baseline), "interleaved 1F1B, backward split")


def interleaved_estimate(problem: Problem) -> float:
    """Interleaved 1F1B's span by megatron's bubble formula: the busiest rank's work and (p-1)/(v m) of it idle."""
    busiest = max(problem.busy(r) for r in range(problem.stages))
    return busiest * (1 + (problem.stages - 1) / (problem.chunks * problem.microbatches))


def may_lose_to_interleaved(problem: Problem, plan: Plan) -> bool:
    """Whether interleaved 1F1B could be shorter than `plan` (interleaved_estimate). Large plans are compared with
    the baseline only then (building and simulating it takes seconds there); the greedy lost to it by far at
    v = 8, p = 32, m = 256."""
    return plan.span > interleaved_estimate(problem)


def heuristic_or_interleaved(problem: Problem) -> Plan:
    """best_heuristic's plan, or with several chunks split_interleaved's where that is shorter (see
    BASELINE_PASSES). The baseline comes first where it is compared anyway, so that greedy runs stop as soon as
    they are sure to lose to it; above BASELINE_PASSES they stop once past interleaved_estimate, and only then is
    the baseline built, and the heuristic run again against it."""
    if problem.chunks == 1:
        plan = best_heuristic(problem)
        for baseline in family_baselines(problem):  # the heuristic's plan wins ties
            if plan is None or baseline.span < plan.span * (1 - 1e-12):
                plan = baseline
        return plan
    small = 3 * problem.num_virtual_stages * problem.microbatches <= BASELINE_PASSES
    if small:
        baseline = split_interleaved(problem)
        beat = None if baseline is None else baseline.span
    else:
        baseline, beat = None, interleaved_estimate(problem)
    plan = best_heuristic(problem, beat=beat)
    if not small and (plan is None or may_lose_to_interleaved(problem, plan)):
        baseline = split_interleaved(problem)
        if plan is None:
            plan = best_heuristic(problem, beat=None if baseline is None else baseline.span)
    if baseline is not None and (plan is None or baseline.span < plan.span * (1 - 1e-12)):
        return baseline
    return plan


def default_memory_limit(stages: int) -> float:
    """ZB-2p: twice 1F1B's peak, in in-flight microbatches (the registry, planners.SCHEDULES, reads it here)."""
    return 2 * stages


def interleaved_memory_limit(stages: int, chunks: int, microbatches: int | None = None) -> float:
    """Megatron's interleaved 1F1B's peak in in-flight microbatches (M_B of a rank): rank 0 warms up with
    2(p-1) + (v-1)p forwards of 1/v of a microbatch each and runs one more before its first backward. The
    default for several chunks: the same memory as the schedule it replaces, less bubble."""
    if chunks == 1:
        return default_memory_limit(stages)
    forwards = 2 * (stages - 1) + (chunks - 1) * stages + 1
    if microbatches is not None:
        forwards = min(forwards, microbatches * chunks)
    return forwards / chunks


def zb_auto(
    stages: int,
    microbatches: int,
    costs: Costs,
    memory_limit: MemoryLimit | float | None = None,
    ilp_time_limit: float = 10.0,
    progress: Callable[[str], None] | None = None,
    chunks: int = 1,
) -> Schedule:
    """ZB-1p (memory_limit=p), ZB-2p (memory_limit=2p, the default with one chunk) or any other limit; with
    several chunks per rank, megatron's interleaved placement (virtual stage k*p + r) at interleaved 1F1B's
    peak by default.

    memory_limit is a MemoryLimit (in-flight microbatches, or absolute in the costs' memory unit) or a count
    of in-flight microbatches (multiples of each rank's M_B). ilp_time_limit (seconds, 0 skips) bounds the
    ILP refinement, whose result replaces the heuristic's only when it simulates to a shorter longest-rank
    span. progress(line) hears from the ILP about once a second when it runs longer than that.
    """
    if stages < 1 or microbatches < 1 or chunks < 1:
        raise ScheduleError(f"the automatic planner needs a stage, a chunk and a microbatch, got {stages}, "
                            f"{chunks} and {microbatches}")
    if costs.num_virtual_stages != stages * chunks:
        raise ScheduleError(f"costs describe {costs.num_virtual_stages} virtual stages but the pipeline has "
                            f"{stages * chunks} ({stages} ranks x {chunks} chunks)")
    limit = MemoryLimit.of(memory_limit)
    if limit is None:
        limit = MemoryLimit(interleaved_memory_limit(stages, chunks, microbatches))
    layout = "single" if chunks == 1 else "interleaved"
    limits = limit.per_rank(stages, chunks, layout, costs)
    problem = Problem.from_costs(stages, microbatches, costs, limits, chunks, layout)
    for r in range(stages):
        need = problem.microbatch_memory(r) + problem.backward_extra(r)
        if not problem.fits(r, need):
            raise ScheduleError(
                f"memory limit {limits[r]:.4g} on rank {r} is below one microbatch's activations ({need:.4g})"
            )
    plan = heuristic_or_interleaved(problem)
    notes = {**limit.to_info(), "heuristic": plan.label, "heuristic_span": plan.span}
    if ilp_time_limit and ilp_time_limit > 0:
        plan, notes["ilp"] = refine(problem, plan, ilp_time_limit, progress)  # imports highspy only now
    notes["span"] = plan.span
    return to_schedule(problem, plan, {"planner": notes})
