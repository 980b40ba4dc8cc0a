"""V-shape schedules: ZB-V, V-Half and V-Min, built by a greedy list scheduler that simulates as it builds.

Layout "v": the model is cut into 2p chunks and rank r holds virtual stage r (chunk 0) and 2p-1-r
(chunk 1), so a microbatch goes down the ranks and back up, and its loss is computed on rank 0. The turn
of the V (virtual stage p-1 to p) stays on rank p-1, so it costs no T_comm.

The scheduler walks simulated time. Whenever a rank is free it runs, in order of preference: a B that is
ready (B is on the critical path), an F that is ready and fits the memory limit (chunk 1 first, since it
is closer to the loss), and otherwise a W to fill the gap or to free memory. Each op of each chunk runs
in microbatch order, so W accumulates weight gradients in the same order as 1F1B. Memory limits follow
"Pipeline Parallelism with Controllable Memory" (arXiv 2405.15362): ZB-V p M_B (as 1F1B), V-Half
(p+2)//2 M_B, V-Min (p+4)//3 M_B. A few policy variants are tried and the best simulated bubble is kept.
"""
from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass

from .costs import Costs
from .memory import rank_memory_limits
from .schedule import Pass, Schedule, ScheduleError
from .simulate import simulate

_EPS = 1e-9


@dataclass(frozen=True)
class Policy:
    """The choices the greedy leaves open; `_policies` lists the variants tried.

    order: preference among ready passes, e.g. ("B", "F1", "F0"): B first, then F of chunk 1, then of chunk 0.
    b_order: which ready B runs first: "older" (smaller microbatch, chunk 0 on ties), "chunk0", "chunk1".
    w_fill: "always" runs a W whenever nothing else is ready; "fits" runs it only if it ends before the
      next known arrival of an F or B (or memory needs it, or no arrival is known yet).
    wait: hold back a ready pass for a preferred one arriving within `wait` times its duration.
    f0_cap_offset: cap on chunk-0 forwards in flight per rank, relative to 2p-1-r; None leaves it to memory.
    """

    order: tuple = ("B", "F1", "F0")
    b_order: str = "older"
    w_fill: str = "always"
    wait: float = 0.0
    f0_cap_offset: int | None = None
    warmup_extra: int | None = None
    w_backlog: int | None = None


def _policies(stages: int) -> list[Policy]:
    orders = (("B", "F1", "F0"), ("F1", "B", "F0"), ("F1", "F0", "B"))
    return [
        Policy(*choice)
        for choice in itertools.product(orders, ("older", "chunk1"), ("always", "fits", "slack"), (0.0, 0.5), (None, 0), (None, 0), (None, 0, 1, 2))
    ]


class _Rank:
    """Progress of one rank: per chunk, the next microbatch of each op; memory held; when it is free."""

    def __init__(self, rank: int, stages: int, limit: float):
        self.rank = rank
        self.vstages = (rank, 2 * stages - 1 - rank)
        self.next = {(op, c): 0 for op in "FBW" for c in (0, 1)}
        self.memory = 0.0
        self.limit = limit
        self.free_at = 0.0
        self.order: list[Pass] = []


