"""The start-up checks that refuse what cannot work, with one line naming the flag and the fix.

`check(args, argv)` runs on the parsed command line (before megatron validates it) and returns the
`ZeroBubbleOptions` of the run, None for megatron's own schedule; every refusal is a `StartupRefusal`.
`check_flags` needs no megatron and also runs before its import (early.py), as do paths.py's checks of the files
and directories and hybrid_checks.py's of a --hybrid-layer-pattern.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..schedules.planners import (PlanRequest, accepts_chunks, conflicting_options, ilp_schedules, layout_of,
                                  multi_chunk_schedules, natural_chunks, plan, schedule_kind)
from ..schedules.schedule import ScheduleError
from ..schedules.vbudget import mem_setup_limit
from ..te_cpu.loader import te_python_version
from .paths import check_input_files, check_paths
from .post_validation_checks import check_post_validation
from .devices import check_device_choice, check_gpu_kernels, check_shared_gpus
from .layer_layout import LAYOUT_FLAGS, layout_stage_count, padding_layout, standalone_mtp_rank
from .hybrid_checks import check_schedule_chunks
from .hybrid_pattern import pattern_chunks, pattern_of
from .te_checks import check_transformer_engine_split
from .flags import (DEFAULT_TIMERS, PIPELINE_SCHEDULES, SCHEDULE_ALIASES, SPLIT_BACKWARD_SCHEDULES, UNSUPPORTED_FLAGS,
                    StartupRefusal, cuda_available, given)

# Flags that only mean something with a schedule run by the zero-bubble runtime (None when not given).
RUNTIME_ONLY_FLAGS = ("zero_bubble_max_pending_backward", "zero_bubble_v_schedule_mem_setup",
                      "zero_bubble_adaptive_memory_limit_percentile",
                      "zero_bubble_pipeline_timers_start_iter",
                      "zero_bubble_pipeline_timers_end_iter", "zero_bubble_dump_schedule",
                      "zero_bubble_watchdog_timeout", "zero_bubble_watchdog_abort", "zero_bubble_inject_fault",
                      "zero_bubble_output_layer_wgrad")


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
    device_memory_share: float | None = None  # of the free device memory for the automatic limit; None: default
    split_check: bool = False  # fused and split compared on the real layers before the first iteration
    head_wgrad: str = "auto"  # where a split schedule runs the output layer's W (PlanRequest.head_wgrad)


def _dest(flag: str) -> str:
    return flag[2:].replace("-", "_")


def chosen_schedule(args) -> tuple[str | None, str | None]:
    """(schedule, the flag that asked for it), or (None, None) for megatron's own; refuses conflicting flags."""
    for flag, (_, why) in UNSUPPORTED_FLAGS.items():
        if getattr(args, _dest(flag)) not in (None, False):
            raise StartupRefusal(f"{flag}: {why}")
    asked = []
    if args.pipeline_schedule is not None:
        asked.append(("--pipeline-schedule " + args.pipeline_schedule, args.pipeline_schedule))
    asked += [(flag, name) for flag, name in SCHEDULE_ALIASES.items() if getattr(args, _dest(flag))]
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
    """Model chunks per rank as megatron derives them from whichever virtual-pipeline flag is given."""
    p = max(1, args.pipeline_model_parallel_size)
    if pattern_of(args):  # megatron's virtual pipeline size from the pattern's | segments
        return pattern_chunks(pattern_of(args), p)
    if args.num_virtual_stages_per_pipeline_rank is not None:
        return args.num_virtual_stages_per_pipeline_rank
    if args.pipeline_model_parallel_layout is not None:
        return layout_stage_count(args.pipeline_model_parallel_layout) // p
    if args.num_layers_per_virtual_pipeline_stage is not None and args.num_layers:
        counted = args.num_layers + args.account_for_embedding_in_pipeline_split + args.account_for_loss_in_pipeline_split
        return counted // p // args.num_layers_per_virtual_pipeline_stage
    return None


def padding_chunks(args, schedule: str | None) -> int:
    """Model chunks per rank that --allow-padding-num-layers lays the layers out over."""
    return args.num_virtual_stages_per_pipeline_rank or (natural_chunks(schedule) if schedule else 1)


