"""What a rank really holds between its passes, read from the allocator, independently of the planner's model.

`MemoryProbe` reads the bytes allocated on this rank's device: on CUDA `torch.cuda.memory_allocated` (and the
call's peak inside passes from `max_memory_allocated`, its counter reset when the call starts); on CPU glibc's
`mallinfo2` (bytes in use in malloc's arenas plus its mmapped blocks: where torch's CPU allocator gets tensor
memory). Elsewhere (another C library) it says "not measured" rather than guess.

`start()` takes the baseline when a forward-backward call starts: weights, gradient (main_grad) buffers and
optimizer state exist by then and stay out of the figures. `sample(p)` after each compute pass records what is
held above it: the activations the planner's memory model (schedules/memory.py) counts between passes, plus
whatever else the runtime keeps (messages in flight, received tensors). Only profiled calls use a probe.

`start()` also records the model state: the memory of every tensor alive as the call starts (weights, megatron
DDP's gradient buffers, optimizer state, megatron's buffers), which `zb-schedule advise` predicts beside the
activations. On CUDA that is the baseline itself (the device holds tensors only); on the CPU the allocator also
holds the interpreter's, the libraries' and the data pipeline's memory (which a GPU run keeps in host memory), so
the live tensors are counted instead: each storage once, found through Python's garbage collector.
"""
from __future__ import annotations

import ctypes
import gc
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..schedules.schedule import Pass

MIB = 2**20


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def _mallinfo2_reader() -> Callable[[], int] | None:
    """glibc >= 2.33: bytes malloc hands out (uordblks, over all arenas) plus its mmapped blocks (hblkhd)."""
    try:
        function = ctypes.CDLL(None).mallinfo2
    except (OSError, AttributeError):
        return None
    function.restype, function.argtypes = _Mallinfo2, []

    def read() -> int:
        info = function()
        return info.uordblks + info.hblkhd

    return read


@dataclass
class HeldMemory:
    """One call's bytes above its baseline after each compute pass (none: not measured on this device)."""

    source: str  # where the figures come from, or why there are none
    after_pass: list[tuple[Pass, int]] = field(default_factory=list)
    peak_in_passes: int | None = None  # CUDA: the call's peak, transients inside passes included
    model_state: int | None = None  # bytes of the tensors alive as the call started (see the module docstring)

    @property
    def peak(self) -> int | None:
        """The most held between two passes (what the planner's model predicts), None if not measured."""
        return max(held for _, held in self.after_pass) if self.after_pass else None


def live_tensor_bytes(device: torch.device) -> int:
    """Bytes of the storages of every tensor on `device` that Python can reach, each storage once."""
    seen, total = set(), 0
    for obj in gc.get_objects():
        if not isinstance(obj, torch.Tensor) or obj.device != device or obj.is_sparse or obj.is_meta:
            continue
        storage = obj.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


class MemoryProbe:
    """Reads the allocator of `device` at a call's start and after each of its compute passes."""

    def __init__(self, device: torch.device, read: Callable[[], int] | None = None, source: str | None = None):
        self.device = device
        if read is None:
            read, source = self._reader(device)
        self._read, self.source = read, source or "a given reader"
        self._baseline = 0
        self.held = HeldMemory(self.source)

    @staticmethod
    def _reader(device: torch.device) -> tuple[Callable[[], int] | None, str]:
        if device.type == "cuda":
            return (lambda: torch.cuda.memory_allocated(device)), "torch.cuda.memory_allocated"
        if device.type == "cpu":
            read = _mallinfo2_reader()
            if read is not None:
                return read, "glibc mallinfo2 (arenas + mmapped blocks)"
            return None, "not measured (no glibc mallinfo2 in this C library)"
        return None, f"not measured (no allocator reading for {device.type})"

    @property
    def available(self) -> bool:
        return self._read is not None

    def start(self) -> None:
        """The baseline, as a forward-backward call starts; forgets the previous call's samples."""
        self.held = HeldMemory(self.source)
        if self._read is None:
            return
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        self._baseline = self._read()
        self.held.model_state = self._baseline if self.device.type == "cuda" else live_tensor_bytes(self.device)

    def sample(self, p: Pass) -> None:
        """After a compute pass: what is held above the baseline."""
        if self._read is not None:
            self.held.after_pass.append((p, self._read() - self._baseline))

    def finish(self) -> HeldMemory:
        if self._read is not None and self.device.type == "cuda":
            self.held.peak_in_passes = torch.cuda.max_memory_allocated(self.device) - self._baseline
        return self.held
