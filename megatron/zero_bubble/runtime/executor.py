"""Run this rank's part of a schedule inside Megatron's training loop.

`PipelineExecutor` is called exactly like megatron-core's `forward_backward_pipelining_*` functions. It
never decides order: it walks the lowered program of its pipeline rank (compute passes with the sends and
receives between them) and runs F with Megatron's own `forward_step`, B with the weight-gradient part
deferred into the chunk's WeightGradStore, W by running that store's oldest microbatch, and BW as
Megatron's ordinary backward. With optimizer post-validation, the S pass after the rank's last pass adds
its gradient statistics to the partial sums of the step, and the V pass validates the previous step and,
when that step had to be redone, replays this rank's passes from the start (see post_validation.py); the
executor reaches the controller through the `StepValidation` interface only.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch

from ..schedules.comm import Recv, Send, check_lowering, consumed, lower, produced
from ..schedules.costs import Costs
from ..schedules.ops import Kind, Op
from ..schedules.post_validation import check_rollback, rollback_programs
from ..schedules.schedule import Pass, Schedule, ScheduleError
from .p2p import PipelineTransport, current_device
from .replay import Rewind
from .wgrad_store import WeightGradStore


class StepValidation(Protocol):
    """What the executor needs of optimizer post-validation (post_validation.PostValidation)."""

    size: int  # elements of the summaries that the S and V passes send
    has_pending: bool  # a speculative step waits for its validation

    def statistics(self, partial: torch.Tensor | None, final: bool) -> torch.Tensor:
        """S: this rank's gradient statistics added to the partial sums (None: first of the chain)."""

    def receive_result(self, result: torch.Tensor | None) -> tuple[torch.Tensor, bool]:
        """V: the full sums (None: this rank holds them) -> (the sums to pass on, replay?)."""

    def settle(self) -> bool:
        """Apply the verdict of the last V (once the sums went on); False (a no-op) when there is none."""

    def flush(self) -> None:
        """Validate a pending step outside an iteration (every rank at the same point)."""


@dataclass
class IterationStats:
    """What one iteration held, to check the planner's memory model against reality."""

    peak_activations: int = 0  # (microbatch, chunk) pairs whose F ran and whose B has not
    peak_in_flight: int = 0  # pairs whose F ran and whose W (or BW) has not
    peak_wgrad_bytes: int = 0  # bytes kept for deferred W (inputs and output gradients of linear layers)


def forward_only_schedule(schedule: Schedule) -> Schedule:
    """The same schedule with only its F passes (evaluation; no V: a pending step is validated before)."""
    ranks = [[p for p in passes if p.op == Op.F] for passes in schedule.ranks]
    return Schedule(schedule.stages, schedule.chunks, schedule.microbatches, schedule.layout, ranks, schedule.name)


def pipeline_tensor_shape(config, pg_collection, seq_length: int, micro_batch_size: int,
                          decoder_seq_length: int | None = None) -> tuple[int, ...]:
    """The shape of the activations and gradients that travel between stages, as megatron's schedules make it."""
    from megatron.core.pipeline_parallel import schedules as mcore

    return tuple(mcore.get_tensor_shapes(
        seq_length=seq_length, micro_batch_size=micro_batch_size, decoder_seq_length=decoder_seq_length,
        config=config, tp_group=pg_collection.tp, cp_group=pg_collection.cp,
    )[0])


class ChunkGradSync:
    """Megatron's no_sync around each chunk's backward passes but its last one, as megatron's schedules do:
    until then megatron DDP counts no parameter as ready; in the last one the hooks (and the stores'
    grad_ready for deferred weights) register each parameter, and a bucket's reduction starts once all of
    its parameters are in (overlap_grad_reduce). Entered lazily, before a backward pass: post-validation
    may zero the gradient buffers in the V pass, which resets DDP's flag. Megatron keeps one no_sync
    function per chunk when there are several."""

    def __init__(self, no_sync_func, num_chunks: int):
        funcs = list(no_sync_func) if isinstance(no_sync_func, (list, tuple)) else [no_sync_func]
        self._per_chunk = len(funcs) == num_chunks
        self._funcs = funcs
        self._open: dict[int, object] = {}  # index into funcs -> its entered context

    def before_backward(self, chunk: int, last: bool) -> None:
        index = chunk if self._per_chunk else 0
        if last:
            self._leave(index)
        elif index not in self._open and self._funcs[index] is not None:
            self._open[index] = self._funcs[index]()
            self._open[index].__enter__()

    def release_all(self) -> None:
        for index in list(self._open):
            self._leave(index)

    def _leave(self, index: int) -> None:
        context = self._open.pop(index, None)
        if context is not None:
            context.__exit__(None, None, None)


