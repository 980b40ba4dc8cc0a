"""Communication lowering: which sends and receives each rank posts, batched, between its compute passes.

The wire is megatron's: every message goes on the one pipeline process group ("pipeline", named alike on both ends),
and what a rank posts between two compute passes goes out as one batch (`torch.distributed.batch_isend_irecv`: one
NCCL kernel). Each rank's program starts with a warm-up that touches every link it will use, so no rank's host
blocks later at a first use (nccl_model.py, rule 5).

Each message is exchanged at the time its producer ends in the simulated timeline: the sender posts it in the batch
right after the pass that produces it; the receiver posts its receive in the batch at the last pass boundary it
reaches by then (before the pass running at that time), so the transfer overlaps that pass as the plan assumes, and
at the latest right before the pass that consumes it. A message that lands only after that pass has ended (within
T_comm of its end) is received at the next boundary instead: a batch completes as a whole and the next batch on the
stream starts only then, so the receive posted early would hold up whatever the rank posts at the next boundary, and
under one launch queue the pass after it too. It stays where it is when the pass after that boundary consumes it
(which would start later) or when the sender posts again before the later receive would land (the sender's next
batch would wait instead). Both ends therefore post every message at the same point of one global order (by exchange
time), batch after batch: a batch's partners are posted at about the same time on the neighbours, and no batch waits
long for its peers (rules 1 to 3, 6). Where a pass consumes a message of the batch right before it, the receives due
only later go into a second batch after it, so that the pass waits for no more than it needs (a batch completes as a
whole).
A message its receiver consumes only after its replay point (V) is exchanged after that V on the receiver (a receive
posted before V could be matched by a replayed message after a rollback).
`nccl_model.check_lowering` replays the programs on the model of NCCL and CUDA and names the first stuck item.
Which message a pass sends or receives is read from ops.TABLE: an F's activation goes one virtual stage up, a B's (or
BW's) gradient one down, the post-validation passes' summaries (V's result, S's partial statistics) one rank on along
their chain (see post_validation.py); a pass receives what its cross-stage dependency sends.
"""
from __future__ import annotations

import bisect
import functools
from operator import itemgetter
from typing import Iterator, NamedTuple, Union

from .costs import Costs
from .ops import KIND_NOUNS, RECEIVES, TABLE, Kind, carries_microbatch, facts, per_rank_chunk
from .schedule import Pass, Schedule, ScheduleError, stage_owner, virtual_stage
from .simulate import Timeline, simulate


class _MessageFields(NamedTuple):
    kind: Kind
    mb: int
    src_stage: int
    dst_stage: int
    src: int  # rank
    dst: int


class Message(_MessageFields):
    """An activation (kind ACT) or an input gradient (GRAD) between stages, or a summary of the optimizer
    step (VALID, STATS; microbatch 0) from one rank to the next of its chain. The kind may be given as its
    string ("act"). An immutable tuple: lowering a large plan makes and looks up hundreds of thousands."""

    __slots__ = ()

    def __new__(cls, kind, mb: int, src_stage: int, dst_stage: int, src: int, dst: int):
        return tuple.__new__(cls, (kind if type(kind) is Kind else Kind(kind), mb, src_stage, dst_stage, src, dst))

    def describe(self) -> str:
        noun = KIND_NOUNS[self.kind]
        if not carries_microbatch(self.kind):
            return f"the {noun} from rank {self.src} to rank {self.dst}"
        return f"the {noun} of microbatch {self.mb} from stage {self.src_stage} to stage {self.dst_stage}"


class _Post:
    """Posting one side of a message (a plain slotted class: a program of a large plan holds many)."""

    __slots__ = ("msg",)

    def __init__(self, msg: Message):
        self.msg = msg

    def __eq__(self, other) -> bool:
        return type(other) is type(self) and other.msg == self.msg

    def __hash__(self) -> int:
        return hash((type(self).__name__, self.msg))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(msg={self.msg!r})"


class Send(_Post):
    __slots__ = ()


class Recv(_Post):
    __slots__ = ()


PIPELINE_GROUP = "pipeline"  # the process group every pipeline message goes on: megatron's pipeline group


class _BatchFields(NamedTuple):
    ops: tuple  # of Send and Recv, in posting order
    group: str


class Batch(_BatchFields):
    """Sends and receives posted together, as one NCCL kernel (`batch_isend_irecv`) on a process group. An immutable
    tuple, as Pass and Message are: the lowering of a large plan makes tens of thousands."""

    __slots__ = ()

    def __new__(cls, ops, group: str = PIPELINE_GROUP):
        return tuple.__new__(cls, (tuple(ops), group))


class _WarmupFields(NamedTuple):
    peers: tuple  # pipeline ranks
    group: str


class Warmup(_WarmupFields):
    """A first exchange with each of `peers` on a process group, all at once: made by the first call, before any other
    message (links already warm are skipped), so that no later first use of a link blocks a host (nccl_model.py,
    rule 5)."""

    __slots__ = ()

    def __new__(cls, peers, group: str = PIPELINE_GROUP):
        return tuple.__new__(cls, (tuple(peers), group))


