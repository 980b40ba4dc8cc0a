"""Route megatron-core's `get_forward_backward_func` to a zero-bubble PipelineExecutor.

Megatron binds the function by name in several places (its defining module, the package that re-exports
it, megatron.training.training at import); every binding is replaced, so whichever one the training loop
calls returns the executor whenever the pipeline has more than one stage.
"""
from __future__ import annotations

import importlib

from ._patching import MegatronPatch, module_functions


class ScheduleSelection(MegatronPatch):
    name = "schedule_selection"

    def apply(self, executor) -> None:
        schedules = importlib.import_module("megatron.core.pipeline_parallel.schedules")
        original = schedules.get_forward_backward_func
        patch = self

        def get_forward_backward_func(pp_size=None, vp_size=None, schedule_pg_collection=None):
            if pp_size is None and vp_size is None:
                from megatron.core import parallel_state

                pp_size = parallel_state.get_pipeline_model_parallel_world_size()
            if patch.installed and pp_size is not None and pp_size > 1:
                return patch.options[0]  # the executor installed now (a late binding may outlive this one)
            return original(pp_size=pp_size, vp_size=vp_size, schedule_pg_collection=schedule_pg_collection)

        self.patches.replace_everywhere(schedules, "get_forward_backward_func", get_forward_backward_func)


install, uninstall, installed = module_functions(ScheduleSelection())
