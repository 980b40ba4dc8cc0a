"""The post-validation passes S and V: the optimizer step leaves the critical path (paper, "Bypassing
the optimizer synchronisation").

After its last pass of iteration n each rank runs S: it adds its gradient statistics (squared norm,
inf/NaN) to the partial sums it received and sends them on, then steps its optimizer speculatively.
The statistics chain ends at the rank of the last virtual stage (p-1; rank 0 in a V), which then holds
the full sums. They travel back to every rank during the warm-up of iteration n+1: V on each rank
receives them from the rank before it in the validation chain, validates (maybe rolls back and
re-steps) and sends them on. V sits right before the rank's first B (or BW): everything before it is
warm-up F work, so the wait hides behind the warm-up of the ranks ahead in the chain. Both chains follow
the last chunks' virtual stages (ops.TABLE), one rank each, so they work for every layout: in 1F1B and
interleaved schedules the result walks from rank p-1 down to rank 0, in a V from rank 0 up, which is the
order in which those ranks run their first backward.

After a rollback every pass a rank ran before its V used speculative weights. Each rank then runs its
`RollbackProgram`: `after_validation` (pass the result on, drain the stale messages the other ranks sent
before their V), then `restart` (its whole program again, same message identities). `check_rollback`
proves this path runs to its end on the model of NCCL and CUDA (nccl_model.py).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, replace

from .comm import Action, Batch, Message, Recv, Send, Warmup, posts
from .nccl_model import check_lowering
from .ops import Op, facts, per_rank_chunk
from .schedule import Pass, Schedule, ScheduleError

RESULT = facts(Op.V).sends[0]  # the kind of message that carries the result along the ranks


def validation_pass(chunks: int) -> Pass:
    return Pass(Op.V, 0, per_rank_chunk(chunks))


def statistics_pass(chunks: int) -> Pass:
    return Pass(Op.S, 0, per_rank_chunk(chunks))


def with_post_validation(schedule: Schedule) -> Schedule:
    """A copy with one V on each rank right before its first B or BW (at the end if it has none), and one
    S after its last pass."""
    if schedule.has_post_validation():
        name = schedule.name or "(unnamed)"
        raise ScheduleError(f"schedule '{name}' ({schedule.layout} layout) already has post-validation passes")
    ranks = []
    validation, statistics = validation_pass(schedule.chunks), statistics_pass(schedule.chunks)
    for passes in schedule.ranks:
        first_backward = next((i for i, p in enumerate(passes) if p.op in facts(Op.V).precedes), len(passes))
        ranks.append(passes[:first_backward] + [validation] + passes[first_backward:] + [statistics])
    info = copy.deepcopy(schedule.info)
    info["post_validation"] = True
    return replace(schedule, ranks=ranks, info=info)


def validation_only(stages: int, chunks: int, layout: str) -> Schedule:
    """One V per rank and nothing else: the result's walk when a pending step is validated outside an
    iteration (before evaluation, a checkpoint or the end of training)."""
    return Schedule(stages, chunks, 1, layout, [[validation_pass(chunks)] for _ in range(stages)],
                    name="post-validation only")


@dataclass
class RollbackProgram:
    """What one rank runs after its V when the validation rolled the optimizer step back."""

    after_validation: list[Action]  # send the result on, receive-and-discard stale messages, in order
    restart: list[Action]  # the whole program again, without V and its messages


def _validation_position(program: list[Action], rank: int) -> int:
    positions = [i for i, item in enumerate(program) if isinstance(item, Pass) and item.op == Op.V]
    if len(positions) != 1:
        raise ScheduleError(f"rank {rank}'s program has {len(positions)} post-validation passes; it needs exactly one")
    return positions[0]


def pre_validation_messages(programs: list[list[Action]]) -> set[Message]:
    """Messages whose sender posts the Send before the sender's own V (computed on speculative weights)."""
    stale = set()
    for rank, program in enumerate(programs):
        v = _validation_position(program, rank)
        stale |= {post.msg for post in posts(program[:v]) if type(post) is Send}
    return stale


def _is_validation(item: Action) -> bool:
    """V itself: not replayed after a rollback (S is: it comes after V)."""
    return isinstance(item, Pass) and item.op == Op.V


def _filtered(item: Action, keep) -> Action | None:
    """A batch with only the posts `keep` accepts (None when none is left); any other item as it is."""
    if type(item) is not Batch:
        return item
    ops = [post for post in item.ops if keep(post)]
    return Batch(ops, item.group) if ops else None


def rollback_programs(schedule: Schedule, programs: list[list[Action]]) -> list[RollbackProgram]:
    """Per rank, the drain after V and the program to restart from, given comm.lower's programs. The drain keeps the
    batches after V with their sends of the result and their receives of stale messages; the restart is the program
    without V, the result's messages and the warm-up (the links are up by then)."""
    if len(programs) != schedule.stages:
        raise ScheduleError(f"got {len(programs)} rank programs for a schedule of {schedule.stages} stages")
    stale = pre_validation_messages(programs)

    def drained(post) -> bool:
        return (type(post) is Send and post.msg.kind == RESULT) or (type(post) is Recv and post.msg in stale)

    out = []
    for rank, program in enumerate(programs):
        v = _validation_position(program, rank)
        after = [kept for item in program[v + 1:] if type(item) is Batch
                 for kept in [_filtered(item, drained)] if kept is not None]
        restart = [kept for item in program if not _is_validation(item) and type(item) is not Warmup
                   for kept in [_filtered(item, lambda post: post.msg.kind != RESULT)] if kept is not None]
        out.append(RollbackProgram(after, restart))
    return out


def _renumbered(item: Action, offset: int) -> Action:
    """The same action for microbatch mb + offset: a replay is told apart from the stale original."""
    if isinstance(item, Pass):
        return item._replace(mb=item.mb + offset)
    return Batch([type(post)(post.msg._replace(mb=post.msg.mb + offset)) for post in item.ops], item.group)


def check_rollback(schedule: Schedule, programs: list[list[Action]]) -> None:
    """Prove that a rollback cannot deadlock: replay V, the drain and the restart (as microbatches m..2m-1).

    Rank r runs its program up to and including V, then `after_validation`, then `restart` with every
    microbatch renumbered mb + m. The drained stale receives are matched by the Sends the other ranks
    posted before their V and are never consumed by a pass, which the model allows.
    """
    m = schedule.microbatches
    rollbacks = rollback_programs(schedule, programs)
    ranks, replayed = [], []
    for rank, (program, rollback) in enumerate(zip(programs, rollbacks)):
        v = _validation_position(program, rank)
        restart = [_renumbered(item, m) for item in rollback.restart]
        replayed.append(program[: v + 1] + rollback.after_validation + restart)
        ranks.append([item for item in replayed[-1] if isinstance(item, Pass)])
    synthetic = replace(schedule, microbatches=2 * m, ranks=ranks, info={})
    try:
        check_lowering(synthetic, replayed)
    except ScheduleError as e:
        raise ScheduleError(
            f"after a rollback, schedule '{schedule.name or '(unnamed)'}' cannot replay its passes "
            f"(microbatch {m} + i is the replay of microbatch i): {e}"
        ) from None
