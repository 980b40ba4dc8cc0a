"""Check a schedule before anything runs it; every problem is one sentence naming rank, pass and microbatch.

Checks, in order: the shape (ranks, layout, ranges), the post-validation passes V if any, that every
(microbatch, virtual stage) has exactly one F and one B and W (or one BW) with W after its B, that the
order cannot deadlock (compute dependencies, then the lowered send/receive order between neighbouring
ranks, and with V the replay after a rollback), and the memory limit.
"""
from __future__ import annotations

from .costs import Costs
from .memory import memory_profile, rank_memory_limits
from .schedule import LAYOUTS, OPS, Schedule, ScheduleError
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
    for rank, _, p in s.passes():
        if p.op not in OPS:
            raise ScheduleError(f"rank {rank} has a pass with unknown op {p.op!r}; expected one of {', '.join(OPS)}")
        if p.op == "V":  # no microbatch of its own: check_post_validation checks it is mb 0, chunk 0
            continue
        if not 0 <= p.mb < s.microbatches:
            raise ScheduleError(f"rank {rank} runs {p.describe()}, outside microbatches 0..{s.microbatches - 1}")
        if not 0 <= p.chunk < s.chunks:
            raise ScheduleError(f"rank {rank} runs {p.describe()}, outside chunks 0..{s.chunks - 1}")
    if s.has_post_validation():
        check_post_validation(s)


def check_post_validation(schedule: Schedule) -> None:
    """Exactly one V per rank, Pass("V", 0, 0), before the rank's first B or BW, in the single layout."""
    from .post_validation import refuse_unsupported_layout

    refuse_unsupported_layout(schedule.name or "(unnamed)", schedule.layout)
    for rank, passes in enumerate(schedule.ranks):
        positions = [pos for pos, p in enumerate(passes) if p.op == "V"]
        if len(positions) != 1:
            raise ScheduleError(
                f"rank {rank} runs the post-validation pass {len(positions)} times; it needs exactly one V per rank"
            )
        v = passes[positions[0]]
        if (v.mb, v.chunk) != (0, 0):
            raise ScheduleError(
                f"rank {rank}'s post-validation pass names microbatch {v.mb} and chunk {v.chunk}; "
                f"V is always mb 0, chunk 0"
            )
        backward = next((p for p in passes[: positions[0]] if p.op in ("B", "BW")), None)
        if backward is not None:
            raise ScheduleError(
                f"rank {rank} runs {backward.describe()} before its post-validation pass; V must precede every B and BW"
            )


def check_coverage(schedule: Schedule) -> None:
    """Exactly one F and one B and W (or one BW) per (microbatch, chunk) on each rank, W after its B."""
    for rank, passes in enumerate(schedule.ranks):
        seen: dict[tuple[str, int, int], int] = {}
        for pos, p in enumerate(passes):
            if p.op == "V":  # no microbatch: check_post_validation covers it
                continue
            key = (p.op, p.mb, p.chunk)
            if key in seen:
                raise ScheduleError(f"rank {rank} runs {p.describe()} twice (passes {seen[key]} and {pos})")
            seen[key] = pos
            if p.op == "W" and ("B", p.mb, p.chunk) not in seen:
                raise ScheduleError(f"rank {rank} runs {p.describe()} before its B")

            if p.op in ("B", "BW") and ("F", p.mb, p.chunk) not in seen:
                raise ScheduleError(f"rank {rank} runs {p.describe()} before its F")
        for chunk in range(schedule.chunks):
            for mb in range(schedule.microbatches):
                has = {op for op in OPS if (op, mb, chunk) in seen}
                where = f"microbatch {mb}" + (f" (chunk {chunk})" if chunk else "")
                if "F" not in has:
                    raise ScheduleError(f"rank {rank} has no F for {where}")
                if "BW" in has and has & {"B", "W"}:
                    raise ScheduleError(f"rank {rank} runs both a fused BW and a split B/W for {where}")
                for op in ("B", "W"):
                    if "BW" not in has and op not in has:
                        raise ScheduleError(f"rank {rank} has no {op} for {where}")
        _check_w_follows_b(rank, passes)


def _check_w_follows_b(rank: int, passes) -> None:
    """The runtime keeps deferred weight gradients in a FIFO per chunk: W passes follow B order."""
    waiting: dict[int, list[int]] = {}  # per chunk, microbatches whose B ran and whose W has not
    for p in passes:
        if p.op == "B":
            waiting.setdefault(p.chunk, []).append(p.mb)
        elif p.op == "W":
            oldest = waiting[p.chunk].pop(0)
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
    memory_limit: float | None = None,
    memory_limit_absolute: float | None = None,
    check_comm: bool = True,
) -> Timeline:
    """Raise ScheduleError with one sentence on the first problem; return the simulated timeline if none.

    memory_limit is in-flight microbatches (multiples of a rank's M_B); memory_limit_absolute is in the
    costs' unit (bytes when the costs carry bytes). Without costs, uniform unit costs are used.
    """
    check_structure(schedule)
    check_coverage(schedule)
    if costs is None:
        costs = Costs.make(schedule.num_virtual_stages, chunks=schedule.chunks)
    timeline = simulate(schedule, costs)
    if check_comm:
        from .comm import check_lowering, lower  # the lowering is a separate layer over the same data

        programs = lower(schedule, costs, timeline)
        check_lowering(schedule, programs)
        if schedule.has_post_validation():
            from .post_validation import check_rollback

            check_rollback(schedule, programs)
    limits = rank_memory_limits(
        schedule.stages, schedule.chunks, schedule.layout, costs, memory_limit, memory_limit_absolute
    )
    if limits is not None:
        check_memory(schedule, costs, limits)
    return timeline
