"""What `zb-schedule` prints: machine-readable stdout with the ILP on, units on every figure, legends.

The ILP runs in these commands (p=4, m=4 under a limit of 2 microbatches: the heuristic's span 22 is above
the bound and HiGHS proves 21 optimal in about a second), so the solver's banner would show if it reached stdout. The
commands run as subprocesses because HiGHS writes from C++, past Python's sys.stdout.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from megatron.zero_bubble.schedules.costs import Costs
from megatron.zero_bubble.schedules.draw import comparison_table, describe_memory, simulation_report, summary
from megatron.zero_bubble.schedules.handcrafted import zb_h1
from megatron.zero_bubble.schedules.simulate import simulate

ILP_CASE = ["--schedule", "zb-auto", "--stages", "4", "--microbatches", "4", "--memory-limit", "2",
            "--ilp-time-limit", "10"]


pytestmark = pytest.mark.slow  # every command runs as a process


def _run(*argv: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "megatron.zero_bubble.cli", *argv]
    return subprocess.run(command, capture_output=True, text=True, timeout=120, check=True)


def test_export_with_the_ilp_prints_only_json_and_the_ilp_did_run():
    out = _run("export", *ILP_CASE).stdout
    plan = json.loads(out)
    assert not plan["planner"]["ilp"].startswith("skipped")  # HiGHS ran (on an idle machine: 22 -> 21)
    assert "HiGHS" not in out


@pytest.mark.parametrize("command", [["simulate", *ILP_CASE], ["draw", *ILP_CASE],
                                     ["compare", *[a if a != "--schedule" else "--schedules" for a in ILP_CASE]]])
def test_no_subcommand_lets_the_solver_write_to_stdout(command):
    result = _run(*command)
    assert "HiGHS" not in result.stdout and "Copyright" not in result.stdout
    assert "HiGHS" not in result.stderr  # the solver's log is off, not moved


def test_every_time_in_the_simulation_report_carries_its_unit():
    report = simulation_report(simulate(zb_h1(4, 8), Costs.make(4, t_f=2.0, t_b=2.0, t_w=1.0)))
    assert "makespan: 49 ms" in report  # m(T_F+T_B+T_W) + (p-1)(T_F+T_B-T_W) = 40 + 9
    assert "(ms)" in report.splitlines()[6]  # the units line under the per-rank column names
    assert "M_B: one microbatch's activation memory on one rank" in report


def test_model_shape_costs_are_in_milliseconds_like_pass_times():
    out = _run("simulate", "--schedule", "1f1b", "--model", "1.5b", "-m", "8").stdout
    makespan, unit = re.search(r"^makespan: (\S+) (\S+)", out, re.MULTILINE).groups()
    makespan = float(makespan)
    # (m + p - 1) passes of about 18.5 + 18.1 + 9.3 ms each on the paper's 1.5B model
    assert unit == "ms" and 300 < makespan < 1500


def test_comparison_table_explains_each_column_and_names_units():
    costs = Costs.make(4, t_f=1.0, t_b=1.0, t_w=1.0)
    table = comparison_table([("zb-h1", simulate(zb_h1(4, 8), costs), 0.01)])
    assert "bubble (span): idle share of each rank between its own first and last pass" in table
    assert "bubble (t=0): idle share of every rank from time 0" in table
    assert " ms " in table.splitlines()[1] and table.splitlines()[1].rstrip().endswith(" s")
    assert "in M_B (one microbatch's activations on one rank)" in table


def test_small_byte_peaks_are_shown_in_mib_not_as_zero_gib():
    assert describe_memory(3 * 2**20, "bytes") == "3 MiB"
    assert describe_memory(1.5 * 2**30, "bytes") == "1.5 GiB"
    costs = Costs.make(2, m_f=[5e6, 5e6], memory_unit="bytes")
    title = summary(simulate(zb_h1(2, 2), costs))
    assert "0.00 GiB" not in title and "MiB" in title and "makespan" in title and " ms;" in title
