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

from dataclasses import dataclass
from typing import Union

from .costs import Costs
from .ops import KIND_NOUNS, RECEIVES, Kind, carries_microbatch, facts
from .schedule import Pass, Schedule, ScheduleError
from .simulate import Timeline, simulate


@dataclass(frozen=True)
class Message:
    """An activation (kind ACT) or an input gradient (GRAD) between stages, or a summary of the optimizer
    step (VALID, STATS; microbatch 0) from one rank to the next of its chain. The kind may be given as its
    string ("act")."""

    kind: Kind
    mb: int
    src_stage: int
    dst_stage: int
    src: int  # rank
    dst: int

    def __post_init__(self):
        if type(self.kind) is not Kind:
            object.__setattr__(self, "kind", Kind(self.kind))

    def describe(self) -> str:
        noun = KIND_NOUNS[self.kind]
        if not carries_microbatch(self.kind):
            return f"the {noun} from rank {self.src} to rank {self.dst}"
        return f"the {noun} of microbatch {self.mb} from stage {self.src_stage} to stage {self.dst_stage}"


@dataclass(frozen=True)
class Send:
    msg: Message


@dataclass(frozen=True)
class Recv:
    msg: Message


Action = Union[Pass, Send, Recv]


def _message(schedule: Schedule, kind: Kind, mb: int, src_stage: int | None, dst_stage: int | None) -> Message | None:
    """The message between two virtual stages, if both exist and sit on different ranks (a V's turn does not)."""
    if src_stage is None or dst_stage is None:
        return None
    src, dst = schedule.owner(src_stage)[0], schedule.owner(dst_stage)[0]
    return None if src == dst else Message(kind, mb, src_stage, dst_stage, src, dst)


def _linked(schedule: Schedule, p: Pass, vstage: int, offset: int) -> int | None:
    return facts(p.op).linked_stage(vstage, offset, schedule.num_virtual_stages, schedule.stages)


def produced(schedule: Schedule, rank: int, p: Pass) -> Message | None:
    """The message a pass sends to another rank, if any."""
    sends = facts(p.op).sends
    if sends is None:
        return None
    vs = schedule.virtual_stage(rank, p.chunk)
    return _message(schedule, sends[0], p.mb, vs, _linked(schedule, p, vs, sends[1]))


def consumed(schedule: Schedule, rank: int, p: Pass) -> Message | None:
    """The message a pass must receive from another rank before it can run, if any: the output of its
    dependency on another virtual stage."""
    receives = RECEIVES[p.op]
    if receives is None:
        return None
    vs = schedule.virtual_stage(rank, p.chunk)
    return _message(schedule, receives[0], p.mb, _linked(schedule, p, vs, receives[1]), vs)


