"""The end of a training process: every process group destroyed while the interpreter is still whole.

megatron's `pretrain()` returns with its process groups alive, and megatron's example scripts then let the
interpreter end, so the groups die during its finalization. A gloo group runs each collective on a C++ worker thread
of its own, and that thread lets go of the collective's tensors only after the rank has seen the collective complete.
A tensor whose Python object the rank has dropped by then has its Python object released on the worker thread, which
must take the GIL for it. Once the interpreter is finalizing, CPython (3.11) ends a thread that asks for the GIL with
`pthread_exit`, whose unwinding stops at a C++ frame that may not throw: `std::terminate`, "terminate called without
an active exception", SIGABRT and torchrun's exit status 1, after a run that trained, evaluated and saved. It takes a
worker that lags the rank's main thread from the rank's last collective (megatron's timers, tens of milliseconds before
the end) to the interpreter's end, which a loaded machine makes happen now and then (docs/clean-exit.md).

`run_to_end(main)` is how the entry scripts run. Its `end_distributed()` ends the process as megatron's own orderly
shutdown does (its exit on a termination signal): a barrier, so that no peer is still in a collective with this rank,
then every group destroyed. A gloo group's threads stop only with its last reference, so megatron's references go
first, then torch's, then the reference cycles that hold the rest. torch releases the GIL while a group's destructor
joins its workers, so a worker that still needs the GIL gets it.
"""
from __future__ import annotations

import functools
import gc
import os
import sys

# The line's words where gloo threads outlive the teardown (the tests look for them in every run's output).
THREADS_OUTLIVE = "gloo threads outlive the process groups' teardown"
# The callables megatron's training loop stores on the model's TransformerConfig (see release_training_cycles).
_CONFIG_CALLBACKS = ("grad_scale_func", "no_sync_func", "grad_sync_func", "param_sync_func",
                     "finalize_model_grads_func")


def run_to_end(main) -> None:
    """An entry script's `main()`, then, if it ended well (megatron's early exits by --exit-interval and
    --exit-duration-in-mins included), every process group destroyed before the interpreter ends. A run that failed
    ends as before: destroying a group could wait for a peer that is gone.

    What the entry script imported (torch, megatron: hundreds of thousands of objects) lives as long as the process,
    so it is frozen first (gc.freeze): no collection walks it again, neither megatron's full ones during training nor
    the interpreter's at its end. What `main` makes is collected as before."""
    gc.freeze()
    try:
        main()
    except SystemExit as stop:
        if stop.code not in (None, 0):
            raise
    # past the except block the exception has gone, and with its traceback the frames that held the model's groups
    end_distributed(log=lambda line: print(line, file=sys.stderr, flush=True))


