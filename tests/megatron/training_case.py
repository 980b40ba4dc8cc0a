"""One training case on every rank of the harness: what the test modules that train run, in `harness.run_cases`.

    Case(label, layout, schedule, spec, ...)   the run: layout, schedule, model, optimizer, DDP, steps (a test
                                               module's cases may subclass it with fields of their own)
    CaseRun(case)                              on a rank: the zero-bubble session, megatron's parallel state, the
                                               model (DDP) and optimizer, then the iterations and the report
    planned(name, stages, microbatches, ...)   a schedule as its planner makes it (cached)
    BUCKET_ELEMENTS                            DDP's bucket size in overlapped cases
    run_layout(layout, spec, num_microbatches, ...) -> this rank's report of one iteration

The model, batches and forward-backward are rank_model.py's; the parallel state is process_groups.py's.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Callable

import torch

from tests.megatron.harness import Layout, ModelSpec, strict_messaging
from tests.megatron.process_groups import destroy_parallel_state, init_parallel_state
from tests.megatron.rank_model import (build_gpt_chunks, full_grads, full_params, gpt_forward_step,
                                       gpt_forward_step_per_token, make_optimizer, run_forward_backward, wrap_in_ddp)


@dataclasses.dataclass(frozen=True)
class Case:
    """One training run that `CaseRun` sets up on every rank; a test module's cases may add fields of their own."""

    label: str
    layout: Layout
    schedule: str | None = None  # a planner's name, run by our executor; None: megatron-core's own schedule
    spec: ModelSpec = ModelSpec()
    microbatches: int = 8
    steps: int = 1  # iterations, each followed by an optimizer step where there is an optimizer
    optimizer: str | None = None  # megatron's "adam" or "sgd" (over DDP), "local" (torch Adam per rank, no DDP)
    ddp: bool = False  # megatron DDP without a megatron optimizer (one implies it)
    clip_grad: float = 1.0
    weight_decay: float = 0.0
    distributed: bool = False  # megatron's distributed optimizer
    overlap: bool = False  # DDP's overlapped reduction in small buckets (distributed: overlapped parameter gathers)
    every_stage_buckets: bool = False  # patches/ddp_bucketing.py buckets every stage (megatron: the first only)
    shard_data: bool = False  # data-parallel replica r trains on microbatches of its own; else all on the same
    forward_only: bool = False
    post_validation: bool = False  # the plan has post-validation's V and S passes
    costs: tuple | None = None  # (T_F, T_B, T_W per virtual stage, T_comm) to plan on (see `planned`); None: unit
    dropout: float = 0.0  # hidden dropout
    per_token: bool = False  # --calculate-per-token-loss (gpt_forward_step_per_token): gradients divided by tokens
    head_wgrad: str = "auto"  # where the plan runs the output layer's W (PlanRequest.head_wgrad)
    rows_wgrad: str = "auto"  # and the row-parallel layers' (PlanRequest.rows_wgrad)

    @property
    def megatron_optimizer(self) -> bool:
        return self.optimizer in ("adam", "sgd")


BUCKET_ELEMENTS = 12_000  # a few buckets per stage of the tiny model, so that their reductions can start apart


@functools.lru_cache(maxsize=None)
def planned(name: str, stages: int, microbatches: int, costs: tuple | None = None, post_validation: bool = False,
            chunks: int | None = None, head_wgrad: str = "auto", rows_wgrad: str = "auto"):
    """Schedule `name` as its planner makes it (ILP off), for `chunks` model chunks per rank (None: the schedule's
    natural count). `costs` as in `Case`: a plan of n virtual stages takes the last n entries of each tuple."""
    from megatron.zero_bubble.schedules import Costs
    from megatron.zero_bubble.schedules.planners import PlanRequest, natural_chunks, plan

    chunks = chunks or natural_chunks(name)
    if costs is not None:
        n = stages * chunks
        t_f, t_b, t_w, t_comm = costs
        costs = Costs.make(n, t_f=t_f[-n:], t_b=t_b[-n:], t_w=t_w[-n:], t_comm=t_comm, chunks=chunks)
    return plan(name, PlanRequest(stages=stages, microbatches=microbatches, costs=costs, ilp_time_limit=0,
                                  post_validation=post_validation, chunks=chunks, head_wgrad=head_wgrad,
                                  rows_wgrad=rows_wgrad))


