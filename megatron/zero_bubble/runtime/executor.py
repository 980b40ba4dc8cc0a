"""Run this rank's part of a schedule inside Megatron's training loop.

`PipelineExecutor` is called exactly like megatron-core's `forward_backward_pipelining_*` functions. It
never decides order: it checks that the schedule fits the run, lowers it once (iteration.LoweredRun), and
runs this rank's program as an `Iteration` whose compute passes are megatron's own (megatron_passes.py): F
with megatron's forward_step, B with the weight-gradient part deferred into the chunk's WeightGradStore, W
by running that store's oldest microbatch, BW as megatron's ordinary backward. It reaches megatron only
through the adapter it is built with (patches/megatron_adapter.py) and optimizer post-validation only
through `StepValidation`.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from ..schedules.schedule import Schedule, ScheduleError
from .iteration import Iteration, IterationStats, LoweredRun, PassObserver, StepValidation
from .megatron_passes import MegatronPasses, MegatronRun
from .memory_probe import MemoryProbe
from .messaging import Messaging, MessagingOptions
from .p2p import current_device
from .replay import Rewind
from .split_check import ChunkRun, SplitCheck, fixed_input, keep_attributes
from .wgrad_store import WeightGradStore

__all__ = ["IterationStats", "PipelineExecutor", "StepValidation"]


def _per_chunk(funcs, num_chunks: int) -> list:
    if funcs is None:
        return []
    return list(funcs) if isinstance(funcs, (list, tuple)) else [funcs] * num_chunks


class PipelineExecutor:
    """A drop-in for megatron-core's forward_backward_pipelining_* that interprets a Schedule.

    plan_for(num_microbatches) returns the Schedule to run (the same object while the plan is unchanged,
    so its lowering is computed once). megatron: the adapter to megatron-core. observer, when set, sees
    every pass of every call with its start and end (iteration.PassObserver; observing synchronises the
    device, so pass one only for profiling); a call may pass its own (`pass_observer=`). post_validation,
    when attached, is the StepValidation whose optimizer step the schedules' S and V passes serve. split_check,
    when given, runs once before the first training call of a split schedule (split_check.py).
    """

    def __init__(self, plan_for: Callable[[int], Schedule], megatron, observer: PassObserver | None = None,
                 split_check: SplitCheck | None = None, messaging: MessagingOptions | None = None):
        self.plan_for = plan_for
        self.messaging = Messaging(messaging)  # links, p2p operations, watchdog and faults (messaging.py)
        self.megatron = megatron
        self.observer = observer
        self.split_check = split_check
        self.post_validation: StepValidation | None = None
        self.stores: list[WeightGradStore] = []
        self._attached_to: tuple | None = None  # (ids of the chunks, split) the stores were made for
        self._kept_in_b_for: tuple | None = None  # (layer names, ids of the stores) _keep_in_b last applied
        self._lowered: dict[tuple[int, bool], tuple[Schedule, LoweredRun]] = {}
        self.last_stats = IterationStats()
        self.memory_probe: MemoryProbe | None = None  # set: every call reads the allocator (a call may pass its own)

    def attach_post_validation(self, controller: StepValidation | None) -> None:
        self.post_validation = controller
        if controller is not None:  # its flush sends the step's sums along the pipeline's links
            controller.make_transport = lambda *args, **kwargs: self.messaging.transport(controller.pp_group, *args,
                                                                                          **kwargs)

    # -- set-up checks and caches --------------------------------------------------------------------
    def _stores_for(self, chunks: list[torch.nn.Module], split: bool) -> list[WeightGradStore]:
        """One store per chunk; under a split schedule the chunk's linear layers hand their W to it."""
        key = ([id(c) for c in chunks], split)
        if self._attached_to != key:
            self.release()
            self.stores = [WeightGradStore(name=f"chunk {k}") for k in range(len(chunks))]
            for store, chunk in zip(self.stores, chunks):
                if split:
                    store.attach(chunk, self.megatron)
            self._attached_to = key
        return self.stores

    def _keep_in_b(self, schedule: Schedule, chunks: list, stores: list[WeightGradStore]) -> None:
        """The layers whose W the schedule keeps inside B (info["wgrad_in_b"]), where the chunk's store holds them (a
        layer the split leaves alone runs its W in B anyway); looked up in the model only when the names or the stores
        change, not every call."""
        if not schedule.uses_split_backward():
            return
        names = schedule.info.get("wgrad_in_b", ())
        key = (tuple(names), tuple(id(store) for store in stores))  # new stores come after release(), which resets it
        if key == self._kept_in_b_for:
            return
        self._kept_in_b_for = key
        for store, chunk in zip(stores, chunks):
            held = {id(weight) for weight in store.weights}
            store.keep_in_b([w for w in self.megatron.named_layer_weights(chunk, names) if id(w) in held])

    def _prepare_stores(self, chunks: list) -> None:
        """With megatron DDP's overlapped reduction, the stores report deferred weights through DDP's own hook."""
        for store, chunk in zip(self.stores, chunks):
            overlap = getattr(getattr(chunk, "ddp_config", None), "overlap_grad_reduce", False)
            store.grad_ready = self.megatron.grad_ready_hook(chunk) if overlap else None

    def release(self) -> None:
        """Give the layers back their own backward (e.g. before another executor takes the model over)."""
        for store in self.stores:
            store.detach()
        self.stores, self._attached_to, self._kept_in_b_for = [], None, None

    def close(self) -> None:
        """release(), and the operations and watchdog of the messages (at the end of the run)."""
        self.release()
        self.messaging.close()

    def prepare(self, schedule: Schedule) -> None:
        """Lower `schedule` for training and check it (ScheduleError if its lowering or a proof fails), ahead of
        the iteration that runs it."""
        self._lowered_run(schedule, forward_only=False)

    def _lowered_run(self, schedule: Schedule, forward_only: bool) -> LoweredRun:
        """The lowering of `schedule`, computed and checked once per schedule."""
        key = (schedule.microbatches, forward_only)
        cached = self._lowered.get(key)
        if cached is None or cached[0] is not schedule:
            cached = self._lowered[key] = (schedule, LoweredRun.of(schedule, forward_only))
        return cached[1]

    @staticmethod
    def check_run_matches(schedule: Schedule, pp_size: int, num_chunks: int, num_microbatches: int) -> None:
        if schedule.stages != pp_size:
            raise ScheduleError(
                f"the schedule '{schedule.name}' is for {schedule.stages} pipeline stages but the run has "
                f"--pipeline-model-parallel-size {pp_size}"
            )
        if schedule.microbatches != num_microbatches:
            raise ScheduleError(
                f"the schedule '{schedule.name}' is for {schedule.microbatches} microbatches but the run has "
                f"{num_microbatches} (global batch / (micro batch x data parallel))"
            )
        if schedule.chunks != num_chunks:
            raise ScheduleError(
                f"the schedule '{schedule.name}' places {schedule.chunks} model chunk(s) per rank but the model "
                f"has {num_chunks}"
            )

    def check_post_validation(self, schedule: Schedule, forward_only: bool) -> None:
        if forward_only:
            return
        if self.post_validation is not None and not schedule.has_post_validation():
            raise ScheduleError(
                f"optimizer post-validation is on, but the schedule '{schedule.name}' has no S and V passes "
                f"(plan it with post_validation=True)"
            )
        if self.post_validation is None and schedule.has_post_validation():
            raise ScheduleError(
                f"the schedule '{schedule.name}' has S and V passes but optimizer post-validation is off")

    def _check_split(self, check: SplitCheck, schedule: Schedule, rank: int, stores: list, run: MegatronRun, shape,
                     device) -> list:
        """The split check (split_check.py) on this rank's chunks; returns the data iterators for the iteration (the
        check's, rewound: the iteration reads the same microbatches)."""
        chunks, config = run.chunks, run.config
        rewind = Rewind(run.iterators, self.megatron, self.megatron.forward_accumulators(chunks))
        run.iterators = rewind.iterators
        last = schedule.num_virtual_stages - 1
        runs = []
        for k in range(len(chunks)):
            vs = schedule.virtual_stage(rank, k)
            runs.append(ChunkRun(k, vs, vs == last,
                                 None if vs == 0 else fixed_input(shape, config.pipeline_dtype, device, k)))
        flags = keep_attributes(chunks, "is_first_microbatch")
        timers = self.megatron.pause_timers(config)

        def restore_extra() -> None:
            flags()
            timers()

        for store in stores:
            store.grad_ready = None  # nothing is reported ready: the check's backward passes run in no_sync
        result = check.run(MegatronPasses(self.megatron, run, device), stores, chunks, runs,
                           lambda chunk: {n: p for n, p in chunk.named_parameters() if p.requires_grad}, rewind,
                           restore_extra)
        check.conclude(result)
        return rewind.iterators

    # -- the megatron-compatible entry ---------------------------------------------------------------
    def __call__(
        self,
        *,
        forward_step_func,
        data_iterator,
        model,
        num_microbatches: int,
        seq_length: int,
        micro_batch_size: int,
        decoder_seq_length: int | None = None,
        forward_only: bool = False,
        collect_non_loss_data: bool = False,
        first_val_step: bool | None = None,
        adjust_tensor_shapes_fn: Callable | None = None,
        p2p_communicator=None,
        pg_collection=None,
        force_all_reduce: bool | None = False,
        pass_observer: PassObserver | None = None,
        memory_probe: MemoryProbe | None = None,
    ):
        memory = memory_probe or self.memory_probe
        if memory is not None:  # the baseline: weights, gradient buffers and optimizer state are in place
            memory.start()
        chunks = model if isinstance(model, list) else [model]
        iterators = data_iterator if isinstance(data_iterator, list) else [data_iterator]
        if len(iterators) != len(chunks):
            raise ValueError(f"expected one data iterator per model chunk ({len(chunks)}), got {len(iterators)}")
        config = self.megatron.model_config(chunks[0])
        if adjust_tensor_shapes_fn is not None or config.variable_seq_lengths or getattr(config, "mtp_standalone", False):
            raise ValueError("the zero-bubble runtime needs fixed pipeline tensor shapes (no variable_seq_lengths, "
                             "no multi-token-prediction layers off the last pipeline stage)")
        if pg_collection is None:
            pg_collection = self.megatron.default_pg_collection()
        pp_group = p2p_communicator.pp_group if p2p_communicator is not None else pg_collection.pp
        schedule = self.plan_for(num_microbatches)
        self.check_run_matches(schedule, pp_group.size(), len(chunks), num_microbatches)
        self.check_post_validation(schedule, forward_only)
        validation = self.post_validation
        if forward_only and validation is not None and validation.has_pending:
            validation.flush()  # evaluation must see validated weights
        rank = pp_group.rank()
        lowered = self._lowered_run(schedule, forward_only)
        shape = self.megatron.pipeline_tensor_shape(config, pg_collection, seq_length, micro_batch_size,
                                                    decoder_seq_length)
        device = current_device()
        stores = self._stores_for(chunks, schedule.uses_split_backward())
        self._keep_in_b(schedule, chunks, stores)
        run = MegatronRun(forward_step_func, iterators, chunks, num_microbatches, config, pg_collection.cp.size(),
                          forward_only, collect_non_loss_data, first_val_step, pg_collection, force_all_reduce)
        check = self.split_check
        if check is not None and not check.done and not forward_only and schedule.uses_split_backward():
            # the check trains on the same arguments, its losses kept apart from the iteration's
            run.iterators = self._check_split(check, schedule, rank, stores, dataclasses.replace(
                run, collect_non_loss_data=False, forward_data_store=[]), shape, device)
        rollback = lowered.rollback(rank)
        rewind = None
        if rollback is not None and validation.has_pending:  # the V pass may ask for a replay
            rewind = Rewind(run.iterators, self.megatron, self.megatron.forward_accumulators(chunks))
            run.iterators = rewind.iterators
        transport = self.messaging.transport(pp_group, shape, config.pipeline_dtype, device,
                                             validation_numel=validation.size if validation else 0,
                                             token_counts=validation is not None and config.calculate_per_token_loss)
        iteration = Iteration(
            schedule=lowered.schedule, rank=rank,
            compute=MegatronPasses(self.megatron, run, device, tokens_divided_later=validation is not None),
            transport=transport, stores=stores, validation=validation, faults=self.messaging.faults,
            rollback=rollback, rewind=rewind, observer=pass_observer or self.observer, memory=memory,
        )
        with self.megatron.timed_forward_backward(config):
            if not forward_only:
                self._prepare_stores(chunks)
                for k, param_sync in enumerate(_per_chunk(config.param_sync_func, len(chunks))):
                    param_sync(chunks[k].parameters())  # overlapped parameter gathers, as megatron's schedules do
            # watched until the next call: on NCCL what this one posted may complete after it returns
            self.messaging.watch(transport, lowered.consumers(rank).get)
            iteration.run(lowered.programs[rank])
            iteration.finish_backward()
        if memory is not None:
            iteration.stats.memory = memory.finish()
        self.last_stats = iteration.stats
        return run.forward_data_store
