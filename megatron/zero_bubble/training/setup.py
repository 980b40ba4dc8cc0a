"""Turn the parsed flags into installed patches and a planning, profiling executor around `pretrain()`.

    prepare_process()                      # top of the entry script, before megatron is imported
    args, options = arguments.parse_and_validate()
    with zero_bubble_session(args, options):
        pretrain(...)

Without zero-bubble options (or with megatron's own 1F1B / interleaved schedule chosen) the session
installs nothing: the run is megatron's own.
"""
from __future__ import annotations

import contextlib
import os
from functools import partial

from ..schedules.planners import layout_of, natural_chunks
from . import arguments
from .arguments import SPLIT_BACKWARD_SCHEDULES, ZeroBubbleOptions
from .session import ZeroBubbleSession
from .layer_layout import layer_options_of, stage_layers_of


def prepare_process() -> None:
    """Import shims (no triton, Python 3.11), megatron's dataset helpers as installed; with --zero-bubble-cpu (or
    without CUDA, which the start-up checks then refuse) megatron imported without compiling anything and the CPU
    backend for megatron.training."""
    import gc
    import sys

    import torch

    # What is imported so far (torch, this package) lives as long as the process: frozen, it is not walked again by
    # the collections megatron's import sets off; teardown.run_to_end freezes megatron's part too.
    gc.freeze()
    from ..patches import imports, prebuilt_helpers
    from ..patches.uncompiled_import import uncompiled_import
    from .devices import hide_gpus_if_asked, transformer_engine_asked_for

    hide_gpus_if_asked(sys.argv)  # before torch asks CUDA for its devices
    cpu = not torch.cuda.is_available()

    imports.install(transformer_engine=cpu and transformer_engine_asked_for(sys.argv))
    with uncompiled_import() if cpu else contextlib.nullcontext():
        prebuilt_helpers.install()  # imports megatron.training (and with it megatron-core's models and fusions)
    if cpu:
        os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")  # megatron asks for it with TP > 1
        from ..patches import cpu_backend

        cpu_backend.install(training=True)


def plan_settings(args, options: ZeroBubbleOptions):
    """PlanSettings for the run: costs estimated from the model shape (each virtual stage's layers by kind, as the
    layout or a hybrid pattern places them) until measured ones replace them."""
    from ..runtime.replan import PlanSettings
    from ..schedules.costs import Costs

    p = args.pipeline_model_parallel_size
    chunks = args.virtual_pipeline_model_parallel_size or natural_chunks(options.schedule)
    costs = Costs.from_model(
        layers=args.num_layers, hidden=args.hidden_size, heads=args.num_attention_heads,
        seq_length=args.seq_length, micro_batch=args.micro_batch_size, vocab=args.padded_vocab_size,
        num_virtual_stages=p * chunks, stage_layers=stage_layers_of(args, p, chunks),
        layer_options=layer_options_of(args),
    )
    return PlanSettings(
        schedule=options.schedule, stages=p, chunks=chunks, memory_limit=options.memory_limit,
        ilp_time_limit=options.ilp_time_limit, timers_start_iter=options.timers_start_iter,
        timers_end_iter=options.timers_end_iter, dump_dir=options.dump_dir, initial_costs=costs,
        post_validation=options.post_validation, head_wgrad=options.head_wgrad,
        **({} if options.device_memory_share is None else {"device_memory_share": options.device_memory_share}),
    )


def messaging_options(args):
    """The watchdog's timeout and whether it ends the job, and the injected faults, as the runtime takes them."""
    from ..runtime.messaging import DEFAULT_WATCHDOG_TIMEOUT_S, MessagingOptions

    timeout = args.zero_bubble_watchdog_timeout
    return MessagingOptions(watchdog_timeout_s=DEFAULT_WATCHDOG_TIMEOUT_S if timeout is None else timeout,
                            watchdog_abort=bool(args.zero_bubble_watchdog_abort),
                            faults=tuple(args.zero_bubble_inject_fault or ()))


def _log_on_rank0(line: str) -> None:
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_rank() == 0:
        print(line, flush=True)


def _current_iteration() -> int:
    from megatron.training import get_args

    return get_args().curr_iteration


def _attach_post_validation(session, exact: bool, settings, model, optimizer, scheduler):
    """Put the optimizer's step under post-validation once megatron has built it (refusing what cannot roll back)."""
    from ..runtime import optimizer_rollback

    from ..patches.megatron_optimizer import leaf_optimizers

    for torch_optimizer in filter(None, (leaf.torch_optimizer for leaf in leaf_optimizers(optimizer))):
        reason = None if exact else optimizer_rollback.inverse_unsupported_reason(torch_optimizer)
        if reason is None and not exact and type(torch_optimizer).__name__ == "FusedAdam":
            # written from apex/TE's documented update rule, but not yet checked against their CUDA kernels
            reason = "the in-place inverse of FusedAdam is not verified on a GPU yet; use --zero-bubble-exact-rollback"
        if reason is not None:
            arguments.refuse(f"--enable-optimizer-post-validation: {reason}")
    controller = session.start_post_validation(optimizer, model, exact=exact, scheduler=scheduler,
                                               layout=layout_of(settings.schedule, settings.chunks), chunks=settings.chunks)
    _log_on_rank0(f"zero-bubble: optimizer post-validation on ({'exact rollback' if exact else 'in-place inverse'})")
    return controller


@contextlib.contextmanager
def zero_bubble_session(args, options: ZeroBubbleOptions | None):
    """The ZeroBubbleSession `options` ask for, installed for the duration of the block; yields its
    pipeline (None, and nothing installed, for megatron's own schedules)."""
    if options is None or not options.through_runtime:
        yield None
        return
    settings = plan_settings(args, options)
    # here, not at the top: the entry script imports this module before its early checks
    from ..patches import PatchError, te_wgrad
    from ..runtime.split_check import SplitCheckFailed

    split_backward = options.schedule in SPLIT_BACKWARD_SCHEDULES
    if split_backward and args.transformer_impl == "transformer_engine":
        _log_on_rank0(f"zero-bubble: Transformer Engine layers split into B and W through their own deferral "
                      f"(transformer-engine {te_wgrad.installed_version()}, delay_wgrad_compute and backward_dw)")
    v_stages = args.pipeline_model_parallel_size if layout_of(options.schedule) == "v" else None
    # Every stage ends with W passes whose buckets can start early (megatron buckets the first stage only).
    bucket_every_stage = split_backward and args.overlap_grad_reduce
    with ZeroBubbleSession(plan_settings=settings, current_iteration=_current_iteration, log=_log_on_rank0,
                           v_stages=v_stages, bucket_every_stage=bucket_every_stage,
                           split_check=options.split_check, messaging=messaging_options(args)) as session:
        if options.post_validation:
            session.on_optimizer_built(partial(_attach_post_validation, session, options.exact_rollback, settings))
        try:
            yield session.pipeline
        except SplitCheckFailed as failed:  # every rank reached the same verdict: one line, exit status 2
            arguments.refuse(str(failed))
        except PatchError as refused:  # a layer the split cannot take over (te_wgrad's per-module refusals): one line
            arguments.refuse(str(refused))
