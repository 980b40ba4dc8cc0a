"""`zb-schedule`: plan, simulate, draw, export and compare pipeline schedules without any GPU.

    zb-schedule export   --schedule zb-h1 --stages 4 --microbatches 8 [-o plan.json]
    zb-schedule simulate --schedule zb-auto -p 8 -m 24 --memory-limit 16 --t-f 18.5 --t-b 18.1 --t-w 9.3
    zb-schedule draw     --input plan.json -o plan.png        (no -o: a text picture on stdout)
    zb-schedule compare  --schedules 1f1b,zb-h1,zb-v --model 1.5b -m 24 [-o all.svg] [--tradeoff budget.png]

Every planner is reached through `planners.plan`; bad input ends with one line on stderr, never a traceback.
"""
from __future__ import annotations

import argparse
import math
import os
import re
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

from .comm import check_lowering, lower
from .costs import DEFAULT_MW_RATIO, TIME_UNITS, Costs
from .draw import (check_picture_path, comparison_table, draw, draw_budget_curve, draw_stacked, render_text,
                   simulation_report)
from .planners import (SCHEDULE_NAMES, SCHEDULES, PlanRequest, accepts_chunks, collector_paused, default_memory_limit,
                       ilp_schedules, layout_of, multi_chunk_schedules, natural_chunks, plan_with_timeline,
                       schedule_kind)
from .post_validation import with_post_validation
from .program import TRANSPORT, program_json, simulate_program
from .problem import MemoryLimit
from .schedule import Schedule, ScheduleError, stage_owner
from .simulate import Timeline
from .trace import chrome_trace, timeline_rows, write_trace
from .validate import validate
from .vbudget import MEM_SETUPS, budget_curve, mem_setup_limit

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


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse would print the usage and exit; we want one line
        raise UsageError(message)


class _Progress:
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
    microbatches, absolute = parse_memory_limit(args.memory_limit)
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
    progress = _Progress(name, progress_stream, f"p={args.stages}, m={args.microbatches}{ilp}")
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


def cmd_export(args) -> None:
    schedule, costs, timeline = schedule_and_timeline(args)
    schedule.info["costs"] = costs.to_dict()
    schedule.info.setdefault("predicted", {}).update(
        bubble_rate=timeline.bubble_rate,
        bubble_rate_from_zero=timeline.bubble_rate_from_zero,
        makespan=timeline.makespan,
        peak_memory=timeline.peak_memory,
    )
    if args.program:
        programs = lower(schedule, costs, timeline)  # what the runtime runs: proven under every channel model
        check_lowering(schedule, programs)
        streams = simulate_program(schedule, programs, costs)
        schedule.info["predicted"].update(bubble_rate_on_streams=streams.bubble_rate, makespan_on_streams=streams.makespan)
        schedule.info["transport"] = TRANSPORT
        schedule.info["programs"] = program_json(schedule, programs)
    text = schedule.to_json(indent=1) + "\n"
    if args.output:
        Path(args.output).write_text(text)
    else:
        sys.stdout.write(text)


def cmd_simulate(args) -> None:
    schedule, costs, timeline = schedule_and_timeline(args)
    print(simulation_report(timeline))
    streams = simulate_program(schedule, lower(schedule, costs, timeline), costs)
    print(f"with the runtime's sends and receives on NCCL's in-order streams (T_comm each): makespan "
          f"{streams.makespan:.6g} {costs.time_unit}, bubble rate {streams.bubble_rate:.4f} (paper's measure)")
    if args.trace:
        unit_ms = TIME_UNITS[timeline.costs.time_unit] / TIME_UNITS["ms"]
        write_trace(chrome_trace(timeline_rows(timeline, unit_ms), source="simulated",
                                 ranks=timeline.schedule.stages), args.trace)
        print(f"{PROG}: wrote {args.trace}", file=sys.stderr)  # stdout stays the report


def cmd_draw(args) -> None:
    if args.output:
        check_picture_path(args.output)
        if args.width is not None:
            raise UsageError("--width sets the text picture's width (draw without -o); drop --width or -o")
    timeline = schedule_and_timeline(args)[2]
    if args.output:
        draw(timeline, args.output)
        print(f"wrote {args.output}")
    else:
        print(render_text(timeline, DEFAULT_WIDTH if args.width is None else args.width))


