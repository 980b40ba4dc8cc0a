"""ILP refinement of the automatic planner's schedule (paper section 3.2), solved with HiGHS.

Variables: the start time of every pass, C (the longest stage span), and one ordering binary per pair of
same-stage passes of different kinds that the heuristic placed at most `window` positions apart and
whose time windows let them swap. F, B and W each keep microbatch order on a stage (W's order keeps
the gradients bit-identical to 1F1B); pairs further apart keep the heuristic's order. The model is thus
a large neighbourhood of the heuristic's schedule rather than a hopeless full model for big p and m.
Constraints: dependencies with T_comm, no overlap on a stage (big-M per pair, from the time windows),
and the memory limit after every F (and after every B when M_W > M_B). Objective: C >= end of a stage's
last W minus the earliest start of its first F (where the simulator starts it), so simulating the
extracted order can only shorten the spans. Warm-started from the heuristic, time-limited, and its
result is used only if it simulates to a shorter span than the heuristic's.
"""
from __future__ import annotations

import bisect
import time
from typing import Callable

from .auto_problem import Plan, Problem, Step, span_lower_bound, to_schedule
from .costs import Costs
from .ops import facts
from .schedule import ScheduleError
from .simulate import simulate
from .validate import check_memory

KINDS = ("F", "B", "W")
RANK = {"F": 0, "B": 1, "W": 2}
MAX_PASSES = 5000  # above this, building and solving the model eats the time limit for nothing
MAX_BINARIES = 4000  # beyond this many ordering binaries HiGHS rarely improves anything in seconds
MAX_WINDOW = 48
Key = tuple[int, Step]  # (stage, pass)


def _forced(a: Step, b: Step) -> bool:
    """True when a precedes b on its stage in every schedule (kind chain plus microbatch order)."""
    return RANK[a[0]] < RANK[b[0]] and a[1] <= b[1]


class Windows:
    """Earliest and latest start of every pass when no stage span may exceed `span`.

    Earliest: dependencies and the passes that must run before on the same stage; latest: the same,
    backwards from each stage's deadline (its earliest first start plus `span`).
    """

    def __init__(self, problem: Problem, first: list[float], span: float):
        p, m, tc = problem.stages, problem.microbatches, problem.t_comm
        tf, tb, tw = problem.t_f, problem.t_b, problem.t_w
        self.length = {"F": tf, "B": tb, "W": tw}
        es: dict[Key, float] = {}
        for s in range(p):
            for j in range(m):
                chain = es[(s - 1, ("F", j))] + tf[s - 1] + tc if s > 0 else 0.0
                es[(s, ("F", j))] = max(first[s] + j * tf[s], chain)
        for s in reversed(range(p)):
            for j in range(m):
                later = es[(s + 1, ("B", j))] + tb[s + 1] + tc if s < p - 1 else 0.0
                previous = es[(s, ("B", j - 1))] + tb[s] if j > 0 else 0.0
                own = first[s] + (j + 1) * tf[s] + j * tb[s]
                es[(s, ("B", j))] = max(own, later, previous, es[(s, ("F", j))] + tf[s])
                previous = es[(s, ("W", j - 1))] + tw[s] if j > 0 else 0.0
                es[(s, ("W", j))] = max(es[(s, ("B", j))] + tb[s], previous)
        ls: dict[Key, float] = {}
        deadline = [first[s] + span for s in range(p)]
        for s in range(p):
            for j in reversed(range(m)):
                ls[(s, ("W", j))] = deadline[s] - (m - j) * tw[s]
                bounds = [ls[(s, ("W", j))] - tb[s], deadline[s] - (m - j) * (tb[s] + tw[s])]
                if j < m - 1:
                    bounds.append(ls[(s, ("B", j + 1))] - tb[s])
                if s > 0:
                    bounds.append(ls[(s - 1, ("B", j))] - tc - tb[s])
                ls[(s, ("B", j))] = min(bounds)
        for s in reversed(range(p)):
            for j in reversed(range(m)):
                bounds = [ls[(s, ("B", j))] - tf[s], deadline[s] - (m - j) * (tf[s] + tb[s] + tw[s])]
                if j < m - 1:
                    bounds.append(ls[(s, ("F", j + 1))] - tf[s])
                if s < p - 1:
                    bounds.append(ls[(s + 1, ("F", j))] - tc - tf[s])
                ls[(s, ("F", j))] = min(bounds)
        self.earliest, self.latest = es, {k: max(v, es[k]) for k, v in ls.items()}

    def duration(self, s: int, step: Step) -> float:
        return self.length[step[0]][s]

    def can_precede(self, s: int, a: Step, b: Step) -> bool:
        """Whether a can end before b starts within the windows."""
        return self.earliest[(s, a)] + self.duration(s, a) <= self.latest[(s, b)] + 1e-9

    def big_m(self, s: int, a: Step, b: Step) -> float:
        """Enough slack to switch off 'a ends before b starts'."""
        return max(0.0, self.latest[(s, a)] + self.duration(s, a) - self.earliest[(s, b)]) + 1e-6


