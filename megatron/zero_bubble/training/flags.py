"""The zero-bubble command-line flags of `pretrain_gpt.py`, added through megatron's extra-args hook.

`add_arguments` is megatron's `extra_args_provider`: `--help` lists the flags in the group "zero bubble", a
bad value or flag (megatron's own included) is one line (`StartupRefusal`), never argparse's usage text, and on
a machine without CUDA the defaults that need it are switched to their CPU counterparts.
"""
from __future__ import annotations

import argparse

from ..schedules.errors import ScheduleError
from ..schedules.planners import SCHEDULES, pipeline_schedule_names, split_backward_schedules
from ..schedules.problem import WGRAD_PLACEMENTS, MemoryLimit
from ..runtime.faults import KINDS as FAULT_KINDS, parse_fault
from ..runtime.messaging import DEFAULT_WATCHDOG_TIMEOUT_S
from ..runtime.planning import DEVICE_MEMORY_SHARE
from ..schedules.vbudget import MEM_SETUPS
from .refusal import program

# What pretrain_gpt.py offers; the facts live in the planning registry (planners.SCHEDULES).
PIPELINE_SCHEDULES = pipeline_schedule_names()
SPLIT_BACKWARD_SCHEDULES = split_backward_schedules()
SHARE_GPUS = "--zero-bubble-share-gpus"  # devices.py
ON_CPU = "--zero-bubble-cpu"
DEFAULT_TIMERS = (100, 110)  # timer window [start, end) in iterations, as in the paper's implementation

# Flags users bring from other zero-bubble implementations (README, "Coming from another implementation").
# Megatron-DeepSpeed's ZB-H1 flags ask for our zb-h1, which is exact (W runs in microbatch order):
SCHEDULE_ALIASES = {"--enable-zbh1-pipeline": "zb-h1", "--enable-zbh1-exact-semantics": "zb-h1"}
_OFFLOAD = ("activation offloading (PipeOffload) is not implemented; for less activation memory use a V schedule "
            "under a smaller budget (--zero-bubble-v-schedule-mem-setup half or min)")
# The original implementation's flags with no counterpart here: (takes a value, why and what to use instead).
UNSUPPORTED_FLAGS = {
    "--enable-1f1b-v": (False, "1F1B-V is not implemented; use --zero-bubble-v-schedule (ZB-V at 1F1B's memory) "
                               "or --pipeline-schedule interleaved-1f1b"),
    "--interleave-group-size": (True, "group-interleaved 1F1B is not implemented; use --pipeline-schedule "
                                      "interleaved-1f1b"),
    "--no-pre-communication-optimization": (False, "the runtime sends and receives in the order its lowering "
                                                   "proves deadlock-free, with no switch; drop the flag"),
    "--cpu-offload": (False, _OFFLOAD),
    "--offload-chunk-num": (True, _OFFLOAD),
    "--offload-time": (True, _OFFLOAD),
    "--auto-offload-time": (False, _OFFLOAD),
    "--num-seq-splits": (True, "sequence-split pipelining (Seq1F1B) is not implemented; drop the flag"),
}


# megatron's defaults assume CUDA; on CPU these work (the fusions would compile with torch.compile, seconds per
# process for no gain at CPU sizes; masked softmax's fp16/bf16 kernel is CUDA-only; apply_rope_fusion is Transformer
# Engine's RoPE kernel, megatron's --no-rope-fusion). Gradient-accumulation fusion stays megatron's default (on):
# TE's layers fuse on the CPU kernel layer, megatron's own over apex's kernel emulated (cpu_backend_core.py).
CPU_DEFAULTS = dict(distributed_backend="gloo", no_persist_layer_norm=True,
                    transformer_impl="local", bias_gelu_fusion=False, bias_swiglu_fusion=False,
                    bias_dropout_fusion=False, masked_softmax_fusion=False, apply_rope_fusion=False)


def cpu_defaults() -> dict:
    """CPU_DEFAULTS, with megatron's own default layers (Transformer Engine's) where TE's Python is installed: on the CPU
    it runs over the labelled kernel layer (te_cpu)."""
    from ..te_cpu import te_python_version

    if te_python_version() is None:
        return dict(CPU_DEFAULTS)
    # TE's attention in PyTorch: flash and cuDNN attention need CUDA (a string default goes through the flag's type)
    return {**CPU_DEFAULTS, "transformer_impl": "transformer_engine", "attention_backend": "unfused"}


class StartupRefusal(Exception):
    """A flag combination that cannot work; the message is one line naming the flag and the fix."""