def check_layer_padding(args, schedule: str | None) -> None:
    """--allow-padding-num-layers lays the layers out itself: not with megatron's layout flags, and not so thin
    that a middle stage would hold nothing."""
    if not args.allow_padding_num_layers:
        return
    for name in LAYOUT_FLAGS:
        if getattr(args, name, None):
            option = "--" + name.replace("_", "-")
            raise StartupRefusal(f"--allow-padding-num-layers lays the layers out itself, and so does {option}; "
                                 f"keep one of them")
    stages = args.pipeline_model_parallel_size * padding_chunks(args, schedule)
    try:
        padding_layout(args.num_layers or 0, stages)
    except ValueError as error:
        raise StartupRefusal(f"--allow-padding-num-layers: {error} (--num-layers)") from None


def microbatches(args) -> int:
    model_parallel = args.tensor_model_parallel_size * args.pipeline_model_parallel_size * args.context_parallel_size
    data_parallel = max(1, args.world_size // model_parallel)
    global_batch = args.global_batch_size or args.micro_batch_size * data_parallel
    return max(1, global_batch // (args.micro_batch_size * data_parallel))


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
    if cuda_available():
        check_gpu_kernels(args)
        return
    if args.distributed_backend != "gloo":
        raise StartupRefusal("--distributed-backend nccl needs CUDA; on CPU drop the flag (gloo is used)")
    if args.transformer_impl == "transformer_engine" and te_python_version() is None:
        raise StartupRefusal("--transformer-impl transformer_engine on the CPU needs Transformer Engine's Python "
                             "(pip install --no-deps transformer-engine==2.20.2 onnxscript einops); or use "
                             "--transformer-impl local")
    if args.transformer_impl == "transformer_engine" and args.attention_backend.name not in ("unfused", "local"):
        raise StartupRefusal(f"--attention-backend {args.attention_backend.name} needs CUDA; on CPU drop the flag "
                             f"(TE's unfused attention runs)")
    if not args.num_experts:
        return
    for name, why in MOE_CUDA_ONLY.items():
        if name == "moe_grouped_gemm" and args.transformer_impl == "transformer_engine":
            continue  # TE's GroupedLinear over the CPU kernel layer
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
    check_schedule_chunks(args, schedule, flag)  # a hybrid pattern's segments: refused in its own words
    vpp = _virtual_stages(args)
    _check_conflicts(args, schedule, flag)
    if layout_of(schedule) == "v":
        _check_v_layout(args, vpp, flag)
    elif vpp is not None and not accepts_chunks(schedule, vpp):
        if vpp < 2:
            raise StartupRefusal(
                f"{flag} needs two or more model chunks per rank; drop --num-virtual-stages-per-pipeline-rank 1")
        multi = " / ".join(name for name in multi_chunk_schedules() if name in PIPELINE_SCHEDULES)
        raise StartupRefusal(
            f"{flag} runs one model chunk per rank; drop --num-virtual-stages-per-pipeline-rank / "
            f"--num-layers-per-virtual-pipeline-stage (or use --pipeline-schedule {multi})"
        )
    if not _through_runtime(args, schedule):
        _refuse_runtime_only_flags(args, f"{flag} runs megatron's own schedule; add --enable-zb-runtime or drop")
        return
    limit = args.zero_bubble_max_pending_backward
    if isinstance(limit, float) and limit < 1:
        raise StartupRefusal(
            f"--zero-bubble-max-pending-backward {limit:g} is below one microbatch; give at least 1 (p = 1F1B's memory)"
        )
    _check_memory_share(args)
    head_wgrad = getattr(args, "zero_bubble_output_layer_wgrad", None)
    if head_wgrad is not None and schedule not in SPLIT_BACKWARD_SCHEDULES:
        raise StartupRefusal(f"--zero-bubble-output-layer-wgrad {head_wgrad} places the output layer's weight "
                             f"gradient, which {flag} does not split from its backward; drop the flag or choose a "
                             f"split schedule ({', '.join(SPLIT_BACKWARD_SCHEDULES)})")
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


def _check_memory_share(args) -> None:
    share = args.zero_bubble_adaptive_memory_limit_percentile
    if share is None:
        return
    flag = f"--zero-bubble-adaptive-memory-limit-percentile {share:g}"
    if not 0 < share <= 100:
        raise StartupRefusal(f"{flag} is not a percentage; give a number above 0 and at most 100")
    if args.zero_bubble_max_pending_backward is not None or args.zero_bubble_v_schedule_mem_setup is not None:
        raise StartupRefusal(f"{flag} sizes the automatic memory limit, but the limit is given; drop one of them")
    if not cuda_available():
        raise StartupRefusal(f"{flag} has no effect without CUDA (the automatic limit reads the free device "
                             f"memory; on CPU it is the planner's default); drop the flag")


def check_zero_bubble(args, schedule: str, flag: str) -> ZeroBubbleOptions:
    """Refuse what the chosen schedule cannot run with beyond `check_schedule_flags` (which `check_flags`
    ran already); the options otherwise."""
    _check_split_check_flag(args, schedule, flag)
    if not _through_runtime(args, schedule):
        return ZeroBubbleOptions(schedule=schedule, through_runtime=False, memory_limit=None, timers_start_iter=0,
                                 timers_end_iter=0, dump_dir=None, ilp_time_limit=0.0)
    _check_runtime(args, flag)
    if schedule in SPLIT_BACKWARD_SCHEDULES:
        check_transformer_engine_split(args, flag)
    head_wgrad = getattr(args, "zero_bubble_output_layer_wgrad", None)
    limit = args.zero_bubble_max_pending_backward
    if getattr(args, "zero_bubble_v_schedule_mem_setup", None) is not None:
        limit = mem_setup_limit(args.zero_bubble_v_schedule_mem_setup, args.pipeline_model_parallel_size)
    start, end = _timer_window(args)
    options = ZeroBubbleOptions(
        schedule=schedule, through_runtime=True, memory_limit=limit, timers_start_iter=start, timers_end_iter=end,
        dump_dir=args.zero_bubble_dump_schedule, ilp_time_limit=args.zero_bubble_ilp_time_limit,
        device_memory_share=None if args.zero_bubble_adaptive_memory_limit_percentile is None
        else args.zero_bubble_adaptive_memory_limit_percentile / 100,
        split_check=schedule in SPLIT_BACKWARD_SCHEDULES and getattr(args, "zero_bubble_split_check", True),
        head_wgrad=head_wgrad or "auto",
    )
    _try_planning(args, options, flag)
    return options


def _check_split_check_flag(args, schedule: str | None, flag: str | None) -> None:
    if getattr(args, "zero_bubble_split_check", True) or schedule in SPLIT_BACKWARD_SCHEDULES:
        return
    runs = f"{flag} does not split the backward" if schedule is not None else "no zero-bubble schedule is chosen"
    raise StartupRefusal(f"--no-zero-bubble-split-check has no effect: {runs}; drop --no-zero-bubble-split-check")


def _refuse_runtime_only_flags(args, reason: str) -> None:
    for name in RUNTIME_ONLY_FLAGS:
        if getattr(args, name) is not None:
            raise StartupRefusal(f"--{name.replace('_', '-')} has no effect: {reason} --{name.replace('_', '-')}")


def _check_v_layout(args, vpp, flag: str) -> None:
    p, layers = args.pipeline_model_parallel_size, args.num_layers
    if vpp not in (None, 2):
        what = ("--pipeline-model-parallel-layout names 2p stages" if args.pipeline_model_parallel_layout
                else "drop the virtual pipeline flags")
        raise StartupRefusal(f"{flag} places exactly two model chunks per rank; {what}")
    if args.pipeline_model_parallel_layout is not None or args.allow_padding_num_layers or pattern_of(args):
        return  # megatron checks that a layout holds every layer; padding splits any count; a pattern has 2p segments
    counted = (layers or 0) + args.account_for_embedding_in_pipeline_split + args.account_for_loss_in_pipeline_split
    if layers is None or counted % (2 * p):
        extra = counted - (layers or 0)
        what = f"--num-layers {layers}" + (f" (+{extra} for the embedding and the loss)" if extra else "")
        raise StartupRefusal(
            f"{flag} cuts the model into 2p = {2 * p} virtual stages, but {what} is not a multiple of {2 * p}; "
            f"use --num-layers {nearest_multiples(layers or 0, 2 * p)}{' less ' + str(extra) if extra else ''}, "
            f"or add --allow-padding-num-layers")


def nearest_multiples(layers: int, step: int) -> str:
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
    "moe_paged_stash": "megatron's own schedules switch the stash on at each iteration and reload the experts' "
                       "activations in the pass order they recorded in the first; the runtime replaces those "
                       "schedules (the stash would stay off) and re-plans that order",
}


# How megatron's own schedules post pipeline messages: the runtime posts batches of its own on megatron's pipeline group
# (docs/communication.md), so these would change nothing; refused rather than ignored. Read from the parsed arguments,
# before megatron validates them (it switches overlap_p2p_comm off itself without an interleaved schedule):
# option -> (destination, the value that option sets, why).
_P2P_FLAGS_NOT_HONOURED = {
    "--no-overlap-p2p-communication": ("overlap_p2p_comm", False,
                                       "it chooses how megatron's interleaved schedule posts its messages"),
    "--overlap-p2p-communication-warmup-flush": ("overlap_p2p_comm_warmup_flush", True,
                                                 "it tunes megatron's interleaved schedule's message overlap"),
    "--use-ring-exchange-p2p": ("use_ring_exchange_p2p", True,
                                "it replaces megatron's batched sends and receives with a ring exchange"),
}


def _check_p2p_flags(args, flag: str) -> None:
    for option, (name, value, why) in _P2P_FLAGS_NOT_HONOURED.items():
        if getattr(args, name, not value) is value:
            raise StartupRefusal(f"{option} does not apply with the zero-bubble runtime ({flag}), which posts its "
                                 f"messages in batches of its own on the pipeline group: {why}; drop {option}")
    if getattr(args, "pipeline_model_parallel_comm_backend", None) == "ucc":
        raise StartupRefusal(f"--pipeline-model-parallel-comm-backend ucc does not work with the zero-bubble runtime "
                             f"({flag}): its pipeline messages are proven on NCCL's rules, not UCC's; use nccl")


def _check_runtime(args, flag: str) -> None:
    for name in ("sft", "rl_use_sequence_packing", "hybrid_context_parallel"):
        if getattr(args, name, False):
            raise StartupRefusal(
                f"--{name.replace('_', '-')} gives variable sequence lengths, which the zero-bubble runtime "
                f"does not support ({flag} needs fixed pipeline tensor shapes); drop one of them"
            )
    layout, pipeline_size = args.pipeline_model_parallel_layout, args.pipeline_model_parallel_size
    rank = standalone_mtp_rank(str(layout), pipeline_size) if layout is not None and pipeline_size > 1 else None
    if rank is not None:
        raise StartupRefusal(f"--pipeline-model-parallel-layout puts the multi-token-prediction layers (m) at the end of "
                             f"pipeline rank {rank}, not the last: megatron then exchanges pipeline tensors of varying "
                             f"shapes (mtp_standalone), which the zero-bubble runtime ({flag}) does not support; put "
                             f"m in the last stage")
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
            post_validation=args.enable_optimizer_post_validation, head_wgrad=options.head_wgrad,
        ))
    except ScheduleError as error:
        raise StartupRefusal(f"{flag}: {error}") from None