def lower(schedule: Schedule, costs: Costs | None = None, timeline: Timeline | None = None) -> list[list[Action]]:
    """Each rank's program: its compute passes with Send/Recv posts placed between them."""
    if timeline is None:
        costs = costs or Costs.make(schedule.num_virtual_stages, chunks=schedule.chunks)
        timeline = simulate(schedule, costs)
    replay_index = {rank: pos for rank, pos, p in schedule.passes() if facts(p.op).replay_point}
    replay_time = {rank: timeline.ranks[rank][pos].end for rank, pos in replay_index.items()}
    # Per rank pair, every message with its place in the pair's order and its slots on both ends. The order
    # is by production time, except that a message its receiver needs only after its replay point (V)
    # counts from just after that V: the result V receives, needed before, then goes first. (In a V layout
    # the result walks the way warm-up activations go, sent long before the receiver needs them; their
    # sends then wait until after the sender's V: after a rollback they are never sent, so never drained.)
    pairs: dict[tuple[int, int], list[tuple[tuple[float, int], int, int, Message]]] = {}
    produce_index: dict[Message, int] = {}
    consume_index: dict[Message, int] = {}
    for rank, passes in enumerate(timeline.ranks):
        for pos, t in enumerate(passes):
            need = consumed(schedule, rank, t.op)
            if need is not None:
                consume_index[need] = pos
    for rank, passes in enumerate(timeline.ranks):
        for pos, t in enumerate(passes):
            out = produced(schedule, rank, t.op)
            if out is not None:
                produce_index[out] = pos
                order = (t.end, 0)
                if out.dst in replay_index and consume_index[out] > replay_index[out.dst]:
                    order = max(order, (replay_time[out.dst], 1))
                pairs.setdefault((min(out.src, out.dst), max(out.src, out.dst)), []).append((order, rank, pos, out))
    # slots[rank][k]: comm posts placed just before compute k (k = len means after the last pass).
    slots: list[dict[int, list[Action]]] = [{} for _ in range(schedule.stages)]
    for pair, messages in sorted(pairs.items()):
        messages.sort(key=lambda item: item[:3])
        last_slot = {pair[0]: 0, pair[1]: 0}
        for _, _, _, msg in messages:
            send_slot = max(last_slot[msg.src], produce_index[msg] + 1)
            recv_slot = last_slot[msg.dst]
            replay = replay_index.get(msg.dst)
            if replay is not None and consume_index[msg] > replay:
                # A receive posted before V could be matched by a replayed message after a rollback.
                recv_slot = max(recv_slot, replay + 1)
            if recv_slot > consume_index[msg]:
                raise ScheduleError(
                    f"rank {msg.dst} cannot post the receive of {msg.describe()} before it needs it: "
                    f"the in-order matching with rank {msg.src} puts it too late"
                )
            slots[msg.src].setdefault(send_slot, []).append(Send(msg))
            slots[msg.dst].setdefault(recv_slot, []).append(Recv(msg))
            last_slot[msg.src], last_slot[msg.dst] = send_slot, recv_slot
    programs = []
    for rank, passes in enumerate(schedule.ranks):
        program: list[Action] = []
        for k in range(len(passes) + 1):
            program += slots[rank].get(k, [])
            if k < len(passes):
                program.append(passes[k])
        programs.append(program)
    return programs


def check_lowering(schedule: Schedule, programs: list[list[Action]]) -> None:
    """Replay the programs with in-order matching per rank pair; raise ScheduleError on any mismatch or deadlock.

    Posting a Send or Recv never blocks; a compute pass waits until the message it consumes was received.
    On each rank pair, operations complete strictly in posting order, head against head (as NCCL's
    per-pair stream does, which also covers gloo's looser rules).
    """
    p = schedule.stages
    pos = [0] * p
    queues: dict[tuple[int, int], list[Action]] = {}  # (rank, peer) -> posted, not yet completed
    received: set[Message] = set()
    produced_so_far: set[Message] = set()
    progressed = True
    while progressed:
        progressed = False
        for rank in range(p):
            program = programs[rank]
            while pos[rank] < len(program):
                item = program[pos[rank]]
                if isinstance(item, (Send, Recv)):
                    peer = item.msg.dst if isinstance(item, Send) else item.msg.src
                    if isinstance(item, Send) and item.msg not in produced_so_far:
                        raise ScheduleError(f"rank {rank} posts the send of {item.msg.describe()} before computing it")
                    queues.setdefault((rank, peer), []).append(item)
                else:
                    need = consumed(schedule, rank, item)
                    if need is not None and need not in received:
                        break
                    out = produced(schedule, rank, item)
                    if out is not None:
                        produced_so_far.add(out)
                pos[rank] += 1
                progressed = True
        for (rank, peer), queue in queues.items():
            other = queues.get((peer, rank), [])
            while queue and other:
                mine, theirs = queue[0], other[0]
                if type(mine) is type(theirs) or mine.msg != theirs.msg:
                    break
                queue.pop(0)
                other.pop(0)
                received.add(mine.msg)
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