Post = Union[Send, Recv]
Action = Union[Pass, Batch, Warmup]


def posts(program: list[Action]) -> Iterator[Post]:
    """The sends and receives of a program, in posting order."""
    for item in program:
        if type(item) is Batch:
            yield from item.ops


# A message without its microbatch: kind, stages (from, to), ranks (from, to), and the kind's number (for keys
# of plain ints, which hash fast).
Link = tuple[Kind, int, int, int, int, int]
_KIND_NUMBER = {kind: number for number, kind in enumerate(Kind)}


def _link(layout: str, stages: int, kind: Kind, src_stage: int | None, dst_stage: int | None) -> Link | None:
    """The message between two virtual stages, if both exist and sit on different ranks (a V's turn does not)."""
    if src_stage is None or dst_stage is None:
        return None
    src, dst = stage_owner(layout, stages, src_stage)[0], stage_owner(layout, stages, dst_stage)[0]
    return None if src == dst else (kind, src_stage, dst_stage, src, dst, _KIND_NUMBER[kind])


def _links(schedule: Schedule, rank: int, chunk: int, op) -> tuple[Link | None, Link | None]:
    """What a pass of `op` on (rank, chunk) sends and what it receives, from ops.TABLE."""
    return _layout_links(schedule.layout, schedule.stages, schedule.chunks, rank, chunk, op)


@functools.lru_cache(maxsize=None)
def _layout_links(layout: str, stages: int, chunks: int, rank: int, chunk: int, op) -> tuple[Link | None, Link | None]:
    """_links, which depends on the layout's shape only: worked out once per shape (the runtime asks it per pass)."""
    f, vs = facts(op), virtual_stage(layout, stages, rank, chunk)
    nv = stages * chunks
    send = None if f.sends is None else _link(layout, stages, f.sends[0], vs,
                                              f.linked_stage(vs, f.sends[1], nv, stages))
    receives = RECEIVES[op]
    recv = None if receives is None else _link(layout, stages, receives[0],
                                               f.linked_stage(vs, receives[1], nv, stages), vs)
    return send, recv


def link_table(schedule: Schedule) -> list[dict]:
    """_links for every (chunk, op) of every rank, worked out once per schedule."""
    return [{(chunk, op): _links(schedule, rank, chunk, op) for chunk in range(schedule.chunks) for op in TABLE}
            for rank in range(schedule.stages)]


def link_message(link: Link | None, mb: int) -> Message | None:
    """The message of microbatch `mb` on a link of link_table (None for no link)."""
    return None if link is None else tuple.__new__(Message, (link[0], mb) + link[1:5])


def produced(schedule: Schedule, rank: int, p: Pass) -> Message | None:
    """The message a pass sends to another rank, if any."""
    return link_message(_links(schedule, rank, p.chunk, p.op)[0], p.mb)


def consumed(schedule: Schedule, rank: int, p: Pass) -> Message | None:
    """The message a pass must receive from another rank before it can run, if any: the output of its
    dependency on another virtual stage."""
    return link_message(_links(schedule, rank, p.chunk, p.op)[1], p.mb)


def output_send(schedule: Schedule, rank: int, p: Pass) -> Message | None:
    """The send a pass waits for before it runs, if any: a backward's forward output (the runtime frees it)."""
    frees = facts(p.op).frees_output_of
    return None if frees is None else produced(schedule, rank, Pass(frees, p.mb, p.chunk))


_ORDER = itemgetter(0, 1, 2)  # messages in their exchange order: ((time, after V, causal order), rank, position)


def _replay_points(schedule: Schedule) -> dict[int, int]:
    """Each rank's position of its replay point (V), for the ranks that have one."""
    points = {}
    for op in (op for op, f in TABLE.items() if f.replay_point):
        at = Pass(op, 0, per_rank_chunk(schedule.chunks))
        for rank, passes in enumerate(schedule.ranks):
            if at in passes:  # a tuple search in C: plans without post-validation have hundreds of thousands
                points[rank] = passes.index(at)
    return points


def _consumer_index(schedule: Schedule, table: list[dict]) -> dict[tuple, int]:
    """Where each message is consumed on its receiver, by (kind number, microbatch, source stage, destination stage):
    plain int tuples, quick to hash for hundreds of thousands of messages."""
    index: dict[tuple, int] = {}
    for rank, passes in enumerate(schedule.ranks):
        links = table[rank]
        for pos, p in enumerate(passes):
            link = links[p.chunk, p.op][1]
            if link is not None:
                index[link[5], p.mb, link[1], link[2]] = pos
    return index


