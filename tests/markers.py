"""Which tests start processes, found from their code; a guard that fails a test that starts one unmarked; marks that
a fixture hands to every test using it.

conftest.py applies them: `launches_processes(function)` reads a test's (or fixture's) code and that of the test
suite's own functions it names, transitively (tests/ only: what a library does inside is not read), and says
whether any of it uses subprocess, multiprocessing, torch.multiprocessing or os.fork/system/posix_spawn.
`ProcessGuard` stops a test without the `launches` mark from starting a process through any route (a library
call too), so a missed case fails instead of slipping into the quick subset.
"""
from __future__ import annotations

import contextlib
import inspect
import multiprocessing.process
import os
import subprocess
import sys
import types

LAUNCHING_MODULES = frozenset({"subprocess", "multiprocessing", "torch.multiprocessing", "asyncio.subprocess"})
LAUNCHING_OS_CALLS = frozenset({"fork", "forkpty", "system", "popen", "posix_spawn", "posix_spawnp",
                                "spawnv", "spawnve", "spawnvp", "spawnvpe", "spawnl", "spawnle", "spawnlp", "spawnlpe"})
# Helpers libraries run as part of their own work (matplotlib's font cache lists fonts, platform asks uname): no
# test's doing, and quick to run.
LIBRARY_PROBES = frozenset({"fc-list", "uname", "ldconfig", "nvidia-smi", "lsb_release"})
TEST_PACKAGE = "tests"
CONSTRUCTION = frozenset({"__new__", "__init__", "__post_init__", "__enter__", "__call__"})


def marks_tests(*marks):
    """Decorates a fixture function (beneath @pytest.fixture): every test that uses the fixture, directly or through
    other fixtures, gets `marks` (conftest.py adds them at collection)."""

    def decorate(function):
        function.marks_tests = marks
        return function

    return decorate


def starts_in_background(start):
    """Decorates a fixture function (beneath @pytest.fixture) whose launches may run beside other tests:
    `start(tmp_path_factory) -> [launch with .stop()]` is called by conftest.py once the tests are collected, if a
    selected test uses the fixture (the fixture then finds them started); whatever it started is stopped at the
    session's end."""

    def decorate(function):
        function.background_start = start
        return function

    return decorate


# ---------------------------------------------------------------- reading the code


def launches_processes(function, seen: set | None = None) -> bool:
    """Whether `function`'s code, or that of a function or class of the test suite it names, starts processes."""
    seen = set() if seen is None else seen
    function = inspect.unwrap(function)
    code = getattr(function, "__code__", None)
    if code is None or code in seen:
        return False
    seen.add(code)
    namespace = getattr(function, "__globals__", {})
    names = _names(code)
    # a global, or a module imported inside the function (its dotted name is among the names)
    values = [namespace[name] if name in namespace else sys.modules.get(name) for name in names]
    return any(_is_launcher(value) or _launches_through(value, names, seen) for value in values if value is not None)


def _names(code: types.CodeType) -> set[str]:
    """Global and attribute names the code (nested functions, lambdas and comprehensions included) refers to."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _names(const)
    return names


def _is_launcher(value) -> bool:
    if isinstance(value, types.ModuleType):
        return value.__name__ in LAUNCHING_MODULES
    module = getattr(value, "__module__", None) or ""
    return any(module == name or module.startswith(name + ".") for name in LAUNCHING_MODULES)


def _launches_through(value, names: set[str], seen: set) -> bool:
    """Through a function or class of the test suite (its code read in turn), or an attribute the code names of a
    module: a launching one (`torch.multiprocessing`), os's calls that start processes, the test suite's members."""
    if isinstance(value, types.ModuleType):
        if value is os:
            return bool(names & LAUNCHING_OS_CALLS)
        key = (value.__name__, frozenset(names))  # another function may name other members of the module
        if key in seen:
            return False
        seen.add(key)
        attributes = [getattr(value, name, None) for name in names]
        return any(_is_launcher(a) for a in attributes if isinstance(a, types.ModuleType)) or (
            ours(value) and any(_launches_through(a, names, seen) for a in attributes if a is not None))
    if inspect.isclass(value) and ours(value):  # the methods the code names, and those that making one calls
        members = [vars(value).get(name) for name in names | CONSTRUCTION]
        members = [getattr(member, "__func__", member) for member in members if member is not None]  # static methods
        return any(launches_processes(member, seen) for member in members if inspect.isfunction(member))
    return inspect.isfunction(value) and ours(value) and launches_processes(value, seen)


def ours(value) -> bool:
    """Whether a module, function or class belongs to the test suite."""
    name = value.__name__ if isinstance(value, types.ModuleType) else getattr(value, "__module__", None) or ""
    return name == TEST_PACKAGE or name.startswith(TEST_PACKAGE + ".")


# ---------------------------------------------------------------- the guard


class ProcessGuard:
    """While active, every way of starting a process raises (and is remembered): subprocess, multiprocessing (so
    torch.multiprocessing), os.fork, os.system, os.posix_spawn. Library probes (LIBRARY_PROBES) pass."""

    def __init__(self):
        self.refused: list[str] = []

    @contextlib.contextmanager
    def active(self):
        with contextlib.ExitStack() as stack:
            self._wrap(stack, subprocess.Popen, "_execute_child", self._describe_popen)
            self._wrap(stack, multiprocessing.process.BaseProcess, "start", lambda process, *a, **k: repr(process))
            for name in ("fork", "forkpty", "system", "posix_spawn", "posix_spawnp"):
                if hasattr(os, name):
                    self._wrap(stack, os, name, lambda *a, _name=name, **k: f"os.{_name}{a[:2]!r}")
            yield self

    def _wrap(self, stack: contextlib.ExitStack, owner, name: str, describe) -> None:
        original = getattr(owner, name)

        def refuse(*args, **kwargs):
            what = describe(*args, **kwargs)
            if what is None:
                return original(*args, **kwargs)
            self.refused.append(what)
            raise ProcessNotMarked(what)

        setattr(owner, name, refuse)
        stack.callback(setattr, owner, name, original)

    @staticmethod
    def _describe_popen(popen, args, *rest, **kwargs) -> str | None:
        argv = [args] if isinstance(args, (str, bytes, os.PathLike)) else list(args)
        program = os.path.basename(os.fsdecode(argv[0])).split()[0] if argv else ""
        return None if program in LIBRARY_PROBES else f"subprocess {argv[:6]!r}"


class ProcessNotMarked(RuntimeError):
    def __init__(self, what: str):
        super().__init__(f"this test started a process ({what}) but is not marked `launches`: it reaches it through "
                         f"code tests/markers.py does not read; mark it @pytest.mark.launches")