class CaseRun:
    """`case` on this rank: the zero-bubble session, megatron's parallel state, the model (DDP) and optimizer,
    then the iterations the test module drives:

        with CaseRun(case) as run:       # run.session, run.chunks, run.optimizer built
            for step in range(case.steps):
                run.iteration(step)      # gradients zeroed, forward-backward on this replica's microbatches
                run.step()               # the optimizer's: megatron's (update_successful, grad_norm, zeros)
            return run.report()          # dp/pp/tp rank, losses {(step, microbatch)}, grads (last step), params

    `observer` sees every pass of our executor; `forward_step` replaces `gpt_forward_step`.
    """

    def __init__(self, case: Case, observer: Callable | None = None, forward_step: Callable | None = None):
        self.case, self.observer = case, observer
        self.forward_step = forward_step or (gpt_forward_step_per_token if case.per_token else gpt_forward_step)
        self.losses, self.grads = {}, {}
        self._exit = contextlib.ExitStack()

    def __enter__(self) -> "CaseRun":
        from megatron.zero_bubble.schedules.planners import layout_of
        from megatron.zero_bubble.training.session import ZeroBubbleSession

        case = self.case
        plans = None
        if case.schedule is not None:
            plans = functools.partial(_plan_for_microbatches, case)
        v_stages = case.layout.pp if case.schedule is not None and layout_of(case.schedule) == "v" else None
        if v_stages is not None:  # the V placement must be in place before the groups are made
            destroy_parallel_state()
        self.session = self._exit.enter_context(ZeroBubbleSession(
            schedule_for=plans, v_stages=v_stages, bucket_every_stage=case.every_stage_buckets, observer=self.observer,
            messaging=strict_messaging()))
        try:
            init_parallel_state(case.layout.tp, case.layout.pp, case.layout.vpp, ep=case.layout.ep)
            self.chunks = build_gpt_chunks(case.spec, init_seed=0, hidden_dropout=case.dropout,
                                           calculate_per_token_loss=case.per_token)
            self.ddp = case.ddp or case.megatron_optimizer
            if self.ddp:
                self.chunks = wrap_in_ddp(self.chunks, _ddp_config(case))
            self.optimizer = _optimizer(case, self.chunks)
        except BaseException:
            self._exit.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self._exit.close()

    def iteration(self, step: int, keep_grads: bool = True) -> dict[int, float]:
        """Zero the gradients, run forward-backward on this step's microbatches; returns its losses, and keeps them
        and (with `keep_grads`, unless forward only) the full gradients (an all-gather over TP ranks)."""
        from megatron.core import parallel_state

        case, m = self.case, self.case.microbatches
        if self.optimizer is not None:
            self.optimizer.zero_grad()
            for chunk in self.chunks if self.ddp else ():
                chunk.zero_grad_buffer()
        first = step * m
        if case.shard_data:
            first = (step * parallel_state.get_data_parallel_world_size() + parallel_state.get_data_parallel_rank()) * m
        losses = run_forward_backward(self.chunks, case.spec, m, first, forward_step_func=self.forward_step,
                                      forward_only=case.forward_only)
        self.losses.update({(step, k): v for k, v in losses.items()})
        if keep_grads and not case.forward_only:
            self.grads = full_grads(self.chunks)
        return losses

    def step(self) -> tuple:
        """The optimizer's step: megatron's (update_successful, grad_norm, num_zeros); a local one's (True, None,
        None)."""
        if self.case.optimizer == "local":
            self.optimizer.step()
            return True, None, None
        return self.optimizer.step()

    def report(self, **extras) -> dict:
        """This rank's ranks, losses, last gradients and parameters (gathered first under overlapped parameter
        gathers), and `extras`."""
        from megatron.core import parallel_state

        if self.case.overlap and self.case.distributed:  # the last step's parameters, gathered
            for chunk in self.chunks:
                chunk.start_param_sync(force_sync=True)
        return {"dp_rank": parallel_state.get_data_parallel_rank(),
                "pp_rank": parallel_state.get_pipeline_model_parallel_rank(),
                "tp_rank": parallel_state.get_tensor_model_parallel_rank(),
                "losses": self.losses, "grads": self.grads, "params": full_params(self.chunks), **extras}


def _plan_for_microbatches(case: Case, microbatches: int):
    """The case's plan for the layout's chunks per rank (vpp; zb-auto plans any number)."""
    return planned(case.schedule, case.layout.pp, microbatches, case.costs, case.post_validation, case.layout.vpp,
                   case.head_wgrad, case.rows_wgrad)


def _ddp_config(case: Case):
    from megatron.core.distributed import DistributedDataParallelConfig

    return DistributedDataParallelConfig(
        use_distributed_optimizer=case.distributed, overlap_grad_reduce=case.overlap,
        overlap_param_gather=case.overlap and case.distributed, bucket_size=BUCKET_ELEMENTS if case.overlap else None)


def _optimizer(case: Case, chunks: list):
    if case.optimizer is None:
        return None
    if case.optimizer == "local":  # each rank's own torch Adam: no reduction whose order depends on the layout
        return torch.optim.Adam([p for chunk in chunks for p in chunk.parameters()], lr=1e-3)
    from megatron.core.optimizer import OptimizerConfig

    settings = dict(lr=1e-3) if case.optimizer == "adam" else dict(lr=0.05, sgd_momentum=0.9)
    return make_optimizer(chunks, OptimizerConfig(
        optimizer=case.optimizer, weight_decay=case.weight_decay, clip_grad=case.clip_grad,
        use_distributed_optimizer=case.distributed, **settings))


# ---------------------------------------------------------------- one iteration of a layout
# It runs a Case, so it lives here: rank_model.py, which this module imports, must not import it back.


def run_layout(layout: Layout, spec: ModelSpec, num_microbatches: int, *, ddp: bool = False,
               optimizer_step: bool = False, shard_data: bool | None = None) -> dict:
    """Initialise `layout`, build the model, run one forward-backward (+ optional Adam step); this rank's report.

    With `shard_data` (default: `ddp`) data-parallel replica r runs microbatches [r*m, (r+1)*m);
    otherwise every replica runs [0, m). The report has dp_rank, losses, grads, params (at the end, so
    after the step if there is one) and grad_norm (None without a step); merge with `harness.merge_by_dp_rank`.
    """
    case = Case("layout", layout, spec=spec, microbatches=num_microbatches, ddp=ddp,
                optimizer="adam" if optimizer_step else None, shard_data=ddp if shard_data is None else shard_data)
    with CaseRun(case) as run:
        run.iteration(0)
        grad_norm = None
        if optimizer_step:
            success, grad_norm, _ = run.step()
            assert success, "optimizer step was skipped"
        return run.report(grad_norm=None if grad_norm is None else float(grad_norm))