def _exchanges(schedule: Schedule, timeline: Timeline, table: list[dict]) -> list[tuple]:
    """Every message as ((exchange time, after V, causal order), producing rank, producer's position, message,
    consumer's position), in exchange order. A message is exchanged when its producer ends, except that one its
    receiver consumes after its replay point (V) is exchanged after that V. Among messages of one time, the one whose
    producer the simulator timed later goes later: with passes that take no time (V) or no T_comm, a message can be
    due at the very time of one its producer waited for."""
    new = tuple.__new__  # a Message from fields that are right already (the link's kind is a Kind)
    consumers = _consumer_index(schedule, table)
    replay = {rank: (timeline.ranks[rank][pos].end, pos) for rank, pos in _replay_points(schedule).items()}
    causal = timeline.sequence or simulate(schedule, timeline.costs).sequence
    out = []
    for rank, passes in enumerate(timeline.ranks):
        links = table[rank]
        for pos, t in enumerate(passes):
            link = links[t.op.chunk, t.op.op][0]
            if link is None:
                continue
            kind, src_stage, dst_stage, src, dst, number = link
            consumed_at = consumers[number, t.op.mb, src_stage, dst_stage]
            when = (t.end, 0, causal[rank][pos])
            if dst in replay and consumed_at > replay[dst][1]:
                when = max(when, (replay[dst][0], 1, causal[rank][pos]))
            out.append((when, rank, pos, new(Message, (kind, t.op.mb, src_stage, dst_stage, src, dst)), consumed_at))
    out.sort(key=_ORDER)
    return out


def lower(schedule: Schedule, costs: Costs | None = None, timeline: Timeline | None = None) -> list[list[Action]]:
    """Each rank's program: a warm-up of its links, then its compute passes with batches of sends and receives
    between them (see the module docstring)."""
    if timeline is None:
        costs = costs or Costs.make(schedule.num_virtual_stages, chunks=schedule.chunks)
        timeline = simulate(schedule, costs)
    table = link_table(schedule)
    replay = _replay_points(schedule)
    ends = [[t.end for t in passes] for passes in timeline.ranks]
    t_comm = timeline.costs.t_comm
    slots: list[dict[int, list[Post]]] = [{} for _ in range(schedule.stages)]  # rank -> boundary -> posts in order
    last = [0] * schedule.stages  # each rank's latest boundary so far: its posts follow the exchange order
    for (when, after_replay, _), _, produced_at, msg, consumed_at in _exchanges(schedule, timeline, table):
        src, dst = msg.src, msg.dst
        # right after its producer, or where the sender is at its later exchange time (never past a pass of the
        # same end, a V: what a receiver needs before its own V must go before the sender's V, see post_validation)
        send_at = max(bisect.bisect_right(ends[src], when) if after_replay else 0, produced_at + 1, last[src])
        earliest = max(last[dst], replay[dst] + 1 if after_replay else 0)
        recv_at = max(earliest, min(bisect.bisect_right(ends[dst], when), consumed_at))
        if recv_at + 1 < consumed_at and when + t_comm > ends[dst][recv_at] and (
                send_at == len(ends[src]) or ends[src][send_at] >= ends[dst][recv_at] + t_comm):
            recv_at += 1  # it lands after the pass it would overlap: its batch would hold up the next one
        if recv_at > consumed_at:
            raise ScheduleError(f"rank {dst} cannot post the receive of {msg.describe()} before it needs it: the "
                                f"exchange order puts it after its receive of another message it needs later")
        slots[src].setdefault(send_at, []).append(Send(msg))
        slots[dst].setdefault(recv_at, []).append(Recv(msg))
        last[src], last[dst] = send_at, recv_at
    return [_program(schedule.ranks[rank], table[rank], slots[rank]) for rank in range(schedule.stages)]


def _program(passes: list[Pass], links: dict, slots: dict[int, list[Post]]) -> list[Action]:
    """A rank's warm-up, passes and batches, from its passes, its link_table and its posts by boundary. The posts
    before a pass that consumes one of them are cut after the last it waits for: the rest go into a batch of their
    own, which the pass does not wait for."""
    peers = sorted({post.msg.dst if type(post) is Send else post.msg.src for group in slots.values() for post in group})
    program: list[Action] = [Warmup(peers)] if peers else []
    for k in range(len(passes) + 1):
        group = slots.get(k)
        if group:
            needed = waited_for(links, passes[k]) if k < len(passes) else ()
            cut = max((i for i, post in enumerate(group) if (type(post), post.msg) in needed),
                      default=len(group) - 1) + 1
            program.append(Batch(group[:cut]))
            if cut < len(group):
                program.append(Batch(group[cut:]))
        if k < len(passes):
            program.append(passes[k])
    return program


def waited_for(links: dict, p: Pass) -> tuple[tuple, ...]:
    """The posts a pass waits for, as (Recv or Send, message), from its rank's link_table: the receive of what it
    consumes and, for a backward, the send of its forward's output (output_send: the runtime frees that output
    first)."""
    need = link_message(links[p.chunk, p.op][1], p.mb)
    frees = facts(p.op).frees_output_of
    sent = None if frees is None else link_message(links[p.chunk, frees][0], p.mb)
    return tuple(post for post in ((Recv, need), (Send, sent)) if post[1] is not None)
