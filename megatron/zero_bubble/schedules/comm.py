"""Communication lowering: where each rank posts its sends and receives between compute passes.

NCCL (and gloo without tags) match point-to-point messages between two ranks in posting order, and NCCL
runs the operations of one rank pair on one stream, one after another, in both directions. So for every
pair of ranks we fix ONE sequence of messages (by the simulated time they are produced) and both ranks
post their side of it in that order: sends right after the compute that produces them, receives as
early as that order allows, so they overlap with compute. `check_lowering` replays the programs under
those strict rules (a pair's operations complete only head-to-head, in order) and names any deadlock.
Which message a pass sends or receives is read from ops.TABLE: an F's activation goes one virtual stage
up, a B's (or BW's) gradient one down, the post-validation passes' summaries (V's result, S's partial
statistics) one rank on along their chain (see post_validation.py); a pass receives what its cross-stage
dependency sends. After a replay point (V) every receive the rank needs is posted after it.
"""
from __future__ import annotations

from collections import deque
from operator import itemgetter
from typing import NamedTuple, Union

from .costs import Costs
from .ops import KIND_NOUNS, RECEIVES, TABLE, Kind, carries_microbatch, facts, per_rank_chunk
from .schedule import Pass, Schedule, ScheduleError
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


Action = Union[Pass, Send, Recv]


# A message without its microbatch: kind, stages (from, to), ranks (from, to), and the kind's number (for keys
# of plain ints, which hash fast).
Link = tuple[Kind, int, int, int, int, int]
_KIND_NUMBER = {kind: number for number, kind in enumerate(Kind)}


def _link(schedule: Schedule, kind: Kind, src_stage: int | None, dst_stage: int | None) -> Link | None:
    """The message between two virtual stages, if both exist and sit on different ranks (a V's turn does not)."""
    if src_stage is None or dst_stage is None:
        return None
    src, dst = schedule.owner(src_stage)[0], schedule.owner(dst_stage)[0]
    return None if src == dst else (kind, src_stage, dst_stage, src, dst, _KIND_NUMBER[kind])


def _links(schedule: Schedule, rank: int, chunk: int, op) -> tuple[Link | None, Link | None]:
    """What a pass of `op` on (rank, chunk) sends and what it receives, from ops.TABLE."""
    f, vs = facts(op), schedule.virtual_stage(rank, chunk)
    nv, p = schedule.num_virtual_stages, schedule.stages
    send = None if f.sends is None else _link(schedule, f.sends[0], vs, f.linked_stage(vs, f.sends[1], nv, p))
    receives = RECEIVES[op]
    recv = None if receives is None else _link(schedule, receives[0], f.linked_stage(vs, receives[1], nv, p), vs)
    return send, recv


def _link_table(schedule: Schedule) -> list[dict]:
    """_links for every (chunk, op) of every rank, worked out once per schedule."""
    return [{(chunk, op): _links(schedule, rank, chunk, op) for chunk in range(schedule.chunks) for op in TABLE}
            for rank in range(schedule.stages)]


def _message(link: Link | None, mb: int) -> Message | None:
    return None if link is None else Message(link[0], mb, *link[1:5])


def produced(schedule: Schedule, rank: int, p: Pass) -> Message | None:
    """The message a pass sends to another rank, if any."""
    return _message(_links(schedule, rank, p.chunk, p.op)[0], p.mb)


def consumed(schedule: Schedule, rank: int, p: Pass) -> Message | None:
    """The message a pass must receive from another rank before it can run, if any: the output of its
    dependency on another virtual stage."""
    return _message(_links(schedule, rank, p.chunk, p.op)[1], p.mb)


_ORDER = itemgetter(0, 1, 2)  # a pair's messages: by (production order, producing rank, its position)


def _replay_points(schedule: Schedule) -> dict[int, int]:
    """Each rank's position of its replay point (V), for the ranks that have one."""
    points = {}
    for op in (op for op, f in TABLE.items() if f.replay_point):
        at = Pass(op, 0, per_rank_chunk(schedule.chunks))
        for rank, passes in enumerate(schedule.ranks):
            if at in passes:  # a tuple search in C: plans without post-validation have hundreds of thousands
                points[rank] = passes.index(at)
    return points


