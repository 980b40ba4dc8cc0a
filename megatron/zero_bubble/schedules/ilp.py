"""ILP refinement of the automatic planner's schedule (paper section 3.2), solved with HiGHS.

Variables: the start time of every pass, one ordering binary per pair of same-stage passes of different
kinds that the heuristic placed at most `window` positions apart, and C, the longest stage span. F, B
and W each keep microbatch order on a stage (W's order is what keeps gradients bit-identical to 1F1B),
and pairs further apart than the window keep the heuristic's order. That makes the ILP a large
neighbourhood search around the heuristic instead of a hopeless full model for big p and m.
Constraints: dependencies with T_comm, no overlap on a stage (big-M on the ordering binaries), and the
memory limit after every F (and after every B when M_W > M_B). Objective: C >= end of the stage's last
W minus the start of its first F, with every first F pinned at its earliest time, so that simulating
the extracted order can only shorten the spans. The heuristic solution warm-starts the solver, the run
is time-limited, and its result is used only if it simulates to a shorter span than the heuristic's.
"""
from __future__ import annotations

import time
from typing import Callable

from .auto import Plan, Problem, Step, to_schedule
from .schedule import ScheduleError
from .simulate import simulate
from .validate import check_memory

KINDS = ("F", "B", "W")
# Ordering binaries allowed in one model; beyond that HiGHS rarely improves anything in seconds.
MAX_BINARIES = 4000
MAX_WINDOW = 8


def _forced(a: Step, b: Step) -> bool:
    """True when a must precede b on its stage whatever the order (kind chain plus microbatch order)."""
    return KINDS.index(a[0]) < KINDS.index(b[0]) and a[1] <= b[1]


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

    def row(self, terms: list[tuple[int, float]], lower: float, upper: float) -> None:
        self.starts.append(len(self.index))
        for i, v in terms:
            self.index.append(i)
            self.value.append(v)
        self.row_lower.append(lower)
        self.row_upper.append(upper)


def _pairs(order: list[Step], window: int) -> tuple[list[tuple[Step, Step]], list[tuple[Step, Step]]]:
    """(free pairs within the window, boundary pairs fixed as (before, after)) of one stage's order."""
    free, fixed = [], set()
    pos = {step: i for i, step in enumerate(order)}
    by_kind = {k: [step for step in order if step[0] == k] for k in KINDS}
    for i, a in enumerate(order):
        for b in order[i + 1:i + 1 + window]:
            if a[0] != b[0] and not _forced(a, b) and not _forced(b, a):
                free.append((a, b))
        for kind in KINDS:
            if kind == a[0]:
                continue
            far_before = [y for y in by_kind[kind] if pos[y] < i - window and not _forced(y, a)]
            far_after = [y for y in by_kind[kind] if pos[y] > i + window and not _forced(a, y)]
            if far_before:
                fixed.add((far_before[-1], a))
            if far_after:
                fixed.add((a, far_after[0]))
    return free, sorted(fixed, key=lambda pair: (pos[pair[0]], pos[pair[1]]))


def choose_window(plan: Plan, limit: int = MAX_BINARIES) -> tuple[int, int]:
    """Widest window (<= MAX_WINDOW) whose binaries fit in `limit`; (0, n) when even 1 is too many."""
    best = (0, 0)
    for window in range(1, MAX_WINDOW + 1):
        count = sum(len(_pairs(order, window)[0]) for order in plan.orders)
        if count > limit:
            return best if best[0] else (0, count)
        best = (window, count)
    return best


