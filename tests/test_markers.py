"""The suite's markers (tests/markers.py, applied by conftest.py): which tests start processes, found from their code,
and the guard that fails a test starting one without the mark. Nothing here starts a process."""
from __future__ import annotations

import multiprocessing
import multiprocessing.process
import subprocess

import pytest

from tests import markers
from tests.megatron import harness


def _runs_a_command():
    return subprocess.run(["true"], check=True)


def _through_a_helper():
    return _runs_a_command()


def _spawns_ranks():
    return harness.spawn(print, 2)


def _imports_subprocess_inside():
    import subprocess as sp

    return sp.check_output(["true"])


def _plans_only():
    from megatron.zero_bubble.schedules.handcrafted import zb_h1

    return zb_h1(4, 8)


@pytest.mark.parametrize("function", [_runs_a_command, _through_a_helper, _spawns_ranks, _imports_subprocess_inside])
def test_code_that_starts_processes_directly_or_through_the_suites_helpers_is_found(function):
    assert markers.launches_processes(function)


def test_code_that_starts_none_is_not_marked():
    assert not markers.launches_processes(_plans_only)
    assert not markers.launches_processes(test_code_that_starts_none_is_not_marked)


def test_the_launching_fixtures_and_tests_of_the_suite_are_found(request):
    """A fixture that forks gloo ranks through the harness, one that starts torchrun, a SLURM cluster: marked from
    their code (the list conftest kept by hand missed test_rehearsal.py's 16 processes)."""
    from tests.megatron import test_pretrain_gpt, test_runtime_exactness
    from tests.slurm import test_slurm_launcher

    for fixture in (test_runtime_exactness.reports, test_pretrain_gpt.runs, test_slurm_launcher.jobs):
        assert markers.launches_processes(getattr(fixture, "__wrapped__", fixture)), fixture
    assert request.node.get_closest_marker("launches") is None  # and this test, which starts none, is quick


def test_the_guard_refuses_a_subprocess_and_a_multiprocessing_start_and_remembers_them():
    guard, originals = markers.ProcessGuard(), (subprocess.Popen._execute_child, multiprocessing.process.BaseProcess.start)
    with guard.active():
        with pytest.raises(markers.ProcessNotMarked, match="not marked `launches`"):
            subprocess.run(["true"])
        with pytest.raises(markers.ProcessNotMarked):
            multiprocessing.get_context("spawn").Process(target=print).start()
    assert len(guard.refused) == 2 and "true" in guard.refused[0]
    assert (subprocess.Popen._execute_child, multiprocessing.process.BaseProcess.start) == originals  # restored


def test_the_guard_lets_a_librarys_own_probes_pass():
    assert markers.ProcessGuard._describe_popen(None, ["fc-list", "--format=%{file}"]) is None
    assert markers.ProcessGuard._describe_popen(None, "uname -p") is None
    assert markers.ProcessGuard._describe_popen(None, ["python", "-c", "1"]) is not None


def test_tests_that_need_cuda_or_transformer_engine_skip_with_the_reason_where_it_is_missing(pytester, monkeypatch):
    """conftest.py's marks in a session of their own (in this process): each test runs where its requirement is met
    and is skipped, saying what is missing, where it is not."""
    import importlib.util

    import torch

    pytester.makeconftest("from tests.conftest import *  # noqa: F401,F403 (this suite's hooks)")
    pytester.makepyfile(test_needs="""
        import pytest

        @pytest.mark.cuda
        def test_on_cuda():
            import torch
            assert torch.cuda.is_available()

        @pytest.mark.transformer_engine
        def test_with_transformer_engine():
            import transformer_engine  # noqa: F401
    """)
    # installed plugins stay out (pytest-benchmark, where installed, runs git as it loads: a process this test may
    # not start)
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    result = pytester.runpytest_inprocess("-rs", "-p", "no:cacheprovider")
    have = {"cuda": torch.cuda.is_available(), "te": importlib.util.find_spec("transformer_engine") is not None}
    result.assert_outcomes(passed=sum(have.values()), skipped=2 - sum(have.values()))
    if not have["cuda"]:
        result.stdout.fnmatch_lines(["*needs CUDA (torch.cuda.is_available() is False here)*"])
    if not have["te"]:
        result.stdout.fnmatch_lines(["*needs Transformer Engine (transformer_engine is not installed)*"])


def test_a_pytest_session_inside_a_test_leaves_the_suites_background_launches_running(pytester, request, monkeypatch):
    """A session run by pytester with this suite's conftest ends with its pytest_sessionfinish: that must stop only
    what that session started, not the pretrain driver this session started in the background."""
    from tests import conftest

    class Launch:
        stopped = False

        def stop(self):
            self.stopped = True

    launch = Launch()
    started = request.config.stash.setdefault(conftest._BACKGROUND, [])
    started.append(launch)
    try:
        pytester.makeconftest("from tests.conftest import *  # noqa: F401,F403 (this suite's hooks)")
        pytester.makepyfile(test_inner="def test_inner():\n    pass\n")
        monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
        pytester.runpytest_inprocess("-p", "no:cacheprovider").assert_outcomes(passed=1)
        assert not launch.stopped
    finally:
        started.remove(launch)
