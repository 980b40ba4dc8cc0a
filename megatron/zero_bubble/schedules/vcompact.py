"""Squeezing a V schedule's warm-up and cool-down: passes slide into idle time under the memory limit.

A schedule read off a repeated building block (vblocks.py) is tight in its steady state but leaves idle
time where the pipeline fills and drains. The operators here rebuild each rank's order from the real
costs (T_F, T_B, T_W per virtual stage, T_comm), pass by pass, and never let a rank's activation memory
(ops.TABLE's memory change of each pass, in microbatch order) exceed its limit:

- `left_justify` walks the passes by start time and starts each one as early as its inputs allow, in an
  idle gap of its rank when one fits (the paper's "reordering" of the warm-up and cool-down);
- `right_justify` walks them by end time, backwards, and ends each one as late as the passes that need it
  allow: forwards of the warm-up start just in time, so a rank's span begins later and the memory they no
  longer hold early lets the other chunk's passes through;
- `refill_weight_passes` takes the W passes out, left-justifies the rest and lets each W fill idle time
  (or free memory) again: W only has to follow its B and precede the next W of its chunk.

Every pass of a chunk keeps its microbatch order on its rank (so W keeps the order of B, and gradients
accumulate as in 1F1B). The result is a new order; its simulated timeline can only be judged, not
assumed, so planners simulate and validate what comes out. Pure Python, no torch.
"""
from __future__ import annotations

import bisect
import heapq
from collections import deque

from .costs import Costs
from .ops import OPS, Op, facts
from .schedule import Pass, Schedule
from .simulate import Timeline, simulate

_EPS = 1e-9
# Gaps tried per pass, nearest first: far more cost time (each is a memory check) and rarely fit better.
_GAPS_TRIED = 8


class _Lane:
    """One rank's passes as they are placed again: their order, start times, the memory held after each
    and the idle gaps between them that a pass could still use."""

    def __init__(self, limit: float, smallest: float, held_before: float = 0.0):
        self.limit, self.smallest = limit, smallest
        self.passes: list[Pass] = []
        self.starts: list[float] = []
        self.held: list[float] = []  # memory after each placed pass, absolute
        # idle intervals at least `smallest` long, in time order: their starts and ends
        self.gap_starts: list[float] = []
        self.gap_ends: list[float] = []
        self.held_before = held_before  # memory before the first placed pass

    def _replace_gap(self, g: int, pieces: list[tuple[float, float]]) -> None:
        """Gap g (an index, or the insertion point of a new one) becomes the pieces long enough to keep."""
        kept = [(a, b) for a, b in pieces if b - a >= self.smallest - _EPS]
        self.gap_starts[g:g + 1] = [a for a, _ in kept]
        self.gap_ends[g:g + 1] = [b for _, b in kept]

    def _add_gap(self, index: int, start: float, end: float) -> None:
        if end - start >= self.smallest - _EPS:
            self.gap_starts.insert(index, start)
            self.gap_ends.insert(index, end)

    def _fits_memory(self, index: int, change: float, after: bool) -> bool:
        """Whether a pass changing memory by `change` fits at position `index`: the passes it moves in front
        of (after=True, placing earlier) or behind (after=False, placing later) carry the change too."""
        if (change <= 0) if after else (change >= 0 or index == 0):
            return True
        here = self.held[index - 1] if index > 0 else self.held_before
        if after:
            peak = max(here, max(self.held[index:], default=here)) + change
        else:  # the passes before it no longer see it; a freeing pass moved later raises them
            peak = max(self.held[:index], default=self.held_before) - change
        return peak <= self.limit * (1 + _EPS) + _EPS


class _Forward(_Lane):
    """Placing passes in start order, each as early as possible."""

    def __init__(self, limit: float, smallest: float):
        super().__init__(limit, smallest)
        self.end = 0.0

    def place(self, p: Pass, ready: float, length: float, change: float) -> float:
        first = bisect.bisect_left(self.gap_ends, ready + length - _EPS)
        for g in range(first, min(first + _GAPS_TRIED, len(self.gap_ends))):
            g0, g1 = self.gap_starts[g], self.gap_ends[g]
            start = max(g0, ready)
            if start + length > g1 + _EPS:
                continue
            index = bisect.bisect_left(self.starts, start)
            if not self._fits_memory(index, change, after=True):
                continue
            self.passes.insert(index, p)
            self.starts.insert(index, start)
            self.held.insert(index, (self.held[index - 1] if index else 0.0) + change)
            if change:
                self.held[index + 1:] = [h + change for h in self.held[index + 1:]]
            self._replace_gap(g, [(g0, start), (start + length, g1)])
            return start
        start = max(ready, self.end)
        self._add_gap(len(self.gap_ends), self.end, start)
        self.passes.append(p)
        self.starts.append(start)
        self.held.append((self.held[-1] if self.held else 0.0) + change)
        self.end = start + length
        return start


