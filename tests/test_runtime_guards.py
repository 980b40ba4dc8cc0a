"""The runtime's guards against what would stop or hang a running job: re-planning's agreement (runtime/replan.py
`_agree`) takes a re-planned schedule only if it plans, validates and lowers with its proofs, on every rank alike
(otherwise the current schedule stays, with one line saying why); post-validation refuses models whose
finalize_model_grads reduces over the pipeline group inside its S pass."""
from __future__ import annotations

import pytest

from megatron.zero_bubble.runtime import executor as executor_module
from megatron.zero_bubble.runtime.planning import PlanSettings
from megatron.zero_bubble.runtime.replan import ReplanningPipeline
from megatron.zero_bubble.schedules import Costs, ScheduleError


def _pipeline(lines: list) -> ReplanningPipeline:
    settings = PlanSettings(schedule="zb-auto", stages=2, chunks=1, memory_limit=4, ilp_time_limit=0,
                            initial_costs=Costs.make(2))
    return ReplanningPipeline(settings, current_iteration=lambda: 0, megatron=None, log=lines.append)


def test_a_replanned_schedule_whose_lowering_fails_leaves_the_current_one_running(one_rank_gloo, monkeypatch):
    lines = []
    pipeline = _pipeline(lines)
    current = pipeline.plan_for(4)
    lower = executor_module.LoweredRun.of

    def refuse_new_schedules(schedule, forward_only=False):
        if schedule is not current:
            raise ScheduleError("rank 2 stuck at its receive of act5 (the proof of the lowering)")
        return lower(schedule, forward_only)

    monkeypatch.setattr(executor_module.LoweredRun, "of", staticmethod(refuse_new_schedules))
    kept, _ = pipeline._agree(4, {}, previous=current)
    assert kept is current
    assert lines == ["rank 2 stuck at its receive of act5 (the proof of the lowering); keeping the current schedule"]


def test_a_replanned_schedule_that_lowers_is_taken_and_lowered_once(one_rank_gloo, monkeypatch):
    pipeline = _pipeline([])
    current = pipeline.plan_for(4)
    lowered = []
    lower = executor_module.LoweredRun.of
    monkeypatch.setattr(executor_module.LoweredRun, "of",
                        staticmethod(lambda schedule, forward_only=False: lowered.append(schedule)
                                     or lower(schedule, forward_only)))
    taken, _ = pipeline._agree(4, {}, previous=current)
    assert taken is not current and lowered == [taken]
    pipeline.executor.prepare(taken)  # the iteration that runs it finds its lowering made
    assert lowered == [taken]


@pytest.mark.parametrize("name", ["has_cond_embedder", "flextron"])
def test_post_validation_refuses_models_that_reduce_over_the_pipeline_group_in_finalize(name):
    import types

    from megatron.zero_bubble.training.session import check_no_pipeline_group_collectives

    config = types.SimpleNamespace(pipeline_model_parallel_size=4, **{name: True})
    with pytest.raises(ValueError, match=rf"^optimizer post-validation does not work with config\.{name}: .*drop "
                                         r"--enable-optimizer-post-validation$"):
        check_no_pipeline_group_collectives(config)
    check_no_pipeline_group_collectives(types.SimpleNamespace(pipeline_model_parallel_size=1, **{name: True}))
    check_no_pipeline_group_collectives(types.SimpleNamespace(pipeline_model_parallel_size=4))
