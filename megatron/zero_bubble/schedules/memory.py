"""The activation-memory model: what each pass adds or frees, and memory limits per rank.

Limits come in the users' unit, in-flight microbatches (p = ZB-1p, 2p = ZB-2p: multiples of the rank's
own one-microbatch activation M_B), or in the cost model's unit (bytes when costs carry bytes).
"""
from __future__ import annotations

from .costs import Costs
from .schedule import Pass, Schedule, ScheduleError, stage_owner


def memory_delta(p: Pass, vstage: int, costs: Costs) -> float:
    """Activation memory a pass adds (F) or frees (B keeps M_W of M_B, W frees M_W, BW frees all; V none)."""
    if p.op == "V":
        return 0.0
    if p.op == "F":
        return costs.m_f[vstage]
    if p.op == "B":
        return costs.m_w[vstage] - costs.m_f[vstage]
    if p.op == "W":
        return -costs.m_w[vstage]
    return -costs.m_f[vstage]


def memory_profile(schedule: Schedule, costs: Costs) -> list[list[float]]:
    """Per rank, activation memory held after each pass (depends on order only, not on timing)."""
    profiles = []
    for rank, passes in enumerate(schedule.ranks):
        held, profile = 0.0, []
        for p in passes:
            held += memory_delta(p, schedule.virtual_stage(rank, p.chunk), costs)
            profile.append(held)
        profiles.append(profile)
    return profiles


def rank_memory_limits(
    stages: int,
    chunks: int,
    layout: str,
    costs: Costs,
    microbatches: float | None = None,
    absolute: float | None = None,
) -> list[float] | None:
    """Per-rank limit in the costs' unit, from a limit in microbatches or in the costs' own unit."""
    if microbatches is not None and absolute is not None:
        raise ScheduleError("give the memory limit in microbatches or in the costs' unit, not both")
    if absolute is not None:
        return [float(absolute)] * stages
    if microbatches is None:
        return None
    if microbatches <= 0:
        raise ScheduleError(f"memory limit must be positive, got {microbatches}")
    owned = [[] for _ in range(stages)]
    for v in range(stages * chunks):
        owned[stage_owner(layout, stages, v)[0]].append(v)
    return [microbatches * m for m in costs.rank_microbatch_memory(owned)]
