"""Point-to-point transport for the lowered schedule: post receives and sends, wait where a pass needs them.

Every message goes on the process group of its pair of pipeline ranks (links.py), one operation at a time, in the
order the lowering fixed and `check_lowering` proved for both ways NCCL may run a group's operations
(schedules/channels.py). The operations themselves come from a `P2POps`: torch.distributed's (training), or a
stand-in that runs them as strictly as NCCL does (strict_p2p.py: tests and rehearsals on CPU).

A send's tensor is held until the send completes. gloo's send never reports completion unless waited for, so
sends are completed at points the program fixes (what the held-memory model counts, schedules/held_memory.py):
once a message from the same peer arrived whose receive was posted after the send (the peer posted its receive of
the send before that message, and a pair's operations complete in order), before the backward of an F whose output
it is, and at the end of the call; NCCL's may complete earlier (`reap_sends`).

What is posted and not yet completed is kept with the time it was posted, and the operation the rank is blocked on
with the time it started waiting, for the pipeline watchdog (watchdog.py), which reads both from another thread.
NCCL's works report their completion (a CUDA event); gloo's say they are done only once waited for, so on gloo only
the blocking wait tells that a message is late (`completion_reported`).
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable, Protocol

import torch
import torch.distributed as dist

from ..schedules.comm import Message
from ..schedules.ops import Kind, carries_microbatch


def current_device() -> torch.device:
    """Where pipeline tensors live: this process's CUDA device, or the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def wire_device(group, device: torch.device) -> torch.device:
    """Where a message travels from: gloo moves host memory only (its send of a CUDA tensor fails with "writev ...
    Bad address", seen on an H100 with torch 2.11), so CUDA tensors on a gloo group (ranks sharing a GPU,
    --zero-bubble-share-gpus) go through host copies; NCCL, and gloo on CPU, send where the tensor lives."""
    if device.type == "cuda" and dist.get_backend(group) == dist.Backend.GLOO:
        return torch.device("cpu")
    return device


class P2POps(Protocol):
    """How one send or receive is posted: returns a work with `wait()` and `is_completed()`."""

    def isend(self, tensor: torch.Tensor, dst: int, group): ...

    def irecv(self, tensor: torch.Tensor, src: int, group): ...


class TorchP2P:
    """torch.distributed's own operations (what training posts)."""

    def isend(self, tensor, dst, group):
        return dist.isend(tensor, dst=dst, group=group)

    def irecv(self, tensor, src, group):
        return dist.irecv(tensor, src=src, group=group)


@dataclass
class Posted:
    """One operation in flight: its work, the buffer it holds, when it was posted (order on this rank, seconds)."""

    msg: Message
    is_send: bool
    work: object
    tensor: torch.Tensor
    order: int
    at: float
    on_done: Callable | None = None
    count: tuple | None = None  # (work, tensor) of the token count that travels with a gradient

    @property
    def peer(self) -> int:
        return self.msg.dst if self.is_send else self.msg.src


