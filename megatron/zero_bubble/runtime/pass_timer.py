"""How long a compute pass took: its own compute, never the wait for a neighbour.

A profiled pass starts its clock once its input has arrived (the iteration waits for the message first), so on the
CPU the clock around the pass reads its compute. On CUDA the kernels run after the host returns, and a device-wide
`torch.cuda.synchronize()` would also wait for NCCL's streams, where receives are posted early: a pass's time would
then include a neighbour's lateness, and re-planning would plan on inflated costs. `CudaPassTimer` records events on
the compute stream around each pass and reads them all once the iteration's passes are queued: one wait, for the last
end event, per iteration. Waiting after every pass would stop the host from queueing ahead of the GPU, so a pass's
time would also count the host launching its kernels, and the profiled iterations would run slower than the rest.
"""
from __future__ import annotations

from typing import Callable

import torch


class ClockPassTimer:
    """The host clock around the pass (CPU: the compute is done when the pass returns). Its times are known at once."""

    deferred = False

    def __init__(self, clock: Callable[[], float]):
        self.clock = clock
        self._start = 0.0

    def start(self) -> None:
        self._start = self.clock()

    def stop(self) -> tuple[float, float]:
        return self._start, self.clock()


class CudaPassTimer:
    """Events on the current (compute) stream; times on the host clock, from an event recorded at the timer's start.
    One per iteration. `stop()` only records the pass's end event; `read()` waits for the last one and returns every
    pass's (start, end) since the previous `read()`, in order. `event`: what makes an event (torch.cuda.Event)."""

    deferred = True

    def __init__(self, clock: Callable[[], float], event: Callable = None):
        self.clock = clock
        self._event = event or (lambda: torch.cuda.Event(enable_timing=True))
        self._base = self._event()
        self._base.record()
        self._base_time = clock()
        self._start = None
        self._pending: list[tuple] = []

    def start(self) -> None:
        self._start = self._event()
        self._start.record()

    def stop(self) -> None:
        end = self._event()
        end.record()
        self._pending.append((self._start, end))

    def read(self) -> list[tuple[float, float]]:
        if not self._pending:
            return []
        self._pending[-1][1].synchronize()  # the stream runs in order: every earlier event is complete too
        base, at = self._base, self._base_time
        times = [(at + base.elapsed_time(start) / 1e3, at + base.elapsed_time(end) / 1e3)
                 for start, end in self._pending]
        self._pending.clear()
        return times


def pass_timer(device: torch.device, clock: Callable[[], float]):
    return CudaPassTimer(clock) if device.type == "cuda" else ClockPassTimer(clock)
