"""The `zb-schedule` command and the schedule pictures: round trips, printed figures, one-line errors."""
from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from megatron.zero_bubble.schedules import Costs, Schedule, simulate, validate
from megatron.zero_bubble.schedules.baselines import one_f_one_b
from megatron.zero_bubble.cli import main
from megatron.zero_bubble.commands.options import Progress as _Progress, parse_memory_limit
from megatron.zero_bubble.schedules.draw import draw, render_text
from megatron.zero_bubble.schedules.planners import PlanRequest, plan

REPO = Path(__file__).resolve().parent.parent


def run(argv, capsys):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_export_round_trips_through_from_json_and_passes_validate(tmp_path, capsys):
    path = tmp_path / "plan.json"
    code, _, err = run(["export", "--schedule", "1f1b", "-p", 4, "-m", 8, "--t-b", 2, "-o", path], capsys)
    assert code == 0, err
    schedule = Schedule.from_json(path.read_text())
    costs = Costs.from_dict(schedule.info["costs"])
    assert costs.t_b == (2.0,) * 4
    timeline = validate(schedule, costs)
    assert schedule.ranks == plan("1f1b", PlanRequest(4, 8)).ranks
    assert schedule.info["predicted"]["bubble_rate"] == pytest.approx(timeline.bubble_rate)
    assert schedule.info["predicted"]["peak_memory"] == timeline.peak_memory


def test_export_without_output_prints_the_json(capsys):
    code, out, _ = run(["export", "--schedule", "1f1b", "-p", 3, "-m", 5], capsys)
    assert code == 0
    data = json.loads(out)
    assert (data["stages"], data["microbatches"], data["layout"]) == (3, 5, "single")


def test_simulate_prints_the_1f1b_bubble_of_p_minus_1_over_m_plus_p_minus_1(capsys):
    code, out, _ = run(["simulate", "--schedule", "1f1b", "-p", 4, "-m", 8], capsys)
    assert code == 0
    expected = f"{3 / 11:.4f}"  # T_F = T_B = T_W: (p-1)/(m+p-1)
    assert f"paper's measure (each rank from its own first to its own last pass): {expected}" in out
    assert f"every rank from time 0 to the makespan: {expected}" in out
    assert "makespan: 33" in out


def test_simulate_input_uses_the_costs_stored_in_the_json(tmp_path, capsys):
    path = tmp_path / "plan.json"
    run(["export", "--schedule", "1f1b", "-p", 4, "-m", 8, "--t-f", 1, "--t-b", 2, "--t-w", 1, "-o", path], capsys)
    code, out, _ = run(["simulate", "--input", path], capsys)
    assert code == 0
    assert "makespan: 44" in out  # (m + p - 1)(T_F + T_B + T_W) = 11 * 4


def test_per_rank_times_are_split_over_the_v_layouts_two_chunks(capsys):
    code, out, err = run(["export", "--schedule", "zb-v", "-p", 4, "-m", 8, "--t-f", "1,2,3,4"], capsys)
    assert code == 0, err
    # virtual stages 0..3 on ranks 0..3, stages 4..7 on ranks 3..0; each chunk gets half of its rank's T_F
    assert json.loads(out)["costs"]["t_f"] == [0.5, 1.0, 1.5, 2.0, 2.0, 1.5, 1.0, 0.5]


def test_model_preset_accepts_a_memory_limit_in_bytes(capsys):
    argv = ["simulate", "--schedule", "1f1b", "--model", "1.5b", "-m", 8, "--memory-limit", "40GiB"]
    code, out, err = run(argv, capsys)
    assert code == 0, err
    assert "p=8, m=8" in out and "GiB" in out


def test_the_memory_limit_takes_a_multiple_of_1f1bs_peak_with_a_model_preset(capsys):
    """The planner's check that 1x caps every rank at 1F1B's fullest is tests/test_auto_never_worse.py's."""
    code, out, err = run(["simulate", "--schedule", "zb-auto", "--model", "1.5b", "-m", 16, "--memory-limit", "1x",
                          "--ilp-time-limit", 0], capsys)
    assert code == 0, err
    assert "p=8, m=16" in out


def test_memory_limit_is_microbatches_without_a_unit_and_bytes_with_one():
    assert parse_memory_limit("16") == (16.0, None)
    assert parse_memory_limit("40GiB") == (None, 40 * 2**30)
    assert parse_memory_limit("1.5 MB") == (None, 1.5e6)


