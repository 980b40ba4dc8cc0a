"""The pipeline watchdog: a rank that waits for a message too long says where the pipeline stands, and the job ends.

NCCL's own watchdog ends a hung job after many minutes (megatron's default: 10) with nothing about where the
pipeline stood. This one looks, from a thread of its own, at the rank's transport (p2p.PipelineTransport): the
operation the rank is blocked on, or, where the backend reports completion (NCCL, whose works the rank does not block
on), the oldest operation posted and not completed. When it has waited longer than `timeout_s`, the watchdog prints
one line, in the schedule's terms: the message, the peer, the pass that needs it, and the head of what is in flight
on each link. It then tells the other ranks through the job's store, so that each prints its own line too, and ends
the process with EXIT_STUCK. A rank that is told while it waits for no message says so in its line.
"""
from __future__ import annotations

import os
import sys
import threading
import time
from typing import Callable

EXIT_STUCK = 3
STORE_KEY = "zero_bubble/watchdog"
GRACE_S = 3.0  # how long the first rank to report waits for the others' lines before it ends


class PipelineWatchdog:
    """One per rank. `watch(transport, needed_by)` for the duration of an iteration (`None` after it)."""

    def __init__(self, timeout_s: float, rank: int, pp_rank: int, store=None, log: Callable[[str], None] | None = None,
                 end: Callable[[int], None] = os._exit, clock: Callable[[], float] = time.monotonic):
        self.timeout_s, self.rank, self.pp_rank = timeout_s, rank, pp_rank
        self.store, self.end, self.clock = store, end, clock
        self.log = log or (lambda line: print(line, file=sys.stderr, flush=True))
        self.transport = None
        self.needed_by: Callable = lambda msg: None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def watch(self, transport, needed_by: Callable | None = None) -> None:
        self.transport = transport
        if needed_by is not None:
            self.needed_by = needed_by
        if self._thread is None and self.timeout_s > 0:
            self._thread = threading.Thread(target=self._run, daemon=True, name="zero-bubble-watchdog")
            self._thread.start()

    def close(self) -> None:
        """Stop the thread and wait for it: one left inside a call into torch (the store) when the interpreter
        ends would be ended by it mid-call, which aborts the process (training/teardown.py)."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=GRACE_S + 2.0)  # it wakes at once, unless it is reporting (then it ends the process)

    def _run(self) -> None:
        period = min(1.0, self.timeout_s / 10)
        while not self._stop.wait(period):
            line = self.check()
            if line is None and self.store is not None and self._told():
                line = self.describe(told=True)
            if line is not None:
                self._report(line)
                return

    def _late(self):
        """(the late operation, since when) or None: what the rank is blocked on, or where the backend reports
        completion (NCCL: the rank runs ahead of its GPU), the oldest operation not completed."""
        transport = self.transport
        if transport is None:
            return None
        if transport.blocked is not None:
            return transport.blocked
        if transport.completion_reported:
            stuck = [p for p in transport.in_flight() if not p.work.is_completed()]
            if stuck:
                return stuck[0], stuck[0].at
        return None

    def check(self) -> str | None:
        """The line to print when the rank has waited for an operation longer than the timeout, else None."""
        late = self._late()
        if late is not None and self.clock() - late[1] > self.timeout_s:
            return self.describe()
        return None

    def describe(self, told: bool = False) -> str:
        who = f"zero-bubble: pipeline watchdog: rank {self.pp_rank} of the pipeline (global rank {self.rank})"
        late = self._late()
        if late is None:
            return (f"{who} waits for no pipeline message (between forward-backward calls, or in a collective); "
                    f"another rank's watchdog fired, so this one stops too")
        oldest, since = late
        if oldest.is_send:
            what = f"its send of {oldest.msg.describe()} to rank {oldest.peer} to complete"
        else:
            needer = self.needed_by(oldest.msg)
            what = f"{oldest.msg.describe()} from rank {oldest.peer}" + (
                f", which {needer.describe()} needs" if needer is not None else "")
        in_flight = self.transport.in_flight()
        heads = {}
        for p in in_flight:
            heads.setdefault(p.peer, p)
        queued = "; ".join(f"with rank {peer}: the {'send' if p.is_send else 'receive'} of {p.msg.describe()} "
                           f"({sum(1 for q in in_flight if q.peer == peer)} in flight)" for peer, p in heads.items())
        return f"{who} has waited {self.clock() - since:.0f} s for {what}; heads of its links: {queued}" + (
            " (stopped by another rank's watchdog)" if told else f" (--zero-bubble-watchdog-timeout {self.timeout_s:g})")

    def _told(self) -> bool:
        try:
            return self.store.check([STORE_KEY])
        except Exception:  # noqa: BLE001 - a store that is gone tells nothing
            return False

    def _report(self, line: str) -> None:
        self.log(line)
        if self.store is not None:
            if not self._told():
                try:
                    self.store.set(STORE_KEY, str(self.rank))
                except Exception:  # noqa: BLE001
                    pass
            time.sleep(GRACE_S)  # every rank prints its line before the first to end takes the job down
        self.end(EXIT_STUCK)
