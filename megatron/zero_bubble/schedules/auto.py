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
from collections import deque
from dataclasses import dataclass, replace
from typing import Callable, Sequence

from .auto_problem import TOLERANCE, Plan, Problem, Step, span_lower_bound, to_schedule
from .costs import Costs
from .baselines import interleaved_one_f_one_b
from .ilp import refine
from .memory import memory_profile
from .problem import MemoryLimit
from .ops import Op
from .schedule import Schedule, ScheduleError
from .simulate import simulate

__all__ = ["Plan", "Problem", "Rule", "best_heuristic", "default_memory_limit", "greedy",
           "interleaved_memory_limit", "span_lower_bound", "to_schedule", "zb_auto"]

# Passes the heuristic may simulate in all (about half a second of CPU): p=32, m=256 gets 16 runs.
PASS_BUDGET = 400_000


@dataclass(frozen=True)
class Rule:
    """Knobs of one greedy variant.

    strict: B and F alternate after the warm-up, 1F1B-style (else B first, F whenever ready and under
      the cap); strict needs caps that never increase along the pipeline to be deadlock-free.
    fill: a W also goes into an idle gap of at least fill * T_W, delaying the next pass by T_W - gap.
    bubble: also insert such a W when leaving the gap idle would make this stage the most idle so far.
    patience, warmup_patience: after / before a rank's first B, do not start an F when the next B
      arrives within that many T_F (an F then would delay the B the stages before wait for).
    f_order, b_order: with several chunks per rank, which ready F (B) goes first: "deep" (the highest
      virtual stage: closer to the loss, or further from the end of the backward), "shallow" (the lowest)
      or "oldest" (the lowest microbatch, then the deepest).
    f_wait: before a rank's first B, do not start an F when one the order prefers arrives within that many
      of its T_F (the warm-up has time to spare; the microbatch on its way to the loss has not).
    """

    strict: bool = False
    fill: float = 1.0
    bubble: bool = True
    patience: float = 0.0
    warmup_patience: float = 0.0
    f_order: str = "deep"
    b_order: str = "deep"
    f_wait: float = 0.0

    def __str__(self) -> str:
        order = "strict 1F1B order" if self.strict else "eager B/F"
        bubble = " + bubble rule" if self.bubble else ""
        chunks = "" if (self.f_order, self.b_order, self.f_wait) == ("deep", "deep", 0.0) else \
            f", F {self.f_order} first (waiting {self.f_wait:g} T_F for it), B {self.b_order} first"
        return f"{order}, W fill {self.fill:g}{bubble}, patience {self.patience:g}/{self.warmup_patience:g}{chunks}"


# (weight of microbatch * virtual stages, weight of virtual stage) in the key a rule's chunk order minimises
_ORDER_KEYS = {"deep": (0, -1), "shallow": (0, 1), "oldest": (1, -1)}


class _Rank:
    """One rank's progress in a greedy run: per chunk the next F and B, the W passes waiting (in B order)."""

    __slots__ = ("next_f", "next_b", "waiting", "waiting_memory", "held", "free", "start", "idle", "order", "done")

    def __init__(self, chunks: int):
        self.next_f, self.next_b = [0] * chunks, [0] * chunks
        self.waiting: deque = deque()  # (chunk, microbatch, virtual stage) whose B ran and W not
        self.waiting_memory = 0.0  # what those W passes would free
        self.held, self.free, self.start, self.idle = 0.0, 0.0, -1.0, 0.0
        self.order: list[Step] = []
        self.done = 0  # B passes run


