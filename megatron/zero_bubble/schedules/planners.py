"""The schedule registry and its one entry point: `plan(name, request)` returns a validated Schedule.

`SCHEDULES` holds every fact about a schedule name that a caller needs (layout, chunks, split backward,
cost awareness, default memory limit, the megatron options it conflicts with,
whether training offers it, and its planner); the command line, the benchmarks, the runtime and the
training entry point read them here. `plan` fills in a request's defaults before it calls a planner, so
planners are pure functions (stages, microbatches, costs, memory limit) -> Schedule that never import
this module.
"""
from __future__ import annotations

import contextlib
import gc
from dataclasses import dataclass, replace
from typing import Callable

from . import auto, baselines, handcrafted, vbudget, vshape
from .costs import Costs
from .memory import memory_profile
from .post_validation import with_post_validation
from .problem import OUTPUT_LAYER, ROW_PARALLEL_LAYERS, MemoryLimit, PlanRequest
from .schedule import Schedule, ScheduleError
from .simulate import Timeline
from .validate import validate

__all__ = ["SCHEDULES", "SCHEDULE_NAMES", "Conflict", "MemoryLimit", "PlanRequest", "ScheduleKind", "accepts_chunks",
           "collector_paused", "conflicting_options", "default_memory_limit", "ilp_schedules", "layout_of",
           "multi_chunk_schedules", "natural_chunks", "pipeline_schedule_names", "plan", "plan_with_timeline",
           "resolve", "schedule_kind", "split_backward_schedules"]


@dataclass(frozen=True)
class Conflict:
    """A megatron option (its args attribute, e.g. "overlap_grad_reduce") a schedule cannot run with."""

    option: str
    reason: str  # reads as "--<option> does not work with <schedule> (<reason>)"


# Megatron's rules for placing layers that the V cannot follow (its layout string and the embedding/loss
# accounting it does follow, patches/vshape_layout.py).
_FIRST_LAST = ("it names one rank's layers, but the V holds the first and the last virtual stage both on rank 0; "
               "lay the 2p virtual stages out with --pipeline-model-parallel-layout instead")
_V_PLACEMENT = (
    Conflict("decoder_first_pipeline_num_layers", _FIRST_LAST),
    Conflict("decoder_last_pipeline_num_layers", _FIRST_LAST),
    Conflict("mtp_num_layers", "megatron places multi-token-prediction layers by its interleaved rule"),
)


@dataclass(frozen=True)
class ScheduleKind:
    """What every caller needs to know about a schedule name, kept in one place."""

    layout: str  # how virtual stages map to ranks at its natural chunk count: "single", "interleaved" or "v"
    chunks: int  # natural model chunks per rank
    split_backward: bool  # runs B and W as separate passes (zero-bubble schedules)
    cost_aware: bool  # the pass order depends on the costs, so measured costs call for re-planning
    build: Callable[[PlanRequest], Schedule]  # the planner, given a request whose defaults are filled in
    # Default limit in in-flight microbatches for (p stages, chunks, m); None: the memory is fixed by the order.
    default_memory_limit: Callable[[int, int, int | None], float] | None = None
    trainable: bool = True  # offered by pretrain_gpt.py (--pipeline-schedule) and run by the runtime
    min_chunks: int | None = None  # chunks per rank it plans for, from min_chunks (None: `chunks` only) ...
    max_chunks: int | None = None  # ... to max_chunks (None: no upper bound once min_chunks is given)
    ilp: bool = False  # refines its plan with a time-limited ILP (PlanRequest.ilp_time_limit)
    default_memory_text: str = ""  # the default limit as a formula, for help texts

    @property
    def conflicting_options(self) -> tuple[Conflict, ...]:
        return _V_PLACEMENT if self.layout == "v" else ()

    def accepts_chunks(self, chunks: int) -> bool:
        if self.min_chunks is None:
            return chunks == self.chunks
        return chunks >= self.min_chunks and (self.max_chunks is None or chunks <= self.max_chunks)

    def chunks_text(self) -> str:
        """The chunk counts it plans for, as a phrase: "exactly 2", "1 or more", "2 to 4"."""
        if self.min_chunks is None:
            return f"exactly {self.chunks}"
        return f"{self.min_chunks} or more" if self.max_chunks is None else f"{self.min_chunks} to {self.max_chunks}"

    def layout_for(self, chunks: int | None = None) -> str:
        """The layout at `chunks` per rank (None: its natural count): a V stays a V; otherwise one chunk is
        "single" and several are megatron's "interleaved" placement (virtual stage k*p + r)."""
        chunks = self.chunks if chunks is None else chunks
        if self.layout == "v":
            return "v"
        return "single" if chunks == 1 else "interleaved"