def _schedule_name(text: str) -> str:
    """--pipeline-schedule's type: one of PIPELINE_SCHEDULES (a bad name is one line, not argparse's usage dump)."""
    if text in PIPELINE_SCHEDULES:
        return text
    planner_only = f" ({text} is planner-only: zb-schedule)" if text in SCHEDULES else ""
    raise argparse.ArgumentTypeError(f"{text!r} is not a schedule pretrain_gpt.py runs{planner_only}; use one of "
                                     f"{', '.join(PIPELINE_SCHEDULES)}")


def _max_pending_backward(text: str):
    """A number of in-flight microbatches, 'Nx' (N times the largest activation memory a rank holds under 1F1B on
    the same costs), or 'auto'."""
    if text == "auto":
        return None
    try:
        limit = MemoryLimit.parse_of_1f1b(text)
        return float(text) if limit is None else limit
    except (ValueError, ScheduleError):
        raise argparse.ArgumentTypeError(f"expected a number of microbatches, a multiple of 1F1B's peak such as 1x, "
                                         f"or 'auto', got {text!r}") from None


def _fault(text: str):
    try:
        return parse_fault(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected seconds (0 or more), got {text!r}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """megatron's `extra_args_provider`: the zero-bubble flags and the entry script's own options."""
    add_zero_bubble_flags(parser)
    _repair_help_texts(parser)
    parser.error = refuse_argparse_error  # a bad megatron flag: one line, not the full usage on every rank
    if not cuda_available():
        parser.set_defaults(**cpu_defaults())
    return parser


_WATCHDOG_HELP = ("A rank whose oldest pipeline message has been in flight this long prints where the pipeline "
                  "stands (the message, its peer, the pass that needs it, the head of each link); ending a hung job "
                  "is left to NCCL's timeout (--distributed-timeout-minutes), which writes the flight recorder "
                  f"(--flight-recorder-dump-path). Default {DEFAULT_WATCHDOG_TIMEOUT_S:g}, well under NCCL's; 0: off.")
_WATCHDOG_ABORT_HELP = ("With the pipeline watchdog's line, end the job at once: write the flight recorder "
                        "(--flight-recorder-dump-path), abort the NCCL process groups and exit with status 3.")
_FAULT_HELP = (f"Inject a fault on a global rank, to see the run stop cleanly: {', '.join(FAULT_KINDS)} (the split "
               "check sees a difference on that rank only; that rank never posts its last activation or gradient "
               "send of an iteration; that rank sleeps SECONDS, default 0.2, before each pass). May be given more "
               "than once. For tests.")


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
                       "1F1B's rank 0, i.e. ZB-1p; 2p = ZB-2p; zb-h1 / zb-h2 have fixed memory), or for zb-auto with "
                       "one chunk Nx: N times the largest activation memory any rank holds under 1F1B on the same "
                       "costs (1x: no rank holds more than 1F1B's fullest, where a larger last stage makes p M_B "
                       "more). auto (default): on GPU what the free device memory holds, at most the planner's "
                       "default; on CPU the default, 2p for zb-auto and p for zb-v.")
    group.add_argument("--zero-bubble-output-layer-wgrad", choices=WGRAD_PLACEMENTS, default=None,
                       help="Where a split schedule runs the output layer's weight gradient: auto (default: the "
                       "planner plans it both deferred into a W pass and kept inside B, and keeps the faster, where "
                       "the costs know the output layer's share; it stays in B after re-planning if it was), "
                       "deferred, or in-b (its large deferred operands, the input and the sequence x vocabulary "
                       "gradient, are then never held).")
    group.add_argument("--zero-bubble-pipeline-timers-start-iter", type=int, default=None, metavar="START",
                       help=f"Re-planning from measured costs: pass times and activation sizes are recorded while "
                       f"megatron's count of completed iterations is in [START, END), i.e. in the iterations its "
                       f"log numbers START+1..END, counted from where the run starts (a run resumed from the "
                       f"checkpoint of iteration N records N+START+1..N+END) (default {DEFAULT_TIMERS[0]}).")
    group.add_argument("--zero-bubble-pipeline-timers-end-iter", type=int, default=None, metavar="END",
                       help=f"After logged iteration END the costs are gathered, the schedule is re-planned on one "
                       f"rank and broadcast; every rank runs it from logged iteration END+1 on (default "
                       f"{DEFAULT_TIMERS[1]}; END equal to START: no re-planning).")
    group.add_argument("--zero-bubble-ilp-time-limit", type=float, default=10.0,
                       help="Seconds the automatic planner's ILP refinement may take (0 skips it).")
    group.add_argument("--zero-bubble-dump-schedule", metavar="DIR", default=None,
                       help="Write the schedule in use as JSON and PNG into DIR (rank 0), again after "
                       "re-planning.")
    group.add_argument("--zero-bubble-adaptive-memory-limit-percentile", type=float, default=None, metavar="P",
                       help=f"With --zero-bubble-max-pending-backward auto on GPU: activations may take P%% of the "
                       f"device memory left free once the model and optimizer are in place (default "
                       f"{100 * DEVICE_MEMORY_SHARE:g}). The original implementation's flag of this name counts "
                       f"P%% of all device memory, for every allocation.")
    group.add_argument("--enable-exactly-numeric-match", dest="zero_bubble_exact_rollback", action="store_true",
                       help="The original implementation's name of --zero-bubble-exact-rollback.")
    for flag, schedule in SCHEDULE_ALIASES.items():
        group.add_argument(flag, action="store_true",
                           help=f"Megatron-DeepSpeed's flag: same as --pipeline-schedule {schedule}, which is exact.")
    for flag, (takes_value, why) in UNSUPPORTED_FLAGS.items():
        group.add_argument(flag, **({"metavar": "VALUE"} if takes_value else {"action": "store_true"}),
                           help=f"Known from another implementation, refused here: {why.replace('%', '%%')}.")
    group.add_argument("--allow-padding-num-layers", action="store_true",
                       help="Let --num-layers not divide into the virtual stages (p, or p x model chunks; 2p for "
                       "ZB-V): the layers that do not divide go to the middle stages first, so the stages at both "
                       "ends of the model, which also hold the embedding and the LM head, get the fewest; megatron "
                       "gets it as the equivalent --pipeline-model-parallel-layout (so not with a layout flag).")
    group.add_argument("--no-zero-bubble-split-check", dest="zero_bubble_split_check", action="store_false",
                       help="Skip the split check at start-up (on by default with a schedule that splits the "
                       "backward: before the first iteration each rank runs one microbatch of each of its model "
                       "chunks fused and split into B and W on its real layers and stops the run if any gradient "
                       "differs in any bit).")
    group.add_argument("--enable-optimizer-post-validation", action="store_true",
                       help="No cross-stage synchronisation before the optimizer step: each stage steps "
                       "speculatively on the partial grad-norm/inf sums of the stages before it; the full sums "
                       "come back in the next iteration's warm-up, which rolls the step back (and re-steps "
                       "clipped, replaying what ran on the speculative weights) when needed. Steps with inf/NaN "
                       "gradients are skipped in every precision. Needs a schedule the zero-bubble runtime runs "
                       "(any layout: one chunk, interleaved or V).")
    group.add_argument("--zero-bubble-exact-rollback", action="store_true",
                       help="With --enable-optimizer-post-validation: keep a copy of the parameters and optimizer "
                       "state at each speculative step so that a rollback restores them bit for bit (default: "
                       "invert the update in place, exact to a few ulps, no extra memory).")
    group.add_argument("--zero-bubble-watchdog-timeout", type=_seconds, default=None, metavar="SECONDS",
                       help=_WATCHDOG_HELP)
    group.add_argument("--zero-bubble-watchdog-abort", action="store_true", default=None, help=_WATCHDOG_ABORT_HELP)
    group.add_argument("--zero-bubble-inject-fault", type=_fault, action="append", default=None,
                       metavar="KIND:RANK[:SECONDS]", help=_FAULT_HELP)
    group.add_argument(ON_CPU, action="store_true",
                       help="Train on the CPU with gloo: slow, for trying zero bubble and for tests. Without it, a "
                       "machine where torch sees no CUDA device stops at start-up (a GPU node with a broken driver "
                       "would otherwise train a thousand times slower); with it, the GPUs are not used.")
    group.add_argument(SHARE_GPUS, action="store_true",
                       help="Let a node's ranks outnumber its GPUs: local rank i computes on GPU i mod the GPU count, "
                       "and pipeline messages go through host memory over gloo (needs --distributed-backend gloo: "
                       "NCCL refuses two ranks on one GPU). For checking a pipeline on one GPU "
                       "(scripts/gpu_check.sh), not for speed; pipeline and data parallelism only, with a schedule "
                       "the zero-bubble runtime runs.")
    entry = parser.add_argument_group("pretrain_gpt.py")
    entry.add_argument("--init-weights-by-global-name", action="store_true",
                       help="Initialise every weight from a generator seeded by (--seed, its global name), "
                       "so that any pipeline/tensor layout of the model starts from the same weights.")


def given(argv: list[str], flag: str) -> bool:
    """Whether the command line `argv` names `flag` itself (not just its default)."""
    return any(word == flag or word.startswith(flag + "=") for word in argv)


def refuse_argparse_error(message: str):
    """argparse's `error` for our parsers: a StartupRefusal (one line) instead of the usage text and exit."""
    if message.startswith("argument "):
        message = message[len("argument "):]
    if message.startswith("unrecognized arguments"):
        message += f" (python {program()} --help lists every flag)"
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


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()
