"""The pieces of a clean process end, in this process (tests/megatron/test_clean_exit.py launches whole runs).

training/teardown.py destroys every process group before the interpreter ends, so that no gloo worker thread is left
to take the GIL while it finalizes; the pipeline watchdog's thread is joined when it closes; an iteration of the
runtime is no reference cycle, so what it holds (megatron's data iterators) goes when its call ends.
"""
from __future__ import annotations

import gc
import sys
import types
import weakref

import pytest
import torch.distributed as dist

from megatron.zero_bubble.runtime.iteration import Iteration
from megatron.zero_bubble.runtime.watchdog import PipelineWatchdog
from megatron.zero_bubble.schedules.planners import plan
from megatron.zero_bubble.schedules.problem import PlanRequest
from megatron.zero_bubble.training import teardown

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts threads by name in /proc")


@pytest.fixture
def one_rank_gloo(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture
def megatron_state(monkeypatch):
    """A stand-in for megatron.core.parallel_state as a run leaves it: destroy_model_parallel drops what it knows,
    and forgets one global (as megatron-core 0.19.2 forgets _INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_GLOO)."""
    state = types.ModuleType("megatron.core.parallel_state")
    state._DATA_PARALLEL_GROUP_GLOO = None
    state._INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_GLOO = None
    state.model_parallel_is_initialized = lambda: state._DATA_PARALLEL_GROUP_GLOO is not None

    def destroy_model_parallel():
        dist.destroy_process_group(state._DATA_PARALLEL_GROUP_GLOO)  # megatron destroys its gloo groups itself
        state._DATA_PARALLEL_GROUP_GLOO = None

    state.destroy_model_parallel = destroy_model_parallel
    monkeypatch.setitem(sys.modules, "megatron.core.parallel_state", state)
    return state


@linux_only
def test_the_end_of_a_process_leaves_no_gloo_thread_and_says_nothing(one_rank_gloo, megatron_state):
    megatron_state._DATA_PARALLEL_GROUP_GLOO = dist.new_group([0], backend="gloo")
    megatron_state._INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_GLOO = dist.new_group([0], backend="gloo")
    assert teardown.gloo_threads() > 0  # each group's TCP loop and workers
    lines = []
    teardown.end_distributed(log=lines.append)
    assert not dist.is_initialized()
    assert megatron_state._INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_GLOO is None  # the forgotten global too
    assert teardown.gloo_threads() == 0 and lines == []


@linux_only
def test_a_group_still_held_at_the_end_is_reported_in_one_line(one_rank_gloo, megatron_state):
    held = [dist.new_group([0], backend="gloo")]  # a reference the teardown cannot know of
    lines = []
    teardown.end_distributed(log=lines.append)
    left = teardown.gloo_threads()
    assert left > 0
    assert lines == [f"zero-bubble: {left} gloo threads outlive the process groups' teardown (a reference to a group "
                     f"is still held); the process may abort as it exits"]
    held.clear()
    gc.collect()
    assert teardown.gloo_threads() == 0


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