def _v_shape(planner) -> Callable[[PlanRequest], Schedule]:
    return lambda r: planner(r.stages, r.microbatches, r.costs, r.memory_limit)


def _per_stages(limit: Callable[[int], float]) -> Callable[[int, int, int | None], float]:
    return lambda stages, chunks, microbatches: limit(stages)


SCHEDULES: dict[str, ScheduleKind] = {
    "1f1b": ScheduleKind("single", 1, split_backward=False, cost_aware=False,
                         build=lambda r: baselines.one_f_one_b(r.stages, r.microbatches)),
    "interleaved-1f1b": ScheduleKind(
        "interleaved", 2, split_backward=False, cost_aware=False, min_chunks=2,
        build=lambda r: baselines.interleaved_one_f_one_b(r.stages, r.microbatches, r.chunks)),
    "zb-h1": ScheduleKind("single", 1, split_backward=True, cost_aware=False,
                          build=lambda r: handcrafted.zb_h1(r.stages, r.microbatches)),
    "zb-h2": ScheduleKind("single", 1, split_backward=True, cost_aware=False,
                          build=lambda r: handcrafted.zb_h2(r.stages, r.microbatches)),
    "zb-auto": ScheduleKind(
        "single", 1, split_backward=True, cost_aware=True, min_chunks=1, ilp=True,
        default_memory_limit=auto.interleaved_memory_limit,
        default_memory_text="2p (ZB-2p) with one chunk; with v chunks interleaved 1F1B's peak, (2(p-1) + (v-1)p + 1)/v",
        build=lambda r: auto.zb_auto(r.stages, r.microbatches, r.costs, r.memory_limit, chunks=r.chunks,
                                     ilp_time_limit=r.ilp_time_limit, progress=r.progress)),
    "zb-v": ScheduleKind("v", 2, split_backward=True, cost_aware=True, build=_v_shape(vbudget.zb_v),
                         default_memory_limit=_per_stages(vshape.zb_v_memory_limit), default_memory_text="p"),
    "v-half": ScheduleKind("v", 2, split_backward=True, cost_aware=True, build=_v_shape(vbudget.v_half),
                           default_memory_limit=_per_stages(vshape.v_half_memory_limit), trainable=False,
                           default_memory_text="(p+2)//2"),
    "v-min": ScheduleKind("v", 2, split_backward=True, cost_aware=True, build=_v_shape(vbudget.v_min),
                          default_memory_limit=_per_stages(vshape.v_min_memory_limit), trainable=False,
                          default_memory_text="(p+4)//3"),
}
SCHEDULE_NAMES = tuple(SCHEDULES)


def schedule_kind(name: str) -> ScheduleKind:
    try:
        return SCHEDULES[name]
    except KeyError:
        raise ScheduleError(f"unknown schedule {name!r}; choose one of {', '.join(SCHEDULE_NAMES)}") from None


def layout_of(name: str, chunks: int | None = None) -> str:
    """The schedule's layout at `chunks` per rank (None: its natural chunk count)."""
    return schedule_kind(name).layout_for(chunks)


def natural_chunks(name: str) -> int:
    return schedule_kind(name).chunks


def accepts_chunks(name: str, chunks: int) -> bool:
    """Whether the schedule plans for `chunks` model chunks per rank (zb-auto: any; V shapes: 2; 1F1B: 1)."""
    return schedule_kind(name).accepts_chunks(chunks)