def refine(
    problem: Problem, plan: Plan, time_limit: float, progress: Callable[[str], None] | None = None
) -> tuple[Plan, str]:
    """The better of the heuristic plan and the time-limited ILP's, with a one-line note on what happened."""
    begun = time.monotonic()
    try:
        import highspy
    except ImportError:
        return plan, "skipped: highspy is not installed"
    window, count = choose_window(plan)
    if window == 0:
        return plan, f"skipped: even a window of 1 needs {count} ordering binaries (limit {MAX_BINARIES})"
    baseline = simulate(to_schedule(problem, plan, {}), _costs(problem))
    model, columns, binaries, objective_column = _build(problem, plan, window, baseline)
    highs = highspy.Highs()
    highs.setOptionValue("output_flag", False)
    highs.setOptionValue("random_seed", 0)
    remaining = time_limit - (time.monotonic() - begun)
    if remaining <= 0.05:
        return plan, f"skipped: building the model took the whole {time_limit:g} s"
    highs.setOptionValue("time_limit", float(remaining))
    _load(highs, model)
    if progress is not None:
        _report_progress(highs, progress, begun)
    highs.setSolution(_warm_start(plan, baseline, columns, binaries, objective_column, len(model.lower)))
    highs.run()
    values = list(highs.getSolution().col_value)
    status = highs.modelStatusToString(highs.getModelStatus())
    if len(values) != len(model.lower) or not highs.getSolution().value_valid:
        return plan, f"no ILP solution ({status}); heuristic kept"
    candidate = _extract(problem, plan, columns, values)
    span = _evaluate(problem, candidate)
    elapsed = time.monotonic() - begun
    where = f"window {window}, {count} binaries, {elapsed:.1f} s, {status}"
    if span is not None and span < plan.span * (1 - 1e-9):
        return Plan(candidate, span, plan.label + " + ILP"), f"improved span {plan.span:.6g} -> {span:.6g} ({where})"
    return plan, f"no improvement over the heuristic ({where})"


def _costs(problem: Problem):
    from .costs import Costs

    return Costs(problem.t_f, problem.t_b, problem.t_w, problem.m_f, problem.m_w, problem.t_comm)


def _duration(problem: Problem, step: Step, s: int) -> float:
    return {"F": problem.t_f, "B": problem.t_b, "W": problem.t_w}[step[0]][s]


def _build(problem: Problem, plan: Plan, window: int, baseline) -> tuple[_Model, dict, list[int], int]:
    p, m, tc = problem.stages, problem.microbatches, problem.t_comm
    first = [baseline.ranks[s][0].start for s in range(p)]  # earliest start of each stage's F0
    horizon = max(first[s] + plan.span for s in range(p)) * (1 + 1e-9) + 1e-9
    model = _Model()
    columns: dict[tuple[int, Step], int] = {}
    for s in range(p):
        for kind in KINDS:
            for j in range(m):
                step = (kind, j)
                length = _duration(problem, step, s)
                pinned = kind == "F" and j == 0
                columns[(s, step)] = model.column(first[s], first[s] if pinned else horizon - length)
    objective = model.column(max(problem.busy(s) for s in range(p)), plan.span * (1 + 1e-9) + 1e-9, 1.0)

    def after(later: int, earlier: int, gap: float) -> None:
        model.row([(later, 1.0), (earlier, -1.0)], gap, float("inf"))

    for s in range(p):
        col = lambda kind, j: columns[(s, (kind, j))]  # noqa: E731 - local shorthand
        for j in range(m):
            if s > 0:
                after(col("F", j), columns[(s - 1, ("F", j))], problem.t_f[s - 1] + tc)
            after(col("B", j), col("F", j), problem.t_f[s])
            if s < p - 1:
                after(col("B", j), columns[(s + 1, ("B", j))], problem.t_b[s + 1] + tc)
            after(col("W", j), col("B", j), problem.t_b[s])
            if j > 0:
                for kind in KINDS:
                    after(col(kind, j), col(kind, j - 1), _duration(problem, (kind, j - 1), s))
        # C covers the stage span: end of its last W minus its (pinned) first F.
        model.row([(objective, 1.0), (col("W", m - 1), -1.0)], problem.t_w[s] - first[s], float("inf"))
    binaries: list[int] = []
    for s, order in enumerate(plan.orders):
        binaries += _order_rows(problem, model, columns, s, order, window, horizon)
    return model, columns, binaries, objective


