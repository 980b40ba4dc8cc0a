"""Rehearsal: the real executor loop, lowering and gloo transport with each pass a wait of its planned time."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from megatron.zero_bubble.tools.rehearsal import DataParallel, RehearsalOptions, rehearse
from megatron.zero_bubble.schedules.costs import Costs
from megatron.zero_bubble.schedules.handcrafted import zb_h1
from megatron.zero_bubble.schedules.planners import PlanRequest, plan
from megatron.zero_bubble.schedules.post_validation import with_post_validation
from megatron.zero_bubble.schedules.simulate import simulate

KEYS = {"schedule", "stages", "microbatches", "simulated_makespan", "measured_makespan", "ratio",
        "simulated_bubble_rate", "measured_bubble_rate", "max_pass_lateness", "per_rank"}


# rehearse() starts one process per rank: slow.
@pytest.mark.slow
def test_a_p16_rehearsal_runs_every_planned_pass_no_sooner_than_planned():
    schedule, costs = zb_h1(16, 32), Costs.make(16, t_f=4.0, t_b=4.0, t_w=3.0, t_comm=0.2)
    report = rehearse(schedule, costs)
    assert KEYS <= report.keys() and report["stages"] == 16 and report["microbatches"] == 32
    timeline = simulate(schedule, costs)
    for rank, planned in zip(report["per_rank"], timeline.ranks):
        assert [(p["op"], p["mb"]) for p in rank["passes"]] == [(t.op.op, t.op.mb) for t in planned]
        assert [p["planned_start"] for p in rank["passes"]] == [t.start for t in planned]
        # a pass lasts its planned time, so no rank can finish its work sooner than its busy time
        assert rank["passes"][-1]["actual_end"] - rank["passes"][0]["actual_start"] >= timeline.busy(rank["rank"]) * 0.999
    assert report["simulated_makespan"] == timeline.makespan
    assert report["measured_makespan"] >= timeline.makespan * 0.999
    # no upper bound here: a loaded CI machine stretches the waits; benchmarks/rehearsal.py measures the ratio


@pytest.mark.slow
def test_a_transport_that_posts_receives_late_shows_as_lateness():
    schedule, costs = zb_h1(4, 8), Costs.make(4, t_f=5.0, t_b=5.0, t_w=4.0)
    delay_ms = 30.0
    slow = rehearse(schedule, costs, RehearsalOptions(recv_delay_ms=delay_ms, delayed_rank=1))
    # rank 1 posts each of its receives 30 ms late, and its passes wait behind those posts
    assert slow["per_rank"][1]["max_lateness"] >= delay_ms
    assert slow["max_pass_lateness"] >= delay_ms and slow["ratio"] > 1.1


@pytest.mark.slow
def test_several_iterations_with_the_synchronous_step_or_post_validation():
    """The synchronous step waits for every rank, then the all-reduce, then the step: no iteration can take
    less than the makespan plus both. Post-validation iterations run the plan's V passes in order."""
    costs = Costs.make(4, t_f=3.0, t_b=3.0, t_w=2.0, t_comm=0.1)
    options = RehearsalOptions(iterations=3, optimizer_step=4.0, allreduce=3.0)
    synchronous = rehearse(zb_h1(4, 6), costs, options)
    assert synchronous["iterations"] == 3
    assert synchronous["measured_time_per_iteration"] >= synchronous["simulated_makespan"] + 4.0 + 3.0
    validated = rehearse(with_post_validation(zb_h1(4, 6)), costs, options)
    assert validated["iterations"] == 3 and [p["op"] for p in validated["per_rank"][0]["passes"]].count("V") == 1
    assert validated["executor_us_per_pass"] is not None and validated["executor_us_per_pass"] > 0


@pytest.mark.slow
def test_modelled_data_parallel_reduction_starts_buckets_during_the_last_passes_only_with_overlap():
    """Without overlap every bucket starts after the rank's last pass, so each rank waits the whole reduction;
    with it, buckets start as the last BW (1F1B: megatron buckets only the first stage, the others reduce in
    one bucket after their last pass) or the layer-by-layer W tail (zb-auto, through the runtime's own
    WeightGradStore; every stage bucketed, as the runtime does) completes their weights."""
    costs = Costs.make(2, t_f=5.0, t_b=5.0, t_w=5.0)
    reduce_time = 20.0
    # 4 ms a unit: the suite's background launches share the cores, and a few ms of waking late must not pose as a
    # reduction that failed to overlap (1 ms a unit once came out 19.6 units exposed instead of under 18)
    unit_ms = 4.0
    for name in ("1f1b", "zb-auto"):
        schedule = plan(name, PlanRequest(2, 4, costs=costs, ilp_time_limit=0))
        if name == "zb-auto":
            assert [str(p) for p in schedule.ranks[0][-3:]] == ["B3", "W2", "W3"]  # two W after the last B
        late = rehearse(schedule, costs, RehearsalOptions(unit_ms=unit_ms,
                                                          data_parallel=DataParallel(reduce_time, overlap=False)))
        assert all(exposed >= reduce_time * 0.999 for exposed in late["dp_exposed_per_rank"])
        early = rehearse(schedule, costs, RehearsalOptions(unit_ms=unit_ms,
                                                           data_parallel=DataParallel(reduce_time, overlap=True)))
        first, others = early["dp_exposed_per_rank"][0], early["dp_exposed_per_rank"][1:]
        assert first < reduce_time * 0.9, name
        if name == "1f1b":  # one bucket on the other stages: it starts as their last pass completes its last weight
            assert all(exposed >= reduce_time * 0.98 for exposed in others)
        else:
            assert all(exposed < reduce_time * 0.9 for exposed in others)
        assert early["dp_exposed"] >= 0.0 and [p["op"] for p in early["per_rank"][0]["passes"]] == [
            p.op for p in schedule.ranks[0]]


@pytest.mark.slow
def test_rehearse_command_prints_only_json_on_stdout_and_a_summary_on_stderr_and_writes_a_trace(tmp_path):
    trace_path = tmp_path / "rehearsed.json"
    command = [sys.executable, "-m", "megatron.zero_bubble.cli", "rehearse", "--schedule", "1f1b", "--stages", "2",
               "--microbatches", "4", "--t-f", "2", "--t-b", "2", "--t-w", "1", "--time-unit-ms", "1",
               "--trace", str(trace_path)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, check=True)
    report = json.loads(result.stdout)
    assert KEYS <= report.keys() and report["schedule"] == "1f1b"
    assert "rehearsed 1f1b on 2 processes" in result.stderr and "ms" in result.stderr
    events = [e for e in json.loads(trace_path.read_text())["traceEvents"] if e["ph"] == "X"]
    for rank in report["per_rank"]:  # every pass, with its actual start in microseconds and its planned start
        mine = [e for e in events if e["tid"] == rank["rank"]]
        assert [e["name"] for e in mine] == [f"{p['op']}{p['mb']}" for p in rank["passes"]]
        assert [e["ts"] for e in mine] == [round(p["actual_start"] * 1000, 3) for p in rank["passes"]]
        assert [e["args"]["planned_start_ms"] for e in mine] == [p["planned_start"] for p in rank["passes"]]


@pytest.mark.parametrize("argv,message", [(["--stages", "65"], "more than 64"), (["--time-unit-ms", "0"], "positive")])
def test_rehearse_refuses_bad_input_in_one_line(argv, message, capsys):
    from megatron.zero_bubble.cli import main

    code = main(["rehearse", "--schedule", "zb-h1", "--microbatches", "8",
                 *(["--stages", "4"] if "--stages" not in argv else []), *argv])
    err = capsys.readouterr().err
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1
