"""`zb-schedule advise`'s predicted peak memory per pipeline rank against what pretrain_gpt.py's memory report measures.

    python benchmarks/advise_memory.py [--lines llama3-8b,gpt3-175b,mixtral-8x7b,deepseek-moe]

Each line is a tiny CPU version of one of Megatron-LM's example command lines (tests/advise_lines.py), trained under
torchrun with the processes it names; its memory report gives each pipeline rank's model state and its peak with the
activations (the largest over data-parallel replicas). `zb-schedule advise --json` on the same command line predicts
both. Printed: a row per line, MiB per pipeline rank as measured / predicted, and the error of the peak; the exit status
is 1 if any rank's peak is off by more than 10% (the goal docs/advise.md states). The suite checks one line
(tests/megatron/test_advise_measured.py); this measures all four.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.advise_lines import TINY  # noqa: E402
from tests.megatron.advise_measure import MIB, TOLERANCE, measure  # noqa: E402


def _mib(values) -> str:
    return ", ".join(f"{value / MIB:.1f}" for value in values)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lines", default=",".join(TINY), help=f"of {', '.join(TINY)}")
    args = parser.parse_args(argv)
    worst = 0.0
    print("line (processes, schedule) | model state measured / predicted | peak measured / predicted | error of the "
          "peak")
    for name in args.lines.split(","):
        started = time.monotonic()
        result = measure(name)
        errors = [(p - m) / m for p, m in zip(result.predicted_peak, result.peak)]
        worst = max([worst, *map(abs, errors)])
        print(f"{name} ({result.processes}, {result.schedule}) | {_mib(result.state)} / {_mib(result.predicted_state)}"
              f" | {_mib(result.peak)} / {_mib(result.predicted_peak)} | {', '.join(f'{e:+.1%}' for e in errors)}"
              f"  ({time.monotonic() - started:.0f} s)", flush=True)
    print(f"largest error of a peak: {worst:.1%} (goal: within {TOLERANCE:.0%})")
    return 0 if worst <= TOLERANCE else 1


if __name__ == "__main__":
    sys.exit(main())
