"""One entry point for every planner: `plan(name, ...)` returns a validated Schedule.

Planners are pure functions (stages, microbatches, costs, memory limit) -> Schedule. This table is what
the command line, the benchmarks and the training entry point choose from.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .costs import Costs
from .schedule import Schedule, ScheduleError
from .validate import validate

SCHEDULE_NAMES = ("1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "zb-auto", "zb-v", "v-half", "v-min")


@dataclass(frozen=True)
class PlanRequest:
    stages: int
    microbatches: int
    costs: Costs | None = None  # None: uniform unit costs
    chunks: int | None = None  # None: the schedule's natural chunk count (1, or 2 for V shapes)
    memory_limit: float | None = None  # in-flight microbatches (p = ZB-1p, 2p = ZB-2p)
    memory_limit_absolute: float | None = None  # in the costs' memory unit (bytes when costs carry bytes)
    ilp_time_limit: float = 10.0  # seconds; 0 skips the ILP refinement
    progress: Callable[[str], None] | None = None  # called with a line of progress during long ILP runs


def natural_chunks(name: str) -> int:
    return 2 if name in ("zb-v", "v-half", "v-min", "interleaved-1f1b") else 1


def default_costs(request: PlanRequest, name: str) -> Costs:
    chunks = request.chunks or natural_chunks(name)
    if request.costs is not None:
        return request.costs
    return Costs.make(request.stages * chunks, chunks=chunks)


def _build(name: str, r: PlanRequest, costs: Costs) -> Schedule:
    # Imported on use: each planner module is independent and some (the ILP) are heavier to import.
    chunks = r.chunks or natural_chunks(name)
    if name == "1f1b":
        from .baselines import one_f_one_b

        return one_f_one_b(r.stages, r.microbatches)
    if name == "interleaved-1f1b":
        from .baselines import interleaved_one_f_one_b

        return interleaved_one_f_one_b(r.stages, r.microbatches, chunks)
    if name in ("zb-h1", "zb-h2"):
        from .handcrafted import zb_h1, zb_h2

        return (zb_h1 if name == "zb-h1" else zb_h2)(r.stages, r.microbatches)
    if name == "zb-auto":
        from .auto import zb_auto

        return zb_auto(
            r.stages, r.microbatches, costs, r.memory_limit, r.memory_limit_absolute, r.ilp_time_limit, r.progress
        )
    if name in ("zb-v", "v-half", "v-min"):
        from . import vshape

        planner = {"zb-v": vshape.zb_v, "v-half": vshape.v_half, "v-min": vshape.v_min}[name]
        return planner(r.stages, r.microbatches, costs, r.memory_limit, r.memory_limit_absolute)
    raise ScheduleError(f"unknown schedule {name!r}; choose one of {', '.join(SCHEDULE_NAMES)}")


def plan(name: str, request: PlanRequest) -> Schedule:
    """Build the named schedule and check it with the validator before handing it out."""
    if request.stages < 2 and name != "1f1b":
        raise ScheduleError(f"pipeline schedules need at least 2 stages, got {request.stages}")
    if request.microbatches < 1:
        raise ScheduleError(f"need at least 1 microbatch, got {request.microbatches}")
    if name in ("zb-v", "v-half", "v-min") and (request.chunks or 2) != 2:
        raise ScheduleError(f"{name} places exactly 2 chunks per rank (a V), got chunks={request.chunks}")
    costs = default_costs(request, name)
    schedule = _build(name, request, costs)
    timeline = validate(schedule, costs, request.memory_limit, request.memory_limit_absolute)
    schedule.info.setdefault("predicted", {})
    schedule.info["predicted"].update(
        bubble_rate=timeline.bubble_rate, makespan=timeline.makespan, peak_memory=timeline.peak_memory
    )
    return schedule
