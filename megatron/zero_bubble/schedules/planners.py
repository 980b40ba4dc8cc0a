"""One entry point for every planner: `plan(name, ...)` returns a validated Schedule.

Planners are pure functions (stages, microbatches, costs, memory limit) -> Schedule. This table is what
the command line, the benchmarks and the training entry point choose from.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .costs import Costs
from .post_validation import refuse_unsupported_layout, with_post_validation
from .schedule import Schedule, ScheduleError
from .validate import validate


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
    post_validation: bool = False  # insert the post-validation pass V on every rank (single layout only)


@dataclass(frozen=True)
class ScheduleKind:
    """What every caller needs to know about a schedule name, kept in one place."""

    layout: str  # how virtual stages map to ranks: "single", "interleaved" or "v"
    chunks: int  # natural model chunks per rank
    split_backward: bool  # runs B and W as separate passes (zero-bubble schedules)
    cost_aware: bool  # the pass order depends on the costs, so measured costs call for re-planning
    # Default limit in in-flight microbatches for p stages; None: the schedule's memory is fixed by its order.
    default_memory_limit: Callable[[int], float] | None = None


SCHEDULES: dict[str, ScheduleKind] = {
    "1f1b": ScheduleKind("single", 1, split_backward=False, cost_aware=False),
    "interleaved-1f1b": ScheduleKind("interleaved", 2, split_backward=False, cost_aware=False),
    "zb-h1": ScheduleKind("single", 1, split_backward=True, cost_aware=False),
    "zb-h2": ScheduleKind("single", 1, split_backward=True, cost_aware=False),
    "zb-auto": ScheduleKind("single", 1, split_backward=True, cost_aware=True, default_memory_limit=lambda p: 2 * p),
    "zb-v": ScheduleKind("v", 2, split_backward=True, cost_aware=True, default_memory_limit=lambda p: p),
    "v-half": ScheduleKind("v", 2, split_backward=True, cost_aware=True, default_memory_limit=lambda p: (p + 2) // 2),
    "v-min": ScheduleKind("v", 2, split_backward=True, cost_aware=True, default_memory_limit=lambda p: (p + 4) // 3),
}
SCHEDULE_NAMES = tuple(SCHEDULES)


def schedule_kind(name: str) -> ScheduleKind:
    try:
        return SCHEDULES[name]
    except KeyError:
        raise ScheduleError(f"unknown schedule {name!r}; choose one of {', '.join(SCHEDULE_NAMES)}") from None


def layout_of(name: str) -> str:
    return schedule_kind(name).layout


def default_memory_limit(name: str, stages: int) -> float | None:
    """The planner's limit in in-flight microbatches when none is given (None: fixed by the schedule)."""
    limit = schedule_kind(name).default_memory_limit
    return None if limit is None else limit(stages)


def natural_chunks(name: str) -> int:
    return schedule_kind(name).chunks


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
    if layout_of(name) == "v" and (request.chunks or 2) != 2:
        raise ScheduleError(f"{name} places exactly 2 chunks per rank (a V), got chunks={request.chunks}")
    if request.post_validation:  # refuse before planning: the V-shape planners can take a while
        refuse_unsupported_layout(name, layout_of(name))
    costs = default_costs(request, name)
    schedule = _build(name, request, costs)
    if request.post_validation:
        schedule = with_post_validation(schedule)
    timeline = validate(schedule, costs, request.memory_limit, request.memory_limit_absolute)
    schedule.info.setdefault("costs", costs.to_dict())  # the executor orders its messages on these too
    schedule.info.setdefault("predicted", {})
    schedule.info["predicted"].update(
        bubble_rate=timeline.bubble_rate, makespan=timeline.makespan, peak_memory=timeline.peak_memory
    )
    return schedule
