"""The zero-bubble executor on megatron-core (CPU, gloo): bit-identical to megatron's own 1F1B.

One spawned group of 4 ranks runs every scenario in turn (process start and megatron import are the
slow part); the parent compares the reports with torch.equal.
"""
import functools

import pytest
import torch

from tests.megatron import harness
from tests.megatron.harness import Layout, ModelSpec

SPEC = ModelSpec()
ZB_SCHEDULES = ("zb-h1", "zb-h2", "zb-auto")


def _schedule_for(name: str, stages: int, microbatches: int):
    from megatron.zero_bubble.schedules.planners import PlanRequest, plan

    return plan(name, PlanRequest(stages=stages, microbatches=microbatches, ilp_time_limit=0))


@functools.lru_cache(maxsize=None)
def _cached_schedule(name, stages, microbatches):
    return _schedule_for(name, stages, microbatches)


def _run_case(layout: Layout, schedule: str | None, m: int, ddp: bool, steps: int) -> dict:
    """Run `steps` training iterations (forward-backward, and an optimizer step when steps > 1)."""
    from megatron.zero_bubble.patches import linear_wgrad, schedule_selection
    from megatron.zero_bubble.runtime.executor import PipelineExecutor

    executor = None
    if schedule is not None:
        linear_wgrad.install()
        executor = PipelineExecutor(lambda mbs: _cached_schedule(schedule, layout.pp, mbs))
        schedule_selection.install(executor)
    try:
        harness.init_parallel_state(layout.tp, layout.pp, layout.vpp)
        chunks = harness.build_gpt_chunks(SPEC, init_seed=0)
        if ddp:
            chunks = harness.wrap_in_ddp(chunks)
        optimizer = harness.make_optimizer(chunks) if steps > 1 else None
        losses = {}
        for step in range(steps):
            if optimizer is not None:
                optimizer.zero_grad()
            losses.update({(step, k): v for k, v in harness.run_forward_backward(chunks, SPEC, m, step * m).items()})
            grads = harness.full_grads(chunks)  # the last step's gradients
            if optimizer is not None:
                success, _, _ = optimizer.step()
                assert success
        from megatron.core import parallel_state

        return {
            "dp_rank": parallel_state.get_data_parallel_rank(),
            "pp_rank": parallel_state.get_pipeline_model_parallel_rank(),
            "tp_rank": parallel_state.get_tensor_model_parallel_rank(),
            "losses": losses,
            "grads": grads,
            "params": harness.full_params(chunks),
            "stats": executor.last_stats if executor is not None else None,
        }
    finally:
        schedule_selection.uninstall()
        linear_wgrad.uninstall()


# (label, layout, schedule or None for megatron's own, microbatches, megatron DDP, iterations)
CASES = [
    ("pp4/megatron", Layout(pp=4), None, 8, False, 1),
    ("pp4/1f1b", Layout(pp=4), "1f1b", 8, False, 1),
    *[(f"pp4/{s}", Layout(pp=4), s, 8, False, 1) for s in ZB_SCHEDULES],
    ("pp4/zb-h1/m3", Layout(pp=4), "zb-h1", 3, False, 1),
    ("pp4/megatron/m3", Layout(pp=4), None, 3, False, 1),
    ("pp2xdp2/megatron", Layout(pp=2), None, 4, True, 3),
    *[(f"pp2xdp2/{s}", Layout(pp=2), s, 4, True, 3) for s in ZB_SCHEDULES],
    ("tp2xpp2/megatron", Layout(tp=2, pp=2), None, 4, False, 1),
    *[(f"tp2xpp2/{s}", Layout(tp=2, pp=2), s, 4, False, 1) for s in ZB_SCHEDULES],
]


def _all_cases():
    return {label: _run_case(layout, schedule, m, ddp, steps) for label, layout, schedule, m, ddp, steps in CASES}


@pytest.fixture(scope="module")
def reports():
    results = harness.spawn(_all_cases, 4, timeout=600)
    return {label: [r[label] for r in results] for label, *_ in CASES}


def _merged(per_rank):
    """Per data-parallel replica: losses (from the last stage) and full grads/params of every parameter."""
    merged = {}
    for r in per_rank:
        replica = merged.setdefault(r["dp_rank"], {"losses": {}, "grads": {}, "params": {}})
        for key in ("losses", "grads", "params"):
            replica[key].update(r[key])
    return merged


def _assert_identical(ours, reference):
    ours, reference = _merged(ours), _merged(reference)
    assert ours.keys() == reference.keys()
    for dp in reference:
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


@pytest.mark.parametrize("label", [f"pp4/{s}" for s in ("1f1b",) + ZB_SCHEDULES] + ["pp4/zb-h1/m3", "tp2xpp2/zb-h2"])
def test_measured_peak_activations_equal_the_planners_prediction(reports, label):
    from megatron.zero_bubble.schedules import Costs
    from megatron.zero_bubble.schedules.memory import memory_profile

    _, layout, name, m, _, _ = next(c for c in CASES if c[0] == label)
    schedule = _schedule_for(name, layout.pp, m)
    n = schedule.num_virtual_stages
    held_for_b = memory_profile(schedule, Costs.make(n, m_f=1.0, m_w=0.0))
    held_until_w = memory_profile(schedule, Costs.make(n, m_f=1.0, m_w=1.0))
    for report in reports[label]:
        stats, rank = report["stats"], report["pp_rank"]
        assert stats.peak_activations == max(held_for_b[rank])
        assert stats.peak_in_flight == max(held_until_w[rank])
        if name != "1f1b" and max(held_until_w[rank]) > max(held_for_b[rank]):
            assert stats.peak_wgrad_bytes > 0  # W work was actually held back
