"""`zb-schedule`: plan, simulate, draw, export and compare pipeline schedules without any GPU.

    zb-schedule export   --schedule zb-h1 --stages 4 --microbatches 8 [-o plan.json] [--program]
    zb-schedule simulate --schedule zb-auto -p 8 -m 24 --memory-limit 16 --t-f 18.5 --t-b 18.1 --t-w 9.3
    zb-schedule draw     --input plan.json -o plan.png        (no -o: a text picture on stdout)
    zb-schedule compare  --schedules 1f1b,zb-h1,zb-v --model 1.5b -m 24 [-o all.svg] [--tradeoff budget.png]

Bad input ends with one line on stderr, never a traceback. `build_parser(extensions)` takes more subcommands
(rehearse, advise: megatron/zero_bubble/cli.py adds them).
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from ..schedules.comm import lower
from ..schedules.costs import DEFAULT_MW_RATIO, TIME_UNITS
from ..schedules.draw import (check_picture_path, comparison_table, draw, draw_budget_curve, draw_stacked, render_text,
                              simulation_report)
from ..schedules.planners import (SCHEDULE_NAMES, SCHEDULES, collector_paused, ilp_schedules, multi_chunk_schedules,
                                  natural_chunks)
from ..schedules.program import TRANSPORT, program_json, simulate_program
from ..schedules.schedule import ScheduleError
from ..schedules.trace import chrome_trace, timeline_rows, write_trace
from ..schedules.vbudget import MEM_SETUPS, budget_curve, mem_setup_limit
from .options import (DEFAULT_ILP_TIME_LIMIT, DEFAULT_WIDTH, MODEL_PRESETS, PRESET_SEQ_LENGTH, PRESET_VOCAB, PROG,
                      CommandParser, PlannerUnavailable, Progress, UsageError, build_costs, plan_schedule,
                      schedule_and_timeline)


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
        programs = lower(schedule, costs, timeline)  # what the runtime runs, replayed on the model of NCCL and CUDA
        on_model = simulate_program(schedule, programs, costs)
        schedule.info["predicted"].update(bubble_rate_on_the_model=on_model.bubble_rate,
                                          makespan_on_the_model=on_model.makespan)
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
    on_model = simulate_program(schedule, lower(schedule, costs, timeline), costs)
    print(f"with the runtime's batches of sends and receives on the model of NCCL and CUDA (T_comm each): makespan "
          f"{on_model.makespan:.6g} {costs.time_unit}, bubble rate {on_model.bubble_rate:.4f} (paper's measure)")
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
        # what the runtime's programs take on the model of NCCL and CUDA (within a few per cent of the plan)
        timelines.append(simulate_program(schedule, lower(schedule, costs, timeline), costs))
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
    progress = Progress("tradeoff", what=f"the V planner's budgets from V-Min's to p M_B, p={args.stages}, "
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
    return ("per-rank activation limit: in-flight microbatches (p = ZB-1p, 2p = ZB-2p), bytes like 40GiB with a "
            "model shape, or Nx: N times the largest a rank holds under 1F1B on the same costs (one-chunk zb-auto) "
            f"(default: the schedule's own; {defaults}; the others' memory follows from their order)")


POST_VALIDATION_HELP = ("insert the post-validation passes on every rank: V (the previous step's validation) before "
                        "its first backward, S (the step's statistics) after its last pass; any schedule and layout")


def build_parser(extensions=()) -> argparse.ArgumentParser:
    """The parser of every subcommand; each extension is called with (subparsers, common options parser,
    the options of a command that reads one schedule) and adds commands of a layer above this one."""
    common = CommandParser(add_help=False)
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

    parser = CommandParser(prog=PROG, description="Plan, simulate, draw, export and compare zero-bubble pipeline schedules.")
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