def _order_rows(problem: Problem, model: _Model, columns: dict, s: int, order: list[Step], window: int,
                horizon: float) -> list[int]:
    """No-overlap and memory rows of one stage; returns its ordering binaries' columns."""
    free, fixed = _pairs(order, window)
    binary_of: dict[tuple[Step, Step], int] = {}
    for a, b in free:
        x = model.column(0.0, 1.0, integer=True)
        binary_of[(a, b)] = x
        ca, cb = columns[(s, a)], columns[(s, b)]
        # x = 1: a ends before b starts; x = 0: b ends before a starts.
        model.row([(cb, 1.0), (ca, -1.0), (x, -horizon)], _duration(problem, a, s) - horizon, float("inf"))
        model.row([(ca, 1.0), (cb, -1.0), (x, horizon)], _duration(problem, b, s), float("inf"))
    for a, b in fixed:
        model.row([(columns[(s, b)], 1.0), (columns[(s, a)], -1.0)], _duration(problem, a, s), float("inf"))
    pos = {step: i for i, step in enumerate(order)}

    def before_terms(y: Step, x: Step) -> tuple[float, list[tuple[int, float]]]:
        """[y runs before x] as constant + linear terms."""
        if (y, x) in binary_of:
            return 0.0, [(binary_of[(y, x)], 1.0)]
        if (x, y) in binary_of:
            return 1.0, [(binary_of[(x, y)], -1.0)]
        return (1.0 if pos[y] < pos[x] else 0.0), []

    mf, mw, limit = problem.m_f[s], problem.m_w[s], problem.limits[s] * (1 + 1e-9) + 1e-9
    m = problem.microbatches
    checks = [("F", i) for i in range(m)]
    if mw > mf:
        checks += [("B", j) for j in range(m)]
    for x in checks:
        # held after x = M_F * #F up to x - (M_F - M_W) * #B up to x - M_W * #W before x
        constant, terms = 0.0, []
        for kind, weight in (("F", mf), ("B", mw - mf), ("W", -mw)):
            for j in range(m):
                y = (kind, j)
                if y == x:
                    constant += weight
                    continue
                if _forced(x, y):
                    continue
                if _forced(y, x):
                    constant += weight
                    continue
                c, t = before_terms(y, x)
                constant += weight * c
                terms += [(i, weight * v) for i, v in t]
        if terms:
            model.row(terms, -float("inf"), limit - constant)
    return list(binary_of.values())


def _load(highs, model: _Model) -> None:
    import numpy as np

    n = len(model.lower)
    highs.addCols(n, np.array(model.cost), np.array(model.lower), np.array(model.upper), 0,
                  np.array([], dtype=np.int32), np.array([], dtype=np.int32), np.array([], dtype=np.float64))
    highs.addRows(len(model.row_lower), np.array(model.row_lower), np.array(model.row_upper), len(model.index),
                  np.array(model.starts, dtype=np.int32), np.array(model.index, dtype=np.int32),
                  np.array(model.value, dtype=np.float64))
    integer = [i for i, flag in enumerate(model.integer) if flag]
    if integer:
        import highspy

        kinds = np.array([highspy.HighsVarType.kInteger.value] * len(integer), dtype=np.uint8)
        highs.changeColsIntegrality(len(integer), np.array(integer, dtype=np.int32), kinds)


def _warm_start(plan: Plan, baseline, columns: dict, binaries: list[int], objective: int, n: int):
    """The heuristic as a MIP solution: its simulated start times, and every binary 1 (free pairs are
    listed in heuristic order)."""
    import highspy

    values = [0.0] * n
    for s, passes in enumerate(baseline.ranks):
        for tp in passes:
            values[columns[(s, (tp.op.op, tp.op.mb))]] = tp.start
    for x in binaries:
        values[x] = 1.0
    values[objective] = plan.span
    solution = highspy.HighsSolution()
    solution.col_value = values
    solution.value_valid = True
    return solution


def _report_progress(highs, progress: Callable[[str], None], begun: float) -> None:
    last = [begun]

    def on_interrupt(event) -> None:
        now = time.monotonic()
        if now - begun < 1.0 or now - last[0] < 1.0:
            return
        last[0] = now
        out = event.data_out
        progress(f"ILP {now - begun:.0f} s: best span {out.mip_primal_bound:.6g}, bound {out.mip_dual_bound:.6g}")

    highs.cbMipInterrupt.subscribe(on_interrupt)


def _extract(problem: Problem, plan: Plan, columns: dict, values: list[float]) -> list[list[Step]]:
    """Stage orders by ILP start time, ties broken by the heuristic's order."""
    orders = []
    for s, order in enumerate(plan.orders):
        pos = {step: i for i, step in enumerate(order)}
        orders.append(sorted(order, key=lambda step: (round(values[columns[(s, step)]], 7), pos[step])))
    return orders


def _evaluate(problem: Problem, orders: list[list[Step]]) -> float | None:
    """Longest stage span of the orders when simulated, or None if they deadlock or break the memory limit."""
    costs = _costs(problem)
    schedule = to_schedule(problem, Plan(orders, 0.0, ""), {})
    try:
        timeline = simulate(schedule, costs)
        check_memory(schedule, costs, list(problem.limits))
    except ScheduleError:
        return None
    return max(timeline.span(s) for s in range(problem.stages))
