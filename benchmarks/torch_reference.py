"""PyTorch's own zero-bubble schedules as our `Schedule`s, so the benchmarks can simulate them on our costs.

torch.distributed.pipelining.ScheduleZBVZeroBubble and ScheduleInterleavedZeroBubble compute every rank's
action order in their constructor (`pipeline_order`), from the stages' group size, rank and stage count
only. We build them with stand-in stage objects that carry just those attributes, so no process group,
model or GPU is needed, and map their actions (F = forward, I = backward for inputs, W = backward for
weights, on global stage indices) to our F/B/W passes on (rank, chunk) of the "v" or "interleaved" layout.
This module imports torch; the planning package does not.
"""
from __future__ import annotations

from types import SimpleNamespace

from megatron.zero_bubble.schedules import Costs, Pass, Schedule, ScheduleError, simulate
from megatron.zero_bubble.schedules.memory import rank_memory_limits
from megatron.zero_bubble.schedules.schedule import stage_owner
from megatron.zero_bubble.schedules.vbudget import zb_v

_OPS = {"F": "F", "I": "B", "W": "W"}  # torch's computation types -> our passes


def _fake_stage(stages: int, chunks: int, stage_index: int) -> SimpleNamespace:
    # Only what the constructors read: rank 0's stages suffice, every rank's order is computed anyway.
    return SimpleNamespace(submod=None, group_size=stages, group_rank=0, num_stages=chunks * stages,
                           stage_index=stage_index, is_last=False)


def _as_schedule(pipeline_order: dict, stages: int, chunks: int, microbatches: int, layout: str,
                 name: str) -> Schedule:
    ranks: list[list[Pass]] = [[] for _ in range(stages)]
    for rank, actions in pipeline_order.items():
        for action in actions:
            if action is None:  # idle slots in torch's lock-step table
                continue
            op = _OPS.get(str(action.computation_type.value))
            if op is None:
                raise ScheduleError(f"torch's {name} has an action {action} with no F/B/W equivalent")
            owner, chunk = stage_owner(layout, stages, action.stage_index)
            if owner != rank:
                raise ScheduleError(f"torch's {name} puts stage {action.stage_index} on rank {rank}, not {owner}")
            ranks[rank].append(Pass(op, action.microbatch_index, chunk))
    return Schedule(stages, chunks, microbatches, layout, ranks, name=name)


def torch_zbv_schedule(stages: int, microbatches: int) -> Schedule:
    """PyTorch's ScheduleZBVZeroBubble order for p ranks and m microbatches, as a "v" Schedule."""
    from torch.distributed.pipelining.schedules import ScheduleZBVZeroBubble

    fake = [_fake_stage(stages, 2, 0), _fake_stage(stages, 2, 2 * stages - 1)]
    order = ScheduleZBVZeroBubble(fake, microbatches).pipeline_order
    return _as_schedule(order, stages, 2, microbatches, "v", "torch-zbv")


def torch_interleaved_zb_schedule(stages: int, chunks: int, microbatches: int) -> Schedule:
    """PyTorch's ScheduleInterleavedZeroBubble (its ZB-1p-shaped order over several chunks) for p ranks, v
    chunks and m microbatches, as an "interleaved" Schedule (virtual stage k*p + r)."""
    from torch.distributed.pipelining.schedules import ScheduleInterleavedZeroBubble

    fake = [_fake_stage(stages, chunks, k * stages) for k in range(chunks)]
    order = ScheduleInterleavedZeroBubble(fake, microbatches).pipeline_order
    return _as_schedule(order, stages, chunks, microbatches, "interleaved", "torch-interleaved-zb")


def compare_zbv_with_torch(stages: int, microbatches: int, costs: Costs | None = None) -> dict:
    """Simulate torch's ZB-V and ours on the same costs and memory: our limit is torch's highest peak.

    The limit is in M_B of each rank (p for m >= 2p-1, as 1F1B). Returns both bubble rates (the paper's
    measure and from time 0), makespans and highest peak memories in the costs' unit.
    """
    costs = costs or Costs.make(2 * stages, chunks=2)
    theirs = simulate(torch_zbv_schedule(stages, microbatches), costs)
    per_mb = rank_memory_limits(stages, 2, "v", costs, microbatches=1.0)
    limit = max(peak / mb for peak, mb in zip(theirs.peak_memory, per_mb))
    ours = simulate(zb_v(stages, microbatches, costs, memory_limit=limit), costs)
    return {
        "stages": stages,
        "microbatches": microbatches,
        "memory_limit": limit,
        "ours": _summary(ours),
        "torch": _summary(theirs),
    }


def _summary(timeline) -> dict:
    return {
        "bubble_rate": timeline.bubble_rate,
        "bubble_rate_from_zero": timeline.bubble_rate_from_zero,
        "makespan": timeline.makespan,
        "peak_memory": max(timeline.peak_memory),
    }
