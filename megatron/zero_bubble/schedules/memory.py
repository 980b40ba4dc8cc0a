"""The activation-memory model: what each pass adds or frees, and memory limits per rank.

What a pass adds is a row of ops.TABLE: F adds M_B (m_f), B frees all but M_W, W frees M_W, BW frees all,
V holds nothing. Limits are problem.MemoryLimit values (in-flight microbatches or the costs' own unit).
"""
from __future__ import annotations

from .costs import Costs
from .ops import facts
from .problem import MemoryLimit
from .schedule import Schedule

# The share of a GPU's free memory the automatic limit lets activations take (the rest absorbs what the plan does not
# count: transients inside passes, pipeline tensors); training's --zero-bubble-max-pending-backward auto and advise
DEVICE_MEMORY_SHARE = 0.9


def memory_profile(schedule: Schedule, costs: Costs) -> list[list[float]]:
    """Per rank, activation memory held after each pass (depends on order only, not on timing)."""
    profiles = []
    for rank, passes in enumerate(schedule.ranks):
        deltas = {}  # per (chunk, op), worked out once
        held, profile = 0.0, []
        for p in passes:
            delta = deltas.get((p.chunk, p.op))
            if delta is None:
                delta = deltas[p.chunk, p.op] = facts(p.op).memory_change(costs, schedule.virtual_stage(rank, p.chunk))
            held += delta
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
    """Per-rank limit in the costs' unit, from a limit in microbatches or in the costs' own unit (None: none)."""
    limit = MemoryLimit.of(microbatches, absolute)
    return None if limit is None else limit.per_rank(stages, chunks, layout, costs)