def multi_chunk_schedules() -> tuple[str, ...]:
    """The schedules that plan for more than one chunk per rank, in registry order."""
    return tuple(name for name, kind in SCHEDULES.items() if kind.accepts_chunks(2))


def default_memory_limit(name: str, stages: int, chunks: int | None = None,
                         microbatches: int | None = None) -> float | None:
    """The planner's limit in in-flight microbatches when none is given (None: fixed by the schedule). It may
    depend on the chunks per rank (zb-auto: interleaved 1F1B's peak; None: the natural count) and on m
    (fewer microbatches than that peak holds)."""
    kind = schedule_kind(name)
    if kind.default_memory_limit is None:
        return None
    return kind.default_memory_limit(stages, kind.chunks if chunks is None else chunks, microbatches)


def conflicting_options(name: str) -> tuple[Conflict, ...]:
    return schedule_kind(name).conflicting_options


def pipeline_schedule_names() -> tuple[str, ...]:
    """The schedules training offers (pretrain_gpt.py --pipeline-schedule), in registry order."""
    return tuple(name for name, kind in SCHEDULES.items() if kind.trainable)


def ilp_schedules() -> tuple[str, ...]:
    """The schedules whose planner has an ILP refinement (the ILP time limit applies to them only), in registry
    order."""
    return tuple(name for name, kind in SCHEDULES.items() if kind.ilp)


def split_backward_schedules() -> tuple[str, ...]:
    """Of those, the ones that split the backward into B and W (they need the linear-layer patch)."""
    return tuple(name for name in pipeline_schedule_names() if SCHEDULES[name].split_backward)


def resolve(name: str, request: PlanRequest) -> PlanRequest:
    """The request with its defaults filled in from the registry: chunks, costs and memory limit."""
    kind = schedule_kind(name)
    chunks = request.chunks or kind.chunks
    if not kind.accepts_chunks(chunks):
        raise ScheduleError(f"{name} plans {kind.chunks_text()} chunk(s) per rank, got chunks={chunks}")
    costs = request.costs if request.costs is not None else Costs.make(request.stages * chunks, chunks=chunks)
    limit = request.memory_limit
    if limit is None and kind.default_memory_limit is not None:
        limit = MemoryLimit(kind.default_memory_limit(request.stages, chunks, request.microbatches))
    if isinstance(limit, MemoryLimit) and limit.of_1f1b:
        if chunks != 1 or kind.layout != "single":
            raise ScheduleError(f"a memory limit relative to 1F1B's peak ({limit.describe()}) needs a one-chunk "
                                f"schedule; {name} with {chunks} chunk(s) takes it in microbatches")
        peaks = memory_profile(baselines.one_f_one_b(request.stages, request.microbatches), costs)
        limit = limit.resolved([max(rank, default=0.0) for rank in peaks])
    return replace(request, chunks=chunks, costs=costs, memory_limit=limit)


def plan(name: str, request: PlanRequest) -> Schedule:
    """Build the named schedule and check it with the validator before handing it out."""
    return plan_with_timeline(name, request)[0]


