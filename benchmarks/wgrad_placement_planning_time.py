"""Planning time with the placements of W weighed (the output layer's and the row-parallel layers', each deferred or
in B: PlanRequest head_wgrad / rows_wgrad "auto") against all W deferred, from the model shape of a Llama-like
4096-wide model with 4 layers per rank; alternated, 5 repetitions each, min / median / max and the ratio of medians.

    python benchmarks/wgrad_placement_planning_time.py
"""
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
from megatron.zero_bubble.schedules.costs import Costs  # noqa: E402
from megatron.zero_bubble.schedules.planners import plan  # noqa: E402
from megatron.zero_bubble.schedules.problem import PlanRequest  # noqa: E402


def costs(p, chunks):
    return Costs.from_model(layers=4 * p, hidden=4096, heads=32, seq_length=4096, micro_batch=1, vocab=128256,
                            num_virtual_stages=chunks * p, time_unit="ms")


# (planner, p, m, chunks, memory limit, ILP seconds)
CASES = [("zb-v", 8, 64, 2, None, 0), ("zb-v", 32, 128, 2, None, 0), ("zb-auto", 8, 32, 1, 4, 10)]


def main() -> None:
    for name, p, m, chunks, limit, ilp in CASES:
        c = costs(p, chunks)
        times = {"deferred": [], "auto": []}
        for rep in range(5):
            for mode in ("deferred", "auto"):  # A B A B ...
                t = time.perf_counter()
                plan(name, PlanRequest(stages=p, microbatches=m, costs=c, memory_limit=limit, ilp_time_limit=ilp,
                                       head_wgrad=mode, rows_wgrad=mode))
                times[mode].append(time.perf_counter() - t)
        d, a = (statistics.median(times[k]) for k in ("deferred", "auto"))
        print(f"{name} p={p} m={m}" + (f" limit {limit} ILP {ilp} s" if ilp else "") + ": " +
              "; ".join(f"{k} min/median/max {min(v):.2f}/{statistics.median(v):.2f}/{max(v):.2f} s"
                        for k, v in times.items()) + f"; ratio of medians {a / d:.2f}")


if __name__ == "__main__":
    main()