def cmd_compare(args) -> int:
    names = [n.strip() for group in (args.schedules or []) for n in group.split(",") if n.strip()]
    if not names:
        raise UsageError("compare needs --schedules a,b,c (or --schedules repeated)")
    if args.output:
        check_picture_path(args.output)
    if args.tradeoff:
        check_picture_path(args.tradeoff)
    rows, timelines, skipped = [], [], []
    for name in names:
        try:
            schedule, costs, timeline, seconds = plan_schedule(args, name)
        except ScheduleError as e:  # one schedule refusing the costs or the limit should not hide the others
            skipped.append((name, e))
            continue
        timelines.append(timeline)
        rows.append((name, timelines[-1], seconds))
    if not rows:
        if len(skipped) == 1:
            raise skipped[0][1]
        raise ScheduleError("no schedule could be planned: " + "; ".join(f"{n}: {e}" for n, e in skipped))
    for name, error in skipped:
        print(f"{PROG}: skipped {name}: {error}", file=sys.stderr)
    names = [row[0] for row in rows]
    print(comparison_table(rows))
    if args.output and args.separate:
        out = Path(args.output)
        for name, timeline in zip(names, timelines):
            draw(timeline, out.with_name(f"{out.stem}-{name}{out.suffix}"))
        print(f"wrote {len(names)} pictures next to {out}")
    elif args.output:
        draw_stacked(timelines, args.output)
        print(f"wrote {args.output}")
    if args.tradeoff:
        draw_tradeoff(args, rows, args.tradeoff)
        print(f"{PROG}: wrote {args.tradeoff}", file=sys.stderr)  # stdout stays the table it always was
    return int(any(not isinstance(e, PlannerUnavailable) for _, e in skipped))


def draw_tradeoff(args, rows, path) -> None:
    """Bubble against the memory budget for the V planner on these costs, with V-Min, V-Half and ZB-V
    marked and every other compared schedule as a point at its peak memory."""
    costs = build_costs(args, args.stages, 2, "v")
    progress = _Progress("tradeoff", what=f"the V planner's budgets from V-Min's to p M_B, p={args.stages}, "
                         f"m={args.microbatches}")
    try:
        with collector_paused():
            curve = budget_curve(args.stages, args.microbatches, costs, progress)
    finally:
        progress.finish()
    by_level = {level: (budget, bubble) for level, budget, bubble in curve}
    named = [(name, *by_level[mem_setup_limit(setup, args.stages)])
             for name, setup in (("v-min", "min"), ("v-half", "half"), ("zb-v", "zb"))
             if mem_setup_limit(setup, args.stages) in by_level]
    others = [(name, max(t.peak_memory), t.bubble_rate) for name, t, _ in rows if t.schedule.layout != "v"]
    title = (f"bubble against memory budget, p={args.stages}, m={args.microbatches}\ncosts per rank: "
             f"T_F {_times(costs.t_f)}, T_B {_times(costs.t_b)}, T_W {_times(costs.t_w)}, "
             f"T_comm {costs.t_comm:.3g} {costs.time_unit}")
    draw_budget_curve([(budget, bubble) for _, budget, bubble in curve], named, others, path,
                      costs.memory_unit, title)


def _times(per_chunk) -> str:
    """A V's per-chunk times as the per-rank figures users give (both chunks, 3 digits), a range if they differ."""
    values = sorted({float(f"{2 * t:.3g}") for t in per_chunk})
    return f"{values[0]:g}" if len(values) == 1 else f"{values[0]:g} to {values[-1]:g}"


def _chunk_help() -> str:
    return "model chunks per rank for " + ", ".join(
        f"{name} ({SCHEDULES[name].chunks_text()}, default {natural_chunks(name)})" for name in multi_chunk_schedules())


def _memory_help() -> str:
    defaults = "; ".join(f"{name}: {kind.default_memory_text}" for name, kind in SCHEDULES.items()
                         if kind.default_memory_limit is not None)
    return ("per-rank activation limit: in-flight microbatches (p = ZB-1p, 2p = ZB-2p), or bytes like 40GiB with a "
            f"model shape (default: the schedule's own; {defaults}; the others' memory follows from their order)")


POST_VALIDATION_HELP = ("insert the post-validation passes on every rank: V (the previous step's validation) before "
                        "its first backward, S (the step's statistics) after its last pass; any schedule and layout")


