"""The V family against 1F1B and the reference implementation's V-Half / V-Min (benchmarks/plan_quality.py
prints these tables after the paper's; `python benchmarks/plan_quality.py --v-only` prints only them).

Costs as in issue 12: T_F, T_B, T_W and T_comm per full pipeline stage; a V rank holds two chunks, each
with half of its rank's T_F/T_B/T_W (T_comm stays), M_B = 1 per rank, M_W = M_B / 2. Bubble rates are
the paper's measure (each rank from its own first to its own last pass). The reference figures were
simulated by an independent simulator at the same peaks: V-Half (p+2)/2 M_B, V-Min floor((p+4)/3) M_B.
"""
from __future__ import annotations

import os
import statistics
import time

from megatron.zero_bubble.schedules import Costs, ScheduleError, simulate
from megatron.zero_bubble.schedules.planners import PlanRequest, plan
from megatron.zero_bubble.schedules.vbudget import budget_curve, mem_setup_limit

ROUNDING = 5e-5  # the reference figures have four decimals
COST_SETS = {"unit": (1.0, 1.0, 1.0, 0.0), "1.5B": (18.5, 18.1, 9.3, 0.7)}
# (p, m, cost set): 1F1B, reference V-Half, reference V-Min, from the issue
REFERENCE = [
    (8, 16, "unit", 0.3043, 0.1504, 0.2195), (8, 16, "1.5B", 0.3223, 0.2392, 0.3879),
    (8, 32, "unit", 0.1795, 0.0813, 0.1233), (8, 32, "1.5B", 0.2007, 0.1358, 0.3148),
    (16, 32, "unit", 0.3191, 0.1760, 0.2351), (16, 32, "1.5B", 0.3381, 0.2644, 0.4045),
    (16, 64, "unit", 0.1899, 0.0965, 0.1332), (16, 64, "1.5B", 0.2124, 0.1523, 0.3274),
    (32, 64, "unit", 0.3263, 0.1882, 0.2426), (32, 64, "1.5B", 0.3456, 0.2751, 0.4126),
    (32, 128, "unit", 0.1950, 0.1039, 0.1380), (32, 128, "1.5B", 0.2181, 0.1595, 0.3334),
]
# Other cost sets of the paper's models (per rank, ms): the ZB-V rows' profiled costs, and the 6.2B/14.6B
# rows of its main table; no reference figures exist for them, so they are compared with 1F1B.
OTHER_SETS = [
    ("6.2B ZB-V row", 16, 48, (14.407, 14.380, 9.676, 1.610)),
    ("14.6B ZB-V row", 24, 96, (6.783, 6.984, 5.259, 0.758)),
    ("28.3B ZB-V row", 32, 128, (9.469, 9.744, 7.306, 0.892)),
    ("6.2B", 8, 32, (29.802, 29.428, 19.530, 0.577)),
    ("14.6B", 16, 64, (11.307, 11.254, 8.101, 0.379)),
]
UNIT_GOALS = {"v-half": 0.55, "v-min": 0.72}  # at m = 4p with unit costs, at most this share of 1F1B's bubble
TIMING_GOAL_S = 10.0


def v_costs(p: int, times) -> Costs:
    t_f, t_b, t_w, t_comm = times
    return Costs.make(2 * p, t_f / 2, t_b / 2, t_w / 2, t_comm, chunks=2, time_unit="ms")


def one_f_one_b(p: int, m: int, times) -> float:
    costs = Costs.make(p, *times[:3], times[3], time_unit="ms")
    return simulate(plan("1f1b", PlanRequest(p, m, costs)), costs).bubble_rate


def planned(name: str, p: int, m: int, costs: Costs, memory_limit: float | None = None):
    """(bubble rate, peak memory in M_B, planning seconds of wall time, of CPU time) of a V plan; its default
    budget unless given. CPU time is what planning costs; wall time also counts whatever else this machine
    runs meanwhile."""
    started, cpu = time.perf_counter(), time.process_time()
    schedule = plan(name, PlanRequest(p, m, costs, memory_limit=memory_limit))
    seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
    timeline = simulate(schedule, costs)
    return timeline.bubble_rate, max(timeline.peak_memory), seconds, cpu


def _r(x: float) -> str:
    return f"{x:.4f}"