class _Greedy:
    """One run of the list scheduler under one policy; `run()` returns each rank's pass order."""

    def __init__(self, stages: int, microbatches: int, costs: Costs, limits: list[float], policy: Policy):
        self.p, self.m, self.costs, self.policy = stages, microbatches, costs, policy
        self.ranks = [_Rank(r, stages, limits[r]) for r in range(stages)]
        self.ended: dict[tuple[str, int, int], float] = {}  # (op, mb, vstage) -> end time
        self.nv = 2 * stages
        self.warmup = None if policy.warmup_extra is None else self._warmup_counts(policy.warmup_extra)

    def _warmup_counts(self, extra: int) -> list[int]:
        """Chunk-0 forwards each rank fits before microbatch 0 comes back to its chunk 1, on an empty pipeline."""
        costs, start = self.costs, [0.0]
        for v in range(self.nv - 1):
            hop = costs.t_comm if self._owner(v) != self._owner(v + 1) else 0.0
            start.append(start[-1] + costs.t_f[v] + hop)
        counts = []
        for r in range(self.p):
            gap = start[self.nv - 1 - r] - start[r]
            counts.append(max(1, int(gap / max(costs.t_f[r], _EPS) + _EPS)) + extra)
        return counts

    def _owner(self, vstage: int) -> int:
        return vstage if vstage < self.p else self.nv - 1 - vstage

    def _arrival(self, op: str, mb: int, vstage: int, rank: int) -> float | None:
        """When the output of (op, mb, vstage) is usable on `rank`, or None if it is not scheduled yet."""
        end = self.ended.get((op, mb, vstage))
        if end is None:
            return None
        return end + (self.costs.t_comm if self._owner(vstage) != rank else 0.0)

    def _candidates(self, rk: _Rank):
        """(op, chunk, mb, ready time or None) for the next F and B of each chunk whose turn has come."""
        out = []
        for c, vs in enumerate(rk.vstages):
            mb = rk.next["F", c]
            if mb < self.m:
                ready = 0.0 if vs == 0 else self._arrival("F", mb, vs - 1, rk.rank)
                out.append(("F", c, mb, ready))
            mb = rk.next["B", c]
            if mb < rk.next["F", c]:
                f_done = self.ended["F", mb, vs]
                ready = f_done if vs == self.nv - 1 else self._arrival("B", mb, vs + 1, rk.rank)
                out.append(("B", c, mb, None if ready is None else max(ready, f_done)))
        return out

    def _f_allowed(self, rk: _Rank, c: int) -> bool:
        costs, (v0, v1) = self.costs, rk.vstages
        if c == 1:
            return rk.memory + costs.m_f[v1] <= rk.limit + _EPS
        # A chunk-0 F must leave room for a chunk-1 F, or the oldest microbatch could never turn back.
        if rk.memory + costs.m_f[v0] + costs.m_f[v1] > rk.limit + _EPS:
            return False
        if self.warmup is not None and rk.next["F", 1] == 0 and rk.next["F", 0] >= self.warmup[rk.rank]:
            return False  # keep the rank free for the first microbatch on its way back up
        cap = self.policy.f0_cap_offset
        if cap is None:
            return True
        in_flight = rk.next["F", 0] - rk.next["B", 0]
        return in_flight < 2 * self.p - 1 - rk.rank + cap

    def _choose(self, rk: _Rank, t: float):
        """The pass rank `rk` starts at time t, or None to wait; also the next time worth waking at."""
        cands = [c for c in self._candidates(rk) if c[3] is not None]
        later = [c[3] for c in cands if c[3] > t + _EPS]
        blocked_f = False
        ranked = []
        for c in cands:
            if c[0] == "F" and not self._f_allowed(rk, c[1]):
                blocked_f = blocked_f or c[3] <= t + _EPS
                continue
            ranked.append(c)
        ranked.sort(key=self._priority)
        now = [c for c in ranked if c[3] <= t + _EPS]
        w_chunks = [c for c in (0, 1) if rk.next["W", c] < rk.next["B", c]]
        backlog = sum(rk.next["B", c] - rk.next["W", c] for c in (0, 1))
        if w_chunks and self.policy.w_backlog is not None and backlog > self.policy.w_backlog:
            c = min(w_chunks, key=lambda c: rk.next["W", c])
            return ("W", c, rk.next["W", c]), None
        if now:
            pick = now[0]
            # Hold back for a more urgent pass that arrives before the ready one would end.
            dur = self._duration(rk, pick)
            for c in ranked:
                if c is pick:
                    break
                if c[3] - t <= self.policy.wait * dur + _EPS:
                    return None, c[3]
            return pick[:3], None
        w_chunks = [c for c in (0, 1) if rk.next["W", c] < rk.next["B", c]]
        if w_chunks:
            c = min(w_chunks, key=lambda c: rk.next["W", c])
            t_w = self.costs.t_w[rk.vstages[c]]
            blocking = later
            if self.policy.w_fill == "slack":
                # B of virtual stage 0 only unlocks its own W: a W may run over its arrival.
                blocking = [c[3] for c in cands if c[3] > t + _EPS and not (c[0] == "B" and rk.vstages[c[1]] == 0)]
            upcoming = min(blocking, default=None)
            if (
                self.policy.w_fill == "always"
                or blocked_f
                or upcoming is None
                or t + t_w <= upcoming + _EPS
            ):
                return ("W", c, rk.next["W", c]), None
        return None, min(later, default=None)

    def _duration(self, rk: _Rank, cand) -> float:
        op, c = cand[0], cand[1]
        return {"F": self.costs.t_f, "B": self.costs.t_b}[op][rk.vstages[c]]

    def _priority(self, cand):
        op, c, mb, _ = cand
        kind = op + (str(c) if op == "F" else "")
        tie = {"chunk0": (c, mb), "chunk1": (1 - c, mb), "older": (mb, c)}[self.policy.b_order]
        return self.policy.order.index(kind), tie

    def _start(self, rk: _Rank, op: str, c: int, mb: int, t: float) -> float:
        vs, costs = rk.vstages[c], self.costs
        duration = {"F": costs.t_f, "B": costs.t_b, "W": costs.t_w}[op][vs]
        rk.memory += {"F": costs.m_f[vs], "B": costs.m_w[vs] - costs.m_f[vs], "W": -costs.m_w[vs]}[op]
        rk.order.append(Pass(op, mb, c))
        rk.next[op, c] += 1
        rk.free_at = t + duration
        self.ended[op, mb, vs] = rk.free_at
        return rk.free_at

    def run(self) -> list[list[Pass]] | None:
        """Each rank's pass order, or None if this policy gets stuck under the memory limit."""
        total = 6 * self.p * self.m
        done, t = 0, 0.0
        events: list[float] = [0.0]
        while done < total:
            if not events:
                return None
            t = heapq.heappop(events)
            while events and events[0] <= t + _EPS:
                heapq.heappop(events)
            progressed = True
            while progressed:  # zero-length passes can make more passes ready at the same instant
                progressed = False
                for rk in self.ranks:
                    if rk.free_at > t + _EPS:
                        continue
                    choice, wake = self._choose(rk, t)
                    if choice is None:
                        if wake is not None:
                            heapq.heappush(events, wake)
                        continue
                    end = self._start(rk, *choice, t)
                    done += 1
                    if end > t + _EPS:
                        heapq.heappush(events, end)
                    else:
                        progressed = True
        return [rk.order for rk in self.ranks]


