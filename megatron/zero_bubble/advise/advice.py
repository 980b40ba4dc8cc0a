"""Plan every candidate schedule on the run's costs and predict its bubble, its time and its memory per GPU.

Each candidate is planned by the planning registry (`planners.plan_with_timeline`) on the costs of its own layout
(stage_costs.py), as training would plan it at start-up; its peak per GPU is the model state of the pipeline rank
(parameters.py) plus the most that rank holds between two passes by the held-memory model
(schedules/held_memory.py: the planner's activation model plus the pipeline tensors in flight).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..schedules.costs import Costs
from ..schedules.held_memory import held_memory_profile
from ..schedules.memory import DEVICE_MEMORY_SHARE
from ..schedules.planners import MemoryLimit, PlanRequest, default_memory_limit, layout_of, plan_with_timeline
from ..schedules.schedule import ScheduleError
from .activations import pipeline_tensor_bytes
from .candidates import GPU_MEMORY, Candidate, Change, command_line, refusal
from .parameters import ModelState, ends_per_rank, model_state, rank_params
from .run import Run

GIB = 2**30


@dataclass(frozen=True)
class Prediction:
    candidate: Candidate
    change: Change
    bubble_rate: float
    makespan: float  # in the costs' time unit
    time_unit: str
    state: tuple[ModelState, ...]  # per pipeline rank
    activations: tuple[float, ...]  # per pipeline rank: the most held between passes, bytes
    busy: tuple[float, ...] = ()  # per pipeline rank: the time its passes take, in the costs' time unit
    held_per_microbatch: tuple[float, float] = (0.0, 0.0)  # the median virtual stage's M_F and M_W, bytes
    wgrad_in_b: tuple[str, ...] = ()  # layers whose W the plan keeps inside B (schedule.info["wgrad_in_b"])

    @property
    def peak_per_rank(self) -> tuple[float, ...]:
        return tuple(s.total + a for s, a in zip(self.state, self.activations))

    @property
    def peak(self) -> float:
        return max(self.peak_per_rank)

    @property
    def peak_rank(self) -> int:
        return self.peak_per_rank.index(self.peak)


@dataclass(frozen=True)
class Skipped:
    candidate: Candidate
    reason: str


@dataclass(frozen=True)
class Advice:
    run: Run
    predictions: tuple[Prediction, ...]
    skipped: tuple[Skipped, ...]
    gpu_memory: float  # bytes
    costs_from: str

    def by_planner(self, planner: str) -> Prediction | None:
        return next((p for p in self.predictions if p.candidate.planner == planner), None)

    def relative(self, prediction: Prediction, planner: str) -> float | None:
        """Iteration time over that of the named baseline (None where it does not apply)."""
        baseline = self.by_planner(planner)
        return None if baseline is None else prediction.makespan / baseline.makespan

    @property
    def fitting(self) -> list[Prediction]:
        return [p for p in self.predictions if p.peak <= self.gpu_memory]

    @property
    def best(self) -> Prediction | None:
        """The fastest schedule that fits (the less memory of two as fast)."""
        fitting = self.fitting
        return min(fitting, key=lambda p: (round(p.makespan, 9), p.peak)) if fitting else None


def predict(run: Run, candidate: Candidate, costs: Costs, ilp_time_limit: float = 0.0,
            gpu_memory: float | None = None) -> Prediction:
    """Plan `candidate` on `costs` (of its layout) and predict its time and memory; a candidate whose limit is
    GPU_MEMORY plans each rank under the share of `gpu_memory` its model state leaves, as training's automatic limit
    plans under the free device memory."""
    layout = run.layout
    counts = layout.placement.counts(layout.pp, candidate.chunks)
    placement = layout_of(candidate.planner, candidate.chunks)
    ends = ends_per_rank(run, counts, placement)
    params = rank_params(run, counts, placement)
    state = tuple(model_state(run, rank, *end) for rank, end in zip(params, ends))
    limit = candidate.memory_limit
    if limit == GPU_MEMORY:
        default = default_memory_limit(candidate.planner, layout.pp, candidate.chunks, layout.microbatches)
        cap = MemoryLimit(default).per_rank(layout.pp, candidate.chunks, placement, costs)
        limit = _room_per_rank(state, gpu_memory, cap)
    request = PlanRequest(stages=layout.pp, microbatches=layout.microbatches, costs=costs, chunks=candidate.chunks,
                          memory_limit=limit, ilp_time_limit=ilp_time_limit)
    schedule, timeline = plan_with_timeline(candidate.planner, request)
    costs = Costs.from_dict(schedule.info["costs"])  # with the output layer's W in B where the planner kept it there
    # as in the first call: what a later call's baseline still holds of the previous one is not counted twice
    held = held_memory_profile(schedule, costs, pipeline_tensor_bytes(run), after_a_call=False)
    return Prediction(candidate=candidate, change=command_line(run, candidate), bubble_rate=timeline.bubble_rate,
                      makespan=timeline.makespan, time_unit=costs.time_unit, state=state,
                      activations=tuple(max(rank, default=0.0) for rank in held),
                      busy=tuple(sum(t.end - t.start for t in rank) for rank in timeline.ranks),
                      held_per_microbatch=(median(costs.m_f), median(costs.m_w)),
                      wgrad_in_b=tuple(schedule.info.get("wgrad_in_b", ())))


def _room_per_rank(state: tuple[ModelState, ...], gpu_memory: float | None, cap: list[float]) -> MemoryLimit:
    """Each rank's activation limit in bytes, as training's automatic limit sets it: a share of what its model state
    leaves, at most the planner's default (`cap`, bytes per rank)."""
    room = [min(DEVICE_MEMORY_SHARE * (gpu_memory - rank.total), most)
            for rank, most in zip(state, cap)] if gpu_memory else []
    if not room or min(room) <= 0:
        worst = max(range(len(state)), key=lambda r: state[r].total)
        raise ScheduleError(f"the model state of pipeline rank {worst} ({state[worst].total / GIB:.1f} GiB) leaves "
                            f"no room for activations in --gpu-memory")
    return MemoryLimit.per_rank_amounts(room)