@pytest.mark.parametrize("suffix, magic", [(".png", b"\x89PNG"), (".svg", b"<?xml")])
def test_draw_writes_a_non_empty_picture(tmp_path, capsys, suffix, magic):
    path = tmp_path / f"plan{suffix}"
    code, _, err = run(["draw", "--schedule", "1f1b", "-p", 4, "-m", 8, "-o", path], capsys)
    assert code == 0, err
    data = path.read_bytes()
    assert data.startswith(magic) and len(data) > 5000


def test_draw_stacks_a_comparison_into_one_picture(tmp_path, capsys):
    path = tmp_path / "both.svg"
    argv = ["compare", "--schedules", "1f1b", "--schedules", "1f1b", "-p", 3, "-m", 4, "-o", path]
    code, out, err = run(argv, capsys)
    assert code == 0, err
    assert path.read_text().count("rank 2") == 2  # one panel per schedule
    assert sum(line.startswith("1f1b ") for line in out.splitlines()) == 2


def test_draw_without_output_prints_one_text_row_per_rank(capsys):
    code, out, _ = run(["draw", "--schedule", "1f1b", "-p", 4, "-m", 8, "--width", 60], capsys)
    assert code == 0
    rows = [line for line in out.splitlines() if line.startswith("rank ")]
    assert len(rows) == 4 and all(len(r) == 60 for r in rows)


def test_render_text_leaves_bubbles_as_dots():
    timeline = simulate(one_f_one_b(2, 1), Costs.make(2))
    lines = render_text(timeline, 20).splitlines()
    # makespan 6 over 11 columns: rank 0 runs F, waits while rank 1 runs F and BW, then runs BW
    assert lines[1:] == ["rank 0 |F......####|", "rank 1 |.FF####....|"]


def test_draw_refuses_other_suffixes(tmp_path):
    timeline = simulate(one_f_one_b(2, 2), Costs.make(2))
    with pytest.raises(ValueError, match=r"\.png or \.svg"):
        draw(timeline, tmp_path / "plan.jpg")


def test_progress_lines_appear_only_after_a_second():
    stream = io.StringIO()
    progress = _Progress("zb-auto", stream)
    progress("gap 5%")
    assert stream.getvalue() == ""
    progress.started -= 2.0
    progress("gap 1%")
    assert stream.getvalue() == "zb-schedule: zb-auto: gap 1%\n"


BAD_INPUTS = {
    "no microbatches": ["simulate", "--schedule", "1f1b", "-p", "4", "-m", "0"],
    "one stage": ["simulate", "--schedule", "1f1b", "-p", "1", "-m", "4"],
    "zb-v with 3 chunks": ["simulate", "--schedule", "zb-v", "-p", "4", "-m", "8", "--chunks", "3"],
    "limit below 1f1b's need": ["simulate", "--schedule", "1f1b", "-p", "4", "-m", "8", "--memory-limit", "2"],
    "limit below one microbatch": ["simulate", "--schedule", "zb-v", "-p", "4", "-m", "8", "--memory-limit", "0.5"],
    "zero limit": ["simulate", "--schedule", "1f1b", "-p", "4", "-m", "8", "--memory-limit", "0"],
    "unknown schedule": ["simulate", "--schedule", "zb-h9", "-p", "4", "-m", "8"],
    "unknown schedule in compare": ["compare", "--schedules", "1f1b,zb-h9", "-p", "4", "-m", "8"],
    "bytes without a model": ["simulate", "--schedule", "1f1b", "-p", "4", "-m", "8", "--memory-limit", "4GiB"],
    "bad unit": ["simulate", "--schedule", "1f1b", "-p", "4", "-m", "8", "--memory-limit", "4XB"],
    "no multiple of 1F1B's peak": ["simulate", "--schedule", "zb-auto", "-p", "4", "-m", "8", "--memory-limit", "0x"],
    "1F1B's peak for two chunks": ["simulate", "--schedule", "zb-v", "-p", "4", "-m", "8", "--memory-limit", "1x"],
    "bad time": ["simulate", "--schedule", "1f1b", "-p", "4", "-m", "8", "--t-f", "fast"],
    "wrong number of times": ["simulate", "--schedule", "1f1b", "-p", "4", "-m", "8", "--t-f", "1,2,3"],
    "picture suffix": ["draw", "--schedule", "1f1b", "-p", "4", "-m", "8", "-o", "plan.jpg"],
    "no command": [],
    "missing input": ["simulate", "--input", "/nonexistent/plan.json"],
}
# Options that would do nothing for the command or the schedule: refused in one line naming the option.
IGNORED_OPTIONS = {
    "simulate -o": (["simulate", "--schedule", "1f1b", "-p", "4", "-m", "8", "-o", "x.txt"], "-o"),
    "export --width": (["export", "--schedule", "1f1b", "-p", "4", "-m", "8", "--width", "50"], "--width"),
    "draw --width with -o": (["draw", "--schedule", "1f1b", "-p", "4", "-m", "8", "-o", "x.png", "--width", "50"],
                             "--width"),
    "--mw-ratio with a model": (["simulate", "--schedule", "zb-h1", "-m", "8", "--model", "1.5b", "--mw-ratio", "0.4"],
                                "--mw-ratio"),
    "--ilp-time-limit without an ILP": (["simulate", "--schedule", "zb-v", "-p", "4", "-m", "8",
                                         "--ilp-time-limit", "1"], "--ilp-time-limit"),
    "--chunks for one chunk": (["simulate", "--schedule", "zb-h1", "-p", "4", "-m", "8", "--chunks", "2"], "--chunks"),
}
BAD_JSON = {"not json": "{stages: 2", "missing keys": '{"stages": 2}', "a list": "[1, 2]",
            "bad pass": '{"stages": 1, "chunks": 1, "microbatches": 1, "layout": "single", "ranks": [[{"op": "F"}]]}',
            "bad number": '{"stages": "two", "chunks": 1, "microbatches": 1, "layout": "single", "ranks": []}'}


