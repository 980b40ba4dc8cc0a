"""Schedule data, JSON contract, cost model, simulator and validator (planner-independent)."""
import json

import pytest

from megatron.zero_bubble.schedules import Costs, Pass, Schedule, ScheduleError, simulate, validate
from megatron.zero_bubble.schedules.baselines import one_f_one_b
from megatron.zero_bubble.schedules.memory import rank_memory_limits
from megatron.zero_bubble.schedules.schedule import stage_owner, virtual_stage


def test_json_uses_exactly_the_architecture_key_names_and_round_trips():
    s = one_f_one_b(3, 4)
    s.info["costs"] = {"t_f": [1, 1, 1]}
    data = json.loads(s.to_json())
    assert set(data) == {"stages", "chunks", "microbatches", "layout", "ranks", "name", "costs"}
    assert data["ranks"][0][0] == {"op": "F", "mb": 0, "chunk": 0}
    back = Schedule.from_json(s.to_json())
    assert back.ranks == s.ranks and back.info == s.info and back.layout == "single"


def test_malformed_json_gives_one_clear_error():
    with pytest.raises(ScheduleError, match="lacks the key"):
        Schedule.from_json('{"stages": 2}')
    with pytest.raises(ScheduleError, match="not valid JSON"):
        Schedule.from_json("{nope")


@pytest.mark.parametrize("layout,chunks", [("single", 1), ("interleaved", 3), ("v", 2)])
def test_virtual_stage_and_owner_are_inverse(layout, chunks):
    p = 4
    seen = set()
    for rank in range(p):
        for chunk in range(chunks):
            vs = virtual_stage(layout, p, rank, chunk)
            assert stage_owner(layout, p, vs) == (rank, chunk)
            seen.add(vs)
    assert seen == set(range(p * chunks))
    if layout == "v":
        assert virtual_stage("v", p, 0, 1) == 2 * p - 1  # the loss lives on rank 0


@pytest.mark.parametrize("p,m", [(2, 1), (2, 5), (4, 3), (4, 8), (8, 24)])
def test_1f1b_simulated_bubble_equals_paper_formula(p, m):
    costs = Costs.make(p, t_f=1.0, t_b=1.0, t_w=1.0)
    t = simulate(one_f_one_b(p, m), costs)
    assert t.bubble_time == (p - 1) * 3.0
    assert t.peak_memory[0] == min(p, m)
    assert t.bubble_rate == pytest.approx((p - 1) / (m + p - 1))


def test_comm_time_is_added_only_between_ranks():
    costs = Costs.make(2, t_f=1.0, t_b=1.0, t_w=1.0, t_comm=0.25)
    t = simulate(one_f_one_b(2, 1), costs)
    # F0 on rank 0 [0,1], F0 on rank 1 [1.25, 2.25], BW on rank 1 [2.25, 4.25], BW on rank 0 [4.5, 6.5]
    assert [(x.start, x.end) for x in t.ranks[1]] == [(1.25, 2.25), (2.25, 4.25)]
    assert t.ranks[0][-1].start == 4.5 and t.makespan == 6.5


def test_cost_model_from_model_shape_matches_paper_scale():
    # Paper's 1.5B model: 22 layers, h 2304, 24 heads, p 8, microbatch 6, seq 1024; profiled T_F 18.5 ms.
    c = Costs.from_model(layers=22, hidden=2304, heads=24, seq_length=1024, micro_batch=6, vocab=50257,
                         num_virtual_stages=8)
    middle = c.t_f[3]
    assert 0.012 < middle < 0.025
    assert c.t_f[-1] > c.t_f[3]  # the LM head makes the last stage heavier
    assert c.t_w[3] < c.t_f[3] < c.t_b[3]
    assert c.memory_unit == "bytes" and all(w < f for w, f in zip(c.m_w, c.m_f))


def test_per_stage_costs_need_one_value_per_virtual_stage():
    with pytest.raises(ScheduleError, match="3 values but the pipeline has 4"):
        Costs.make(4, t_f=[1, 2, 3])


def _zb_like(p, m):
    """A valid split-backward schedule built from 1F1B by running each W right after its B."""
    s = one_f_one_b(p, m)
    ranks = [[q for x in r for q in ((Pass("B", x.mb), Pass("W", x.mb)) if x.op == "BW" else (x,))] for r in s.ranks]
    return Schedule(p, 1, m, "single", ranks, name="split")


def _move_after(passes, moved, anchor):
    passes.remove(moved)
    passes.insert(passes.index(anchor) + 1, moved)


def _sequential(passes):
    """F, B, W of each microbatch in turn: no warm-up."""
    return [Pass(op, x.mb) for x in passes if x.op == "F" for op in ("F", "B", "W")]


def test_validator_accepts_split_schedule():
    validate(_zb_like(4, 6))


@pytest.mark.parametrize(
    "breakage,message",
    [
        (lambda r: r[2].remove(Pass("W", 3)), "rank 2 has no W for microbatch 3"),
        (lambda r: r[1].insert(0, r[1].pop(r[1].index(Pass("W", 0)))), "rank 1 runs W of microbatch 0 before its B"),
        (lambda r: r[0].append(Pass("F", 1)), "rank 0 runs F of microbatch 1 twice"),
        (lambda r: r[1].append(Pass("BW", 2)), "rank 1 runs both a fused BW and a split B/W for microbatch 2"),
        (lambda r: _move_after(r[3], Pass("W", 1), Pass("W", 2)), "rank 3 runs W of microbatch 2 before the W of microbatch 1"),
        (lambda r: r[3].append(Pass("F", 9)), "outside microbatches"),
        # rank 0 waits for the gradient of microbatch 0 before sending F1, which rank 1 needs first
        (lambda r: r[0].__setitem__(slice(None), _sequential(r[0])), "deadlock: rank 0 waits at B of microbatch 0"),
    ],
)
def test_validator_catches_hand_broken_schedules(breakage, message):
    s = _zb_like(4, 6)
    breakage(s.ranks)
    with pytest.raises(ScheduleError, match=message):
        validate(s)


def test_validator_catches_memory_overrun_naming_rank_and_pass():
    s = _zb_like(4, 6)
    validate(s, memory_limit=4)
    with pytest.raises(ScheduleError, match=r"rank 0 holds 4 microbatches of activations after F of microbatch 3"):
        validate(s, memory_limit=3)


def test_memory_limit_in_microbatches_scales_with_each_ranks_activation():
    costs = Costs.make(4, m_f=[2.0, 1.0, 1.0, 3.0], memory_unit="bytes")
    assert rank_memory_limits(4, 1, "single", costs, microbatches=2) == [4.0, 2.0, 2.0, 6.0]
    assert rank_memory_limits(2, 2, "v", Costs.make(4, m_f=[1, 2, 3, 4]), microbatches=1) == [5.0, 5.0]
    assert rank_memory_limits(4, 1, "single", costs, absolute=10) == [10.0] * 4


def test_schedule_table_gives_each_schedule_its_layout_and_default_memory_limit():
    from megatron.zero_bubble.schedules.planners import SCHEDULE_NAMES, default_memory_limit, layout_of

    assert [layout_of(n) for n in SCHEDULE_NAMES] == ["single", "interleaved", "single", "single", "single", "v", "v", "v"]
    assert [default_memory_limit(n, 8) for n in ("zb-auto", "zb-v", "v-half", "v-min")] == [16, 8, 5, 4]
    with pytest.raises(ScheduleError, match="unknown schedule"):
        layout_of("gpipe")
