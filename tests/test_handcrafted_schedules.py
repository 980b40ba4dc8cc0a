"""ZB-H1, ZB-H2 (Qi et al. 2024, Figure 3) and megatron-core's interleaved 1F1B against the paper's formulas.

Times are multiples of 1/4 (exact in binary), so simulated bubbles compare with == where the paper promises
an exact value. Bubble = the paper's measure (each rank's span from its own first to its own last pass).
"""

import pytest

from megatron.zero_bubble.schedules import Costs, ScheduleError, simulate, validate
from megatron.zero_bubble.schedules.baselines import interleaved_one_f_one_b, one_f_one_b
from megatron.zero_bubble.schedules.handcrafted import zb_h1, zb_h2

# validate() also proves the send/receive lowering (comm.py) deadlock-free: check_comm is on by default.
STAGES = range(2, 9)


def uniform(p, t_f, t_b, t_w, m_f=1.0, m_w=0.25):
    return Costs.make(p, t_f=t_f, t_b=t_b, t_w=t_w, t_comm=0, m_f=m_f, m_w=m_w)


def longest_span(timeline):
    return max(timeline.span(r) for r in range(len(timeline.ranks)))


# --- bubbles -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("p", STAGES)
@pytest.mark.parametrize("t", [1.0, 2.5])
def test_bubbles_equal_paper_formulas_with_equal_pass_times(p, t):
    for m in (2 * p, 3 * p):
        costs = uniform(p, t, t, t)
        assert simulate(one_f_one_b(p, m), costs).bubble_time == (p - 1) * (t + t + t)
        assert simulate(zb_h1(p, m), costs).bubble_time == (p - 1) * (t + t - t)
        assert simulate(zb_h2(p, m), costs).bubble_time == (p - 1) * (t + t - 2 * t) == 0


@pytest.mark.parametrize("t_f, t_b, t_w", [(2, 3, 1), (1.5, 2, 1.5), (3, 2, 1), (2, 2, 0.5), (1.25, 3, 0.75)])
def test_bubbles_equal_paper_formulas_with_unequal_times_when_w_is_not_slower_than_f(t_f, t_b, t_w):
    for p in (2, 4, 8):
        m = 3 * p
        costs = uniform(p, t_f, t_b, t_w)
        assert simulate(one_f_one_b(p, m), costs).bubble_time == (p - 1) * (t_f + t_b + t_w)
        assert simulate(zb_h1(p, m), costs).bubble_time == (p - 1) * (t_f + t_b - t_w)
        assert simulate(zb_h2(p, m), costs).bubble_time == (p - 1) * max(t_f + t_b - 2 * t_w, 0)


def test_bubbles_match_paper_formulas_with_the_papers_profiled_times():
    p, m, t_f, t_b, t_w = 8, 24, 18.5, 18.1, 9.3  # the 1.5B model on A100
    costs = uniform(p, t_f, t_b, t_w)
    assert simulate(one_f_one_b(p, m), costs).bubble_time == pytest.approx((p - 1) * (t_f + t_b + t_w), rel=1e-12)
    assert simulate(zb_h1(p, m), costs).bubble_time == pytest.approx((p - 1) * (t_f + t_b - t_w), rel=1e-12)
    assert simulate(zb_h2(p, m), costs).bubble_time == pytest.approx((p - 1) * (t_f + t_b - 2 * t_w), rel=1e-12)


@pytest.mark.parametrize("t_f, t_b, t_w", [(1, 1, 2), (1, 2, 1.5), (1, 3, 2), (0.5, 1, 0.75)])
def test_when_w_is_slower_than_f_rank0_waits_for_its_first_b_longer_than_the_formula_says(t_f, t_b, t_w):
    # Rank 0's p (ZB-H1) or 2p-1 (ZB-H2) warm-up F passes cannot cover the B chain's return any more.
    for p in (2, 4, 8):
        m = 3 * p
        costs = uniform(p, t_f, t_b, t_w)
        h1 = simulate(zb_h1(p, m), costs).bubble_time
        h2 = simulate(zb_h2(p, m), costs).bubble_time
        assert h1 == (p - 1) * max(t_f + t_b - t_w, t_b) > (p - 1) * (t_f + t_b - t_w)
        assert h2 == (p - 1) * max(t_f + t_b - 2 * t_w, t_b - t_f, 0)


