"""A GPT on Transformer Engine's layers through the runtime, tensor for tensor against megatron's own schedules
(tests/megatron/te_gpt_cases.py), in a pytest process of its own: it installs TE's import hook before megatron is
imported, for the life of the process, which the pytest worker that runs the other files must not do."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.launching import REPO, launch_environment

CASES = Path(REPO) / "tests" / "megatron" / "te_gpt_cases.py"


@pytest.mark.slow
def test_a_gpt_on_tes_layers_trained_through_the_runtime_matches_megatrons_schedules_tensor_for_tensor():
    done = subprocess.run([sys.executable, "-m", "pytest", "-v", "-m", "", "-p", "no:cacheprovider", "-p", "no:xdist",
                           str(CASES)], cwd=REPO, env=launch_environment(), capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    outcomes = [re.match(r"\S*te_gpt_cases\.py::\S+ (PASSED|FAILED|ERROR|SKIPPED)", line)
                for line in done.stdout.splitlines()]
    outcomes = [m.group(1) for m in outcomes if m]
    assert outcomes and set(outcomes) == {"PASSED"}, done.stdout[-4000:]
