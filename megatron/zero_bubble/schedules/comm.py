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

from .channels import MODELS, ChannelModel
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


def check_lowering(schedule: Schedule, programs: list[list[Action]], channel: ChannelModel | None = None) -> None:
    """Replay the programs under a channel model (channels.py), or under every model of channels.MODELS when none
    is given; raise ScheduleError naming the model and the first wait of any mismatch or deadlock.

    Posting a Send or Recv never blocks. On each rank, the operations of one channel complete strictly in posting
    order, each only together with the peer's matching operation at the head of the peer's queue on the same
    channel (NCCL's in-order streams, rendezvous; gloo's rules are looser). A compute pass waits until the message
    it consumes was received and, as the runtime does (its output is freed), a backward until the send of its
    forward's output completed.
    """
    if channel is None:
        proven = []  # how the models checked so far group the messages into channels
        for name, model in MODELS.items():
            partition = _partition(programs, model)
            if partition in proven:
                continue  # the same channels as a model already replayed: the same replay
            try:
                check_lowering(schedule, programs, model)
            except ScheduleError as error:
                raise ScheduleError(f"{error} (under {name})") from None
            proven.append(partition)
        return
    replay = _Replay(schedule, programs, channel)
    replay.run()
    replay.conclude()


def _partition(programs: list[list[Action]], channel: ChannelModel) -> set:
    """Which links (a message without its microbatch: channel models do not look at it) share a channel."""
    links: dict = {}
    for program in programs:
        for item in program:
            if type(item) is Send:
                msg = item.msg
                links.setdefault((msg.kind, msg.src_stage, msg.dst_stage, msg.src, msg.dst), msg)
    shared: dict = {}
    for link, msg in links.items():
        shared.setdefault(channel(msg), set()).add(link)
    return {frozenset(group) for group in shared.values()}


class _Replay:
    """One replay of `check_lowering`: where each rank stands, what each channel holds, what has arrived."""

    def __init__(self, schedule: Schedule, programs: list[list[Action]], channel: ChannelModel):
        self.schedule, self.programs, self.channel = schedule, programs, channel
        self.table = _link_table(schedule)
        self.pos = [0] * schedule.stages
        self.queues: dict[tuple[int, object], deque] = {}  # (rank, channel) -> posted, not yet completed
        self.matched: set[tuple] = set()  # (kind number, microbatch, stages) of what was delivered
        self.produced: set[tuple] = set()

    def run(self) -> None:
        progressed = True
        while progressed:
            progressed = any([self._advance(rank) for rank in range(self.schedule.stages)])
            progressed = self._match() or progressed

    def _advance(self, rank: int) -> bool:
        program, links, at = self.programs[rank], self.table[rank], self.pos[rank]
        start = at
        while at < len(program):
            item = program[at]
            kind = type(item)
            if kind is Send or kind is Recv:
                msg = item.msg
                if kind is Send and _key(msg) not in self.produced:
                    raise ScheduleError(f"rank {rank} posts the send of {msg.describe()} before computing it")
                self.queues.setdefault((rank, self.channel(msg)), deque()).append(item)
            else:
                send, recv = links[item.chunk, item.op]
                if recv is not None and (recv[5], item.mb, recv[1], recv[2]) not in self.matched:
                    break
                if self._output_send_pending(rank, item):
                    break
                if send is not None:
                    self.produced.add((send[5], item.mb, send[1], send[2]))
            at += 1
        self.pos[rank] = at
        return at > start

    def _output_send_pending(self, rank: int, item: Pass) -> bool:
        """A backward waits for the send of its forward's output (the runtime frees that output first)."""
        if facts(item.op).frees_output_of is None:
            return False
        sent = produced(self.schedule, rank, Pass(facts(item.op).frees_output_of, item.mb, item.chunk))
        return sent is not None and _key(sent) not in self.matched

    def _match(self) -> bool:
        progressed = False
        for (rank, channel), queue in self.queues.items():
            while queue:
                mine = queue[0]
                peer = mine.msg.dst if type(mine) is Send else mine.msg.src
                other = self.queues.get((peer, channel))
                if not other:
                    break
                theirs = other[0]
                if type(mine) is type(theirs) or mine.msg != theirs.msg:
                    break
                queue.popleft()
                other.popleft()
                self.matched.add(_key(mine.msg))
                progressed = True
        return progressed

    def conclude(self) -> None:
        for rank in range(self.schedule.stages):
            if self.pos[rank] < len(self.programs[rank]):
                item = self.programs[rank][self.pos[rank]]
                need = consumed(self.schedule, rank, item)
                if need is None or _key(need) in self.matched:  # it waits for the send of its forward's output
                    need = produced(self.schedule, rank, Pass(facts(item.op).frees_output_of, item.mb, item.chunk))
                    raise ScheduleError(f"communication deadlock: rank {rank} waits at {item.describe()} for its "
                                        f"send of {need.describe()} to complete" + self._head_note(rank, need))
                raise ScheduleError(f"communication deadlock: rank {rank} waits at {item.describe()} for "
                                    f"{need.describe()}" + self._head_note(need.dst, need))
        for (rank, _), queue in self.queues.items():
            if queue:
                head = queue[0]
                verb = "send" if isinstance(head, Send) else "receive"
                peer = head.msg.dst if verb == "send" else head.msg.src
                raise ScheduleError(f"rank {rank} posts a {verb} of {head.msg.describe()} that rank {peer} never "
                                    f"matches")

    def _head_note(self, rank: int, need: Message) -> str:
        """What holds the channel of `need` up on `rank` and on its peer."""
        peer = need.src if rank == need.dst else need.dst
        channel = self.channel(need)
        mine = self.queues.get((rank, channel), [])
        theirs = self.queues.get((peer, channel), [])
        if mine and theirs:
            return (f", but rank {rank}'s next operation on its channel with rank {peer} is the "
                    f"{_verb(mine[0])} of {mine[0].msg.describe()} while rank {peer}'s is the {_verb(theirs[0])} of "
                    f"{theirs[0].msg.describe()}")
        if not theirs:
            return f", which rank {peer} has not posted"
        return ""


def _verb(item: Action) -> str:
    return "send" if isinstance(item, Send) else "receive"


def _key(msg: Message) -> tuple:
    return (_KIND_NUMBER[msg.kind], msg.mb, msg.src_stage, msg.dst_stage)
