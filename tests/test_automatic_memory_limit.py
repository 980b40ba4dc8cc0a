"""`--zero-bubble-max-pending-backward auto` on GPU: each pipeline rank's limit, in bytes, is a share of the free
device memory of its GPUs (the safety margin, `--zero-bubble-adaptive-memory-limit-percentile`), capped at the
planner's default amount of that rank's microbatches. RankZeroPlanner.memory_limit is arithmetic on what the ranks
report, so it is checked here without a GPU; the planner then holds each rank to its own limit."""
import pytest

from megatron.zero_bubble.runtime.planning import DEVICE_MEMORY_SHARE, PlanSettings, RankZeroPlanner
from megatron.zero_bubble.schedules import Costs
from megatron.zero_bubble.schedules.memory import memory_profile
from megatron.zero_bubble.schedules.planners import PlanRequest, plan

GIB = 2**30
# M_B of each stage in bytes: the last one carries the LM head
COSTS = Costs.make(4, m_f=(1 * GIB, 1 * GIB, 1 * GIB, 2 * GIB), memory_unit="bytes")


def _reported(free: list[float], replicas: int = 1) -> list[dict]:
    """What each GPU reports: its free memory and its pipeline rank (rank r's replicas report r too)."""
    return [{"free_bytes": amount, "pp_rank": rank} for _ in range(replicas) for rank, amount in enumerate(free)]


def _limit(free: list[float], share: float = DEVICE_MEMORY_SHARE, schedule: str = "zb-auto", logged=None,
           replicas: int = 1):
    settings = PlanSettings(schedule=schedule, stages=4, chunks=1, memory_limit=None, device_memory_share=share)
    planner = RankZeroPlanner(settings, log=(logged.append if logged is not None else print))
    return planner.memory_limit(COSTS, _reported(free, replicas))


def test_each_rank_gets_a_share_of_its_own_free_memory_in_bytes():
    limit = _limit([20 * GIB, 5 * GIB, 3 * GIB, 13 * GIB])
    # 0.9 of each rank's free memory, capped at zb-auto's default 2p = 8 of the rank's microbatches (rank 0: 8 GiB)
    assert limit.ranks == pytest.approx((8 * GIB, 4.5 * GIB, 2.7 * GIB, 11.7 * GIB))
    assert limit.per_rank(4, 1, "single", COSTS) == list(limit.ranks)


def test_a_rank_with_several_gpus_takes_the_least_free_of_them():
    settings = PlanSettings(schedule="zb-auto", stages=4, chunks=1, memory_limit=None)
    gathered = _reported([4 * GIB] * 4) + [{"free_bytes": 2 * GIB, "pp_rank": 2}]
    assert RankZeroPlanner(settings).memory_limit(COSTS, gathered).ranks[2] == pytest.approx(1.8 * GIB)


def test_the_margin_is_settable_like_the_original_implementations_percentile():
    assert _limit([4 * GIB] * 4, share=0.5).ranks == pytest.approx((2 * GIB,) * 3 + (2 * GIB,))
    assert _limit([4 * GIB] * 4, share=1.0).ranks == pytest.approx((4 * GIB,) * 4)


def test_too_little_memory_plans_one_microbatch_there_with_a_warning():
    logged = []
    limit = _limit([10 * GIB, 10 * GIB, 10 * GIB, 1 * GIB], logged=logged)
    assert limit.ranks[3] == 2 * GIB  # one of the last rank's microbatches
    assert len(logged) == 1 and "pipeline rank 3" in logged[0] and "less than one microbatch" in logged[0]


def test_the_planner_holds_each_rank_to_its_own_bytes():
    """The rank with the least room gets the fewest microbatches in flight; none goes past its own limit."""
    limit = _limit([20 * GIB, 20 * GIB, 3.5 * GIB, 20 * GIB])
    schedule = plan("zb-auto", PlanRequest(stages=4, microbatches=12, costs=COSTS, memory_limit=limit,
                                           ilp_time_limit=0))
    peaks = [max(rank) for rank in memory_profile(schedule, COSTS)]
    assert all(peak <= amount * (1 + 1e-9) for peak, amount in zip(peaks, limit.ranks))
    assert peaks[2] <= 3.15 * GIB < peaks[1]


def test_without_device_memory_figures_the_planners_default_applies():
    settings = PlanSettings(schedule="zb-auto", stages=4, chunks=1, memory_limit=None)
    planner = RankZeroPlanner(settings)
    assert planner.memory_limit(COSTS, [{}, {}]) is None  # CPU: no free_bytes reported
    assert planner.memory_limit(Costs.make(4), _reported([13 * GIB] * 4)) is None  # costs not in bytes yet
