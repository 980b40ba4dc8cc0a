"""What a planner is asked for: the request and its memory limit, shared by the registry and the planners.

`planners.plan(name, request)` fills in a request's defaults (chunks, costs, memory limit) from the
registry before it calls a planner, so no planner needs the registry.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .costs import Costs
from .errors import ScheduleError
from .schedule import stage_owner


@dataclass(frozen=True)
class MemoryLimit:
    """A per-rank activation-memory limit in one of three units.

    In-flight microbatches (the default): multiples of each rank's own one-microbatch activations M_B, the
    unit users think in (p = ZB-1p, 2p = ZB-2p). Absolute: the costs' memory unit (bytes when the costs
    carry bytes), the same amount on every rank, or one of its own for each (`ranks`: what each GPU has room for
    beside its model state). Of 1F1B (`of_1f1b`): multiples of the largest activation memory
    any rank holds under 1F1B on the same costs, on every rank ("1x": no rank holds more than 1F1B's fullest; where
    the last stage's microbatch is larger, p M_B is not that); the planner resolves it into an absolute amount
    (`resolved`).
    """

    amount: float
    absolute: bool = False
    of_1f1b: bool = False
    ranks: tuple[float, ...] | None = None  # absolute, one amount per pipeline rank (`per_rank_amounts`)

    @classmethod
    def of(cls, microbatches: MemoryLimit | float | None = None, absolute: float | None = None) -> MemoryLimit | None:
        """The limit from a MemoryLimit, a count of in-flight microbatches, or (the command line's two
        spellings) an absolute amount; None when none is given."""
        if microbatches is not None and absolute is not None:
            raise ScheduleError("give the memory limit in microbatches or in the costs' unit, not both")
        if isinstance(microbatches, MemoryLimit):
            return microbatches
        if absolute is not None:
            return cls(absolute, absolute=True)
        return None if microbatches is None else cls(microbatches)

    @classmethod
    def per_rank_amounts(cls, amounts) -> MemoryLimit:
        """An absolute limit of its own for each pipeline rank (bytes: what each GPU has room for)."""
        amounts = tuple(float(a) for a in amounts)
        if not amounts or min(amounts) <= 0:
            raise ScheduleError(f"per-rank memory limits must be positive, got {list(amounts)}")
        return cls(max(amounts), absolute=True, ranks=amounts)

    @classmethod
    def of_1f1b_peak(cls, multiple: float) -> MemoryLimit:
        if multiple <= 0:
            raise ScheduleError(f"memory limit must be positive, got {multiple:g}x 1F1B's")
        return cls(multiple, of_1f1b=True)

    @classmethod
    def parse_of_1f1b(cls, text: str) -> MemoryLimit | None:
        """'Nx' (N times 1F1B's fullest rank) as a limit; None for any text without the x; ValueError or
        ScheduleError for a bad N. The command lines' one spelling of it."""
        text = text.strip()
        if not text.lower().endswith("x"):
            return None
        return cls.of_1f1b_peak(float(text[:-1]))

    def resolved(self, one_f_one_b_peaks: list[float]) -> MemoryLimit:
        """An of-1F1B limit as an absolute amount: the multiple of the largest of 1F1B's per-rank peaks."""
        if not self.of_1f1b:
            return self
        return MemoryLimit(self.amount * max(one_f_one_b_peaks), absolute=True)

    def per_rank(self, stages: int, chunks: int, layout: str, costs: Costs) -> list[float]:
        """Each rank's limit in the costs' unit."""
        if self.of_1f1b:
            raise ScheduleError("a memory limit relative to 1F1B's peak must be resolved by the planner first")
        if self.ranks is not None:
            if len(self.ranks) != stages:
                raise ScheduleError(f"per-rank memory limits for {len(self.ranks)} ranks, the pipeline has {stages}")
            return list(self.ranks)
        if self.absolute:
            return [float(self.amount)] * stages
        # Checked here, where it is applied, as every caller reports planning errors from here on.
        if self.amount <= 0:
            raise ScheduleError(f"memory limit must be positive, got {self.amount}")
        owned = [[] for _ in range(stages)]
        for v in range(stages * chunks):
            owned[stage_owner(layout, stages, v)[0]].append(v)
        return [self.amount * m for m in costs.rank_microbatch_memory(owned)]

    def to_info(self) -> dict:
        """The two keys a schedule's JSON has always carried for its limit."""
        return {"memory_limit": None if self.absolute else self.amount,
                "memory_limit_absolute": self.amount if self.absolute else None,
                **({"memory_limit_per_rank": list(self.ranks)} if self.ranks is not None else {})}

    def describe(self) -> str:
        if self.of_1f1b:
            return f"{self.amount:g}x 1F1B's peak"
        if self.ranks is not None:
            return "per rank " + ", ".join(f"{amount:.4g}" for amount in self.ranks) + " (absolute)"
        return f"{self.amount:g}" + ("" if not self.absolute else " (absolute)")


WGRAD_PLACEMENTS = ("auto", "deferred", "in-b")
OUTPUT_LAYER = "output_layer"  # the name a schedule's info["wgrad_in_b"] gives the output layer (the LM head)
ROW_PARALLEL_LAYERS = ("linear_proj", "linear_fc2")  # and the row-parallel layers (megatron's module names)


@dataclass(frozen=True)
class PlanRequest:
    stages: int
    microbatches: int
    costs: Costs | None = None  # None: uniform unit costs
    chunks: int | None = None  # None: the schedule's natural chunk count (1, or 2 for V shapes)
    # A MemoryLimit, or a number of in-flight microbatches; stored as MemoryLimit | None (None: the default).
    memory_limit: MemoryLimit | float | None = None
    ilp_time_limit: float = 10.0  # seconds; 0 skips the ILP refinement
    progress: Callable[[str], None] | None = None  # called with a line of progress during long ILP runs
    post_validation: bool = False  # insert the post-validation passes V and S on every rank (any layout)
    # Where the output layer's W runs under a split schedule: "auto" (a cost-aware planner plans both ways and keeps
    # the faster, where the costs know the output layer's share of W), "deferred" (a W pass) or "in-b" (inside B)
    head_wgrad: str = "auto"
    rows_wgrad: str = "auto"  # the same for the row-parallel layers (Costs.row_t_w): "auto", "deferred" or "in-b"

    def __post_init__(self) -> None:
        object.__setattr__(self, "memory_limit", MemoryLimit.of(self.memory_limit))
        for what, choice in (("the output layer's W", self.head_wgrad), ("the row-parallel layers' W", self.rows_wgrad)):
            if choice not in WGRAD_PLACEMENTS:
                raise ScheduleError(f"{what}: expected one of {', '.join(WGRAD_PLACEMENTS)}, got {choice!r}")
