"""Rehearsal of the real runtime at p = 4..32 against the simulator (issue: prove the speed without GPUs).

    python benchmarks/rehearsal.py [--stages 4,8,16,32] [--reps 5] [--ilp-time-limit 10] [--unit-ms 1]
    python benchmarks/rehearsal.py --post-validation-table | --dp-table

Each row runs every schedule on p local processes (gloo): the executor's own iteration loop, lowering and
transport, each F/B/W pass a wait of its planned time (see megatron/zero_bubble/tools/rehearsal.py).
Costs: the paper's profiled T_F/T_B/T_W/T_comm of one row per size, in ms (p=2 and p=4 take the 1.5B row's
costs, p=8 6.2B, p=16 14.6B, p=32 28.3B; m = 4p throughout). ZB-V gives each of its two chunks half a
rank's time, as 1F1B-I does in plan_quality.py.

Protocol: the schedules run in turn (A B C ... A B C ...), `--reps` times, so slow phases of the machine
hit all of them alike. Printed per schedule: the simulated makespan, the measured makespan's
min / median / max over the reps, ratio = median measured / simulated, the median of the latest pass
start (ms after its planned start), the spread (max - min) / median ("noisy" above 10%) and the
executor's time per pass in microseconds (median gap between two passes planned back to back). A row's
verdict: every ratio <= 1.03, and the medians rank the schedules as the simulator does (pairs whose
simulated makespans are within 1% of each other count as ties).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
for path in (HERE.parent, HERE):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from plan_quality import row_costs  # noqa: E402

from megatron.zero_bubble.tools.rehearsal import RehearsalOptions, rehearse  # noqa: E402
from megatron.zero_bubble.schedules.costs import Costs  # noqa: E402
from megatron.zero_bubble.schedules.planners import PlanRequest, plan  # noqa: E402

ROW_OF_SIZE = {2: ("1.5B", 8, 24), 4: ("1.5B", 8, 24), 8: ("6.2B", 8, 32), 16: ("14.6B", 16, 64), 32: ("28.3B", 32, 128)}
# label -> (planner name, memory limit as a multiple of p or None for the schedule's own, chunks)
SCHEDULES = {
    "1f1b": ("1f1b", None, 1),
    "zb-h1": ("zb-h1", None, 1),
    "zb-h2": ("zb-h2", None, 1),
    "zb-auto p": ("zb-auto", 1, 1),
    "zb-auto 2p": ("zb-auto", 2, 1),
    "zb-v": ("zb-v", None, 2),
}
RATIO_GOAL = 1.03
TIE = 0.01
NOISY = 0.10  # (max - min) / median above this marks a figure noisy


def build(label: str, p: int, m: int, ilp_time_limit: float):
    name, limit, chunks = SCHEDULES[label]
    model, row_p, row_m = ROW_OF_SIZE[p]
    costs = row_costs(model, row_p, row_m, chunks=chunks, stages=p)
    request = PlanRequest(stages=p, microbatches=m, costs=costs, chunks=chunks,
                          memory_limit=None if limit is None else limit * p, ilp_time_limit=ilp_time_limit)
    return plan(name, request), costs


def order_agrees(simulated: dict[str, float], measured: dict[str, float]) -> list[str]:
    """The pairs the measurement ranks against the simulator (beyond ties)."""
    wrong = []
    labels = list(simulated)
    for i, a in enumerate(labels):
        for b in labels[i + 1:]:
            if abs(simulated[a] - simulated[b]) <= TIE * max(simulated[a], simulated[b]):
                continue
            if (simulated[a] < simulated[b]) != (measured[a] < measured[b]):
                wrong.append(f"{a} vs {b}")
    return wrong


def run_row(p: int, reps: int, ilp_time_limit: float, unit_ms: float) -> bool:
    m = 4 * p
    model = ROW_OF_SIZE[p][0]
    planned = {}
    for label in SCHEDULES:
        start = time.monotonic()
        planned[label] = build(label, p, m, ilp_time_limit)
        print(f"# p={p}: planned {label} in {time.monotonic() - start:.1f} s", file=sys.stderr, flush=True)
    measured = {label: [] for label in SCHEDULES}
    lateness = {label: [] for label in SCHEDULES}
    overhead = {label: [] for label in SCHEDULES}
    simulated = {}
    options = RehearsalOptions(unit_ms=unit_ms)
    for rep in range(reps):
        for label, (schedule, costs) in planned.items():
            report = rehearse(schedule, costs, options)
            simulated[label] = report["simulated_makespan"]
            measured[label].append(report["measured_makespan"])
            lateness[label].append(report["max_pass_lateness"])
            overhead[label].append(report["executor_us_per_pass"])
        print(f"# p={p}: rep {rep + 1}/{reps} done", file=sys.stderr, flush=True)
    print(f"\np={p} m={m} ({model} row costs, ms; {reps} reps, schedules alternated)")
    print(f"{'schedule':<12}{'simulated':>11}{'min':>10}{'median':>10}{'max':>10}{'ratio':>8}{'late med':>10}"
          f"{'spread':>8}{'exec us':>9}")
    medians, within = {}, True
    for label in SCHEDULES:
        runs = measured[label]
        medians[label] = statistics.median(runs)
        ratio = medians[label] / simulated[label]
        within &= ratio <= RATIO_GOAL
        spread = (max(runs) - min(runs)) / medians[label]
        print(f"{label:<12}{simulated[label]:>11.1f}{min(runs):>10.1f}{medians[label]:>10.1f}{max(runs):>10.1f}"
              f"{ratio:>8.3f}{statistics.median(lateness[label]):>10.2f}{spread:>8.1%}"
              f"{statistics.median(overhead[label]):>9.0f}{' noisy' if spread > NOISY else ''}")
    wrong = order_agrees(simulated, medians)
    print(f"order as simulated: {'yes' if not wrong else 'NO (' + ', '.join(wrong) + ')'}; "
          f"every ratio <= {RATIO_GOAL}: {'yes' if within else 'NO'}")
    return within and not wrong


# Post-validation against the synchronous optimizer step (--post-validation-table): the p=8 row's costs
# (6.2B, see ROW_OF_SIZE) at m=24, made stage-imbalanced as embedding and loss make them (first stage +10%, last +25%); the step
# waits for a real all-reduce of every rank plus a modelled ALLREDUCE_MS (two small all-reduces over the
# pipeline, grad norm and inf check), then OPTIMIZER_MS (Adam over a stage's ~0.2B parameters).
PV_SCHEDULES = ("1f1b", "zb-h1", "zb-h2", "zb-auto")
PV_P, PV_M, PV_ITERATIONS = 8, 24, 4
IMBALANCE = {"first": 1.10, "last": 1.25}
ALLREDUCE_MS, OPTIMIZER_MS = 0.5, 3.0
PAPER_PV_GAIN = 0.08


def imbalanced_costs(p: int) -> Costs:
    base = row_costs(*ROW_OF_SIZE[p], stages=p)
    scale = [IMBALANCE["first"]] + [1.0] * (p - 2) + [IMBALANCE["last"]]
    scaled = {name: [t * k for t, k in zip(getattr(base, name), scale)] for name in ("t_f", "t_b", "t_w")}
    return Costs.make(p, **scaled, t_comm=base.t_comm, m_f=base.m_f, m_w=base.m_w, time_unit="ms")


def post_validation_table(reps: int, ilp_time_limit: float, unit_ms: float) -> None:
    costs = imbalanced_costs(PV_P)
    variants = {}
    for name in PV_SCHEDULES:
        for pv in (False, True):
            request = PlanRequest(stages=PV_P, microbatches=PV_M, costs=costs, ilp_time_limit=ilp_time_limit,
                                  memory_limit=PV_P if name == "zb-auto" else None, post_validation=pv)
            variants[(name, pv)] = plan(name, request)
    options = RehearsalOptions(unit_ms=unit_ms, iterations=PV_ITERATIONS, optimizer_step=OPTIMIZER_MS,
                               allreduce=ALLREDUCE_MS)
    times = {key: [] for key in variants}
    for rep in range(reps):
        for key, schedule in variants.items():
            times[key].append(rehearse(schedule, costs, options)["measured_time_per_iteration"])
        print(f"# post-validation: rep {rep + 1}/{reps} done", file=sys.stderr, flush=True)
    print(f"\nPost-validation vs synchronous step: p={PV_P} m={PV_M}, {PV_ITERATIONS} iterations per run, {ROW_OF_SIZE[PV_P][0]} "
          f"row costs x{IMBALANCE['first']} on the first and x{IMBALANCE['last']} on the last stage, all-reduce "
          f"{ALLREDUCE_MS} ms, optimizer step {OPTIMIZER_MS} ms; ms per iteration, {reps} reps alternated")
    print(f"{'schedule':<10}{'sync min':>10}{'median':>9}{'max':>9}{'PV min':>9}{'median':>9}{'max':>9}{'gain':>8}")
    for name in PV_SCHEDULES:
        sync, pv = times[(name, False)], times[(name, True)]
        gain = 1 - statistics.median(pv) / statistics.median(sync)
        spread = max((max(x) - min(x)) / statistics.median(x) for x in (sync, pv))
        print(f"{name:<10}{min(sync):>10.1f}{statistics.median(sync):>9.1f}{max(sync):>9.1f}{min(pv):>9.1f}"
              f"{statistics.median(pv):>9.1f}{max(pv):>9.1f}{gain:>8.1%}{' noisy' if spread > NOISY else ''}")
    print(f"(the paper reports about {PAPER_PV_GAIN:.0%} for post-validation over the synchronous step)")


# Data-parallel overlap (--dp-table): the p=8 row (6.2B, m=32) with the gradient reduction over 2 data-parallel
# replicas modelled: a stage holds about 6.2B/8 parameters, bf16 gradients of 1.55 GB, and a ring all-reduce
# over two replicas moves that much per rank, 62 ms at 25 GB/s (200 Gb/s InfiniBand). Megatron DDP's default
# buckets (40M parameters) cut a stage into about 19; we model 16 (4 layers x 4 linear weights per stage).
# megatron-core 0.19 buckets the first stage only (one bucket on the others); under a split schedule the
# runtime buckets every stage (patches/ddp_bucketing.py); both are shown for both schedules.
DP_P, DP_M, DP_REDUCE_MS, DP_BUCKETS = 8, 32, 62.0, 16
DP_SCHEDULES = {"1f1b": ("1f1b", None), "zb-auto": ("zb-auto", None)}
DP_VARIANTS = {"no overlap": dict(overlap=False),
               "overlap, first stage bucketed": dict(overlap=True, every_stage=False),
               "overlap, every stage bucketed": dict(overlap=True, every_stage=True)}


def dp_table(reps: int, ilp_time_limit: float, unit_ms: float) -> None:
    from megatron.zero_bubble.tools.rehearsal import DataParallel

    model, row_p, row_m = ROW_OF_SIZE[DP_P]
    costs = row_costs(model, row_p, row_m, stages=DP_P)
    schedules = {label: plan(name, PlanRequest(stages=DP_P, microbatches=DP_M, costs=costs, ilp_time_limit=ilp_time_limit))
                 for label, (name, _) in DP_SCHEDULES.items()}
    keys = [(label, variant) for label in schedules for variant in DP_VARIANTS]
    exposed = {key: [] for key in keys}
    iteration = {key: [] for key in keys}
    for rep in range(reps):
        for label, variant in keys:
            model_dp = DataParallel(DP_REDUCE_MS, buckets=DP_BUCKETS, layers=DP_BUCKETS, **DP_VARIANTS[variant])
            report = rehearse(schedules[label], costs, RehearsalOptions(unit_ms=unit_ms, data_parallel=model_dp))
            exposed[(label, variant)].append(report["dp_exposed"])
            iteration[(label, variant)].append(report["measured_makespan"] + report["dp_exposed"])
        print(f"# data-parallel overlap: rep {rep + 1}/{reps} done", file=sys.stderr, flush=True)
    print(f"\nData-parallel gradient reduction, p={DP_P} m={DP_M} ({model} row costs), reduction modelled at "
          f"{DP_REDUCE_MS:g} ms per stage, {DP_BUCKETS} buckets on the first stage; ms, {reps} reps alternated")
    print(f"{'schedule':<10}{'reduction':<32}{'exposed min':>12}{'median':>9}{'max':>9}{'iteration median':>18}")
    for label, variant in keys:
        runs = exposed[(label, variant)]
        spread = (max(iteration[(label, variant)]) - min(iteration[(label, variant)])) / statistics.median(
            iteration[(label, variant)])
        print(f"{label:<10}{variant:<32}{min(runs):>12.1f}{statistics.median(runs):>9.1f}{max(runs):>9.1f}"
              f"{statistics.median(iteration[(label, variant)]):>18.1f}{' noisy' if spread > NOISY else ''}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stages", default="4,8,16,32", help="pipeline sizes, comma-separated (default %(default)s)")
    parser.add_argument("--reps", type=int, default=5, help="repetitions of every schedule (default %(default)s)")
    parser.add_argument("--ilp-time-limit", type=float, default=10.0, help="seconds per zb-auto ILP (default %(default)s)")
    parser.add_argument("--unit-ms", type=float, default=1.0,
                        help="wall milliseconds per profiled millisecond (default %(default)s: real time)")
    parser.add_argument("--post-validation-table", action="store_true",
                        help="only the table of post-validation against the synchronous optimizer step")
    parser.add_argument("--dp-table", action="store_true",
                        help="only the table of the exposed data-parallel reduction with and without overlap")
    args = parser.parse_args(argv)
    if args.post_validation_table:
        post_validation_table(args.reps, args.ilp_time_limit, args.unit_ms)
        return 0
    if args.dp_table:
        dp_table(args.reps, args.ilp_time_limit, args.unit_ms)
        return 0
    sizes = [int(x) for x in args.stages.split(",")]
    for p in sizes:
        if p not in ROW_OF_SIZE:
            parser.error(f"--stages: {p} is not one of {sorted(ROW_OF_SIZE)}")
    results = {p: run_row(p, args.reps, args.ilp_time_limit, args.unit_ms) for p in sizes}
    print("\nall rows meet the goal" if all(results.values()) else
          f"\nrows missing the goal: {', '.join(f'p={p}' for p, ok in results.items() if not ok)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