def reference_table(errors: list[str], goals: list[tuple[str, bool]]) -> None:
    print("\nV-Half and V-Min against the reference implementation (issue 12's table), same peak memory;")
    print("ratio = bubble / 1F1B's bubble; plan s = planning time (CPU, validation included)")
    print(f"{'p':>3} {'m':>4} {'costs':>5}  {'1F1B':>6}  {'ref V-Half':>10} {'ours':>6} {'ratio':>5} {'peak':>4} "
          f"{'plan s':>6}  {'ref V-Min':>9} {'ours':>6} {'ratio':>5} {'peak':>4} {'plan s':>6}")
    for p, m, cost_set, base, ref_half, ref_min in REFERENCE:
        costs = v_costs(p, COST_SETS[cost_set])
        line = f"{p:>3} {m:>4} {cost_set:>5}  {_r(base):>6}"
        for name, ref in (("v-half", ref_half), ("v-min", ref_min)):
            label = f"{name} p={p} m={m} {cost_set}"
            try:
                bubble, peak, _, seconds = planned(name, p, m, costs)
            except ScheduleError as e:
                errors.append(f"{label}: {e}")
                line += f"  {_r(ref):>10} {'n/a':>6}" if name == "v-half" else f"  {_r(ref):>9} {'n/a':>6}"
                continue
            width = 10 if name == "v-half" else 9
            line += f"  {_r(ref):>{width}} {_r(bubble):>6} {bubble / base:>5.2f} {peak:>4g} {seconds:>6.1f}"
            goals.append((f"{label}: {bubble:.4f} <= reference {ref:.4f}", bubble <= ref + ROUNDING))
            if cost_set == "unit" and m == 4 * p:
                share = UNIT_GOALS[name]
                goals.append((f"{label}: {bubble / base:.2f} of 1F1B's bubble <= {share}", bubble <= share * base))
            if cost_set != "unit" and name == "v-min":
                goals.append((f"stretch: {label} no worse than 1F1B ({bubble:.4f} vs {base:.4f})", bubble <= base))
        print(line, flush=True)


def other_cost_sets(errors: list[str], goals: list[tuple[str, bool]]) -> None:
    print("\nV family on other cost sets of the paper's models (T_F/T_B/T_W/T_comm per rank as listed in "
          "paper-facts.md, each V chunk half of it, ms): bubble, ratio to 1F1B")
    print(f"{'costs':>15} {'p':>3} {'m':>4}  {'1F1B':>6}  {'V-Min':>12}  {'V-Half':>12}  {'ZB-V':>12}")
    for label, p, m, times in OTHER_SETS:
        base = one_f_one_b(p, m, times)
        costs = v_costs(p, times)
        cells = []
        for name in ("v-min", "v-half", "zb-v"):
            try:
                bubble = planned(name, p, m, costs)[0]
                cells.append(f"{_r(bubble)} {bubble / base:.2f}x")
            except ScheduleError as e:
                errors.append(f"{label} {name}: {e}")
                cells.append("n/a")
        print(f"{label:>15} {p:>3} {m:>4}  {_r(base):>6}  " + "  ".join(f"{c:>12}" for c in cells), flush=True)


def budget_monotonicity(goals: list[tuple[str, bool]]) -> None:
    print("\nThe budgeted V planner (zb-v with --memory-limit): best bubble per budget, V-Min's to p M_B")
    for p, m, cost_set in ((8, 32, "unit"), (8, 32, "1.5B"), (16, 64, "1.5B")):
        costs = v_costs(p, COST_SETS[cost_set])
        curve = budget_curve(p, m, costs)
        print(f"  p={p} m={m} {cost_set}: " + ", ".join(f"{level:g} M_B {bubble:.4f}" for level, _, bubble in curve))
        bubbles = [bubble for _, _, bubble in curve]
        goals.append((f"budgeted V p={p} m={m} {cost_set}: bubble never rises with the budget",
                      all(b <= a + 1e-12 for a, b in zip(bubbles, bubbles[1:]))))
        zbv = planned("zb-v", p, m, costs)[0]
        at_p = planned("zb-v", p, m, costs, memory_limit=mem_setup_limit("zb", p))[0]
        goals.append((f"budgeted V p={p} m={m} {cost_set}: {at_p:.4f} at p M_B equals ZB-V's {zbv:.4f}",
                      abs(at_p - zbv) < 1e-12 and abs(bubbles[-1] - zbv) < 1e-12))


def planning_times(goals: list[tuple[str, bool]], runs: int = 3) -> None:
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"\nPlanning time at p=32, m=128 ({runs} runs: min / median / max), validation included; "
          f"load average {load:.1f} on {os.cpu_count()} cores at the start:")
    for cost_set in COST_SETS:
        costs = v_costs(32, COST_SETS[cost_set])
        for name in ("v-min", "v-half", "zb-v"):
            times = [planned(name, 32, 128, costs)[2:] for _ in range(runs)]
            wall, cpu = sorted(t[0] for t in times), sorted(t[1] for t in times)
            print(f"  {name:>6} {cost_set:>5}: CPU {cpu[0]:.2f} / {statistics.median(cpu):.2f} / {cpu[-1]:.2f} s, "
                  f"wall {wall[0]:.2f} / {statistics.median(wall):.2f} / {wall[-1]:.2f} s", flush=True)
            mid = statistics.median(cpu)
            goals.append((f"{name} p=32 m=128 {cost_set} plans in {mid:.1f} s of CPU (median) < {TIMING_GOAL_S:g} s",
                          mid < TIMING_GOAL_S))


def v_tables(errors: list[str], goals: list[tuple[str, bool]], timing_runs: int = 3) -> None:
    reference_table(errors, goals)
    other_cost_sets(errors, goals)
    budget_monotonicity(goals)
    if timing_runs:
        planning_times(goals, timing_runs)
