"""The Transformer Engine split checks on the Python of one release of each line of the version table
(docs/transformer-engine.md) that 2.20.2, the installed one, does not stand for: test_transformer_engine_split.py run
again with that release first on PYTHONPATH, over the CPU kernel layer, which follows each release's own names.

scripts/install.sh puts the releases into .te-releases/ (TE_RELEASES). Each run is one pytest process (about 10 s).
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.launching import REPO, launch_environment

RELEASES = {"2.3 to 2.7": "2.5.0", "2.8 to 2.18": "2.12.0", "2.19": "2.19.0"}
SPLIT_TESTS = Path(REPO) / "tests" / "megatron" / "test_transformer_engine_split.py"


@pytest.mark.parametrize("line, release", RELEASES.items(), ids=list(RELEASES.values()))
def test_the_split_checks_pass_on_the_python_of_a_release_of_each_line(line, release):
    target = Path(REPO) / ".te-releases" / release
    assert (target / "transformer_engine").is_dir(), f"transformer-engine {release} is not in {target}: run " \
                                                     f"scripts/install.sh"
    env = {**launch_environment(), "ZB_TE_RELEASE_UNDER_TEST": release,
           "PYTHONPATH": os.pathsep.join(filter(None, [str(target), launch_environment().get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-m", "pytest", "-v", "-m", "", "-p", "no:cacheprovider", "-p", "no:xdist",
                           str(SPLIT_TESTS)], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "::test_the_release_under_test_is_the_one_asked_for PASSED" in done.stdout, done.stdout[-3000:]
    split = [line for line in done.stdout.splitlines() if "::test_te_modules_split_into_b_and_w" in line]
    assert any(line.endswith("PASSED") or " PASSED " in line for line in split), done.stdout[-3000:]
