"""scripts/gpu_check.sh (megatron/zero_bubble/tools/gpu_check.py) without a GPU: one line and exit status 2 where
there is no CUDA; what it reads from megatron's and the runtime's output; the whole check on CPU (--cpu, tiny)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from megatron.zero_bubble.tools import gpu_check

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _script(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHON=sys.executable, CUDA_VISIBLE_DEVICES="")
    return subprocess.run(["bash", "scripts/gpu_check.sh", *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.slow  # starts the tool
def test_without_cuda_it_says_so_in_one_line_and_exits_2():
    done = _script()
    assert done.returncode == gpu_check.EXIT_NO_CUDA
    assert done.stdout == "" and done.stderr.count("\n") == 1
    assert done.stderr.startswith("gpu_check: no CUDA device here")


@pytest.mark.parametrize("version, reason", [
    ("not installed", "transformer-engine is not installed"), ("2.19.0", None), ("2.8.0+40c69e75", None),
    ("2.20.0", "2.20.0 is newer than the releases this split was checked against"),
])
def test_transformer_engine_layers_are_checked_only_with_a_version_the_split_accepts(version, reason):
    found = gpu_check.transformer_engine_refusal(version)
    assert found == reason if reason is None else reason in found


def test_losses_are_read_as_megatron_prints_them():
    out = ("iteration        1/      20 | consumed samples: 16 | elapsed time per iteration (ms): 80.1 | lm loss: "
           "4.876812E+00 | loss scale: 1.0 |\n"
           " [2026-11-25] iteration       2/      20 | lm loss: 4.771300E+00 | grad norm: 1.2 |\n")
    assert gpu_check.losses(out) == {1: "4.876812E+00", 2: "4.771300E+00"}


def test_the_split_check_line_and_memory_report_are_found():
    out = ("noise\nzero-bubble: split check: passed, 17 layers split into B and W on 2 ranks (...)\n"
           "[Rank 3] (after 2 iterations) memory (MB) | allocated: 100.50 | max allocated: 612.25 | reserved: 700.00 "
           "| max reserved: 700.00\n")
    assert gpu_check.split_check_line(out).startswith("zero-bubble: split check: passed")
    assert gpu_check.split_check_line("pretrain_gpt.py: error: zero-bubble: split check failed on rank 1, x") == \
        "zero-bubble: split check failed on rank 1, x"
    assert gpu_check.memory_peaks(out) == {3: 511.75}


def test_executor_gaps_are_the_waits_before_w_passes(tmp_path):
    trace = {"traceEvents": [
        {"ph": "M", "name": "thread_name", "pid": 0, "tid": 0},
        {"ph": "X", "name": "F0", "pid": 0, "tid": 0, "ts": 0.0, "dur": 100.0},
        {"ph": "X", "name": "B0", "pid": 0, "tid": 0, "ts": 150.0, "dur": 100.0},
        {"ph": "X", "name": "W0", "pid": 0, "tid": 0, "ts": 260.0, "dur": 50.0},
        {"ph": "X", "name": "W1", "pid": 0, "tid": 1, "ts": 40.0, "dur": 5.0},
        {"ph": "X", "name": "F1", "pid": 0, "tid": 1, "ts": 0.0, "dur": 30.0},
    ]}
    path = tmp_path / "t.json"
    path.write_text(json.dumps(trace))
    assert sorted(gpu_check.executor_gaps_us(str(path))) == [10.0, 10.0]


def test_the_table_holds_only_when_every_verdict_of_a_part_holds():
    report = gpu_check.Report({"torch": "2.13.0"})
    report.add("a", "layer", "bit-identical", True)
    report.add("c", "ratio", "1.01", None)
    assert report.holds("a") and not report.holds("b") and not report.holds("c")
    report.add("a", "model", "differs", False)
    assert not report.holds("a")
    table = report.table()
    assert table.splitlines()[0] == "versions: torch 2.13.0" and "| a | model | differs | NO |" in table


def test_the_model_suits_two_chunks_per_rank_at_every_pipeline_size():
    """zb-auto-2chunks: 2p virtual stages need the layers to divide by them, interleaving needs m a multiple of p."""
    assert any(name == "zb-auto-2chunks" and "--num-virtual-stages-per-pipeline-rank" in flags
               for name, flags in gpu_check.SCHEDULES)
    for gpus in range(2, 9):
        sizes = gpu_check.Sizes(gpus, iterations=3)
        assert sizes.layers % (2 * gpus) == 0
        assert (sizes.global_batch // sizes.micro_batch) % gpus == 0


@pytest.fixture(scope="module")
def cpu_check(tmp_path_factory):
    """The whole check on CPU, once for the module's tests."""
    out = str(tmp_path_factory.mktemp("gpu_check_cpu"))
    return _script("--cpu", "--iterations", "3", "--reps", "1", "--schedules", "zb-h1", "--out", out, timeout=900)


@pytest.mark.slow
def test_every_part_runs_on_cpu_and_the_check_holds(cpu_check):
    """One zero-bubble schedule (the others are the same launch with another flag): 2 pretrain_gpt.py launches."""
    done = cpu_check
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("| ")]
    assert any(line.startswith("| a | local layer tiny") and line.endswith("| yes |") for line in rows)
    assert any(line.startswith("| a | zb-h1 start-up split check on the whole model | zero-bubble: split check: "
                               "passed, 33 layers split into B and W on 2 ranks") for line in rows), rows
    assert any(line.startswith("| b | zb-h1, PP=2, vs 1F1B | identical losses at all 3 iterations") for line in rows)
    assert any(line.startswith("| d | executor time before a W pass (zb-h1") and "µs over" in line for line in rows), rows
    assert done.stdout.rstrip().endswith("gpu_check: (a) and (b) hold")


@pytest.mark.slow
def test_the_one_gpu_mode_is_rehearsed_on_cpu_against_a_single_rank_run(tmp_path):
    """The one-GPU mode's launches (two pipeline ranks against megatron on one rank, untied embeddings) on CPU: what
    a lent GPU runs, minus the card; zb-auto over two chunks per rank and ZB-V, the two with 2p virtual stages."""
    done = _script("--cpu", "--one-gpu", "--iterations", "3", "--reps", "1", "--schedules", "zb-auto-2chunks,zb-v",
                   "--out", str(tmp_path), timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("| b | ")]
    assert rows == [f"| b | {name}, PP=2, vs megatron on one rank (PP=1) | identical losses at all 3 iterations | yes |"
                    for name in ("zb-auto-2chunks", "zb-v")]
    assert "--untie-embeddings-and-output-weights" in (tmp_path / "pretrain-pp1.log").read_text().splitlines()[0]
    two_chunks = (tmp_path / "pretrain-zb-auto-2chunks.log").read_text()
    assert "Number of virtual stages per pipeline stage: 2" in two_chunks  # megatron built two chunks per rank
