"""The demo's speed part: megatron's 1F1B against zb-h1, zb-auto and zb-v at PP=2, each rank on a core of its own.

    python scripts/demo_speed.py [--reps 5] [--iterations 10] [--out DIR]

Runs pretrain_gpt.py (2 ranks, gloo, one thread each) under each schedule in turn (A B C D A B C D ...),
`--reps` times each, on a GPT big enough that compute outweighs the runtime's own work (hidden 256, 4 layers,
sequence 256, m = 8 microbatches). Per run it takes the median of megatron's "elapsed time per iteration (ms)" over
the iterations after the first two; it prints min / median / max over the runs, the ratio of the medians to
1F1B's, and the bubble the simulator plans for each on the pass times its first run measured (1F1B on zb-h1's).
Exits 0 whatever the figures (on a busy machine they are noisy: the spread says how much).
"""
from __future__ import annotations

import argparse
import glob
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from megatron.zero_bubble.tools.local_ranks import TORCHRUN_ONE_MACHINE  # noqa: E402
ITERATION_MS = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?elapsed time per iteration \(ms\): ([0-9.]+)")
MODEL = ("--zero-bubble-cpu --pipeline-model-parallel-size 2 --num-layers 4 --hidden-size 256 --num-attention-heads 4 "
         "--seq-length 256 --max-position-embeddings 256 --micro-batch-size 2 --global-batch-size 16 --vocab-size 512 "
         "--tokenizer-type NullTokenizer --mock-data --num-workers 0 --lr 1e-4 --eval-iters 0 --log-interval 1 "
         "--seed 1234 --hidden-dropout 0 --attention-dropout 0").split()
NO_CHECK = ["--no-zero-bubble-split-check"]  # the start-up split check is not part of an iteration's time
VARIANTS = {"megatron 1f1b": [], "zb-h1": ["--pipeline-schedule", "zb-h1", *NO_CHECK],
            "zb-auto": ["--pipeline-schedule", "zb-auto", "--zero-bubble-ilp-time-limit", "2", *NO_CHECK],
            "zb-v": ["--pipeline-schedule", "zb-v", *NO_CHECK]}


def run(flags: list[str], iterations: int, dump: str | None) -> float:
    """Median ms per iteration of one launch (iterations 3 and on)."""
    extra = ["--zero-bubble-pipeline-timers-start-iter", "2", "--zero-bubble-pipeline-timers-end-iter", "4",
             "--zero-bubble-dump-schedule", dump] if dump and flags else []
    command = [sys.executable, "-m", "torch.distributed.run", *TORCHRUN_ONE_MACHINE, "--nproc-per-node", "2",
               "pretrain_gpt.py", *MODEL, "--train-iters", str(iterations), "--eval-interval", str(iterations + 1),
               *flags, *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode:
        sys.exit(f"demo_speed: a run failed (exit {done.returncode}):\n{done.stderr[-2000:]}")
    times = [float(ms) for it, ms in ITERATION_MS.findall(done.stdout) if int(it) > 2]
    return statistics.median(times)


def planned_bubbles(dump: str) -> dict[str, float]:
    """Each zero-bubble schedule simulated on the costs its run measured (its re-planned dump); megatron's 1F1B on
    zb-h1's."""
    from megatron.zero_bubble.schedules import Costs, Schedule, validate
    from megatron.zero_bubble.schedules.planners import PlanRequest, plan

    bubbles = {}
    for name in VARIANTS:
        paths = sorted(p for p in glob.glob(os.path.join(dump, f"{name}-m*-iter*.json"))
                       if not p.endswith(".trace.json"))
        if paths:
            measured = Schedule.from_json(Path(paths[-1]).read_text())
            costs = Costs.from_dict(measured.info["costs"])
            bubbles[name] = validate(measured, costs).bubble_rate
            if name == "zb-h1":
                one_f_one_b = plan("1f1b", PlanRequest(2, measured.microbatches, costs=costs))
                bubbles["megatron 1f1b"] = validate(one_f_one_b, costs).bubble_rate
    return bubbles


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--out", default="out/demo")
    args = parser.parse_args()
    dump = os.path.join(args.out, "speed-schedules")
    times = {name: [] for name in VARIANTS}
    for rep in range(args.reps):
        for name, flags in VARIANTS.items():
            times[name].append(run(flags, args.iterations, dump if rep == 0 else None))
        print(f"  round {rep + 1}/{args.reps}: " + ", ".join(f"{n} {t[-1]:.0f} ms" for n, t in times.items()),
              flush=True)
    planned = planned_bubbles(dump)
    base = statistics.median(times["megatron 1f1b"])
    print(f"\n{'schedule':<15}{'ms/iteration min / median / max':>33}{'vs 1f1b':>9}{'planned bubble':>16}")
    for name, runs in times.items():
        bubble = f"{planned[name]:.1%}" if name in planned else "-"
        print(f"{name:<15}{min(runs):>15.0f} / {statistics.median(runs):.0f} / {max(runs):.0f}"
              f"{statistics.median(runs) / base:>9.2f}{bubble:>16}")
    spread = max((max(r) - min(r)) / statistics.median(r) for r in times.values())
    print(f"(PP=2, one core per rank, {args.reps} runs of each alternated, medians of iterations 3-{args.iterations}; "
          f"largest spread {spread:.0%}{': noisy, the machine is busy' if spread > 0.1 else ''})")


if __name__ == "__main__":
    main()
