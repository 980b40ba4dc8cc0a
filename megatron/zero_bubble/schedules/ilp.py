"""ILP refinement of the automatic planner's schedule (paper section 3.2), solved with HiGHS.

Variables: the start time of every pass, C (the longest rank span), and one ordering binary per pair of
same-rank passes of different kinds (op and chunk) that the heuristic placed at most `window` positions
apart and whose time windows let them swap. Every kind keeps microbatch order on its rank (W's order keeps
the gradients bit-identical to 1F1B); pairs further apart keep the heuristic's order. The model is thus a
large neighbourhood of the heuristic's schedule rather than a hopeless full model for big p and m.
Constraints, all read from ops.TABLE through the Problem: dependencies with T_comm between ranks, no
overlap on a rank (big-M per pair, from the time windows), and the memory limit after every pass that adds
memory. Objective: C >= end of each pass that can be a rank's last minus the earliest start of its first
(where the simulator starts it), so simulating the extracted order can only shorten the spans.
Warm-started from the heuristic, time-limited, and its result is used only if it simulates to a shorter
span than the heuristic's and passes the memory limit and the communication lowering's deadlock check.
"""
from __future__ import annotations

import bisect
import time
from typing import Callable

from .auto_problem import SPLIT, Plan, Problem, Step, span_lower_bound, to_schedule
from .comm import lower
from .nccl_model import check_lowering
from .ops import Op
from .schedule import ScheduleError
from .simulate import simulate
from .validate import check_memory

MAX_PASSES = 5000  # above this, building and solving the model eats the time limit for nothing
MAX_BINARIES = 4000  # beyond this many ordering binaries HiGHS rarely improves anything in seconds
MAX_WINDOW = 48
Key = tuple[int, Step]  # (rank, pass)
Kind = tuple[Op, int]  # (op, chunk): the passes of one kind on a rank run in microbatch order


class Precedence:
    """Which kinds of pass on a rank always come before which, from ops.TABLE's needs: within a microbatch,
    a kind precedes another if a chain of needs leads from it to the other; across microbatches, stream
    order (every kind runs in microbatch order) carries that to every later microbatch."""

    def __init__(self, problem: Problem):
        self.problem = problem
        nodes = [(op, u) for op in SPLIT for u in range(problem.num_virtual_stages)]
        ancestors: dict[tuple[Op, int], set] = {}
        for node in _topological(problem, nodes):
            found = set()
            for need, u, _ in problem.needs[node[0]][node[1]]:
                found.add((need, u))
                found |= ancestors[(need, u)]
            ancestors[node] = found
        self.reaches = [{(a, b): (a[0], problem.stage_of[r][a[1]]) in ancestors[(b[0], problem.stage_of[r][b[1]])]
                         for a in self.kinds(r) for b in self.kinds(r)} for r in range(problem.stages)]

    def kinds(self, r: int) -> list[Kind]:
        return [(op, c) for op in SPLIT for c in range(self.problem.chunks)]

    def forced(self, r: int, a: Step, b: Step) -> bool:
        """True when a precedes b on rank r in every schedule."""
        ka, kb = (a[0], a[2]), (b[0], b[2])
        if ka == kb:
            return a[1] < b[1]
        return a[1] <= b[1] and self.reaches[r][(ka, kb)]

    def before(self, r: int, kind: Kind, mb: int) -> dict[Kind, int]:
        """How many passes of each kind come before (kind, mb) on rank r in every schedule."""
        return {k: (mb + 1 if self.reaches[r][(k, kind)] else mb if k == kind else 0) for k in self.kinds(r)}

    def after(self, r: int, kind: Kind, mb: int) -> dict[Kind, int]:
        """How many passes of each kind come after (kind, mb) on rank r in every schedule."""
        m = self.problem.microbatches
        return {k: (m - mb if self.reaches[r][(kind, k)] else m - 1 - mb if k == kind else 0)
                for k in self.kinds(r)}


