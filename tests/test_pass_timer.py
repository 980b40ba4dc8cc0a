"""Profiled passes on CUDA are read after the iteration, not once per pass (runtime/pass_timer.py).

CUDA cannot run here, so `_ModelledStream` is a test double of CUDA's timing events (labelled as one) that is at least
as strict as CUDA: `elapsed_time` raises unless both events have completed, an event completes only when the host
waits for it or for a later event of the same stream, and every such wait is counted (on a GPU each one stops the host
until the GPU gets there). The modelled GPU runs each pass for the seconds the test gives it.
"""
from __future__ import annotations

import types

import pytest
import torch

from megatron.zero_bubble.runtime.iteration import Iteration, LoweredRun
from megatron.zero_bubble.runtime.pass_timer import ClockPassTimer, CudaPassTimer
from megatron.zero_bubble.runtime.wgrad_store import WeightGradStore
from megatron.zero_bubble.schedules.planners import plan
from megatron.zero_bubble.schedules.problem import PlanRequest


class _ModelledStream:
    """Test double: one CUDA stream's timing events, with the GPU's clock advanced by `run(seconds)`."""

    def __init__(self):
        self.gpu_ms = 0.0
        self.recorded: list[_ModelledEvent] = []
        self.host_waits = 0

    def run(self, seconds: float) -> None:
        self.gpu_ms += seconds * 1e3

    def event(self) -> _ModelledEvent:
        return _ModelledEvent(self)


class _ModelledEvent:
    def __init__(self, stream: _ModelledStream):
        self.stream, self.at_ms, self.complete = stream, None, False

    def record(self) -> None:
        self.at_ms = self.stream.gpu_ms
        self.stream.recorded.append(self)

    def synchronize(self) -> None:
        self.stream.host_waits += 1
        for event in self.stream.recorded[: self.stream.recorded.index(self) + 1]:
            event.complete = True

    def elapsed_time(self, other: _ModelledEvent) -> float:
        if not (self.complete and other.complete):
            raise RuntimeError("elapsed_time of an event that has not completed (CUDA: cudaErrorNotReady)")
        return other.at_ms - self.at_ms


def test_the_cuda_timer_waits_once_for_all_the_passes_it_timed():
    stream = _ModelledStream()
    timer = CudaPassTimer(clock=lambda: 100.0, event=stream.event)
    seconds = [0.004, 0.001, 0.008, 0.002]
    for s in seconds:
        stream.run(0.5)  # the GPU idle or busy with something else between passes
        timer.start()
        stream.run(s)
        assert timer.stop() is None
    assert stream.host_waits == 0
    times = timer.read()
    assert stream.host_waits == 1
    assert [round(end - start, 9) for start, end in times] == seconds
    assert times[0][0] == pytest.approx(100.5) and all(a[1] < b[0] for a, b in zip(times, times[1:]))
    assert timer.read() == [] and stream.host_waits == 1  # nothing new: no wait


class _Compute:
    """Passes that run on the modelled GPU, logging when each one runs (`log`)."""

    forward_only = False

    def __init__(self, timer, stream, log):
        self.timer, self.stream, self.log = timer, stream, log

    def forward(self, p, vstage, input_tensor, is_last_stage):
        self.log.append(("ran", p))
        self.stream.run(0.003)
        return torch.zeros(1)

    def release_output(self, output):
        pass

    def backward(self, p, vstage, input_tensor, output, output_grad, store, last):
        self.log.append(("ran", p))
        self.stream.run(0.005)

    def finish_backward(self):
        pass

    def pass_timer(self, clock):
        return self.timer

    def token_count(self):
        return torch.zeros(1, dtype=torch.int64)


class _NoMessages:
    token_counts = False

    def reap(self):
        pass

    def finish(self):
        pass


def _run(timer, stream, microbatches=3):
    schedule = plan("1f1b", PlanRequest(stages=1, microbatches=microbatches, ilp_time_limit=0))
    log = []
    observer = lambda p, start, end: log.append(("seen", p, round(end - start, 9)))  # noqa: E731
    iteration = Iteration(schedule=schedule, rank=0, compute=_Compute(timer, stream, log), transport=_NoMessages(),
                          stores=[WeightGradStore()], observer=observer)
    iteration.run(LoweredRun.of(schedule).programs[0])
    return schedule.ranks[0], log


def test_an_iteration_timed_on_cuda_waits_once_and_shows_every_pass_after_its_last():
    stream = _ModelledStream()
    passes, log = _run(CudaPassTimer(clock=lambda: 0.0, event=stream.event), stream)
    assert stream.host_waits == 1
    ran, seen = log[: len(passes)], log[len(passes):]
    assert [p for _, p in ran] == passes  # every pass ran before the observer saw any
    assert [(p, s) for _, p, s in seen] == [(p, 0.003 if p.op.value == "F" else 0.005) for p in passes]


def test_on_the_host_clock_the_observer_sees_each_pass_when_it_ends():
    stream = _ModelledStream()
    clock = types.SimpleNamespace(now=0.0)
    timer = ClockPassTimer(lambda: clock.now)
    passes, log = _run(timer, stream)
    assert [entry[:2] for entry in log] == [(kind, p) for p in passes for kind in ("ran", "seen")]
