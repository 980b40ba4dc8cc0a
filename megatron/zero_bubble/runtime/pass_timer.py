"""How long a compute pass took: its own compute, never the wait for a neighbour.

A profiled pass starts its clock once its input has arrived (the iteration waits for the message first), so on the
CPU the clock around the pass reads its compute. On CUDA the kernels run after the host returns, and a device-wide
`torch.cuda.synchronize()` would also wait for NCCL's streams, where receives are posted early: a pass's time would
then include a neighbour's lateness, and re-planning would plan on inflated costs. `CudaPassTimer` records events on
the compute stream around the pass and waits for the end event alone.
"""
from __future__ import annotations

from typing import Callable

import torch


class ClockPassTimer:
    """The host clock around the pass (CPU: the compute is done when the pass returns)."""

    def __init__(self, clock: Callable[[], float]):
        self.clock = clock
        self._start = 0.0

    def start(self) -> None:
        self._start = self.clock()

    def stop(self) -> tuple[float, float]:
        return self._start, self.clock()


class CudaPassTimer:
    """Events on the current (compute) stream; times on the host clock, from an event recorded at the timer's start.
    One per iteration: `stop()` waits for the pass's end event, not for the device."""

    def __init__(self, clock: Callable[[], float]):
        self.clock = clock
        self._base = torch.cuda.Event(enable_timing=True)
        self._base.record()
        self._base_time = clock()
        self._start = None

    def start(self) -> None:
        self._start = torch.cuda.Event(enable_timing=True)
        self._start.record()

    def stop(self) -> tuple[float, float]:
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        end.synchronize()
        return (self._base_time + self._base.elapsed_time(self._start) / 1e3,
                self._base_time + self._base.elapsed_time(end) / 1e3)


def pass_timer(device: torch.device, clock: Callable[[], float]):
    return CudaPassTimer(clock) if device.type == "cuda" else ClockPassTimer(clock)
