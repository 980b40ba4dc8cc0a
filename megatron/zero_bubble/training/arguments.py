"""The zero-bubble command-line flags of `pretrain_gpt.py`, and the start-up checks that refuse what cannot work.

Flags are added through megatron's extra-args hook (`add_arguments`), so `--help` lists them in the group
"zero bubble". `parse_and_validate()` parses the command line once without megatron's validation, refuses
bad combinations with one line naming the flag and the fix (`StartupRefusal`), then runs megatron's own
`parse_and_validate_args`. Without any zero-bubble flag the run is megatron's own.

Before that, `early_check()` (top of pretrain_gpt.py, before megatron is imported: a second, not minutes,
under torchrun) parses our flags and the few megatron flags it needs and refuses what needs no megatron: bad
values, conflicting flags, directories that cannot be written, missing input files, model-parallel sizes that
divide neither the processes nor the layers. A bad megatron flag is one line too (our parsers' `error`), never
argparse's usage text, and every refusal is printed once, by rank 0 (`refuse`).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import NoReturn

from ..schedules.planners import (SCHEDULES, PlanRequest, conflicting_options, layout_of, natural_chunks,
                                  pipeline_schedule_names, plan, split_backward_schedules)
from ..schedules.schedule import ScheduleError
from ..schedules.vbudget import MEM_SETUPS, mem_setup_limit

# What pretrain_gpt.py offers; the facts live in the planning registry (planners.SCHEDULES).
PIPELINE_SCHEDULES = pipeline_schedule_names()
SPLIT_BACKWARD_SCHEDULES = split_backward_schedules()
EXIT_REFUSED = 2
DEFAULT_TIMERS = (100, 110)  # timer window [start, end) in iterations, as in the paper's implementation
# Flags that only mean something with a schedule run by the zero-bubble runtime (None when not given).
RUNTIME_ONLY_FLAGS = ("zero_bubble_max_pending_backward", "zero_bubble_v_schedule_mem_setup",
                      "zero_bubble_pipeline_timers_start_iter",
                      "zero_bubble_pipeline_timers_end_iter", "zero_bubble_dump_schedule")


class StartupRefusal(Exception):
    """A flag combination that cannot work; the message is one line naming the flag and the fix."""


@dataclass(frozen=True)
class ZeroBubbleOptions:
    """What the zero-bubble flags ask for, after the start-up checks."""

    schedule: str | None  # None: megatron's own schedule, untouched
    through_runtime: bool  # run the schedule with the zero-bubble PipelineExecutor
    memory_limit: float | None  # in-flight microbatches (p = ZB-1p, 2p = ZB-2p); None: auto
    timers_start_iter: int
    timers_end_iter: int
    dump_dir: str | None
    ilp_time_limit: float
    post_validation: bool = False  # speculative optimizer step, validated in the next iteration's V pass
    exact_rollback: bool = False


# ---------------------------------------------------------------- flags


def _schedule_name(text: str) -> str:
    """--pipeline-schedule's type: one of PIPELINE_SCHEDULES (a bad name is one line, not argparse's usage dump)."""
    if text in PIPELINE_SCHEDULES:
        return text
    planner_only = f" ({text} is planner-only: zb-schedule)" if text in SCHEDULES else ""
    raise argparse.ArgumentTypeError(f"{text!r} is not a schedule pretrain_gpt.py runs{planner_only}; use one of "
                                     f"{', '.join(PIPELINE_SCHEDULES)}")


def _max_pending_backward(text: str):
    if text == "auto":
        return None
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of microbatches or 'auto', got {text!r}") from None


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """megatron's `extra_args_provider`: the zero-bubble flags and the entry script's own options."""
    add_zero_bubble_flags(parser)
    _repair_help_texts(parser)
    parser.error = _refuse_argparse_error  # a bad megatron flag: one line, not the full usage on every rank
    if not _cuda_available():
        # megatron's defaults assume CUDA; on CPU these work (the fusions would compile with torch.compile,
        # seconds per process for no gain at CPU sizes).
        parser.set_defaults(distributed_backend="gloo", gradient_accumulation_fusion=False,
                            no_persist_layer_norm=True, transformer_impl="local",
                            bias_gelu_fusion=False, bias_swiglu_fusion=False, bias_dropout_fusion=False,
                            masked_softmax_fusion=False)  # its fp16/bf16 kernel is CUDA-only
    return parser


def add_zero_bubble_flags(parser: argparse.ArgumentParser) -> None:
    """The zero-bubble flags and the entry script's own options (no megatron needed)."""
    group = parser.add_argument_group("zero bubble", "Zero-bubble pipeline schedules (Qi et al., ICLR 2024).")
    group.add_argument("--pipeline-schedule", type=_schedule_name, default=None, metavar="NAME",
                       help=f"Pipeline schedule: {', '.join(PIPELINE_SCHEDULES)}. 1f1b and interleaved-1f1b are megatron's own unless "
                       "--enable-zb-runtime is given; zb-h1 / zb-h2 are the paper's handcrafted schedules "
                       "(1F1B's memory / twice it), zb-auto its automatic planner, zb-v the V-shape schedule "
                       "(two model chunks per rank). Default: megatron's schedule.")
    group.add_argument("--enable-zero-bubble", action="store_true",
                       help="Same as --pipeline-schedule zb-auto: the automatic zero-bubble planner under the "
                       "memory limit of --zero-bubble-max-pending-backward, re-planned from measured costs.")
    group.add_argument("--zero-bubble-v-schedule", action="store_true",
                       help="Same as --pipeline-schedule zb-v: ZB-V, 2p virtual stages placed as a V "
                       "(needs --num-layers divisible by 2 x --pipeline-model-parallel-size).")
    group.add_argument("--enable-zb-runtime", action="store_true",
                       help="Run the chosen schedule, baselines included, through the zero-bubble runtime "
                       "(without --pipeline-schedule: 1f1b, or interleaved-1f1b when a virtual pipeline "
                       "size is set). Zero-bubble schedules always use it.")
    group.add_argument("--zero-bubble-v-schedule-mem-setup", choices=tuple(MEM_SETUPS), default=None,
                       help="ZB-V's memory budget in the original implementation's terms: min = V-Min's "
                       "floor((p+4)/3) microbatches per rank, half = V-Half's (p+2)/2, zb = ZB-V's p (1F1B's peak). "
                       "The V planner takes any budget in between through --zero-bubble-max-pending-backward.")
    group.add_argument("--zero-bubble-max-pending-backward", type=_max_pending_backward, default=None,
                       metavar="N|auto",
                       help="Activation-memory limit of zb-auto and zb-v in microbatches held per rank (p = "
                       "1F1B's peak, i.e. ZB-1p; 2p = ZB-2p; zb-h1 / zb-h2 have fixed memory). auto (default): on "
                       "GPU what the free device memory holds, at most the planner's default; on CPU the default, "
                       "2p for zb-auto and p for zb-v.")
    group.add_argument("--zero-bubble-pipeline-timers-start-iter", type=int, default=None, metavar="START",
                       help=f"Re-planning from measured costs: pass times and activation sizes are recorded while "
                       f"megatron's count of completed iterations is in [START, END), i.e. in the iterations its "
                       f"log numbers START+1..END (default {DEFAULT_TIMERS[0]}).")
    group.add_argument("--zero-bubble-pipeline-timers-end-iter", type=int, default=None, metavar="END",
                       help=f"After logged iteration END the costs are gathered, the schedule is re-planned on one "
                       f"rank and broadcast; every rank runs it from logged iteration END+1 on (default "
                       f"{DEFAULT_TIMERS[1]}; END equal to START: no re-planning).")
    group.add_argument("--zero-bubble-ilp-time-limit", type=float, default=10.0,
                       help="Seconds the automatic planner's ILP refinement may take (0 skips it).")
    group.add_argument("--zero-bubble-dump-schedule", metavar="DIR", default=None,
                       help="Write the schedule in use as JSON and PNG into DIR (rank 0), again after "
                       "re-planning.")
    group.add_argument("--allow-padding-num-layers", action="store_true",
                       help="Known from the paper's implementation, refused here: layer padding is not "
                       "implemented; give ZB-V a --num-layers that is a multiple of 2 x "
                       "--pipeline-model-parallel-size.")
    group.add_argument("--enable-optimizer-post-validation", action="store_true",
                       help="No cross-stage synchronisation before the optimizer step: each stage steps "
                       "speculatively on the partial grad-norm/inf sums of the stages before it; the full sums "
                       "come back in the next iteration's warm-up, which rolls the step back (and re-steps "
                       "clipped, replaying what ran on the speculative weights) when needed. Steps with inf/NaN "
                       "gradients are skipped in every precision. Needs zb-h1, zb-h2, zb-auto or 1f1b through "
                       "the runtime.")
    group.add_argument("--zero-bubble-exact-rollback", action="store_true",
                       help="With --enable-optimizer-post-validation: keep a copy of the parameters and optimizer "
                       "state at each speculative step so that a rollback restores them bit for bit (default: "
                       "invert the update in place, exact to a few ulps, no extra memory).")
    entry = parser.add_argument_group("pretrain_gpt.py")
    entry.add_argument("--init-weights-by-global-name", action="store_true",
                       help="Initialise every weight from a generator seeded by (--seed, its global name), "
                       "so that any pipeline/tensor layout of the model starts from the same weights.")


