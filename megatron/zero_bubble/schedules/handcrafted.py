"""The paper's handcrafted schedules ZB-H1 and ZB-H2 (Qi et al. 2024, Section 2, Figure 3).

Both are 1F1B with the backward split into B and W: a rank warms up with some F passes, then runs
"F, B" pairs, and runs the W of its oldest waiting microbatch only once `lag` later B passes have run.
Holding W back on the later ranks lets their B passes (the critical path) start earlier, and the held W
passes fill the bubbles at the tail. Every rank runs its W passes in microbatch order, so the weight
gradients accumulate exactly as in 1F1B.

    rank i (0-indexed) | warm-up F passes | W lag | peak activations
    ZB-H1              | p-1-i  (1F1B's)  | i     | (p-i) M_B + i M_W      (p M_B on rank 0)
    ZB-H2              | 2(p-1-i)         | 2i    | (2p-1-2i) M_B + 2i M_W (<= (2p-1) M_B)

With T_comm = 0 and uniform stages the simulated bubble (each rank's span from its own first to its own
last pass, minus its work) is exactly:
    ZB-H1: (p-1) max(T_F+T_B-T_W, T_B)            = the paper's (p-1)(T_F+T_B-T_W) when T_W <= T_F
    ZB-H2: (p-1) max(T_F+T_B-2T_W, T_B-T_F, 0)    = the paper's (p-1)(T_F+T_B-2T_W) when T_W <= T_F,
                                                    for m >= 2p-1 (zero when T_F = T_B = T_W)
The T_B terms are rank 0's wait for its first B, which its p (ZB-H1) or 2p-1 (ZB-H2) warm-up F passes
cannot cover once T_W > T_F. With m <= p both take (m+p-1)(T_F+T_B)+T_W when T_W <= min(T_F, T_B).
"""
from __future__ import annotations

from .schedule import Pass, Schedule, ScheduleError


def _split_one_f_one_b(
    stages: int, microbatches: int, warmups: list[int], lags: list[int], name: str
) -> Schedule:
    """1F1B with split backward: per rank, `warmups[r]` F passes first, W held back by `lags[r]` B passes."""
    ranks = []
    for warmup, lag in zip(warmups, lags):
        warmup = min(warmup, microbatches)
        passes = [Pass("F", mb) for mb in range(warmup)]
        next_f, next_w = warmup, 0
        for b in range(microbatches):
            if next_f < microbatches:  # steady state: one F before each B, as in 1F1B
                passes.append(Pass("F", next_f))
                next_f += 1
            passes.append(Pass("B", b))
            if b + 1 - next_w > lag:  # more than `lag` microbatches wait for their W: run the oldest
                passes.append(Pass("W", next_w))
                next_w += 1
        passes += [Pass("W", mb) for mb in range(next_w, microbatches)]
        ranks.append(passes)
    return Schedule(stages, 1, microbatches, "single", ranks, name=name)


def _check(kind: str, stages: int, microbatches: int) -> None:
    if stages < 1 or microbatches < 1:
        raise ScheduleError(f"{kind} needs at least one stage and one microbatch, got p={stages}, m={microbatches}")


def zb_h1(stages: int, microbatches: int) -> Schedule:
    """ZB-H1: 1F1B's warm-up and peak memory (p M_B), bubble cut to (p-1)(T_F+T_B-T_W).

    Rank i (0-indexed) warms up with p-1-i F passes like 1F1B and holds back i W passes, so every rank
    keeps p microbatches in flight: (p-i) M_B + i M_W, never more than rank 0's p M_B.
    """
    _check("ZB-H1", stages, microbatches)
    p = stages
    return _split_one_f_one_b(p, microbatches, [p - 1 - i for i in range(p)], list(range(p)), "zb-h1")


def zb_h2(stages: int, microbatches: int) -> Schedule:
    """ZB-H2: zero bubble with T_F = T_B = T_W and m >= 2p-1, at a peak of (2p-1) M_B.

    Rank i (0-indexed) warms up with 2(p-1-i) F passes, enough to cover the wait for its first B, and
    holds back 2i W passes, so rank i ends with 2i+1 W passes after its last B: each rank is busy from
    its own first pass to its own last (a parallelogram instead of 1F1B's trapezoid).
    """
    _check("ZB-H2", stages, microbatches)
    p = stages
    warmups = [2 * (p - 1 - i) for i in range(p)]
    return _split_one_f_one_b(p, microbatches, warmups, [2 * i for i in range(p)], "zb-h2")
