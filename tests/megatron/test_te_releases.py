"""The Transformer Engine split on TE's own modules (tests/megatron/te_split_cases.py), each release's Python in a
process of its own: the installed one (2.20.2, what megatron-core[te] brings) and one release of each other line of
the version table (docs/transformer-engine.md), first on PYTHONPATH. On the CPU they run over the labelled kernel
layer, whose names and enumeration members follow the release imported; on a GPU, on TE's own kernels.

A process of its own, because importing TE and patching it for the CPU is for the life of a process: the pytest
worker that runs the other files never imports TE. scripts/install.sh puts the other releases into .te-releases/.
"""
from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.launching import REPO, launch_environment

INSTALLED = "installed"
RELEASES = {"2.20": INSTALLED, "2.3 to 2.7": "2.5.0", "2.8 to 2.18": "2.12.0", "2.19": "2.19.0"}
CASES = Path(REPO) / "tests" / "megatron" / "te_split_cases.py"


def _installed() -> str:
    try:
        return importlib.metadata.version("transformer-engine")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("transformer-engine is not installed (scripts/install.sh installs its Python on the CPU)")


@pytest.mark.parametrize("line, release", RELEASES.items(), ids=list(RELEASES.values()))
def test_tes_modules_split_into_b_and_w_give_their_fused_gradients_on_a_release_of_each_line(line, release):
    env = launch_environment()
    if release == INSTALLED:
        release = _installed()
    else:
        target = Path(REPO) / ".te-releases" / release
        assert (target / "transformer_engine").is_dir(), f"transformer-engine {release} is not in {target}: run " \
                                                         f"scripts/install.sh"
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(target), env.get("PYTHONPATH")]))
    env["ZB_TE_RELEASE_UNDER_TEST"] = release
    done = subprocess.run([sys.executable, "-m", "pytest", "-v", "-m", "", "-p", "no:cacheprovider", "-p", "no:xdist",
                           str(CASES)], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "::test_the_release_under_test_is_the_one_asked_for PASSED" in done.stdout, done.stdout[-3000:]
    split = [line for line in done.stdout.splitlines() if "::test_te_modules_split_into_b_and_w" in line]
    assert any(" PASSED" in line for line in split), done.stdout[-3000:]
