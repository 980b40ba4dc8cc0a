"""What a rank holds between its passes: the activation model (memory.py) plus the pipeline tensors in flight.

The planner plans on activations alone (memory.py: M_B added by F, M_W kept by B for W). Between two passes a
rank also holds pipeline tensors (one microbatch's activation or gradient at a stage boundary, all of one
shape), at points its lowered program (comm.py) fixes, as the runtime keeps them (runtime/iteration.py, p2p.py):
- a receive holds its buffer from the post of its batch until the pass that consumes it;
- a sent tensor lives until the runtime sees its batch complete: when a pass waits for that batch or a later one
  (a stream completes its batches in order), which the backward of the F whose output it is does, or at the end
  of the call. With megatron's deallocate_pipeline_outputs off an F's output stays until its backward anyway.
  (NCCL may report a batch complete earlier: then this is an upper bound.)
- an F's output handed to the next chunk on the same rank (a V's turn), or a gradient handed back, lives until
  the pass that takes it;
- megatron's model chunk keeps the input of its latest F (set_input_tensor) until its next F, so once that F's
  backward ran the input and its gradient stay; the previous call's go at the chunk's first F.
`pipeline_tensors_held` counts them per rank and pass, from the call's start; `held_memory_profile` adds their
bytes to the activation profile. Once consumed, a received tensor is an activation (saved by the F that read
it: M_F) or part of what a B leaves for its W (M_W), as runtime/profiling.py measures them.
"""
from __future__ import annotations

import bisect

from .comm import Batch, Send, consumed, lower, output_send, produced
from .costs import Costs
from .memory import memory_profile
from .ops import Kind, Op, carries_microbatch, facts
from .schedule import Pass, Schedule, ScheduleError

_COMPUTE = (Op.F, Op.B, Op.W, Op.BW)  # the passes after which the runtime reads what is held


def lowered_programs(schedule: Schedule) -> list:
    """Every rank's program as the runtime lowers it (runtime/iteration.py LoweredRun: on the schedule's own costs)."""
    costs = Costs.from_dict(schedule.info["costs"]) if "costs" in schedule.info else None
    return lower(schedule, costs)


def pipeline_tensors_held(schedule: Schedule, programs: list | None = None, outputs_freed_when_sent: bool = True,
                          after_a_call: bool = True) -> list[list[int]]:
    """Per rank, after each of its compute passes (F, B, W, BW in order): pipeline tensors held by messages,
    hand-overs and the inputs megatron keeps, counted from the call's start (see the module docstring; negative
    where the previous call's kept inputs went). `outputs_freed_when_sent`: megatron's
    deallocate_pipeline_outputs; `after_a_call`: not the first call of the run."""
    programs = lowered_programs(schedule) if programs is None else programs
    return [_held_on_rank(schedule, rank, program, outputs_freed_when_sent, after_a_call)
            for rank, program in enumerate(programs)]


def held_memory_profile(schedule: Schedule, costs: Costs, pipeline_tensor_bytes: float, programs: list | None = None,
                        outputs_freed_when_sent: bool = True, after_a_call: bool = True) -> list[list[float]]:
    """Per rank, bytes held after each compute pass: activations (memory_profile) and pipeline tensors."""
    if costs.memory_unit != "bytes":
        raise ScheduleError("held memory adds pipeline tensors in bytes: the costs must carry bytes")
    activations = memory_profile(schedule, costs)
    tensors = pipeline_tensors_held(schedule, programs, outputs_freed_when_sent, after_a_call)
    held = []
    for rank, passes in enumerate(schedule.ranks):
        after_compute = [a for p, a in zip(passes, activations[rank]) if p.op in _COMPUTE]
        held.append([a + n * pipeline_tensor_bytes for a, n in zip(after_compute, tensors[rank])])
    return held