def lower(schedule: Schedule, costs: Costs | None = None, timeline: Timeline | None = None) -> list[list[Action]]:
    """Each rank's program: its compute passes with Send/Recv posts placed between them."""
    if timeline is None:
        costs = costs or Costs.make(schedule.num_virtual_stages, chunks=schedule.chunks)
        timeline = simulate(schedule, costs)
    table = _link_table(schedule)
    new = tuple.__new__  # a Message from fields that are right already (the link's kind is a Kind)
    replay_index = _replay_points(schedule)
    replay_time = {rank: timeline.ranks[rank][pos].end for rank, pos in replay_index.items()}
    # Where each message is consumed, by (kind number, microbatch, source stage, destination stage): plain int
    # tuples, quick to hash for hundreds of thousands of messages.
    consume_index: dict[tuple, int] = {}
    for rank, passes in enumerate(schedule.ranks):
        links = table[rank]
        for pos, p in enumerate(passes):
            link = links[p.chunk, p.op][1]
            if link is not None:
                consume_index[link[5], p.mb, link[1], link[2]] = pos
    # Per rank pair, every message with its place in the pair's order and its slots on both ends. The order
    # is by production time, except that a message its receiver needs only after its replay point (V)
    # counts from just after that V: the result V receives, needed before, then goes first. (In a V layout
    # the result walks the way warm-up activations go, sent long before the receiver needs them; their
    # sends then wait until after the sender's V: after a rollback they are never sent, so never drained.)
    pairs: dict[tuple[int, int], list] = {}
    for rank, passes in enumerate(timeline.ranks):
        links = table[rank]
        for pos, t in enumerate(passes):
            op = t.op
            link = links[op.chunk, op.op][0]
            if link is not None:
                kind, src_stage, dst_stage, src, dst, number = link
                mb = op.mb
                consumed_at = consume_index[number, mb, src_stage, dst_stage]
                order = (t.end, 0)
                if replay_index and dst in replay_index and consumed_at > replay_index[dst]:
                    order = max(order, (replay_time[dst], 1))
                pair = (src, dst) if src < dst else (dst, src)
                msg = new(Message, (kind, mb, src_stage, dst_stage, src, dst))
                entry = (order, rank, pos, msg, consumed_at)
                queue = pairs.get(pair)
                if queue is None:
                    pairs[pair] = [entry]
                else:
                    queue.append(entry)
    # slots[rank][k]: comm posts placed just before compute k (k = len means after the last pass).
    slots: list[dict[int, list[Action]]] = [{} for _ in range(schedule.stages)]
    for pair, messages in sorted(pairs.items()):
        messages.sort(key=_ORDER)
        last_slot = {pair[0]: 0, pair[1]: 0}
        for _, _, produced_at, msg, consumed_at in messages:
            src, dst = msg[4], msg[5]
            send_slot = last_slot[src]
            if produced_at >= send_slot:
                send_slot = produced_at + 1
            recv_slot = last_slot[dst]
            if replay_index:
                replay = replay_index.get(dst)
                if replay is not None and consumed_at > replay:
                    # A receive posted before V could be matched by a replayed message after a rollback.
                    recv_slot = max(recv_slot, replay + 1)
            if recv_slot > consumed_at:
                raise ScheduleError(
                    f"rank {dst} cannot post the receive of {msg.describe()} before it needs it: "
                    f"the in-order matching with rank {src} puts it too late"
                )
            posts = slots[src].get(send_slot)
            if posts is None:
                slots[src][send_slot] = [Send(msg)]
            else:
                posts.append(Send(msg))
            posts = slots[dst].get(recv_slot)
            if posts is None:
                slots[dst][recv_slot] = [Recv(msg)]
            else:
                posts.append(Recv(msg))
            last_slot[src], last_slot[dst] = send_slot, recv_slot
    programs = []
    for rank, passes in enumerate(schedule.ranks):
        program: list[Action] = []
        posts = slots[rank]
        for k, p in enumerate(passes):
            if k in posts:
                program += posts[k]
            program.append(p)
        program += posts.get(len(passes), [])
        programs.append(program)
    return programs


def check_lowering(schedule: Schedule, programs: list[list[Action]]) -> None:
    """Replay the programs with in-order matching per rank pair; raise ScheduleError on any mismatch or deadlock.

    Posting a Send or Recv never blocks; a compute pass waits until the message it consumes was received.
    On each rank pair, operations complete strictly in posting order, head against head (as NCCL's
    per-pair stream does, which also covers gloo's looser rules).
    """
    p = schedule.stages
    table = _link_table(schedule)
    pos = [0] * p
    queues: dict[tuple[int, int], deque] = {}  # (rank, peer) -> posted, not yet completed
    received: set[tuple] = set()  # (kind number, microbatch, stages) of what arrived
    produced_so_far: set[tuple] = set()
    progressed = True
    while progressed:
        progressed = False
        for rank in range(p):
            program, links, at = programs[rank], table[rank], pos[rank]
            while at < len(program):
                item = program[at]
                kind = type(item)
                if kind is Send or kind is Recv:
                    msg = item.msg
                    if kind is Send:
                        if (_KIND_NUMBER[msg.kind], msg.mb, msg.src_stage, msg.dst_stage) not in produced_so_far:
                            raise ScheduleError(f"rank {rank} posts the send of {msg.describe()} before computing it")
                        peer = msg.dst
                    else:
                        peer = msg.src
                    queue = queues.get((rank, peer))
                    if queue is None:
                        queue = queues[rank, peer] = deque()
                    queue.append(item)
                else:
                    send, recv = links[item.chunk, item.op]
                    if recv is not None and (recv[5], item.mb, recv[1], recv[2]) not in received:
                        break
                    if send is not None:
                        produced_so_far.add((send[5], item.mb, send[1], send[2]))
                at += 1
                progressed = True
            pos[rank] = at
        for (rank, peer), queue in queues.items():
            other = queues.get((peer, rank))
            while queue and other:
                mine, theirs = queue[0], other[0]
                if type(mine) is type(theirs) or mine.msg != theirs.msg:
                    break
                queue.popleft()
                other.popleft()
                msg = mine.msg
                received.add((_KIND_NUMBER[msg.kind], msg.mb, msg.src_stage, msg.dst_stage))
                progressed = True
    for rank in range(p):
        if pos[rank] < len(programs[rank]):
            item = programs[rank][pos[rank]]
            need = consumed(schedule, rank, item)
            raise ScheduleError(
                f"communication deadlock: rank {rank} waits at {item.describe()} for {need.describe()}"
                + _head_note(queues, need)
            )
    for (rank, peer), queue in queues.items():
        if queue:
            head = queue[0]
            verb = "send" if isinstance(head, Send) else "receive"
            raise ScheduleError(f"rank {rank} posts a {verb} of {head.msg.describe()} that rank {peer} never matches")


def _head_note(queues: dict, need: Message) -> str:
    mine = queues.get((need.dst, need.src), [])
    theirs = queues.get((need.src, need.dst), [])
    if mine and theirs:
        return (
            f", but rank {need.dst}'s next operation with rank {need.src} is for {mine[0].msg.describe()} "
            f"while rank {need.src}'s is for {theirs[0].msg.describe()}"
        )
    if not theirs:
        return f", which rank {need.src} has not sent"
    return ""
