"""The links pipeline messages travel on: megatron's pipeline group itself, warmed up once.

Every message goes on the pipeline group megatron made (pg_collection.pp): its timeout, NCCL options, backend and
stream priority are megatron's (--distributed-timeout-minutes, the "pp" NCCL options, --high-priority-stream-groups),
and nothing else is made: no collective call builds a link. NCCL sets a link up at its first use, which blocks the
host until the peer makes its own (../shared/reference/nccl-p2p.md, section 3; with lazily made communicators the
first batched operation also makes the group's communicator, which every member must join). Each program therefore
starts with a warm-up (schedules/comm.py): one exchange of a tiny tensor with every peer it uses, all in one batch,
made by every rank at the head of the same call, before any other message.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


class PipelineLinks:
    """This rank's view of the pipeline group: `group`, `rank`, `global_rank(r)`, and which peers are warm."""

    def __init__(self, group):
        self.group = group
        self.rank = group.rank()
        self._global = [dist.get_global_rank(group, r) for r in range(group.size())]
        self.warm: set[int] = set()

    def global_rank(self, pipeline_rank: int) -> int:
        return self._global[pipeline_rank]

    def warm_up(self, peers, ops) -> None:
        """One exchange with every peer not warm yet, as one batch; every such peer makes its own at the same point."""
        cold = sorted(set(peers) - self.warm)
        if not cold:
            return
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(self.group) == "nccl" else "cpu"
        posts = []
        for peer in cold:
            posts += [(True, torch.ones(1, device=device), self.global_rank(peer)),
                      (False, torch.zeros(1, device=device), self.global_rank(peer))]
        ops.batch(posts, self.group).wait()
        self.warm.update(cold)
