"""What a rank holds between its passes: the activation model (memory.py) plus the pipeline tensors in flight.

The planner plans on activations alone (memory.py: M_B added by F, M_W kept by B for W). Between two passes a
rank also holds pipeline tensors (one microbatch's activation or gradient at a stage boundary, all of one
shape), at points its lowered program (comm.py) fixes, as the runtime keeps them (runtime/iteration.py, p2p.py):
- a receive holds its buffer from its post until the pass that consumes it (receives are posted early);
- a sent tensor lives until its send completes: when a message from the same peer arrives whose receive was
  posted after the send (the peer had posted its receive by then), before the backward of the F whose output
  it is, or at the end of the call. With megatron's deallocate_pipeline_outputs off an F's output stays until
  its backward anyway. (NCCL may complete a send earlier: then this is an upper bound.)
- an F's output handed to the next chunk on the same rank (a V's turn), or a gradient handed back, lives until
  the pass that takes it;
- megatron's model chunk keeps the input of its latest F (set_input_tensor) until its next F, so once that F's
  backward ran the input and its gradient stay; the previous call's go at the chunk's first F.
`pipeline_tensors_held` counts them per rank and pass, from the call's start; `held_memory_profile` adds their
bytes to the activation profile. Once consumed, a received tensor is an activation (saved by the F that read
it: M_F) or part of what a B leaves for its W (M_W), as runtime/profiling.py measures them.
"""
from __future__ import annotations

from .comm import Recv, Send, consumed, lower, produced
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
    position = {item: x for x, item in enumerate(program) if isinstance(item, Pass)}
    end = len(program)
    lifetimes = []  # (born, gone)
    recv_at = {}  # Message -> position of its receive
    waits = []  # (position of the item that waits for a receive, the receive's position, its sender)
    for x, item in enumerate(program):
        if isinstance(item, Recv):
            recv_at[item.msg] = x
        elif isinstance(item, Pass):
            need = consumed(schedule, rank, item)
            if need is not None:
                waits.append((x, recv_at[need], need.src))
                if carries_microbatch(need.kind):
                    lifetimes.append((recv_at[need], x))
    kept = _inputs_kept(schedule, rank, program, position)
    for x, item in enumerate(program):
        if isinstance(item, Send) and carries_microbatch(item.msg.kind):
            producer = _producer(item.msg, schedule, rank)
            gone = min((w for w, posted, peer in waits if peer == item.msg.dst and posted > x), default=end)
            if item.msg.kind == Kind.ACT:  # completed before the backward of its F at the latest
                backward = _backward_of(schedule, rank, position, item.msg.mb, producer.chunk)
                gone = backward if not outputs_freed_when_sent else min(gone, backward)
            else:  # a gradient is its input's .grad: alive while megatron keeps that input
                gone = max(gone, kept.get((producer.mb, producer.chunk), 0))
            lifetimes.append((position[producer], gone))
        elif isinstance(item, Pass) and item.op in _COMPUTE and facts(item.op).sends is not None:
            taker = _hand_over(schedule, rank, item, position)
            if taker is not None:
                gone = taker if facts(item.op).sends[0] == Kind.ACT else max(taker, kept.get((item.mb, item.chunk), 0))
                lifetimes.append((x, gone))
    for (mb, chunk), gone in kept.items():  # the input itself, once its F's activations are gone
        lifetimes.append((_backward_of(schedule, rank, position, mb, chunk), gone))
    reads = [x for x, item in enumerate(program) if isinstance(item, Pass) and item.op in _COMPUTE]
    held = [sum(1 for born, gone in lifetimes if born <= x < gone) for x in reads]
    if after_a_call:  # the previous call's last input of each such chunk, and its gradient, went at its first F
        firsts = [min(position[p] for p in schedule.ranks[rank] if p.op == Op.F and p.chunk == chunk)
                  for chunk in {c for _, c in kept}]
        held = [n - 2 * sum(1 for first in firsts if first <= x) for n, x in zip(held, reads)]
    return held


def _inputs_kept(schedule: Schedule, rank: int, program: list, position: dict) -> dict[tuple[int, int], int]:
    """Megatron's model chunk keeps the input of its latest forward (set_input_tensor) until its next one: for each
    (microbatch, chunk) whose input came from another stage, where that input goes (the chunk's next F, or the
    call's end)."""
    kept = {}
    for chunk in range(schedule.chunks):
        if schedule.virtual_stage(rank, chunk) == 0:
            continue  # the first stage's input is the data, not a pipeline tensor
        forwards = sorted(position[p] for p in schedule.ranks[rank] if p.op == Op.F and p.chunk == chunk)
        for here, after in zip(forwards, forwards[1:] + [len(program)]):
            kept[(program[here].mb, chunk)] = after
    return kept


def _chunk_of(schedule: Schedule, rank: int, vstage: int) -> int:
    return next(c for c in range(schedule.chunks) if schedule.virtual_stage(rank, c) == vstage)


def _producer(msg, schedule: Schedule, rank: int) -> Pass:
    chunk = _chunk_of(schedule, rank, msg.src_stage)
    if msg.kind == Kind.ACT:
        return Pass(Op.F, msg.mb, chunk)
    return next(p for p in schedule.ranks[rank] if p.mb == msg.mb and p.chunk == chunk and p.op in (Op.B, Op.BW))


def _backward_of(schedule: Schedule, rank: int, position: dict, mb: int, chunk: int) -> int:
    return next(position[p] for p in schedule.ranks[rank] if p.op in (Op.B, Op.BW) and p.mb == mb and p.chunk == chunk)


def _hand_over(schedule: Schedule, rank: int, p: Pass, position: dict) -> int | None:
    """Where the pass that takes this pass's output on the same rank (a V's turn) runs, None if there is none."""
    if produced(schedule, rank, p) is not None:
        return None
    kind, offset = facts(p.op).sends
    vstage = schedule.virtual_stage(rank, p.chunk)
    target = vstage + offset
    if not 0 <= target < schedule.num_virtual_stages:
        return None
    chunk = _chunk_of(schedule, rank, target)
    if kind == Kind.ACT:
        return position[Pass(Op.F, p.mb, chunk)]
    return _backward_of(schedule, rank, position, p.mb, chunk)
