"""The model of NCCL and CUDA that every lowered program is proven on and timed on: one set of rules, as data.

A program (comm.py) is one rank's items in posting order: compute passes, batches of sends and receives on a process
group, and warm-ups. Each rank has a host, which posts the items in order, and a GPU, which starts them. The rules
(../shared/reference/nccl-p2p.md; `Rules` can switch each off, so that a test shows what a program needs it for):
1. One in-order stream per communicator: on a rank, a batch starts only after the rank's previous batch on the same
   process group has completed.
2. Rendezvous: a send completes only together with its receive: both move once both batches have started, in
   T_comm. Sends and receives match in posting order per process group and direction: the k-th send from a to b
   is b's k-th receive from a, and must carry the same message.
3. A batch is one kernel: it completes when all its sends and receives have, and a pass waiting for one of them
   waits for all of them.
4. NCCL waits for compute: a batch starts only after the compute posted before it has ended.
5. The first use of a link blocks the host: a rank's first post on a process group waits until every member of the
   group has made its first (lazily made communicators), and its first post with a peer until that peer's first
   with it (NCCL connects two ranks at their first exchange). A warm-up is one such post with all its peers at once.
   The two halves have a switch each (groups, links).
6. One launch queue per GPU (CUDA_DEVICE_MAX_CONNECTIONS=1): the GPU starts items in posting order, and one that
   cannot start yet holds back every later one, on every stream.
Besides the rules: a rank computes one pass at a time, each once the batches it waits for have completed (the one
holding the message it consumes and, for a backward, the one holding its forward's send); after a pass that syncs
the host (ops.TABLE: V, whose verdict the host reads) the host posts nothing until that pass has ended.

`replay` runs the programs to their end and returns the passes' times as a Timeline, or raises ScheduleError naming
each stuck rank's first item when they cannot finish; `check_lowering` is the same as a proof.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .comm import Action, Batch, Recv, Send, Warmup, link_message, link_table, waited_for
from .costs import Costs
from .memory import memory_profile
from .ops import Op, facts
from .schedule import Pass, Schedule, ScheduleError
from .simulate import Timeline, TimedPass, duration


@dataclass(frozen=True)
class Rules:
    """Which rules hold (all of them for every proof; switching one off shows what a program needs it for)."""

    in_order_streams: bool = True  # 1
    rendezvous: bool = True  # 2
    batch_is_one_kernel: bool = True  # 3
    nccl_waits_for_compute: bool = True  # 4
    first_use_of_a_group_blocks_host: bool = True  # 5, lazily made communicators
    first_use_of_a_link_blocks_host: bool = True  # 5, NCCL connects two ranks at their first exchange
    one_launch_queue: bool = True  # 6


ALL_RULES = Rules()
_SYNCS_HOST = {op: facts(op).syncs_host for op in Op}


def check_lowering(schedule: Schedule, programs: list[list[Action]], costs: Costs | None = None,
                   rules: Rules = ALL_RULES) -> None:
    """Prove that the programs run to their end on the model; ScheduleError naming the first stuck item if not."""
    replay(schedule, programs, costs, rules)


def replay(schedule: Schedule, programs: list[list[Action]], costs: Costs | None = None,
           rules: Rules = ALL_RULES) -> Timeline:
    """The passes' times when the programs run on the model (see the module docstring)."""
    if len(programs) != schedule.stages:
        raise ScheduleError(f"got {len(programs)} rank programs for a schedule of {schedule.stages} stages")
    costs = costs or Costs.make(schedule.num_virtual_stages, chunks=schedule.chunks)
    run = _Run(schedule, programs, costs, rules)
    run.run()
    peaks = [max(profile, default=0.0) for profile in memory_profile(schedule, costs)]
    return Timeline(schedule, costs, run.timed, peaks)


class _Op:
    """One send or receive of a batch (`post`), or a warm-up's exchange with one peer (no post), with the item of
    the peer's that matches it."""

    __slots__ = ("is_send", "peer", "partner", "post")

    def __init__(self, is_send: bool, peer: int, post: Send | Recv | None = None):
        self.is_send, self.peer, self.post = is_send, peer, post
        self.partner: tuple[int, int] | None = None  # (rank, item) of the matching post

    @property
    def what(self) -> str:
        if self.post is None:
            return f"warm-up of the link to rank {self.peer}"
        return f"{'send' if self.is_send else 'receive'} of {self.post.msg.describe()}"


