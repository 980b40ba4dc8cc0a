"""Patch contracts in one process: version checks, install/uninstall restores, clear errors for bad runs."""
import pytest

from megatron.zero_bubble.patches import imports

imports.install()  # megatron.core imports without triton from here on

from megatron.zero_bubble.patches import schedule_selection  # noqa: E402
from megatron.zero_bubble.patches._patching import PatchError, PatchSet, check_megatron_core_version  # noqa: E402
from megatron.zero_bubble.patches.megatron_adapter import MegatronAdapter  # noqa: E402
from megatron.zero_bubble.runtime.executor import PipelineExecutor  # noqa: E402
from megatron.zero_bubble.schedules import ScheduleError  # noqa: E402
from megatron.zero_bubble.schedules.baselines import one_f_one_b  # noqa: E402


@pytest.mark.parametrize("version", ["0.18.1", "0.20.0", "1.0.0", "garbage"])
def test_unsupported_megatron_core_version_is_refused_naming_it(version):
    with pytest.raises(PatchError, match=f"megatron-core {version} is installed.*0.19"):
        check_megatron_core_version(version)


def test_installed_megatron_core_is_supported():
    assert check_megatron_core_version().startswith("0.19.")


def test_patching_a_missing_target_names_the_installed_version():
    import megatron.core.pipeline_parallel.schedules as schedules

    with pytest.raises(PatchError, match=r"schedules\.no_such_function does not exist in megatron-core 0\.19"):
        PatchSet("probe").replace(schedules, "no_such_function", None)


def test_schedule_selection_routes_pipelined_runs_and_uninstall_restores_every_binding():
    import megatron.core.pipeline_parallel as pipeline_parallel
    import megatron.core.pipeline_parallel.schedules as schedules

    before = (schedules.get_forward_backward_func, pipeline_parallel.get_forward_backward_func)
    executor = PipelineExecutor(lambda m: one_f_one_b(2, m), MegatronAdapter())
    schedule_selection.install(executor)
    schedule_selection.install(executor)  # idempotent
    try:
        assert schedules.get_forward_backward_func(pp_size=2, vp_size=None) is executor
        assert pipeline_parallel.get_forward_backward_func(pp_size=4, vp_size=2) is executor
        assert schedules.get_forward_backward_func(pp_size=1, vp_size=None) is schedules.forward_backward_no_pipelining
    finally:
        schedule_selection.uninstall()
    assert (schedules.get_forward_backward_func, pipeline_parallel.get_forward_backward_func) == before


@pytest.mark.parametrize(
    "pp,chunks,m,message",
    [
        (4, 1, 8, "is for 2 pipeline stages but the run has --pipeline-model-parallel-size 4"),
        (2, 1, 6, "is for 8 microbatches but the run has 6"),
        (2, 2, 8, "places 1 model chunk\\(s\\) per rank but the model has 2"),
    ],
)
def test_a_schedule_that_disagrees_with_the_run_is_refused_before_any_pass(pp, chunks, m, message):
    with pytest.raises(ScheduleError, match=message):
        PipelineExecutor.check_run_matches(one_f_one_b(2, 8), pp, chunks, m)


def test_a_session_installs_what_it_is_asked_for_and_removes_it_all_even_after_a_failed_install(monkeypatch):
    import megatron.core.pipeline_parallel.schedules as schedules

    from megatron.zero_bubble.training.session import ZeroBubbleSession

    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.zero_bubble.patches import ddp_bucketing

    def bindings():
        return (schedules.get_forward_backward_func, DistributedDataParallel.__dict__["__init__"],
                ProcessGroupCollection.__dict__["setup_process_groups_for_ddp"])

    before = bindings()
    with ZeroBubbleSession(schedule_for=lambda m: one_f_one_b(2, m), bucket_every_stage=True) as session:
        assert isinstance(session.executor, PipelineExecutor) and session.executor.megatron is session.megatron
        assert schedules.get_forward_backward_func(pp_size=2) is session.pipeline
        assert ddp_bucketing.installed() and DistributedDataParallel.__dict__["__init__"] is not before[1]
    assert not ddp_bucketing.installed() and bindings() == before

    def fail(*options):
        raise PatchError("schedule_selection: refused for the test")

    monkeypatch.setattr(schedule_selection, "install", fail)
    with pytest.raises(PatchError, match="refused for the test"):
        ZeroBubbleSession(schedule_for=lambda m: one_f_one_b(2, m), bucket_every_stage=True).install()
    assert not ddp_bucketing.installed()  # installed before the failure, removed by it
    assert bindings() == before


def test_a_session_takes_fixed_plans_or_re_planning_not_both():
    from megatron.zero_bubble.training.session import ZeroBubbleSession

    with pytest.raises(ValueError, match="not both"):
        ZeroBubbleSession(schedule_for=lambda m: one_f_one_b(2, m), plan_settings=object())


def test_the_dataset_helpers_are_compiled_only_where_none_are_installed(monkeypatch, tmp_path):
    """A pip install of megatron-core has the compiled helpers and no Makefile, so megatron's start-up `make` stopped
    every GPU run; with the helpers installed the compile is skipped, and every rank still meets the barrier."""
    import megatron.training.initialize as initialize
    import torch.distributed as dist

    from megatron.zero_bubble.patches import prebuilt_helpers

    compiled = []
    monkeypatch.setattr(initialize, "_compile_dependencies", lambda: compiled.append(True))
    prebuilt_helpers.install()
    try:
        assert prebuilt_helpers.prebuilt()  # this machine's megatron-core has them
        dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
        try:
            initialize._compile_dependencies()
            assert compiled == []
            monkeypatch.setattr(prebuilt_helpers, "prebuilt", lambda: False)
            initialize._compile_dependencies()
            assert compiled == [True]
        finally:
            dist.destroy_process_group()
    finally:
        prebuilt_helpers.uninstall()
    initialize._compile_dependencies()
    assert compiled == [True, True]


def test_megatrons_gradient_reduction_is_issued_one_collective_at_a_time_on_gloo_with_cuda():
    """gloo refuses `allreduce_coalesced` of CUDA tensors (seen on an H100), which megatron DDP's coalescing manager
    hands it; the shared-GPU mode's patch issues the same reductions one by one, synchronously only."""
    import inspect

    import megatron.core.distributed.param_and_grad_buffer as buffers

    from megatron.zero_bubble.patches import gloo_on_cuda

    original = buffers._coalescing_manager
    assert "_coalescing_manager(communication_group, async_ops=async_op)" in inspect.getsource(buffers)
    gloo_on_cuda.install()
    try:
        with buffers._coalescing_manager("group", async_ops=False) as cm:
            pass
        assert cm.wait() is None
        with pytest.raises(RuntimeError, match="--overlap-grad-reduce"):
            with buffers._coalescing_manager("group", async_ops=True):
                pass
    finally:
        gloo_on_cuda.uninstall()
    assert buffers._coalescing_manager is original