class _Backward(_Lane):
    """Placing passes in reverse end order, each as late as possible; `held_before` is what the passes not
    placed yet (all earlier in the order) hold."""

    def __init__(self, limit: float, smallest: float, held_before: float, end: float):
        super().__init__(limit, smallest, held_before)
        self.begin = end  # the earliest start placed so far

    def place(self, p: Pass, latest_end: float, length: float, change: float) -> float:
        self.held_before -= change  # the pass leaves the unplaced prefix
        last = bisect.bisect_right(self.gap_starts, latest_end - length + _EPS)
        for g in range(last - 1, max(last - 1 - _GAPS_TRIED, -1), -1):
            g0, g1 = self.gap_starts[g], self.gap_ends[g]
            end = min(g1, latest_end)
            if end - length < g0 - _EPS:
                continue
            start = end - length
            index = bisect.bisect_left(self.starts, start)
            if not self._fits_memory(index, change, after=False):
                continue
            if change:
                self.held[:index] = [h - change for h in self.held[:index]]
            self.passes.insert(index, p)
            self.starts.insert(index, start)
            self.held.insert(index, (self.held[index - 1] if index else self.held_before) + change)
            self._replace_gap(g, [(g0, start), (end, g1)])
            return start
        end = min(latest_end, self.begin)
        start = end - length
        self._add_gap(0, end, self.begin)
        self.passes.insert(0, p)
        self.starts.insert(0, start)
        self.held.insert(0, self.held_before + change)
        self.begin = start
        return start


class _Facts:
    """ops.TABLE's rows per (op, virtual stage), worked out once: what a pass needs (with the T_comm of each
    input), what it completes, its duration and its memory change; and which passes need it."""

    def __init__(self, schedule: Schedule, costs: Costs):
        self.schedule, self.costs, self.rows, self.users = schedule, costs, {}, {}
        self.nv, self.p = schedule.num_virtual_stages, schedule.stages

    def _comm(self, a: int, b: int) -> float:
        owner = self.schedule.owner
        return self.costs.t_comm if owner(a)[0] != owner(b)[0] else 0.0

    def __call__(self, op: Op, v: int) -> tuple:
        row = self.rows.get((op, v))
        if row is None:
            f = facts(op)
            needs = tuple((need, u, self._comm(u, v)) for need, u in f.needed_stages(v, self.nv, self.p))
            row = self.rows[op, v] = (needs, f.completes, f.duration(self.costs, v), f.memory_change(self.costs, v))
        return row

    def users_of(self, op: Op, v: int) -> tuple:
        """(op, virtual stage, T_comm) of the passes that need what `op` at `v` completes."""
        found = self.users.get((op, v))
        if found is None:
            done = facts(op).completes
            found = self.users[op, v] = tuple(
                (other, v - n.offset, self._comm(v, v - n.offset))
                for other in OPS for n in facts(other).needs
                if n.op in done and 0 <= v - n.offset < self.nv
                and facts(other).linked_stage(v - n.offset, n.offset, self.nv, self.p) == v)
        return found


def _smallest(costs: Costs) -> float:
    return min(min(costs.t_f), min(costs.t_b), min(costs.t_w))


def left_justify(schedule: Schedule, costs: Costs, limits: list[float], timeline: Timeline | None = None) -> Schedule:
    """Every pass, in order of its start, as early as its inputs and its rank allow, into idle gaps where
    the memory limit lets it."""
    timeline = timeline or simulate(schedule, costs)
    row, smallest = _Facts(schedule, costs), _smallest(costs)
    lanes = [_Forward(limits[r], smallest) for r in range(schedule.stages)]
    ended: dict[tuple, float] = {}
    stream_end: dict[tuple, float] = {}  # (rank, op, chunk) -> end of its latest placed pass
    for t in sorted(_all(timeline), key=lambda t: (t.start, t.rank)):
        rank, p, v = t.rank, t.op, t.vstage
        needs, completes, length, change = row(p.op, v)
        ready = stream_end.get((rank, p.op, p.chunk), 0.0)
        for op, at, comm in needs:
            ready = max(ready, ended[op, p.mb, at] + comm)
        start = lanes[rank].place(p, ready, length, change)
        for done in completes:
            ended[done, p.mb, v] = start + length
        stream_end[rank, p.op, p.chunk] = start + length
    return _rebuilt(schedule, [lane.passes for lane in lanes])


def right_justify(schedule: Schedule, costs: Costs, limits: list[float], timeline: Timeline | None = None) -> Schedule:
    """Every pass, in reverse order of its end, as late as the passes that need it allow (no rank ends
    later than it did), into idle gaps where the memory limit lets it."""
    timeline = timeline or simulate(schedule, costs)
    row, smallest = _Facts(schedule, costs), _smallest(costs)
    lanes, ends = [], []
    for r, passes in enumerate(timeline.ranks):
        held = sum(row(t.op.op, t.vstage)[3] for t in passes)
        ends.append(passes[-1].end if passes else 0.0)
        lanes.append(_Backward(limits[r], smallest, held, ends[-1]))
    started: dict[tuple, float] = {}
    stream_start: dict[tuple, float] = {}
    # ties (passes of no duration end where the next starts) in reverse order of the rank's own sequence
    for t in sorted(reversed(list(_all(timeline))), key=lambda t: (-t.end, -t.rank)):
        rank, p, v = t.rank, t.op, t.vstage
        latest = stream_start.get((rank, p.op, p.chunk), ends[rank])
        for op, at, comm in row.users_of(p.op, v):
            begins = started.get((op, p.mb, at))
            if begins is not None and begins - comm < latest:
                latest = begins - comm
        _, _, length, change = row(p.op, v)
        start = lanes[rank].place(p, latest, length, change)
        started[p.op, p.mb, v] = start
        stream_start[rank, p.op, p.chunk] = start
    return _rebuilt(schedule, [lane.passes for lane in lanes])


