"""`zb-schedule advise`: which schedule for a pretrain_gpt.py command line, and how much memory per GPU.

    zb-schedule advise [--gpu-memory 80GiB] [--world-size N | --nodes N --gpus-per-node G] [--profile DIR]
                       -- <pretrain_gpt.py arguments>

Registered as an extension of the planning command line (commands/planning.py `build_parser(extensions)`), from the
`zb-schedule` entry (megatron/zero_bubble/cli.py); see docs/advise.md.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

from ..commands.options import UsageError, parse_memory_limit
from .advice import advise, single_stage
from .candidates import candidates
from .command_line import AdviseError, megatron_parser, read_run
from .report import as_json, describe_run, describe_state, missed_aims, recommendation, size, table
from .stage_costs import FLOPS_PER_SECOND, LINK_BYTES_PER_SECOND, find_profile, load_profile, model_costs

PROG = "zb-schedule advise"
_BIG_PLAN = 20_000  # passes (3 x virtual stages x microbatches) above which planning says what it is doing


def add_advise(commands, common, one_schedule_options) -> None:
    """The `advise` subcommand (an extension of commands/planning.py's parser)."""
    sub = commands.add_parser(
        "advise", help="which schedule for a pretrain_gpt.py command line, and its memory per GPU",
        description="Read the model and the parallel layout from pretrain_gpt.py's arguments (after --), predict "
                    "each pipeline schedule's bubble, iteration time and peak memory per GPU, and print the flags "
                    "for the fastest one that fits in --gpu-memory.")
    sub.add_argument("--gpu-memory", default="80GiB", help="memory of one GPU, e.g. 80GiB, 141GB (default 80GiB)")
    sub.add_argument("--world-size", type=int, help="GPUs of the run (default: TP x PP x CP, one data-parallel "
                     "replica)")
    sub.add_argument("--nodes", type=int, help="nodes of the run (with --gpus-per-node, instead of --world-size)")
    sub.add_argument("--gpus-per-node", type=int, help="GPUs per node with --nodes (default 8)")
    sub.add_argument("--profile", metavar="DIR", help="costs from a profiled run: the directory pretrain_gpt.py "
                     "--zero-bubble-dump-schedule DIR wrote (its newest schedule JSON with measured costs)")
    sub.add_argument("--tokenizer-vocab", type=int, metavar="N", help="the tokenizer's vocabulary, for a tokenizer "
                     "advise cannot size from the flags (it loads no tokenizer files)")
    sub.add_argument("--tflops", type=float, default=FLOPS_PER_SECOND / 1e12,
                     help="compute throughput per GPU for the estimated pass times (default %(default)g, the paper's "
                          "A100 figure); only their ratio to --link-gbps matters")
    sub.add_argument("--link-gbps", type=float, default=LINK_BYTES_PER_SECOND / 1e9,
                     help="GB/s between pipeline stages for the estimated T_comm (default %(default)g)")
    sub.add_argument("--ilp-time-limit", type=float, default=0.0,
                     help="seconds for zb-auto's ILP refinement per plan (default 0: its heuristic alone)")
    sub.add_argument("--json", action="store_true", help="print the predictions as one JSON object instead")
    sub.add_argument("--debug", action="store_true", help="show tracebacks of internal errors")
    sub.add_argument("pretrain_args", nargs=argparse.REMAINDER, help="-- then pretrain_gpt.py's arguments")
    sub.set_defaults(run=cmd_advise, model=None)


def _world(args) -> int | None:
    if args.world_size is not None and (args.nodes is not None or args.gpus_per_node is not None):
        raise UsageError("give either --world-size or --nodes / --gpus-per-node, not both")
    if args.gpus_per_node is not None and args.nodes is None:
        raise UsageError("--gpus-per-node needs --nodes")
    world = args.world_size if args.nodes is None else args.nodes * (args.gpus_per_node or 8)
    if world is not None and world < 1:
        raise UsageError(f"the world size must be at least 1, got {world}")
    return world


def _gpu_memory(text: str) -> float:
    microbatches, absolute = parse_memory_limit(text)
    if absolute is None:
        raise UsageError(f"--gpu-memory {text}: give bytes with a unit, like 80GiB or 141GB")
    return absolute


def cmd_advise(args) -> int:
    words = list(args.pretrain_args)
    if words[:1] == ["--"]:
        words = words[1:]
    if not words:
        raise UsageError("give pretrain_gpt.py's arguments after --")
    gpu_memory, world = _gpu_memory(args.gpu_memory), _world(args)
    try:
        parser = megatron_parser(on_cpu="--zero-bubble-cpu" in words)
        run, _ = read_run(parser, words, world, args.tokenizer_vocab)
        if args.profile is not None:
            profile = load_profile(run, find_profile(args.profile))
            costs_for, costs_from = profile.costs, f"measured ({profile.source})"
        else:
            flops, link = args.tflops * 1e12, args.link_gbps * 1e9
            costs_for = lambda counts: model_costs(run, counts, flops, link)  # noqa: E731
            costs_from = (f"estimated: per-layer FLOP formulas at {args.tflops:g} TFLOP/s, links at "
                          f"{args.link_gbps:g} GB/s; memory counted tensor by tensor")
    except (AdviseError, ValueError) as error:
        raise UsageError(str(error)) from None
    if run.layout.pp < 2:
        return _without_pipeline(run, gpu_memory, args.json)
    passes = 3 * run.layout.pp * 2 * run.layout.microbatches
    started = time.monotonic()
    progress = (lambda line: print(f"{PROG}: {line} ...", file=sys.stderr, flush=True)) if passes > _BIG_PLAN else None
    result = advise(run, parser, candidates(run), costs_for, gpu_memory, costs_from, args.ilp_time_limit, progress)
    if progress is not None:
        progress(f"planned in {time.monotonic() - started:.0f} s")
    if args.json:
        print(json.dumps(as_json(result)))
        return 0
    lines = ["zb-schedule advise: what pretrain_gpt.py would run", *describe_run(run),
             f"  costs      {costs_from}", *(f"  note       {note}" for note in run.notes), "", *table(result),
             *(f"  {line}" for line in missed_aims(result)), "", *recommendation(result)]
    print("\n".join(lines))
    return 0


def _without_pipeline(run, gpu_memory: float, as_json_output: bool) -> int:
    """PP 1: no pipeline schedule applies; the memory of the run as it is."""
    state, activations = single_stage(run)
    peak = state.total + activations
    if as_json_output:
        print(json.dumps({"gpu_memory_bytes": gpu_memory, "stages": 1, "schedules": [], "best": None,
                          "peak_bytes": peak, "model_state": vars(state), "activation_bytes": activations,
                          "notes": list(run.notes)}))
        return 0
    lines = ["zb-schedule advise: what pretrain_gpt.py would run", *describe_run(run),
             *(f"  note       {note}" for note in run.notes), "",
             "no pipeline (--pipeline-model-parallel-size 1): there is no pipeline bubble and no pipeline schedule "
             "to choose; zero-bubble schedules need 2 or more pipeline stages",
             f"peak per GPU {size(peak)}: {describe_state(state)}, activations of one microbatch {size(activations)}"
             f" ({'fits' if peak <= gpu_memory else 'does not fit'} in {size(gpu_memory)})"]
    print("\n".join(lines))
    return 0
