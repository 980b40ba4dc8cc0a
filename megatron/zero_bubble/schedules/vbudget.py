"""V schedules under a memory budget: ZB-V, V-Half, V-Min, and the best plan for any budget in between.

The budget is per rank, in in-flight microbatches (multiples of a rank's M_B) or in the costs' unit
(bytes), like --zero-bubble-max-pending-backward. The reference implementation's short form,
--zero-bubble-v-schedule-mem-setup min|half|zb, names three budgets: V-Min's floor((p+4)/3) M_B,
V-Half's floor((p+2)/2) M_B and ZB-V's p M_B (`mem_setup_limit`). Less than V-Min's is refused.

Plans come from a fixed ladder of memory levels (V-Min's, V-Half's, some whole microbatches between,
p, and 1.5p and 2p above). Each level gets its own candidates, every one held to that level's memory on
every rank:
- at V-Min's and V-Half's: the paper's building blocks (vblocks.paper_shape) and blocks laid out on a
  grid of the real costs (vblocks.Grid.of) with the shortest periods whose memory fits, read off for m
  microbatches and squeezed (vcompact: left- then right-justified, right- then left-justified, or with
  the W passes refilled);
- at the others: the greedy list scheduler of vshape.py, seeded with the paper's ZB-V where that fits.
A budget takes the best simulated plan (the paper's bubble, then makespan) of every level it covers, so
a larger budget can only do as well or better (a budget between two levels gets the lower one's plan),
and p M_B gives ZB-V's plan. The ladder and the candidates depend on p, m and the costs only; how many
are tried shrinks as the 6pm passes grow, so that p = 32, m = 128 plans in seconds. Pure Python.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Callable

from .costs import Costs
from .memory import memory_profile
from .problem import MemoryLimit
from .schedule import Schedule, ScheduleError, rank_stages
from .simulate import simulate
from .vblocks import Block, Grid, Shape, block_order, build_block, paper_shape
from .vcompact import left_justify, refill_weight_passes, right_justify
from .vshape import (LAYOUT, PACED_POLICIES, POLICIES, Policy, VGreedy, paper_v_order, v_half_memory_limit,
                     v_min_memory_limit, zb_v_memory_limit)

_EPS = 1e-9
MEM_SETUPS = {"min": v_min_memory_limit, "half": v_half_memory_limit, "zb": zb_v_memory_limit}
# Passes (6pm) up to which every candidate is tried, up to which the reduced sets are, and above which only
# the paper's blocks and ZB-V order with the greedy seeded by it (p = 32, m = 256 is 49152 passes).
_FULL_EFFORT, _MEDIUM_EFFORT, _LARGE_EFFORT = 4000, 12000, 50000


def mem_setup_limit(setup: str, stages: int) -> float:
    """--zero-bubble-v-schedule-mem-setup min|half|zb as a budget in in-flight microbatches (M_B)."""
    try:
        return float(MEM_SETUPS[setup](stages))
    except KeyError:
        raise ScheduleError(f"unknown V memory setup {setup!r}; choose one of {', '.join(MEM_SETUPS)}") from None


def memory_levels(stages: int, microbatches: int) -> tuple[float, ...]:
    """The fixed ladder of budgets (in M_B) that plans are made for: V-Min's, V-Half's, whole microbatches
    between V-Half's and p (fewer of them for large pipelines), p, 1.5p and 2p."""
    low, half, full = v_min_memory_limit(stages), v_half_memory_limit(stages), zb_v_memory_limit(stages)
    between = list(range(int(half) + 1, int(full)))
    passes = 6 * stages * microbatches
    if passes > _MEDIUM_EFFORT:
        between = []
    elif passes > _FULL_EFFORT and len(between) > 2:
        between = [between[len(between) // 3], between[2 * len(between) // 3]]
    return tuple(sorted({float(low), float(half), *map(float, between), float(full), 1.5 * full, 2.0 * full}))


@dataclass
class _Candidate:
    order: list
    how: dict
    score: tuple  # (bubble rate, makespan), rounded so that float noise cannot reorder equal plans


class _Planner:
    """Candidates per memory level for one (p, m, costs), worked out on demand and kept."""

    def __init__(self, stages: int, microbatches: int, costs: Costs):
        self.p, self.m, self.costs = stages, microbatches, costs
        self.rank_mb = costs.rank_microbatch_memory(rank_stages(LAYOUT, stages, 2))  # M_B of each rank
        self.passes = 6 * stages * microbatches
        self.levels = memory_levels(stages, microbatches)
        self.done: dict[float, list[_Candidate]] = {}
        self._paper_v: Schedule | None = None  # the paper's ZB-V order and its peaks, worked out once
        self._paper_peaks: list[float] = []

    # -- evaluation -------------------------------------------------------------------------------------

    def _schedule(self, order) -> Schedule:
        return Schedule(self.p, 2, self.m, LAYOUT, order)

    def _keep(self, found: list[_Candidate], order, how: dict, limits: list[float]):
        """Simulate an order and keep it if it fits `limits`; returns it as a Schedule with its timeline (for
        further squeezing), or None."""
        if order is None:
            return None
        schedule = self._schedule(order)
        peaks = [max(profile, default=0.0) for profile in memory_profile(schedule, self.costs)]
        if any(peak > limit * (1 + _EPS) + _EPS for peak, limit in zip(peaks, limits)):
            return None
        timeline = simulate(schedule, self.costs)
        found.append(_Candidate(order, how, (round(timeline.bubble_rate, 12), round(timeline.makespan, 9))))
        return schedule, timeline

    # -- candidates of one level ------------------------------------------------------------------------

    def at(self, level: float) -> list[_Candidate]:
        if level not in self.done:
            limits = [level * mb for mb in self.rank_mb]
            found: list[_Candidate] = []
            named = level in (v_min_memory_limit(self.p), v_half_memory_limit(self.p))
            if named:
                for block, how, squeezes in self._blocks(level, limits):
                    self._squeezed(found, block_order(block, self.p, self.m), how, squeezes, limits)
            # At V-Min's and V-Half's memory the greedy never came close to the blocks; it plans the rest (for
            # large plans not above p M_B, where it found little more than at p M_B and took seconds).
            above = level > self.p and self._effort() in ("large", "huge")
            if (not named or not found or level >= self.p) and not above:
                self._greedy(found, level, limits)
            self.done[level] = found
        return self.done[level]

    def _squeezed(self, found, order, how: dict, squeezes: str, limits: list[float]) -> None:
        """The block's own order and the squeezes named in `squeezes`: L (left-, then right-justified),
        R (right-, then left-justified), W (W passes refilled)."""
        kept = self._keep(found, order, how, limits)
        if kept is None:
            return
        base, timeline = kept
        for squeeze in squeezes:
            if squeeze == "L":
                left = left_justify(base, self.costs, limits, timeline)
                self._keep(found, right_justify(left, self.costs, limits).ranks,
                           how | {"squeeze": "left-, then right-justified"}, limits)
            elif squeeze == "R":
                right = right_justify(base, self.costs, limits, timeline)
                self._keep(found, left_justify(right, self.costs, limits).ranks,
                           how | {"squeeze": "right-, then left-justified"}, limits)
            elif squeeze == "W":
                self._keep(found, refill_weight_passes(base, self.costs, limits).ranks,
                           how | {"squeeze": "W refilled"}, limits)

    # Which blocks and squeezes each effort tries: (shape, which of the fitting periods, squeezes). Chosen by
    # how much of the best of every combination they keep, over p 4..16, m 2p and 4p, the paper's 1.5B,
    # 6.2B and 14.6B costs, equal costs and uneven stages with T_comm > 0, at V-Min's and V-Half's memory.
    # Large: the plain mirrored shape never beat the mirrored half one at p = 32 (issue 12's cost sets) or on
    # the paper's ZB-V rows, and at V-Min's memory neither beat the paper's block squeezed; huge (p = 64,
    # m = 512 and beyond) keeps the paper's blocks only, V-Half's refilled.
    _GRID_TRIES = {
        "full": (("mirrored half", 0, "LR"), ("mirrored", 0, "WL"), ("mirrored", 1, "L"), ("mirrored", 2, "W"),
                 ("half", 0, "L")),
        "medium": (("mirrored half", 0, "LR"), ("mirrored", 0, "WL"), ("mirrored", 1, "L")),
        "large": (("mirrored half", 0, "L"),),
        "huge": (),
    }
    # The paper's blocks: at V-Min's memory squeezed from both sides; at V-Half's also with W refilled (which
    # is what matches the reference implementation's V-Half with equal pass times).
    _PAPER_TRIES = {("full", "min"): "LRW", ("full", "half"): "LRW", ("medium", "min"): "LR",
                    ("medium", "half"): "LRW", ("large", "min"): "L", ("large", "half"): "W", ("huge", "min"): "",
                    ("huge", "half"): "W"}

    def _effort(self) -> str:
        if self.passes <= _MEDIUM_EFFORT:
            return "full" if self.passes <= _FULL_EFFORT else "medium"
        return "large" if self.passes <= _LARGE_EFFORT else "huge"

    def _blocks(self, level: float, limits: list[float]):
        """Building blocks for V-Min's or V-Half's memory: the paper's block of that name, and shapes on a
        grid of the real costs with the shortest periods that fit."""
        effort = self._effort()
        low, half = v_min_memory_limit(self.p), v_half_memory_limit(self.p)
        kinds = (["min"] if level == low else []) + (["half"] if level == half else [])
        for kind in kinds:
            block = build_block(self.p, Grid.unit(2 * self.p), paper_shape(self.p, kind))
            if block is not None:
                yield block, {"block": f"paper V-{kind.capitalize()}"}, self._PAPER_TRIES[effort, kind]
        quantum = min(self.costs.t_w)
        grid = Grid.of(self.costs, quantum)
        if grid == Grid.unit(2 * self.p):  # equal passes: the paper's slots; two slots a pass give the shapes room
            quantum /= 2
            grid = Grid.of(self.costs, quantum)
        shapes = dict(self._grid_shapes(grid))
        fitting: dict[str, list[Block]] = {}
        tries = self._GRID_TRIES[effort] if kinds != ["min"] or effort != "large" else ()
        for shape_name, which, squeezes in tries:
            if shape_name not in fitting:
                wanted = 1 + max(w for s, w, _ in self._GRID_TRIES[effort] if s == shape_name)
                fitting[shape_name] = list(self._fitting(grid, shapes[shape_name], limits, wanted))
            if which < len(fitting[shape_name]):
                block = fitting[shape_name][which]
                yield block, {"block": f"{shape_name} shape on a grid of {quantum:.4g} {self.costs.time_unit}",
                              "period_slots": block.period}, squeezes

    @staticmethod
    def _grid_shapes(grid: Grid):
        """V-Min's chain without waits; V-Half's, waiting a pass down the V and back up; its mirror image,
        waiting a pass (or half of one) up the V and back down."""
        f, b = min(grid.f), min(grid.b)
        yield "min", Shape()
        yield "half", Shape(down=f, back_up=b, back_turn=b)
        yield "mirrored", Shape(up=f, back_down=b)
        yield "mirrored half", Shape(up=max(1, f // 2), back_down=max(1, b // 2))

    def _fitting(self, grid: Grid, shape: Shape, limits: list[float], wanted: int):
        """The first `wanted` blocks, by fewest extra slots per period (up to the work again), whose memory
        fits: a longer period can still squeeze better."""
        work = max(sum(grid.f[v] + grid.b[v] + grid.w[v] for v in own) for own in rank_stages(LAYOUT, self.p, 2))
        for extra in range(0, work + 1):
            block = build_block(self.p, grid, shape, extra)
            if block is not None and self._block_fits(block, limits):
                yield block
                wanted -= 1
                if not wanted:
                    return

    def _block_fits(self, block: Block, limits: list[float]) -> bool:
        """Whether the block's steady state fits: enough copies to reach it, memory per rank."""
        span = max(block.w + block.b) - min(block.f)
        copies = span // block.period + 3
        schedule = Schedule(self.p, 2, copies, LAYOUT, block_order(block, self.p, copies))
        return all(max(profile) <= limit * (1 + _EPS) + _EPS
                   for profile, limit in zip(memory_profile(schedule, self.costs), limits))

    def _paper(self) -> Schedule:
        if self._paper_v is None:
            self._paper_v = self._schedule(paper_v_order(self.p, self.m))
            self._paper_peaks = [max(profile, default=0.0) for profile in memory_profile(self._paper_v, self.costs)]
        return self._paper_v

    def _paper_fits(self, level: float) -> bool:
        """Whether the paper's ZB-V order fits the memory of `level` on every rank."""
        self._paper()
        return all(peak <= level * mb + _EPS for peak, mb in zip(self._paper_peaks, self.rank_mb))

    def _greedy(self, found, level: float, limits: list[float]) -> None:
        """vshape's list scheduler under this level; where the paper's ZB-V fits, that order too, and greedy
        drains after its warm-up and steady state (the best ZB-V plans: only they are tried for large p*m)."""
        paper = self._paper()
        paper_fits = self._paper_fits(level)
        effort = self._effort()
        seeds: list[tuple[Policy, list | None]] = []
        if paper_fits:  # ZB-V's memory: the paper's order seeds the best runs (and it is a plan itself, kept at
            # the lowest level it fits: the same order on a higher level could only tie with it)
            if not any(lower < level and self._paper_fits(lower) for lower in self.levels):
                self._keep(found, paper.ranks, {"paper_order": "ZB-V"}, limits)
            until_last_f = [r[: max(i for i, x in enumerate(r) if x.op == "F") + 1] for r in paper.ranks]
            seeds += [(policy, until_last_f) for policy in POLICIES[:2 if effort == "full" else 1]]
            seeds += [(policy, None) for policy in POLICIES[:2 if effort == "full" else 0]]
        else:
            seeds += [(policy, None) for policy in POLICIES[:3] + PACED_POLICIES[:3 if effort == "full" else 1]]
        runs = []
        for policy, prefix in seeds:
            greedy = VGreedy(self.p, self.m, self.costs, limits, policy, prefix)
            order = greedy.run()
            if order is not None:
                how = {"greedy": asdict(policy)} | ({"seed": "paper V until each rank's last F"} if prefix else {})
                runs.append((greedy.bubble_rate(), order, how))
        runs.sort(key=lambda run: run[0])  # each run's own timeline; simulate the best few
        for _, order, how in runs[:3 if effort == "full" else 1]:
            self._keep(found, order, how, limits)

    # -- the plan for a budget --------------------------------------------------------------------------

    def best(self, limits: list[float]) -> tuple[_Candidate, float] | None:
        """The best candidate of every level the per-rank `limits` cover, and its level."""
        best = None
        for level in self.levels:
            if any(level * mb > limit * (1 + _EPS) + _EPS for mb, limit in zip(self.rank_mb, limits)):
                break  # the ladder grows: no higher level fits either
            for candidate in self.at(level):
                if best is None or candidate.score < best[0].score:
                    best = (candidate, level)
        return self._no_slower_than_the_paper(best, limits)

    def _no_slower_than_the_paper(self, best, limits: list[float]):
        """The paper's ZB-V order itself where it fits `limits` and beats `best` (by the planner's measure, the bubble
        then the makespan): the ladder's levels are whole steps, and a budget between two of them that holds ZB-V's
        own peaks must not get a worse plan."""
        paper, found = self._paper(), []
        if self._keep(found, paper.ranks, {"order": "the paper's ZB-V"}, limits) is None:
            return best
        if best is not None and best[0].score <= found[0].score:
            return best
        return found[0], max(peak / mb for peak, mb in zip(self._paper_peaks, self.rank_mb))


def _costs_for(name: str, stages: int, microbatches: int, costs: Costs | None) -> Costs:
    if stages < 2 or microbatches < 1:
        raise ScheduleError(f"{name} needs at least 2 stages and 1 microbatch, got {stages} and {microbatches}")
    costs = costs if costs is not None else Costs.make(2 * stages, chunks=2)
    if costs.num_virtual_stages != 2 * stages:
        raise ScheduleError(f"{name} needs costs for {2 * stages} virtual stages, got {costs.num_virtual_stages}")
    return costs


def _refuse_below_v_min(name: str, stages: int, costs: Costs, limit: MemoryLimit, limits: list[float]) -> None:
    low = v_min_memory_limit(stages)
    for r, (given, one) in enumerate(zip(limits, costs.rank_microbatch_memory(rank_stages(LAYOUT, stages, 2)))):
        need = low * one
        if given < need * (1 - _EPS) - _EPS:
            what = (f"{limit.amount:.4g} M_B" if not limit.absolute
                    else f"{given:.4g} {costs.memory_unit} (rank {r} needs {need:.4g})")
            raise ScheduleError(
                f"{name}: memory budget {what} is below V-Min's floor((p+4)/3) = {low:g} M_B per rank, "
                f"the least a V schedule is planned for at p={stages}")


def plan_v(name: str, stages: int, microbatches: int, costs: Costs | None, memory_limit: MemoryLimit) -> Schedule:
    """The best V schedule this module finds within the per-rank budget `memory_limit`."""
    return v_plans(stages, microbatches, costs, {name: memory_limit})[name]


def v_plans(stages: int, microbatches: int, costs: Costs | None, budgets: dict) -> dict:
    """The best V schedule within each of several budgets ({key: MemoryLimit}; a string key names the
    schedule), sharing the work of the memory levels they have in common."""
    costs = _costs_for(str(next(iter(budgets), "zb-v")), stages, microbatches, costs)
    planner, plans = _Planner(stages, microbatches, costs), {}
    for key, memory_limit in budgets.items():
        name = key if isinstance(key, str) else "zb-v"
        limits = memory_limit.per_rank(stages, 2, LAYOUT, costs)
        _refuse_below_v_min(name, stages, costs, memory_limit, limits)
        found = planner.best(limits)
        if found is None:
            raise ScheduleError(f"{name} found no schedule within the memory budget; raise the budget")
        candidate, level = found
        info = {"planner": candidate.how | {"memory_level": level}}
        plans[key] = Schedule(stages, 2, microbatches, LAYOUT, candidate.order, name=name, info=info)
    return plans


def budget_curve(stages: int, microbatches: int, costs: Costs | None = None,
                 progress: Callable[[str], None] | None = None) -> list[tuple[float, float, float]]:
    """The trade-off for given costs: for every memory level from V-Min's to p M_B, (level in M_B, the
    budget it means for the rank with the largest M_B in the costs' unit, bubble rate of the best plan
    within it). The bubble never rises along the list."""
    costs = _costs_for("zb-v", stages, microbatches, costs)
    planner = _Planner(stages, microbatches, costs)
    curve, best = [], None
    for level in planner.levels:
        if level > zb_v_memory_limit(stages):
            break
        if progress is not None:
            progress(f"planning for {level:g} M_B")
        for candidate in planner.at(level):
            if best is None or candidate.score < best.score:
                best = candidate
        if best is not None:
            curve.append((level, level * max(planner.rank_mb), best.score[0]))
    return curve


def _limit(memory_limit: MemoryLimit | float | None, default: float) -> MemoryLimit:
    """The given limit (a MemoryLimit or in-flight microbatches), else the default."""
    limit = MemoryLimit.of(memory_limit)
    return MemoryLimit(default) if limit is None else limit


def zb_v(stages, microbatches, costs=None, memory_limit: MemoryLimit | float | None = None) -> Schedule:
    """ZB-V: the best V plan within the budget, p M_B (1F1B's peak) by default; zero bubble with
    T_F = T_B = T_W there. Any budget from V-Min's up is accepted."""
    return plan_v("zb-v", stages, microbatches, costs, _limit(memory_limit, zb_v_memory_limit(stages)))


def v_half(stages, microbatches, costs=None, memory_limit: MemoryLimit | float | None = None) -> Schedule:
    """V-Half: the same planner within about half of 1F1B's activation memory, (p+2)//2 M_B by default."""
    return plan_v("v-half", stages, microbatches, costs, _limit(memory_limit, v_half_memory_limit(stages)))


def v_min(stages, microbatches, costs=None, memory_limit: MemoryLimit | float | None = None) -> Schedule:
    """V-Min: the same planner within about a third of 1F1B's activation memory, (p+4)//3 M_B by default."""
    return plan_v("v-min", stages, microbatches, costs, _limit(memory_limit, v_min_memory_limit(stages)))
