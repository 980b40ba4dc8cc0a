"""Each rank's program as the runtime runs it: as JSON (what a person reads when a run hangs, what an outside checker
reads), and timed with the communication streams as NCCL runs them.

A program is the rank's compute passes in order with every send and receive posted between them (comm.lower).
`program_json` writes it per rank as a list of items:
- a compute pass: {"compute": "F", "mb": 0, "chunk": 0, "waits_for": MESSAGE or null, "waits_for_send": MESSAGE or
  null}: the message it consumes, and for a backward the send of its forward's output, which must complete first;
- a post: {"post": "send" | "recv", "message": MESSAGE, "peer": rank, "group": "pipeline pair 0-1"}, the group named
  alike on both ends (channels.pair_group);
- a batch: {"batch": [post, ...]}, posts that complete together (the runtime posts none today);
where MESSAGE is {"kind": "act" | "grad" | "valid" | "stats", "mb", "from_stage", "to_stage", "from_rank", "to_rank"}
(virtual stages and pipeline ranks). `programs_from_json` reads it back.

`simulate_program` times the programs under a channel model (channels.py): a compute pass starts once its rank is
free, its input has arrived and, for a backward, its forward's send completed; a post happens when its rank reaches
it; on each (rank, channel) the operations run one at a time in posting order, and a message moves (T_comm) once
both ends have posted it and both streams are free. A wait that the pass-level simulator (simulate.py) does not see,
a receive posted early that holds back a later send on the same stream, shows up here.
"""
from __future__ import annotations

from collections import deque

from .channels import MODELS, ChannelModel, pair_group, per_group
from .comm import Action, Message, Recv, Send, consumed, produced
from .costs import Costs
from .ops import Kind, facts
from .schedule import Pass, Schedule, ScheduleError
from .simulate import Timeline, TimedPass, duration


# What the exported programs assume of the transport (key "transport" of `zb-schedule export --program`).
TRANSPORT = {
    "groups": "one process group per pair of neighbouring pipeline ranks, named 'pipeline pair A-B' on both ends",
    "posting": "each send and receive posted on its own, in program order (no batches)",
    "proven_under": list(MODELS),
}


def message_json(msg: Message) -> dict:
    return {"kind": str(msg.kind), "mb": msg.mb, "from_stage": msg.src_stage, "to_stage": msg.dst_stage,
            "from_rank": msg.src, "to_rank": msg.dst}


def message_of(data: dict) -> Message:
    return Message(Kind(data["kind"]), data["mb"], data["from_stage"], data["to_stage"], data["from_rank"],
                   data["to_rank"])


def _output_send(schedule: Schedule, rank: int, p: Pass) -> Message | None:
    """The send a pass waits for before it runs: a backward's forward output (the runtime frees it)."""
    frees = facts(p.op).frees_output_of
    return None if frees is None else produced(schedule, rank, Pass(frees, p.mb, p.chunk))


def item_json(schedule: Schedule, rank: int, item: Action) -> dict:
    if isinstance(item, (Send, Recv)):
        msg = item.msg
        peer = msg.dst if isinstance(item, Send) else msg.src
        return {"post": "send" if isinstance(item, Send) else "recv", "message": message_json(msg), "peer": peer,
                "group": pair_group(rank, peer)}
    need, sent = consumed(schedule, rank, item), _output_send(schedule, rank, item)
    return {"compute": str(item.op), "mb": item.mb, "chunk": item.chunk,
            "waits_for": None if need is None else message_json(need),
            "waits_for_send": None if sent is None else message_json(sent)}


def program_json(schedule: Schedule, programs: list[list[Action]]) -> list[list[dict]]:
    return [[item_json(schedule, rank, item) for item in program] for rank, program in enumerate(programs)]


def programs_from_json(data: list[list[dict]]) -> list[list[Action]]:
    """The programs of `program_json` (batches flattened in their order: they complete together anyway)."""
    def items(entries):
        for entry in entries:
            if "batch" in entry:
                yield from items(entry["batch"])
            elif "post" in entry:
                yield (Send if entry["post"] == "send" else Recv)(message_of(entry["message"]))
            else:
                yield Pass(entry["compute"], entry["mb"], entry["chunk"])

    return [list(items(program)) for program in data]


def simulate_program(schedule: Schedule, programs: list[list[Action]], costs: Costs,
                     channel: ChannelModel = per_group) -> Timeline:
    """The timeline of the programs with their streams (see the module docstring); ScheduleError on a deadlock."""
    sim = _ProgramClock(schedule, programs, costs, channel)
    sim.run()
    return Timeline(schedule, costs, sim.timed, [0.0] * schedule.stages)


class _ProgramClock:
    def __init__(self, schedule, programs, costs, channel):
        self.schedule, self.programs, self.costs, self.channel = schedule, programs, costs, channel
        p = schedule.stages
        self.pos, self.free = [0] * p, [0.0] * p
        self.timed: list[list[TimedPass]] = [[] for _ in range(p)]
        self.queues: dict[tuple[int, object], deque] = {}  # (rank, channel) -> (post, posted at), not yet done
        self.stream_free: dict[tuple[int, object], float] = {}
        self.done: dict[Message, float] = {}  # message -> when it arrived (its send completed then too)

    def run(self) -> None:
        progressed = True
        while progressed:
            progressed = any([self._advance(rank) for rank in range(self.schedule.stages)])
            progressed = self._transfer() or progressed
        stuck = [r for r in range(self.schedule.stages) if self.pos[r] < len(self.programs[r])]
        if stuck:
            rank = stuck[0]
            raise ScheduleError(f"the programs deadlock under this channel model: rank {rank} stops at "
                                f"{self.programs[rank][self.pos[rank]]!r}")

    def _advance(self, rank: int) -> bool:
        program, at, start_at = self.programs[rank], self.pos[rank], self.pos[rank]
        while at < len(program):
            item = program[at]
            if isinstance(item, (Send, Recv)):
                self.queues.setdefault((rank, self.channel(item.msg)), deque()).append((item, self.free[rank]))
            else:
                waits = [consumed(self.schedule, rank, item), _output_send(self.schedule, rank, item)]
                times = [self.done.get(m) for m in waits if m is not None]
                if any(t is None for t in times):
                    break
                vs = self.schedule.virtual_stage(rank, item.chunk)
                start = max([self.free[rank], *times])
                end = start + duration(item, vs, self.costs)
                self.timed[rank].append(TimedPass(rank, vs, item, start, end))
                self.free[rank] = end
            at += 1
        self.pos[rank] = at
        return at > start_at

    def _transfer(self) -> bool:
        moved = False
        for (rank, channel), queue in self.queues.items():
            while queue:
                (mine, posted), peer = queue[0], None
                peer = mine.msg.dst if isinstance(mine, Send) else mine.msg.src
                other = self.queues.get((peer, channel))
                if not other or type(other[0][0]) is type(mine) or other[0][0].msg != mine.msg:
                    break
                theirs, their_posted = other.popleft()
                queue.popleft()
                start = max(posted, their_posted, self.stream_free.get((rank, channel), 0.0),
                            self.stream_free.get((peer, channel), 0.0))
                end = start + self.costs.t_comm
                self.stream_free[rank, channel] = self.stream_free[peer, channel] = end
                self.done[mine.msg] = end
                moved = True
        return moved
