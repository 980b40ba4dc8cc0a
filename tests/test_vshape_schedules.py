"""ZB-V, V-Half and V-Min: valid V schedules under their memory limits, zero bubble where the paper says so.
(tests/test_v_budget.py validates them over a grid of p and m, and under budgets in between.)"""
import pytest

from megatron.zero_bubble.schedules import Costs, Pass, Schedule, ScheduleError, simulate, validate
from megatron.zero_bubble.schedules.planners import PlanRequest, plan
from megatron.zero_bubble.schedules.problem import MemoryLimit
from megatron.zero_bubble.schedules.vbudget import v_half, v_min, v_plans, zb_v
from megatron.zero_bubble.schedules.vshape import paper_v_order

PLANNERS = {"zb-v": zb_v, "v-half": v_half, "v-min": v_min}
DEFAULT_LIMIT = {"zb-v": lambda p: p, "v-half": lambda p: (p + 2) // 2, "v-min": lambda p: (p + 4) // 3}


def chunk_costs(p, t_f=1.0, t_b=1.0, t_w=1.0, t_comm=0.0):
    """Per-stage times as the paper profiles them; each of the 2p chunks of the V takes half."""
    return Costs.make(2 * p, t_f=t_f / 2, t_b=t_b / 2, t_w=t_w / 2, t_comm=t_comm, chunks=2)


def skewed_costs(p):
    """Unequal stages (the last virtual stage carries the LM head) and T_comm > 0."""
    t_f = [1.0] * (2 * p - 1) + [1.6]
    t_b = [1.2] * (2 * p - 1) + [1.8]
    t_w = [0.6] * (2 * p - 1) + [1.0]
    return Costs.make(2 * p, t_f=t_f, t_b=t_b, t_w=t_w, t_comm=0.15, chunks=2)


@pytest.mark.parametrize("p", [2, 3, 4, 6])
@pytest.mark.parametrize("factor", [2, 3])
def test_zb_v_has_zero_bubble_at_1f1b_memory_with_equal_times(p, factor):
    costs = chunk_costs(p)
    schedule = zb_v(p, factor * p, costs)
    timeline = validate(schedule, costs, memory_limit=p)
    assert timeline.bubble_rate == pytest.approx(0.0, abs=1e-12)
    assert max(timeline.peak_memory) == pytest.approx(p, abs=1e-9)  # p M_B, as 1F1B


@pytest.mark.parametrize("name", PLANNERS)
def test_each_rank_runs_the_w_passes_of_each_chunk_in_microbatch_order(name):
    schedule = PLANNERS[name](4, 10, skewed_costs(4))
    for passes in schedule.ranks:
        for chunk in (0, 1):
            ws = [x.mb for x in passes if x.op == "W" and x.chunk == chunk]
            assert ws == list(range(10))


def test_lower_memory_variants_stay_within_their_limits_and_pay_for_it_in_bubble():
    p, m = 6, 18
    costs = chunk_costs(p, 29.8, 29.5, 19.6, 0.55)
    plans = v_plans(p, m, costs, {name: MemoryLimit(DEFAULT_LIMIT[name](p)) for name in PLANNERS})
    peaks, rates = {}, {}
    for name, schedule in plans.items():
        assert schedule.name == name
        timeline = validate(schedule, costs, memory_limit=DEFAULT_LIMIT[name](p))
        peaks[name], rates[name] = max(timeline.peak_memory), timeline.bubble_rate
    assert peaks["v-min"] <= 3 + 1e-9 and peaks["v-half"] <= 4 + 1e-9 and peaks["zb-v"] <= 6 + 1e-9
    assert rates["v-min"] >= rates["v-half"] >= rates["zb-v"]


def test_an_explicit_limit_is_respected_in_microbatches_and_in_absolute_units():
    p, m = 4, 12
    costs = chunk_costs(p, t_comm=0.05)
    validate(zb_v(p, m, costs, memory_limit=2.5), costs, memory_limit=2.5)
    validate(zb_v(p, m, costs, MemoryLimit(2.0, absolute=True)), costs, MemoryLimit(2.0, absolute=True))


@pytest.mark.parametrize("limit", [0.9, 0.25])
def test_a_limit_below_one_microbatch_per_rank_is_refused_in_one_sentence(limit):
    with pytest.raises(ScheduleError, match=r"below V-Min's floor\(\(p\+4\)/3\) = 2 M_B per rank, [^\n]*$"):
        zb_v(4, 8, chunk_costs(4), memory_limit=limit)


def test_wrong_costs_or_sizes_are_refused():
    with pytest.raises(ScheduleError, match="virtual stages"):
        zb_v(4, 8, Costs.make(4))
    with pytest.raises(ScheduleError, match="at least 2 stages"):
        v_min(1, 8)


def test_greedy_beats_the_handcrafted_order_when_w_is_cheaper_than_f():
    # 6.2B profiled times (T_W about 2/3 of T_F): the simulated greedy fills the drain better.
    p, m = 4, 12
    costs = chunk_costs(p, 29.8, 29.5, 19.6, 0.55)
    ours = simulate(zb_v(p, m, costs), costs).bubble_rate
    handcrafted = simulate(Schedule(p, 2, m, "v", paper_v_order(p, m)), costs).bubble_rate
    assert ours < handcrafted - 0.005


def test_paper_order_is_a_valid_zero_bubble_v_at_1f1b_memory():
    p, m = 5, 15
    schedule = Schedule(p, 2, m, "v", paper_v_order(p, m))
    timeline = validate(schedule, chunk_costs(p), memory_limit=p)
    assert timeline.bubble_rate == pytest.approx(0.0, abs=1e-12)
    assert schedule.ranks[0][:3] == [Pass("F", 0, 0), Pass("F", 1, 0), Pass("F", 2, 0)]


def test_plan_entry_point_builds_and_predicts_zb_v():
    schedule = plan("zb-v", PlanRequest(3, 6))
    assert schedule.info["predicted"]["bubble_rate"] == pytest.approx(0.0, abs=1e-12)


@pytest.mark.parametrize("p,m", [(2, 5), (4, 6), (4, 12)])
def test_torch_reference_is_the_paper_order(p, m):
    from benchmarks.torch_reference import torch_zbv_schedule

    assert torch_zbv_schedule(p, m).ranks == paper_v_order(p, m)


@pytest.mark.parametrize(
    "p,m,costs",
    [
        (4, 12, chunk_costs(4, 29.8, 29.5, 19.6, 0.55)),
        (3, 7, chunk_costs(3, 11.3, 11.3, 8.1, 0.38)),
        (4, 8, skewed_costs(4)),
    ],
)
def test_ours_is_at_or_below_torch_zbv_on_the_same_costs_and_memory(p, m, costs):
    from benchmarks.torch_reference import compare_zbv_with_torch

    result = compare_zbv_with_torch(p, m, costs)
    assert result["ours"]["bubble_rate"] <= result["torch"]["bubble_rate"] + 1e-12
    assert result["ours"]["peak_memory"] <= result["torch"]["peak_memory"] + 1e-9
