"""pretrain_gpt.py processes end cleanly: single launches run to their end, as users run them (tests/megatron/exits.py).

A process that let its interpreter end with its gloo process groups alive aborted now and then after training,
evaluating and saving ("terminate called without an active exception", SIGABRT, torchrun exit status 1): a group's
worker thread that lagged took the GIL while the interpreter finalized (training/teardown.py). On an idle machine that
lag is rare, so the lagging worker is also injected (benchmarks/lagging_gloo_worker/), and a control shows that the
injection makes megatron's own ending abort, so that the test with the fix could fail. Every other launch of the
suite (pretrain_runs.py) is a single run too, and fails its tests unless torchrun exits with status 0.
"""
from __future__ import annotations

import sys

import pytest

from tests.launching import child_result
from tests.megatron import exits

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts threads by name in /proc")


def _end_of_a_process(scenario: str, tmp_path) -> dict:
    """tests/megatron/teardown_child.py in a process of its own (its gloo threads are counted process-wide)."""
    return child_result(["tests/megatron/teardown_child.py", scenario, str(tmp_path / "store")])


@linux_only
def test_the_end_of_a_process_leaves_no_gloo_thread_and_says_nothing(tmp_path):
    """megatron's groups, the one its destroy forgets, torch's: all destroyed, their threads joined, no line."""
    result = _end_of_a_process("all-destroyed", tmp_path)
    assert result["before"] > 0  # each group's TCP loop and workers
    assert not result["initialized"] and result["forgotten_global"]
    assert result["left"] == 0 and result["lines"] == []


@linux_only
def test_the_group_of_a_module_that_megatron_memoizes_at_class_level_is_destroyed_too(tmp_path):
    """RotaryEmbedding.forward is an lru_cache on the class: it keeps the module, and the module its group."""
    result = _end_of_a_process("rotary-cached", tmp_path)
    assert result["left"] == 0 and result["lines"] == [], result


@linux_only
def test_a_group_still_held_at_the_end_is_reported_in_one_line(tmp_path):
    result = _end_of_a_process("one-held", tmp_path)
    left = result["left"]
    assert left > 0
    assert result["lines"] == [f"zero-bubble: {left} gloo threads outlive the process groups' teardown (a reference "
                               f"to a group is still held); the process may abort as it exits"]
    assert result["after_release"] == 0


FROZEN_CHILD = """
import gc, json, sys
import torch
from megatron.zero_bubble.training import teardown

seen = {}

def main():
    seen["frozen"] = gc.get_freeze_count()
    cycle = []
    cycle.append(cycle)  # made by the run, dropped, a cycle: the collector must still find it
    del cycle
    seen["collected"] = gc.collect()

teardown.run_to_end(main)
print("RESULT " + json.dumps(seen))
"""


def test_what_the_script_imported_is_frozen_and_what_the_run_makes_is_still_collected():
    """run_to_end freezes the imported heap (torch here) before main: main's collections walk only what came since."""
    seen = child_result(["-c", FROZEN_CHILD])
    assert seen["frozen"] > 50_000  # torch's import alone leaves some 100,000 tracked objects
    assert seen["collected"] >= 1


def _assert_clean(launch: exits.Launch) -> None:
    assert launch.clean, f"{launch.summary()}\n{launch.output[-6000:]}"
    assert launch.finished_training, launch.output[-4000:]


@pytest.fixture
def lagging_worker(tmp_path):
    library = exits.build_lagging_worker(str(tmp_path))
    if library is None:
        pytest.skip("the lagging gloo worker needs a C compiler on Linux (cc or gcc)")
    return library


@pytest.mark.slow
def test_a_run_ends_cleanly_even_when_the_gloo_worker_of_its_last_collective_lags_until_the_end(lagging_worker,
                                                                                                   tmp_path):
    """The worker of each rank's last collective is held until the interpreter is about to finalize: pretrain_gpt.py
    destroys its groups first (joining that worker while the interpreter is whole), and ends with status 0. Under the
    same injection, megatron's ending (main() alone, the groups alive at the interpreter's end) aborts: the injection
    reproduces the failure, so this test would fail without the fix."""
    ours = exits.launch(str(tmp_path), "zb-h1", lagging_worker=lagging_worker)
    _assert_clean(ours)
    assert "gloo threads outlive" not in ours.output, ours.output[-3000:]  # every group's threads joined on every rank
    theirs = _megatrons_ending_under_the_injection(str(tmp_path), lagging_worker)
    assert theirs.finished_training and theirs.returncode != 0 and exits.TERMINATE in theirs.output, (
        "the injected lagging worker no longer aborts a process that ends with its groups alive (torch or CPython "
        f"may have changed how a thread that needs the GIL at finalization ends): {theirs.summary()}\n"
        + theirs.output[-3000:])


CONTROL_LAUNCHES = 3


def _megatrons_ending_under_the_injection(work: str, lagging_worker: str) -> exits.Launch:
    """The first of up to CONTROL_LAUNCHES launches of megatron's ending that aborts (else the last): the injection
    aborted 8 of 10 such launches in benchmarks/clean_exit.py, so one launch alone would fail the control now and
    then; three all ending cleanly would mean the injection no longer reproduces the abort."""
    for _ in range(CONTROL_LAUNCHES):
        launch = exits.launch(work, "zb-h1", ending="megatron", lagging_worker=lagging_worker)
        if launch.returncode != 0:
            break
    return launch
