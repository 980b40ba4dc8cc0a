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
