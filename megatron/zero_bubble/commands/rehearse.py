"""`zb-schedule rehearse`: run a plan on local processes with the runtime, each pass a wait of its planned time.

It needs torch (the runtime), so it sits here, above the planning layer, as an extension of the planning command line:

    zb-schedule rehearse --schedule zb-h1 --stages 8 --microbatches 32 --t-f 18.5 --t-b 18.1 --t-w 9.3 --t-comm 0.7
    zb-schedule rehearse --input out/zb/zb-auto-m8-iter5.json --time-unit-ms 1000   (a dump of pretrain_gpt.py)

It prints one JSON object on stdout and a readable summary on stderr.
"""
from __future__ import annotations

import json
import sys

from ..schedules.schedule import Pass
from ..schedules.trace import TraceRow, chrome_trace, write_trace
from .options import UsageError, schedule_and_timeline


def add_rehearse(commands, common, one_schedule_options) -> None:
    sub = commands.add_parser(
        "rehearse", parents=[common], help="run the plan on local processes, each pass a wait of its planned time",
        description="Run the schedule with the real executor, lowering and p2p transport (gloo), one process "
                    "per pipeline rank, each F/B/W a sleep of its planned duration; report planned against "
                    "actual start of every pass as JSON on stdout.")
    one_schedule_options(sub)
    sub.add_argument("--time-unit-ms", type=float, default=1.0,
                     help="wall milliseconds per unit of the costs (default 1: costs in ms run in real time; a "
                          "dump of pretrain_gpt.py has costs in seconds: use 1000)")
    sub.add_argument("--message-kib", type=float, default=None,
                     help="size of each activation/gradient message in KiB (default 64)")
    sub.add_argument("--iterations", type=int, default=1,
                     help="iterations in a row, with the optimizer step between them (default 1)")
    sub.add_argument("--optimizer-step", type=float, default=0.0, metavar="T",
                     help="time of the optimizer step, in the costs' unit (default 0)")
    sub.add_argument("--allreduce", type=float, default=0.0, metavar="T",
                     help="time of the synchronous step's global all-reduce (grad norm, inf check), in the "
                          "costs' unit; not spent with --post-validation, whose sums travel in V passes (default 0)")
    sub.add_argument("--dp-reduce", type=float, default=0.0, metavar="T",
                     help="model data parallelism: the time to reduce one rank's gradients over the replicas, in "
                          "the costs' unit; buckets start as megatron's --overlap-grad-reduce starts them "
                          "(default 0: no data parallelism)")
    sub.add_argument("--dp-buckets", type=int, default=8,
                     help="with --dp-reduce: gradient buckets of a bucketed stage (default 8)")
    sub.add_argument("--dp-bucketed-stages", choices=("training", "first", "every"), default="training",
                     help="with --dp-reduce: which stages have --dp-buckets, the others one: as in training "
                          "(every stage under a split schedule, the first only otherwise, as megatron) or forced "
                          "(default %(default)s)")
    sub.add_argument("--trace", metavar="FILE", default=None,
                     help="also write the timeline as Chrome trace JSON (Perfetto, chrome://tracing): a thread a rank")
    sub.add_argument("--gloo-p2p", action="store_true",
                     help="post the messages with gloo's own operations instead of the stand-in of NCCL's in-order "
                          "streams with rendezvous (default: the stand-in, as NCCL runs them)")
    sub.add_argument("--no-dp-overlap", action="store_true",
                     help="with --dp-reduce: every bucket starts after the rank's last pass (no --overlap-grad-reduce)")
    sub.set_defaults(run=cmd_rehearse)


def cmd_rehearse(args) -> None:
    from ..tools.rehearsal import DEFAULT_MESSAGE_KIB, DataParallel, RehearsalOptions, rehearse

    if args.time_unit_ms <= 0:
        raise UsageError(f"--time-unit-ms must be positive, got {args.time_unit_ms}")
    if args.stages is not None and args.stages > 64:
        raise UsageError(f"rehearse starts one process per stage; --stages {args.stages} is more than 64")
    if args.iterations < 1 or args.optimizer_step < 0 or args.allreduce < 0 or args.dp_reduce < 0:
        raise UsageError("--iterations must be at least 1, --optimizer-step, --allreduce and --dp-reduce "
                                  "not negative")
    if args.dp_buckets < 1:
        raise UsageError(f"--dp-buckets must be at least 1, got {args.dp_buckets}")
    schedule, costs, _ = schedule_and_timeline(args)
    message_kib = DEFAULT_MESSAGE_KIB if args.message_kib is None else args.message_kib
    data_parallel = None
    if args.dp_reduce > 0:
        every_stage = {"training": None, "first": False, "every": True}[args.dp_bucketed_stages]
        data_parallel = DataParallel(reduce_time=args.dp_reduce, overlap=not args.no_dp_overlap,
                                     buckets=args.dp_buckets, every_stage=every_stage)
    report = rehearse(schedule, costs, RehearsalOptions(
        unit_ms=args.time_unit_ms, message_kib=message_kib, iterations=args.iterations,
        optimizer_step=args.optimizer_step, allreduce=args.allreduce, data_parallel=data_parallel,
        strict_p2p=not args.gloo_p2p))
    sys.stdout.write(json.dumps(report) + "\n")
    if args.trace:
        write_trace(chrome_trace(rehearsed_rows(report, args.time_unit_ms), source="rehearsed",
                                 ranks=schedule.stages), args.trace)
    print(summary(report, costs.time_unit), file=sys.stderr)


def rehearsed_rows(report: dict, unit_ms: float) -> list[TraceRow]:
    """The rehearsal's passes as trace rows: wall milliseconds from the common start, planned start kept."""
    return [TraceRow(rank["rank"], Pass(p["op"], p["mb"], p["chunk"]), p["actual_start"] * unit_ms,
                     p["actual_end"] * unit_ms, args={"planned_start_ms": p["planned_start"] * unit_ms,
                                                      "lateness_ms": p["lateness"] * unit_ms})
            for rank in report["per_rank"] for p in rank["passes"]]


def summary(report: dict, unit: str) -> str:
    return (
        f"rehearsed {report['schedule']} on {report['stages']} processes, m={report['microbatches']}: makespan "
        f"{report['measured_makespan']:.4g} {unit} measured vs {report['simulated_makespan']:.4g} {unit} simulated "
        f"(ratio {report['ratio']:.3f}); bubble rate {report['measured_bubble_rate']:.4f} measured vs "
        f"{report['simulated_bubble_rate']:.4f} simulated (paper's measure); latest pass started "
        f"{report['max_pass_lateness']:.3g} {unit} after its planned start"
        + (f"; {report['iterations']} iterations, {report['measured_time_per_iteration']:.4g} {unit} each"
           if report["iterations"] > 1 else "")
        + (f"; data-parallel reduction exposed {report['dp_exposed']:.4g} {unit} after the last pass"
           if "dp_exposed" in report else "")
    )
