"""The greedy list scheduler for V-shape schedules, and the paper's handcrafted ZB-V order.

Layout "v": the model is cut into 2p chunks and rank r holds virtual stage r (chunk 0) and 2p-1-r
(chunk 1), so a microbatch runs down the ranks and back up, and its loss is computed on rank 0. The turn
of the V (virtual stage p-1 to p) stays on rank p-1, so it costs no T_comm.

The scheduler walks simulated time with the real T_F, T_B, T_W of every virtual stage and T_comm. When a
rank is free it starts the ready pass its policy prefers (B is on the critical path; an F of chunk 1 is
closer to the loss than one of chunk 0), an F only if it fits the memory limit, and otherwise a W to fill
the gap or to free memory. Every op of a chunk runs in microbatch order, so each rank accumulates weight
gradients in the same order as 1F1B. vbudget.py runs several policies, together with the handcrafted
ZB-V order of the paper and the building blocks of vblocks.py, and keeps the best simulated bubble.

Default memory limits follow "Pipeline Parallelism with Controllable Memory" (arXiv 2405.15362):
ZB-V p M_B (as 1F1B), V-Half (p+2)//2 M_B, V-Min (p+4)//3 M_B, M_B being one microbatch's activations
of a whole rank.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass

from .costs import Costs
from .ops import facts
from .schedule import Pass, rank_stages, stage_owner

LAYOUT = "v"

_EPS = 1e-9


@dataclass(frozen=True)
class Policy:
    """The choices the greedy leaves open.

    order: preference among ready passes: "B", "F1" (F of chunk 1) and "F0".
    b_order: which of two ready B runs first: "older" (smaller microbatch) or "chunk1".
    w_fill: when nothing else is ready, "always" runs a W; "fits" only if it ends before the next known
      arrival of an F or B; "slack" likewise but ignores B arrivals on virtual stage 0 (they only unlock
      their own W). A W always runs when a ready F waits for memory.
    wait: leave the rank idle for a preferred pass arriving within `wait` times the ready pass's duration.
    f0_cap: if not None, chunk-0 forwards in flight (F done, B not) on rank r are capped at f0_cap plus
      2p-1-r (the paper's V), scaled down by the memory limit over p M_B.
    warmup: before its first chunk-1 F, rank r runs only the chunk-0 forwards that fit until microbatch 0
      comes back (computed from T_F and T_comm) if 0; None leaves it to memory.
    pace, burst: in the greedy's timeline, rank 0 holds back the chunk-0 F of microbatch i until
      (i - burst) * pace * C, C being the longest rank's F+B+W time for one microbatch, and does other
      work meanwhile. Only the order survives (it runs as soon as possible), but it spreads rank 0's
      forwards between other passes: under a small memory limit a burst would fill memory and stall.
    """

    order: tuple = ("B", "F1", "F0")
    b_order: str = "older"
    w_fill: str = "always"
    wait: float = 0.0
    f0_cap: int | None = None
    warmup: int | None = None
    pace: float | None = None
    burst: int = 0


# Chosen greedily (each one cuts the summed regret most) from a sweep of all 144 combinations over p 3..8,
# the paper's profiled costs, equal and skewed costs, T_comm 0 and > 0, and the three memory limits.
POLICIES = (
    Policy(("F1", "F0", "B"), "older", "slack", 0.0, 0, 0),
    Policy(("F1", "B", "F0"), "chunk1", "slack", 0.0, 0, 0),
    Policy(("F1", "F0", "B"), "chunk1", "slack", 0.5, 0, 0),
    Policy(("B", "F1", "F0"), "chunk1", "fits", 0.0, None, 0),
    Policy(("F1", "F0", "B"), "chunk1", "slack", 0.0, None, 0),
    Policy(("F1", "B", "F0"), "chunk1", "always", 0.5, None, 0),
    Policy(("F1", "B", "F0"), "older", "fits", 0.0, None, 0),
    Policy(("B", "F1", "F0"), "chunk1", "fits", 0.5, None, None),
)
# Added when the memory limit is below what the paper's V needs (V-Half, V-Min), chosen the same way.
PACED_POLICIES = (
    Policy(("F1", "B", "F0"), "older", "slack", pace=1.0, burst=2),
    Policy(("F1", "B", "F0"), "older", "slack", pace=1.0, burst=1),
    Policy(("F1", "F0", "B"), "older", "slack", pace=1.0, burst=2),
    Policy(("F1", "F0", "B"), "older", "slack", pace=0.9, burst=1),
    Policy(("B", "F1", "F0"), "older", "always", pace=1.0, burst=1),
    Policy(("F1", "B", "F0"), "older", "slack", pace=1.0, burst=3),
)


class _Rank:
    """Progress of one rank: per (op, chunk) the next microbatch, memory held, when it is free, its order."""

    def __init__(self, rank: int, stages: int, limit: float):
        self.rank = rank
        self.vstages = rank_stages(LAYOUT, stages, 2)[rank]
        self.next = {(op, c): 0 for op in "FBW" for c in (0, 1)}
        self.memory = 0.0
        self.limit = limit
        self.free_at = 0.0
        self.first_start: float | None = None
        self.order: list[Pass] = []


class VGreedy:
    """One run of the list scheduler under one policy: `run()` gives each rank's order, `bubble_rate()` the
    paper's bubble of the run's own timeline."""

    def __init__(self, stages, microbatches, costs: Costs, limits: list[float], policy: Policy, prefix=None):
        self.prefix = prefix  # per rank, passes to run first and in this order (a seed such as the paper's V)
        self.p, self.m, self.nv, self.costs, self.policy = stages, microbatches, 2 * stages, costs, policy
        self.ranks = [_Rank(r, stages, limits[r]) for r in range(stages)]
        self.ended: dict[tuple[str, int, int], float] = {}  # (op, mb, virtual stage) -> end time
        # ops.TABLE's duration and memory change of F, B and W per virtual stage, looked up once per pass.
        self.times = {op: [facts(op).duration(costs, v) for v in range(self.nv)] for op in "FBW"}
        self.memory = {op: [facts(op).memory_change(costs, v) for v in range(self.nv)] for op in "FBW"}
        self.owner = [stage_owner(LAYOUT, stages, v)[0] for v in range(self.nv)]
        self.users = {op: [[] for _ in range(self.nv)] for op in "FBW"}  # op -> stage -> passes that need it
        for user in "FBW":
            for v in range(self.nv):
                for need, u in facts(user).needed_stages(v, self.nv, stages):
                    comm = costs.t_comm if self.owner[u] != self.owner[v] else 0.0
                    self.users[need][u].append((user, v, comm))
        self.warmup = None if policy.warmup is None else self._warmup_counts(policy.warmup)
        cycle = max(sum(t[v] for t in self.times.values() for v in rk.vstages) for rk in self.ranks)
        self.pace = None if policy.pace is None else policy.pace * cycle
        if policy.f0_cap is not None:
            # The paper's V holds 2p-1-r (the virtual stage of chunk 1) chunk-0 and r+1 chunk-1 activations on
            # rank r at p M_B; under a smaller limit keep the same split, so chunk 0 cannot crowd out the way up.
            share = [min(1.0, rk.limit / (self.p * (costs.m_f[rk.vstages[0]] + costs.m_f[rk.vstages[1]])))
                     for rk in self.ranks]
            self.f0_caps = [max(1, int(rk.vstages[1] * share[rk.rank] + _EPS) + policy.f0_cap)
                            for rk in self.ranks]

    def _owner(self, vstage: int) -> int:
        return self.owner[vstage]

    def _warmup_counts(self, extra: int) -> list[int]:
        """Chunk-0 forwards each rank fits before microbatch 0 returns to its chunk 1, on an empty pipeline."""
        start = [0.0]
        for v in range(self.nv - 1):
            hop = self.costs.t_comm if self._owner(v) != self._owner(v + 1) else 0.0
            start.append(start[-1] + self.costs.t_f[v] + hop)
        return [
            max(1, int((start[rk.vstages[1]] - start[rk.vstages[0]]) / max(self.costs.t_f[rk.vstages[0]], _EPS)
                       + _EPS)) + extra
            for rk in self.ranks
        ]

    def _arrival(self, op: str, mb: int, vstage: int, rank: int) -> float | None:
        """When the output of (op, mb, vstage) is usable on `rank`; None while it is not scheduled."""
        end = self.ended.get((op, mb, vstage))
        if end is None:
            return None
        return end + (self.costs.t_comm if self._owner(vstage) != rank else 0.0)

    def _ready(self, rk: _Rank, op: str, c: int, mb: int) -> float | None:
        """When the inputs of a pass on `rk` are there; None while they are not scheduled."""
        vs = rk.vstages[c]
        if op == "W":
            return self.ended["B", mb, vs]
        if op == "F":
            return 0.0 if vs == 0 else self._arrival("F", mb, vs - 1, rk.rank)
        f_end = self.ended["F", mb, vs]
        grad = f_end if vs == self.nv - 1 else self._arrival("B", mb, vs + 1, rk.rank)
        return None if grad is None else max(grad, f_end)

    def _candidates(self, rk: _Rank) -> list[tuple[str, int, int, float]]:
        """(op, chunk, mb, ready time) of the next F and B of each chunk whose inputs are scheduled."""
        out = []
        for c in (0, 1):
            for op, mb in (("F", rk.next["F", c]), ("B", rk.next["B", c])):
                if mb < (self.m if op == "F" else rk.next["F", c]):
                    ready = self._ready(rk, op, c, mb)
                    if ready is not None:
                        out.append((op, c, mb, ready))
        return out

    def _paced_until(self, rk: _Rank) -> float:
        """Earliest start of rank 0's next chunk-0 F under the policy's pace (0 without one)."""
        if self.pace is None or rk.rank != 0:
            return 0.0
        return (rk.next["F", 0] - self.policy.burst) * self.pace

    def _f_allowed(self, rk: _Rank, c: int, t: float) -> bool:
        m_f, (v0, v1) = self.costs.m_f, rk.vstages
        if c == 1:
            return rk.memory + m_f[v1] <= rk.limit + _EPS
        # A chunk-0 F leaves room for a chunk-1 F, so the oldest microbatch can always turn back: no deadlock.
        if rk.memory + m_f[v0] + m_f[v1] > rk.limit + _EPS:
            return False
        if t < self._paced_until(rk) - _EPS:
            return False
        if self.warmup is not None and rk.next["F", 1] == 0 and rk.next["F", 0] >= self.warmup[rk.rank]:
            return False
        if self.policy.f0_cap is not None:
            return rk.next["F", 0] - rk.next["B", 0] < self.f0_caps[rk.rank]
        return True

    def _priority(self, cand) -> tuple:
        op, c, mb, _ = cand
        tie = (mb, c) if self.policy.b_order == "older" else (1 - c, mb)
        return self.policy.order.index(op + str(c) if op == "F" else op), tie

    def _choose(self, rk: _Rank, t: float) -> tuple[tuple[str, int, int] | None, float | None]:
        """The pass `rk` starts at time t (or None to stay idle) and, if idle, when to look again."""
        if self.prefix is not None and len(rk.order) < len(self.prefix[rk.rank]):
            seed = self.prefix[rk.rank][len(rk.order)]
            ready = self._ready(rk, seed.op, seed.chunk, seed.mb)
            if ready is not None and ready <= t + _EPS:
                return (seed.op, seed.chunk, seed.mb), None
            return None, ready
        ranked, later, held_f = [], [], False
        for cand in self._candidates(rk):
            if cand[3] > t + _EPS:
                later.append(cand)
            if cand[0] == "F" and not self._f_allowed(rk, cand[1], t):
                held_f = held_f or cand[3] <= t + _EPS  # a ready F held back: use the time for a W
            else:
                ranked.append(cand)
        ranked.sort(key=self._priority)
        ready = [c for c in ranked if c[3] <= t + _EPS]
        wake = min([c[3] for c in later] + [x for x in [self._paced_until(rk)] if x > t + _EPS], default=None)
        if ready:
            pick = ready[0]
            hold = self.policy.wait * self.times[pick[0]][rk.vstages[pick[1]]]
            for cand in ranked:  # a preferred pass about to arrive beats the ready one
                if cand is pick:
                    break
                if cand[3] - t <= hold + _EPS:
                    return None, cand[3]
            return pick[:3], None
        w_chunks = [c for c in (0, 1) if rk.next["W", c] < rk.next["B", c]]
        if not w_chunks:
            return None, wake
        c = min(w_chunks, key=lambda c: (rk.next["W", c], c))
        blocking = later
        if self.policy.w_fill == "slack":  # a B of virtual stage 0 only unlocks its own W
            blocking = [x for x in later if not (x[0] == "B" and rk.vstages[x[1]] == 0)]
        upcoming = min((x[3] for x in blocking), default=None)
        fits = upcoming is None or t + self.costs.t_w[rk.vstages[c]] <= upcoming + _EPS
        if self.policy.w_fill == "always" or held_f or fits:
            return ("W", c, rk.next["W", c]), None
        return None, wake

    def _start(self, rk: _Rank, op: str, c: int, mb: int, t: float) -> float:
        vs = rk.vstages[c]
        rk.memory += self.memory[op][vs]
        rk.order.append(Pass(op, mb, c))
        rk.next[op, c] += 1
        rk.first_start = t if rk.first_start is None else rk.first_start
        rk.free_at = t + self.times[op][vs]
        self.ended[op, mb, vs] = rk.free_at
        return rk.free_at

    def run(self) -> list[list[Pass]] | None:
        """Each rank's pass order, or None if this policy gets stuck (it cannot under the memory rules)."""
        remaining = 6 * self.p * self.m
        # (time, rank): look at a rank when it is free, when an input of its passes arrives, or when it asked
        # to be woken; ranks looked at the same time go in rank order (a rank later in it sees what the ones
        # before it started)
        events = [(0.0, r) for r in range(self.p)]
        while remaining:
            if not events:
                return None
            t, r = heapq.heappop(events)
            due = {r}
            while events and events[0][0] <= t + _EPS:
                due.add(heapq.heappop(events)[1])
            for r in sorted(due):
                rk = self.ranks[r]
                if rk.free_at > t + _EPS or len(rk.order) == 6 * self.m:
                    continue
                choice, wake = self._choose(rk, t)
                if choice is None:
                    if wake is not None:
                        heapq.heappush(events, (wake, r))
                    continue
                end = self._start(rk, *choice, t)
                remaining -= 1
                heapq.heappush(events, (end, r))
                for other, at in self._consumers(choice[0], rk.vstages[choice[1]], end):
                    heapq.heappush(events, (at, other))
        return [rk.order for rk in self.ranks]

    def _consumers(self, op: str, vstage: int, end: float) -> list[tuple[int, float]]:
        """(rank, arrival) of the other ranks whose next passes may wait for this F or B (ops.TABLE's needs)."""
        out = []
        for user_op, user_stage, comm in self.users[op][vstage]:
            other = self.owner[user_stage]
            if other != self.owner[vstage]:
                out.append((other, end + comm))
        return out

    def bubble_rate(self) -> float:
        """The paper's bubble rate of the run's own timeline (simulating the order can only start passes earlier)."""
        spans = [rk.free_at - rk.first_start for rk in self.ranks]
        busy = max(sum(self.times[p.op][rk.vstages[p.chunk]] for p in rk.order) for rk in self.ranks)
        return (max(spans) - busy) / max(spans) if max(spans) > 0 else 0.0


def paper_v_order(stages: int, microbatches: int) -> list[list[Pass]]:
    """The handcrafted ZB-V of the paper (its figure, for T_F = T_B = T_W), as each rank's pass order.

    Rank r warms up with 2(p-r)-1 chunk-0 forwards, then r pairs (F chunk 1, F chunk 0), then p-r
    triples (F, B, W) of chunk 1; the steady state repeats F B W of chunk 0 then of chunk 1; the drain
    runs the remaining B passes (chunk 0 with its W), then the W passes left. With fewer than 2p-1
    microbatches it is the order for 2p-1 with the missing microbatches left out.
    """
    n = max(microbatches, 2 * stages - 1)
    ranks = []
    for r in range(stages):
        count = {(op, c): 0 for op in "FBW" for c in (0, 1)}
        order: list[Pass] = []

        def run(*kinds: str) -> None:
            for kind in kinds:  # kind is op + chunk, e.g. "F1"
                key = (kind[0], int(kind[1]))
                order.append(Pass(kind[0], count[key], key[1]))
                count[key] += 1

        run(*["F0"] * (2 * (stages - r) - 1))
        for _ in range(r):
            run("F1", "F0")
        for _ in range(stages - r):
            run("F1", "B1", "W1")
        while count["F", 0] < n or count["F", 1] < count["F", 0]:
            run(*(["F0"] if count["F", 0] < n else []), "B0", "W0", "F1", "B1", "W1")
        for _ in range(r):
            run("B0", "B1")
        for _ in range(stages - r):
            run("B0", "W0")
        run(*["W1"] * (count["B", 1] - count["W", 1]), *["W0"] * (count["B", 0] - count["W", 0]))
        ranks.append([p for p in order if p.mb < microbatches])
    return ranks


def zb_v_memory_limit(stages: int) -> float:
    """ZB-V's default: p M_B, 1F1B's peak (the registry, planners.SCHEDULES, reads these three here)."""
    return stages


def v_half_memory_limit(stages: int) -> float:
    return (stages + 2) // 2


def v_min_memory_limit(stages: int) -> float:
    return (stages + 4) // 3