def end_distributed(log=None) -> None:
    """After a run that ended well on this rank: barrier, megatron's parallel state, every process group destroyed.
    `log` gets one line if gloo threads outlive it (something still holds a group)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    dist.barrier()  # every rank has left its last collective: destroying a group strands no peer in it
    forget_megatron_groups()
    clear_megatron_method_caches()
    forget_fp8_state()
    release_training_cycles()
    dist.destroy_process_group()  # torch's references to every group, WORLD included
    gc.collect()  # groups held in reference cycles (model chunks and their process-group collections)
    for _ in range(2):  # what the first collection's finalizers let go, where anything is left
        if not gloo_threads():
            break
        gc.collect()
    left = gloo_threads()
    if left and log is not None:
        log(f"zero-bubble: {left} {THREADS_OUTLIVE} (a reference to a group is still held); the process may abort "
            f"as it exits")


def forget_megatron_groups() -> None:
    """megatron's `destroy_model_parallel` (which also destroys its gloo data-parallel groups), then the globals it
    forgets, and the MoE metrics tracker that names groups. Nothing where megatron was never imported."""
    parallel_state = sys.modules.get("megatron.core.parallel_state")
    if parallel_state is None:
        return
    import torch.distributed as dist

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    # megatron-core 0.19.2's destroy forgets _INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP[_GLOO]: a group referenced
    # there outlives it, threads and all
    for name, value in list(vars(parallel_state).items()):
        if name.isupper() and isinstance(value, dist.ProcessGroup):
            setattr(parallel_state, name, None)
    moe_logging = sys.modules.get("megatron.core.transformer.moe.moe_logging")
    if moe_logging is not None:  # its MoE metrics (a global) name the groups they reduce over
        moe_logging.destroy_moe_metrics_tracker()


def clear_megatron_method_caches() -> None:
    """Empty the functools caches on megatron's classes, and on Transformer Engine's functions and classes. A method
    memoized at class level keeps every `self` it was called on for the life of the process: megatron-core 0.19.2's
    `RotaryEmbedding.forward` (and YaRN's) keeps the rotary module, which keeps its context-parallel group, so every
    run with rotary positions would end with that group's threads alive. TE memoizes functions of a group
    (`get_distributed_world_size`, `get_distributed_rank`), which keep every group a TE module was built with."""
    for name, module in list(sys.modules.items()):
        if not name.startswith(("megatron.", "transformer_engine.")) or module is None:
            continue
        for value in list(vars(module).values()):
            if name.startswith("transformer_engine.") and isinstance(value, functools._lru_cache_wrapper):
                value.cache_clear()
            if isinstance(value, type) and value.__module__ == name:
                for attribute in vars(value).values():
                    if callable(getattr(attribute, "cache_clear", None)):
                        attribute.cache_clear()


def forget_fp8_state() -> None:
    """Where Transformer Engine was imported, the globals of its FP8 that name groups: its FP8 state, a class attribute
    (the recipe and amax-reduction group of every FP8 autocast, and the amax buffers), reset as TE's own reset()
    does; and its attention's cache of the last backend selection, whose parameters keep the last layer's FP8
    metadata, amax-reduction group included (forgotten, as when TE asks for a new selection)."""
    quantization = sys.modules.get("transformer_engine.pytorch.quantization")
    manager = getattr(quantization, "FP8GlobalStateManager", None)
    if manager is not None:
        manager.reset()
    attention = sys.modules.get("transformer_engine.pytorch.attention.dot_product_attention.dot_product_attention")
    backends = getattr(attention, "_attention_backends", None)
    if isinstance(backends, dict) and "attention_params" in backends:
        backends["attention_params"] = None
        backends["backend_selection_requires_update"] = True


def release_training_cycles() -> None:
    """Break the reference cycles the garbage collector cannot see, so that a finished run's groups can go.

    With --use-distributed-optimizer: config.grad_scale_func -> optimizer -> its shard views of the parameters
    (tensors with a grad_fn) -> C++ autograd nodes -> DDP's grad hooks -> model -> config. The C++ edges are invisible
    to gc, so the model, optimizer and their process groups would live on. With MoE: a token dispatcher keeps its
    last forward's routing probabilities (a tensor with a grad_fn) -> C++ autograd nodes -> the router weight's grad
    hook (DDP) -> model -> dispatcher.
    """
    transformer_config = sys.modules.get("megatron.core.transformer.transformer_config")
    if transformer_config is None:
        return
    import torch

    token_dispatcher = sys.modules.get("megatron.core.transformer.moe.token_dispatcher")
    dispatcher_type = getattr(token_dispatcher, "MoETokenDispatcher", ())
    for obj in gc.get_objects():
        if isinstance(obj, transformer_config.TransformerConfig):
            for name in _CONFIG_CALLBACKS:
                if getattr(obj, name, None) is not None:
                    object.__setattr__(obj, name, None)
        elif isinstance(obj, dispatcher_type):
            for name, value in list(vars(obj).items()):
                if torch.is_tensor(value) and value.grad_fn is not None:
                    setattr(obj, name, None)


def gloo_threads() -> int:
    """How many threads of gloo groups this process has (their names: pt_gloo_runloop, gloo_tcp_loop; Linux only)."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return 0
    count = 0
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/comm") as comm:
                count += comm.read().startswith(("pt_gloo", "gloo"))
        except OSError:
            continue
    return count