def _refuse_argparse_error(message: str):
    """argparse's `error` for our parsers: a StartupRefusal (one line) instead of the usage text and exit."""
    if message.startswith("argument "):
        message = message[len("argument "):]
    if message.startswith("unrecognized arguments"):
        message += " (python pretrain_gpt.py --help lists every flag)"
    raise StartupRefusal(message)


def _repair_help_texts(parser: argparse.ArgumentParser) -> None:
    """Escape stray '%' in help texts argparse cannot format (megatron-core 0.19.2 has one, in
    --moe-paged-stash-buffer-size-factor-cuda), so that `--help` prints instead of raising ValueError."""
    for action in parser._actions:
        if not isinstance(action.help, str) or action.help == argparse.SUPPRESS:
            continue
        try:  # what argparse does to a help text: %-format it with the action's attributes and the prog
            action.help % {**vars(action), "prog": parser.prog}
        except (ValueError, TypeError, KeyError):
            action.help = action.help.replace("%", "%%")


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


# ---------------------------------------------------------------- checks


def chosen_schedule(args) -> tuple[str | None, str | None]:
    """(schedule, the flag that asked for it), or (None, None) for megatron's own; refuses conflicting flags."""
    if getattr(args, "allow_padding_num_layers", False):
        raise StartupRefusal("--allow-padding-num-layers: layer padding is not implemented; give --num-layers a "
                             "multiple of 2 x --pipeline-model-parallel-size and drop --allow-padding-num-layers")
    asked = []
    if args.pipeline_schedule is not None:
        asked.append(("--pipeline-schedule " + args.pipeline_schedule, args.pipeline_schedule))
    if args.enable_zero_bubble:
        asked.append(("--enable-zero-bubble", "zb-auto"))
    if args.zero_bubble_v_schedule:
        asked.append(("--zero-bubble-v-schedule", "zb-v"))
    if len({name for _, name in asked}) > 1:
        flags = " and ".join(flag for flag, _ in asked)
        raise StartupRefusal(f"{flags} ask for different pipeline schedules; keep one of them")
    if asked:
        flag, name = asked[0]
        return name, flag
    if args.enable_zb_runtime:
        return ("interleaved-1f1b" if _virtual_stages(args) else "1f1b"), "--enable-zb-runtime"
    return None, None