def _held_on_rank(schedule: Schedule, rank: int, program: list, outputs_freed_when_sent: bool,
                  after_a_call: bool) -> list[int]:
    """Lifetimes in program positions: a tensor born at position b and gone during the item at d is held at the
    read after the compute pass at position x when b <= x < d (a read follows its pass; posts come after it)."""
    at = _Positions(schedule, rank, program)
    lifetimes = []  # (born, gone)
    sends = [(x, post.msg) for x, item in enumerate(program) if type(item) is Batch
             for post in item.ops if type(post) is Send and carries_microbatch(post.msg.kind)]
    for x, msg in sends:
        producer = at.producer(msg)
        gone = at.first_wait_from(x)
        if msg.kind == Kind.ACT:  # completed before the backward of its F at the latest
            backward = at.backward[(producer.mb, producer.chunk)]
            gone = min(gone, backward) if outputs_freed_when_sent else backward
        else:  # a gradient is its input's .grad: alive while megatron keeps that input
            gone = max(gone, at.kept.get((producer.mb, producer.chunk), 0))
        lifetimes.append((at.passes[producer], gone))
    for x, item in enumerate(program):
        if isinstance(item, Pass):
            need = consumed(schedule, rank, item)
            if need is not None and carries_microbatch(need.kind):  # a receive, from its post to its pass
                lifetimes.append((at.receive[need], x))
            taker = at.hand_over(item) if item.op in _COMPUTE else None
            if taker is not None:  # to the next chunk on this rank (a V's turn); a gradient is an input's .grad
                kept = at.kept.get((item.mb, item.chunk), 0) if facts(item.op).sends[0] == Kind.GRAD else 0
                lifetimes.append((x, max(taker, kept)))
    for (mb, chunk), gone in at.kept.items():  # the input itself, once its F's activations are gone
        lifetimes.append((at.backward[(mb, chunk)], gone))
    if after_a_call:  # the previous call's last input of each such chunk, and its gradient, go at its first F
        lifetimes += [(at.first_forward[chunk], len(program), -2) for chunk in {c for _, c in at.kept}]
    change = [0] * (len(program) + 1)
    for born, gone, *count in lifetimes:
        if born < gone:  # e.g. an input megatron let go of (the chunk's next F) before this F's backward
            change[born] += count[0] if count else 1
            change[gone] -= count[0] if count else 1
    held, reads = 0, []
    for x, item in enumerate(program):
        held += change[x]
        if isinstance(item, Pass) and item.op in _COMPUTE:
            reads.append(held)
    return reads


class _Positions:
    """Where things happen in one rank's program (positions are indices into it)."""

    def __init__(self, schedule: Schedule, rank: int, program: list):
        self.schedule, self.rank = schedule, rank
        self.passes = {item: x for x, item in enumerate(program) if isinstance(item, Pass)}
        self.receive = {post.msg: x for x, item in enumerate(program) if type(item) is Batch
                        for post in item.ops if type(post) is not Send}
        self.sent = {post.msg: x for x, item in enumerate(program) if type(item) is Batch
                     for post in item.ops if type(post) is Send}
        self.backward = {(p.mb, p.chunk): x for p, x in self.passes.items() if p.op in (Op.B, Op.BW)}
        forwards: dict[int, list[tuple[int, int]]] = {}
        for p, x in self.passes.items():
            if p.op == Op.F:
                forwards.setdefault(p.chunk, []).append((x, p.mb))
        self.first_forward = {chunk: min(fs)[0] for chunk, fs in forwards.items()}
        # Megatron's model chunk keeps the input of its latest F (set_input_tensor) until its next one: for each
        # (microbatch, chunk) whose input is a pipeline tensor, where that input goes (the next F, or the end).
        self.kept = {}
        for chunk, fs in forwards.items():
            if schedule.virtual_stage(rank, chunk) > 0:  # the first stage's input is the data
                fs.sort()
                for (_, mb), after in zip(fs, [x for x, _ in fs[1:]] + [len(program)]):
                    self.kept[(mb, chunk)] = after
        # every wait of a pass for a batch, as (the batch's position, the pass's position), by batch position, and for
        # each the earliest pass that waits for that batch or a later one
        self._end = len(program)
        waits = []
        for p, x in self.passes.items():
            need = consumed(schedule, rank, p)
            if need is not None:
                waits.append((self.receive[need], x))
            sent = output_send(schedule, rank, p)
            if sent is not None:
                waits.append((self.sent[sent], x))
        waits.sort()
        self._waited = [batch for batch, _ in waits]
        earliest, suffix = self._end, []
        for _, x in reversed(waits):
            earliest = min(earliest, x)
            suffix.append(earliest)
        self._earliest_wait = suffix[::-1]

    def first_wait_from(self, batch: int) -> int:
        """Where the runtime first waits for the batch at position `batch` or a later one (the end if never)."""
        k = bisect.bisect_left(self._waited, batch)
        return self._earliest_wait[k] if k < len(self._waited) else self._end

    def chunk_of(self, vstage: int) -> int:
        return next(c for c in range(self.schedule.chunks) if self.schedule.virtual_stage(self.rank, c) == vstage)

    def producer(self, msg) -> Pass:
        chunk = self.chunk_of(msg.src_stage)
        if msg.kind == Kind.ACT:
            return Pass(Op.F, msg.mb, chunk)
        return next(p for p in (Pass(Op.B, msg.mb, chunk), Pass(Op.BW, msg.mb, chunk)) if p in self.passes)

    def hand_over(self, p: Pass) -> int | None:
        """Where the pass that takes this pass's output on the same rank (a V's turn) runs, None if there is none."""
        sends = facts(p.op).sends
        if sends is None or produced(self.schedule, self.rank, p) is not None:
            return None
        target = self.schedule.virtual_stage(self.rank, p.chunk) + sends[1]
        if not 0 <= target < self.schedule.num_virtual_stages:
            return None
        chunk = self.chunk_of(target)
        return self.passes[Pass(Op.F, p.mb, chunk)] if sends[0] == Kind.ACT else self.backward[(p.mb, chunk)]
