"""The `zb-schedule` command: plan, simulate, draw, export and compare schedules, rehearse a plan on local processes,
and advise a schedule for a pretrain_gpt.py command line (commands/, advise/cli.py).

    zb-schedule compare  --schedules 1f1b,zb-h1,zb-h2,zb-auto,zb-v --stages 8 --microbatches 24 --model 1.5b
    zb-schedule rehearse --schedule zb-h1 --stages 8 --microbatches 32 --t-f 18.5 --t-b 18.1 --t-w 9.3 --t-comm 0.7
    zb-schedule advise   --nodes 8 -- <pretrain_gpt.py arguments>
"""
from __future__ import annotations

import sys

from .advise.cli import add_advise
from .commands import planning
from .commands.rehearse import add_rehearse


def main(argv: list[str] | None = None) -> int:
    return planning.main(argv, extensions=(add_rehearse, add_advise))


if __name__ == "__main__":
    sys.exit(main())