def _per_chunk(funcs, num_chunks: int) -> list:
    if funcs is None:
        return []
    return list(funcs) if isinstance(funcs, (list, tuple)) else [funcs] * num_chunks


class PipelineExecutor:
    """A drop-in for megatron-core's forward_backward_pipelining_* that interprets a Schedule.

    plan_for(num_microbatches) returns the Schedule to run (the same object while the plan is unchanged,
    so its lowering is computed once). pass_timer, when set, is called with (op, chunk, mb, seconds) for
    every pass; timing synchronises the device, so enable it only for profiling windows. post_validation,
    when set, is the StepValidation whose optimizer step the schedules' S and V passes serve.
    split_backward_ready, when given, answers whether megatron's linear layers can defer their W into the
    stores (the integration layer's patch is in force); split schedules are refused while it says no.
    """

    def __init__(self, plan_for: Callable[[int], Schedule], pass_timer: Callable | None = None,
                 post_validation: StepValidation | None = None,
                 split_backward_ready: Callable[[], bool] | None = None):
        self.plan_for = plan_for
        self.pass_timer = pass_timer
        self.post_validation = post_validation
        self.split_backward_ready = split_backward_ready
        # megatron's private functions (patches/megatron_private.py), handed in by the patch that installs
        # this executor into megatron, so that the runtime never imports the patch layer
        self.megatron_internals = None
        self.stores: list[WeightGradStore] = []
        self._attached_to: list[int] = []
        self._lowered: dict[tuple[int, bool], tuple[Schedule, list]] = {}
        self.last_stats = IterationStats()

    # -- set-up checks and caches --------------------------------------------------------------------
    def _stores_for(self, chunks: list[torch.nn.Module]) -> list[WeightGradStore]:
        if self._attached_to != [id(c) for c in chunks]:
            self.release()
            self.stores = [WeightGradStore(name=f"chunk {k}") for k in range(len(chunks))]
            for store, chunk in zip(self.stores, chunks):
                store.attach(chunk)
            self._attached_to = [id(c) for c in chunks]
        return self.stores

    def _prepare_stores(self, chunks: list) -> None:
        """With megatron DDP's overlapped reduction, the stores report deferred weights through DDP's own hook."""
        for store, chunk in zip(self.stores, chunks):
            overlap = getattr(getattr(chunk, "ddp_config", None), "overlap_grad_reduce", False)
            store.grad_ready = self.internals().grad_ready_hook(chunk) if overlap else None

    def internals(self):
        if self.megatron_internals is None:
            raise RuntimeError("the executor runs inside megatron only once schedule_selection.install(executor) "
                               "(or a ZeroBubbleSession) put it there")
        return self.megatron_internals

    def release(self) -> None:
        """Detach the weight-gradient stores from the model (e.g. before another executor takes it over)."""
        for store in self.stores:
            store.detach()
        self.stores, self._attached_to = [], []

    def _program(self, schedule: Schedule, rank: int, forward_only: bool) -> tuple[Schedule, list, object]:
        """This rank's lowered program (and its rollback variant), computed and checked once per schedule."""
        key = (schedule.microbatches, forward_only)
        cached = self._lowered.get(key)
        if cached is None or cached[0] is not schedule:
            run = forward_only_schedule(schedule) if forward_only else schedule
            # Order messages by the schedule's own costs when it carries them (the plan was checked on those).
            costs = Costs.from_dict(schedule.info["costs"]) if "costs" in schedule.info else None
            programs = lower(run, costs)
            check_lowering(run, programs)  # what runs is exactly what was checked
            rollbacks = None
            if run.has_post_validation():
                check_rollback(run, programs)
                rollbacks = rollback_programs(run, programs)
            cached = self._lowered[key] = (schedule, (run, programs, rollbacks))
        run, programs, rollbacks = cached[1]
        return run, programs[rank], rollbacks[rank] if rollbacks else None

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

    def check_runtime_support(self, schedule: Schedule, chunks: list) -> None:
        """Refuse, before any pass, what this runtime cannot run correctly or usefully."""
        if not schedule.uses_split_backward():
            return
        if self.split_backward_ready is not None and not self.split_backward_ready():
            # Without the patch B would compute the whole gradient and W nothing: correct, silently slow.
            raise ScheduleError(
                f"the schedule '{schedule.name}' splits the backward, but the B/W split of the linear layers "
                f"is not installed (megatron.zero_bubble.patches.linear_wgrad.install())"
            )

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
    ):
        from megatron.core.pipeline_parallel import schedules as mcore
        from megatron.core.utils import get_model_config

        chunks = model if isinstance(model, list) else [model]
        iterators = data_iterator if isinstance(data_iterator, list) else [data_iterator]
        if len(iterators) != len(chunks):
            raise ValueError(f"expected one data iterator per model chunk ({len(chunks)}), got {len(iterators)}")
        config = get_model_config(chunks[0])
        if adjust_tensor_shapes_fn is not None or config.variable_seq_lengths:
            raise ValueError("the zero-bubble runtime needs fixed pipeline tensor shapes (no variable_seq_lengths)")
        if pg_collection is None:
            pg_collection = self.internals().default_pg_collection()
        pp_group = p2p_communicator.pp_group if p2p_communicator is not None else pg_collection.pp
        schedule = self.plan_for(num_microbatches)
        self.check_run_matches(schedule, pp_group.size(), len(chunks), num_microbatches)
        self.check_runtime_support(schedule, chunks)
        self.check_post_validation(schedule, forward_only)
        if forward_only and self.post_validation is not None and self.post_validation.has_pending:
            self.post_validation.flush()  # evaluation must see validated weights
        rank = pp_group.rank()
        run, program, rollback = self._program(schedule, rank, forward_only)
        rewind = None
        if rollback is not None and self.post_validation.has_pending:  # the V pass may ask for a replay
            rewind = Rewind(iterators, self.internals().forward_accumulators(chunks))
            iterators = rewind.iterators
        shape = pipeline_tensor_shape(config, pg_collection, seq_length, micro_batch_size, decoder_seq_length)
        device = current_device()
        iteration = _Iteration(
            executor=self, mcore=mcore, schedule=run, rank=rank, chunks=chunks, iterators=iterators,
            config=config, forward_step_func=forward_step_func, num_microbatches=num_microbatches,
            cp_size=pg_collection.cp.size(), forward_only=forward_only,
            collect_non_loss_data=collect_non_loss_data, first_val_step=first_val_step,
            transport=PipelineTransport(pp_group, shape, config.pipeline_dtype, device,
                                        validation_numel=self.post_validation.size if self.post_validation else 0),
            device=device, stores=self._stores_for(chunks), rollback=rollback, rewind=rewind,
            pg_collection=pg_collection, force_all_reduce=force_all_reduce,
        )
        if config.timers is not None:
            config.timers("forward-backward", log_level=1).start(barrier=config.barrier_with_L1_time)
        if not forward_only:
            iteration.grad_sync = ChunkGradSync(config.no_sync_func, len(chunks))
            self._prepare_stores(chunks)
            for k, param_sync in enumerate(_per_chunk(config.param_sync_func, len(chunks))):
                param_sync(chunks[k].parameters())  # overlapped parameter gathers, as megatron's schedules start them
        iteration.run(program)
        iteration.finish_backward()
        if config.timers is not None:
            config.timers("forward-backward").stop()
        self.last_stats = iteration.stats
        return iteration.forward_data_store


