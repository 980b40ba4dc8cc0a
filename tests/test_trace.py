"""Chrome-trace timelines (Perfetto, chrome://tracing) and the text form of a rank's actions."""
from __future__ import annotations

import json

import pytest

from megatron.zero_bubble.schedules import Costs, simulate
from megatron.zero_bubble.schedules.ops import Op, facts
from megatron.zero_bubble.schedules.planners import PlanRequest, plan
from megatron.zero_bubble.schedules.schedule import ScheduleError
from megatron.zero_bubble.schedules.trace import actions_text, chrome_trace, parse_actions, timeline_rows


def test_a_simulated_timeline_becomes_one_complete_event_per_pass_on_its_ranks_thread():
    schedule = plan("zb-h1", PlanRequest(stages=3, microbatches=6))
    timeline = simulate(schedule, Costs.make(3, t_f=1.0, t_b=1.5, t_w=0.5, t_comm=0.25))
    trace = json.loads(json.dumps(chrome_trace(timeline_rows(timeline, unit_ms=2.0), source="simulated")))
    passes = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(passes) == sum(len(r) for r in schedule.ranks)
    threads = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert threads == {0: "rank 0", 1: "rank 1", 2: "rank 2"}
    for rank, timed in enumerate(timeline.ranks):
        mine = [e for e in passes if e["tid"] == rank]
        assert [e["name"] for e in mine] == [str(t.op) for t in timed]
        # microseconds of wall time: 2 ms per unit of the costs
        assert [(e["ts"], e["dur"]) for e in mine] == [(t.start * 2000.0, (t.end - t.start) * 2000.0) for t in timed]
    first_w = next(e for e in passes if e["name"].startswith("W"))
    assert first_w["cat"] == facts(Op.W).noun  # the op table's name for it
    assert first_w["args"]["virtual_stage"] == first_w["tid"]


@pytest.mark.parametrize("name, post_validation", [("zb-v", True), ("zb-auto", False), ("interleaved-1f1b", True)])
def test_a_ranks_actions_print_as_text_and_parse_back(name, post_validation):
    schedule = plan(name, PlanRequest(stages=4, microbatches=8, ilp_time_limit=0, post_validation=post_validation,
                                      chunks=2 if name == "interleaved-1f1b" else None))
    for rank, passes in enumerate(schedule.ranks):
        text = actions_text(schedule, rank)
        assert parse_actions(text, schedule.chunks) == passes
    assert actions_text(schedule, 0).split()[0] in ("F0", "V")


@pytest.mark.parametrize("text, words", [("F0 X1", "'X1'"), ("F", "needs a microbatch"), ("V3", "takes no microbatch"),
                                        ("F0.2", "chunk 2")])
def test_unreadable_actions_are_refused_naming_the_word(text, words):
    with pytest.raises(ScheduleError, match=words):
        parse_actions(text, chunks=2)


def test_simulate_writes_the_simulated_timeline_as_a_chrome_trace(tmp_path, capsys):
    from megatron.zero_bubble.cli import main

    path = tmp_path / "trace.json"
    code = main(["simulate", "--schedule", "zb-auto", "--chunks", "2", "-p", "3", "-m", "6", "--ilp-time-limit", "0",
                 "--t-comm", "0.5", "--trace", str(path)])
    out, err = capsys.readouterr()
    assert code == 0 and "bubble rate" in out and f"wrote {path}" in err
    events = [e for e in json.loads(path.read_text())["traceEvents"] if e["ph"] == "X"]
    schedule = plan("zb-auto", PlanRequest(3, 6, Costs.make(6, chunks=2, t_comm=0.5), chunks=2, ilp_time_limit=0))
    assert sorted(e["name"] for e in events) == sorted(str(x) for passes in schedule.ranks for x in passes)
    assert {e["args"]["chunk"] for e in events} == {0, 1}
