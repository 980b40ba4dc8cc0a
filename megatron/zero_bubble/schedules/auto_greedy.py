"""The automatic planner's greedy list scheduler: one run under one rule and one cap on warm-up forwards per stage.

`greedy(problem, caps, rule)` places every pass of every stage in time with the real costs (T_F, T_B, T_W per stage,
T_comm between ranks): each stage warms up with F passes up to its cap (within the memory limit), then runs B and F
as they arrive and places W passes as it goes, in microbatch order, as the `Rule` says (auto.py explains the rules
and runs many of them).
"""
from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass
from typing import Sequence

from .auto_problem import TOLERANCE, Plan, Problem, Step
from .ops import Op

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
