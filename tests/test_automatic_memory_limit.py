"""`--zero-bubble-max-pending-backward auto` on GPU: the limit rank 0 plans with is what a share of the free device
memory holds (the safety margin, `--zero-bubble-adaptive-memory-limit-percentile`), capped at the planner's default.
RankZeroPlanner.memory_limit is pure arithmetic on what the ranks report, so it is checked here without a GPU."""
from megatron.zero_bubble.runtime.planning import DEVICE_MEMORY_SHARE, PlanSettings, RankZeroPlanner
from megatron.zero_bubble.schedules import Costs

GIB = 2**30
# M_B of each stage in bytes: the last one carries the LM head
COSTS = Costs.make(4, m_f=(1 * GIB, 1 * GIB, 1 * GIB, 2 * GIB), memory_unit="bytes")


def _limit(free: list[float], share: float = DEVICE_MEMORY_SHARE, schedule: str = "zb-auto", logged=None):
    settings = PlanSettings(schedule=schedule, stages=4, chunks=1, memory_limit=None, device_memory_share=share)
    planner = RankZeroPlanner(settings, log=(logged.append if logged is not None else print))
    return planner.memory_limit(COSTS, [{"free_bytes": f} for f in free])


def test_the_limit_is_a_share_of_the_least_free_memory_over_the_largest_microbatch():
    # 0.9 of 13 GiB (the least free of any rank) over 2 GiB (the largest M_B): 5 microbatches, not 6
    assert _limit([20 * GIB, 13 * GIB, 30 * GIB, 40 * GIB]) == 5.0


def test_the_margin_is_settable_like_the_original_implementations_percentile():
    assert _limit([13 * GIB] * 4, share=0.5) == 3.0  # floor(6.5 GiB / 2 GiB)
    assert _limit([13 * GIB] * 4, share=1.0) == 6.0


def test_plenty_of_memory_gives_the_planners_default_and_too_little_one_microbatch_with_a_warning():
    assert _limit([1000 * GIB] * 4) == 8.0  # zb-auto's default: 2p
    logged = []
    assert _limit([1 * GIB] * 4, logged=logged) == 1.0
    assert len(logged) == 1 and "--zero-bubble-max-pending-backward 1" in logged[0]


def test_without_device_memory_figures_the_planners_default_applies():
    settings = PlanSettings(schedule="zb-auto", stages=4, chunks=1, memory_limit=None)
    planner = RankZeroPlanner(settings)
    assert planner.memory_limit(COSTS, [{}, {}]) is None  # CPU: no free_bytes reported
    assert planner.memory_limit(Costs.make(4), [{"free_bytes": 13 * GIB}]) is None  # costs not in bytes yet
