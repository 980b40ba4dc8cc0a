"""One process's end, in a process of its own (test_clean_exit.py runs it): gloo threads are counted process-wide, so
the count must not see groups that other tests of the same process left behind.

    python tests/megatron/teardown_child.py all-destroyed|one-held STORE_FILE

megatron.core.parallel_state is a stand-in here, as a run leaves it: destroy_model_parallel destroys its gloo group,
and one group stays in a global it forgets (as megatron-core 0.19.2 forgets
_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_GLOO).
Prints one line: RESULT followed by JSON.
"""
from __future__ import annotations

import gc
import json
import sys
import types

import torch.distributed as dist

from megatron.zero_bubble.training import teardown


def megatron_state() -> types.ModuleType:
    state = types.ModuleType("megatron.core.parallel_state")
    state._DATA_PARALLEL_GROUP_GLOO = dist.new_group([0], backend="gloo")
    state._INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_GLOO = dist.new_group([0], backend="gloo")
    state.model_parallel_is_initialized = lambda: state._DATA_PARALLEL_GROUP_GLOO is not None

    def destroy_model_parallel():
        dist.destroy_process_group(state._DATA_PARALLEL_GROUP_GLOO)  # megatron destroys its gloo groups itself
        state._DATA_PARALLEL_GROUP_GLOO = None

    state.destroy_model_parallel = destroy_model_parallel
    sys.modules[state.__name__] = state
    return state


def main(scenario: str, store: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    state = megatron_state()
    held = [dist.new_group([0], backend="gloo")] if scenario == "one-held" else []  # a reference it cannot know of
    result = {"before": teardown.gloo_threads(), "lines": []}
    teardown.end_distributed(log=result["lines"].append)
    result.update(initialized=dist.is_initialized(), left=teardown.gloo_threads(),
                  forgotten_global=state._INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_GLOO is None)
    held.clear()
    gc.collect()
    result["after_release"] = teardown.gloo_threads()
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
