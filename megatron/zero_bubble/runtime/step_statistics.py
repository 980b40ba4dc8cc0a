"""The gradient statistics that post-validation's S and V passes carry, and megatron's grad norm from them.

Megatron reduces a leaf optimizer's statistics over that leaf's own group (`get_grad_stats_parallel_group`):
without the distributed optimizer the dense leaf over the model-parallel group (tensor x pipeline) and the
expert leaf of an MoE model over the expert group (expert tensor x expert x pipeline). A ChainedOptimizer
whose leaves share one group sums all their gradients in one reduction; otherwise each leaf gets its own
norm and the chain combines them as `sqrt(sum(norm ** 2))`. The summary mirrors that: one *block* per
reduction, holding one squared norm per rank of the block's group (in its rank order), then one inf/NaN flag
per leaf (megatron updates each fp16 loss scaler with its own leaf's flag), then two flags of the step
(post_validation.SPECULATIVE, PENDING).

A block's squared norms are added in descending rank order, the order gloo's all-reduce of one element
uses (checked at 4 ranks), so that the norm equals megatron's on gloo; with NCCL it may differ by an ulp.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

STEP_FLAGS = 2  # SPECULATIVE and PENDING, the summary's last elements (post_validation.py)


@dataclass(frozen=True)
class Block:
    """One reduction of megatron's step: the gradients of `leaves` summed over the ranks of one group."""

    ranks: tuple[int, ...]  # global ranks of the statistics group, in its rank order
    leaves: tuple[int, ...]  # indices of the leaf optimizers whose gradients it sums
    stage_group: object = None  # the part of the group in this pipeline stage (None: this rank alone)

    @classmethod
    def of(cls, group, leaves, stage_group) -> "Block":
        return cls(tuple(dist.get_process_group_ranks(group)), tuple(leaves), stage_group)

    @property
    def stage_ranks(self) -> list[int]:
        """The ranks whose values this rank gathers over stage_group, in that group's order."""
        return [dist.get_rank()] if self.stage_group is None else dist.get_process_group_ranks(self.stage_group)


class SummaryLayout:
    """Where each value sits in the summary tensor, and what megatron computes from the full sums."""

    def __init__(self, blocks: list[Block], leaves: int):
        self.blocks = blocks
        self.starts = []
        start = 0
        for block in blocks:
            self.starts.append(start)
            start += len(block.ranks)
        self.flags_start = start  # one inf/NaN flag per leaf
        self.size = start + leaves + STEP_FLAGS

    def squares(self, summary: torch.Tensor, index: int) -> torch.Tensor:
        start = self.starts[index]
        return summary[start:start + len(self.blocks[index].ranks)]

    def add_stage(self, summary: torch.Tensor, index: int, rank: int, squares: torch.Tensor,
                  flags: torch.Tensor) -> None:
        """Put a rank's squared norm for block `index` and its leaves' inf flags into the partial sums."""
        block = self.blocks[index]
        summary[self.starts[index] + block.ranks.index(rank)] = squares
        for leaf, flag in zip(block.leaves, flags):
            slot = self.flags_start + leaf
            summary[slot] = torch.maximum(summary[slot], flag)

    def overflowed(self, summary: torch.Tensor, leaf: int) -> bool:
        """Whether this leaf's gradients held inf/NaN once unscaled (megatron's found_inf of the leaf)."""
        return bool(summary[self.flags_start + leaf] > 0)

    def nonfinite(self, summary: torch.Tensor) -> bool:
        """inf/NaN anywhere: a leaf's unscaling found some, or a squared norm is not finite."""
        flags = summary[self.flags_start:self.size - STEP_FLAGS]
        squares = summary[:self.flags_start]
        return bool((flags > 0).any() | ~torch.isfinite(squares).all())  # one read on the host, not two

    def norm(self, summary: torch.Tensor) -> float:
        """Megatron's grad norm from the (partial) sums: one block's norm, or the chain's combination."""
        norms = [_block_norm(self.squares(summary, index)) for index in range(len(self.blocks))]
        if len(norms) == 1:
            return norms[0]
        # ChainedOptimizer.get_grad_norm with leaves on different groups, term for term
        return math.sqrt(sum([(norm if norm else 0.0) ** 2 for norm in norms]))


def _block_norm(squares: torch.Tensor) -> float:
    total = squares[-1].clone()
    for value in reversed(squares[:-1]):  # descending rank order (see the module docstring)
        total = total + value
    return total.item() ** 0.5


def blocks_for(leaves: list, stage_ranks: list[int], stage_groups: list) -> list[Block]:
    """The reductions megatron's step makes for these leaf optimizers.

    stage_ranks: every rank of this pipeline stage; stage_groups: callables returning megatron process groups
    within the stage, tried in turn for the part of each statistics group that lies in this stage."""
    groups = [leaf.statistics_group() or dist.group.WORLD for leaf in leaves]
    if all(group == groups[0] for group in groups):  # megatron's grads_states_parallel_group_is_shared
        shares = [(groups[0], tuple(range(len(leaves))))]
    else:
        shares = [(group, (index,)) for index, group in enumerate(groups)]
    blocks = []
    for group, members in shares:
        in_stage = {rank for rank in dist.get_process_group_ranks(group) if rank in stage_ranks}
        blocks.append(Block.of(group, members, _group_with(in_stage, stage_groups)))
    return blocks


def _group_with(ranks: set[int], candidates: list):
    for candidate in candidates:
        group = candidate()
        if group is not None and set(dist.get_process_group_ranks(group)) == ranks:
            return group
    if len(ranks) == 1:
        return None
    raise RuntimeError(f"optimizer post-validation: no process group of megatron's holds exactly the ranks "
                       f"{sorted(ranks)} of a statistics group that lie in this pipeline stage")
