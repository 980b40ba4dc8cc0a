"""The executor's own time per pass, rehearsed, in this checkout and in an earlier one, alternated.

    python benchmarks/executor_overhead.py --before DIR [--stages 2,8] [--reps 5] [--unit-ms 4]

DIR is another checkout of this repository (e.g. `git worktree add /tmp/before <commit>`). Each repetition runs, in
turn, `zb-schedule rehearse` of zb-h1 from DIR ("before"), from this checkout with the messages on the stand-in of
NCCL's in-order streams ("after", the rehearsal's default) and from this checkout with gloo's own operations
("after, gloo p2p"): p local processes, each pass a wait of its planned time (the paper's 1.5B costs at p=2, 6.2B at
p=8; m = 4p), time dilated by --unit-ms (wall ms per ms of cost). Printed per variant: the executor's time per pass
(median gap between two passes planned back to back, microseconds) and the makespan measured over simulated,
min / median / max over the repetitions, and the ratio of medians against "before".
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
COSTS = {2: dict(t_f=18.5, t_b=18.1, t_w=9.3, t_comm=0.7), 8: dict(t_f=29.8, t_b=29.5, t_w=19.6, t_comm=0.55)}


def rehearse(checkout: Path, p: int, unit_ms: float, gloo: bool) -> dict:
    costs = COSTS.get(p, COSTS[8])
    command = [sys.executable, "-m", "megatron.zero_bubble.cli", "rehearse", "--schedule", "zb-h1", "--stages", str(p),
               "--microbatches", str(4 * p), *[x for k, v in costs.items() for x in (f"--{k.replace('_', '-')}", str(v))],
               "--time-unit-ms", str(unit_ms)] + (["--gloo-p2p"] if gloo else [])
    env = dict(os.environ, PYTHONPATH=str(checkout), OMP_NUM_THREADS="1")
    done = subprocess.run(command, cwd=checkout, env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode:
        raise RuntimeError(f"{checkout}: rehearse failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.splitlines()[-1])


def spread(values: list[float]) -> str:
    return f"{min(values):.1f} / {statistics.median(values):.1f} / {max(values):.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", required=True, type=Path, help="the earlier checkout")
    parser.add_argument("--stages", default="2,8")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--unit-ms", type=float, default=4.0)
    args = parser.parse_args()
    variants = {"before": (args.before, False), "after": (HERE, False), "after, gloo p2p": (HERE, True)}
    for p in (int(x) for x in args.stages.split(",")):
        per_pass = {name: [] for name in variants}
        ratio = {name: [] for name in variants}
        for rep in range(args.reps):
            for name, (checkout, gloo) in variants.items():
                report = rehearse(checkout, p, args.unit_ms, gloo)
                per_pass[name].append(report["executor_us_per_pass"])
                ratio[name].append(report["measured_makespan"] / report["simulated_makespan"])
            print(f"# p={p}: rep {rep + 1}/{args.reps}", file=sys.stderr, flush=True)
        base = statistics.median(per_pass["before"])
        print(f"\nzb-h1, p={p}, m={4 * p}, --time-unit-ms {args.unit_ms:g}, {args.reps} reps alternated")
        print(f"{'variant':<16}{'executor us per pass min / median / max':>42}{'vs before':>11}"
              f"{'measured / simulated (median)':>31}")
        for name in variants:
            print(f"{name:<16}{spread(per_pass[name]):>42}{statistics.median(per_pass[name]) / base:>11.2f}"
                  f"{statistics.median(ratio[name]):>31.3f}")


if __name__ == "__main__":
    main()
