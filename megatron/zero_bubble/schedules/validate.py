"""Check a schedule before anything runs it; every problem is one sentence naming rank, pass and microbatch.

Checks, in order: the shape (ranks, layout, ranges), the once-per-rank passes (V, S) if any, that every
(microbatch, virtual stage) gets its work done exactly once (F, B and W, or F and BW) with each pass
after the same-stage passes it needs, that the order cannot deadlock (compute dependencies, then the
lowered send/receive order between neighbouring ranks, and with V the replay after a rollback), and
the memory limit. What each op needs and whether it is once per rank are rows of ops.TABLE.
"""
from __future__ import annotations

from collections import deque

from .comm import lower
from .nccl_model import check_lowering
from .costs import Costs
from .memory import memory_profile
from .ops import MICROBATCH_WORK, OPS, Op, facts, per_rank_chunk, per_rank_ops
from .post_validation import check_rollback
from .problem import MemoryLimit
from .schedule import LAYOUTS, Schedule, ScheduleError
from .simulate import Timeline, simulate

_MEMORY_TOLERANCE = 1e-9


def check_structure(schedule: Schedule) -> None:
    s = schedule
    if s.stages < 1 or s.chunks < 1 or s.microbatches < 1:
        raise ScheduleError(
            f"stages, chunks and microbatches must be at least 1 (got {s.stages}, {s.chunks}, {s.microbatches})"
        )
    if s.layout not in LAYOUTS:
        raise ScheduleError(f"unknown layout {s.layout!r}; expected one of {', '.join(LAYOUTS)}")
    if s.layout == "single" and s.chunks != 1:
        raise ScheduleError(f"layout 'single' holds one chunk per rank, but the schedule says {s.chunks}")
    if s.layout == "v" and s.chunks != 2:
        raise ScheduleError(f"layout 'v' holds two chunks per rank, but the schedule says {s.chunks}")
    if len(s.ranks) != s.stages:
        raise ScheduleError(f"the schedule lists {len(s.ranks)} ranks but says stages={s.stages}")
    once, present = set(per_rank_ops()), set()  # no microbatch of their own: check_once_per_rank checks those
    for rank, passes in enumerate(s.ranks):
        for p in passes:
            if p.op in once:
                present.add(p.op)
                continue
            if not 0 <= p.mb < s.microbatches:
                raise ScheduleError(f"rank {rank} runs {p.describe()}, outside microbatches 0..{s.microbatches - 1}")
            if not 0 <= p.chunk < s.chunks:
                raise ScheduleError(f"rank {rank} runs {p.describe()}, outside chunks 0..{s.chunks - 1}")
    for op in per_rank_ops():
        if op in present:
            check_once_per_rank(s, op)


def check_once_per_rank(schedule: Schedule, op) -> None:
    """Exactly one `op` per rank (V, S), as microbatch 0 on the rank's last chunk, before the passes it must
    precede (after all others if it comes last)."""
    f = facts(op)
    chunk = per_rank_chunk(schedule.chunks)
    for rank, passes in enumerate(schedule.ranks):
        positions = [pos for pos, p in enumerate(passes) if p.op == op]
        if len(positions) != 1:
            raise ScheduleError(
                f"rank {rank} runs the {f.noun} pass {len(positions)} times; it needs exactly one {op} per rank"
            )
        own = passes[positions[0]]
        if (own.mb, own.chunk) != (0, chunk):
            raise ScheduleError(
                f"rank {rank}'s {f.noun} pass names microbatch {own.mb} and chunk {own.chunk}; "
                f"{op} is always microbatch 0 on the rank's last chunk ({chunk})"
            )
        early = next((p for p in passes[: positions[0]] if p.op in f.precedes), None)
        if early is not None:
            raise ScheduleError(
                f"rank {rank} runs {early.describe()} before its {f.noun} pass; "
                f"{op} must precede every {' and '.join(f.precedes)}"
            )
        if f.last and positions[0] != len(passes) - 1:
            raise ScheduleError(
                f"rank {rank} runs {passes[-1].describe()} after its {f.noun} pass; {op} must be its last pass"
            )