@dataclass
class _Iteration:
    """The state of one forward-backward call: tensors in flight between passes of this rank."""

    executor: PipelineExecutor
    mcore: object  # megatron.core.pipeline_parallel.schedules, whose forward_step/backward_step we call
    schedule: Schedule
    rank: int
    chunks: list
    iterators: list
    config: object
    forward_step_func: Callable
    num_microbatches: int
    cp_size: int
    forward_only: bool
    collect_non_loss_data: bool
    first_val_step: bool | None
    transport: PipelineTransport
    device: torch.device
    stores: list[WeightGradStore]
    rollback: object = None  # this rank's RollbackProgram when the schedule has a V pass
    rewind: Rewind | None = None  # set when a step is pending, so the passes before V can be replayed
    pg_collection: object = None
    force_all_reduce: bool | None = False
    grad_sync: ChunkGradSync | None = None  # megatron's no_sync per chunk (training only)
    backward_finished: bool = False
    forward_data_store: list = field(default_factory=list)
    saved: dict = field(default_factory=dict)  # (mb, chunk) -> (input, output) kept for B
    outgoing: dict = field(default_factory=dict)  # Message -> (tensor, on_done) for the next Send
    handoff: dict = field(default_factory=dict)  # tensors crossing between two chunks of this rank (a V's turn)
    received: dict = field(default_factory=dict)  # Message -> tensor, waited for before its pass (_await_inputs)
    started_chunks: set = field(default_factory=set)
    in_flight: int = 0
    stats: IterationStats = field(default_factory=IterationStats)

    def __post_init__(self):
        self.last_vstage = self.schedule.num_virtual_stages - 1
        # each chunk's last backward pass: megatron's gradient sync for the chunk starts right before it
        self.last_backward = {p.chunk: p for p in self.schedule.ranks[self.rank] if p.op in (Op.B, Op.BW)}
        self.total_num_tokens = torch.zeros([], dtype=torch.int, device=self.device)

    def run(self, program: list) -> None:
        settle = self.settle
        for item in program:
            if isinstance(item, Recv):
                self.transport.post_recv(item.msg)
            elif isinstance(item, Send):
                tensor, on_done = self.outgoing.pop(item.msg)
                self.transport.post_send(item.msg, tensor, on_done)
                settle()  # right after V's result went on (a no-op after other sends)
            elif item.op == Op.V:
                if self.validate_step(item):
                    self.replay()
                    return
            elif item.op == Op.S:
                self.step_statistics(item)
            else:
                settle()  # no pass may run on weights that are not validated yet
                self.transport.reap_sends()
                self._await_inputs(item)
                start = self._clock()
                {Op.F: self.forward, Op.B: self.backward, Op.BW: self.backward, Op.W: self.weight}[item.op](item)
                if self.executor.pass_timer is not None:
                    self.executor.pass_timer(item.op, item.chunk, item.mb, self._clock() - start)
                self._account()
        settle()
        self.transport.finish()
        for store in self.stores:
            if store.pending_count:
                raise ScheduleError(f"{store.name}: W passes missing for microbatches {store.pending_microbatches}")

    def finish_backward(self) -> None:
        """Reduce the gradients, as megatron does after its last backward (once: before S, whose statistics
        need the reduced gradients, or at the end). finalize_model_grads starts what has not started and
        waits for every bucket. Megatron's grad_sync_func (--align-grad-reduce) is not called: it would start
        again the buckets that started as they became ready."""
        if self.forward_only or self.backward_finished:
            return
        self.backward_finished = True
        self.grad_sync.release_all()
        if self.config.finalize_model_grads_func is not None:
            self.config.finalize_model_grads_func(
                self.chunks,
                self.total_num_tokens if self.config.calculate_per_token_loss else None,
                pg_collection=self.pg_collection,
                force_all_reduce=self.force_all_reduce,
            )

    # -- the post-validation passes (post_validation.py) -----------------------------------------------
    def _summary_link(self, p: Pass) -> tuple[torch.Tensor | None, object]:
        """What a once-per-rank pass receives (None: it is first of its chain) and the message it sends on
        (None: it is last)."""
        need = consumed(self.schedule, self.rank, p)
        incoming = self.transport.wait_recv(need) if need is not None else None
        return incoming, produced(self.schedule, self.rank, p)

    def step_statistics(self, p: Pass) -> None:
        """S: after the gradients are reduced, add this rank's statistics to the step's partial sums."""
        self.finish_backward()
        partial, out = self._summary_link(p)
        sums = self.executor.post_validation.statistics(partial, final=out is None)
        if out is not None:
            self.outgoing[out] = (sums, None)

    def validate_step(self, p: Pass) -> bool:
        """V: receive the previous step's full sums and pass them on; True when this iteration must replay what
        it ran so far. The verdict is settled after the sums went on (or at once when this rank is last)."""
        result, out = self._summary_link(p)
        controller = self.executor.post_validation
        summary, replay = controller.receive_result(result)
        if out is not None:
            self.outgoing[out] = (summary, None)
        else:
            self.settle()
        return replay

    def settle(self) -> None:
        """Apply a verdict that waits. It may move the loss scale, which the forward passes before V already
        handed to megatron's auxiliary losses (MoE) for the backward passes that follow: hand them the new one."""
        controller = self.executor.post_validation
        if controller is not None and controller.settle():
            self.executor.internals().reset_forward_loss_scales(self.config, self.num_microbatches, self.cp_size)

    def replay(self) -> None:
        """The step was redone, so what ran before V used wrong weights: drain the stale messages, start over."""
        if self.rewind is None:
            raise ScheduleError("post-validation asked for a replay, but no step was pending when the iteration began")
        settle = self.settle
        for item in self.rollback.after_validation:
            if isinstance(item, Send):
                tensor, on_done = self.outgoing.pop(item.msg)
                self.transport.post_send(item.msg, tensor, on_done)
                settle()
            else:  # a message its sender computed before its own V: received and dropped
                self.transport.post_recv(item.msg)
                self.transport.wait_recv(item.msg)
        settle()
        self.transport.reap_sends(block=True)
        for held in (self.outgoing, self.saved, self.handoff, self.received, self.forward_data_store,
                     self.started_chunks):
            held.clear()
        self.total_num_tokens.zero_()
        self.in_flight = 0
        self.rewind.rewind()
        timer, self.executor.pass_timer = self.executor.pass_timer, None  # replays would skew measured costs
        try:
            self.run(self.rollback.restart)
        finally:
            self.executor.pass_timer = timer

    def _clock(self) -> float:
        if self.executor.pass_timer is not None and self.device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter()

    def _account(self) -> None:
        s = self.stats
        s.peak_activations = max(s.peak_activations, len(self.saved))
        s.peak_in_flight = max(s.peak_in_flight, self.in_flight)
        s.peak_wgrad_bytes = max(s.peak_wgrad_bytes, sum(st.pending_bytes for st in self.stores))

    def _await_inputs(self, p: Pass) -> None:
        """Wait, before the pass's clock starts (measured costs are its compute alone), for the message it
        consumes and, for a backward, for the send of its forward's output (freed before megatron's backward)."""
        need = consumed(self.schedule, self.rank, p)
        if need is not None:
            self.received[need] = self.transport.wait_recv(need)
        if p.op in (Op.B, Op.BW):
            sent = produced(self.schedule, self.rank, Pass(Op.F, p.mb, p.chunk))
            if sent is not None:
                self.transport.complete_send(sent)

    def _incoming(self, p: Pass, kind: str, vstage: int):
        need = consumed(self.schedule, self.rank, p)
        return self.received.pop(need) if need is not None else self.handoff.pop((kind, p.mb, vstage))

    def _outgoing(self, p: Pass, kind: str, tensor, to_vstage: int, on_done=None) -> None:
        msg = produced(self.schedule, self.rank, p)
        if msg is not None:
            self.outgoing[msg] = (tensor, on_done)
        else:  # the next stage is on this rank: hand over a fresh leaf, as a receive would
            self.handoff[(kind, p.mb, to_vstage)] = tensor.detach().requires_grad_()
            if on_done is not None:
                on_done()

    def forward(self, p: Pass) -> None:
        vs = self.schedule.virtual_stage(self.rank, p.chunk)
        input_tensor = None if vs == 0 else self._incoming(p, Kind.ACT, vs)
        output, num_tokens = self.mcore.forward_step(
            self.forward_step_func, self.iterators[p.chunk], self.chunks[p.chunk], self.num_microbatches,
            input_tensor, self.forward_data_store, self.config, cp_group_size=self.cp_size,
            collect_non_loss_data=self.collect_non_loss_data,
            is_first_microbatch=self.mcore.check_first_val_step(
                self.first_val_step, self.forward_only, p.chunk not in self.started_chunks
            ),
            current_microbatch=p.mb,
            vp_stage=p.chunk if len(self.chunks) > 1 else None,
            is_last_stage=vs == self.last_vstage,
        )
        self.started_chunks.add(p.chunk)
        self.total_num_tokens += num_tokens
        free = None
        if not self.forward_only:
            self.saved[(p.mb, p.chunk)] = (input_tensor, output)
            self.in_flight += 1
            free = lambda: self.mcore.deallocate_output_tensor(output, self.config.deallocate_pipeline_outputs)
        if vs < self.last_vstage:
            self._outgoing(p, Kind.ACT, output, vs + 1, on_done=free)
        elif free is not None:
            free()

    def backward(self, p: Pass) -> None:
        vs = self.schedule.virtual_stage(self.rank, p.chunk)
        input_tensor, output = self.saved.pop((p.mb, p.chunk))
        output_grad = None if vs == self.last_vstage else self._incoming(p, Kind.GRAD, vs)
        store = self.stores[p.chunk]
        last = p == self.last_backward[p.chunk]
        self.grad_sync.before_backward(p.chunk, last)
        if p.op == Op.B:
            with store.split_backward():
                input_grad = self.mcore.backward_step(input_tensor, output, output_grad, self.config)
            store.close_microbatch(p.mb, last=last)
        else:
            with store.fused_backward(last):
                input_grad = self.mcore.backward_step(input_tensor, output, output_grad, self.config)
            self.in_flight -= 1
        if vs > 0:
            self._outgoing(p, Kind.GRAD, input_grad, vs - 1)

    def weight(self, p: Pass) -> None:
        self.stores[p.chunk].run_next(p.mb)
        self.in_flight -= 1
