"""Markers by where a test lives, and skips by what the machine lacks (pytest.ini declares the markers).

- slow: every test under tests/megatron/ and tests/slurm/ (they start processes: forked ranks, torchrun, a SLURM
  cluster), and tests elsewhere that start processes, marked by hand. Plain `pytest` runs the rest, the quick
  subset (pytest.ini's addopts); `bash scripts/test.sh` runs everything.
- exactness: the harness's tensors compared bit for bit; CI runs them again under a second instruction set (.ci/run).
- cuda, transformer_engine: skipped, with the reason, where CUDA or Transformer Engine is missing.
"""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

SLOW_DIRECTORIES = {Path(__file__).parent / "megatron", Path(__file__).parent / "slurm"}

# megatron.core's first import asks git for a version suffix (a process started in every rank the suite launches);
# no test reads that string
os.environ.setdefault("NO_VCS_VERSION", "1")


def pytest_collection_modifyitems(items):
    missing = _missing_requirements(items)
    for item in items:
        if Path(item.fspath).parent in SLOW_DIRECTORIES:
            item.add_marker(pytest.mark.slow)
        for name, reason in missing.items():
            if item.get_closest_marker(name) is not None:
                item.add_marker(pytest.mark.skip(reason=reason))


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


@pytest.fixture
def one_rank_gloo(tmp_path):
    """torch.distributed initialised in this process as a gloo group of one rank (its WORLD group), for the test."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()