def greedy(problem: Problem, caps: Sequence[int], rule: Rule, beat: float | None = None) -> Plan | None:
    """Schedule F and B in time order with the real costs, placing W as the module docstring says; None if
    the caps and rule deadlock (strict rules need caps that never increase along the pipeline), or as soon
    as the plan's span is sure to exceed `beat` (a rank's span is its work plus the idle time between its
    passes, and idle time only grows: a variant that lost to interleaved 1F1B at v = 8, p = 64 was sure to
    after 5% of its passes)."""
    p, m, v, n = problem.stages, problem.microbatches, problem.chunks, problem.num_virtual_stages
    # idle time past which a rank's span exceeds `beat` (with room for rounding: a tie still runs to the end)
    slack = [math.inf if beat is None else beat * (1 + 1e-9) - problem.busy(r) for r in range(p)]
    if min(slack) < 0:
        return None  # some rank's work alone takes longer
    t_f, t_b, t_w = problem.time[Op.F], problem.time[Op.B], problem.time[Op.W]
    d_f, d_b, d_w = problem.memory[Op.F], problem.memory[Op.B], problem.memory[Op.W]
    stage_of, owner = problem.stage_of, problem.owner
    room = [x * (1 + TOLERANCE) + TOLERANCE for x in problem.limits]
    forward_room = [room[r] - problem.backward_extra(r) for r in range(p)]
    strict, fill, bubble, total = rule.strict, rule.fill, rule.bubble, v * m
    ends = {Op.F: [[-1.0] * m for _ in range(n)], Op.B: [[-1.0] * m for _ in range(n)]}
    # ops.TABLE's needs of F and B per virtual stage as (end times of the needed pass per microbatch, T_comm)
    inputs = {op: [tuple((ends[need][u], comm) for need, u, comm in problem.needs[op][w]) for w in range(n)]
              for op in (Op.F, Op.B)}
    inputs_f, inputs_b = inputs[Op.F], inputs[Op.B]
    end_f, end_b = ends[Op.F], ends[Op.B]
    # the other ranks whose passes need a pass's output, with the T_comm it takes to reach them
    wakes = {op: [tuple((owner[w], comm) for _, w, comm in problem.users[op][u] if owner[w] != owner[u])
                  for u in range(n)] for op in (Op.F, Op.B)}
    wake_f, wake_b = wakes[Op.F], wakes[Op.B]
    f_mb, f_stage = _ORDER_KEYS[rule.f_order]
    b_mb, b_stage = _ORDER_KEYS[rule.b_order]
    f_mb, b_mb = f_mb * n, b_mb * n
    ranks = [_Rank(v) for _ in range(p)]
    events = [(0.0, r) for r in range(p)]  # (time, rank): decide when free or when an input arrives
    push, pop = heapq.heappush, heapq.heappop
    most_idle = 0.0
    while events:
        now, r = pop(events)
        rk = ranks[r]
        latest = now + TOLERANCE * (1.0 + now)  # inputs arriving by then count as there
        if rk.done == total or rk.free > latest:
            continue
        own, nf, nb = stage_of[r], rk.next_f, rk.next_b
        b_pick, b_key, b_arrival = -1, 0, -1.0  # b_arrival: the earliest known arrival of a next B
        for c in range(v):
            j = nb[c]
            if j >= nf[c]:
                continue
            u, at = own[c], 0.0
            for done, comm in inputs_b[u]:
                if done[j] < 0:
                    break
                if done[j] + comm > at:
                    at = done[j] + comm
            else:
                if b_arrival < 0 or at < b_arrival:
                    b_arrival = at
                key = b_mb * j + b_stage * u
                if at <= latest and (b_pick < 0 or key < b_key):
                    b_pick, b_key = c, key
        under_cap = nf[0] < m and nf[0] - nb[0] < caps[r]
        f_pick, f_key, f_soon, f_soon_key = -1, 0, -1.0, 0  # f_soon: when the preferred F arriving next does
        for c in range(v):
            k = nf[c]
            if k >= m or (c == 0 and not under_cap):
                continue
            u, at = own[c], 0.0
            for done, comm in inputs_f[u]:
                if done[k] < 0:
                    at = -1.0
                elif done[k] + comm > at:
                    at = done[k] + comm
            if at < 0 or not (v == 1 or _room_for_forward(problem, rk, r, c, forward_room[r])):
                continue
            key = f_mb * k + f_stage * u
            if at <= latest:
                if f_pick < 0 or key < f_key:
                    f_pick, f_key = c, key
            elif f_soon < 0 or key < f_soon_key:
                f_soon, f_soon_key = at, key
        if (f_pick >= 0 and rk.done == 0 and 0 <= f_soon < now + rule.f_wait * t_f[own[f_pick]]
                and f_soon_key < f_key):
            f_pick = -1  # a preferred F arrives soon: wait for it rather than delay it by this one
        if strict:  # F while under the cap, else B (or the F of a microbatch already admitted)
            if under_cap:
                b_pick = -1
            elif b_pick >= 0:
                f_pick = -1
        elif f_pick >= 0 and b_pick < 0 and b_arrival >= 0 and own[f_pick] > 0:
            wait = rule.warmup_patience if rk.done == 0 else rule.patience
            if b_arrival < now + wait * t_f[own[f_pick]]:
                f_pick = -1  # wait for the B that arrives soon
        if b_pick >= 0:
            c = b_pick
            u = own[c]
            op, mb, delta, length = Op.B, nb[c], d_b[u], t_b[u]
        elif f_pick >= 0:
            c = f_pick
            u = own[c]
            op, mb, delta, length = Op.F, nf[c], d_f[u], t_f[u]
        else:
            continue  # wait: the next arrival is another decision point
        waiting = rk.waiting
        t = rk.free if rk.start >= 0 else now
        # W passes the memory limit forces, then those that fit in the idle gap, then maybe one more.
        while waiting and (rk.held + delta > room[r] or t + t_w[waiting[0][2]] <= latest):
            t = _run_w(rk, t, t_w, d_w)
        gap = now - t
        if waiting and gap > latest - now and (gap >= fill * t_w[waiting[0][2]]
                                               or (bubble and rk.idle + gap > most_idle)):
            t = _run_w(rk, t, t_w, d_w)
        if rk.start < 0:
            rk.start = now
        elif now > t:
            rk.idle += now - t
            most_idle = max(most_idle, rk.idle)
            if rk.idle > slack[r]:
                return None
            t = now
        rk.order.append((op, mb, c))
        end = rk.free = t + length
        rk.held += delta
        if op is Op.F:
            end_f[u][mb] = end
            nf[c] += 1
            wake = wake_f[u]
        else:
            end_b[u][mb] = end
            nb[c] += 1
            rk.done += 1
            waiting.append((c, mb, u))
            rk.waiting_memory -= d_w[u]
            wake = wake_b[u]
        for other, comm in wake:
            push(events, (end + comm, other))
        push(events, (end, r))
    if any(rk.done < total for rk in ranks):
        return None
    spans = []
    for rk in ranks:
        t = rk.free
        while rk.waiting:
            t = _run_w(rk, t, t_w, d_w)
        spans.append(t - rk.start)
    return Plan([rk.order for rk in ranks], max(spans), f"caps {list(caps)}, {rule}")


