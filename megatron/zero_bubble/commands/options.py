"""What the `zb-schedule` commands share: reading costs, memory limits and a schedule (planned or from a JSON file)
from the command line, the one-line usage errors, and the progress lines of long plans.

Every planner is reached through `planners.plan` (schedules/, the torch-free planning layer below).
"""
from __future__ import annotations

import argparse
import math
import re
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

from ..schedules.costs import DEFAULT_MW_RATIO, Costs
from ..schedules.planners import (SCHEDULE_NAMES, PlanRequest, accepts_chunks, ilp_schedules, layout_of,
                                  multi_chunk_schedules, natural_chunks, plan_with_timeline, schedule_kind)
from ..schedules.post_validation import with_post_validation
from ..schedules.problem import MemoryLimit
from ..schedules.schedule import Schedule, ScheduleError, stage_owner
from ..schedules.simulate import Timeline
from ..schedules.validate import validate
from ..schedules.vbudget import mem_setup_limit

PROG = "zb-schedule"
DEFAULT_WIDTH = 100  # characters of a text picture
DEFAULT_ILP_TIME_LIMIT = 10.0  # seconds
# The paper's evaluated models (seq 1024); the vocabulary is GPT-2's padded to a multiple of 128 (our choice).
MODEL_PRESETS = {
    "1.5b": dict(layers=22, hidden=2304, heads=24, micro_batch=6, stages=8),
    "6.2b": dict(layers=30, hidden=4096, heads=32, micro_batch=3, stages=8),
    "14.6b": dict(layers=46, hidden=5120, heads=40, micro_batch=1, stages=16),
    "28.3b": dict(layers=62, hidden=6144, heads=48, micro_batch=1, stages=32),
}
PRESET_SEQ_LENGTH, PRESET_VOCAB = 1024, 50304
_SHAPE_OPTIONS = ("layers", "hidden", "heads", "seq_length", "micro_batch_size", "vocab_size")
_BYTE_UNITS = {"b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12,
               "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


class UsageError(Exception):
    """Bad command-line input; reported as one line, like ScheduleError."""


class PlannerUnavailable(ScheduleError):
    """The planner's module is not part of this installation (yet)."""


class CommandParser(argparse.ArgumentParser):
    def error(self, message):  # argparse would print the usage and exit; we want one line
        raise UsageError(message)


class Progress:
    """Signs of life on stderr for planning that takes more than a second.

    After one second it says what is being planned (and how long the ILP may take), then shows the
    planner's own progress lines, and at the end how long planning took. Quick plans print nothing.
    """

    def __init__(self, name: str, stream=None, what: str | None = None):
        self.name, self.stream, self.started, self.shown = name, stream or sys.stderr, time.monotonic(), False
        self.lock = threading.Lock()
        self.timer = None
        if what is not None:  # the heartbeat: said once, after a second, while the planner may be silent
            self.timer = threading.Timer(1.0, self._say, (f"planning {what} ...",))
            self.timer.daemon = True
            self.timer.start()

    def _say(self, line: str) -> None:
        with self.lock:
            self.stream.write(f"{PROG}: {self.name}: {line}\n")
            self.stream.flush()
            self.shown = True

    def __call__(self, line: str) -> None:
        if time.monotonic() - self.started >= 1.0:
            self._say(line)

    def finish(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
        seconds = time.monotonic() - self.started
        if seconds >= 1.0:
            self._say(f"planned in {seconds:.1f} s")


def parse_memory_limit(text: str | None) -> tuple[float | None, float | None]:
    """'16' -> 16 in-flight microbatches; '40GiB' -> 40 * 2**30 bytes. Returns (microbatches, bytes)."""
    if text is None:
        return None, None
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[+-]?\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not match or (match.group(2) and match.group(2).lower() not in _BYTE_UNITS):
        raise UsageError(f"memory limit {text!r} is neither a number of microbatches nor bytes like 40GiB")
    value, unit = float(match.group(1)), match.group(2).lower()
    return (None, value * _BYTE_UNITS[unit]) if unit else (value, None)


def parse_times(text: str | None, what: str) -> float | list[float] | None:
    if text is None:
        return None
    try:
        values = [float(v) for v in text.split(",")]
        if not all(math.isfinite(v) for v in values):
            raise ValueError
    except ValueError:
        raise UsageError(f"{what} must be a number or comma-separated numbers, got {text!r}") from None
    return values[0] if len(values) == 1 else values


def _per_virtual_stage(value, stages: int, chunks: int, layout: str, what: str):
    """A rank's time (scalar or one per rank) is split evenly over its chunks; p*c values are taken as they are."""
    if value is None or isinstance(value, float):
        return None if value is None else value / chunks
    if len(value) == stages * chunks:
        return value
    if len(value) == stages:
        return [value[stage_owner(layout, stages, v)[0]] / chunks for v in range(stages * chunks)]
    per_vstage = f" or one per virtual stage ({stages * chunks})" if chunks > 1 else ""
    raise UsageError(f"{what} has {len(value)} values; give 1 or one per rank ({stages}){per_vstage}")


def chunks_for(name: str, args) -> int:
    """--chunks where the schedule plans that many chunks per rank, else its natural count (compare applies
    --chunks to the schedules that take it and plans the others as they are)."""
    if args.chunks is not None and accepts_chunks(name, args.chunks):
        return args.chunks
    return natural_chunks(name)


def _model_shape(args) -> dict | None:
    given = {k: getattr(args, k) for k in _SHAPE_OPTIONS if getattr(args, k) is not None}
    if args.model is None and not given:
        return None
    if args.model is None and len(given) < 4:
        missing = [k for k in ("layers", "hidden", "heads", "micro_batch_size") if k not in given]
        raise UsageError(f"a model shape needs --{', --'.join(m.replace('_', '-') for m in missing)} (or --model)")
    shape = dict(MODEL_PRESETS[args.model]) if args.model else {}
    shape.setdefault("seq_length", PRESET_SEQ_LENGTH)
    shape.setdefault("vocab", PRESET_VOCAB)
    renames = {"micro_batch_size": "micro_batch", "vocab_size": "vocab"}
    shape.update({renames.get(k, k): v for k, v in given.items()})
    shape.pop("stages", None)
    return shape


def costs_given(args) -> bool:
    return _model_shape(args) is not None or any(getattr(args, k) is not None for k in ("t_f", "t_b", "t_w", "t_comm"))


def build_costs(args, stages: int, chunks: int, layout: str) -> Costs:
    """The cost model for one layout: pass times (per rank or per virtual stage) or a model shape."""
    p = stages
    shape = _model_shape(args)
    times = {k: parse_times(getattr(args, k), "--" + k.replace("_", "-")) for k in ("t_f", "t_b", "t_w")}
    t_comm = parse_times(args.t_comm, "--t-comm")
    if isinstance(t_comm, list):
        raise UsageError("--t-comm takes one number")
    if shape is not None:
        if any(v is not None for v in times.values()):
            raise UsageError("give either pass times (--t-f, --t-b, --t-w) or a model shape, not both")
        if args.mw_ratio is not None:
            raise UsageError("--mw-ratio sets M_W / M_B for pass times; a model shape has its own (32h / (34h + 5as)): "
                             "drop --mw-ratio")
        costs = Costs.from_model(**shape, num_virtual_stages=p * chunks, time_unit="ms")
        return costs if t_comm is None else replace(costs, t_comm=t_comm)
    per_stage = {k: _per_virtual_stage(v, p, chunks, layout, "--" + k.replace("_", "-")) for k, v in times.items()}
    m_f = [1.0 / chunks] * (p * chunks)
    return Costs.make(
        p * chunks,
        **{k: (1.0 / chunks if v is None else v) for k, v in per_stage.items()},
        t_comm=t_comm or 0.0,
        m_f=m_f,
        m_w=[(DEFAULT_MW_RATIO if args.mw_ratio is None else args.mw_ratio) * x for x in m_f],
        chunks=chunks,
        time_unit="ms",
    )


def _memory_limit(args, costs: Costs, layout: str, stages: int) -> MemoryLimit | None:
    """--memory-limit, or for the V schedules --mem-setup (the reference implementation's short form)."""
    setup = getattr(args, "mem_setup", None)
    if setup is not None:
        if args.memory_limit is not None:
            raise UsageError("give either --memory-limit or --mem-setup, not both")
        if layout == "v":
            return MemoryLimit(mem_setup_limit(setup, stages))
        if args.command != "compare":  # compare applies it to the V schedules it lists and no others
            raise UsageError(f"--mem-setup applies to the V schedules (zb-v, v-half, v-min), not to the "
                             f"{layout!r} layout")
        return None
    text = args.memory_limit
    try:
        of_1f1b = None if text is None else MemoryLimit.parse_of_1f1b(text)  # a multiple of 1F1B's fullest rank
    except (ValueError, ScheduleError):
        raise UsageError(f"memory limit {text!r}: a multiple of 1F1B's peak is a positive number and x, "
                         f"like 1x") from None
    if of_1f1b is not None:
        return of_1f1b
    microbatches, absolute = parse_memory_limit(text)
    if absolute is not None and costs.memory_unit != "bytes":
        raise UsageError("a memory limit in bytes needs costs in bytes: give a model shape (--model or --layers ...)")
    return MemoryLimit.of(microbatches, absolute)


def plan_schedule(args, name: str, progress_stream=None) -> tuple[Schedule, Costs, Timeline, float]:
    """Plan one named schedule on the command line's costs; returns it with its costs, its simulated timeline
    and the planning seconds."""
    if name not in SCHEDULE_NAMES:
        raise UsageError(f"unknown schedule {name!r}; choose one of {', '.join(SCHEDULE_NAMES)}")
    if args.stages is None or args.microbatches is None:
        raise UsageError("give --stages and --microbatches (or --input FILE)")
    if args.stages < 2:
        raise UsageError(f"a pipeline needs at least 2 stages, got --stages {args.stages}")
    if args.chunks is not None and not accepts_chunks(name, args.chunks) and args.command != "compare":
        raise UsageError(f"{name} plans {schedule_kind(name).chunks_text()} chunk(s) per rank, not --chunks "
                         f"{args.chunks}; --chunks applies to {', '.join(multi_chunk_schedules())}")
    ilp_time_limit = DEFAULT_ILP_TIME_LIMIT if args.ilp_time_limit is None else args.ilp_time_limit
    if ilp_time_limit < 0:
        raise UsageError(f"--ilp-time-limit must not be negative, got {ilp_time_limit}")
    if args.ilp_time_limit is not None and not schedule_kind(name).ilp and args.command != "compare":
        raise UsageError(f"--ilp-time-limit applies to {', '.join(ilp_schedules())}; "
                         f"{name} has no ILP refinement: drop --ilp-time-limit")
    chunks = chunks_for(name, args)
    layout = layout_of(name, chunks)
    costs = build_costs(args, args.stages, chunks, layout)
    memory_limit = _memory_limit(args, costs, layout, args.stages)
    ilp = f"; its ILP refinement may take up to {ilp_time_limit:g} s (--ilp-time-limit)" \
        if schedule_kind(name).ilp and ilp_time_limit > 0 else ""
    progress = Progress(name, progress_stream, f"p={args.stages}, m={args.microbatches}{ilp}")
    request = PlanRequest(
        stages=args.stages,
        microbatches=args.microbatches,
        costs=costs,
        chunks=chunks,
        memory_limit=memory_limit,
        ilp_time_limit=ilp_time_limit,
        progress=progress,
        post_validation=getattr(args, "post_validation", False),
    )
    started = time.perf_counter()
    try:
        schedule, timeline = plan_with_timeline(name, request)
    except ImportError as e:  # planners are imported on use; a missing one should not break the others
        raise PlannerUnavailable(f"the {name} planner is not available here ({e})") from None
    finally:
        progress.finish()
    return schedule, costs, timeline, time.perf_counter() - started


def load_schedule(args) -> tuple[Schedule, Costs, Timeline]:
    """Read --input: the JSON's own costs unless cost options are given, then validate and simulate it."""
    text = Path(args.input).read_text() if args.input != "-" else sys.stdin.read()
    try:
        schedule = Schedule.from_json(text)
    except (TypeError, ValueError, AttributeError, KeyError) as e:
        if isinstance(e, ScheduleError):
            raise
        raise ScheduleError(f"{args.input} is not a schedule JSON ({type(e).__name__}: {e})") from None
    if getattr(args, "post_validation", False) and not schedule.has_post_validation():
        schedule = with_post_validation(schedule)
    if costs_given(args):
        costs = build_costs(args, schedule.stages, schedule.chunks, schedule.layout)
    elif isinstance(schedule.info.get("costs"), dict):
        costs = Costs.from_dict(schedule.info["costs"])
    else:
        costs = Costs.make(schedule.num_virtual_stages, chunks=schedule.chunks)
    return schedule, costs, validate(schedule, costs, _memory_limit(args, costs, schedule.layout, schedule.stages))


def schedule_and_timeline(args, progress_stream=None) -> tuple[Schedule, Costs, Timeline]:
    """The schedule a command reads (--input FILE) or plans (--schedule NAME), its costs and its validated
    timeline."""
    if args.input is not None:
        if args.schedule is not None:
            raise UsageError("give either --schedule or --input, not both")
        for option, value in (("--chunks", args.chunks), ("--ilp-time-limit", args.ilp_time_limit)):
            if value is not None:
                raise UsageError(f"{option} applies to planning (--schedule), not to a schedule read with --input; "
                                 f"drop {option}")
        return load_schedule(args)
    if args.schedule is None:
        raise UsageError("give --schedule NAME or --input FILE")
    schedule, costs, timeline, _ = plan_schedule(args, args.schedule, progress_stream)
    return schedule, costs, timeline