def check_coverage(schedule: Schedule) -> None:
    """Each (microbatch, chunk) on each rank gets F, B and W done exactly once (BW does B and W), every pass
    after the same-stage passes it needs, and W passes in the order of their B."""
    # per op: whether it has a microbatch, the ops of its own stage it needs, the work it completes
    rows = {op: (f.per_microbatch, tuple(need.op for need in f.needs if need.offset == 0), f.completes)
            for op, f in ((op, facts(op)) for op in OPS)}
    expected = schedule.chunks * schedule.microbatches * len(MICROBATCH_WORK)
    for rank, passes in enumerate(schedule.ranks):
        seen: dict[tuple[str, int, int], int] = {}  # (op, mb, chunk): a Pass is that tuple
        done: dict[tuple, int] = {}  # (work, mb, chunk) -> how many passes do it
        for pos, p in enumerate(passes):
            per_microbatch, same_stage, completes = rows[p.op]
            if not per_microbatch:  # no microbatch: check_once_per_rank covers it
                continue
            if p in seen:
                raise ScheduleError(f"rank {rank} runs {p.describe()} twice (passes {seen[p]} and {pos})")
            seen[p] = pos
            for need in same_stage:
                if (need, p.mb, p.chunk) not in seen:
                    raise ScheduleError(f"rank {rank} runs {p.describe()} before its {need}")
            for work in completes:
                key = (work, p.mb, p.chunk)
                done[key] = done.get(key, 0) + 1
        # microbatches and chunks are in range (check_structure): all there, each once, is this many
        if len(done) != expected or len(done) != sum(done.values()):
            _explain_missing_work(rank, schedule, seen)
        _check_w_follows_b(rank, passes)


def _explain_missing_work(rank: int, schedule: Schedule, seen: dict) -> None:
    """The first (microbatch, chunk) of the rank whose work is not done exactly once, in one sentence."""
    for chunk in range(schedule.chunks):
        for mb in range(schedule.microbatches):
            where = f"microbatch {mb}" + (f" (chunk {chunk})" if chunk else "")
            done = [work for op in OPS if (op, mb, chunk) in seen for work in facts(op).completes]
            for work in MICROBATCH_WORK:
                if work not in done:
                    raise ScheduleError(f"rank {rank} has no {work} for {where}")
                if done.count(work) > 1:  # two passes do it: only a fused and a split backward can
                    raise ScheduleError(f"rank {rank} runs both a fused BW and a split B/W for {where}")


def _check_w_follows_b(rank: int, passes) -> None:
    """The runtime keeps deferred weight gradients in a FIFO per chunk: W passes follow B order."""
    waiting: dict[int, deque] = {}  # per chunk, microbatches whose B ran and whose W has not
    for p in passes:
        if p.op is Op.B:
            queue = waiting.get(p.chunk)
            if queue is None:
                queue = waiting[p.chunk] = deque()
            queue.append(p.mb)
        elif p.op is Op.W:
            oldest = waiting[p.chunk].popleft()
            if oldest != p.mb:
                raise ScheduleError(
                    f"rank {rank} runs {p.describe()} before the W of microbatch {oldest}, whose B ran first; "
                    f"W passes must follow the order of their B passes"
                )


def check_memory(schedule: Schedule, costs: Costs, limits: list[float]) -> None:
    for rank, profile in enumerate(memory_profile(schedule, costs)):
        for pos, held in enumerate(profile):
            if held > limits[rank] * (1 + _MEMORY_TOLERANCE) + _MEMORY_TOLERANCE:
                p = schedule.ranks[rank][pos]
                unit = costs.memory_unit
                raise ScheduleError(
                    f"rank {rank} holds {held:.4g} {unit} of activations after {p.describe()}, "
                    f"above its limit of {limits[rank]:.4g}"
                )


def validate(
    schedule: Schedule,
    costs: Costs | None = None,
    memory_limit: MemoryLimit | float | None = None,
    check_comm: bool = True,
) -> Timeline:
    """Raise ScheduleError with one sentence on the first problem; return the simulated timeline if none.

    memory_limit is a MemoryLimit (in-flight microbatches, multiples of a rank's M_B, or absolute in the
    costs' unit: bytes when the costs carry bytes) or a count of in-flight microbatches. Without costs,
    uniform unit costs are used.
    """
    limit = MemoryLimit.of(memory_limit)
    check_structure(schedule)
    check_coverage(schedule)
    if costs is None:
        costs = Costs.make(schedule.num_virtual_stages, chunks=schedule.chunks)
    timeline = simulate(schedule, costs)
    if check_comm:
        programs = lower(schedule, costs, timeline)
        check_lowering(schedule, programs)
        if schedule.has_post_validation():
            check_rollback(schedule, programs)
    if limit is not None:
        check_memory(schedule, costs, limit.per_rank(schedule.stages, schedule.chunks, schedule.layout, costs))
    return timeline
