"""Baseline schedules in the same form as the zero-bubble ones: 1F1B and interleaved 1F1B (fused BW)."""
from __future__ import annotations

from .schedule import Pass, Schedule, ScheduleError


def one_f_one_b(stages: int, microbatches: int) -> Schedule:
    """Megatron's 1F1B: rank r warms up with p-r-1 forwards, then alternates F and BW, then drains."""
    if stages < 1 or microbatches < 1:
        raise ScheduleError("1F1B needs at least one stage and one microbatch")
    ranks = []
    for rank in range(stages):
        warmup = min(stages - rank - 1, microbatches)
        passes = [Pass("F", mb) for mb in range(warmup)]
        for i in range(microbatches - warmup):
            passes += [Pass("F", warmup + i), Pass("BW", i)]
        passes += [Pass("BW", mb) for mb in range(microbatches - warmup, microbatches)]
        ranks.append(passes)
    return Schedule(stages, 1, microbatches, "single", ranks, name="1f1b")


def _virtual_microbatch_table(microbatches: int, chunks: int, group_size: int) -> list[tuple[int, int]]:
    """(microbatch, chunk) of each forward virtual microbatch, as megatron-core's get_schedule_table.

    Microbatches go in groups of `group_size`; a group runs chunk 0 for all its microbatches, then chunk 1,
    and so on. The last group also takes any remainder (so it may be longer than `group_size`).
    """
    table = []
    for first in range(0, microbatches, group_size):
        last = microbatches if first + group_size >= microbatches else first + group_size
        table += [(mb, chunk) for chunk in range(chunks) for mb in range(first, last)]
    return table


def interleaved_one_f_one_b(
    stages: int, microbatches: int, chunks: int, group_size: int | None = None
) -> Schedule:
    """Megatron-core's interleaved 1F1B (forward_backward_pipelining_with_interleaving, 0.19.2), fused BW.

    Rank r holds chunks 0..c-1 (virtual stage k*p + r). Forward virtual microbatch k runs the (microbatch,
    chunk) of `_virtual_microbatch_table`; backward k runs the same microbatch on chunk c-1-chunk. Rank r
    warms up with min(m*c, 2(p-r-1) + (c-1)N) forwards, then alternates F and BW, then drains.
    N = group_size is megatron's microbatch_group_size_per_vp_stage (default p).
    """
    p, m, c = stages, microbatches, chunks
    n = p if group_size is None else group_size
    if p < 2 or c < 2:
        raise ScheduleError(f"interleaved 1F1B needs at least 2 stages and 2 chunks per rank, got p={p}, chunks={c}")
    if m < 1:
        raise ScheduleError(f"interleaved 1F1B needs at least one microbatch, got m={m}")
    if not p <= n <= m:
        raise ScheduleError(
            f"megatron-core requires the microbatch group size N (default p) to lie in [p={p}, m={m}], got N={n}"
        )
    if 0 < m % n < p:
        raise ScheduleError(
            f"megatron-core requires m={m} to be a multiple of the microbatch group size N={n} (default p) "
            f"or to leave a remainder of at least p={p}, but it leaves {m % n}"
        )
    table = _virtual_microbatch_table(m, c, n)
    total = m * c
    ranks = []
    for rank in range(p):
        warmup = min(total, 2 * (p - rank - 1) + (c - 1) * n)
        forwards = [Pass("F", mb, chunk) for mb, chunk in table]
        backwards = [Pass("BW", mb, c - 1 - chunk) for mb, chunk in table]
        passes = forwards[:warmup]
        for k in range(total - warmup):
            passes += [forwards[warmup + k], backwards[k]]
        passes += backwards[total - warmup :]
        ranks.append(passes)
    return Schedule(p, c, m, "interleaved", ranks, name="interleaved-1f1b")
