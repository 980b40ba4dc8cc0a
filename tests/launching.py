"""Starting the product as users start it, from the tests: the environment, torchrun.

    REPO, launch_environment(), torchrun_command(nproc, args), torchrun(nproc, args, timeout), child_result(args)
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

from megatron.zero_bubble.tools.local_ranks import TORCHRUN_ONE_MACHINE

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def launch_environment(**extra: str) -> dict:
    """This checkout first on the path, one intra-op thread per process (ranks share the cores), CPU only."""
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    env.pop("CUDA_VISIBLE_DEVICES", None)
    env.update(extra)
    return env


def torchrun_command(nproc: int, args: list[str]) -> list[str]:
    """torchrun on this machine; its agent's store takes a port of the kernel's choice (no race between launches)."""
    return [sys.executable, "-m", "torch.distributed.run", *TORCHRUN_ONE_MACHINE, "--nproc-per-node", str(nproc),
            *args]


def torchrun(nproc: int, args: list[str], timeout: float = 600, **env: str) -> subprocess.CompletedProcess:
    """`torchrun --nproc-per-node nproc ARGS...` in the repository, to its end (stdout and stderr captured)."""
    return subprocess.run(torchrun_command(nproc, args), cwd=REPO, env=launch_environment(**env),
                          capture_output=True, text=True, timeout=timeout)


def child_result(args: list[str], timeout: float = 120) -> dict:
    """`python ARGS...` in a process of its own (for what is process-wide: threads, gc, torch.compile), which must
    exit 0 and print one line `RESULT <json>`: that JSON."""
    done = subprocess.run([sys.executable, *args], cwd=REPO, env=launch_environment(), capture_output=True, text=True,
                          timeout=timeout)
    line = next((line for line in done.stdout.splitlines() if line.startswith("RESULT ")), None)
    assert done.returncode == 0 and line is not None, done.stdout[-2000:] + done.stderr[-3000:]
    return json.loads(line[len("RESULT "):])
