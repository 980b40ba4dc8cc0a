"""The compute passes of training: megatron's own forward_step and backward_step, one microbatch of one chunk.

`MegatronPasses` is the `iteration.PassCompute` of a training call. F is megatron's forward_step (the loss on
the last virtual stage, the token count, the data the training loop reads back); B is megatron's
backward_step with the chunk's WeightGradStore active, so the linear layers' weight gradients are deferred
into it; BW is the same backward with the store running each weight gradient at once; W runs the store's
oldest microbatch. Megatron's no_sync brackets every backward of a chunk but its last, as in megatron's own
schedules, and `finish_backward` is megatron's finalize_model_grads. Everything megatron is reached through
the adapter handed in (patches/megatron_adapter.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from ..schedules.schedule import Pass
from ..schedules.ops import Op
from .pass_timer import pass_timer
from .wgrad_store import WeightGradStore


@dataclass
class MegatronRun:
    """The arguments of one call of megatron's forward_backward function, as forward_step reads them."""

    forward_step_func: Callable
    iterators: list
    chunks: list
    num_microbatches: int
    config: object
    cp_size: int
    forward_only: bool
    collect_non_loss_data: bool
    first_val_step: bool | None
    pg_collection: object
    force_all_reduce: bool | None = False
    forward_data_store: list = field(default_factory=list)  # what the loss functions report, for the loop


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


class MegatronPasses:
    """F, B, BW and W of one training or evaluation call (see the module docstring)."""

    def __init__(self, megatron, run: MegatronRun, device: torch.device, tokens_divided_later: bool = False):
        self.megatron = megatron  # patches.megatron_adapter.MegatronAdapter
        self.run = run
        # post-validation divides by the token count in its S pass (the count travels along its chain)
        self.tokens_divided_later = tokens_divided_later
        self.device = device
        self.forward_only = run.forward_only
        self.started_chunks: set[int] = set()
        self.total_num_tokens = torch.zeros([], dtype=torch.int, device=device)
        self.grad_sync = None if run.forward_only else ChunkGradSync(run.config.no_sync_func, len(run.chunks))

    def forward(self, p: Pass, vstage: int, input_tensor, is_last_stage: bool):
        output, num_tokens = self.megatron.forward_step(
            self.run, p.chunk, p.mb, input_tensor, first_of_chunk=p.chunk not in self.started_chunks,
            is_last_stage=is_last_stage)
        self.started_chunks.add(p.chunk)
        self.total_num_tokens += num_tokens
        return output

    def release_output(self, output) -> None:
        self.megatron.free_output(output, self.run.config)

    def backward(self, p: Pass, vstage: int, input_tensor, output, output_grad, store: WeightGradStore,
                 last: bool):
        self.grad_sync.before_backward(p.chunk, last)
        if p.op == Op.B:
            with store.split_backward():
                input_grad = self.megatron.backward_step(input_tensor, output, output_grad, self.run.config)
            store.close_microbatch(p.mb, last=last)
        else:
            with store.fused_backward(last):
                input_grad = self.megatron.backward_step(input_tensor, output, output_grad, self.run.config)
        return input_grad

    def weight(self, p: Pass, store: WeightGradStore) -> None:
        store.run_next(p.mb)

    def finish_backward(self) -> None:
        """Reduce the gradients, as megatron does after its last backward. finalize_model_grads starts what has
        not started and waits for every bucket. Megatron's grad_sync_func (--align-grad-reduce) is not called:
        it would start again the buckets that started as they became ready."""
        self.grad_sync.release_all()
        config = self.run.config
        if config.finalize_model_grads_func is not None:
            config.finalize_model_grads_func(
                self.run.chunks,
                self.total_num_tokens if config.calculate_per_token_loss and not self.tokens_divided_later else None,
                pg_collection=self.run.pg_collection,
                force_all_reduce=self.run.force_all_reduce,
            )

    def restart(self) -> None:
        self.run.forward_data_store.clear()
        self.started_chunks.clear()
        self.total_num_tokens.zero_()

    def loss_scale_changed(self) -> None:
        self.megatron.reset_forward_loss_scales(self.run.config, self.run.num_microbatches, self.run.cp_size)

    def pass_timer(self, clock):
        return pass_timer(self.device, clock)

    def token_count(self) -> torch.Tensor:
        return self.total_num_tokens