def assert_one_error_line(code, err):
    assert code != 0
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("zb-schedule: error: "), err
    assert "Traceback" not in err


@pytest.mark.parametrize("argv", BAD_INPUTS.values(), ids=BAD_INPUTS.keys())
def test_bad_input_exits_nonzero_with_one_line(argv, capsys):
    code, _, err = run(argv, capsys)
    assert_one_error_line(code, err)


@pytest.mark.parametrize("argv, option", IGNORED_OPTIONS.values(), ids=IGNORED_OPTIONS.keys())
def test_options_that_would_do_nothing_are_refused_naming_them(argv, option, capsys):
    code, _, err = run(argv, capsys)
    assert_one_error_line(code, err)
    assert option in err


def test_planning_options_are_refused_with_a_schedule_read_from_a_file(tmp_path, capsys):
    path = tmp_path / "plan.json"
    run(["export", "--schedule", "zb-h1", "-p", 3, "-m", 6, "-o", path], capsys)
    for option in (["--chunks", "2"], ["--ilp-time-limit", "1"]):
        code, _, err = run(["simulate", "--input", path, *option], capsys)
        assert_one_error_line(code, err)
        assert option[0] in err and "--input" in err


def test_zb_auto_with_chunks_plans_the_interleaved_layout_from_the_command_line(capsys):
    code, out, _ = run(["export", "--schedule", "zb-auto", "--chunks", 3, "-p", 4, "-m", 8, "--ilp-time-limit", 0,
                        "--t-f", 1.2, "--t-b", 1.2, "--t-w", 0.9, "--t-comm", 0.1], capsys)
    schedule = Schedule.from_json(out)
    assert code == 0 and (schedule.layout, schedule.chunks) == ("interleaved", 3)
    costs = Costs.from_dict(schedule.info["costs"])
    assert costs.t_f == pytest.approx((0.4,) * 12)  # a rank's time split over its three chunks
    validate(schedule, costs, schedule.info["planner"]["memory_limit"])


@pytest.mark.parametrize("text", BAD_JSON.values(), ids=BAD_JSON.keys())
def test_malformed_json_exits_nonzero_with_one_line(text, tmp_path, capsys):
    path = tmp_path / "plan.json"
    path.write_text(text)
    code, _, err = run(["simulate", "--input", path], capsys)
    assert_one_error_line(code, err)


@pytest.mark.slow  # a process
def test_module_entry_point_reports_errors_without_a_traceback():
    result = subprocess.run(
        [sys.executable, "-m", "megatron.zero_bubble.cli", "simulate", "--schedule", "1f1b", "-p", "4",
         "-m", "0"],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )
    assert_one_error_line(result.returncode, result.stderr)


def test_compare_reports_a_refusing_schedule_and_keeps_the_others(capsys):
    # megatron's interleaved 1F1B needs m = 6 to be a multiple of the group size p = 4 (or leave >= p over)
    code, out, err = run(["compare", "--schedules", "interleaved-1f1b,1f1b", "-p", 4, "-m", 6], capsys)
    assert code == 1  # a refusal is reported in the exit status, the table still printed
    assert err.startswith("zb-schedule: skipped interleaved-1f1b: megatron-core requires m=6") and err.count("\n") == 1
    rows = out.split("\n\n")[0].splitlines()[1:]  # the table's rows: under its header, above its legend
    assert [line.split()[0] for line in rows] == ["1f1b"]