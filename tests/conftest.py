"""Suite-wide markers by what a test does (pytest.ini declares them), and a line per launching fixture.

- launches: the test starts processes (forked gloo ranks, torchrun, SLURM jobs, a CLI in a subprocess). Found from
  the code (tests/markers.py reads the test, its fixtures and the test suite's functions they name); a test that
  starts processes through code of the project or a library carries @pytest.mark.launches itself. A test that
  starts a process without the mark fails (markers.ProcessGuard, during its set-up and its run).
- slow: every launching test, and tests marked slow by hand for their time. `-m "not slow"` is the quick subset:
  planning, schedules, the CLI and the patches in one process, no process started.
- cuda, transformer_engine: skipped, with the reason, where CUDA or Transformer Engine is missing.
- exactness: runs compared number for number; CI runs them again under a second instruction set (.ci/run). A
  fixture hands its marks to every test using it (markers.marks_tests).
Launches a fixture can start ahead (markers.starts_in_background) start once the tests are collected, if a selected
test needs them, and their module runs last: the rest of the suite runs beside them.
"""
from __future__ import annotations

import contextlib
import gc
import importlib.util
import os
import time

import pytest

from tests import markers

# megatron.core's first import asks git for a version suffix (a process, refused in a test without the `launches`
# mark, and started again in every rank this suite launches): its version string is not what any test reads
os.environ.setdefault("NO_VCS_VERSION", "1")


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by the marks added here
def pytest_collection_modifyitems(items):
    missing = _missing_requirements(items)
    for item in items:
        for fixture in _fixture_functions(item):
            for mark in getattr(fixture, "marks_tests", ()):
                item.add_marker(mark)
        if item.get_closest_marker("launches") is None and _launches(item):
            item.add_marker(pytest.mark.launches)
        if item.get_closest_marker("launches") is not None:
            item.add_marker(pytest.mark.slow)
        for name, reason in missing.items():
            if item.get_closest_marker(name) is not None:
                item.add_marker(pytest.mark.skip(reason=reason))
    _order_beside_the_background_launches(items)


def _order_beside_the_background_launches(items) -> None:
    """The launches of markers.starts_in_background run from collection on and keep both cores busy for minutes:
    the tests that start no process (one core) go first, beside them; then the launching ones; the modules whose
    launches started in the background last, and of those the tests that wait for a launch at the very end (the
    others of their modules run while the launches finish)."""
    waits = {item for item in items if any(hasattr(fixture, "background_start") for fixture in _fixture_functions(item))}
    late = {item.module for item in waits}
    items.sort(key=lambda item: (getattr(item, "module", None) in late, item in waits,
                                 item.get_closest_marker("launches") is not None))


def _fixture_functions(item) -> list:
    """The functions of every fixture the test uses (directly or through other fixtures)."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return []
    functions = [definitions[-1].func for definitions in info.name2fixturedefs.values() if definitions]
    return [function for function in functions if markers.ours(function)]


def _launches(item) -> bool:
    seen: set = set()
    function = getattr(item, "function", None)
    return any(markers.launches_processes(f, seen) for f in [function, *_fixture_functions(item)] if f is not None)


def _missing_requirements(items) -> dict[str, str]:
    """{marker: why its tests skip} for the requirements this machine lacks (torch is imported only if asked)."""
    missing = {}
    if any(item.get_closest_marker("cuda") for item in items):
        import torch

        if not torch.cuda.is_available():
            missing["cuda"] = "needs CUDA (torch.cuda.is_available() is False here)"
    if any(item.get_closest_marker("transformer_engine") for item in items):
        if importlib.util.find_spec("transformer_engine") is None:
            missing["transformer_engine"] = "needs Transformer Engine (transformer_engine is not installed)"
    return missing


# ---------------------------------------------------------------- launches started early


# Launches started when the tests were collected, stopped at that session's end. Kept in the session's own config:
# a pytest session run inside a test (pytester, with this conftest) must not stop the outer session's launches.
_BACKGROUND = pytest.StashKey[list]()


def pytest_collection_finish(session):
    """Start what the selected tests' fixtures can start ahead (markers.starts_in_background), so that it runs while
    the tests before them do (the 2-core machines' second core is often idle then)."""
    if session.config.option.collectonly:
        return
    # What collection imported (torch, megatron: millions of objects) lives as long as the session: out of the cyclic
    # collector's reach, so that its passes scan only what the tests make (planning tests allocate plenty)
    gc.collect()
    gc.freeze()
    starts = {}
    for item in session.items:
        for fixture in _fixture_functions(item):
            if getattr(fixture, "background_start", None) is not None:
                starts.setdefault(fixture.background_start, None)
    factory = session.config._tmp_path_factory  # pytest's own, as the tmp_path_factory fixture hands it out
    started = session.config.stash.setdefault(_BACKGROUND, [])
    for start in starts:
        started.extend(start(factory))


def pytest_sessionfinish(session):
    started = session.config.stash.get(_BACKGROUND, [])
    while started:
        started.pop().stop()


# ---------------------------------------------------------------- no unmarked process starts


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    return (yield from _guarded(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    return (yield from _guarded(item))


def _guarded(item):
    """Run the phase; without the `launches` mark, under the guard (teardown is not guarded: a fixture that stops
    a cluster may run a command at the end of any test of its module)."""
    if item.get_closest_marker("launches") is not None:
        return (yield)
    guard = markers.ProcessGuard()
    with guard.active():
        result = yield
    if guard.refused:
        raise markers.ProcessNotMarked("; ".join(guard.refused))
    return result


# ---------------------------------------------------------------- progress of long fixtures


@pytest.hookimpl(wrapper=True)
def pytest_fixture_setup(fixturedef, request):
    """One line per launching fixture when it is done (how long it took), so a long run shows where it is."""
    if not (markers.ours(fixturedef.func) and markers.launches_processes(fixturedef.func)):
        return (yield)
    start = time.monotonic()
    failed = ""
    try:
        return (yield)
    except BaseException:
        failed = " (failed)"
        raise
    finally:
        plugins = request.config.pluginmanager
        reporter, capture = plugins.get_plugin("terminalreporter"), plugins.get_plugin("capturemanager")
        if reporter is not None:
            where = request.node.nodeid.split("::")[0]
            with capture.global_and_fixture_disabled() if capture is not None else contextlib.nullcontext():
                reporter.write_line(f"[{where}] {fixturedef.argname}: {time.monotonic() - start:.0f} s{failed}")