def _topological(problem: Problem, nodes: list) -> list:
    """One microbatch's passes, each after everything it needs (Kahn's order over ops.TABLE's needs)."""
    waiting = {node: len(problem.needs[node[0]][node[1]]) for node in nodes}
    ready = [node for node, count in waiting.items() if count == 0]
    out = []
    while ready:
        node = ready.pop()
        out.append(node)
        for user, u, _ in problem.users[node[0]][node[1]]:
            waiting[(user, u)] -= 1
            if waiting[(user, u)] == 0:
                ready.append((user, u))
    return out


class Windows:
    """Earliest and latest start of every pass when no rank span may exceed `span`.

    Earliest: its inputs, the previous pass of its kind, and the work that must run before it on its rank;
    latest: the same backwards from each rank's deadline (its earliest first start plus `span`).
    """

    def __init__(self, problem: Problem, precedence: Precedence, first: list[float], span: float):
        self.problem = problem
        p, m, stage_of, owner, chunk_of = (problem.stages, problem.microbatches, problem.stage_of, problem.owner,
                                           problem.chunk_of)
        chain = _topological(problem, [(op, u) for op in SPLIT for u in range(problem.num_virtual_stages)])
        kinds = [precedence.kinds(r) for r in range(p)]
        length = [{k: problem.time[k[0]][stage_of[r][k[1]]] for k in kinds[r]} for r in range(p)]

        def work(r: int, counts: dict) -> float:
            return sum(length[r][k] * n for k, n in counts.items() if n)

        es: dict[Key, float] = {}
        for mb in range(m):
            for op, u in chain:
                r, c = owner[u], chunk_of[u]
                at = first[r] + work(r, precedence.before(r, (op, c), mb))
                for need, w, comm in problem.needs[op][u]:
                    at = max(at, es[(owner[w], (need, mb, chunk_of[w]))] + problem.time[need][w] + comm)
                if mb:
                    at = max(at, es[(r, (op, mb - 1, c))] + problem.time[op][u])
                es[(r, (op, mb, c))] = at
        ls: dict[Key, float] = {}
        for mb in reversed(range(m)):
            for op, u in reversed(chain):
                r, c, length_x = owner[u], chunk_of[u], problem.time[op][u]
                at = first[r] + span - length_x - work(r, precedence.after(r, (op, c), mb))
                for user, w, comm in problem.users[op][u]:
                    at = min(at, ls[(owner[w], (user, mb, chunk_of[w]))] - comm - length_x)
                if mb < m - 1:
                    at = min(at, ls[(r, (op, mb + 1, c))] - length_x)
                ls[(r, (op, mb, c))] = at
        self.earliest, self.latest = es, {k: max(v, es[k]) for k, v in ls.items()}

    def duration(self, r: int, x: Step) -> float:
        return self.problem.time[x[0]][self.problem.stage_of[r][x[2]]]

    def can_precede(self, r: int, a: Step, b: Step) -> bool:
        """Whether a can end before b starts within the windows."""
        return self.earliest[(r, a)] + self.duration(r, a) <= self.latest[(r, b)] + 1e-9

    def big_m(self, r: int, a: Step, b: Step) -> float:
        """Enough slack to switch off 'a ends before b starts'."""
        return max(0.0, self.latest[(r, a)] + self.duration(r, a) - self.earliest[(r, b)]) + 1e-6


def _kind(x: Step) -> Kind:
    return x[0], x[2]


def _near_pairs(r: int, order: list[Step], windows: Windows, precedence: Precedence):
    """(distance, a, b, b could go first) for passes of different kinds at most MAX_WINDOW apart."""
    out = []
    for i, a in enumerate(order):
        for d, b in enumerate(order[i + 1:i + 1 + MAX_WINDOW], start=1):
            if _kind(a) != _kind(b) and not precedence.forced(r, a, b):
                out.append((d, a, b, windows.can_precede(r, b, a)))
    return out


