"""Stopping a run at start-up: one line on rank 0, exit status 2, no traceback (`refuse`)."""
from __future__ import annotations

import os
import signal
import sys
import time
from typing import NoReturn

EXIT_REFUSED = 2
# A rank other than 0 that refuses waits this long for the launcher to stop it (see `refuse`).
REFUSAL_WAIT_S = 60.0


def refuse(message: str) -> NoReturn:
    """Print one line (once, on global rank 0) and stop before any training, with exit status 2.

    Every rank runs the same checks on the same command line and reaches the same refusal. Rank 0 prints and
    exits; the others wait quietly for the launcher to stop them (torchrun terminates the remaining ranks as
    soon as one exits non-zero, so a rank that exited first would have rank 0 killed before it printed) and
    then exit with the same status. A rank still running after REFUSAL_WAIT_S (rank 0 did not refuse: a
    directory only this node cannot write, say) prints the line itself, naming its rank.
    """
    rank = int(os.environ.get("RANK", "0"))
    if rank == 0:
        print(f"{program()}: error: {message}", file=sys.stderr, flush=True)
        raise SystemExit(EXIT_REFUSED)

    def stopped(signum, frame):
        raise SystemExit(EXIT_REFUSED)

    try:
        signal.signal(signal.SIGTERM, stopped)
    except ValueError:  # not the main thread: the default (terminated by the signal) is as quiet
        pass
    time.sleep(REFUSAL_WAIT_S)
    print(f"{program()}: error: {message} (rank {rank})", file=sys.stderr, flush=True)
    raise SystemExit(EXIT_REFUSED)


def program() -> str:
    """The entry script's name as argparse prints it (pretrain_gpt.py, pretrain_hybrid.py)."""
    return os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "pretrain_gpt.py"
