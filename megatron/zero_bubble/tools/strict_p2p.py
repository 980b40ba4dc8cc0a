"""A stand-in for NCCL's point-to-point on CPU, at least as strict as NCCL: for tests and rehearsals, never training.

gloo is more forgiving than NCCL: its sends complete as soon as the data is written out, operations overtake each
other, and nothing blocks at the first use of a link. `StrictP2P` (runtime.p2p.P2POps) follows the rules of the
model the programs are proven on (schedules/nccl_model.py, ../shared/reference/nccl-p2p.md):
- one in-order stream per process group, and one launch queue: posting a batch blocks the caller while its previous
  batch on that group is incomplete (on a GPU the host would go on, but every later kernel, compute included, would
  wait: a CPU process computes on its host, so it waits there);
- the first use of a link blocks the caller until the peer makes its own first use of it, and the first use of a
  group until every member has made its own;
- rendezvous: a send completes only once the receiver's batch holding its receive runs, even for one byte;
- a batch is one kernel: it completes when all its sends and receives have, and waiting for one waits for all.
A program that would stall or deadlock on NCCL stalls or deadlocks here too: a wait then fails after `timeout_s`,
naming what it waited for.

Where the host waits: a process that computes on its host must hold a message before it computes on it, so by default
`wait()` and posting behind an incomplete batch block the caller, where NCCL would only order the GPU's streams.
With `host_waits=False` they are NCCL's: `wait()` returns at once, posting never waits for the stream, and the host
waits only at `synchronize()`, where megatron's optimizer step reads the gradient norm (`.item()`). That is for
programs that never read what they receive (rehearsals, the watchdog's tests): what a rank does after a wait, and
what sees a message that never comes once the host has gone on.
"""
from __future__ import annotations

import queue
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = 300.0
_DATA, _RUNNING, _FIRST_USE = 1, 2, 3  # gloo tags: payloads, "my batch runs", first-use handshakes


class StrictBatch:
    """One posted batch: `wait()` until all its operations are over (or, with `host_waits` off, at once, as
    NCCL's wait only orders the stream), `is_completed()`, `synchronize()` (the host waits, whatever the mode)."""

    def __init__(self, what: str, timeout_s: float, host_waits: bool = True):
        self.what, self.timeout_s, self.host_waits = what, timeout_s, host_waits
        self._done = threading.Event()
        self.error: BaseException | None = None

    def is_completed(self) -> bool:
        return self._done.is_set()

    def wait(self) -> bool:
        return self.synchronize() if self.host_waits else True

    def synchronize(self) -> bool:
        if not self._done.wait(self.timeout_s):
            raise RuntimeError(f"strict p2p: the batch of {self.what} did not complete within {self.timeout_s:g} s "
                               f"(a group's batches run one at a time and a send completes only once its receive "
                               f"runs, as NCCL's)")
        if self.error is not None:
            raise RuntimeError(f"strict p2p: the batch of {self.what} failed: {self.error}") from self.error
        return True

    def finish(self, error: BaseException | None = None) -> None:
        self.error = error
        self._done.set()


class _Stream(threading.Thread):
    """The in-order stream of one process group on this rank: it runs one batch at a time."""

    def __init__(self, group, timeout_s: float):
        super().__init__(daemon=True, name="strict-p2p")
        self.group, self.timeout = group, timedelta(seconds=timeout_s)
        self.queue: queue.Queue = queue.Queue()
        self.last: StrictBatch | None = None
        self.warm: set[int] = set()
        self.failed: BaseException | None = None

    def run(self) -> None:
        while (item := self.queue.get()) is not None:
            posts, batch = item
            if self.failed is not None:  # an in-order stream stops at its first failure
                batch.finish(self.failed)
                continue
            try:
                self._run_batch(posts)
                batch.finish()
            except BaseException as error:  # noqa: BLE001 - handed to whoever waits for the batch
                self.failed = error
                batch.finish(error)
            del item, posts, batch  # the batch's tensors go with the runtime's references, not at the next batch

    def _run_batch(self, posts) -> None:
        """Tell each peer this rank receives from that the batch runs, move the payloads, and complete each send only
        once its receiver has said so (rendezvous)."""
        group, flag = self.group, torch.ones(1, dtype=torch.uint8)
        works = [dist.isend(flag, peer, group=group, tag=_RUNNING) for is_send, _, peer in posts if not is_send]
        for is_send, tensor, peer in posts:
            if is_send:
                works += [dist.isend(tensor, peer, group=group, tag=_DATA),
                          dist.irecv(torch.zeros(1, dtype=torch.uint8), peer, group=group, tag=_RUNNING)]
            else:
                works.append(dist.irecv(tensor, peer, group=group, tag=_DATA))
        for work in works:
            work.wait(self.timeout)