class PipelineTransport:
    def __init__(self, links, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                 validation_numel: int = 0, token_counts: bool = False, ops: P2POps | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.links = links  # links.PipelineLinks: the group of each pair of pipeline ranks
        self.ops = ops or TorchP2P()
        self.clock = clock
        self.validation_numel = validation_numel  # the optimizer step's summaries (post_validation.py)
        self.shape, self.dtype, self.device = shape, dtype, device
        self.wire = wire_device(links.pp_group, device)  # where buffers live; host copies on gloo with CUDA
        self._posted = 0  # receives and sends posted so far: their order on this rank
        self._recvs: dict[Message, Posted] = {}
        self._sends: dict[Message, Posted] = {}
        self._lock = threading.Lock()  # the watchdog reads what is in flight from its own thread
        self.blocked: tuple[Posted, float] | None = None  # the operation this rank waits for, since when
        self.completion_reported = (getattr(self.ops, "reports_completion", False)
                                    or dist.get_backend(links.pp_group) == dist.Backend.NCCL)
        # Per-token loss under post-validation: every gradient message is followed by the loss stage's token
        # count as far as its sender knows it. Gradients flow away from the loss stage and a rank's last
        # backward comes after all its forwards, so by its last backward every rank knows the full count,
        # with no collective across stages (megatron broadcasts it from the last stage).
        self.token_counts = token_counts
        self.tokens_received = 0  # the largest count that came with a gradient

    def _with_count(self, msg: Message) -> bool:
        return self.token_counts and msg.kind == Kind.GRAD

    def _route(self, msg: Message) -> tuple[int, object]:
        """(the peer's global rank, the pair's group) of a message from or to this rank."""
        peer = msg.dst if msg.src == self.links.rank else msg.src
        return self.links.global_rank(peer), self.links.group(msg.src, msg.dst)

    def in_flight(self) -> list[Posted]:
        """What is posted and not completed, oldest first (the watchdog's view)."""
        with self._lock:
            posted = list(self._recvs.values()) + list(self._sends.values())
        return sorted(posted, key=lambda p: p.order)

    def post_recv(self, msg: Message) -> None:
        if not carries_microbatch(msg.kind):  # a summary of the optimizer step (V, S)
            buffer = torch.empty(self.validation_numel, dtype=torch.float, device=self.wire)
        else:  # megatron receives activations and gradients into leaf tensors that require grad
            buffer = torch.empty(self.shape, dtype=self.dtype, device=self.wire, requires_grad=self.wire == self.device)
        src, group = self._route(msg)
        posted = Posted(msg, False, self.ops.irecv(buffer, src, group), buffer, self._post(), self.clock())
        if self._with_count(msg):  # posted right after its gradient on both sides, so they pair in order
            count = torch.zeros(1, dtype=torch.int64, device=self.wire)
            posted.count = (self.ops.irecv(count, src, group), count)
        with self._lock:
            self._recvs[msg] = posted

    def wait_recv(self, msg: Message) -> torch.Tensor:
        if msg not in self._recvs:
            raise RuntimeError(f"the lowered schedule never posted the receive of {msg.describe()}")
        posted = self._recvs[msg]
        self._wait(posted)
        if posted.count is not None:
            self.tokens_received = max(self.tokens_received, int(posted.count[1].item()))
        with self._lock:
            del self._recvs[msg]
        for earlier in [s.msg for s in self._sends.values() if s.msg.dst == msg.src and s.order < posted.order]:
            self.complete_send(earlier)  # received by now on the peer's side (see the module docstring)
        buffer = posted.tensor
        if self.wire != self.device:  # a host copy: onto the device, as the leaf megatron would have received
            buffer = buffer.to(self.device).requires_grad_(carries_microbatch(msg.kind))
        return buffer

    def _wait(self, posted: Posted) -> None:
        self.blocked = (posted, self.clock())
        try:
            posted.work.wait()
            if posted.count is not None:
                posted.count[0].wait()
        finally:
            self.blocked = None

    def _post(self) -> int:
        self._posted += 1
        return self._posted

    def post_send(self, msg: Message, tensor: torch.Tensor, on_done=None, tokens: int = 0) -> None:
        """Send asynchronously; `on_done()` runs once the send has completed (e.g. to free the output);
        `tokens`: the loss stage's token count as this rank knows it (with `token_counts`, gradients only)."""
        dst, group = self._route(msg)
        if not carries_microbatch(msg.kind):
            payload = tensor.to(self.wire).contiguous()
        else:
            if tuple(tensor.shape) != self.shape:
                raise RuntimeError(
                    f"pipeline tensor for {msg.describe()} has shape {tuple(tensor.shape)}, expected {self.shape} "
                    f"(variable sequence lengths are not supported by the zero-bubble runtime)"
                )
            payload = tensor.detach().to(self.wire, self.dtype).contiguous()  # kept alive until the send completes
        posted = Posted(msg, True, self.ops.isend(payload, dst, group), payload, self._post(), self.clock(), on_done)
        if self._with_count(msg):
            count = torch.tensor([tokens], dtype=torch.int64, device=self.wire)
            posted.count = (self.ops.isend(count, dst, group), count)
        with self._lock:
            self._sends[msg] = posted

    def complete_send(self, msg: Message) -> None:
        """Wait for one send (if still pending) and run its completion callback."""
        posted = self._sends.get(msg)
        if posted is None:
            return
        self._wait(posted)
        with self._lock:
            del self._sends[msg]
        if posted.on_done is not None:
            posted.on_done()

    def reap_sends(self, block: bool = False) -> None:
        """Complete the sends that are done (all of them when block=True), releasing their buffers."""
        for msg in [m for m, s in list(self._sends.items()) if block or s.work.is_completed()]:
            self.complete_send(msg)

    def finish(self) -> None:
        self.reap_sends(block=True)
        if self._recvs:
            left = ", ".join(m.describe() for m in self._recvs)
            raise RuntimeError(f"receives posted but never consumed: {left}")