def _virtual_stages(args) -> int | None:
    if args.num_virtual_stages_per_pipeline_rank is not None:
        return args.num_virtual_stages_per_pipeline_rank
    if args.num_layers_per_virtual_pipeline_stage is not None and args.num_layers:
        per_rank = args.num_layers // max(1, args.pipeline_model_parallel_size)
        return per_rank // args.num_layers_per_virtual_pipeline_stage
    return None


def microbatches(args) -> int:
    model_parallel = args.tensor_model_parallel_size * args.pipeline_model_parallel_size * args.context_parallel_size
    data_parallel = max(1, args.world_size // model_parallel)
    global_batch = args.global_batch_size or args.micro_batch_size * data_parallel
    return max(1, global_batch // (args.micro_batch_size * data_parallel))


def _remote(path: str) -> bool:
    return "://" in path  # object storage (msc://, s3://): megatron's to reach


def check_input_files(args) -> None:
    """Files the run reads: megatron's indexed datasets (PREFIX.bin and PREFIX.idx for every --data-path
    prefix), the data-args files and the tokenizer's vocabulary and merges."""
    paths = []
    for flag in ("data_path", "train_data_path", "valid_data_path", "test_data_path"):
        paths += list(getattr(args, flag, None) or [])
    for prefix in paths:
        if _is_number(prefix) or _remote(prefix):
            continue  # a blend weight
        missing = [prefix + suffix for suffix in (".bin", ".idx") if not os.path.exists(prefix + suffix)]
        if missing:
            raise StartupRefusal(
                f"--data-path: {', '.join(missing)} {'does not exist' if len(missing) == 1 else 'do not exist'}; "
                f"pass the prefix of a megatron indexed dataset (PREFIX.bin and PREFIX.idx), or drop --data-path "
                f"for mock data"
            )
    for name in ("data_args_path", "per_split_data_args_path", "vocab_file", "merge_file"):
        path = getattr(args, name, None)
        if path and not _remote(path) and not os.path.isfile(path):
            flag = "--" + name.replace("_", "-")
            what = "is a directory" if os.path.isdir(path) else "does not exist"
            raise StartupRefusal(f"{flag} {path} {what}; pass an existing file or drop {flag}")


# Directories the run writes into (megatron's and ours): created and written to once at start-up.
WRITTEN_DIRECTORIES = ("zero_bubble_dump_schedule", "save", "tensorboard_dir", "data_cache_path")


def check_paths(args) -> None:
    """Directories the run writes into must be creatable and writable before anything starts."""
    for name in WRITTEN_DIRECTORIES:
        path = getattr(args, name, None)
        if path and not _remote(path):
            _writable_directory(path, "--" + name.replace("_", "-"))


def _writable_directory(path: str, flag: str) -> None:
    """Create `path` (with its parents) and write a file into it, or refuse naming the flag."""
    fix = "pass a directory you can write to"
    existing = os.path.abspath(path)
    while not os.path.exists(existing) and os.path.dirname(existing) != existing:
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise StartupRefusal(f"{flag} {path}: cannot create the directory ({existing} is a file); {fix}")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as error:
        raise StartupRefusal(f"{flag} {path}: cannot create the directory ({error.strerror}); {fix}") from None
    try:
        with tempfile.NamedTemporaryFile(dir=path, prefix=".pretrain_gpt-write-check-"):
            pass
    except OSError as error:
        raise StartupRefusal(f"{flag} {path}: cannot write into the directory ({error.strerror}); {fix}") from None


def _is_number(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False


# MoE options that need CUDA (the CPU backend runs megatron's local experts: SequentialMLP, alltoall/allgather).
MOE_CUDA_ONLY = {
    "moe_grouped_gemm": "the grouped experts are Transformer Engine's TEGroupedMLP; on CPU the local experts run "
                        "one after another (SequentialMLP)",
    "moe_permute_fusion": "Transformer Engine's fused permutation kernels",
    "moe_shared_expert_overlap": "it runs the shared experts beside the token dispatch on a CUDA stream",
}


def check_without_zero_bubble(args) -> None:
    """Checks that apply to every run of the entry script (its own data, MoE, the CPU backend)."""
    check_input_files(args)
    _check_local_experts(args)
    if _cuda_available():
        return
    if args.distributed_backend != "gloo":
        raise StartupRefusal("--distributed-backend nccl needs CUDA; on CPU drop the flag (gloo is used)")
    if args.transformer_impl == "transformer_engine":
        raise StartupRefusal("--transformer-impl transformer_engine needs CUDA; on CPU use --transformer-impl local")
    if not args.num_experts:
        return
    for name, why in MOE_CUDA_ONLY.items():
        if getattr(args, name, False):
            raise StartupRefusal(f"--{name.replace('_', '-')} needs CUDA ({why}); on CPU drop the flag")
    if args.moe_token_dispatcher_type == "flex":
        raise StartupRefusal("--moe-token-dispatcher-type flex needs CUDA (DeepEP / HybridEP); on CPU use alltoall "
                             "or allgather")


def _check_local_experts(args) -> None:
    """megatron-core 0.19.2's local experts (SequentialMLP) with linear biases add the bias in place to the
    output of their all-reduce, which over a single rank is their input returned as is: autograd refuses it at
    the first forward, on any device, unless expert or expert-tensor parallelism makes the reduction explicit."""
    if not args.num_experts or not args.add_bias_linear or args.transformer_impl != "local":
        return
    expert_tp = args.expert_tensor_parallel_size or args.tensor_model_parallel_size
    if args.expert_model_parallel_size == 1 and expert_tp == 1:
        raise StartupRefusal(
            "--num-experts with linear biases fails in megatron-core's local experts at --expert-model-parallel-size "
            "1 and expert tensor parallel size 1 (an in-place bias add on an all-reduce over one rank); add "
            "--disable-bias-linear")


def _through_runtime(args, schedule: str) -> bool:
    return schedule in SPLIT_BACKWARD_SCHEDULES or args.enable_zb_runtime


def _timer_window(args) -> tuple[int, int]:
    start, end = args.zero_bubble_pipeline_timers_start_iter, args.zero_bubble_pipeline_timers_end_iter
    start = DEFAULT_TIMERS[0] if start is None else start
    end = max(start, DEFAULT_TIMERS[1]) if end is None else end
    return start, end


def check_schedule_flags(args, schedule: str, flag: str) -> None:
    """The chosen schedule's checks that need only our flags and megatron's pipeline sizes (so they run
    before megatron is imported as well as after its parsing)."""
    p = args.pipeline_model_parallel_size
    if p < 2:
        raise StartupRefusal(f"{flag} needs --pipeline-model-parallel-size of 2 or more (got {p})")
    vpp = _virtual_stages(args)
    _check_conflicts(args, schedule, flag)
    if layout_of(schedule) == "v":
        _check_v_layout(args, vpp, flag)
    elif layout_of(schedule) == "interleaved":
        if vpp is not None and vpp < 2:
            raise StartupRefusal(
                f"{flag} needs two or more model chunks per rank; drop --num-virtual-stages-per-pipeline-rank 1")
    elif vpp not in (None, 1):
        raise StartupRefusal(
            f"{flag} runs one model chunk per rank; drop --num-virtual-stages-per-pipeline-rank / "
            f"--num-layers-per-virtual-pipeline-stage (or use --pipeline-schedule interleaved-1f1b / zb-v)"
        )
    if not _through_runtime(args, schedule):
        _refuse_runtime_only_flags(args, f"{flag} runs megatron's own schedule; add --enable-zb-runtime or drop")
        return
    limit = args.zero_bubble_max_pending_backward
    if limit is not None and limit < 1:
        raise StartupRefusal(
            f"--zero-bubble-max-pending-backward {limit:g} is below one microbatch; give at least 1 (p = 1F1B's memory)"
        )
    setup = getattr(args, "zero_bubble_v_schedule_mem_setup", None)
    if setup is not None and layout_of(schedule) != "v":
        raise StartupRefusal(f"--zero-bubble-v-schedule-mem-setup sets ZB-V's memory, not {flag}'s; add "
                             f"--zero-bubble-v-schedule or drop it (--zero-bubble-max-pending-backward sets {schedule}'s)")
    if setup is not None and limit is not None:
        raise StartupRefusal("--zero-bubble-v-schedule-mem-setup and --zero-bubble-max-pending-backward both set ZB-V's "
                             "memory; keep one of them")
    start, end = _timer_window(args)
    if end < start:
        raise StartupRefusal(
            "--zero-bubble-pipeline-timers-end-iter is before --zero-bubble-pipeline-timers-start-iter; swap them")


def check_zero_bubble(args, schedule: str, flag: str) -> ZeroBubbleOptions:
    """Refuse what the chosen schedule cannot run with beyond `check_schedule_flags` (which `check_flags`
    ran already); the options otherwise."""
    if not _through_runtime(args, schedule):
        return ZeroBubbleOptions(schedule=schedule, through_runtime=False, memory_limit=None, timers_start_iter=0,
                                 timers_end_iter=0, dump_dir=None, ilp_time_limit=0.0)
    _check_runtime(args, flag)
    limit = args.zero_bubble_max_pending_backward
    if getattr(args, "zero_bubble_v_schedule_mem_setup", None) is not None:
        limit = mem_setup_limit(args.zero_bubble_v_schedule_mem_setup, args.pipeline_model_parallel_size)
    start, end = _timer_window(args)
    options = ZeroBubbleOptions(
        schedule=schedule, through_runtime=True, memory_limit=limit, timers_start_iter=start, timers_end_iter=end,
        dump_dir=args.zero_bubble_dump_schedule, ilp_time_limit=args.zero_bubble_ilp_time_limit,
    )
    _try_planning(args, options, flag)
    return options


def _refuse_runtime_only_flags(args, reason: str) -> None:
    for name in RUNTIME_ONLY_FLAGS:
        if getattr(args, name) is not None:
            raise StartupRefusal(f"--{name.replace('_', '-')} has no effect: {reason} --{name.replace('_', '-')}")


def _check_v_layout(args, vpp, flag: str) -> None:
    p, layers = args.pipeline_model_parallel_size, args.num_layers
    if vpp not in (None, 2):
        raise StartupRefusal(f"{flag} places exactly two model chunks per rank; drop the virtual pipeline flags")
    if layers is None or layers % (2 * p):
        raise StartupRefusal(
            f"{flag} cuts the model into 2p = {2 * p} virtual stages, but --num-layers {layers} "
            f"is not a multiple of {2 * p}; use --num-layers {_nearest_multiples(layers or 0, 2 * p)}"
        )


def _nearest_multiples(layers: int, step: int) -> str:
    """The layer counts next to `layers` that split into `step` equal parts: "8 or 12" (or "4" below one step)."""
    below, above = layers // step * step, (layers // step + 1) * step
    return f"{below} or {above}" if below else f"{above}"


def _check_conflicts(args, schedule: str, flag: str) -> None:
    """The megatron options the planning registry says this schedule cannot run with (those parsed so far)."""
    for conflict in conflicting_options(schedule):
        if getattr(args, conflict.option, None):
            option = "--" + conflict.option.replace("_", "-")
            raise StartupRefusal(f"{option} does not work with {flag} ({conflict.reason}); drop {option}")


# What the zero-bubble runtime cannot drive, whatever the schedule: the megatron option and why.
_NOT_WITH_THE_RUNTIME = {
    "delay_wgrad_compute": "its weight gradients wait for backward_dw(), which only megatron's own schedules call",
    "overlap_param_gather_with_optimizer_step": "it leaves the later chunks' parameter gathers to megatron's "
                                                "interleaved schedule",
    "use_megatron_fsdp": "the runtime accumulates deferred weight gradients into megatron DDP's buffers",
    "use_torch_fsdp2": "the runtime accumulates deferred weight gradients into megatron DDP's buffers",
    "overlap_moe_expert_parallel_comm": "it is megatron's own combined-1F1B schedule (one microbatch's expert "
                                        "all-to-all overlapped with another's compute), which the runtime replaces",
}


def _check_runtime(args, flag: str) -> None:
    for name in ("sft", "rl_use_sequence_packing", "hybrid_context_parallel"):
        if getattr(args, name, False):
            raise StartupRefusal(
                f"--{name.replace('_', '-')} gives variable sequence lengths, which the zero-bubble runtime "
                f"does not support ({flag} needs fixed pipeline tensor shapes); drop one of them"
            )
    for name, why in _NOT_WITH_THE_RUNTIME.items():
        if getattr(args, name, False):
            option = "--" + name.replace("_", "-")
            raise StartupRefusal(f"{option} does not work with the zero-bubble runtime ({flag}): {why}; drop {option}")


def _try_planning(args, options: ZeroBubbleOptions, flag: str) -> None:
    """Plan once with unit costs (no ILP) so that an impossible memory limit is refused before training."""
    chunks = _virtual_stages(args) or natural_chunks(options.schedule)
    try:
        plan(options.schedule, PlanRequest(
            stages=args.pipeline_model_parallel_size, microbatches=microbatches(args), chunks=chunks,
            memory_limit=options.memory_limit, ilp_time_limit=0,
            post_validation=args.enable_optimizer_post_validation,
        ))
    except ScheduleError as error:
        raise StartupRefusal(f"{flag}: {error}") from None


def _given(flag: str) -> bool:
    """Whether the command line names `flag` itself (not just its default)."""
    return any(word == flag or word.startswith(flag + "=") for word in sys.argv[1:])


def megatron_defaults(options: ZeroBubbleOptions | None) -> dict:
    """Values handed to megatron as `args_defaults` (used only where the command line leaves them unset)."""
    if options is not None and options.schedule is not None and natural_chunks(options.schedule) > 1:
        return {"num_virtual_stages_per_pipeline_rank": natural_chunks(options.schedule)}
    return {}


# ---------------------------------------------------------------- entry


# A rank other than 0 that refuses waits this long for the launcher to stop it (see `refuse`).
REFUSAL_WAIT_S = 60.0


def refuse(message: str) -> NoReturn:
    """Print one line (once, on global rank 0) and stop before any training, with exit status 2.

    Every rank runs the same checks on the same command line and reaches the same refusal. Rank 0 prints and
    exits; the others wait quietly for the launcher to stop them (torchrun terminates the remaining ranks as
    soon as one exits non-zero, so a rank that exited first would have rank 0 killed before it printed) and
    then exit with the same status. A rank still running after REFUSAL_WAIT_S (rank 0 did not refuse: a
    directory only this node cannot write, say) prints the line itself, naming its rank.
    """
    rank = int(os.environ.get("RANK", "0"))
    if rank == 0:
        print(f"pretrain_gpt.py: error: {message}", file=sys.stderr, flush=True)
        raise SystemExit(EXIT_REFUSED)

    def stopped(signum, frame):
        raise SystemExit(EXIT_REFUSED)

    try:
        signal.signal(signal.SIGTERM, stopped)
    except ValueError:  # not the main thread: the default (terminated by the signal) is as quiet
        pass
    time.sleep(REFUSAL_WAIT_S)
    print(f"pretrain_gpt.py: error: {message} (rank {rank})", file=sys.stderr, flush=True)
    raise SystemExit(EXIT_REFUSED)


def check(args) -> ZeroBubbleOptions | None:
    """All start-up checks on parsed (not yet megatron-validated) arguments; None without zero bubble."""
    check_without_zero_bubble(args)
    check_paths(args)
    schedule, flag = check_flags(args)
    if schedule is None:
        return None
    options = check_zero_bubble(args, schedule, flag)
    if args.enable_optimizer_post_validation:
        check_post_validation(args, options, flag)
        options = dataclasses.replace(options, post_validation=True, exact_rollback=args.zero_bubble_exact_rollback)
    return options


def check_flags(args) -> tuple[str | None, str | None]:
    """The checks on our own flags (and megatron's pipeline sizes), before megatron is imported and after its
    parsing: (schedule, the flag that asked for it), or (None, None) for megatron's own schedule."""
    if args.zero_bubble_exact_rollback and not args.enable_optimizer_post_validation:
        raise StartupRefusal("--zero-bubble-exact-rollback only applies to --enable-optimizer-post-validation; "
                             "add that flag or drop it")
    schedule, flag = chosen_schedule(args)
    if schedule is None:
        if args.enable_optimizer_post_validation:
            raise StartupRefusal("--enable-optimizer-post-validation needs a zero-bubble runtime schedule; add "
                                 "--enable-zero-bubble (or --pipeline-schedule zb-h1 / zb-h2) or drop the flag")
        _refuse_runtime_only_flags(args, "no zero-bubble schedule is chosen; add --enable-zero-bubble or drop")
    else:
        check_schedule_flags(args, schedule, flag)
    return schedule, flag


def check_post_validation(args, options: ZeroBubbleOptions, flag: str) -> None:
    """What the speculative step and its rollback support; everything else is refused here."""
    if not options.through_runtime:
        raise StartupRefusal(
            f"--enable-optimizer-post-validation works with schedules run by the zero-bubble runtime, not with "
            f"megatron's own ({flag}); add --enable-zb-runtime or drop the flag")
    if _given("--rerun-mode") and args.rerun_mode != "disabled":
        raise StartupRefusal(
            f"--rerun-mode {args.rerun_mode} all-reduces over every rank after each forward-backward, the barrier "
            f"--enable-optimizer-post-validation removes (without --rerun-mode it is switched off); use "
            f"--rerun-mode disabled or drop one of them")
    unsupported = {
        "log_num_zeros_in_grad": "counting zeros reduces over every stage in the step",
        "log_params_norm": "the parameter norm reduces over every stage and would read speculative weights",
        "use_precision_aware_optimizer": "its decoupled gradients and master weights are not rolled back",
        "optimizer_cpu_offload": "the offloaded optimizer's state is not rolled back",
        "mtp_num_layers": "multi-token prediction layers are clipped by their own norm, which is not chained",
        "moe_enable_routing_replay": "the routing it records or replays is not rewound when passes are replayed",
        "moe_routing_trace_path": "the router trace would record the passes a rollback replays twice",
        "save_tokens_per_expert_interval": "it would record the tokens of the passes a rollback replays twice",
        "save_params_interval": "it would save speculative parameters",
        "qk_clip": "it changes weights after the step, which a rollback would not undo",
    }
    for name, why in unsupported.items():
        if getattr(args, name, False):
            raise StartupRefusal(
                f"--{name.replace('_', '-')} does not work with --enable-optimizer-post-validation ({why}); "
                f"drop one of them")
    if getattr(args, "num_distributed_optimizer_instances", 1) > 1:
        raise StartupRefusal("--num-distributed-optimizer-instances above 1 does not work with "
                             "--enable-optimizer-post-validation yet; drop one of them")
    if args.optimizer not in ("adam", "sgd"):
        raise StartupRefusal(
            f"--enable-optimizer-post-validation rolls back adam and sgd steps, not --optimizer {args.optimizer}; "
            f"use one of those or drop the flag")
    coupled_decay = args.optimizer == "adam" and not getattr(args, "decoupled_weight_decay", True)
    if coupled_decay and args.weight_decay and not args.zero_bubble_exact_rollback:
        raise StartupRefusal(
            "Adam with coupled weight decay cannot be inverted in place; add --zero-bubble-exact-rollback "
            "(or use decoupled weight decay)")


# ---------------------------------------------------------------- before megatron is imported


# Megatron's flags that the checks before megatron's import read, declared as megatron-core 0.19.2 declares
# them (same destination, type, nargs and action: tests compare them with megatron's parser), so that the
# early parse reads them exactly as megatron will.
_EARLY_MEGATRON_FLAGS = {
    "--num-layers": {"type": int},
    "--pipeline-model-parallel-size": {"type": int, "default": 1},
    "--tensor-model-parallel-size": {"type": int, "default": 1},
    "--context-parallel-size": {"type": int, "default": 1},
    "--num-virtual-stages-per-pipeline-rank": {"type": int},
    "--num-layers-per-virtual-pipeline-stage": {"type": int},
    "--decoder-first-pipeline-num-layers": {"type": int},
    "--decoder-last-pipeline-num-layers": {"type": int},
    "--pipeline-model-parallel-layout": {"type": str},
    "--account-for-embedding-in-pipeline-split": {"action": "store_true"},
    "--account-for-loss-in-pipeline-split": {"action": "store_true"},
    "--mtp-num-layers": {"type": int},
    "--save": {"type": str},
    "--tensorboard-dir": {"type": str},
    "--data-cache-path": {},
    "--data-path": {"nargs": "*"},
    "--train-data-path": {"nargs": "*"},
    "--valid-data-path": {"nargs": "*"},
    "--test-data-path": {"nargs": "*"},
    "--data-args-path": {"type": str},
    "--per-split-data-args-path": {"type": str},
    "--vocab-file": {"type": str},
    "--merge-file": {"type": str},
    "--yaml-cfg": {"type": str},
    "--use-checkpoint-args": {"action": "store_true"},
}
# Flags that lay the layers out unevenly over the stages: the divisibility of --num-layers is megatron's to check.
_UNEVEN_SPLIT = ("decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers",
                 "pipeline_model_parallel_layout", "account_for_embedding_in_pipeline_split",
                 "account_for_loss_in_pipeline_split")


def early_parser() -> argparse.ArgumentParser:
    """Our flags and the few megatron flags the early checks read; everything else is left for megatron."""
    parser = argparse.ArgumentParser(prog="pretrain_gpt.py", add_help=False, allow_abbrev=False)
    parser.error = _refuse_argparse_error
    add_zero_bubble_flags(parser)
    for flag, keywords in _EARLY_MEGATRON_FLAGS.items():
        parser.add_argument(flag, **keywords)
    return parser


def early_check(argv: list[str] | None = None) -> None:
    """What can be refused before megatron is even imported (a second, not minutes, under torchrun): our flags'
    values and combinations, paths the run reads or writes, and model-parallel sizes that divide neither the
    processes nor the layers. Prints one line on rank 0 and exits 2 (see `refuse`)."""
    try:
        check_early(sys.argv[1:] if argv is None else argv)
    except StartupRefusal as refusal:
        refuse(str(refusal))


def check_early(argv: list[str]) -> None:
    """The checks of `early_check`; raises StartupRefusal."""
    args, _ = early_parser().parse_known_args(argv)
    check_paths(args)
    check_input_files(args)
    if args.yaml_cfg or args.use_checkpoint_args:
        return  # the sizes and the layer count may come from the YAML file or the checkpoint: megatron's to check
    _check_world_size(args)
    schedule, _ = check_flags(args)
    _check_layer_split(args, schedule)


def _check_world_size(args) -> None:
    tp, pp, cp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.context_parallel_size
    world = int(os.environ.get("WORLD_SIZE", "1"))  # as megatron reads it
    if world % (tp * pp * cp):
        launch = " (launch with torchrun --nproc-per-node N)" if world == 1 else ""
        raise StartupRefusal(
            f"--tensor-model-parallel-size {tp} x --pipeline-model-parallel-size {pp}"
            + (f" x --context-parallel-size {cp}" if cp > 1 else "")
            + f" = {tp * pp * cp} does not divide the {world} processes{launch}; choose sizes whose product "
            f"divides the process count (the rest is data parallel)")


def _check_layer_split(args, schedule: str | None) -> None:
    """An even split of --num-layers over the pipeline stages (and model chunks) must come out whole."""
    pp, layers = args.pipeline_model_parallel_size, args.num_layers
    if not layers or pp < 2 or args.num_layers_per_virtual_pipeline_stage is not None:
        return
    if any(getattr(args, name) for name in _UNEVEN_SPLIT):
        return
    chunks = args.num_virtual_stages_per_pipeline_rank or (natural_chunks(schedule) if schedule else 1)
    if layers % (pp * chunks):
        what = f"--pipeline-model-parallel-size {pp}"
        if args.num_virtual_stages_per_pipeline_rank:
            what += f" x --num-virtual-stages-per-pipeline-rank {chunks}"
        elif chunks > 1:
            what += f" x {chunks} model chunks per rank ({schedule})"
        raise StartupRefusal(f"--num-layers {layers} is not divisible by {what} = {pp * chunks}; use --num-layers "
                             f"{_nearest_multiples(layers, pp * chunks)}")


def parse_and_validate():
    """megatron's parse_and_validate_args with the zero-bubble flags; refuses bad input with one line.

    Returns (megatron's args, ZeroBubbleOptions or None for megatron's own schedule).
    """
    from megatron.training.arguments import parse_and_validate_args, parse_args

    try:  # our parser's errors (megatron's flags included: see add_arguments) and the checks raise StartupRefusal
        options = check(parse_args(add_arguments))
        args = parse_and_validate_args(add_arguments, args_defaults=megatron_defaults(options))
    except StartupRefusal as refusal:
        refuse(str(refusal))
    if options is not None and options.post_validation:
        # megatron's default result validation reduces over every rank each iteration: a global barrier
        args.rerun_mode = "disabled"
    if args.padded_vocab_size is None:  # megatron's FLOP count reads it; the model needs it
        from megatron.training import get_tokenizer
        from megatron.training.vocab_utils import calculate_padded_vocab_size

        args.padded_vocab_size = calculate_padded_vocab_size(
            get_tokenizer().vocab_size, args.make_vocab_size_divisible_by, args.tensor_model_parallel_size
        )
    return args, options
