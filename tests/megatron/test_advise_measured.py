"""`zb-schedule advise` against what training measures: tiny CPU versions of the four example command lines
(tests/advise_lines.py: Llama 3 8B, GPT-3 175B, Mixtral 8x7B, a DeepSeek-like MoE with expert parallelism) train
with pretrain_gpt.py under torchrun; its memory report (runtime/memory_report.py) gives each pipeline rank's model
state (the tensors alive as a forward-backward call starts) and its peak with the activations (the allocator after
each pass, the largest over data-parallel replicas). `zb-schedule advise --json` on the same command line must
predict every pipeline rank's peak within 10%.

The Llama-like line uses learned absolute positions (--position-embedding-type learned_absolute): rotary embeddings
do not run on the CPU here.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from tests.advise_lines import TINY, tiny_line
from tests.launching import REPO, launch_environment, torchrun_command

pytestmark = pytest.mark.slow
MIB = 2**20
TOLERANCE = 0.10
MEMORY_LINE = re.compile(r"zero-bubble: memory per device in iteration \d+: model state .*?\) ([0-9., ]+) MiB, "
                         r"peak with the activations ([0-9., ]+) MiB")


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


@pytest.mark.parametrize("name", sorted(TINY))
def test_predicted_peak_per_gpu_is_within_ten_percent_of_the_measured(name):
    processes, schedule, words = tiny_line(name)
    state, peak = _measured(processes, words)
    row = _predicted(processes, schedule, words)
    predicted_state = [sum(part.values()) for part in row["model_state_per_rank"]]
    predicted = row["peak_bytes_per_rank"]
    print(f"\n{name} ({schedule}): measured model state {[round(v / MIB, 1) for v in state]} MiB, peak "
          f"{[round(v / MIB, 1) for v in peak]} MiB; predicted model state "
          f"{[round(v / MIB, 1) for v in predicted_state]} MiB, peak {[round(v / MIB, 1) for v in predicted]} MiB; "
          f"error {[f'{(p - m) / m:+.1%}' for p, m in zip(predicted, peak)]}")
    assert len(predicted) == len(peak)
    for rank, (got, expected) in enumerate(zip(peak, predicted)):
        assert abs(expected - got) <= TOLERANCE * got, (name, rank, got, expected)
