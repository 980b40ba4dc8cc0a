"""The output layer's W kept inside B: the costs that say what it moves, the planner's choice, the store that runs it.

Where W of the output layer holds much for little (its input and a sequence x vocabulary gradient), keeping it in B
frees that memory for deferring the other layers' W. The costs carry the output layer's share of the last virtual
stage's T_W and M_W (`head_t_w`, `head_m_w`); a cost-aware planner plans both ways and keeps the faster
(PlanRequest.head_wgrad "auto"), or is told ("deferred", "in-b"); the schedule says so in info["wgrad_in_b"], and the
chunk's WeightGradStore runs those weights' W as each B pass ends (exactness on megatron: test_runtime_exactness.py).
"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from megatron.zero_bubble.runtime.wgrad_store import WeightGradStore
from megatron.zero_bubble.schedules.costs import Costs
from megatron.zero_bubble.schedules.planners import plan_with_timeline
from megatron.zero_bubble.schedules.problem import PlanRequest
from megatron.zero_bubble.schedules.schedule import ScheduleError

# Four alike stages; the last one's W includes an output layer that takes a sixth of its T_W and most of its M_W.
HEAVY_HEAD = replace(Costs.make(4, t_f=(1, 1, 1, 1.2), t_b=(1, 1, 1, 1.2), t_w=(1, 1, 1, 1.2), m_f=1.0,
                                m_w=(0.5, 0.5, 0.5, 2.5)), head_t_w=0.2, head_m_w=2.0)


def _plan(costs: Costs, head_wgrad: str, limit: float | None = 4, name: str = "zb-auto"):
    return plan_with_timeline(name, PlanRequest(stages=4, microbatches=12, costs=costs, memory_limit=limit,
                                                ilp_time_limit=0, head_wgrad=head_wgrad))


def test_keeping_the_output_layers_w_in_b_moves_its_time_into_b_and_its_memory_away():
    kept = HEAVY_HEAD.head_wgrad_in_b()
    assert kept.t_b == (1, 1, 1, 1.2 + 0.2) and kept.t_w[:3] == (1, 1, 1) and kept.t_w[3] == pytest.approx(1.0)
    assert kept.m_w == (0.5, 0.5, 0.5, 0.5) and kept.m_f == HEAVY_HEAD.m_f
    assert not kept.head_wgrad_known and Costs.from_dict(HEAVY_HEAD.to_dict()) == HEAVY_HEAD
    with pytest.raises(ScheduleError, match="parts of the last virtual stage"):
        replace(HEAVY_HEAD, head_m_w=3.0)


@pytest.mark.parametrize("limit", [4, 6, 8])
def test_the_planner_keeps_the_faster_of_the_two_and_says_which(limit):
    auto, deferred, in_b = (_plan(HEAVY_HEAD, mode, limit) for mode in ("auto", "deferred", "in-b"))
    assert "wgrad_in_b" not in deferred[0].info and in_b[0].info["wgrad_in_b"] == ["output_layer"]
    assert in_b[1].makespan < deferred[1].makespan  # the memory freed defers more of the other layers' W
    assert auto[1].makespan == in_b[1].makespan and auto[0].info["wgrad_in_b"] == ["output_layer"]
    assert auto[0].info["costs"] == HEAVY_HEAD.head_wgrad_in_b().to_dict()  # what the runtime orders messages on


def test_where_its_memory_buys_nothing_the_output_layers_w_stays_deferred():
    light = replace(HEAVY_HEAD, m_w=(0.5, 0.5, 0.5, 0.6), head_m_w=0.1)  # its W keeps little: deferring it is free
    auto, deferred = _plan(light, "auto"), _plan(light, "deferred")
    assert "wgrad_in_b" not in auto[0].info and auto[1].makespan == deferred[1].makespan


def test_without_the_output_layers_share_or_for_a_fixed_order_nothing_is_weighed():
    unknown = replace(HEAVY_HEAD, head_t_w=0.0, head_m_w=0.0)
    assert "wgrad_in_b" not in _plan(unknown, "auto")[0].info
    assert "wgrad_in_b" not in _plan(HEAVY_HEAD, "auto", None, "zb-h1")[0].info  # not cost-aware: a fixed order
    assert _plan(HEAVY_HEAD, "in-b", None, "zb-h1")[0].info["wgrad_in_b"] == ["output_layer"]  # told: it runs so
    with pytest.raises(ScheduleError, match="expected one of auto, deferred, in-b"):
        PlanRequest(stages=4, microbatches=4, head_wgrad="fused")


class _Work:
    """One deferred weight gradient, logging when it runs."""

    def __init__(self, weight, mb, log, nbytes=100):
        self.weight, self.mb, self.log, self.nbytes = weight, mb, log, nbytes

    def __call__(self):
        self.log.append((self.weight.label, self.mb))


def _weight(name):
    weight = torch.nn.Parameter(torch.zeros(2))
    weight.label = name
    return weight


def test_the_store_runs_a_kept_weights_w_as_each_b_ends_and_reports_it_complete_with_the_last():
    head, layer, log, ready = _weight("head"), _weight("layer"), [], []
    store = WeightGradStore("chunk 0", grad_ready=lambda param: ready.append(param.label))
    store._weights.extend([head, layer])  # what attach() records for the layers it splits
    store.keep_in_b([head])
    assert store.kept_in_b == 1
    for mb in range(2):
        with store.split_backward():
            store.hand_over(_Work(head, mb, log))
            store.hand_over(_Work(layer, mb, log))
            assert log == [("head", k) for k in range(mb)]  # not during the backward: as a BW pass, at its end
        assert log[-1] == ("head", mb) and store.pending_bytes == 100 * (mb + 1)  # only the layer's W is held
        store.close_microbatch(mb, last=mb == 1)
    assert ready == ["head"]  # complete with the last B; the layer's with its last W
    store.run_next(0)
    store.run_next(1)
    assert log == [("head", 0), ("head", 1), ("layer", 0), ("layer", 1)] and ready == ["head", "layer"]
    with pytest.raises(ScheduleError, match="does not hold"):
        store.keep_in_b([_weight("stranger")])


def _measured(costs: Costs) -> list[dict]:
    """What every rank gathers after a timer window (Profiler.report and T_comm), for these per-stage costs."""
    return [{"report": {"pp_rank": r, "t_f": [costs.t_f[r]], "t_b": [costs.t_b[r]], "t_w": [costs.t_w[r]],
                        "t_bw": [None], "m_f": [costs.m_f[r]], "m_w": [costs.m_w[r]], "iterations": 1},
             "t_comm": [0.0]} for r in range(4)]


def test_re_planning_on_measured_costs_weighs_it_too_and_never_moves_it_twice():
    """Passes are timed whole: the output layer's share of the measured W comes from the estimate. A run that kept
    the W in B measured it inside B: its re-plan keeps it there and takes the measured costs as they are."""
    from megatron.zero_bubble.runtime.planning import PlanSettings, RankZeroPlanner, with_wgrad_shares
    from megatron.zero_bubble.schedules.schedule import Schedule

    plain = replace(HEAVY_HEAD, head_t_w=0.0, head_m_w=0.0)
    shared = with_wgrad_shares(replace(plain, t_w=(2, 2, 2, 2.4), m_w=(1, 1, 1, 5.0)), HEAVY_HEAD)
    assert shared.head_t_w == pytest.approx(0.4) and shared.head_m_w == pytest.approx(4.0)
    settings = PlanSettings(schedule="zb-auto", stages=4, chunks=1, memory_limit=4.0, ilp_time_limit=0,
                            timers_start_iter=0, timers_end_iter=1, initial_costs=HEAVY_HEAD)
    planner = RankZeroPlanner(settings, log=lambda line: None)
    deferred_run = _plan(HEAVY_HEAD, "deferred")[0]
    after_deferred = Schedule.from_json(planner.decide(12, _measured(plain), deferred_run).schedule_json)
    assert after_deferred.info["wgrad_in_b"] == ["output_layer"]
    planned_on, expected = Costs.from_dict(after_deferred.info["costs"]), HEAVY_HEAD.head_wgrad_in_b()
    for name in ("t_b", "t_w", "m_w"):
        assert getattr(planned_on, name) == pytest.approx(getattr(expected, name)), name
    kept = HEAVY_HEAD.head_wgrad_in_b()  # what a run with the W in B measures
    after_kept = Schedule.from_json(planner.decide(12, _measured(kept), after_deferred).schedule_json)
    assert after_kept.info["wgrad_in_b"] == ["output_layer"]
    assert Costs.from_dict(after_kept.info["costs"]).t_b == kept.t_b  # not moved a second time


def test_the_row_parallel_layers_share_of_a_gpt_layers_w_and_their_choice():
    """Attention's output projection and the MLP's second layer: 10 of a GPT layer's 24 sbh^2 W FLOPs and 14 of its
    32 sbh bytes of M_W (their inputs, h and 4h, and full-width output gradients). Where M_W outweighs M_F (the output
    gradients are not split over tensor-parallel ranks), the V planner keeps their W in B: its memory then defers
    the rest."""
    costs = Costs.from_model(layers=8, hidden=64, heads=4, seq_length=32, micro_batch=2, vocab=128,
                             num_virtual_stages=4)
    head = (costs.head_t_w, costs.head_m_w)
    for v in range(4):
        layers_t = costs.t_w[v] - (head[0] if v == 3 else 0)
        layers_m = costs.m_w[v] - (head[1] if v == 3 else 0)
        assert costs.row_t_w[v] == pytest.approx(10 / 24 * layers_t)
        assert costs.row_m_w[v] == pytest.approx(14 / 32 * layers_m)
    kept = costs.rows_wgrad_in_b()
    assert kept.t_b == pytest.approx(tuple(b + r for b, r in zip(costs.t_b, costs.row_t_w)))
    assert not kept.rows_wgrad_known and kept.head_t_w == costs.head_t_w  # the output layer's choice is its own
    p, m = 4, 16
    wide = replace(Costs.make(2 * p, t_f=1.0, t_b=1.1, t_w=0.9, m_f=1.0, m_w=1.7, chunks=2),
                   row_t_w=(0.32,) * 2 * p, row_m_w=(1.1,) * 2 * p)

    def v_half(rows):
        return plan_with_timeline("v-half", PlanRequest(stages=p, microbatches=m, costs=wide, rows_wgrad=rows))

    auto, deferred = v_half("auto"), v_half("deferred")
    assert auto[0].info["wgrad_in_b"] == ["linear_proj", "linear_fc2"] and "wgrad_in_b" not in deferred[0].info
    assert auto[1].makespan < deferred[1].makespan * 0.95