def _run_w(rk: _Rank, t: float, t_w, d_w) -> float:
    """Run the rank's oldest waiting W at time t; returns when it ends."""
    c, mb, u = rk.waiting.popleft()
    rk.order.append((Op.W, mb, c))
    rk.held += d_w[u]
    rk.waiting_memory += d_w[u]
    return t + t_w[u]


def _room_for_forward(problem: Problem, rk: _Rank, r: int, c: int, room: float) -> bool:
    """Whether an F of chunk c leaves room (once the waiting W passes free theirs) for the rest of the
    forwards of the oldest microbatch still without all of them on this rank. Every F but that
    microbatch's own admission keeps this room, so it can always reach the loss and come back; whatever
    else the rank holds belongs to older microbatches, whose backward passes need nothing more of this
    rank. So the greedy cannot deadlock on memory. (With one chunk the caps, never above
    Problem.memory_cap, already keep room for each F.)"""
    nf, own, d_f = rk.next_f, problem.stage_of[r], problem.memory[Op.F]
    oldest = nf[-1]  # every chunk below the last has run its F for it; it is admitted if chunk 0 has
    rest = 0.0
    if oldest < nf[0]:  # room for what the oldest still lacks, but for this F if it is one of them
        rest = sum(d_f[u] for u, k in zip(own, nf) if k <= oldest) - (d_f[own[c]] if nf[c] == oldest else 0.0)
    return rk.held - rk.waiting_memory + d_f[own[c]] + rest <= room


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


def split_interleaved(problem: Problem) -> Plan | None:
    """Megatron's interleaved 1F1B with each fused backward run as B then W (same time and memory), if megatron
    can order these microbatches and it fits the limits: a plan at least as good as the schedule zb-auto
    replaces (with few microbatches per rank the greedy can do worse)."""
    try:
        baseline = interleaved_one_f_one_b(problem.stages, problem.microbatches, problem.chunks)
    except ScheduleError:
        return None
    orders = [[step for x in passes for step in
               (((Op.B, x.mb, x.chunk), (Op.W, x.mb, x.chunk)) if x.op is Op.BW else ((x.op, x.mb, x.chunk),))]
              for passes in baseline.ranks]
    schedule = to_schedule(problem, Plan(orders, 0.0, ""), {})
    profiles = memory_profile(schedule, problem.costs)
    if any(not problem.fits(r, max(held, default=0.0)) for r, held in enumerate(profiles)):
        return None
    timeline = simulate(schedule, problem.costs)
    return Plan(orders, max(timeline.span(r) for r in range(problem.stages)), "interleaved 1F1B, backward split")


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
        return best_heuristic(problem)
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
