"""What rank 0 decides when a training run (re-)plans: the costs to plan on, the memory limit, the schedule.

`RankZeroPlanner.decide(m, gathered, previous)` takes what every rank reported (`gathered`: their free
device memory, and after a timer window their measured pass times and T_comm) and returns a
`PlanDecision`: the schedule's JSON, or why there is none. It talks to no other rank; `agreement.py`
gathers the facts and broadcasts the decision.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable

from ..schedules.costs import TIME_UNITS, Costs
from ..schedules.memory import DEVICE_MEMORY_SHARE, rank_memory_limits
from ..schedules.planners import PlanRequest, default_memory_limit, layout_of, plan, schedule_kind
from ..schedules.problem import OUTPUT_LAYER, ROW_PARALLEL_LAYERS, MemoryLimit
from ..schedules.schedule import Schedule, ScheduleError, stage_owner
from ..schedules.validate import validate
from .memory_report import memory_record



@dataclass(frozen=True)
class PlanSettings:
    schedule: str
    stages: int
    chunks: int
    memory_limit: float | MemoryLimit | None  # in-flight microbatches, or Nx 1F1B's peak; None: automatic
    ilp_time_limit: float = 10.0
    timers_start_iter: int = 0
    timers_end_iter: int = 0  # equal to the start: no re-planning
    dump_dir: str | None = None
    initial_costs: Costs | None = None  # None: unit costs
    post_validation: bool = False  # S and V passes for the optimizer's post-update validation
    device_memory_share: float = DEVICE_MEMORY_SHARE  # of the free device memory, for the automatic limit
    head_wgrad: str = "auto"  # where a split schedule runs the output layer's W (PlanRequest.head_wgrad)


@dataclass(frozen=True)
class PlanDecision:
    """What rank 0 broadcasts after planning: the schedule (as JSON) or why there is none."""

    schedule_json: str | None = None
    error: str | None = None
    memory: dict | None = None  # after a timer window: measured against planned (memory_report.py)


def measured_costs(reports: list[dict], layout: str, stages: int, chunks: int, t_comm: float) -> Costs:
    """Per-virtual-stage costs from every rank's `Profiler.report()` (a PassProfile summary with "pp_rank").

    A stage's figure is the largest over its data/tensor-parallel replicas: the slowest one sets the pace.
    A fused BW counts as B (T_W = 0), so a 1F1B run predicts its own timeline; what never ran counts 0.
    """
    fields = {name: [0.0] * (stages * chunks) for name in ("t_f", "t_b", "t_w", "m_f", "m_w")}
    for vstage in range(stages * chunks):
        rank, chunk = stage_owner(layout, stages, vstage)
        replicas = [report for report in reports if report["pp_rank"] == rank]
        if not replicas:
            raise ScheduleError(f"no measurements arrived from pipeline rank {rank}")
        worst = {}
        for name in ("t_f", "t_b", "t_w", "t_bw", "m_f", "m_w"):
            values = [report[name][chunk] for report in replicas if report[name][chunk] is not None]
            worst[name] = max(values) if values else None
        if worst["t_b"] is None:
            worst["t_b"] = worst["t_bw"]
        for name in fields:
            fields[name][vstage] = worst[name] or 0.0
    return Costs(**{name: tuple(values) for name, values in fields.items()}, t_comm=t_comm, memory_unit="bytes",
                 time_unit="s")


def with_wgrad_shares(measured: Costs, estimated: Costs | None, kept_in_b=()) -> Costs:
    """Measured costs with the output layer's share of the last virtual stage's T_W and M_W, and the row-parallel
    layers' of each stage's, taken from the estimate (the passes are timed whole, a layer's part is not), so that
    re-planning weighs keeping their W in B too; not for the layers whose W ran in B (`kept_in_b`: measured so)."""
    if estimated is None or measured.num_virtual_stages != estimated.num_virtual_stages:
        return measured

    def share(part: float, whole: float) -> float:
        return part / whole if whole > 0 else 0.0

    out = measured
    if estimated.head_wgrad_known and OUTPUT_LAYER not in kept_in_b:
        out = replace(out, head_t_w=share(estimated.head_t_w, estimated.t_w[-1]) * measured.t_w[-1],
                      head_m_w=share(estimated.head_m_w, estimated.m_w[-1]) * measured.m_w[-1])
    if estimated.rows_wgrad_known and not set(ROW_PARALLEL_LAYERS) & set(kept_in_b):
        def layers(values, head):  # a stage's W without the output layer's (on the last stage)
            return [x - (head if v == len(values) - 1 else 0.0) for v, x in enumerate(values)]

        def scaled(parts, estimate, measure):
            return tuple(share(part, e) * x for part, e, x in zip(parts, estimate, measure))

        out = replace(out, row_t_w=scaled(estimated.row_t_w, layers(estimated.t_w, estimated.head_t_w),
                                          layers(measured.t_w, out.head_t_w)),
                      row_m_w=scaled(estimated.row_m_w, layers(estimated.m_w, estimated.head_m_w),
                                     layers(measured.m_w, out.head_m_w)))
    return out


def describe_costs(costs: Costs) -> str:
    to_ms = TIME_UNITS[costs.time_unit] / TIME_UNITS["ms"]

    def span(values, scale=to_ms):
        low, high = min(values) * scale, max(values) * scale
        return f"{low:.3g}" if math.isclose(low, high, rel_tol=0.005) else f"{low:.3g}-{high:.3g}"

    return (f"T_F {span(costs.t_f)} ms, T_B {span(costs.t_b)} ms, T_W {span(costs.t_w)} ms, "
            f"T_comm {costs.t_comm * to_ms:.3g} ms, M_B {span(costs.m_f, 2**-20)} MiB per stage")


class RankZeroPlanner:
    """Plans on rank 0 from the costs it knows: estimated from the model shape, then measured."""

    def __init__(self, settings: PlanSettings, log: Callable[[str], None] = print):
        self.settings = settings
        self.log = log
        self.costs = settings.initial_costs  # the costs the schedule in use was planned on

    @property
    def layout(self) -> str:
        return layout_of(self.settings.schedule, self.settings.chunks)

    def decide(self, m: int, gathered: list[dict], previous: Schedule | None) -> PlanDecision:
        s = self.settings
        costs, source = self.costs, "estimated from the model shape"
        kept = previous.info.get("wgrad_in_b", ()) if previous is not None else ()  # measured with these W in B
        if costs is None:
            costs, source = Costs.make(s.stages * s.chunks, chunks=s.chunks), "unit costs"
        if gathered[0].get("report"):
            t_comm = sorted(t for facts in gathered for t in facts["t_comm"])
            t_comm = t_comm[len(t_comm) // 2] if t_comm else 0.0
            costs = measured_costs([f["report"] for f in gathered], self.layout, s.stages, s.chunks, t_comm)
            costs = with_wgrad_shares(costs, s.initial_costs, kept)
            source = f"measured in iterations {s.timers_start_iter + 1}-{s.timers_end_iter}"  # as megatron logs them
        cost_aware = schedule_kind(s.schedule).cost_aware
        limit = self.memory_limit(costs, gathered) if cost_aware else None
        head_wgrad, rows_wgrad = s.head_wgrad, "auto"
        if OUTPUT_LAYER in kept:  # measured with its W inside B: the costs hold it there already
            head_wgrad = "in-b"
        if set(ROW_PARALLEL_LAYERS) & set(kept):
            rows_wgrad = "in-b"
        reports = [f["report"] for f in gathered if f.get("report")]
        try:
            if cost_aware or previous is None:
                schedule = plan(s.schedule, PlanRequest(stages=s.stages, microbatches=m, costs=costs, chunks=s.chunks,
                                                        memory_limit=limit, ilp_time_limit=s.ilp_time_limit,
                                                        post_validation=s.post_validation, head_wgrad=head_wgrad,
                                                        rows_wgrad=rows_wgrad))
            else:  # a fixed order: only its prediction changes with the costs
                schedule = Schedule.from_dict(previous.to_dict())
                schedule.info["predicted"] = {"bubble_rate": validate(previous, costs).bubble_rate}
        except ScheduleError as error:
            memory = memory_record(previous, costs, reports, None, s.timers_end_iter) if previous else None
            return PlanDecision(error=f"zero-bubble: could not plan {s.schedule} for m={m} ({error})", memory=memory)
        of_1f1b = limit.amount if isinstance(limit, MemoryLimit) and limit.of_1f1b else None  # checked by the planner
        per_rank = list(limit.ranks) if isinstance(limit, MemoryLimit) and limit.ranks else None  # in bytes
        if schedule.info.get("wgrad_in_b") and (cost_aware or previous is None):  # planned now, with the output
            # layer's W in B: on the costs that say so
            costs = Costs.from_dict(schedule.info["costs"])
        schedule.info.update(costs=costs.to_dict(), memory_limit=None if of_1f1b or per_rank else limit,
                             costs_from=source, **({"memory_limit_of_1f1b": of_1f1b} if of_1f1b else {}),
                             **({"memory_limit_bytes_per_rank": per_rank} if per_rank else {}))
        memory = None
        if previous is not None:
            schedule.info["previous_bubble_rate"] = validate(previous, costs).bubble_rate
            memory = memory_record(previous, costs, reports, schedule, s.timers_end_iter)
            if memory is not None:
                schedule.info["memory"] = memory
        return PlanDecision(schedule_json=schedule.to_json(), memory=memory)

    def accept(self, schedule: Schedule) -> None:
        """The schedule every rank agreed on: its costs are the ones to re-plan from."""
        self.costs = Costs.from_dict(schedule.info["costs"])

    def memory_limit(self, costs: Costs, gathered: list[dict]) -> float | MemoryLimit | None:
        """The flag's limit (microbatches, or a multiple of 1F1B's peak), else (GPU) bytes per pipeline rank: a share
        of the least free device memory of its GPUs, at most the planner's default amount of that rank's
        microbatches and at least one; else None (the planner's default, planners.SCHEDULES)."""
        s = self.settings
        if s.memory_limit is not None:
            return s.memory_limit
        free = [None] * s.stages
        for facts in gathered:
            if "free_bytes" in facts:
                rank = facts["pp_rank"]
                free[rank] = facts["free_bytes"] if free[rank] is None else min(free[rank], facts["free_bytes"])
        if any(amount is None for amount in free) or costs.memory_unit != "bytes":
            return None
        one_microbatch = rank_memory_limits(s.stages, s.chunks, self.layout, costs, microbatches=1)
        default = default_memory_limit(s.schedule, s.stages)
        room = [s.device_memory_share * amount for amount in free]
        short = [rank for rank in range(s.stages) if room[rank] < one_microbatch[rank]]
        if short:  # planning goes on with one microbatch in flight there, but say that it may not fit
            self.log(f"zero-bubble: free device memory on pipeline rank {short[0]} ({free[short[0]] / 2**30:.3g} GiB) "
                     f"holds less than one microbatch's activations; planning with one there")
        return MemoryLimit.per_rank_amounts([max(one, min(default * one, share))
                                             for one, share in zip(one_microbatch, room)])
