"""How long every planner takes to plan (and validate) large pipelines: wall seconds of `planners.plan`.

    python benchmarks/planning_time.py [--runs 3] [--stages 8,16,32,64] [--planners zb-auto,zb-v/2,...]
                                       [--before DIR] [--ilp-time-limit 10]

Each case is planned in a fresh process (`python planning_time.py --one NAME P M`), so one planner's caches
and memory cannot slow or speed another; the figure is the wall time of `plan(...)` in that process (import
time excluded), which includes the validator (simulation, communication lowering and its deadlock check), as
every caller pays it. m = 8p, the paper's 28.3B row costs (T_F 10.4, T_B 10.25, T_W 7.7 ms per rank, T_comm
0.46 ms), spread evenly over the p ranks and over a rank's chunks (each chunk 1/v of the times, the full
T_comm). Planner names: `zb-auto` (one chunk), `zb-auto/v` (v chunks, interleaved), `zb-v`, `zb-v@1.5p`
(ZB-V's planner at a budget of 1.5p M_B), `v-half`, `v-min`. `--before DIR` also times an older checkout of
the repository (DIR holds its `megatron/zero_bubble`), alternating old and new run by run, and prints both
with their ratio of medians.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
DEFAULT_PLANNERS = ("zb-auto", "zb-auto/2", "zb-auto/4", "zb-auto/8", "zb-v", "zb-v@1.5p", "v-half", "v-min")
GOALS_S = {32: 3.0, 64: 10.0}  # issue 22: p=32, m=256 within 3 s; p=64, m=512 within 10 s


def _use_source(source: str | None) -> None:
    """Import megatron.zero_bubble from `source` (an older checkout) instead of the installed one."""
    if source is None:
        return
    sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in type(f).__module__.lower()
                        and "editable" not in getattr(f, "__name__", "").lower()]
    sys.path.insert(0, source)


def plan_once(name: str, stages: int, microbatches: int, ilp_time_limit: float) -> dict:
    """Plan one case in this process; returns the seconds and what the plan predicts (and which code planned)."""
    from megatron.zero_bubble.schedules.planners import PlanRequest, plan  # first: from --source, if given

    sys.path.append(str(HERE))  # after --source: plan_quality's own imports find the modules already loaded
    from plan_quality import row_costs

    base, _, budget = name.partition("@")
    base, _, chunks_text = base.partition("/")
    chunks = int(chunks_text) if chunks_text else (2 if base in ("zb-v", "v-half", "v-min") else 1)
    costs = row_costs("28.3B", 32, 256, chunks=chunks, stages=stages)
    limit = float(budget[:-1]) * stages if budget.endswith("p") else (float(budget) if budget else None)
    request = PlanRequest(stages, microbatches, costs, chunks=None if chunks == 1 else chunks,
                          memory_limit=limit, ilp_time_limit=ilp_time_limit)
    started, cpu = time.perf_counter(), time.process_time()
    schedule = plan(base, request)
    seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
    note = schedule.info.get("planner", {}).get("ilp", "") if isinstance(schedule.info.get("planner"), dict) else ""
    import megatron.zero_bubble.schedules as planning

    return {"code": planning.__file__, "seconds": seconds, "cpu": cpu,
            "bubble_rate": schedule.info["predicted"]["bubble_rate"],
            "peak": max(schedule.info["predicted"]["peak_memory"]), "ilp": note}


def _run(name: str, p: int, m: int, ilp: float, source: str | None, timeout: float) -> dict | None:
    command = [sys.executable, __file__, "--one", name, str(p), str(m), "--ilp-time-limit", str(ilp)]
    if source:
        command += ["--source", source]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return {"seconds": float("inf"), "error": f"over {timeout:g} s"}
    if done.returncode:
        return {"seconds": float("nan"), "error": (done.stderr.strip().splitlines() or ["?"])[-1]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def _spread(values: list[float]) -> str:
    if any(v != v for v in values):
        return "failed"
    return f"{statistics.median(values):7.2f} ({min(values):.2f}-{max(values):.2f})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--one", nargs=3, metavar=("NAME", "P", "M"), help=argparse.SUPPRESS)
    parser.add_argument("--source", help=argparse.SUPPRESS)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--stages", default="8,16,32,64")
    parser.add_argument("--planners", default=",".join(DEFAULT_PLANNERS))
    parser.add_argument("--ilp-time-limit", type=float, default=10.0)
    parser.add_argument("--before", help="an older checkout to time as well, alternating with this one")
    parser.add_argument("--before-only", action="store_true", help="with --before: time only the older checkout")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds before a run counts as failed")
    args = parser.parse_args(argv)
    if args.one:
        _use_source(args.source)
        name, p, m = args.one
        print(json.dumps(plan_once(name, int(p), int(m), args.ilp_time_limit)))
        return 0
    sources = [("now", None)] + ([("before", os.path.abspath(args.before))] if args.before else [])
    if args.before_only:
        sources = sources[1:]
    print(f"planning time of planners.plan (validation included): CPU seconds and wall seconds, median (min-max) "
          f"of {args.runs} runs, each in its own process; m = 8p, 28.3B row costs, ILP limit "
          f"{args.ilp_time_limit:g} s; {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f} at start. On a shared "
          f"machine the CPU time is what planning costs; the wall time adds whatever else runs meanwhile.")
    header = f"{'planner':>11} {'p':>3} {'m':>4}  " + "  ".join(
        f"{label + ' CPU s':>22} {label + ' wall s':>22}" for label, _ in sources)
    print(header + ("  ratio" if len(sources) == 2 else "") + "  bubble   peak  goal (CPU)")
    for name in [n.strip() for n in args.planners.split(",") if n.strip()]:
        for p in [int(x) for x in args.stages.split(",")]:
            m = 8 * p
            runs = {label: [] for label, _ in sources}
            for _ in range(args.runs):
                for label, source in sources:  # alternate: now, before, now, before ...
                    runs[label].append(_run(name, p, m, args.ilp_time_limit, source, args.timeout))
            cells, cpu = [], {}
            for label, _ in sources:
                cpu[label] = [r.get("cpu", float("nan")) for r in runs[label]]
                cells.append(f"{_spread(cpu[label]):>22} {_spread([r['seconds'] for r in runs[label]]):>22}")
            ratio = ""
            if len(sources) == 2:
                ratio = f"  {statistics.median(cpu['before']) / statistics.median(cpu['now']):5.1f}x"
            label = sources[0][0]
            last, goal = runs[label][-1], GOALS_S.get(p)
            verdict = "" if goal is None else ("met" if statistics.median(cpu[label]) <= goal else "MISSED")
            extra = (f"  {last['bubble_rate']:.4f} {last['peak']:6.3g}  {verdict}" if "error" not in last
                     else f"  {last['error']}")
            print(f"{name:>11} {p:>3} {m:>4}  {'  '.join(cells)}{ratio}{extra}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