@pytest.mark.parametrize("p", STAGES)
def test_fewer_microbatches_than_stages_take_the_papers_time(p):
    for t_f, t_b, t_w in [(1, 1, 1), (2, 3, 1), (1.5, 1.5, 1.25)]:
        for m in range(1, p + 1):
            costs = uniform(p, t_f, t_b, t_w)
            expected = (m + p - 1) * (t_f + t_b) + t_w
            assert longest_span(simulate(zb_h1(p, m), costs)) == expected
            assert longest_span(simulate(zb_h2(p, m), costs)) == expected
            assert longest_span(simulate(one_f_one_b(p, m), costs)) == (m + p - 1) * (t_f + t_b + t_w)


@pytest.mark.parametrize("p", STAGES)
def test_zb_h2_bubble_shrinks_one_pass_per_microbatch_until_zero_at_2p_minus_1(p):
    for m in range(1, 3 * p + 1):
        assert simulate(zb_h2(p, m), uniform(p, 1, 1, 1)).bubble_time == max(2 * p - 1 - m, 0)


# --- memory --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("p", STAGES)
def test_peak_memory_per_stage_matches_the_paper(p):
    m_b, m_w = 1.0, 0.25
    costs = uniform(p, 1, 1, 1, m_f=m_b, m_w=m_w)
    m = 3 * p
    one_f = simulate(one_f_one_b(p, m), costs).peak_memory
    h1 = simulate(zb_h1(p, m), costs).peak_memory
    h2 = simulate(zb_h2(p, m), costs).peak_memory
    for i in range(1, p + 1):  # 1-indexed stage, as in the paper
        assert one_f[i - 1] == (p - i + 1) * m_b
        assert h1[i - 1] == (p - i + 1) * m_b + (i - 1) * m_w
        assert h2[i - 1] == (2 * p - 2 * i + 1) * m_b + 2 * (i - 1) * m_w
    assert max(one_f) == max(h1) == p * m_b
    assert max(h2) == (2 * p - 1) * m_b


@pytest.mark.parametrize("p", STAGES)
def test_memory_limits_p_for_zb_h1_and_2p_minus_1_for_zb_h2_hold_and_are_tight(p):
    costs = uniform(p, 1, 1, 1, m_f=1.0, m_w=1.0)  # worst case: B keeps everything for W
    for m in (1, p, 3 * p):
        validate(zb_h1(p, m), costs, memory_limit=p)
        validate(zb_h2(p, m), costs, memory_limit=2 * p - 1)
    with pytest.raises(ScheduleError, match="above its limit"):
        validate(zb_h1(p, 3 * p), costs, memory_limit=p - 1)
    with pytest.raises(ScheduleError, match="above its limit"):
        validate(zb_h2(p, 3 * p), costs, memory_limit=2 * p - 2)


# --- validity and form ---------------------------------------------------------------------------------

@pytest.mark.parametrize("p", STAGES)
def test_all_single_chunk_schedules_validate_for_every_microbatch_count(p):
    costs = uniform(p, 1, 1.5, 0.75)
    for m in range(1, 3 * p + 1):
        for schedule in (one_f_one_b(p, m), zb_h1(p, m), zb_h2(p, m)):
            validate(schedule, costs)


@pytest.mark.parametrize("build, name", [(zb_h1, "zb-h1"), (zb_h2, "zb-h2")])
def test_zb_schedules_are_single_chunk_split_backward_with_w_in_microbatch_order(build, name):
    for p, m in [(2, 1), (4, 3), (4, 12), (8, 24)]:
        s = build(p, m)
        assert (s.name, s.layout, s.chunks, s.stages, s.microbatches) == (name, "single", 1, p, m)
        for passes in s.ranks:
            assert {x.op for x in passes} == {"F", "B", "W"}
            for op in "FBW":
                assert [x.mb for x in passes if x.op == op] == list(range(m))


