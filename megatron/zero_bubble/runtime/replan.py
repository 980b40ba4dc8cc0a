"""Plan on one rank, run everywhere, measure, re-plan: the schedule behind a training run's executor.

`ReplanningPipeline` is what megatron's `get_forward_backward_func()` returns (schedule_selection.py).
It owns a `PipelineExecutor` whose `plan_for(m)` it answers, and puts three collaborators together:

- planning (planning.py): rank 0 decides the schedule from the costs it knows (from the model shape,
  then measured) under the memory limit;
- agreement (agreement.py): every rank's facts go to rank 0, its decision comes back, every rank
  validates it, so all run the same schedule;
- profiling (profiling.py): while megatron's iteration counter (completed iterations; its log prints
  counter i as "iteration i+1") is in [timers_start_iter, timers_end_iter), counted from the counter at this
  process's first training call (0 for a new run, the checkpoint's iteration for a resumed one: a resumed run
  re-plans on costs it measured, as a new run does), every rank records pass times
  and activation bytes. At the end of counter timers_end_iter - 1 each rank times a p2p ping-pong
  (T_comm), rank 0 re-plans from the measurements (the slowest replica of each stage), and every rank
  switches at the same iteration (logged as timers_end_iter + 1).
  In the timer window a memory probe (memory_probe.py) also reads the allocator after every compute pass.
Rank 0 prints one line when the training schedule is first planned and one after re-planning (iterations
named as megatron's log names them), and at the end of the timer window one line with the memory each rank
held in the last profiled iteration next to the planner's prediction, and one with each rank's model state and
its peak with the activations (memory_report.py); with a dump
directory it writes each schedule as JSON (the re-planned one with that comparison) and PNG.
"""
from __future__ import annotations

import dataclasses
import math
import os
import time
from typing import Callable

import torch
import torch.distributed as dist

from ..schedules.costs import Costs
from ..schedules.planners import layout_of
from ..schedules.schedule import Pass, Schedule, ScheduleError
from ..schedules.ops import facts
from ..schedules.trace import TraceRow, chrome_trace, write_trace
from ..schedules.validate import validate
from .agreement import agree, schedule_of
from .executor import PipelineExecutor
from .memory_probe import MemoryProbe
from .memory_report import describe_memory, describe_memory_per_device, describe_replanned_memory
from .p2p import current_device
from .planning import PlanSettings, RankZeroPlanner, describe_costs
from .profiling import Profiler, measure_p2p_seconds

__all__ = ["PlanSettings", "ReplanningPipeline"]


