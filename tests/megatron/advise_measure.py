"""One tiny advise line (tests/advise_lines.py) trained under torchrun and predicted by `zb-schedule advise --json`:
what test_advise_measured.py checks and benchmarks/advise_memory.py prints.

    measure(name) -> Measured: model state and peak per pipeline rank, measured and predicted (bytes)
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
from dataclasses import dataclass

from tests.advise_lines import tiny_line
from tests.launching import REPO, launch_environment, torchrun_command

MIB = 2**20
TOLERANCE = 0.10
MEMORY_LINE = re.compile(r"zero-bubble: memory per device in iteration \d+: model state .*?\) ([0-9., ]+) MiB, "
                         r"peak with the activations ([0-9., ]+) MiB")


@dataclass
class Measured:
    processes: int
    schedule: str
    state: list[float]
    peak: list[float]
    predicted_state: list[float]
    predicted_peak: list[float]


def measure(name: str) -> Measured:
    processes, schedule, words = tiny_line(name)
    state, peak = _measured(processes, words)
    row = _predicted(processes, schedule, words)
    return Measured(processes, schedule, state, peak, [sum(part.values()) for part in row["model_state_per_rank"]],
                    row["peak_bytes_per_rank"])


def _figures(text: str) -> list[float]:
    return [float(value) * MIB for value in text.split(",")]


def _measured(processes: int, words: list[str]) -> tuple[list[float], list[float]]:
    """(model state, peak) per pipeline rank as pretrain_gpt.py's memory report prints them."""
    done = subprocess.run(torchrun_command(processes, ["pretrain_gpt.py", *words]), cwd=REPO, env=launch_environment(),
                          capture_output=True, text=True, timeout=900)
    output = done.stdout + done.stderr
    match = MEMORY_LINE.search(output)
    assert done.returncode == 0 and match, output[-4000:]
    return _figures(match.group(1)), _figures(match.group(2))


def _predicted(processes: int, schedule: str, words: list[str]) -> dict:
    done = subprocess.run([sys.executable, "-m", "megatron.zero_bubble.cli", "advise", "--json", "--world-size",
                           str(processes), "--", *words], cwd=REPO, env=launch_environment(), capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    return next(row for row in json.loads(done.stdout)["schedules"] if row["label"] == schedule)
