"""Plan on one rank, run everywhere, measure, re-plan: the schedule behind a training run's executor.

`ReplanningPipeline` is what megatron's `get_forward_backward_func()` returns (schedule_selection.py).
It owns a `PipelineExecutor` whose `plan_for(m)` it answers:

- The first call with m microbatches plans the schedule on global rank 0 (costs from the model shape,
  or measured ones later) and broadcasts its JSON; every rank validates it before use. Planning on one
  rank matters: the ILP is time-limited, so two ranks planning alone could disagree.
- While megatron's iteration counter (completed iterations; its log prints counter i as "iteration i+1")
  is in [timers_start_iter, timers_end_iter), every rank records pass times and activation bytes
  (profiling.py). At the end of counter timers_end_iter - 1 each rank times a p2p ping-pong (T_comm), the
  measurements are gathered to rank 0, which builds per-virtual-stage costs (the slowest replica of each
  stage) and re-plans; all ranks take the broadcast schedule for their next call, so every rank switches
  at the same iteration (logged as timers_end_iter + 1).
Rank 0 prints one line when the training schedule is first planned and one after re-planning (iterations
named as megatron's log names them); with a dump directory it writes each schedule as JSON and PNG.
"""
from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from ..schedules.costs import TIME_UNITS, Costs
from ..schedules.memory import rank_memory_limits
from ..schedules.planners import PlanRequest, default_memory_limit, layout_of, plan, schedule_kind
from ..schedules.schedule import Schedule, ScheduleError, stage_owner
from ..schedules.validate import validate
from .executor import PipelineExecutor
from .profiling import PassProfile, measure_p2p_seconds, saved_activation_bytes

DEVICE_MEMORY_SHARE = 0.9  # of free device memory the automatic limit lets activations take


@dataclass(frozen=True)
class PlanSettings:
    schedule: str
    stages: int
    chunks: int
    memory_limit: float | None  # in-flight microbatches; None: automatic (device memory on GPU)
    ilp_time_limit: float = 10.0
    timers_start_iter: int = 0
    timers_end_iter: int = 0  # equal to the start: no re-planning
    dump_dir: str | None = None
    initial_costs: Costs | None = None  # None: unit costs
    post_validation: bool = False  # V passes for the optimizer's post-update validation


