"""Post-update validation of the optimizer step: no cross-stage synchronisation before stepping.

Megatron's step all-reduces the gradient norm and the inf/NaN flag over the model-parallel group, every
pipeline stage included, which keeps the next iteration from starting before the slowest stage ends.
Here (paper, "bypassing optimizer synchronizations") the schedule's S pass, after a rank's last pass,
adds the rank's squared norm (reduced over its tensor-parallel group, as megatron does) to the partial
sums from the rank before it in the statistics chain and passes them on; the rank then steps
speculatively unless the partial sums already show inf/NaN or a needed clip. The last rank of the chain
(schedules/post_validation.py) holds the full sums; they travel back to every rank in the next
iteration's V passes, where the rank rolls a speculative step back (and re-steps with the clip
coefficient) when needed and tells the executor whether the passes that ran before V, on speculative
weights, must be replayed. Both summaries travel as messages of the schedule's lowering.

The executor talks to this controller through four calls (iteration.StepValidation): `statistics` (S),
`receive_result` and `settle` (V), `flush` (a pending step validated outside an iteration). Undoing a step
(a snapshot, or the in-place inverse) is step_undo.py's; megatron is reached through the adapter handed in.

The squared norms travel per rank of megatron's statistics groups (model-parallel ranks; with MoE also
the expert group's; every rank with the distributed optimizer), laid out and added up as megatron reduces
them (step_statistics.py), so the full norm equals megatron's on gloo; with NCCL it may differ by an ulp
(so may clipped steps with the exact rollback).
"""
from __future__ import annotations

import math
from enum import StrEnum
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist

from ..schedules.comm import Batch, Warmup, consumed, lower
from ..schedules.post_validation import validation_only
from . import step_statistics
from .p2p import current_device
from .step_undo import StepUndo

# The summary tensor that travels between stages: squared norms and inf flags (step_statistics.SummaryLayout),
# then these two.
SPECULATIVE, PENDING = range(-step_statistics.STEP_FLAGS, 0)


class StepState(StrEnum):
    """What stage r did in its step (strings, so that reports and logs read as before)."""

    STEPPED = "stepped"  # speculatively, on partial sums that showed nothing wrong
    DEFERRED = "deferred"  # not yet: the partial sums already need a clip, so it waits for the full ones
    SKIPPED = "skipped"  # inf/NaN in the partial sums
    EXACT = "exact"  # the last rank of the statistics chain: its partial sums are the full ones


@dataclass
class _Statistics:
    """What this rank's S pass found, for the step that follows it."""

    summary: torch.Tensor  # the partial sums up to this rank (the full ones on the chain's last rank)
    norm: float  # the grad norm those sums give
    clip: bool  # whether they already call for clipping
    state: "StepState"
    final: bool  # this rank holds the full sums


@dataclass
class _Pending:
    """What stage r did in its step, kept until the full sums arrive."""

    state: StepState
    final: bool  # this rank held the full sums: its step was exact, and it logged the verdict at once
    hyperparameters: list  # per leaf optimizer: [(lr, weight_decay)] per param group at step time
    undo: list  # per leaf optimizer: what StepUndo.keep kept, "stepped" only
    scheduler_steps: int | None  # the LR scheduler's num_steps before train_step advanced it


@dataclass
class Outcome:
    """The verdict on one step, for logging and tests."""

    grad_norm: float
    state: str  # what this stage did at the step: stepped, deferred, skipped or exact (see _Pending)
    nonfinite: bool
    clipped: bool
    rolled_back: bool  # this stage undid a speculative step
    replay: bool  # every stage replays the passes it ran before V