def test_zb_h1_keeps_1f1b_warmup_and_zb_h2_doubles_it():
    p, m = 4, 12
    for rank, (h1, h2, base) in enumerate(zip(zb_h1(p, m).ranks, zb_h2(p, m).ranks, one_f_one_b(p, m).ranks)):
        def forwards_before_first_backward(passes):
            return next(i for i, x in enumerate(passes) if x.op != "F")

        assert forwards_before_first_backward(h1) == forwards_before_first_backward(base) == p - rank
        assert forwards_before_first_backward(h2) == 2 * (p - 1 - rank) + 1


def test_zb_schedules_refuse_empty_pipelines():
    with pytest.raises(ScheduleError, match="at least one"):
        zb_h1(2, 0)
    with pytest.raises(ScheduleError, match="at least one"):
        zb_h2(0, 4)


# --- interleaved 1F1B ----------------------------------------------------------------------------------

def chunked(p, c, t=12.0):
    """Each of a rank's c chunks takes 1/c of the work (t is divisible by 2, 3 and 4: exact times)."""
    return Costs.make(p * c, t_f=t / c, t_b=t / c, t_w=t / c, t_comm=0, chunks=c)


@pytest.mark.parametrize("p", STAGES)
def test_interleaved_validates_and_cuts_the_1f1b_bubble_by_the_chunk_count(p):
    t = 12.0
    for m in (p, 2 * p, 3 * p):
        one_f = simulate(one_f_one_b(p, m), uniform(p, t, t, t)).bubble_time
        for c in (2, 3, 4):
            timeline = validate(interleaved_one_f_one_b(p, m, c), chunked(p, c, t))
            assert timeline.bubble_time == (p - 1) * 3 * t / c < one_f


def test_interleaved_follows_megatrons_virtual_microbatch_table():
    # megatron-core's own example: PP2, VP2, N=3, M=5 -> microbatches 0 1 2 0 1 2 3 4 3 4, chunks 0 0 0 1 1 1 0 0 1 1
    s = interleaved_one_f_one_b(2, 5, 2, group_size=3)
    forwards = [(x.mb, x.chunk) for x in s.ranks[0] if x.op == "F"]
    assert forwards == list(zip([0, 1, 2, 0, 1, 2, 3, 4, 3, 4], [0, 0, 0, 1, 1, 1, 0, 0, 1, 1]))
    backwards = [(x.mb, x.chunk) for x in s.ranks[0] if x.op == "BW"]
    assert backwards == list(zip([0, 1, 2, 0, 1, 2, 3, 4, 3, 4], [1, 1, 1, 0, 0, 0, 1, 1, 0, 0]))
    assert (s.name, s.layout, s.chunks) == ("interleaved-1f1b", "interleaved", 2)


@pytest.mark.parametrize("p, m, c", [(4, 8, 2), (4, 4, 3), (8, 24, 2), (3, 3, 4)])
def test_interleaved_warmup_is_megatrons(p, m, c):
    for rank, passes in enumerate(interleaved_one_f_one_b(p, m, c).ranks):
        warmup = min(m * c, 2 * (p - rank - 1) + (c - 1) * p)
        first_bw = next(i for i, x in enumerate(passes) if x.op == "BW")
        assert first_bw == min(warmup + 1, m * c)  # the steady state starts with one more F


def test_interleaved_accepts_a_group_size_whose_remainder_is_at_least_p():
    validate(interleaved_one_f_one_b(4, 10, 2, group_size=6), chunked(4, 2))


@pytest.mark.parametrize(
    "args, message",
    [
        ((4, 6, 2), "multiple of the microbatch group size"),
        ((4, 10, 2, 4), "multiple of the microbatch group size"),
        ((4, 3, 2), r"lie in \[p=4, m=3\]"),
        ((4, 8, 2, 3), r"lie in \[p=4, m=8\]"),
        ((4, 8, 2, 9), r"lie in \[p=4, m=8\]"),
        ((4, 8, 1), "at least 2 stages and 2 chunks"),
        ((1, 8, 2), "at least 2 stages and 2 chunks"),
        ((4, 0, 2), "at least one microbatch"),
    ],
)
def test_interleaved_refuses_what_megatron_refuses(args, message):
    with pytest.raises(ScheduleError, match=message):
        interleaved_one_f_one_b(*args)
