"""A stand-in for NCCL's point-to-point on CPU, at least as strict as NCCL: for tests and rehearsals, never training.

gloo is more forgiving than NCCL: its sends complete as soon as the data is written out, and operations with
different peers overtake each other. NCCL runs a communicator's operations in posting order on one stream, and a
send completes only together with its receive (../shared/reference/nccl-p2p.md). `StrictP2P` runs the operations of
each (rank, process group) one at a time, in posting order, on a thread of their own, and completes a send only when
the peer has acknowledged its receive: a rendezvous, even for one byte. A program that would stall or deadlock on
NCCL's streams stalls or deadlocks here too (a wait then fails after `timeout_s`, naming the operation), whichever
of NCCL's two ways of making communicators is in force: one stream per process group is the stricter, and every
group the runtime posts on links one pair of ranks.
"""
from __future__ import annotations

import queue
import threading

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = 300.0


class StrictWork:
    """One posted operation: `wait()` until its rendezvous is over, `is_completed()`."""

    def __init__(self, what: str, timeout_s: float):
        self.what, self.timeout_s = what, timeout_s
        self._done = threading.Event()
        self.error: BaseException | None = None

    def is_completed(self) -> bool:
        return self._done.is_set()

    def wait(self) -> bool:
        if not self._done.wait(self.timeout_s):
            raise RuntimeError(f"strict p2p: the {self.what} did not complete within {self.timeout_s:g} s (its "
                               f"stream runs in posting order and a send completes only with its receive, as NCCL's)")
        if self.error is not None:
            raise RuntimeError(f"strict p2p: the {self.what} failed: {self.error}") from self.error
        return True

    def finish(self, error: BaseException | None = None) -> None:
        self.error = error
        self._done.set()


class _Stream(threading.Thread):
    """The in-order stream of one (rank, process group)."""

    def __init__(self, group):
        super().__init__(daemon=True, name="strict-p2p")
        self.group = group
        self.queue: queue.Queue = queue.Queue()
        self.failed: BaseException | None = None

    def run(self) -> None:
        ack = torch.zeros(1, dtype=torch.uint8)
        while True:
            item = self.queue.get()
            if item is None:
                return
            is_send, tensor, peer, work = item
            if self.failed is not None:  # an in-order stream stops at its first failure
                work.finish(self.failed)
                continue
            try:
                if is_send:
                    dist.send(tensor, peer, group=self.group)
                    dist.recv(ack, peer, group=self.group)  # the peer's receive ran: rendezvous
                else:
                    dist.recv(tensor, peer, group=self.group)
                    dist.send(ack, peer, group=self.group)
                work.finish()
            except BaseException as error:  # noqa: BLE001 - handed to whoever waits for the operation
                self.failed = error
                work.finish(error)


class StrictP2P:
    """runtime.p2p.P2POps, strictly: one in-order stream per process group, sends completed by rendezvous."""

    reports_completion = True  # is_completed() tells, as NCCL's works do (gloo's only after a wait)

    def __init__(self, timeout_s: float = DEFAULT_TIMEOUT_S):
        self.timeout_s = timeout_s
        self._streams: dict[int, _Stream] = {}

    def _stream(self, group) -> _Stream:
        stream = self._streams.get(id(group))
        if stream is None:
            stream = self._streams[id(group)] = _Stream(group)
            stream.start()
        return stream

    def _post(self, is_send: bool, tensor: torch.Tensor, peer: int, group) -> StrictWork:
        work = StrictWork(f"{'send to' if is_send else 'receive from'} rank {peer}", self.timeout_s)
        self._stream(group).queue.put((is_send, tensor, peer, work))
        return work

    def isend(self, tensor, dst, group) -> StrictWork:
        return self._post(True, tensor, dst, group)

    def irecv(self, tensor, src, group) -> StrictWork:
        return self._post(False, tensor, src, group)

    def close(self) -> None:
        """Stop the streams once what they hold is done (before their groups are destroyed)."""
        for stream in self._streams.values():
            stream.queue.put(None)
        for stream in self._streams.values():
            stream.join(timeout=self.timeout_s)
        self._streams.clear()