def _boundary_pairs(r: int, order: list[Step], window: int, precedence: Precedence) -> set[tuple[Step, Step]]:
    """Beyond the window only the nearest pass of each other kind needs a row; chains do the rest."""
    fixed = set()
    positions: dict[Kind, list[int]] = {}
    for i, x in enumerate(order):
        positions.setdefault(_kind(x), []).append(i)
    for i, a in enumerate(order):
        for kind, where in positions.items():
            if kind == _kind(a):
                continue
            before = bisect.bisect_left(where, i - window) - 1
            if before >= 0 and not precedence.forced(r, order[where[before]], a):
                fixed.add((order[where[before]], a))
            after = bisect.bisect_right(where, i + window)
            if after < len(where) and not precedence.forced(r, a, order[where[after]]):
                fixed.add((a, order[where[after]]))
    return fixed


def choose_window(near: list[list[tuple[int, Step, Step, bool]]], limit: int = MAX_BINARIES) -> tuple[int, int]:
    """(widest window whose binaries fit in `limit`, their count); window 0 when even 1 does not fit."""
    per_distance = [0] * (MAX_WINDOW + 1)
    for pairs in near:
        for d, _, _, free in pairs:
            per_distance[d] += free
    window, count = 0, 0
    for d in range(1, MAX_WINDOW + 1):
        if count + per_distance[d] > limit:
            return (window, count) if window else (0, count + per_distance[d])
        window, count = d, count + per_distance[d]
    return window, count


class _Model:
    """Columns and rows of the MIP in compressed form, built with plain lists."""

    def __init__(self):
        self.lower, self.upper, self.cost, self.integer = [], [], [], []
        self.row_lower, self.row_upper, self.starts, self.index, self.value = [], [], [], [], []

    def column(self, lower: float, upper: float, cost: float = 0.0, integer: bool = False) -> int:
        self.lower.append(lower)
        self.upper.append(upper)
        self.cost.append(cost)
        self.integer.append(integer)
        return len(self.lower) - 1

    def row(self, terms: list[tuple[int, float]], lower: float, upper: float = float("inf")) -> None:
        self.starts.append(len(self.index))
        for i, v in terms:
            self.index.append(i)
            self.value.append(v)
        self.row_lower.append(lower)
        self.row_upper.append(upper)


def refine(
    problem: Problem, plan: Plan, time_limit: float, progress: Callable[[str], None] | None = None
) -> tuple[Plan, str]:
    """The better of the heuristic plan and the time-limited ILP's, with a one-line note on what happened."""
    begun = time.monotonic()
    p, passes = problem.stages, 3 * problem.num_virtual_stages * problem.microbatches
    if plan.span <= span_lower_bound(problem) * (1 + 1e-9):
        return plan, "skipped: the heuristic already meets the lower bound on the span"
    if passes > MAX_PASSES:
        return plan, f"skipped: {passes} passes is more than the ILP can improve in seconds (limit {MAX_PASSES})"
    try:
        import highspy
    except ImportError:
        return plan, "skipped: highspy is not installed"
    costs = problem.costs
    baseline = simulate(to_schedule(problem, plan, {}), costs)
    first = [baseline.ranks[r][0].start for r in range(p)]
    precedence = Precedence(problem)
    windows = Windows(problem, precedence, first, plan.span)
    near = [_near_pairs(r, order, windows, precedence) for r, order in enumerate(plan.orders)]
    window, count = choose_window(near)
    if window == 0:
        return plan, f"skipped: even neighbouring passes need {count} ordering binaries (limit {MAX_BINARIES})"
    model, columns, binaries, objective = _build(problem, plan, windows, precedence, near, window, first)
    remaining = time_limit - (time.monotonic() - begun)
    if remaining <= 0.05:
        return plan, f"skipped: building the model took the whole {time_limit:g} s"
    highs = _quiet_solver(highspy)
    highs.setOptionValue("random_seed", 0)
    highs.setOptionValue("time_limit", float(remaining))
    _load(highs, model)
    if progress is not None:
        _report_progress(highs, progress, begun, max(problem.busy(r) for r in range(p)))
    highs.setSolution(_warm_start(baseline, plan, columns, binaries, objective, len(model.lower)))
    highs.run()
    solution = highs.getSolution()
    status = highs.modelStatusToString(highs.getModelStatus())
    where = f"window {window}, {count} binaries, {time.monotonic() - begun:.1f} s, {status}"
    if not solution.value_valid or len(solution.col_value) != len(model.lower):
        return plan, f"no ILP solution ({where}); heuristic kept"
    candidate = _extract(plan, columns, list(solution.col_value))
    span = _evaluate(problem, candidate)
    if span is not None and span < plan.span * (1 - 1e-9):
        return Plan(candidate, span, plan.label + " + ILP"), f"improved span {plan.span:.6g} -> {span:.6g} ({where})"
    return plan, f"no improvement over the heuristic ({where})"