def check(args, argv: list[str]) -> ZeroBubbleOptions | None:
    """All start-up checks on parsed (not yet megatron-validated) arguments (`argv`: the command line they were
    parsed from, for what must be given explicitly); None without zero bubble."""
    check_device_choice(args)
    check_without_zero_bubble(args)
    check_paths(args)
    schedule, flag = check_flags(args)
    if given(argv, "--zero-bubble-ilp-time-limit") and (schedule is None or not schedule_kind(schedule).ilp):
        chosen = flag or "megatron's own schedule"
        planners = " / ".join(ilp_schedules())
        raise StartupRefusal(f"--zero-bubble-ilp-time-limit bounds the ILP of {planners}'s planner, which {chosen} "
                             f"does not use; drop the flag")
    check_shared_gpus(args, through_runtime=schedule is not None and _through_runtime(args, schedule))
    if schedule is None:
        return None
    options = check_zero_bubble(args, schedule, flag)
    if options.through_runtime:
        _check_p2p_flags(args, flag)
    if args.enable_optimizer_post_validation:
        check_post_validation(args, options, flag, argv)
        options = dataclasses.replace(options, post_validation=True, exact_rollback=args.zero_bubble_exact_rollback)
    return options


def check_flags(args) -> tuple[str | None, str | None]:
    """The checks on our own flags (and megatron's pipeline sizes), before megatron is imported and after its
    parsing: (schedule, the flag that asked for it), or (None, None) for megatron's own schedule."""
    if args.zero_bubble_exact_rollback and not args.enable_optimizer_post_validation:
        raise StartupRefusal("--zero-bubble-exact-rollback only applies to --enable-optimizer-post-validation; "
                             "add that flag or drop it")
    schedule, flag = chosen_schedule(args)
    check_layer_padding(args, schedule)
    if schedule is None:
        if args.enable_optimizer_post_validation:
            raise StartupRefusal("--enable-optimizer-post-validation needs a zero-bubble runtime schedule; add "
                                 "--enable-zero-bubble (or --pipeline-schedule zb-h1 / zb-h2) or drop the flag")
        _refuse_runtime_only_flags(args, "no zero-bubble schedule is chosen; add --enable-zero-bubble or drop")
        _check_split_check_flag(args, None, None)
    else:
        check_schedule_flags(args, schedule, flag)
    return schedule, flag
