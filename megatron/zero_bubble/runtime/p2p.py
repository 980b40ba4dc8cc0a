"""Point-to-point transport for the lowered schedule: post receives and sends, wait where a pass needs them.

Operations are posted one by one with torch.distributed.isend/irecv on the pipeline group; the lowering
(schedules/comm.py) already put them in an order that matches in posting order between every two ranks,
which is how both NCCL and gloo pair untagged messages.

A send's tensor is held until the send completes. gloo's send never reports completion unless waited for, so
sends are completed at points the program fixes (what the held-memory model counts, schedules/held_memory.py):
once a message from the same peer arrived whose receive was posted after the send (the peer posted its receive of
the send before that message, so the wait needs nothing more of it), before the backward of an F whose output it
is, and at the end of the call; NCCL's may complete earlier (`reap_sends`).
"""
from __future__ import annotations

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


class PipelineTransport:
    def __init__(self, pp_group, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                 validation_numel: int = 0, token_counts: bool = False):
        self.group = pp_group
        self.validation_numel = validation_numel  # the optimizer step's summaries (post_validation.py)
        self.shape, self.dtype, self.device = shape, dtype, device
        self.wire = wire_device(pp_group, device)  # buffers that send and receive; host copies on gloo with CUDA
        self._posted = 0  # receives and sends posted so far: their order on this rank
        self._recvs: dict[Message, tuple[dist.Work, torch.Tensor, int]] = {}  # ..., when it was posted
        self._sends: dict[Message, tuple[dist.Work, torch.Tensor, object, int]] = {}  # ..., on_done, when posted
        # Per-token loss under post-validation: every gradient message is followed by the loss stage's token
        # count as far as its sender knows it. Gradients flow away from the loss stage and a rank's last
        # backward comes after all its forwards, so by its last backward every rank knows the full count,
        # with no collective across stages (megatron broadcasts it from the last stage).
        self.token_counts = token_counts
        self.tokens_received = 0  # the largest count that came with a gradient
        self._count_recvs: dict[Message, tuple[dist.Work, torch.Tensor]] = {}  # a gradient's count, in flight
        self._count_sends: dict[Message, tuple[dist.Work, torch.Tensor]] = {}

    def _with_count(self, msg: Message) -> bool:
        return self.token_counts and msg.kind == Kind.GRAD

    def _global(self, group_rank: int) -> int:
        return dist.get_global_rank(self.group, group_rank)

    def post_recv(self, msg: Message) -> None:
        if not carries_microbatch(msg.kind):  # a summary of the optimizer step (V, S)
            buffer = torch.empty(self.validation_numel, dtype=torch.float, device=self.wire)
        else:  # megatron receives activations and gradients into leaf tensors that require grad
            buffer = torch.empty(self.shape, dtype=self.dtype, device=self.wire, requires_grad=self.wire == self.device)
        self._recvs[msg] = (dist.irecv(buffer, src=self._global(msg.src), group=self.group), buffer, self._post())
        if self._with_count(msg):  # posted right after its gradient on both sides, so they pair in order
            count = torch.zeros(1, dtype=torch.int64, device=self.wire)
            self._count_recvs[msg] = (dist.irecv(count, src=self._global(msg.src), group=self.group), count)

    def wait_recv(self, msg: Message) -> torch.Tensor:
        if msg not in self._recvs:
            raise RuntimeError(f"the lowered schedule never posted the receive of {msg.describe()}")
        work, buffer, posted = self._recvs.pop(msg)
        work.wait()
        if msg in self._count_recvs:
            work, count = self._count_recvs.pop(msg)
            work.wait()
            self.tokens_received = max(self.tokens_received, int(count.item()))
        for earlier in [m for m, send in self._sends.items() if m.dst == msg.src and send[3] < posted]:
            self.complete_send(earlier)  # received by now on the peer's side (see the module docstring)
        if self.wire != self.device:  # a host copy: onto the device, as the leaf megatron would have received
            buffer = buffer.to(self.device).requires_grad_(carries_microbatch(msg.kind))
        return buffer

    def _post(self) -> int:
        self._posted += 1
        return self._posted

    def post_send(self, msg: Message, tensor: torch.Tensor, on_done=None, tokens: int = 0) -> None:
        """Send asynchronously; `on_done()` runs once the send has completed (e.g. to free the output);
        `tokens`: the loss stage's token count as this rank knows it (with `token_counts`, gradients only)."""
        if not carries_microbatch(msg.kind):
            payload = tensor.to(self.wire).contiguous()
            self._sends[msg] = (dist.isend(payload, dst=self._global(msg.dst), group=self.group), payload,
                                on_done, self._post())
            return
        if tuple(tensor.shape) != self.shape:
            raise RuntimeError(
                f"pipeline tensor for {msg.describe()} has shape {tuple(tensor.shape)}, expected {self.shape} "
                f"(variable sequence lengths are not supported by the zero-bubble runtime)"
            )
        payload = tensor.detach().to(self.wire, self.dtype).contiguous()  # kept alive until the send completes
        self._sends[msg] = (dist.isend(payload, dst=self._global(msg.dst), group=self.group), payload, on_done,
                            self._post())
        if self._with_count(msg):
            count = torch.tensor([tokens], dtype=torch.int64, device=self.wire)
            self._count_sends[msg] = (dist.isend(count, dst=self._global(msg.dst), group=self.group), count)

    def complete_send(self, msg: Message) -> None:
        """Wait for one send (if still pending) and run its completion callback."""
        count = self._count_sends.pop(msg, None)
        if count is not None:
            count[0].wait()
        entry = self._sends.pop(msg, None)
        if entry is not None:
            entry[0].wait()
            if entry[2] is not None:
                entry[2]()

    def reap_sends(self, block: bool = False) -> None:
        """Complete the sends that are done (all of them when block=True), releasing their buffers."""
        for msg in [m for m, (work, *_) in self._sends.items() if block or work.is_completed()]:
            self.complete_send(msg)

    def finish(self) -> None:
        self.reap_sends(block=True)
        if self._recvs:
            left = ", ".join(m.describe() for m in self._recvs)
            raise RuntimeError(f"receives posted but never consumed: {left}")