class StrictP2P:
    """runtime.p2p.P2POps, strictly (see the module docstring)."""

    reports_completion = True  # is_completed() tells, as NCCL's works do (gloo's only after a wait)

    def __init__(self, timeout_s: float = DEFAULT_TIMEOUT_S, host_waits: bool = True):
        self.timeout_s, self.host_waits = timeout_s, host_waits
        self._streams: dict[int, _Stream] = {}

    def batch(self, posts, group) -> StrictBatch:
        stream = self._stream(group)
        if stream.last is not None and self.host_waits:
            stream.last.wait()  # the previous batch of the group must be over before this one may start
        self._first_use(stream, sorted({peer for _, _, peer in posts} - stream.warm))
        peers = ", ".join(f"{'send to' if is_send else 'receive from'} rank {peer}" for is_send, _, peer in posts)
        stream.last = StrictBatch(peers, self.timeout_s, self.host_waits)
        stream.queue.put((posts, stream.last))
        return stream.last

    def synchronize(self) -> None:
        """The host waits for every batch posted so far (the GPU's streams wait for them, and a read of a result on
        the host, such as the optimizer step's `.item()`, waits for the GPU)."""
        for stream in list(self._streams.values()):
            if stream.last is not None:
                stream.last.synchronize()

    def _stream(self, group) -> _Stream:
        stream = self._streams.get(id(group))
        if stream is None:
            self._join(group)
            stream = self._streams[id(group)] = _Stream(group, self.timeout_s)
            stream.start()
        return stream

    def _join(self, group) -> None:
        """The group's first use: wait until every member has made its own, as a lazily made NCCL communicator's
        creation does (counted in the job's store, so that no collective of the group's is spent on it)."""
        store = dist.distributed_c10d._get_default_store()
        key, size = f"zero_bubble/strict_p2p/{group.group_name}", group.size()
        arrived = store.add(key, 1)
        everyone = -(-arrived // size) * size  # this round of first uses is complete at the next multiple
        deadline = time.monotonic() + self.timeout_s
        while store.add(key, 0) < everyone:
            if time.monotonic() > deadline:
                raise RuntimeError(f"strict p2p: the first use of group '{group.group_name}' did not complete within "
                                   f"{self.timeout_s:g} s: a member has not made its own (a lazily made NCCL "
                                   f"communicator waits for every member)")
            time.sleep(0.005)

    def _first_use(self, stream: _Stream, peers: list[int]) -> None:
        """Block until each new peer makes its own first use of the link (a handshake with each, all at once)."""
        if not peers:
            return
        token = torch.ones(1, dtype=torch.uint8)
        works = []
        for peer in peers:
            works += [dist.isend(token, peer, group=stream.group, tag=_FIRST_USE),
                      dist.irecv(torch.zeros(1, dtype=torch.uint8), peer, group=stream.group, tag=_FIRST_USE)]
        try:
            for work in works:
                work.wait(stream.timeout)
        except RuntimeError as error:
            raise RuntimeError(f"strict p2p: the first use of the links to ranks {peers} did not complete within "
                               f"{self.timeout_s:g} s: a peer has not made its own first use (NCCL sets a link up at "
                               f"its first exchange, blocking the host until the peer comes): {error}") from error
        stream.warm.update(peers)

    def close(self) -> None:
        """Stop the streams once what they hold is done."""
        for stream in self._streams.values():
            stream.queue.put(None)
        for stream in self._streams.values():
            stream.join(timeout=self.timeout_s)
        self._streams.clear()
