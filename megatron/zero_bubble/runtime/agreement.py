"""Every rank runs the same schedule: rank 0 decides from what all ranks report, everyone checks the result.

Planning on one rank matters: the ILP is time-limited, so two ranks planning alone could disagree.
"""
from __future__ import annotations

from typing import Callable

import torch.distributed as dist

from ..schedules.costs import Costs
from ..schedules.schedule import Schedule, ScheduleError
from ..schedules.validate import validate
from .planning import PlanDecision


def agree(facts: dict, decide: Callable[[list[dict]], PlanDecision]) -> PlanDecision:
    """Gather every rank's `facts` to global rank 0, run `decide` there, broadcast its decision to all. Whatever
    `decide` raises becomes the decision's error, so that every rank gets it (instead of waiting in the broadcast
    for a rank that has stopped) and all stop with the same line."""
    rank = dist.get_rank()
    gathered = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(facts, gathered, dst=0)
    payload = [_decided(decide, gathered) if rank == 0 else None]
    dist.broadcast_object_list(payload, src=0)
    return payload[0]


def _decided(decide: Callable[[list[dict]], PlanDecision], gathered: list[dict]) -> PlanDecision:
    try:
        return decide(gathered)
    except Exception as error:  # noqa: BLE001 - every rank must hear of it; ScheduleError's own text is the line
        what = str(error) if isinstance(error, ScheduleError) else f"{type(error).__name__}: {error}"
        return PlanDecision(error=f"zero-bubble: planning failed on rank 0: {what}")


def schedule_of(decision: PlanDecision) -> Schedule:
    """The decided schedule, validated on this rank against the costs and limit it was planned for (every
    rank runs the same check, so all accept or all refuse); ScheduleError if there is none."""
    if decision.error is not None:
        raise ScheduleError(decision.error)
    schedule = Schedule.from_json(decision.schedule_json)
    validate(schedule, Costs.from_dict(schedule.info["costs"]), schedule.info["memory_limit"])
    return schedule
