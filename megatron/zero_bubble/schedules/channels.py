"""Which point-to-point operations share an in-order stream: the transport's rules, as data.

NCCL runs the operations of one stream in posting order, and a send completes only together with its receive (large
messages move through bounded buffers, so a send cannot finish before the peer's receive runs: rendezvous). Which
operations share a stream depends on how PyTorch made the communicator (../shared/reference/nccl-p2p.md):
- lazily (no `device_id` at `init_process_group`, the default of megatron-core 0.19): one communicator, so one
  stream, per pair of ranks within a process group, both directions;
- eagerly (`device_id` given; PyTorch's newer NCCL engine by default): one communicator per process group, so every
  send and receive of a rank on that group shares one stream, whatever the peer.
The runtime posts each message on a process group of its own pair of ranks (`pair_group`), so under either mode a
stream carries the messages of one rank pair, and only those. A model here is a function from a message to its
channel (what shares a stream with it, named alike on both ends); `comm.check_lowering` replays the programs under
every model of `MODELS`, `program.simulate_program` times them under one. `PIPELINE_GROUP` is what posting every
message on the one pipeline group would mean under eager initialisation: the rule the runtime is built to avoid (its
interleaved programs deadlock under it; tests show it).
"""
from __future__ import annotations

from typing import Callable, Hashable

Channel = Hashable
ChannelModel = Callable[[object], Channel]  # message (comm.Message) -> channel; never depends on the microbatch


def pair_group(rank: int, peer: int) -> str:
    """The name of the process group of two pipeline ranks, the same on both ends."""
    low, high = sorted((rank, peer))
    return f"pipeline pair {low}-{high}"


def per_pair(msg) -> Channel:
    """Lazily made NCCL communicators: one stream per pair of ranks."""
    return ("pair",) + tuple(sorted((msg.src, msg.dst)))


def per_group(msg) -> Channel:
    """Eagerly made NCCL communicators: one stream per (rank, process group), on the groups the runtime posts on."""
    return pair_group(msg.src, msg.dst)


def pipeline_group(msg) -> Channel:
    """Every message on the one pipeline group, eagerly made: one stream per rank (not what the runtime does)."""
    return "pipeline"


# The models every lowered program is proven under before it runs: how NCCL may run the runtime's posts.
MODELS: dict[str, ChannelModel] = {"one stream per rank pair": per_pair,
                                   "one stream per (rank, process group)": per_group}
