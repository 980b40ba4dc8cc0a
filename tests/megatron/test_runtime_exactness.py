"""The zero-bubble executor on megatron-core (CPU, gloo): bit-identical to megatron's own 1F1B.

One spawned group of 4 ranks runs every scenario in turn (process start and megatron import are the
slow part); the parent compares the reports with torch.equal.
"""
import dataclasses
import functools

import pytest
import torch

from tests.megatron import harness
from tests.megatron.harness import Layout, ModelSpec

SPEC = ModelSpec()
ZB_SCHEDULES = ("zb-h1", "zb-h2", "zb-auto")
V_SCHEDULES = ("zb-v", "v-half", "v-min")


def _schedule_for(name: str, stages: int, microbatches: int):
    from megatron.zero_bubble.schedules.planners import PlanRequest, plan

    return plan(name, PlanRequest(stages=stages, microbatches=microbatches, ilp_time_limit=0))


@functools.lru_cache(maxsize=None)
def _cached_schedule(name, stages, microbatches):
    return _schedule_for(name, stages, microbatches)


@dataclasses.dataclass(frozen=True)
class Case:
    label: str
    layout: Layout
    schedule: str | None  # None: megatron-core's own schedule
    microbatches: int
    ddp: bool = False
    steps: int = 1  # > 1: that many iterations with an Adam step after each
    spec: ModelSpec = SPEC
    forward_only: bool = False
    patch_only: bool = False  # install the linear patch but run megatron's schedule


def _run_case(case: Case) -> dict:
    from megatron.core import parallel_state
    from megatron.zero_bubble.runtime.executor import PipelineExecutor
    from megatron.zero_bubble.training.session import ZeroBubbleSession

    executor = None
    if case.schedule is not None:
        executor = PipelineExecutor(lambda mbs: _cached_schedule(case.schedule, case.layout.pp, mbs))
    v_stages = case.layout.pp if case.schedule in V_SCHEDULES else None
    if v_stages is not None:  # the V placement must be in place before the groups are made
        harness.destroy_parallel_state()
    with ZeroBubbleSession(executor, split_backward=case.schedule is not None or case.patch_only, v_stages=v_stages):
        harness.init_parallel_state(case.layout.tp, case.layout.pp, case.layout.vpp)
        chunks = harness.build_gpt_chunks(case.spec, init_seed=0)
        if case.ddp:
            chunks = harness.wrap_in_ddp(chunks)
        optimizer = harness.make_optimizer(chunks) if case.steps > 1 else None
        m, losses = case.microbatches, {}
        for step in range(case.steps):
            if optimizer is not None:
                optimizer.zero_grad()
            step_losses = harness.run_forward_backward(chunks, case.spec, m, step * m, forward_only=case.forward_only)
            losses.update({(step, k): v for k, v in step_losses.items()})
            grads = {} if case.forward_only else harness.full_grads(chunks)  # the last step's gradients
            if optimizer is not None:
                success, _, _ = optimizer.step()
                assert success
        return {
            "dp_rank": parallel_state.get_data_parallel_rank(),
            "pp_rank": parallel_state.get_pipeline_model_parallel_rank(),
            "losses": losses,
            "grads": grads,
            "params": harness.full_params(chunks),
            "stats": executor.last_stats if executor is not None else None,
        }


SPEC8 = ModelSpec(num_layers=8)
CASES = [
    Case("pp4/megatron", Layout(pp=4), None, 8),
    Case("pp4/megatron+patch", Layout(pp=4), None, 8, patch_only=True),
    Case("pp4/1f1b", Layout(pp=4), "1f1b", 8),
    *[Case(f"pp4/{s}", Layout(pp=4), s, 8) for s in ZB_SCHEDULES],
    Case("pp4/zb-h1/m3", Layout(pp=4), "zb-h1", 3),
    Case("pp4/megatron/m3", Layout(pp=4), None, 3),
    Case("pp4/megatron/eval", Layout(pp=4), None, 8, forward_only=True),
    Case("pp4/zb-h2/eval", Layout(pp=4), "zb-h2", 8, forward_only=True),
    Case("pp2xdp2/megatron", Layout(pp=2), None, 4, ddp=True, steps=3),
    *[Case(f"pp2xdp2/{s}", Layout(pp=2), s, 4, ddp=True, steps=3) for s in ZB_SCHEDULES],
    Case("tp2xpp2/megatron", Layout(tp=2, pp=2), None, 4),
    *[Case(f"tp2xpp2/{s}", Layout(tp=2, pp=2), s, 4) for s in ZB_SCHEDULES],
    Case("pp4vpp2/megatron", Layout(pp=4, vpp=2), None, 8, spec=SPEC8),
    Case("pp4vpp2/interleaved-1f1b", Layout(pp=4, vpp=2), "interleaved-1f1b", 8, spec=SPEC8),
    # ZB-V against a single-stage run of the same model (DP=4 replicas there, all on the same data)
    Case("pp1/megatron", Layout(), None, 4),
    Case("pp2xdp2/zb-v", Layout(pp=2, vpp=2), "zb-v", 4),
    Case("pp1/megatron/8", Layout(), None, 8, spec=SPEC8),
    *[Case(f"pp4/{s}", Layout(pp=4, vpp=2), s, 8, spec=SPEC8) for s in V_SCHEDULES],
]


