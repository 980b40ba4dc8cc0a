"""How often a pretrain_gpt.py process fails to end cleanly: megatron's ending against pretrain_gpt.py's, alternated.

    python benchmarks/clean_exit.py [--runs 40] [--lagging-gloo-worker] [--schedules 1f1b,zb-h1] [--logs DIR]

Each run is one `torchrun --nproc-per-node 4 pretrain_gpt.py ...` of the GPT-3-shaped CPU command line in
tests/megatron/exits.py (fp16, loss scale, clipping at 1.0, cosine decay, PP=4, an evaluation, --save), run to its
end. Two endings, alternated run by run (A B A B ...), the schedules taking turns within each:
- megatron: main() alone, the interpreter ending with the process groups alive (megatron's scripts; pretrain_gpt.py
  before training/teardown.py);
- pretrain_gpt.py: as shipped, every process group destroyed before the interpreter ends.
A run fails when torchrun's exit status is not 0 or a rank aborted ("terminate called", SIGABRT). Printed: a line per
run, then per ending the failures out of the runs and the 95% upper bound on the failure rate (Clopper-Pearson).
With --lagging-gloo-worker, benchmarks/lagging_gloo_worker/ is preloaded into every rank: the gloo worker of each
rank's last collective lags until the interpreter is about to finalize, which a loaded machine does only now and then.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.megatron import exits  # noqa: E402  (the command line, the launch, the fault injection)

ENDINGS = ("megatron", "pretrain_gpt.py")


def upper_bound(failures: int, runs: int, confidence: float = 0.95) -> float:
    """Clopper-Pearson: the failure rate above which `failures` or fewer in `runs` has probability < 1 - confidence."""
    if failures >= runs:
        return 1.0

    def at_most(rate: float) -> float:
        return sum(math.comb(runs, k) * rate ** k * (1 - rate) ** (runs - k) for k in range(failures + 1))

    low, high = failures / runs, 1.0
    for _ in range(60):
        middle = (low + high) / 2
        low, high = (middle, high) if at_most(middle) > 1 - confidence else (low, middle)
    return high


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=40, help="runs of each ending")
    parser.add_argument("--schedules", default="1f1b,zb-h1", help=f"taking turns; of {sorted(exits.SCHEDULES)}")
    parser.add_argument("--lagging-gloo-worker", action="store_true", help="inject the lagging gloo worker")
    parser.add_argument("--logs", help="keep the output of every failed run here")
    args = parser.parse_args(argv)
    schedules = args.schedules.split(",")
    work = tempfile.mkdtemp(prefix="clean_exit.")
    library = exits.build_lagging_worker(work) if args.lagging_gloo_worker else None
    if args.lagging_gloo_worker and library is None:
        parser.error("--lagging-gloo-worker needs a C compiler on Linux (cc or gcc)")
    if args.logs:
        os.makedirs(args.logs, exist_ok=True)
    condition = "with the lagging gloo worker injected" if library else "as launched"
    print(f"== {args.runs} runs of each ending, alternated, {condition}; schedules {', '.join(schedules)} ==",
          flush=True)
    failures = {ending: [] for ending in ENDINGS}
    seconds = {ending: [] for ending in ENDINGS}
    for run in range(args.runs):
        schedule = schedules[run % len(schedules)]
        for ending in ENDINGS:
            launch = exits.launch(work, schedule, ending=ending, lagging_worker=library)
            seconds[ending].append(launch.seconds)
            if not launch.clean:
                failures[ending].append(run)
                if args.logs:
                    name = f"{run:03d}-{ending.replace('.', '_')}-{schedule}.log"
                    Path(args.logs, name).write_text(launch.output)
            print(f"run {run + 1:3d} {ending:16s} {schedule:6s} {launch.seconds:6.1f} s  "
                  f"{'clean' if launch.clean else 'FAILED: ' + launch.summary()}", flush=True)
    print(f"\n== {condition}: failures out of {args.runs} runs of each ending ==")
    for ending in ENDINGS:
        count = len(failures[ending])
        times = sorted(seconds[ending])
        print(f"{ending:16s} {count:3d} / {args.runs}  (rate {count / args.runs:.1%}, 95% upper bound "
              f"{upper_bound(count, args.runs):.1%}; seconds per run min {times[0]:.0f} median "
              f"{times[len(times) // 2]:.0f} max {times[-1]:.0f})")
    return 0


if __name__ == "__main__":
    started = time.monotonic()
    status = main()
    print(f"({time.monotonic() - started:.0f} s in all)")
    sys.exit(status)
