"""scripts/gpu_check.sh (megatron/zero_bubble/tools/gpu_check.py) without a GPU: one line and exit status 2 where
there is no CUDA; what it reads from megatron's and the runtime's output; the whole check on CPU (--cpu, tiny)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from megatron.zero_bubble.tools import gpu_check, launch_queue

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
    ("2.20.2", None), ("2.21.0", "2.21.0 is newer than the releases this split was checked against"),
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


def _queue_result(a_ms, b_end_ms, launch_gap_ms, connections, stand_in=False):
    return {"device": "a GPU", "stand_in": stand_in, "connections": connections, "sleep_ms": 20.0, "a_ms": a_ms,
            "b_end_ms": b_end_ms, "launch_gap_ms": launch_gap_ms, "b_ms": [0.004] * len(a_ms)}


def test_the_launch_queue_childs_result_is_read_from_its_output():
    result = _queue_result([20.0], [0.05], [0.01], "1")
    assert launch_queue.read_result(f"noise\n{launch_queue.RESULT_PREFIX}{json.dumps(result)}\nmore\n") == result
    assert launch_queue.read_result("Traceback (most recent call last):\n") is None


def test_b_waited_only_when_its_own_launch_to_end_spans_the_sleep():
    """B's end is timed from A's start: a late launch of B on the host is taken off before judging the wait."""
    result = _queue_result(a_ms=[20.0, 20.0, 20.0], b_end_ms=[20.02, 0.05, 15.03], launch_gap_ms=[0.01, 0.01, 15.0],
                           connections="1")
    assert launch_queue.launch_to_end_ms(result) == pytest.approx([20.01, 0.04, 0.03])
    assert launch_queue.waited(result) == [True, False, False]


WAITS = dict(a_ms=[20.0] * 3, b_end_ms=[20.02] * 3, launch_gap_ms=[0.01] * 3)
NO_WAIT = dict(a_ms=[20.0] * 3, b_end_ms=[0.05] * 3, launch_gap_ms=[0.01] * 3)


def _queue_rows(one, many):
    report = gpu_check.Report()
    gpu_check.check_launch_queue(report, {1: one, 32: many})
    return report.rows


def test_the_launch_queue_rows_report_the_expected_wait_without_a_verdict():
    rows = _queue_rows(_queue_result(**WAITS, connections="1"), _queue_result(**NO_WAIT, connections="32"))
    assert [(part, holds) for part, _, _, holds in rows] == [("f", None)] * 3
    assert "CUDA_DEVICE_MAX_CONNECTIONS=1" in rows[0][1] and rows[0][2].endswith("in 3 of 3")
    assert "CUDA_DEVICE_MAX_CONNECTIONS=32" in rows[1][1] and rows[1][2].endswith("in 0 of 3")
    assert rows[2][2].startswith("with 1 connection B waited behind A's second kernel, with 32 it did not")


def test_a_launch_queue_result_against_the_rule_is_said_plainly():
    one, many = _queue_result(**NO_WAIT, connections="1"), _queue_result(**NO_WAIT, connections="32")
    assert _queue_rows(one, many)[2][2].startswith("CONTRADICTS the launch-queue rule")
    assert gpu_check.launch_queue_contradicts({1: one, 32: many})
    both_wait = {1: _queue_result(**WAITS, connections="1"), 32: _queue_result(**WAITS, connections="32")}
    assert not gpu_check.launch_queue_contradicts(both_wait)
    assert "with 32 it waited too" in gpu_check.launch_queue_finding(both_wait)


@pytest.mark.parametrize("one, many, finding", [
    (_queue_result(**NO_WAIT, connections="1", stand_in=True),
     _queue_result(**NO_WAIT, connections="32", stand_in=True), "not measured: needs CUDA"),
    (None, _queue_result(**NO_WAIT, connections="32"), "not measured: a child process printed no result"),
    (_queue_result(**NO_WAIT, connections=None), _queue_result(**NO_WAIT, connections="32"),
     "not measured: the child for 1 connections saw CUDA_DEVICE_MAX_CONNECTIONS=None"),
])
def test_the_launch_queue_finding_is_not_measured_without_a_gpu_result_for_each_setting(one, many, finding):
    results = {1: one, 32: many}
    assert gpu_check.launch_queue_finding(results).startswith(finding)
    assert not gpu_check.launch_queue_contradicts(results)


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
def test_the_launch_queue_part_runs_its_labelled_stand_in_in_a_child_per_setting(cpu_check):
    """(f) on CPU: a child process per CUDA_DEVICE_MAX_CONNECTIONS setting, each seeing its own value (else the
    finding names the value it saw), its result read back into rows that say they come from a stand-in."""
    rows = [line for line in cpu_check.stdout.splitlines() if line.startswith("| f | ")]
    assert len(rows) == 3, rows
    for row, connections in zip(rows, gpu_check.LAUNCH_QUEUE_CONNECTIONS):
        assert f"CUDA_DEVICE_MAX_CONNECTIONS={connections}:" in row and launch_queue.STAND_IN_LABEL in row
        assert f"of {gpu_check.LAUNCH_QUEUE_REPS} | - |" in row
    assert "| not measured: needs CUDA" in rows[2] and rows[2].endswith("| - |")


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