def measured_costs(reports: list[dict], layout: str, stages: int, chunks: int, t_comm: float) -> Costs:
    """Per-virtual-stage costs from every rank's `PassProfile.summary()` (with its "pp_rank").

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


def describe_costs(costs: Costs) -> str:
    to_ms = TIME_UNITS[costs.time_unit] / TIME_UNITS["ms"]

    def span(values, scale=to_ms):
        low, high = min(values) * scale, max(values) * scale
        return f"{low:.3g}" if math.isclose(low, high, rel_tol=0.005) else f"{low:.3g}-{high:.3g}"

    return (f"T_F {span(costs.t_f)} ms, T_B {span(costs.t_b)} ms, T_W {span(costs.t_w)} ms, "
            f"T_comm {costs.t_comm * to_ms:.3g} ms, M_B {span(costs.m_f, 2**-20)} MiB per stage")


@dataclass(frozen=True)
class PlanDecision:
    """What rank 0 broadcasts after planning: the schedule (as JSON) or why there is none."""

    schedule_json: str | None = None
    error: str | None = None


class ReplanningPipeline:
    """Callable like megatron's forward_backward functions; see the module docstring."""

    def __init__(self, settings: PlanSettings, current_iteration: Callable[[], int],
                 log: Callable[[str], None] = print, split_backward_ready: Callable[[], bool] | None = None):
        self.settings = settings
        self.current_iteration = current_iteration
        self.log = log  # one line; the caller prints it on global rank 0 only
        self.executor = PipelineExecutor(self.plan_for, split_backward_ready=split_backward_ready)
        self.costs = settings.initial_costs
        self.schedules: dict[int, Schedule] = {}  # by number of microbatches (training and evaluation)
        self.profile: PassProfile | None = None
        self._announced: set[int] = set()

    @property
    def layout(self) -> str:
        return layout_of(self.settings.schedule)

    def release(self) -> None:
        self.executor.release()

    # -- the forward-backward call ---------------------------------------------------------------------
    def __call__(self, **kwargs):
        s = self.settings
        training = not kwargs.get("forward_only", False)
        timing = False
        if training:
            iteration = self.current_iteration()
            timing = s.timers_start_iter <= iteration < s.timers_end_iter
            m = kwargs["num_microbatches"]
            if m not in self._announced:
                self._announced.add(m)
                self._report(self.plan_for(m), "initial")
        if timing:
            kwargs["forward_step_func"] = self._profiled_forward_step(kwargs["forward_step_func"], kwargs["model"])
            self.executor.pass_timer = self._record_pass
        try:
            result = self.executor(**kwargs)
        finally:
            self.executor.pass_timer = None
        if timing:
            self.profile.iterations += 1
            if iteration == s.timers_end_iter - 1:
                self._replan(kwargs, first_logged=iteration + 2)  # megatron logs counter i as iteration i+1
        return result

    def _profiled_forward_step(self, forward_step_func, model):
        """forward_step_func that also records the activation bytes of each F (first timed iteration only:
        they do not change, and walking the graph costs time that would count in T_F)."""
        chunks = model if isinstance(model, list) else [model]
        if self.profile is None:
            self.profile = PassProfile()
            self._pending_bytes = [0] * len(chunks)
        if self.profile.iterations > 0:
            return forward_step_func
        index = {id(c): k for k, c in enumerate(chunks)}
        parameters = {id(c): list(c.parameters()) for c in chunks}

        @functools.wraps(forward_step_func)
        def forward_step(data_iterator, model, *args, **kwargs):
            output, loss_func = forward_step_func(data_iterator, model, *args, **kwargs)
            nbytes = saved_activation_bytes(output, parameters[id(model)])
            self.profile.record_forward_bytes(index[id(model)], nbytes)
            return output, loss_func

        return forward_step

    def _record_pass(self, op: str, chunk: int, mb: int, seconds: float) -> None:
        self.profile.record_pass(op, chunk, seconds)
        held = self.executor.stores[chunk].pending_bytes if chunk < len(self.executor.stores) else 0
        if op == "B":  # what this B left for its W
            self.profile.record_wgrad_bytes(chunk, held - self._pending_bytes[chunk])
        self._pending_bytes[chunk] = held

    # -- planning on one rank --------------------------------------------------------------------------
    def plan_for(self, num_microbatches: int) -> Schedule:
        schedule = self.schedules.get(num_microbatches)
        if schedule is None:
            schedule = self._agree(num_microbatches, self._local_facts(), previous=None)
            self.schedules[num_microbatches] = schedule
        return schedule

    def _local_facts(self, **extra) -> dict:
        facts = dict(extra)
        if torch.cuda.is_available():
            free, _ = torch.cuda.mem_get_info()
            facts["free_bytes"] = free + torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
        return facts

    def _agree(self, m: int, facts: dict, previous: Schedule | None) -> Schedule:
        """Gather `facts` to rank 0, plan there, broadcast; every rank validates and returns the result
        (`previous` when re-planning failed)."""
        rank = dist.get_rank()
        gathered = [None] * dist.get_world_size() if rank == 0 else None
        dist.gather_object(facts, gathered, dst=0)
        payload = [self._plan_on_rank0(m, gathered, previous) if rank == 0 else None]
        dist.broadcast_object_list(payload, src=0)
        decision: PlanDecision = payload[0]
        if decision.error is not None:
            if previous is None:
                raise ScheduleError(decision.error)
            self.log(f"{decision.error}; keeping the current schedule")
            return previous
        schedule = Schedule.from_json(decision.schedule_json)
        costs = Costs.from_dict(schedule.info["costs"])
        validate(schedule, costs, schedule.info["memory_limit"])  # the same check on every rank: all agree
        self.costs = costs
        return schedule

    def _plan_on_rank0(self, m: int, gathered: list[dict], previous: Schedule | None) -> PlanDecision:
        s = self.settings
        costs, source = self.costs, "estimated from the model shape"
        if costs is None:
            costs, source = Costs.make(s.stages * s.chunks, chunks=s.chunks), "unit costs"
        if gathered[0].get("report"):
            t_comm = sorted(t for facts in gathered for t in facts["t_comm"])
            t_comm = t_comm[len(t_comm) // 2] if t_comm else 0.0
            costs = measured_costs([f["report"] for f in gathered], self.layout, s.stages, s.chunks, t_comm)
            source = f"measured in iterations {s.timers_start_iter + 1}-{s.timers_end_iter}"  # as megatron logs them
        cost_aware = schedule_kind(s.schedule).cost_aware
        limit = self._memory_limit(costs, gathered) if cost_aware else None
        try:
            if cost_aware or previous is None:
                schedule = plan(s.schedule, PlanRequest(stages=s.stages, microbatches=m, costs=costs, chunks=s.chunks,
                                                        memory_limit=limit, ilp_time_limit=s.ilp_time_limit,
                                                        post_validation=s.post_validation))
            else:  # a fixed order: only its prediction changes with the costs
                schedule = Schedule.from_dict(previous.to_dict())
                schedule.info["predicted"] = {"bubble_rate": validate(previous, costs).bubble_rate}
        except ScheduleError as error:
            return PlanDecision(error=f"zero-bubble: could not plan {s.schedule} for m={m} ({error})")
        schedule.info.update(costs=costs.to_dict(), memory_limit=limit, costs_from=source)
        if previous is not None:
            schedule.info["previous_bubble_rate"] = validate(previous, costs).bubble_rate
        return PlanDecision(schedule_json=schedule.to_json())

    def _memory_limit(self, costs: Costs, gathered: list[dict]) -> float | None:
        """The limit in microbatches: the flag's, else (GPU) what the free device memory holds, at most the
        planner's default, else None (the planner's default, see planners.SCHEDULES)."""
        s = self.settings
        if s.memory_limit is not None:
            return s.memory_limit
        free = [facts["free_bytes"] for facts in gathered if "free_bytes" in facts]
        if not free or costs.memory_unit != "bytes":
            return None
        one_microbatch = rank_memory_limits(s.stages, s.chunks, self.layout, costs, microbatches=1)
        default = default_memory_limit(s.schedule, s.stages)
        fits = math.floor(DEVICE_MEMORY_SHARE * min(free) / max(max(one_microbatch), 1.0))
        if fits < 1:  # planning goes on with one microbatch in flight, but say that it may not fit
            self.log(f"zero-bubble: free device memory ({min(free) / 2**30:.3g} GiB) holds less than one "
                     f"microbatch's activations; planning with --zero-bubble-max-pending-backward 1")
        return float(max(1, min(default, fits)))

    # -- what rank 0 tells -----------------------------------------------------------------------------
    def _report(self, schedule: Schedule, when: str) -> None:
        """One log line about the schedule now used for training, and its JSON and PNG in the dump dir."""
        s, info = self.settings, schedule.info
        limit = info.get("memory_limit")
        where = f"p={s.stages}, m={schedule.microbatches}" + (f", {s.chunks} chunks per rank" if s.chunks > 1 else "")
        where += f", memory limit {limit:g} microbatches" if limit is not None else ""
        rate = info["predicted"]["bubble_rate"]
        if when == "initial":
            later = ("; re-planned from measured pass times after iteration "
                     f"{s.timers_end_iter}" if s.timers_end_iter > s.timers_start_iter else "")
            self.log(f"zero-bubble: running {s.schedule} ({where}) through the zero-bubble runtime; "
                     f"predicted bubble rate {rate:.2%} (idle share of each rank's span) on costs "
                     f"{info['costs_from']}, a rough guess until pass times are measured{later}")
        else:
            costs = describe_costs(Costs.from_dict(info["costs"]))
            self.log(f"zero-bubble: re-planned {s.schedule} ({where}) from costs {info['costs_from']} ({costs}); "
                     f"predicted bubble rate {rate:.2%} (the previous schedule: {info['previous_bubble_rate']:.2%}); "
                     f"running it from iteration {when}")
        if s.dump_dir is not None and dist.get_rank() == 0:
            self._dump(schedule, "initial" if when == "initial" else f"iter{when}")

    def _dump(self, schedule: Schedule, tag: str) -> None:
        os.makedirs(self.settings.dump_dir, exist_ok=True)
        stem = os.path.join(self.settings.dump_dir, f"{self.settings.schedule}-m{schedule.microbatches}-{tag}")
        with open(stem + ".json", "w") as f:
            f.write(schedule.to_json(indent=1))
        try:
            from ..schedules.draw import draw

            draw(validate(schedule, Costs.from_dict(schedule.info["costs"])), stem + ".png")
        except ImportError as error:  # matplotlib missing: the JSON is the contract, the picture a bonus
            self.log(f"zero-bubble: no PNG of the schedule ({error})")

    # -- the end of the timer window -------------------------------------------------------------------
    def _replan(self, call_kwargs: dict, first_logged: int) -> None:
        """Measure T_comm, agree on the re-planned schedule; it runs from megatron's logged iteration
        `first_logged` on."""
        from megatron.core import parallel_state
        from megatron.core.pipeline_parallel import schedules as mcore
        from megatron.core.utils import get_model_config

        chunks = call_kwargs["model"] if isinstance(call_kwargs["model"], list) else [call_kwargs["model"]]
        config = get_model_config(chunks[0])
        pg = call_kwargs.get("pg_collection") or self.executor.internals().default_pg_collection()
        shape = mcore.get_tensor_shapes(
            seq_length=call_kwargs["seq_length"], micro_batch_size=call_kwargs["micro_batch_size"],
            decoder_seq_length=call_kwargs.get("decoder_seq_length"), config=config, tp_group=pg.tp, cp_group=pg.cp,
        )[0]
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        t_comm = measure_p2p_seconds(pg.pp, shape, config.pipeline_dtype, device)
        report = dict(self.profile.summary(len(chunks)), pp_rank=parallel_state.get_pipeline_model_parallel_rank())
        m = call_kwargs["num_microbatches"]
        previous = self.plan_for(m)
        schedule = self._agree(m, self._local_facts(report=report, t_comm=t_comm), previous)
        self.profile = None
        if schedule is not previous:
            self.schedules[m] = schedule
            self._report(schedule, str(first_logged))