@dataclass
class PostValidation:
    """Speculative optimizer steps for one pipeline rank, validated one iteration later.

    optimizer: megatron-core's (FP32Optimizer, Float16OptimizerWithFloat16Params, DistributedOptimizer or
    a ChainedOptimizer of those); megatron: the adapter to megatron-core; pp_group: this rank's pipeline group; stats_group: the group megatron
    reduces gradient statistics over (its model-parallel group; the world with the distributed optimizer);
    stage_group: the part of it in this stage (tensor-parallel ranks; with the distributed optimizer also
    the data-parallel ones); blocks: instead of those two, megatron's reductions one by one where its leaf
    optimizers reduce over different groups (MoE: step_statistics.blocks_for); exact: keep snapshots for
    bit-exact rollback instead of inverting in place; layout and chunks: the schedule's, which fix the order
    in which the result walks the ranks (flush).
    """

    optimizer: object
    megatron: object
    pp_group: object
    stage_group: object = None
    stats_group: object = None  # None: this pipeline group (TP=1, non-distributed optimizer)
    blocks: list | None = None  # step_statistics.Block per reduction; None: one, over stats_group
    # --calculate-per-token-loss: the chunks whose gradients the S pass divides by the global token count, and
    # the data-parallel group that count is summed over (megatron's finalize_model_grads does it otherwise, after
    # a broadcast from the last stage that would hold every stage until the last one's backward ends)
    model_chunks: list | None = None
    data_parallel_group: object = None
    exact: bool = False
    scheduler: object = None
    layout: str = "single"
    chunks: int = 1
    zero_grad_owed: list = field(default_factory=list)  # deferred zero_grad calls, run after validation
    # (shape, dtype, device, **options) -> a PipelineTransport on the pipeline's links (the executor sets it)
    make_transport: Callable | None = None
    pending: _Pending | None = None
    final: torch.Tensor | None = None  # the full sums, on the chain's last rank, until sent in the next V
    last_outcome: Outcome | None = None
    rollbacks: int = 0  # speculative steps this stage undid
    rolled_back_steps: int = 0  # steps that some stage undoes (the full sums' holder knows at once, others at V)
    _statistics: _Statistics | None = None  # from this iteration's S pass, for the step
    _unsettled: torch.Tensor | None = None  # the full sums received in V, applied once they went on

    @classmethod
    def for_optimizer(cls, optimizer, megatron, **kwargs) -> "PostValidation":
        """With the groups megatron's parallel state gives this optimizer: its leaves' statistics groups, and the
        part of each in this stage (tensor-parallel; expert tensor- and expert-parallel for the expert leaf; also
        data-parallel where the distributed optimizer shards state)."""
        leaves = megatron.leaf_optimizers(optimizer)
        groups = megatron.statistics_groups()
        blocks = step_statistics.blocks_for(leaves, dist.get_process_group_ranks(groups.stage), groups.in_stage)
        return cls(optimizer, megatron, pp_group=groups.pipeline, stage_group=blocks[0].stage_group, blocks=blocks,
                   data_parallel_group=groups.data_parallel, **kwargs)

    def __post_init__(self):
        self.stage, self.stages = self.pp_group.rank(), self.pp_group.size()
        self.leaves = self.megatron.leaf_optimizers(self.optimizer)  # patches/megatron_optimizer.LeafOptimizer
        if self.blocks is None:
            self.blocks = [step_statistics.Block.of(self.stats_group or self.pp_group, range(len(self.leaves)),
                                                    self.stage_group)]
        self.stats = step_statistics.SummaryLayout(self.blocks, len(self.leaves))
        self.size = self.stats.size
        self.device = current_device()
        self.clip_grad = max(leaf.clip_grad for leaf in self.leaves)
        self.undo = StepUndo(self.leaves, self.megatron, self.exact, self.scheduler)

    # -- the S pass and the step (replaces optimizer.step()) ----------------------------------------
    @torch.no_grad()
    def statistics(self, partial: torch.Tensor | None, final: bool, tokens: torch.Tensor | None = None) -> torch.Tensor:
        """S: add this rank's gradient statistics to the partial sums (None on the chain's first rank) and
        decide this rank's step; returns the sums to pass on (the full sums when `final`). tokens: the loss
        stage's token count on the device, which came with the gradients (per-token loss; p2p.PipelineTransport)."""
        if self.pending is not None:
            raise RuntimeError("optimizer post-validation: a step ran before the previous one was validated")
        if self.model_chunks is not None:
            self._divide_by_tokens(tokens)
        found_inf = self._prepare_grads()
        summary = torch.zeros(self.size, dtype=torch.float, device=self.device) if partial is None else partial.clone()
        for index, block in enumerate(self.blocks):
            local = torch.stack([self._squared_norm(block), *(found_inf[leaf] for leaf in block.leaves)])
            ranks, gathered = block.stage_ranks, [local]
            if len(ranks) > 1:  # every rank's own value, so that the sum can follow megatron's order
                gathered = [torch.empty_like(local) for _ in ranks]
                dist.all_gather(gathered, local, group=block.stage_group)
            for rank, value in zip(ranks, gathered):
                self.stats.add_stage(summary, index, rank, value[0], value[1:])
        norm = self.stats.norm(summary)
        clip = self._needs_clip(norm)
        state = (StepState.SKIPPED if self.stats.nonfinite(summary) else StepState.EXACT if final
                 else StepState.DEFERRED if clip else StepState.STEPPED)
        summary[SPECULATIVE] += float(state == StepState.STEPPED)
        self._statistics = _Statistics(summary, norm, clip, state, final)
        return summary

    @torch.no_grad()
    def step(self):
        """Megatron's (success, grad_norm, num_zeros); grad_norm is known (and returned) on the rank holding
        the full sums only. Steps as this iteration's S pass decided."""
        found, self._statistics = self._statistics, None
        if found is None:
            raise RuntimeError("optimizer post-validation: the step came without the schedule's statistics pass "
                               "(S); plan the schedule with post_validation=True")
        state, clip, norm = found.state, found.clip, found.norm
        pending = _Pending(state, found.final, self.undo.hyperparameters(), [], getattr(self.scheduler, "num_steps", None))
        if state == StepState.STEPPED:
            pending.undo = self.undo.keep()
        if state in (StepState.STEPPED, StepState.EXACT):
            if clip:
                self._clip(norm)
            self._step_leaves()
        self.pending = pending
        skipped = state == StepState.SKIPPED
        if found.final:
            summary = found.summary
            summary[PENDING] = 1
            self.final = summary
            self._update_loss_scale(summary)
            self.last_outcome = Outcome(norm, state, skipped, clip and not skipped, False, False)
            if (clip or skipped) and summary[SPECULATIVE] > 0:
                self.rolled_back_steps += 1
        reported_norm = norm if found.final and self.clip_grad > 0 else None
        return not skipped, (None if skipped else reported_norm), None

    # -- the validation (the V pass) -----------------------------------------------------------------
    def own_summary(self) -> torch.Tensor:
        """What the head of the validation chain sends in its V pass: the full sums of the pending step, or
        'nothing pending'."""
        if self.final is None:
            return torch.zeros(self.size, dtype=torch.float, device=self.device)
        final, self.final = self.final, None
        return final

    def receive_result(self, result: torch.Tensor | None) -> tuple[torch.Tensor, bool]:
        """V: the full sums from the rank before this one in the validation chain (None: this rank is its
        head and holds them). Returns them, to be passed on, and whether every rank must replay what it ran
        before V. The verdict is applied by `settle`, once the sums went on, so that the ranks after this
        one do not wait for this rank's optimizer work."""
        summary = self.own_summary() if result is None else result
        self._unsettled = summary
        return summary, self.needs_replay(summary)

    def settle(self) -> bool:
        """Apply the verdict V received; False (a no-op) when there is none waiting."""
        if self._unsettled is None:
            return False
        summary, self._unsettled = self._unsettled, None
        self.validate(summary)
        return True

    def needs_replay(self, summary: torch.Tensor) -> bool:
        """Whether every rank must replay what it ran before V (decided alike everywhere from the full sums)."""
        if summary[PENDING] == 0:
            return False
        nonfinite = self.stats.nonfinite(summary)
        return (not nonfinite and self._needs_clip(self.stats.norm(summary))) or (
            nonfinite and bool(summary[SPECULATIVE] > 0))

    @torch.no_grad()
    def validate(self, summary: torch.Tensor) -> bool:
        """Apply the verdict of the full sums to this stage's pending step; True when passes must be replayed."""
        if summary[PENDING] == 0:
            if self.pending is not None:
                raise RuntimeError("optimizer post-validation: stages disagree on whether a step is pending")
            self._run_owed_zero_grad()
            return False
        pending, self.pending = self.pending, None
        if pending is None:
            raise RuntimeError("optimizer post-validation: a validation arrived for no pending step")
        nonfinite = self.stats.nonfinite(summary)
        norm = self.stats.norm(summary)
        clip = not nonfinite and self._needs_clip(norm)
        undo = pending.state == StepState.STEPPED and (nonfinite or clip)
        waiting = pending.state in (StepState.STEPPED, StepState.DEFERRED)
        step = waiting and not nonfinite and (clip or pending.state == StepState.DEFERRED)
        gathers = self._overlapped_gathers() if undo or step else []
        for chunk in gathers:  # what a forward pre-hook started gathers the speculative step's values: let it end
            chunk.start_param_sync(force_sync=True)
        if undo:
            self.undo.restore(pending.undo, pending.hyperparameters, gather=not gathers)
            self.rollbacks += 1
        if step:
            if clip:
                self._clip(norm)
            with self.undo.hyperparameters_of(pending.hyperparameters):
                self._step_leaves()
        for chunk in gathers:  # now every rank of the stage holds the validated parameters
            chunk.start_param_sync(force_sync=True)
        rolled_back = undo
        if nonfinite and pending.state in (StepState.STEPPED, StepState.DEFERRED):
            self.undo.scheduler_increment(pending.scheduler_steps)
        replay = self.needs_replay(summary)
        if not pending.final:  # the holder of the full sums did this at its step
            self._update_loss_scale(summary)
            self.last_outcome = Outcome(norm, pending.state, nonfinite, clip, rolled_back, False)
            self.rolled_back_steps += (nonfinite or clip) and bool(summary[SPECULATIVE] > 0)
        self.last_outcome.replay = replay
        self.last_outcome.rolled_back = rolled_back
        self._run_owed_zero_grad()
        return replay

    @torch.no_grad()
    def flush(self) -> None:
        """Validate the pending step outside any schedule (before evaluation, checkpointing or the end).

        Every rank must call it at the same point; the sums take the V passes' way along the ranks, lowered
        as in a schedule."""
        schedule = validation_only(self.stages, self.chunks, self.layout)
        transport = self.make_transport((1,), torch.float, self.device, validation_numel=self.size)
        summary = None
        for item in lower(schedule)[self.stage]:
            if type(item) is Warmup:
                transport.warm_up(item.peers)
            elif type(item) is Batch:
                transport.post_batch(item, lambda msg: (summary, None))
            else:
                need = consumed(schedule, self.stage, item)
                summary = self.own_summary() if need is None else transport.wait_recv(need)
        transport.finish()
        self.validate(summary)  # nothing ran on the speculative weights since the step: no replay

    @property
    def has_pending(self) -> bool:
        return self.pending is not None

    # -- deferred gradient zeroing -------------------------------------------------------------------
    def defer_or_run(self, zero_grad, *args, **kwargs) -> None:
        """Gradients must survive until validation (a re-step needs them): zero them then."""
        if self.pending is None:
            zero_grad(*args, **kwargs)
        else:
            self.zero_grad_owed.append((zero_grad, args, kwargs))

    def _run_owed_zero_grad(self) -> None:
        owed, self.zero_grad_owed = self.zero_grad_owed, []
        for zero_grad, args, kwargs in owed:
            zero_grad(*args, **kwargs)

    # -- pieces of megatron's step, kept stage-local -------------------------------------------------
    def _divide_by_tokens(self, loss_stage_tokens: torch.Tensor | None) -> None:
        """Megatron's per-token-loss normalisation (finalize_model_grads), from the loss stage's count that came
        with the gradients instead of a broadcast from the last stage: summed over data-parallel replicas, then
        every gradient divided by it."""
        count = (torch.zeros((), dtype=torch.int, device=self.device) if loss_stage_tokens is None
                 else loss_stage_tokens.reshape(()).to(self.device, torch.int))
        dist.all_reduce(count, group=self.data_parallel_group)
        scaling = 1.0 / torch.clamp(count, min=1)
        for chunk in self.model_chunks:
            chunk.scale_gradients(scaling)

    def _prepare_grads(self) -> list[torch.Tensor]:
        """Megatron's prepare_grads without its model-parallel all-reduce: main grads ready; per leaf, whether
        unscaling found inf/NaN on this rank (always 0 without a loss scaler)."""
        found_inf = []
        for leaf in self.leaves:
            found = torch.zeros((), dtype=torch.float, device=self.device)
            found_inf.append(found)
            if not leaf.is_stub:
                leaf.prepare_grads(found)
        return found_inf

    def _squared_norm(self, block) -> torch.Tensor:
        """This rank's sum of squared gradients of the block's leaves, computed as megatron's get_grad_norm_fp32
        does before reducing."""
        grads = [grad for leaf in block.leaves for grad in self.leaves[leaf].grads_for_norm()]
        if not grads:
            return torch.zeros((), dtype=torch.float, device=self.device)
        return self.megatron.squared_grad_norm(grads, self.device)

    def _needs_clip(self, norm: float) -> bool:
        # Megatron's rule: scale by clip / (norm + 1e-6) when that is below 1 (monotone in the partial sums).
        return self.clip_grad > 0.0 and not math.isnan(norm) and self.clip_grad / (norm + 1.0e-6) < 1.0

    def _clip(self, norm: float) -> None:
        for leaf in self.leaves:
            params = leaf.parameters()
            if leaf.clip_grad > 0.0 and params:
                self.megatron.clip_by_total_norm(params, leaf.clip_grad, norm)

    def _step_leaves(self) -> None:
        for leaf in self.leaves:
            if not leaf.is_stub:
                leaf.step()

    def _overlapped_gathers(self) -> list:
        """The model chunks whose parameter all-gathers megatron overlaps with the next forward passes
        (--overlap-param-gather with the distributed optimizer): after the step, a forward pre-hook gathers
        each bucket on its first use; a validation that changes the parameters gathers them itself."""
        return [chunk for leaf in self.leaves for chunk in leaf.overlapped_gather_chunks()]

    def _update_loss_scale(self, summary: torch.Tensor) -> None:
        """Each leaf's scaler with its own leaf's inf flag, as megatron's prepare_grads updates it."""
        for index, leaf in enumerate(self.leaves):
            if leaf.has_loss_scaler:
                leaf.update_loss_scale(self.stats.overflowed(summary, index))
