"""The cases of a harness test module in a process of their own, started beside the other tests.

A module whose fixture runs `harness.run_cases` for a minute or more can start it once the tests are collected
(markers.starts_in_background), at idle priority like the suite's other background launches: it then takes the
cores the tests in the foreground leave idle (ranks waiting on each other, tests on one core) instead of running
after them.

Parent side (imports nothing of megatron):
    CasesInBackground(name, module, world_size, timeout)
        .launches(tmp_path_factory) -> [Background]   starts `python -m tests.megatron.background_cases ...` once
        .results(tmp_path_factory) -> {label: [each rank's report]}   waits; a failed run raises with its output
        .stop()
As a script: run_cases(MODULE._run_case, MODULE.CASES, WORLD_SIZE), the reports saved with torch.save.
"""
from __future__ import annotations

import importlib
import os
import sys

from tests.megatron.pretrain_driver import Background

TAIL_CHARS = 6000


class CasesInBackground:
    """One launch of a module's cases per session, started by whichever asks first: conftest.py once the tests are
    collected, or the module's fixture."""

    def __init__(self, name: str, module: str, world_size: int, timeout: float):
        self.name, self.module, self.world_size, self.timeout = name, module, world_size, timeout
        self.launch: Background | None = None
        self.out = ""

    def launches(self, tmp_path_factory) -> list[Background]:
        if self.launch is None:
            work = str(tmp_path_factory.mktemp(self.name))
            self.out = os.path.join(work, "reports.pt")
            command = [sys.executable, "-m", __name__, self.module, str(self.world_size), str(self.timeout), self.out]
            self.launch = Background(self.name, command, work, self.timeout + 60)
        return [self.launch]

    def results(self, tmp_path_factory) -> dict:
        import torch

        (launch,) = self.launches(tmp_path_factory)
        done = launch.result()
        if done.returncode != 0:
            ended = "timed out" if done.returncode is None else f"exited with {done.returncode}"
            raise AssertionError(f"the cases of {self.module} {ended}:\n{done.stdout[-TAIL_CHARS // 3:]}\n"
                                 f"{done.stderr[-TAIL_CHARS:]}")
        return torch.load(self.out, weights_only=False)

    def stop(self) -> None:
        if self.launch is not None:
            self.launch.stop()
            self.launch = None


def main(module_name: str, world_size: str, timeout: str, out: str) -> None:
    import torch

    from tests.megatron import harness

    module = importlib.import_module(module_name)
    reports = harness.run_cases(module._run_case, module.CASES, int(world_size), timeout=float(timeout))
    torch.save(reports, out)


if __name__ == "__main__":
    main(*sys.argv[1:])