def _near_pairs(s: int, order: list[Step], windows: Windows) -> list[tuple[int, Step, Step, bool]]:
    """(distance, a, b, b could go first) for passes of different kinds at most MAX_WINDOW apart."""
    out = []
    for i, a in enumerate(order):
        for d, b in enumerate(order[i + 1:i + 1 + MAX_WINDOW], start=1):
            if a[0] != b[0] and not _forced(a, b):
                out.append((d, a, b, windows.can_precede(s, b, a)))
    return out


def _boundary_pairs(order: list[Step], window: int) -> set[tuple[Step, Step]]:
    """Beyond the window only the nearest pass of each other kind needs a row; chains do the rest."""
    fixed = set()
    positions = {kind: [i for i, step in enumerate(order) if step[0] == kind] for kind in KINDS}
    for i, a in enumerate(order):
        for kind in KINDS:
            if kind == a[0]:
                continue
            where = positions[kind]
            before = bisect.bisect_left(where, i - window) - 1
            if before >= 0 and not _forced(order[where[before]], a):
                fixed.add((order[where[before]], a))
            after = bisect.bisect_right(where, i + window)
            if after < len(where) and not _forced(a, order[where[after]]):
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
    p, m = problem.stages, problem.microbatches
    if plan.span <= span_lower_bound(problem) * (1 + 1e-9):
        return plan, "skipped: the heuristic already meets the lower bound on the span"
    if 3 * p * m > MAX_PASSES:
        return plan, f"skipped: {3 * p * m} passes is more than the ILP can improve in seconds (limit {MAX_PASSES})"
    try:
        import highspy
    except ImportError:
        return plan, "skipped: highspy is not installed"
    costs = Costs(problem.t_f, problem.t_b, problem.t_w, problem.m_f, problem.m_w, problem.t_comm)
    baseline = simulate(to_schedule(problem, plan, {}), costs)
    first = [baseline.ranks[s][0].start for s in range(p)]
    windows = Windows(problem, first, plan.span)
    near = [_near_pairs(s, order, windows) for s, order in enumerate(plan.orders)]
    window, count = choose_window(near)
    if window == 0:
        return plan, f"skipped: even neighbouring passes need {count} ordering binaries (limit {MAX_BINARIES})"
    model, columns, binaries, objective = _build(problem, plan, windows, near, window, first)
    remaining = time_limit - (time.monotonic() - begun)
    if remaining <= 0.05:
        return plan, f"skipped: building the model took the whole {time_limit:g} s"
    highs = _quiet_solver(highspy)
    highs.setOptionValue("random_seed", 0)
    highs.setOptionValue("time_limit", float(remaining))
    _load(highs, model)
    if progress is not None:
        _report_progress(highs, progress, begun, max(problem.busy(s) for s in range(p)))
    highs.setSolution(_warm_start(baseline, plan, columns, binaries, objective, len(model.lower)))
    highs.run()
    solution = highs.getSolution()
    status = highs.modelStatusToString(highs.getModelStatus())
    where = f"window {window}, {count} binaries, {time.monotonic() - begun:.1f} s, {status}"
    if not solution.value_valid or len(solution.col_value) != len(model.lower):
        return plan, f"no ILP solution ({where}); heuristic kept"
    candidate = _extract(plan, columns, list(solution.col_value))
    span = _evaluate(problem, costs, candidate)
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


