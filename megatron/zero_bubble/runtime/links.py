"""The process groups pipeline messages travel on: one for each pair of neighbouring pipeline ranks.

NCCL runs a process group's point-to-point operations in posting order on one stream per rank once the group's
communicator is made eagerly (`init_process_group(device_id=...)`, PyTorch's newer NCCL engine), whatever the peer;
made lazily, one stream per pair of ranks. Posted on the one pipeline group, the runtime's early receives would then
hold back every later send of the rank, and its interleaved programs would deadlock (schedules/channels.py). On a
group of its own for each pair of ranks, a stream carries the messages of one pair under either mode, and the
lowering's per-pair proof holds for both.

The ring of neighbours (i, i+1 mod p) covers every layout: one chunk and the V walk neighbours, the interleaved
layout also goes from the last rank back to the first, and the post-validation chains walk neighbours too. The groups
are made once, by every rank of the job in one order (megatron makes its own groups the same way): made from an
eagerly initialised NCCL group, a new group is split from it, which every rank of the parent must join.
"""
from __future__ import annotations

import torch.distributed as dist

from ..schedules.channels import pair_group


def ring_pairs(size: int) -> list[tuple[int, int]]:
    """The neighbouring pipeline ranks (i, i+1 mod size), each pair once, lower rank first."""
    return sorted({tuple(sorted((i, (i + 1) % size))) for i in range(size) if size > 1})


class PipelineLinks:
    """This rank's pair groups: `group(a, b)` for two pipeline ranks, `global_rank(r)`, `close()`."""

    def __init__(self, pp_group, groups: dict[tuple[int, int], object], names: dict[tuple[int, int], str]):
        self.pp_group = pp_group
        self.rank = pp_group.rank()
        self._groups = groups
        self._names = names
        self._global = [dist.get_global_rank(pp_group, r) for r in range(pp_group.size())]

    @classmethod
    def make(cls, pp_group) -> "PipelineLinks":
        """Collective over every rank of the job: each pipeline's ring pairs, all pipelines in one order."""
        mine = dist.get_process_group_ranks(pp_group)
        pipelines: list = [None] * dist.get_world_size()
        dist.all_gather_object(pipelines, mine)
        groups, names = {}, {}
        for ranks in sorted({tuple(p) for p in pipelines}):
            for a, b in ring_pairs(len(ranks)):
                name = pair_group(a, b)
                group = dist.new_group([ranks[a], ranks[b]], group_desc=f"{name} of pipeline {ranks[0]}")
                if tuple(ranks) == tuple(mine):
                    groups[a, b], names[a, b] = group, name
        return cls(pp_group, groups, names)

    def group(self, a: int, b: int):
        key = (a, b) if a < b else (b, a)
        group = self._groups.get(key)
        if group is None:
            raise RuntimeError(f"pipeline ranks {a} and {b} have no link: the runtime links neighbouring ranks only "
                               f"(a schedule that sends between other ranks needs links of its own)")
        return group

    def name(self, a: int, b: int) -> str:
        return pair_group(a, b)

    def global_rank(self, pipeline_rank: int) -> int:
        return self._global[pipeline_rank]

    def close(self) -> None:
        """Destroy the pair groups (each rank its own, as megatron's groups are destroyed)."""
        if dist.is_initialized():
            for group in self._groups.values():
                dist.destroy_process_group(group)
        self._groups.clear()