def median(values) -> float:
    """The middle value (the upper of the two middle ones), 0 for none."""
    ordered = sorted(values)
    return float(ordered[len(ordered) // 2]) if ordered else 0.0


def advise(run: Run, parser, candidates: list[Candidate], costs_for: Callable[[list[int]], Costs],
           gpu_memory: float, costs_from: str, ilp_time_limit: float = 0.0,
           progress: Callable[[str], None] | None = None) -> Advice:
    """Every candidate that applies, predicted; the others with the reason. `costs_for(counts)` gives the costs of
    virtual stages holding those layer counts."""
    predictions, skipped = [], []
    for candidate in candidates:
        reason = refusal(parser, run, candidate)
        if reason is None:
            counts = run.layout.placement.counts(run.layout.pp, candidate.chunks)
            if progress is not None:
                progress(f"planning {candidate.label} (p={run.layout.pp}, m={run.layout.microbatches})")
            try:
                predictions.append(predict(run, candidate, costs_for(counts), ilp_time_limit, gpu_memory))
                continue
            except ScheduleError as error:
                reason = str(error)
        skipped.append(Skipped(candidate, reason))
    return Advice(run=run, predictions=tuple(predictions), skipped=tuple(skipped), gpu_memory=gpu_memory,
                  costs_from=costs_from)


def single_stage(run: Run) -> tuple[ModelState, float]:
    """Without pipelining (PP 1): the model state and one microbatch's activations, all on every GPU."""
    from .activations import stage_saved

    counts = [run.model.layers]
    state = model_state(run, rank_params(run, counts, layout_of("1f1b", 1))[0], True, True)
    return state, stage_saved(run, counts)[0].forward