@contextlib.contextmanager
def collector_paused():
    """Python's cyclic garbage collector off while a plan is built, as it was afterwards.

    A large plan allocates millions of small tuples and lists (passes, timelines, placements) that live until it
    is done; each of the collector's automatic passes rescans them all, and they come every few hundred
    allocations: a quarter of the time of zb-v at p = 32 and 45% of zb-auto's at v = 8, p = 64 went there. What
    planning frees is freed by reference counting as before; a cycle it leaves waits for the next collection.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def plan_with_timeline(name: str, request: PlanRequest) -> tuple[Schedule, Timeline]:
    """`plan`, and the validator's simulated timeline of the schedule on the request's costs."""
    with collector_paused():
        return _plan_with_timeline(name, request)


def _plan_with_timeline(name: str, request: PlanRequest) -> tuple[Schedule, Timeline]:
    kind = schedule_kind(name)
    if request.stages < 2 and name != "1f1b":
        raise ScheduleError(f"pipeline schedules need at least 2 stages, got {request.stages}")
    if request.microbatches < 1:
        raise ScheduleError(f"need at least 1 microbatch, got {request.microbatches}")
    request = resolve(name, request)
    variants = _wgrad_variants(kind, request)
    if len(variants) == 1:
        return _built(kind, *variants[0])
    refine = kind.ilp and request.ilp_time_limit > 0  # weighed on the heuristic's plans; the ILP refines the one kept
    best = _fastest(kind, [(replace(v[0], ilp_time_limit=0) if refine else v[0], v[1]) for v in variants])
    if not refine:
        return best
    kept = next(v for v in variants if tuple(v[1]) == tuple(best[0].info.get("wgrad_in_b", ())))
    return _built(kind, *kept)


def _wgrad_variants(kind: ScheduleKind, request: PlanRequest) -> list[tuple[PlanRequest, list[str]]]:
    """The requests to plan, each with the layers whose W it keeps in B: where the output layer's and the
    row-parallel layers' W run (deferred, in B, or both weighed by a cost-aware split planner where the costs know
    their share); the all-deferred one first."""
    if not kind.split_backward:
        return [(request, [])]
    weighs = kind.cost_aware
    head = {"deferred": [False], "in-b": [True]}.get(request.head_wgrad,
                                                     [False, True] if weighs and request.costs.head_wgrad_known
                                                     else [False])
    rows = {"deferred": [False], "in-b": [True]}.get(request.rows_wgrad,
                                                     [False, True] if weighs and request.costs.rows_wgrad_known
                                                     else [False])
    variants = []
    for in_b_rows in rows:
        for in_b_head in head:
            costs, names = request.costs, []
            if in_b_head:
                costs, names = costs.head_wgrad_in_b(), names + [OUTPUT_LAYER]
            if in_b_rows:
                costs, names = costs.rows_wgrad_in_b(), names + list(ROW_PARALLEL_LAYERS)
            variants.append((replace(request, costs=costs), names))
    return variants


# How much shorter a plan with some W kept in B must be than the one with all W deferred: deferring is the default,
# and a change for a gain within the cost model's error would only move memory around
WGRAD_IN_B_GAIN = 1e-3


def _fastest(kind: ScheduleKind, variants: list) -> tuple[Schedule, Timeline]:
    """The shortest plan of the variants (the first, all W deferred, unless another is shorter by WGRAD_IN_B_GAIN);
    one that cannot be planned (it does not fit the limit) leaves the others. When the first is within the gain of the
    busiest rank's work, which no placement of W changes, there is nothing to win: the others are not planned."""
    built, error = [], None
    for k, variant in enumerate(variants):
        try:
            built.append((_built(kind, *variant), k))
        except ScheduleError as failure:
            error = error or failure
            continue
        if k == 0 and built[0][0][1].bubble_rate_from_zero <= WGRAD_IN_B_GAIN / (1 + WGRAD_IN_B_GAIN):
            break
    if not built:
        raise error
    return min(built, key=lambda item: (item[0][1].makespan * (1 + WGRAD_IN_B_GAIN * (item[1] > 0)), item[1]))[0]


def _built(kind: ScheduleKind, request: PlanRequest, in_b: list[str] = ()) -> tuple[Schedule, Timeline]:
    """The kind's plan for a resolved request, validated on its costs; `in_b`: the layers whose W the costs have
    inside B, and the schedule says so (info["wgrad_in_b"], which the runtime honours)."""
    schedule = kind.build(request)
    if request.post_validation:
        schedule = with_post_validation(schedule)
    timeline = validate(schedule, request.costs, request.memory_limit)
    schedule.info.setdefault("costs", request.costs.to_dict())  # the executor orders its messages on these too
    schedule.info.setdefault("predicted", {})
    schedule.info["predicted"].update(
        bubble_rate=timeline.bubble_rate, makespan=timeline.makespan, peak_memory=timeline.peak_memory
    )
    if in_b:
        schedule.info["wgrad_in_b"] = list(in_b)
    return schedule, timeline
