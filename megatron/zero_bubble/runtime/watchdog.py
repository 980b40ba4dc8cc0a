"""The pipeline watchdog: a rank that waits for a message too long says where the pipeline stands.

From a thread of its own it looks at the rank's transport (p2p.PipelineTransport): the batch the host is blocked on,
or, where the backend reports completion (NCCL, whose works the host does not block on), the oldest message posted
and not completed. When that has waited longer than `timeout_s` it prints one line, in the schedule's terms: the
message, the peer, the pass that needs it, and the head of what is in flight with each peer, and counts itself in the
job's store (one call, only then), so the line says how many ranks reported before it.

By default that is all: ending a hung job is left to PyTorch's NCCL watchdog at the process group's timeout
(megatron's --distributed-timeout-minutes), which writes the flight recorder's dump megatron configures
(--flight-recorder-dump-path). A stall shorter than that (a slow read of the data, a straggler) costs a line, not the
job. With `abort` (--zero-bubble-watchdog-abort) the watchdog ends the job itself once it has printed: it writes the
flight recorder's dump first, aborts the NCCL process groups, and exits with EXIT_STUCK.
"""
from __future__ import annotations

import os
import pickle
import sys
import threading
import time
from typing import Callable

EXIT_STUCK = 3
STORE_KEY = "zero_bubble/watchdog"


def dump_flight_recorder(rank: int) -> str | None:
    """Write PyTorch's flight recorder to where megatron points it (TORCH_FR_DUMP_TEMP_FILE + rank, as PyTorch names
    its own dumps); the file, or None when no path is set or there is no recorder."""
    prefix = os.environ.get("TORCH_FR_DUMP_TEMP_FILE") or os.environ.get("TORCH_NCCL_DEBUG_INFO_TEMP_FILE")
    if not prefix:
        return None
    from torch._C import _distributed_c10d as c10d

    path = f"{prefix}{rank}"
    with open(path, "wb") as out:
        out.write(c10d._dump_fr_trace())
    return path


def abort_process_groups() -> None:
    """Abort every NCCL communicator, so that no rank is left inside a collective of this one (NCCL only)."""
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_backend() == dist.Backend.NCCL:
        dist.distributed_c10d._abort_process_group()


class PipelineWatchdog:
    """One per rank. `watch(transport, needed_by)` for the duration of an iteration (`None` after it)."""

    def __init__(self, timeout_s: float, rank: int, pp_rank: int, store=None, abort: bool = False,
                 log: Callable[[str], None] | None = None, end: Callable[[int], None] = os._exit,
                 clock: Callable[[], float] = time.monotonic):
        self.timeout_s, self.rank, self.pp_rank = timeout_s, rank, pp_rank
        self.store, self.abort, self.end, self.clock = store, abort, end, clock
        self.log = log or (lambda line: print(line, file=sys.stderr, flush=True))
        self.transport = None
        self.needed_by: Callable = lambda msg: None
        self.reported: object = None  # the late post this rank printed its line for
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
            thread.join(timeout=5.0)

    def _run(self) -> None:
        period = min(1.0, self.timeout_s / 10)
        while not self._stop.wait(period):
            self.poll()

    def poll(self) -> str | None:
        """Report the late post once (and end the job with `abort`); the line, when it printed one."""
        late = self._late()
        if late is None or late[0] is self.reported or self.clock() - late[1] <= self.timeout_s:
            return None
        self.reported = late[0]
        line = self.describe(late) + self._count_in()
        self.log(line)
        if self.abort:
            self._end_the_job()
        return line

    def _end_the_job(self) -> None:
        """The flight recorder's dump, the communicators aborted, the exit: each step guarded, so that a failure of
        one (a dump path not writable, an abort that raises) is a line and the exit still happens; a thread that
        died here would leave the job hanging until NCCL's timeout."""
        try:
            path = dump_flight_recorder(self.rank)
            self.log(f"zero-bubble: pipeline watchdog: rank {self.rank} wrote the flight recorder to {path}" if path
                     else "zero-bubble: pipeline watchdog: no flight-recorder dump (set --flight-recorder-dump-path)")
        except Exception as error:  # noqa: BLE001 - the exit must still come
            self.log(f"zero-bubble: pipeline watchdog: rank {self.rank} could not write the flight recorder "
                     f"({type(error).__name__}: {error})")
        try:
            abort_process_groups()
        except Exception as error:  # noqa: BLE001
            self.log(f"zero-bubble: pipeline watchdog: rank {self.rank} could not abort its process groups "
                     f"({type(error).__name__}: {error})")
        self.end(EXIT_STUCK)

    def _late(self):
        """(the late post, since when) or None: what the host is blocked on, or where the backend reports
        completion (NCCL: the host runs ahead of its GPU), the oldest post not completed."""
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

    def describe(self, late) -> str:
        oldest, since = late
        who = f"zero-bubble: pipeline watchdog: rank {self.pp_rank} of the pipeline (global rank {self.rank})"
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
        return (f"{who} has waited {self.clock() - since:.0f} s for {what}; heads of its links: {queued} "
                f"(--zero-bubble-watchdog-timeout {self.timeout_s:g})")

    def _count_in(self) -> str:
        """Count this report in the job's store: the only store call, made once the rank's own timer fired."""
        if self.store is None:
            return ""
        try:
            n = int(self.store.add(STORE_KEY, 1))
        except Exception:  # noqa: BLE001 - a store that is gone tells nothing
            return ""
        return "; the first rank to report" if n == 1 else f"; {n - 1} rank(s) reported before it"