def _build(problem: Problem, plan: Plan, windows: Windows, near, window: int, first: list[float]):
    p, m, tc = problem.stages, problem.microbatches, problem.t_comm
    model = _Model()
    columns: dict[Key, int] = {}
    for s in range(p):
        for kind in KINDS:
            for j in range(m):
                key = (s, (kind, j))
                columns[key] = model.column(windows.earliest[key], windows.latest[key])
    busiest = max(problem.busy(s) for s in range(p))
    objective = model.column(max(busiest, span_lower_bound(problem)), plan.span * (1 + 1e-9) + 1e-9, 1.0)

    def after(later: Key, earlier: Key, gap: float) -> None:
        model.row([(columns[later], 1.0), (columns[earlier], -1.0)], gap)

    for s in range(p):
        for j in range(m):
            if s > 0:
                after((s, ("F", j)), (s - 1, ("F", j)), problem.t_f[s - 1] + tc)
            after((s, ("B", j)), (s, ("F", j)), problem.t_f[s])
            if s < p - 1:
                after((s, ("B", j)), (s + 1, ("B", j)), problem.t_b[s + 1] + tc)
            after((s, ("W", j)), (s, ("B", j)), problem.t_b[s])
            for kind in KINDS:
                if j > 0:
                    after((s, (kind, j)), (s, (kind, j - 1)), windows.duration(s, (kind, j - 1)))
        # C covers the stage span: end of its last W minus the earliest start of its first F.
        model.row([(objective, 1.0), (columns[(s, ("W", m - 1))], -1.0)], problem.t_w[s] - first[s])
    binaries: list[int] = []
    for s, order in enumerate(plan.orders):
        binaries += _stage_rows(problem, model, columns, windows, s, order, near[s], window)
    return model, columns, binaries, objective


def _stage_rows(problem: Problem, model: _Model, columns: dict, windows: Windows, s: int, order: list[Step],
                near, window: int) -> list[int]:
    """No-overlap and memory rows of one stage; returns its ordering binaries' columns."""
    binary_of: dict[tuple[Step, Step], int] = {}
    fixed = _boundary_pairs(order, window)
    for d, a, b, free in near:
        if d > window:
            continue
        if not free:
            fixed.add((a, b))
            continue
        x = model.column(0.0, 1.0, integer=True)  # 1: a ends before b starts; 0: the other way round
        binary_of[(a, b)] = x
        ca, cb = columns[(s, a)], columns[(s, b)]
        m_ab, m_ba = windows.big_m(s, a, b), windows.big_m(s, b, a)
        model.row([(cb, 1.0), (ca, -1.0), (x, -m_ab)], windows.duration(s, a) - m_ab)
        model.row([(ca, 1.0), (cb, -1.0), (x, m_ba)], windows.duration(s, b))
    for a, b in fixed:
        model.row([(columns[(s, b)], 1.0), (columns[(s, a)], -1.0)], windows.duration(s, a))
    pos = {step: i for i, step in enumerate(order)}
    weights = {kind: facts(kind).memory_change(problem, s) for kind in KINDS}  # M_F, M_W - M_F, -M_W
    limit = problem.limits[s] * (1 + 1e-9) + 1e-9
    m = problem.microbatches
    checks = [("F", i) for i in range(m)] + ([("B", j) for j in range(m)] if weights["B"] > 0 else [])
    for x in checks:
        # held after x = M_F * #F up to x - (M_F - M_W) * #B up to x - M_W * #W up to x
        constant, terms = 0.0, []
        for kind, weight in weights.items():
            for j in range(m):
                y = (kind, j)
                if y == x or _forced(y, x):
                    constant += weight
                elif (y, x) in binary_of:
                    terms.append((binary_of[(y, x)], weight))
                elif (x, y) in binary_of:
                    constant += weight
                    terms.append((binary_of[(x, y)], -weight))
                elif not _forced(x, y) and pos[y] < pos[x]:
                    constant += weight
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
    for s, passes in enumerate(baseline.ranks):
        for timed in passes:
            values[columns[(s, (timed.op.op, timed.op.mb))]] = timed.start
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
    """Stage orders by ILP start time, ties broken by the heuristic's order."""
    orders = []
    for s, order in enumerate(plan.orders):
        pos = {step: i for i, step in enumerate(order)}
        orders.append(sorted(order, key=lambda step: (round(values[columns[(s, step)]], 7), pos[step])))
    return orders


def _evaluate(problem: Problem, costs: Costs, orders: list[list[Step]]) -> float | None:
    """Longest stage span of the orders when simulated; None if they deadlock or break the memory limit."""
    schedule = to_schedule(problem, Plan(orders, 0.0, ""), {})
    try:
        timeline = simulate(schedule, costs)
        check_memory(schedule, costs, list(problem.limits))
    except ScheduleError:
        return None
    return max(timeline.span(s) for s in range(problem.stages))