def _quiet_solver(highspy):
    """A HiGHS instance that never writes to stdout (planners' output, e.g. `zb-schedule export`, is data).

    HiGHS prints its banner on the first call after construction unless output_flag is already off;
    highspy's own constructor makes such a call (enableCallbacks), so the option is set right before it.
    """

    class QuietHighs(highspy.Highs):
        def enableCallbacks(self):  # noqa: N802 - highspy's name
            self.setOptionValue("output_flag", False)
            return super().enableCallbacks()

    highs = QuietHighs() if hasattr(highspy.Highs, "enableCallbacks") else highspy.Highs()
    highs.setOptionValue("output_flag", False)
    return highs


def _build(problem: Problem, plan: Plan, windows: Windows, precedence: Precedence, near, window: int,
           first: list[float]):
    p, m = problem.stages, problem.microbatches
    model = _Model()
    columns: dict[Key, int] = {}
    for r, order in enumerate(plan.orders):
        for x in order:
            columns[(r, x)] = model.column(windows.earliest[(r, x)], windows.latest[(r, x)])
    busiest = max(problem.busy(r) for r in range(p))
    objective = model.column(max(busiest, span_lower_bound(problem)), plan.span * (1 + 1e-9) + 1e-9, 1.0)

    def after(later: Key, earlier: Key, gap: float) -> None:
        model.row([(columns[later], 1.0), (columns[earlier], -1.0)], gap)

    for r, order in enumerate(plan.orders):
        for x in order:
            op, mb, chunk = x
            u = problem.stage_of[r][chunk]
            for need, w, comm in problem.needs[op][u]:  # ops.TABLE's dependencies, with T_comm between ranks
                after((r, x), (problem.owner[w], (need, mb, problem.chunk_of[w])), problem.time[need][w] + comm)
            if mb:  # every kind of pass runs in microbatch order
                after((r, x), (r, (op, mb - 1, chunk)), problem.time[op][u])
            if mb == m - 1 and not any(precedence.after(r, _kind(x), mb).values()):
                # C covers the rank span: end of a pass that can be its last, minus the earliest start of its first.
                model.row([(objective, 1.0), (columns[(r, x)], -1.0)], problem.time[op][u] - first[r])
    binaries: list[int] = []
    for r, order in enumerate(plan.orders):
        binaries += _rank_rows(problem, model, columns, windows, precedence, r, order, near[r], window)
    return model, columns, binaries, objective


def _rank_rows(problem: Problem, model: _Model, columns: dict, windows: Windows, precedence: Precedence, r: int,
               order: list[Step], near, window: int) -> list[int]:
    """No-overlap and memory rows of one rank; returns its ordering binaries' columns."""
    binary_of: dict[tuple[Step, Step], int] = {}
    fixed = _boundary_pairs(r, order, window, precedence)
    for d, a, b, free in near:
        if d > window:
            continue
        if not free:
            fixed.add((a, b))
            continue
        x = model.column(0.0, 1.0, integer=True)  # 1: a ends before b starts; 0: the other way round
        binary_of[(a, b)] = x
        ca, cb = columns[(r, a)], columns[(r, b)]
        m_ab, m_ba = windows.big_m(r, a, b), windows.big_m(r, b, a)
        model.row([(cb, 1.0), (ca, -1.0), (x, -m_ab)], windows.duration(r, a) - m_ab)
        model.row([(ca, 1.0), (cb, -1.0), (x, m_ba)], windows.duration(r, b))
    for a, b in fixed:
        model.row([(columns[(r, b)], 1.0), (columns[(r, a)], -1.0)], windows.duration(r, a))
    pos = {x: i for i, x in enumerate(order)}
    # what each pass adds to the rank's activation memory (ops.TABLE): M_F, M_W - M_F, -M_W
    weight = {x: problem.memory[x[0]][problem.stage_of[r][x[2]]] for x in order}
    limit = problem.limits[r] * (1 + 1e-9) + 1e-9
    for x in order:
        if weight[x] <= 0:  # memory only peaks right after a pass that adds some
            continue
        constant, terms = 0.0, []
        for y in order:
            if y == x or precedence.forced(r, y, x):
                constant += weight[y]
            elif (y, x) in binary_of:
                terms.append((binary_of[(y, x)], weight[y]))
            elif (x, y) in binary_of:
                constant += weight[y]
                terms.append((binary_of[(x, y)], -weight[y]))
            elif not precedence.forced(r, x, y) and pos[y] < pos[x]:
                constant += weight[y]
        if terms:
            model.row(terms, -float("inf"), limit - constant)
    return list(binary_of.values())