class _Item:
    """What the replay needs of one program item, worked out once."""

    __slots__ = ("action", "is_pass", "group", "ops", "waits", "length", "syncs_host", "first_groups",
                 "first_links", "after_pass", "posted", "start", "end")

    def __init__(self, action: Action):
        self.action = action
        self.is_pass = isinstance(action, Pass)
        self.group: str | None = None if self.is_pass else action.group
        self.ops: list[_Op] = []
        self.waits: list[tuple[int, Optional[int]]] = []  # (item, its op) a pass waits for
        self.length = 0.0
        self.syncs_host = False
        self.first_groups: tuple[str, ...] = ()  # process groups this item uses first on its rank
        self.first_links: tuple[tuple[str, int], ...] = ()  # (group, peer) links it uses first
        self.after_pass: int | None = None  # the last pass posted before it
        self.posted: float | None = None  # host time of its posting
        self.start: float | None = None
        self.end: float | None = None


class _Run:
    def __init__(self, schedule: Schedule, programs: list[list[Action]], costs: Costs, rules: Rules):
        self.schedule, self.costs, self.rules = schedule, costs, rules
        self.p = schedule.stages
        self.items = [[_Item(action) for action in program] for program in programs]
        self.timed: list[list[TimedPass]] = [[] for _ in range(self.p)]
        self.members: dict[str, set[int]] = {}
        self.links = link_table(schedule)  # what each pass of each rank sends and receives, worked out once
        self.lengths: dict[tuple, float] = {}  # (op, virtual stage) -> duration
        for rank in range(self.p):
            self._describe_rank(rank)
        self._match()
        # host: next item to post, its clock, when it first reached each group and link; GPU: next item to start
        self.host_pos, self.host_time = [0] * self.p, [0.0] * self.p
        self.reached: dict[tuple, float] = {}  # (rank, group) or (rank, group, peer) -> host time
        self.gpu_pos = [0] * self.p
        self.last_start, self.compute_end = [0.0] * self.p, [0.0] * self.p
        self.stream_tail: list[dict[str, int]] = [{} for _ in range(self.p)]  # group -> last batch started

    # -- set-up ---------------------------------------------------------------------------------------------------
    def _describe_rank(self, rank: int) -> None:
        schedule, items = self.schedule, self.items[rank]
        where: dict[tuple[bool, object], tuple[int, int]] = {}  # (is send, message) -> (item, op)
        groups, links, last_pass, computed = set(), set(), None, set()
        vstage = [schedule.virtual_stage(rank, chunk) for chunk in range(schedule.chunks)]
        for i, item in enumerate(items):
            action = item.action
            if item.is_pass:
                key = (action.op, vstage[action.chunk])
                length = self.lengths.get(key)
                if length is None:
                    length = self.lengths[key] = duration(action, key[1], self.costs)
                item.length = length
                item.syncs_host = _SYNCS_HOST[action.op]
                item.waits = self._waits(rank, i, action, where)
                computed.add(link_message(self.links[rank][action.chunk, action.op][0], action.mb))
                last_pass = i
                continue
            item.after_pass = last_pass
            self.members.setdefault(item.group, set()).add(rank)
            if isinstance(action, Warmup):
                item.ops = [_Op(False, peer) for peer in action.peers]
            elif isinstance(action, Batch):
                for k, post in enumerate(action.ops):
                    is_send = type(post) is Send
                    if is_send and post.msg not in computed:
                        raise ScheduleError(f"rank {rank} posts the send of {post.msg.describe()} before computing it")
                    where[is_send, post.msg] = (i, k)
                    peer = post.msg.dst if is_send else post.msg.src
                    item.ops.append(_Op(is_send, peer, post))
            else:
                raise ScheduleError(f"rank {rank}'s program holds {action!r}, which is no pass, batch or warm-up")
            fresh = [(item.group, op.peer) for op in item.ops if (item.group, op.peer) not in links]
            if fresh:
                item.first_links = tuple(dict.fromkeys(fresh))
                links.update(fresh)
            if item.group not in groups:
                item.first_groups = (item.group,)
                groups.add(item.group)

    def _waits(self, rank: int, i: int, p: Pass, where: dict) -> list[tuple[int, int]]:
        """The posts a pass waits for, as (item, op) of its rank's program: they must come before it."""
        waits = []
        for post, msg in waited_for(self.links[rank], p):
            is_send = post is Send
            if (is_send, msg) not in where:
                if is_send:
                    raise ScheduleError(f"rank {rank} runs {p.describe()} before posting the send of "
                                        f"{msg.describe()} (its forward's output, freed first)")
                raise ScheduleError(f"rank {rank} runs {p.describe()} without having posted the receive of "
                                    f"{msg.describe()} before it")
            waits.append(where[is_send, msg])
        return waits

    def _match(self) -> None:
        """Pair every send with its receive (in posting order per group and direction) and every warm-up with the
        peer's; ScheduleError on a mismatch or an unmatched post."""
        queues: dict[tuple, list] = {}  # (group, from, to, is send) -> [(rank, item, op, message)]
        for rank, items in enumerate(self.items):
            for i, item in enumerate(items):
                action = item.action
                if isinstance(action, Batch):
                    for k, post in enumerate(action.ops):
                        msg = post.msg
                        queues.setdefault((item.group, msg.src, msg.dst, type(post) is Send), []).append(
                            (rank, i, k, msg))
                elif isinstance(action, Warmup):
                    for k, peer in enumerate(action.peers):
                        queues.setdefault((item.group, rank, peer, "warm-up"), []).append((rank, i, k, None))
        for (group, src, dst, kind), posted in queues.items():
            if kind is False:
                continue
            other = queues.get((group, dst, src, "warm-up") if kind == "warm-up" else (group, src, dst, False), [])
            for n, (rank, i, k, msg) in enumerate(posted):
                if n >= len(other):
                    what = "warms up its link to" if kind == "warm-up" else f"posts the send of {msg.describe()} to"
                    raise ScheduleError(f"rank {rank} {what} rank {dst} on group '{group}', which rank {dst} never "
                                        f"matches")
                peer_rank, j, l, peer_msg = other[n]
                if peer_msg != msg:
                    raise ScheduleError(f"mismatched messages on group '{group}': rank {src}'s send number {n + 1} to "
                                        f"rank {dst} is {msg.describe()}, but rank {dst}'s receive number {n + 1} "
                                        f"from rank {src} is {peer_msg.describe()}")
                self.items[rank][i].ops[k].partner = (peer_rank, j)
                self.items[peer_rank][j].ops[l].partner = (rank, i)
        for rank, items in enumerate(self.items):
            for item in items:
                for op in item.ops:
                    if op.partner is None:
                        raise ScheduleError(f"rank {rank} posts the {op.what} on group '{item.group}', which rank "
                                            f"{op.peer} never matches")

    # -- the replay -----------------------------------------------------------------------------------------------
    def run(self) -> None:
        progressed = True
        while progressed:
            progressed = False
            for rank in range(self.p):
                while self._post(rank) | self._start(rank):
                    progressed = True
        stuck = [rank for rank in range(self.p) if self.gpu_pos[rank] < len(self.items[rank])
                 or any(item.start is None for item in self.items[rank])]
        if stuck:
            raise ScheduleError("communication deadlock: " + "; ".join(self._why(rank) for rank in stuck))

    def _post(self, rank: int) -> bool:
        """Let the host post what it can: it blocks at a first use (rule 5) and after a pass that syncs it."""
        items, at = self.items[rank], self.host_pos[rank]
        start_at = at
        while at < len(items):
            if at > 0 and items[at - 1].syncs_host:
                if items[at - 1].end is None:
                    break
                self.host_time[rank] = max(self.host_time[rank], items[at - 1].end)
            item = items[at]
            if not item.is_pass and (self.rules.first_use_of_a_group_blocks_host
                                     or self.rules.first_use_of_a_link_blocks_host):
                met = self._first_use(rank, item)
                if met is None:
                    break
                self.host_time[rank] = max(self.host_time[rank], met)
            item.posted = self.host_time[rank]
            at += 1
        self.host_pos[rank] = at
        return at > start_at

    def _first_use(self, rank: int, item: _Item) -> float | None:
        """When the host may go on past an item that uses a group or link first: once every member of the group
        and every peer of the link has reached its own first use (None while one has not)."""
        now = self.host_time[rank]
        for group in item.first_groups:
            self.reached.setdefault((rank, group), now)
        for group, peer in item.first_links:
            self.reached.setdefault((rank, group, peer), now)
        times = [now]
        for group in self._blocking_groups(item):
            times += [self.reached.get((member, group)) for member in self.members[group]]
        times += [self.reached.get((peer, group, rank)) for group, peer in self._blocking_links(item)]
        return None if None in times else max(times)

    def _blocking_groups(self, item: _Item) -> tuple:
        return item.first_groups if self.rules.first_use_of_a_group_blocks_host else ()

    def _blocking_links(self, item: _Item) -> tuple:
        return item.first_links if self.rules.first_use_of_a_link_blocks_host else ()

    def _start(self, rank: int) -> bool:
        """Start on the GPU what can start: in posting order under one launch queue (rule 6), else each stream's
        next."""
        if self.rules.one_launch_queue:
            started = False
            while self.gpu_pos[rank] < self.host_pos[rank] and self._try_start(rank, self.gpu_pos[rank]):
                self.gpu_pos[rank] += 1
                started = True
            return started
        return self._start_streams(rank)

    def _start_streams(self, rank: int) -> bool:
        items, started = self.items[rank], False
        heads: dict[object, int] = {}
        for i in range(self.gpu_pos[rank], self.host_pos[rank]):
            item = items[i]
            stream = "compute" if item.is_pass else item.group
            if item.start is None and stream not in heads:
                heads[stream] = i
        for i in sorted(heads.values()):
            started |= self._try_start(rank, i)
        while self.gpu_pos[rank] < self.host_pos[rank] and items[self.gpu_pos[rank]].start is not None:
            self.gpu_pos[rank] += 1
        return started

    def _try_start(self, rank: int, i: int) -> bool:
        item, rules = self.items[rank][i], self.rules
        if item.start is not None:
            return False
        ready = item.posted
        if rules.one_launch_queue:
            ready = max(ready, self.last_start[rank])
        if item.is_pass:
            ready = max(ready, self.compute_end[rank])
            for j, k in item.waits:
                done = self._done(rank, j, None if rules.batch_is_one_kernel else k)
                if done is None:
                    return False
                ready = max(ready, done)
            item.start, item.end = ready, ready + item.length
            self.compute_end[rank] = item.end
            t = item.action
            self.timed[rank].append(TimedPass(rank, self.schedule.virtual_stage(rank, t.chunk), t, item.start,
                                              item.end))
        else:
            tail = self.stream_tail[rank].get(item.group)
            if rules.in_order_streams and tail is not None:
                done = self._done(rank, tail, None)
                if done is None:
                    return False
                ready = max(ready, done)
            if rules.nccl_waits_for_compute and item.after_pass is not None:
                before = self.items[rank][item.after_pass].end
                if before is None:
                    return False
                ready = max(ready, before)
            item.start = ready
            self.stream_tail[rank][item.group] = i
        self.last_start[rank] = max(self.last_start[rank], item.start)
        return True

    def _done(self, rank: int, i: int, op: int | None) -> float | None:
        """When a batch completed (op None) or one of its posts did; None while it cannot be known yet."""
        item = self.items[rank][i]
        if item.start is None:
            return None
        ends = []
        for k, post in enumerate(item.ops):
            if op is not None and k != op:
                continue
            peer, j = post.partner
            partner_start = self.items[peer][j].start
            if post.is_send and not self.rules.rendezvous:
                ends.append(item.start + self.costs.t_comm)
            elif partner_start is None:
                return None
            else:
                ends.append(max(item.start, partner_start) + self.costs.t_comm)
        return max(ends, default=item.start)

    # -- what a stuck rank waits for ----------------------------------------------------------------------------
    def _why(self, rank: int) -> str:
        items = self.items[rank]
        if self.host_pos[rank] < len(items) and self.gpu_pos[rank] == self.host_pos[rank]:
            item = items[self.host_pos[rank]]
            if self.host_pos[rank] > 0 and items[self.host_pos[rank] - 1].syncs_host:
                return f"rank {rank}'s host waits for {items[self.host_pos[rank] - 1].action.describe()} to end"
            missing = [f"rank {peer} on group '{group}'" for group, peer in self._blocking_links(item)
                       if (peer, group, rank) not in self.reached]
            missing += [f"rank {member} on group '{group}'" for group in self._blocking_groups(item)
                        for member in sorted(self.members[group]) if (member, group) not in self.reached]
            return (f"rank {rank}'s host is blocked at the first use of its links ({_describe(item)}) until "
                    f"{', '.join(missing)} uses its own first")
        i = next(i for i in range(self.gpu_pos[rank], len(items)) if items[i].start is None)
        item = items[i]
        if item.is_pass:
            waits = [(j, k) for j, k in item.waits if self._done(rank, j, None) is None]
            if waits:
                j, k = waits[0]
                return f"rank {rank} stops at {item.action.describe()}, waiting for its {items[j].ops[k].what}" + \
                    self._holdup(rank, j)
            return f"rank {rank} stops at {item.action.describe()}"
        tail = self.stream_tail[rank].get(item.group)
        if tail is not None and self._done(rank, tail, None) is None:
            return (f"rank {rank} stops at {_describe(item)}: its previous batch on group '{item.group}' has not "
                    f"completed" + self._holdup(rank, tail))
        return f"rank {rank} stops at {_describe(item)}"

    def _holdup(self, rank: int, i: int) -> str:
        """Which peer has not started the post a batch waits for."""
        for post in self.items[rank][i].ops:
            peer, j = post.partner
            if self.items[peer][j].start is None:
                return f" ({post.what}), which rank {peer} posts in {_describe(self.items[peer][j])}, not started"
        return ""


def _describe(item: _Item) -> str:
    action = item.action
    if isinstance(action, Warmup):
        return f"its warm-up of links to ranks {', '.join(map(str, action.peers))}"
    if isinstance(action, Batch):
        posts = ", ".join(f"{'send' if type(p) is Send else 'receive'} of {p.msg.describe()}" for p in action.ops[:3])
        more = f" and {len(action.ops) - 3} more" if len(action.ops) > 3 else ""
        return f"its batch of {posts}{more}"
    return action.describe()
