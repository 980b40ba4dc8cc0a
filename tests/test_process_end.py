"""The pieces of a clean process end that need no process of their own (tests/megatron/test_clean_exit.py counts a
process's gloo threads at its end, and launches whole runs).

training/teardown.py destroys every process group before the interpreter ends, so that no gloo worker thread is left
to take the GIL while it finalizes; the pipeline watchdog's thread is joined when it closes; an iteration of the
runtime is no reference cycle, so what it holds (megatron's data iterators) goes when its call ends.
"""
from __future__ import annotations

import gc
import types
import weakref

import pytest
import torch.distributed as dist

from megatron.zero_bubble.runtime.iteration import Iteration
from megatron.zero_bubble.runtime.watchdog import PipelineWatchdog
from megatron.zero_bubble.schedules.planners import plan
from megatron.zero_bubble.schedules.problem import PlanRequest
from megatron.zero_bubble.training import teardown

def test_the_end_of_a_process_without_torch_distributed_does_nothing():
    assert not dist.is_initialized()
    teardown.end_distributed(log=pytest.fail)


class _Transport:
    blocked = None
    completion_reported = False

    def in_flight(self):
        return []


def test_closing_the_watchdog_waits_for_its_thread():
    """A watchdog thread still inside a call into torch (the store) when the interpreter ends would be ended mid-call,
    which aborts the process: close() returns once the thread is gone."""
    watchdog = PipelineWatchdog(timeout_s=30.0, rank=0, pp_rank=0, end=pytest.fail)
    watchdog.watch(_Transport())
    thread = watchdog._thread
    assert thread.is_alive()
    watchdog.close()
    assert not thread.is_alive()


def test_an_iteration_goes_when_its_last_reference_does():
    """No reference cycle: what an iteration holds (megatron's data iterators, in its compute passes) goes when its
    call ends, not at the next garbage collection (a DataLoader shut down from inside one waits 5 s per worker)."""
    schedule = plan("zb-h1", PlanRequest(stages=2, microbatches=4, ilp_time_limit=0))
    compute = types.SimpleNamespace(forward_only=False)
    gc.disable()
    try:
        iteration = Iteration(schedule=schedule, rank=0, compute=compute, transport=_Transport(), stores=[])
        gone = weakref.ref(iteration)
        del iteration
        assert gone() is None
    finally:
        gc.enable()


def test_the_watchdogs_abort_ends_the_job_even_when_the_dump_and_the_abort_fail(tmp_path, monkeypatch):
    """--zero-bubble-watchdog-abort: a flight-recorder path that cannot be written, and an abort of the communicators
    that raises, are each a line; the exit still comes (a watchdog thread that died there would leave the job to
    NCCL's timeout)."""
    from megatron.zero_bubble.runtime import watchdog as watchdog_module

    lines, ended = [], []
    monkeypatch.setenv("TORCH_FR_DUMP_TEMP_FILE", str(tmp_path / "missing-directory" / "fr-"))

    def failing_abort():
        raise RuntimeError("ncclCommAbort failed")

    monkeypatch.setattr(watchdog_module, "abort_process_groups", failing_abort)
    watchdog = PipelineWatchdog(timeout_s=1.0, rank=3, pp_rank=1, abort=True, log=lines.append, end=ended.append)
    watchdog._end_the_job()
    assert ended == [watchdog_module.EXIT_STUCK]
    assert [line.split(" (")[0] for line in lines] == [
        "zero-bubble: pipeline watchdog: rank 3 could not write the flight recorder",
        "zero-bubble: pipeline watchdog: rank 3 could not abort its process groups"]