def _load(highs, model: _Model) -> None:
    import highspy
    import numpy as np

    n = len(model.lower)
    empty_int, empty_float = np.array([], dtype=np.int32), np.array([], dtype=np.float64)
    highs.addCols(n, np.array(model.cost), np.array(model.lower), np.array(model.upper), 0,
                  empty_int, empty_int, empty_float)
    highs.addRows(len(model.row_lower), np.array(model.row_lower), np.array(model.row_upper), len(model.index),
                  np.array(model.starts, dtype=np.int32), np.array(model.index, dtype=np.int32),
                  np.array(model.value, dtype=np.float64))
    integer = [i for i, flag in enumerate(model.integer) if flag]
    if integer:
        kinds = np.array([highspy.HighsVarType.kInteger.value] * len(integer), dtype=np.uint8)
        highs.changeColsIntegrality(len(integer), np.array(integer, dtype=np.int32), kinds)


def _warm_start(baseline, plan: Plan, columns: dict, binaries: list[int], objective: int, n: int):
    """The heuristic as a MIP solution: its simulated starts, every binary 1 (pairs are in its order)."""
    import highspy

    values = [0.0] * n
    for r, passes in enumerate(baseline.ranks):
        for timed in passes:
            values[columns[(r, (timed.op.op, timed.op.mb, timed.op.chunk))]] = timed.start
    for x in binaries:
        values[x] = 1.0
    values[objective] = plan.span
    solution = highspy.HighsSolution()
    solution.col_value = values
    solution.value_valid = True
    return solution


def _report_progress(highs, progress: Callable[[str], None], begun: float, busiest: float) -> None:
    """Call progress with elapsed time and best span at most once a second, after the first second."""
    last = [begun]

    def on_interrupt(event) -> None:
        now = time.monotonic()
        if now - begun < 1.0 or now - last[0] < 1.0:
            return
        last[0] = now
        best, bound = event.data_out.mip_primal_bound, event.data_out.mip_dual_bound
        bubble = f" (bubble {100 * (best - busiest) / best:.2f}%)" if 0 < best < float("inf") else ""
        progress(f"ILP {now - begun:.0f} s: best span {best:.6g}{bubble}, bound {bound:.6g}")

    highs.cbMipInterrupt.subscribe(on_interrupt)


def _extract(plan: Plan, columns: dict, values: list[float]) -> list[list[Step]]:
    """Rank orders by ILP start time, ties broken by the heuristic's order."""
    orders = []
    for r, order in enumerate(plan.orders):
        pos = {x: i for i, x in enumerate(order)}
        orders.append(sorted(order, key=lambda x: (round(values[columns[(r, x)]], 7), pos[x])))
    return orders


def _evaluate(problem: Problem, orders: list[list[Step]]) -> float | None:
    """Longest rank span of the orders when simulated; None if they deadlock (in compute or in the lowered
    communication) or break the memory limit."""
    schedule = to_schedule(problem, Plan(orders, 0.0, ""), {})
    try:
        timeline = simulate(schedule, problem.costs)
        check_memory(schedule, problem.costs, list(problem.limits))
        check_lowering(schedule, lower(schedule, problem.costs, timeline))
    except ScheduleError:
        return None
    return max(timeline.span(r) for r in range(problem.stages))