def _default_limit(name: str, stages: int) -> float:
    return {"zb-v": stages, "v-half": (stages + 2) // 2, "v-min": (stages + 4) // 3}[name]


def _plan(name, stages, microbatches, costs, memory_limit, memory_limit_absolute) -> Schedule:
    if stages < 2:
        raise ScheduleError(f"{name} needs at least 2 pipeline stages, got {stages}")
    if microbatches < 1:
        raise ScheduleError(f"{name} needs at least 1 microbatch, got {microbatches}")
    nv = 2 * stages
    costs = costs if costs is not None else Costs.make(nv, chunks=2)
    if costs.num_virtual_stages != nv:
        raise ScheduleError(f"{name} needs costs for {nv} virtual stages, got {costs.num_virtual_stages}")
    if memory_limit is None and memory_limit_absolute is None:
        memory_limit = _default_limit(name, stages)
    limits = rank_memory_limits(stages, 2, "v", costs, memory_limit, memory_limit_absolute)
    for r in range(stages):
        # A rank holds both chunks of a microbatch before its first B can free anything.
        need = costs.m_f[r] + costs.m_f[nv - 1 - r]
        if limits[r] < need - _EPS:
            raise ScheduleError(
                f"memory limit {limits[r]:.4g} on rank {r} is below one microbatch's activations ({need:.4g}), "
                f"too small for any V schedule"
            )
    best = None
    for policy in _policies(stages):
        ranks = _Greedy(stages, microbatches, costs, limits, policy).run()
        if ranks is None:
            continue
        schedule = Schedule(stages, 2, microbatches, "v", ranks, name=name)
        timeline = simulate(schedule, costs)
        score = (round(timeline.bubble_rate, 12), round(timeline.makespan, 9), max(timeline.peak_memory))
        if best is None or score < best[0]:
            best = (score, schedule, policy)
    if best is None:
        raise ScheduleError(f"{name} found no schedule under the memory limit; raise the limit")
    _, schedule, policy = best
    schedule.info["planner"] = {"policy": policy.__dict__, "memory_limit": memory_limit}
    return schedule


def zb_v(stages, microbatches, costs=None, memory_limit=None, memory_limit_absolute=None) -> Schedule:
    """ZB-V: zero bubble with T_F = T_B = T_W at 1F1B's peak activation memory p M_B (default limit)."""
    return _plan("zb-v", stages, microbatches, costs, memory_limit, memory_limit_absolute)


def v_half(stages, microbatches, costs=None, memory_limit=None, memory_limit_absolute=None) -> Schedule:
    """V-Half: about half of 1F1B's activation memory, (p+2)//2 M_B by default; bubble about half of 1F1B's."""
    return _plan("v-half", stages, microbatches, costs, memory_limit, memory_limit_absolute)


def v_min(stages, microbatches, costs=None, memory_limit=None, memory_limit_absolute=None) -> Schedule:
    """V-Min: about a third of 1F1B's activation memory, (p+4)//3 M_B by default."""
    return _plan("v-min", stages, microbatches, costs, memory_limit, memory_limit_absolute)