class ReplanningPipeline:
    """Callable like megatron's forward_backward functions; see the module docstring."""

    def __init__(self, settings: PlanSettings, current_iteration: Callable[[], int], megatron,
                 log: Callable[[str], None] = print, split_check=None, messaging=None):
        self.settings = settings
        self.current_iteration = current_iteration
        self.megatron = megatron  # patches.megatron_adapter.MegatronAdapter
        self.log = log  # one line; the caller prints it on global rank 0 only
        # split_check.SplitCheck; messaging: messaging.MessagingOptions
        self.executor = PipelineExecutor(self.plan_for, megatron, split_check=split_check, messaging=messaging)
        self.planner = RankZeroPlanner(settings, log)
        self.schedules: dict[int, Schedule] = {}  # by number of microbatches (training and evaluation)
        self.profiler: Profiler | None = None
        self.memory_probe: MemoryProbe | None = None  # reads the allocator in profiled calls only
        self._call_start, self._measured = 0.0, []  # the timed call's start and its passes (pass, start, end)
        self._announced: set[int] = set()
        self._window_placed = False  # the timer window counted from the first training call's iteration
        # after a re-plan with memory figures: (the logged iteration it runs from, its planned bytes per rank), so
        # that the first call under it reads the allocator too and says what it held against that plan
        self._memory_after_replan: tuple[int, list] | None = None

    @property
    def layout(self) -> str:
        return layout_of(self.settings.schedule, self.settings.chunks)

    def release(self) -> None:
        self.executor.release()

    def close(self) -> None:
        self.executor.close()

    # -- the forward-backward call ---------------------------------------------------------------------
    def __call__(self, **kwargs):
        s = self.settings
        training = not kwargs.get("forward_only", False)
        timing = False
        if training:
            iteration = self.current_iteration()
            s = self._place_window(iteration)
            timing = s.timers_start_iter <= iteration < s.timers_end_iter
            m = kwargs["num_microbatches"]
            if m not in self._announced:
                self._announced.add(m)
                self._report(self.plan_for(m), "initial")
        if timing:
            if self.profiler is None:
                self.profiler = Profiler(s.chunks)
                self.memory_probe = self.memory_probe or MemoryProbe(current_device())
            kwargs["forward_step_func"] = self.profiler.forward_step(kwargs["forward_step_func"], kwargs["model"])
        if timing:  # this iteration's passes, from the start of this call (the last one is dumped)
            self._call_start, self._measured = time.perf_counter(), []
        checking = training and not timing and self._memory_after_replan is not None
        result = self.executor(**kwargs, pass_observer=self._record_pass if timing else None,
                               memory_probe=self.memory_probe if timing or checking else None)
        if checking:
            self._check_replanned_memory(kwargs)
        if timing:
            self.profiler.end_iteration(self.executor.last_stats)
            if iteration == s.timers_end_iter - 1:
                self._replan(kwargs, first_logged=iteration + 2)  # megatron logs counter i as iteration i+1
        return result

    def _place_window(self, first_iteration: int) -> PlanSettings:
        """The settings with the timer window counted from `first_iteration`, the counter at the first training
        call (a resumed run starts at its checkpoint's); set once, for the planner's lines and records too."""
        if not self._window_placed:
            self._window_placed = True
            if first_iteration:
                s = self.settings
                self.settings = dataclasses.replace(s, timers_start_iter=s.timers_start_iter + first_iteration,
                                                    timers_end_iter=s.timers_end_iter + first_iteration)
                self.planner.settings = self.settings
        return self.settings

    def _record_pass(self, p: Pass, start: float, end: float) -> None:
        self._measured.append((p, start - self._call_start, end - self._call_start))
        if not facts(p.op).takes_time:  # the post-validation passes: no cost of the plan's
            return
        self.profiler.record_pass(p.op, p.chunk, end - start)

    # -- planning, agreed by every rank ----------------------------------------------------------------
    def plan_for(self, num_microbatches: int) -> Schedule:
        schedule = self.schedules.get(num_microbatches)
        if schedule is None:
            schedule, _ = self._agree(num_microbatches, self._local_facts(), previous=None)
            self.schedules[num_microbatches] = schedule
        return schedule

    def _local_facts(self, **extra) -> dict:
        facts = dict(extra)
        if current_device().type == "cuda":
            free, _ = torch.cuda.mem_get_info()
            facts["free_bytes"] = free + torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
            facts["pp_rank"] = self.megatron.default_pg_collection().pp.rank()
        return facts

    def _agree(self, m: int, facts: dict, previous: Schedule | None) -> tuple[Schedule, dict | None]:
        """The schedule rank 0 plans from every rank's `facts` (`previous` when re-planning failed), and after a
        timer window the memory measured against planned (memory_report.py)."""
        decision = agree(facts, lambda gathered: self.planner.decide(m, gathered, previous))
        try:
            schedule = schedule_of(decision)
            if previous is not None:  # its lowering and proofs now, as its first iteration would make them: every
                self.executor.prepare(schedule)  # rank makes the same, so all keep or all switch
        except ScheduleError as error:
            if previous is None:
                raise
            self.log(f"{error}; keeping the current schedule")
            return previous, decision.memory
        self.planner.accept(schedule)
        return schedule, decision.memory

    # -- what rank 0 tells -----------------------------------------------------------------------------
    def _report(self, schedule: Schedule, when: str) -> None:
        """One log line about the schedule now used for training, and its JSON and PNG in the dump dir."""
        s, info = self.settings, schedule.info
        limit = info.get("memory_limit")
        where = f"p={s.stages}, m={schedule.microbatches}" + (f", {s.chunks} chunks per rank" if s.chunks > 1 else "")
        where += f", memory limit {limit:g} microbatches" if limit is not None else ""
        if info.get("memory_limit_of_1f1b") is not None:
            where += f", memory limit {info['memory_limit_of_1f1b']:g}x 1F1B's peak"
        if info.get("memory_limit_bytes_per_rank") is not None:
            where += (", memory limit " + " / ".join(f"{amount / 2**30:.3g}" for amount in info["memory_limit_bytes_per_rank"])
                      + " GiB per rank (free device memory)")
        if info.get("wgrad_in_b"):
            where += f", W of {', '.join(info['wgrad_in_b'])} kept in B"
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
        chunks = call_kwargs["model"] if isinstance(call_kwargs["model"], list) else [call_kwargs["model"]]
        config = self.megatron.model_config(chunks[0])
        pg = call_kwargs.get("pg_collection") or self.megatron.default_pg_collection()
        shape = self.megatron.pipeline_tensor_shape(config, pg, call_kwargs["seq_length"],
                                                    call_kwargs["micro_batch_size"], call_kwargs.get("decoder_seq_length"))
        t_comm = measure_p2p_seconds(pg.pp, shape, config.pipeline_dtype, current_device(),
                                     self.executor.messaging.ops)
        report = self.profiler.report(len(chunks), pg.pp.rank())
        element = torch.empty((), dtype=config.pipeline_dtype).element_size()
        report.update(pipeline_tensor_bytes=math.prod(shape) * element,  # for the held-memory model
                      outputs_freed_when_sent=bool(config.deallocate_pipeline_outputs))
        m = call_kwargs["num_microbatches"]
        previous = self.plan_for(m)
        schedule, memory = self._agree(m, self._local_facts(report=report, t_comm=t_comm), previous)
        self.profiler = None
        if memory is not None:
            self.log(describe_memory(memory))
            if any(v is not None for v in memory["model_state_bytes"]):
                self.log(describe_memory_per_device(memory))
        if self.settings.dump_dir is not None:
            self._dump_measured(previous, Costs.from_dict(schedule.info["costs"]), pg.pp.rank(), first_logged - 1,
                                memory)
        if schedule is not previous:
            self.schedules[m] = schedule
            self._report(schedule, str(first_logged))
            if memory is not None and memory.get("replanned_bytes") is not None:
                self._memory_after_replan = (first_logged, memory["replanned_bytes"])

    def _check_replanned_memory(self, call_kwargs: dict) -> None:
        """The first call under a re-planned schedule: every rank's measured peak to every rank (one all-gather, made
        by every rank at the same call), said beside the plan's prediction (the caller prints global rank 0's)."""
        logged, planned = self._memory_after_replan
        self._memory_after_replan = None
        pg = call_kwargs.get("pg_collection") or self.megatron.default_pg_collection()
        held = self.executor.last_stats.memory
        mine = {"pp_rank": pg.pp.rank(), "held_peak_bytes": None if held is None else held.peak}
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        measured = [max((g["held_peak_bytes"] for g in gathered if g["pp_rank"] == rank
                         and g["held_peak_bytes"] is not None), default=None) for rank in range(len(planned))]
        self.log(describe_replanned_memory(logged, measured, planned))

    def _dump_measured(self, ran: Schedule, costs: Costs, pp_rank: int, logged_iteration: int,
                       memory: dict | None = None) -> None:
        """Every rank's passes of the last profiled iteration, next to their planned starts (`ran` simulated on
        the measured costs), as Chrome trace JSON in the dump directory. Each rank's times run from the start of
        its own forward-backward call. `memory`: measured against planned (memory_report.py), under otherData."""
        mine = [(pp_rank, p.op.value, p.mb, p.chunk, start, end) for p, start, end in self._measured]
        gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(mine, gathered, dst=0)
        if dist.get_rank() != 0:
            return
        planned = {(t.rank, t.op): t.start for passes in validate(ran, costs).ranks for t in passes}
        rows = [TraceRow(rank, Pass(op, mb, chunk), start * 1e3, end * 1e3, ran.virtual_stage(pipeline_rank, chunk),
                         {"pipeline_rank": pipeline_rank,
                          "planned_start_ms": planned.get((pipeline_rank, Pass(op, mb, chunk)), 0.0) * 1e3})
                for rank, passes in enumerate(gathered) for pipeline_rank, op, mb, chunk, start, end in passes]
        os.makedirs(self.settings.dump_dir, exist_ok=True)
        stem = f"{self.settings.schedule}-m{ran.microbatches}-measured-iter{logged_iteration}"
        trace = chrome_trace(rows, source=f"measured ({self.settings.schedule}, iteration {logged_iteration})",
                             ranks=len(gathered))
        if memory is not None:
            trace["otherData"] = {"memory": memory}
        write_trace(trace, os.path.join(self.settings.dump_dir, stem + ".trace.json"))
