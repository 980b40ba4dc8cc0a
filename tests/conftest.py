"""Suite-wide: the `slow` and `exactness` markers, and a line per process launch.

Tests that need a fixture in LAUNCHING_FIXTURES (spawned gloo ranks, torchrun, a SLURM cluster) and every
test of a module in LAUNCHING_MODULES are marked `slow` here; other tests that launch ranks themselves
carry `@pytest.mark.slow`. `pytest -m "not slow"` runs the rest (planning, schedules, CLI, patches in one
process). Each launching fixture prints one line
when it is done (how long it took), so a long run shows where it is beyond pytest's dots.
"""
from __future__ import annotations

import time

import pytest

LAUNCHING_FIXTURES = frozenset({
    "core_runs",  # tests/megatron/test_cpu_backend.py: 4 forked ranks, every core layout
    "reports",  # test_runtime_exactness.py, test_post_validation.py: 4 forked ranks, every case
    "v_run",  # test_vshape_layout.py: 2 and 4 forked ranks
    "spawned",  # test_wgrad_split.py: 2 forked ranks
    "runs", "refusals",  # test_pretrain_gpt.py: torchrun and python launches
    "slurm_cluster",  # tests/slurm: a local SLURM cluster and its jobs
})

# Modules whose tests start torchrun or the training script one by one (seconds to minutes each).
LAUNCHING_MODULES = frozenset({"tests/megatron/test_pretrain_gpt.py"})

# Fixtures whose runs the tests compare number for number (torch.equal, or megatron's printed losses to the last
# digit), and modules that do so in-process: the `exactness` marker, which CI runs a second time under another
# instruction set (.ci/run), since kernels of another vector width sum in another order.
EXACTNESS_FIXTURES = frozenset({"core_runs", "reports", "v_run", "spawned", "runs"})
EXACTNESS_MODULES = frozenset({"tests/test_optimizer_rollback.py"})


def pytest_collection_modifyitems(items):
    for item in items:
        module = item.nodeid.split("::")[0]
        fixtures = set(getattr(item, "fixturenames", ()))
        if module in LAUNCHING_MODULES or LAUNCHING_FIXTURES & fixtures:
            item.add_marker(pytest.mark.slow)
        if module in EXACTNESS_MODULES or EXACTNESS_FIXTURES & fixtures:
            item.add_marker(pytest.mark.exactness)


@pytest.hookimpl(hookwrapper=True)
def pytest_fixture_setup(fixturedef, request):
    if fixturedef.argname not in LAUNCHING_FIXTURES:
        yield
        return
    start = time.monotonic()
    outcome = yield
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        failed = " (failed)" if outcome.excinfo is not None else ""
        where = request.node.nodeid.split("::")[0]
        reporter.write_line(f"[{where}] {fixturedef.argname}: {time.monotonic() - start:.0f} s{failed}")
