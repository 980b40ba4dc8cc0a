"""pretrain_gpt.py processes end cleanly: single launches run to their end, as users run them (tests/megatron/exits.py).

A process that let its interpreter end with its gloo process groups alive aborted now and then after training,
evaluating and saving ("terminate called without an active exception", SIGABRT, torchrun exit status 1): a group's
worker thread that lagged took the GIL while the interpreter finalized (training/teardown.py). On an idle machine that
lag is rare, so the lagging worker is also injected (benchmarks/lagging_gloo_worker/), and a control shows that the
injection makes megatron's own ending abort, so that the test with the fix could fail. Every other launch of the
suite (pretrain_runs.py) is a single run too, and fails its tests unless torchrun exits with status 0.
"""
from __future__ import annotations

import pytest

from tests.megatron import exits


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
    theirs = exits.launch(str(tmp_path), "zb-h1", ending="megatron", lagging_worker=lagging_worker)
    assert theirs.finished_training and theirs.returncode != 0 and exits.TERMINATE in theirs.output, (
        "the injected lagging worker no longer aborts a process that ends with its groups alive (torch or CPython "
        f"may have changed how a thread that needs the GIL at finalization ends): {theirs.summary()}\n"
        + theirs.output[-3000:])