@pytest.fixture(scope="module")
def reports():
    return harness.run_cases(_run_case, CASES, 4, timeout=600)


def _merged(per_rank):
    """Per data-parallel replica: losses (from the last stage) and full grads/params of every parameter."""
    merged = {}
    for r in per_rank:
        replica = merged.setdefault(r["dp_rank"], {"losses": {}, "grads": {}, "params": {}})
        for key in ("losses", "grads", "params"):
            replica[key].update(r[key])
    return merged


def _assert_identical(ours, reference, replicas=None):
    ours, reference = _merged(ours), _merged(reference)
    if replicas is None:
        assert ours.keys() == reference.keys()
    for dp in replicas or reference:
        assert ours[dp]["losses"] == reference[dp]["losses"] and reference[dp]["losses"]
        assert ours[dp]["grads"].keys() == reference[dp]["grads"].keys()
        for name, grad in reference[dp]["grads"].items():
            assert torch.equal(ours[dp]["grads"][name], grad), f"gradient of {name} differs"
        for name, value in reference[dp]["params"].items():
            assert torch.equal(ours[dp]["params"][name], value), f"parameter {name} differs"


@pytest.mark.parametrize("schedule", ("1f1b",) + ZB_SCHEDULES)
def test_pp4_gradients_and_losses_are_bit_identical_to_megatron_1f1b(reports, schedule):
    _assert_identical(reports[f"pp4/{schedule}"], reports["pp4/megatron"])


def test_fewer_microbatches_than_stages_is_bit_identical(reports):
    _assert_identical(reports["pp4/zb-h1/m3"], reports["pp4/megatron/m3"])


@pytest.mark.parametrize("schedule", ZB_SCHEDULES)
def test_dp2_pp2_with_megatron_ddp_and_three_adam_steps_is_bit_identical(reports, schedule):
    _assert_identical(reports[f"pp2xdp2/{schedule}"], reports["pp2xdp2/megatron"])


@pytest.mark.parametrize("schedule", ZB_SCHEDULES)
def test_tp2_pp2_is_bit_identical(reports, schedule):
    _assert_identical(reports[f"tp2xpp2/{schedule}"], reports["tp2xpp2/megatron"])


@pytest.mark.parametrize(
    "label", [f"pp4/{s}" for s in ("1f1b",) + ZB_SCHEDULES + V_SCHEDULES] + ["pp4/zb-h1/m3", "tp2xpp2/zb-h2", "pp2xdp2/zb-v"]
)
def test_measured_peak_activations_equal_the_planners_prediction(reports, label):
    from megatron.zero_bubble.schedules import Costs
    from megatron.zero_bubble.schedules.memory import memory_profile

    case = next(c for c in CASES if c.label == label)
    schedule = _schedule_for(case.schedule, case.layout.pp, case.microbatches)
    n = schedule.num_virtual_stages
    held_for_b = memory_profile(schedule, Costs.make(n, m_f=1.0, m_w=0.0))
    held_until_w = memory_profile(schedule, Costs.make(n, m_f=1.0, m_w=1.0))
    for report in reports[label]:
        stats, rank = report["stats"], report["pp_rank"]
        assert stats.peak_activations == max(held_for_b[rank])
        assert stats.peak_in_flight == max(held_until_w[rank])
        if case.schedule != "1f1b" and max(held_until_w[rank]) > max(held_for_b[rank]):
            assert stats.peak_wgrad_bytes > 0  # W work was actually held back


def test_linear_patch_without_a_zero_bubble_schedule_changes_nothing(reports):
    _assert_identical(reports["pp4/megatron+patch"], reports["pp4/megatron"])


def test_forward_only_evaluation_gives_megatrons_losses(reports):
    ours, reference = _merged(reports["pp4/zb-h2/eval"]), _merged(reports["pp4/megatron/eval"])
    assert ours[0]["losses"] == reference[0]["losses"] and len(reference[0]["losses"]) == 8


def test_interleaved_1f1b_through_the_runtime_is_bit_identical_to_megatrons(reports):
    _assert_identical(reports["pp4vpp2/interleaved-1f1b"], reports["pp4vpp2/megatron"])


def test_zb_v_with_two_ranks_is_bit_identical_to_a_single_stage_run(reports):
    _assert_identical(reports["pp2xdp2/zb-v"], reports["pp1/megatron"], replicas=[0, 1])


@pytest.mark.parametrize("schedule", V_SCHEDULES)
def test_v_schedules_on_four_ranks_are_bit_identical_to_a_single_stage_run(reports, schedule):
    _assert_identical(reports[f"pp4/{schedule}"], reports["pp1/megatron/8"], replicas=[0])