def build_parser(extensions=()) -> argparse.ArgumentParser:
    """The parser of every subcommand; each extension is called with (subparsers, common options parser,
    the options of a command that reads one schedule) and adds commands of a layer above this one."""
    common = _Parser(add_help=False)
    common.add_argument("-p", "--stages", type=int, help="pipeline ranks p (default: the --model preset's)")
    common.add_argument("-m", "--microbatches", type=int, help="microbatches m per iteration")
    common.add_argument("--chunks", type=int, help=_chunk_help())
    common.add_argument("--memory-limit", help=_memory_help())
    for name, what in (("t-f", "T_F"), ("t-b", "T_B"), ("t-w", "T_W")):
        common.add_argument(f"--{name}", help=f"{what} in milliseconds of one rank (split over its chunks), or "
                            "comma-separated per rank or per virtual stage (default 1 ms)")
    common.add_argument("--t-comm", help="T_comm, stage-to-stage send time in milliseconds (default 0 ms; with "
                        "a model shape: activation bytes over a 25 GB/s link)")
    common.add_argument("--mw-ratio", type=float, help=f"M_W / M_B with pass times (default {DEFAULT_MW_RATIO}; a "
                        "model shape has its own)")
    common.add_argument("--model", choices=sorted(MODEL_PRESETS), help="costs in milliseconds and bytes from one "
                        "of the paper's model shapes (A100 at 125 TFLOP/s)")
    for name in ("layers", "hidden", "heads", "seq-length", "micro-batch-size", "vocab-size"):
        common.add_argument(f"--{name}", type=int, help="model shape for Costs.from_model (sequence default "
                            f"{PRESET_SEQ_LENGTH}, vocabulary default {PRESET_VOCAB})")
    common.add_argument("--mem-setup", choices=tuple(MEM_SETUPS), help="V schedules' budget in the reference "
                        "implementation's short form: min = floor((p+4)/3) M_B, half = floor((p+2)/2), zb = p "
                        "(instead of --memory-limit)")
    ilp = ", ".join(ilp_schedules())
    common.add_argument("--ilp-time-limit", type=float, help=f"seconds for the ILP refinement of {ilp} (default "
                        f"{DEFAULT_ILP_TIME_LIMIT:g} s; 0: heuristic only)")
    common.add_argument("--debug", action="store_true", help="show tracebacks of internal errors")

    parser = _Parser(prog=PROG, description="Plan, simulate, draw, export and compare zero-bubble pipeline schedules.")
    commands = parser.add_subparsers(dest="command", required=True)
    sub = commands.add_parser("export", parents=[common], help="print the schedule JSON",
                              description="print the schedule JSON (or write it with -o)")
    _one_schedule_options(sub)
    sub.add_argument("-o", "--output", help="write the JSON to this file instead of stdout")
    sub.add_argument("--program", action="store_true",
                     help="add each rank's program as the runtime runs it: compute passes and every send and receive "
                          "as posted, with its message, peer and process group (key 'programs'; format in docs)")
    sub.set_defaults(run=cmd_export)
    sub = commands.add_parser("simulate", parents=[common], help="print bubble rates, makespan and peak memory",
                              description="print bubble rates, makespan and peak memory")
    _one_schedule_options(sub)
    sub.add_argument("--trace", metavar="FILE", help="also write the simulated timeline as Chrome trace JSON (open "
                     "it in Perfetto or chrome://tracing): one thread per rank, times in ms")
    sub.set_defaults(run=cmd_simulate)
    sub = commands.add_parser("draw", parents=[common], help="draw the timeline (PNG/SVG, or text without -o)",
                              description="draw the timeline (PNG/SVG, or text without -o)")
    _one_schedule_options(sub)
    sub.add_argument("-o", "--output", help="picture file (.png or .svg); without it a text picture on stdout")
    sub.add_argument("--width", type=int,
                     help=f"text picture width in characters (without -o; default {DEFAULT_WIDTH})")
    sub.set_defaults(run=cmd_draw)
    sub = commands.add_parser("compare", parents=[common], help="one table of several schedules on the same costs")
    sub.add_argument("--schedules", "--schedule", action="append", help="comma-separated names, or repeat the option")
    sub.add_argument("-o", "--output", help="a picture (.png/.svg) with all schedules stacked")
    sub.add_argument("--separate", action="store_true", help="with -o: one picture per schedule, FILE-<name>.png")
    sub.add_argument("--tradeoff", help="also draw bubble against memory budget (.png/.svg): the V planner for "
                     "every budget from V-Min's to p M_B on these costs, the other schedules at their peak")
    sub.set_defaults(run=cmd_compare, input=None)
    for extend in extensions:
        extend(commands, common, _one_schedule_options)
    return parser


def _one_schedule_options(sub) -> None:
    sub.add_argument("--schedule", choices=SCHEDULE_NAMES, help="which planner")
    sub.add_argument("--input", help="an existing schedule JSON (- for stdin) instead of planning one")
    sub.add_argument("--post-validation", action="store_true", help=POST_VALIDATION_HELP)


def main(argv: list[str] | None = None, extensions=()) -> int:
    args, code = None, 1
    try:
        args = build_parser(extensions).parse_args(argv)
        if args.model and args.stages is None:
            args.stages = MODEL_PRESETS[args.model]["stages"]
        return args.run(args) or 0
    except UsageError as e:
        message, code = str(e), 2
    except ScheduleError as e:
        message = str(e)
    except BrokenPipeError:  # output piped into `head`: nothing more to say
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - keeps the interpreter's final flush quiet
        return 1
    except OSError as e:
        message = f"{e.strerror or e}: {e.filename}" if e.filename else str(e)
    except SystemExit as e:  # --help
        return e.code if isinstance(e.code, int) else 0
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # noqa: BLE001 - a command-line tool answers with one line, not a traceback
        if args is not None and getattr(args, "debug", False):
            raise
        message = f"internal error ({type(e).__name__}: {e}); rerun with --debug for the traceback"
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
