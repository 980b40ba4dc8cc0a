"""Point-to-point transport for the lowered schedule: post the program's batches, wait where a pass needs them.

Every message goes on megatron's pipeline group, and what the program posts between two passes goes out as one batch
(`batch_isend_irecv`: one NCCL kernel), in the order the lowering fixed and the model of NCCL and CUDA proved
(schedules/comm.py, schedules/nccl_model.py). The links are warmed up once, at the first call (links.py). The
operations themselves come from a `P2POps`: torch.distributed's (training), or a stand-in that runs them as strictly
as NCCL does (tools/strict_p2p.py: tests and rehearsals on CPU).

A batch's tensors are held until the runtime has waited for it or for a later batch (a stream completes its batches
in order; what the held-memory model counts, schedules/held_memory.py): when a pass needs a message it received,
when a backward frees its forward's output (sent before), at the end of the call, and, where the backend reports
completion (NCCL), whenever it says so. On NCCL a wait makes the compute stream wait and never blocks the host.

What is posted and not yet completed is kept with the time it was posted, and the batch the host is blocked on with
the time it started waiting, for the pipeline watchdog (watchdog.py), which reads both from another thread. NCCL's
works report their completion (a CUDA event); gloo's say they are done only once waited for, so on gloo only the
blocking wait tells that a message is late (`completion_reported`). Where the backend reports completion, a batch the
runtime has waited for (on NCCL: ordered its stream after, the host going on) stays in view, without its tensors,
until the backend says it is complete, also after the call (finish) returns: a message the last passes wait for that
never comes is then still seen while the host runs megatron's optimizer step.
"""
from __future__ import annotations

import dataclasses
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch
import torch.distributed as dist

from ..schedules.comm import Batch, Message, Send
from ..schedules.ops import Kind, carries_microbatch

Posts = list[tuple[bool, torch.Tensor, int]]  # (is a send, tensor, the peer's global rank), in posting order


