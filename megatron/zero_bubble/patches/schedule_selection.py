"""Route megatron-core's `get_forward_backward_func` to a zero-bubble PipelineExecutor.

Megatron binds the function by name in three places: its defining module, the package that re-exports
it, and megatron.training.training (at import). Each binding that exists is replaced, so whichever one the
training loop calls returns the executor whenever the pipeline has more than one stage.
"""
from __future__ import annotations

import sys

from ._patching import Patcher, check_megatron_core_version

_patcher = Patcher("schedule_selection")
_BINDINGS = ("megatron.core.pipeline_parallel.schedules", "megatron.core.pipeline_parallel", "megatron.training.training")


def install(executor) -> None:
    """Make every binding of get_forward_backward_func return `executor` when PP > 1 (idempotent: re-installing
    replaces the executor)."""
    check_megatron_core_version()
    import megatron.core.pipeline_parallel.schedules as schedules

    if _patcher.installed:
        uninstall()
    original = schedules.get_forward_backward_func

    def get_forward_backward_func(pp_size=None, vp_size=None, schedule_pg_collection=None):
        if pp_size is None and vp_size is None:
            from megatron.core import parallel_state

            pp_size = parallel_state.get_pipeline_model_parallel_world_size()
        if pp_size is not None and pp_size > 1:
            return executor
        return original(pp_size=pp_size, vp_size=vp_size, schedule_pg_collection=schedule_pg_collection)

    get_forward_backward_func.zero_bubble_executor = executor
    for name in _BINDINGS:
        module = sys.modules.get(name)
        if module is not None:
            _patcher.replace(module, "get_forward_backward_func", get_forward_backward_func)


def uninstall() -> None:
    _patcher.restore()


def installed_executor():
    """The executor in use, or None when megatron-core's own schedules run."""
    import megatron.core.pipeline_parallel.schedules as schedules

    return getattr(schedules.get_forward_backward_func, "zero_bubble_executor", None)