def refill_weight_passes(schedule: Schedule, costs: Costs, limits: list[float]) -> Schedule:
    """Left-justify F and B with every W taken out (counted as run right after its B, for the memory
    check), then run each rank's W passes, oldest first, whenever its next F or B cannot start yet and
    the W ends before that pass could, or when memory needs freeing; the rest after the last B."""
    with_w_after_b = []
    for passes in schedule.ranks:
        order = []
        for p in passes:
            if p.op != Op.W:
                order.append(p)
                if p.op == Op.B:
                    order.append(Pass(Op.W, p.mb, p.chunk))
        with_w_after_b.append(order)
    squeezed = left_justify(_rebuilt(schedule, with_w_after_b), costs, limits)
    return _rebuilt(schedule, _fill_weight_passes(squeezed, costs, limits))


def _fill_weight_passes(schedule: Schedule, costs: Costs, limits: list[float]) -> list[list[Pass]]:
    """Simulate the F/B order of `schedule` and insert the W passes into each rank's idle time."""
    p, row = schedule.stages, _Facts(schedule, costs)
    fb = [[x for x in passes if x.op != Op.W] for passes in schedule.ranks]
    out: list[list[Pass]] = [[] for _ in range(p)]
    pending: list[deque] = [deque() for _ in range(p)]  # W passes whose B ran, oldest first
    ended: dict[tuple, float] = {}
    position, free, held = [0] * p, [0.0] * p, [0.0] * p
    left = sum(map(len, schedule.ranks))
    # (time, rank): look at a rank when it is free, when an input of its next pass arrives, or when that pass
    # could start; ranks looked at the same time go in rank order
    events = [(0.0, rank) for rank in range(p)]
    vstage = [[schedule.virtual_stage(r, c) for c in range(schedule.chunks)] for r in range(p)]
    owner = [schedule.owner(v)[0] for v in range(schedule.num_virtual_stages)]

    def ready(rank: int, x: Pass) -> float | None:
        at = 0.0
        for op, v, comm in row(x.op, vstage[rank][x.chunk])[0]:
            end = ended.get((op, x.mb, v))
            if end is None:
                return None
            at = max(at, end + comm)
        return at

    def start(rank: int, x: Pass, t: float) -> None:
        nonlocal left
        v = vstage[rank][x.chunk]
        _, completes, length, change = row(x.op, v)
        held[rank] += change
        for done in completes:
            ended[done, x.mb, v] = t + length
        out[rank].append(x)
        free[rank] = t + length
        left -= 1
        heapq.heappush(events, (t + length, rank))
        for _, u, comm in row.users_of(x.op, v):  # the ranks whose passes wait for this one
            if owner[u] != rank:
                heapq.heappush(events, (t + length + comm, owner[u]))

    while left:
        if not events:  # nothing can start any more: the F/B order deadlocks; keep what was given
            return schedule.ranks
        t, rank = heapq.heappop(events)
        due = {rank}
        while events and events[0][0] <= t + _EPS:
            due.add(heapq.heappop(events)[1])
        for rank in sorted(due):
            if free[rank] > t + _EPS:
                continue
            nxt = fb[rank][position[rank]] if position[rank] < len(fb[rank]) else None
            at = ready(rank, nxt) if nxt is not None else None
            if nxt is not None and at is not None and at <= t + _EPS:
                change = row(nxt.op, vstage[rank][nxt.chunk])[3]
                if not (change > 0 and held[rank] + change > limits[rank] + _EPS and pending[rank]):
                    position[rank] += 1
                    if nxt.op == Op.B:
                        pending[rank].append(Pass(Op.W, nxt.mb, nxt.chunk))
                    start(rank, nxt, t)
                    continue
                start(rank, pending[rank].popleft(), t)  # free memory first
            elif pending[rank]:
                w = pending[rank][0]
                length = row(Op.W, vstage[rank][w.chunk])[2]
                if nxt is None or at is None or t + length <= at + _EPS:
                    start(rank, pending[rank].popleft(), t)
                else:
                    heapq.heappush(events, (at, rank))
            elif at is not None:
                heapq.heappush(events, (at, rank))
    return out


def _all(timeline: Timeline):
    return (t for passes in timeline.ranks for t in passes)


def _rebuilt(schedule: Schedule, ranks: list[list[Pass]]) -> Schedule:
    return Schedule(schedule.stages, schedule.chunks, schedule.microbatches, schedule.layout, ranks,
                    schedule.name, dict(schedule.info))
