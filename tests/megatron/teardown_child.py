"""One process's end, in a process of its own (test_clean_exit.py runs it): gloo threads are counted process-wide, so
the count must not see groups that other tests of the same process left behind.

    python tests/megatron/teardown_child.py all-destroyed|one-held|rotary-cached STORE_FILE

megatron.core.parallel_state is a stand-in here, as a run leaves it: destroy_model_parallel destroys its gloo group,
and one group stays in a global it forgets (as megatron-core 0.19.2 forgets
_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_GLOO). In `rotary-cached`, megatron's real RotaryEmbedding has run a
forward (memoized at class level) on a gloo context-parallel group, and the rank has dropped the module, as a run
with rotary positions leaves it.
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


def rotary_embedding_class() -> type:
    """megatron's RotaryEmbedding, imported before the stand-in parallel state replaces the real one."""
    from megatron.zero_bubble.patches import cpu_backend

    cpu_backend.install()  # megatron.core imports without triton; the rotary module sees the CPU as its device
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    return RotaryEmbedding


def run_and_drop(rotary_embedding: type) -> None:
    """A rotary module on a context-parallel group of its own, its forward run once, the module dropped."""
    rotary = rotary_embedding(kv_channels=16, rotary_percent=1.0, cp_group=dist.new_group([0], backend="gloo"))
    rotary.forward(8)


def main(scenario: str, store: str) -> None:
    # megatron imported first, as a run imports it (a module of megatron.core imported later keeps the default group)
    rotary_embedding = rotary_embedding_class() if scenario == "rotary-cached" else None
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    state = megatron_state()
    held = [dist.new_group([0], backend="gloo")] if scenario == "one-held" else []  # a reference it cannot know of
    if rotary_embedding is not None:
        run_and_drop(rotary_embedding)
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
