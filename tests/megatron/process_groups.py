"""megatron's parallel state in a rank of the harness: made, and taken down again within one scenario.

    init_parallel_state(tp, pp, vpp, seed, ep)   megatron's model-parallel groups and RNG tracker
    destroy_parallel_state(synchronize)          megatron's destroy, then every process group but WORLD

Each harness case runs in fresh ranks (harness.spawn), so nothing outlives it. A scenario that builds several
layouts one after another destroys the groups of the one before: megatron's `destroy_model_parallel` only drops its
references, and a gloo group keeps its threads until `torch.distributed.destroy_process_group(group)`.
"""
from __future__ import annotations

import torch


def init_parallel_state(tp: int = 1, pp: int = 1, vpp: int | None = None, seed: int = 1234, ep: int = 1) -> None:
    """megatron's model-parallel groups and RNG tracker; dp = world_size / (tp * pp), of which `ep` ranks hold
    different experts of MoE layers. Whatever parallel state there was is destroyed first."""
    from megatron.core import parallel_state, tensor_parallel

    if parallel_state.model_parallel_is_initialized():
        destroy_parallel_state()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp,
        expert_model_parallel_size=ep,
    )
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def destroy_parallel_state(synchronize: bool = True) -> None:
    """megatron's destroy_model_parallel, then destroy every process group but WORLD (megatron's, and any other
    made since: they are all in torch's group map).

    With `synchronize` all ranks first meet at a barrier on WORLD, so that no rank closes a group's connections
    while a peer is still in a collective on it; every rank must then call this together.
    """
    import sys

    dist = torch.distributed
    parallel_state = sys.modules.get("megatron.core.parallel_state")  # never import megatron just for this
    if parallel_state is not None and parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if not (dist.is_available() and dist.is_initialized()):
        return
    if synchronize:
        dist.barrier()
    groups = [group for group in dist.distributed_c10d._world.pg_map if group is not dist.GroupMember.WORLD]
    while groups:  # popped, so that no reference outlives the loop
        dist.destroy_process_group(groups.pop())