def current_device() -> torch.device:
    """Where pipeline tensors live: this process's CUDA device, or the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def wire_device(group, device: torch.device) -> torch.device:
    """Where a message travels from: gloo moves host memory only (its send of a CUDA tensor fails with "writev ...
    Bad address"), so CUDA tensors on a gloo group (ranks sharing a GPU,
    --zero-bubble-share-gpus) go through host copies; NCCL, and gloo on CPU, send where the tensor lives."""
    if device.type == "cuda" and dist.get_backend(group) == dist.Backend.GLOO:
        return torch.device("cpu")
    return device


class P2POps(Protocol):
    """How a batch of sends and receives is posted: returns a work with `wait()` and `is_completed()`."""

    def batch(self, posts: Posts, group): ...


class Works:
    """The works of one batch: done when all are. Waited for once (a gloo receive's second wait waits for another
    message)."""

    def __init__(self, works):
        self.works = list(works)
        self.waited = False

    def wait(self) -> bool:
        if not self.waited:
            for work in self.works:
                work.wait()
            self.waited = True
        return True

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self.works)


class TorchP2P:
    """torch.distributed's own operations (what training posts): one `batch_isend_irecv` per batch (one NCCL kernel
    on NCCL; gloo posts its operations one by one, in order)."""

    def batch(self, posts: Posts, group) -> Works:
        ops = [dist.P2POp(dist.isend if is_send else dist.irecv, tensor, peer, group)
               for is_send, tensor, peer in posts]
        return Works(dist.batch_isend_irecv(ops))


@dataclass
class Posted:
    """One message in flight: its buffer, and the batch it went in (its work, order on this rank, when posted)."""

    msg: Message
    is_send: bool
    tensor: torch.Tensor
    on_done: Callable | None = None
    count: torch.Tensor | None = None  # the token count that travels with a gradient
    work: object = None
    order: int = 0
    at: float = 0.0

    @property
    def peer(self) -> int:
        return self.msg.dst if self.is_send else self.msg.src


@dataclass
class _PostedBatch:
    """A batch posted and not yet waited for (its messages do not point back at it: no reference cycle to keep what
    they hold alive until a garbage collection)."""

    work: object
    order: int
    posted: list[Posted] = field(default_factory=list)


class PipelineTransport:
    def __init__(self, links, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                 validation_numel: int = 0, token_counts: bool = False, ops: P2POps | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.links = links  # links.PipelineLinks: the pipeline group, its ranks, the links warmed up
        self.ops = ops or TorchP2P()
        self.clock = clock
        self.validation_numel = validation_numel  # the optimizer step's summaries (post_validation.py)
        self.shape, self.dtype, self.device = shape, dtype, device
        self.wire = wire_device(links.group, device)  # where buffers live; host copies on gloo with CUDA
        self._batches: deque[_PostedBatch] = deque()  # posted and not yet waited for, in posting order
        self._unfinished: deque[_PostedBatch] = deque()  # waited for, not reported complete (NCCL), tensors dropped
        self._recvs: dict[Message, Posted] = {}  # received or in flight, not yet consumed
        self._sends: dict[Message, Posted] = {}
        self._posted = 0
        self._lock = threading.Lock()  # the watchdog reads what is in flight from its own thread
        self.blocked: tuple[Posted, float] | None = None  # what this rank's host waits for, since when
        self.completion_reported = (getattr(self.ops, "reports_completion", False)
                                    or dist.get_backend(links.group) == dist.Backend.NCCL)
        # Per-token loss under post-validation: every gradient message is followed by the loss stage's token
        # count as far as its sender knows it (a device tensor: nothing waits for it on the host). Gradients flow
        # away from the loss stage and a rank's last backward comes after all its forwards, so by its last backward
        # every rank knows the full count, with no collective across stages (megatron broadcasts it from the last).
        self.token_counts = token_counts
        self.tokens_received = torch.zeros(1, dtype=torch.int64, device=self.wire)  # the largest that came along

    def _with_count(self, msg: Message) -> bool:
        return self.token_counts and msg.kind == Kind.GRAD

    def in_flight(self) -> list[Posted]:
        """What is posted and not known complete, oldest first (the watchdog's view)."""
        with self._lock:
            self._prune_unfinished()
            return [posted for batches in (self._unfinished, self._batches) for batch in batches
                    for posted in batch.posted]

    def _prune_unfinished(self) -> None:
        """Forget the waited-for batches the backend now reports complete (one stream: in order). Holds the lock."""
        while self._unfinished and self._unfinished[0].work.is_completed():
            self._unfinished.popleft()

    def warm_up(self, peers) -> None:
        """The program's warm-up: one exchange with every peer whose link is cold, all at once (links.py)."""
        self.links.warm_up(peers, self.ops)

    def post_batch(self, batch: Batch, outgoing: Callable[[Message], tuple], tokens: Callable | None = None) -> None:
        """Post a batch of the program: a receive buffer for each receive, the tensor `outgoing(msg)` gives (tensor,
        on_done) for each send; `tokens()`: the loss stage's token count as this rank knows it (with `token_counts`)."""
        posts: Posts = []
        entries = []
        for post in batch.ops:
            msg, is_send = post.msg, type(post) is Send
            peer = self.links.global_rank(msg.dst if is_send else msg.src)
            if is_send:
                tensor, on_done = outgoing(msg)
                entry = Posted(msg, True, self._payload(msg, tensor), on_done)
            else:
                entry = Posted(msg, False, self._buffer(msg))
            posts.append((is_send, entry.tensor, peer))
            if self._with_count(msg):  # right after its gradient on both ends, so they pair in order
                entry.count = (tokens().reshape(1).to(self.wire, torch.int64) if is_send
                               else torch.zeros(1, dtype=torch.int64, device=self.wire))
                posts.append((is_send, entry.count, peer))
            entries.append(entry)
        if not posts:
            return
        self._posted += 1
        work, at = self.ops.batch(posts, self.links.group), self.clock()
        with self._lock:
            for entry in entries:
                entry.work, entry.order, entry.at = work, self._posted, at
                (self._sends if entry.is_send else self._recvs)[entry.msg] = entry
            self._batches.append(_PostedBatch(work, self._posted, entries))

    def _buffer(self, msg: Message) -> torch.Tensor:
        if not carries_microbatch(msg.kind):  # a summary of the optimizer step (V, S)
            return torch.empty(self.validation_numel, dtype=torch.float, device=self.wire)
        # megatron receives activations and gradients into leaf tensors that require grad
        return torch.empty(self.shape, dtype=self.dtype, device=self.wire, requires_grad=self.wire == self.device)

    def _payload(self, msg: Message, tensor: torch.Tensor) -> torch.Tensor:
        if not carries_microbatch(msg.kind):
            return tensor.to(self.wire).contiguous()
        if tuple(tensor.shape) != self.shape:
            raise RuntimeError(f"pipeline tensor for {msg.describe()} has shape {tuple(tensor.shape)}, expected "
                               f"{self.shape} (variable sequence lengths are not supported by the zero-bubble runtime)")
        return tensor.detach().to(self.wire, self.dtype).contiguous()  # kept alive until its batch completes

    def wait_recv(self, msg: Message) -> torch.Tensor:
        """Wait for the batch holding the receive of `msg` (and the batches before it) and hand the tensor over."""
        posted = self._recvs.get(msg)
        if posted is None:
            raise RuntimeError(f"the lowered schedule never posted the receive of {msg.describe()}")
        self._complete_through(posted)
        with self._lock:
            del self._recvs[msg]
        if posted.count is not None:
            torch.maximum(self.tokens_received, posted.count, out=self.tokens_received)
        buffer = posted.tensor
        if self.wire != self.device:  # a host copy: onto the device, as the leaf megatron would have received
            buffer = buffer.to(self.device).requires_grad_(carries_microbatch(msg.kind))
        return buffer

    def complete_send(self, msg: Message) -> None:
        """Wait for the batch holding the send of `msg`, if it is still pending (and the batches before it)."""
        posted = self._sends.get(msg)
        if posted is not None:
            self._complete_through(posted)

    def _complete_through(self, posted: Posted) -> None:
        """Wait for the batches up to the one holding `posted`, then let them go (in order: one stream)."""
        while self._batches and self._batches[0].order <= posted.order:
            batch = self._batches[0]
            self.blocked = (posted if posted.order == batch.order else batch.posted[0], self.clock())
            try:
                batch.work.wait()
            finally:
                self.blocked = None
            self._release()

    def _release(self) -> None:
        """Let the oldest batch go: its sends are done (their completion callbacks run), its receives arrived."""
        with self._lock:
            batch = self._batches.popleft()
            done = [entry for entry in batch.posted if entry.is_send]
            for entry in done:
                del self._sends[entry.msg]
            self._prune_unfinished()  # kept short without a watchdog reading it too
            if self.completion_reported and not batch.work.is_completed():
                self._unfinished.append(_PostedBatch(batch.work, batch.order, [
                    dataclasses.replace(entry, tensor=None, on_done=None, count=None) for entry in batch.posted]))
        for entry in done:
            if entry.on_done is not None:
                entry.on_done()

    def reap(self) -> None:
        """Let go of the batches the backend reports complete (NCCL; gloo's say so only once waited for)."""
        while self.completion_reported and self._batches and self._batches[0].work.is_completed():
            self._release()

    def finish(self) -> None:
        while self._batches:
            self._complete_through(self._batches[-1].posted[-1])
        if self._recvs:
            left = ", ".join(m.describe() for m in self._recvs)
            raise RuntimeError(f"receives posted but never consumed: {left}")
