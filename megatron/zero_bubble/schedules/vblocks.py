"""Building blocks of V schedules: one microbatch's passes laid out on a grid of slots, repeated each period.

"Pipeline Parallelism with Controllable Memory" (Qi et al., arXiv 2405.15362) builds a schedule from the
passes of one microbatch (its building block) placed so that copies shifted by a period never collide;
the lifespan of the block (from a chunk's F to its B, in periods) is the activation memory each rank
holds in the steady state. Its V-Min and V-Half blocks are chains with fixed gaps: V-Min starts every pass
as soon as its input is there (memory about p/3 M_B), V-Half waits one slot before each forward down the
V and each backward up it (memory about p/2 M_B).

Here a block is placed on an integer grid whose slot lengths come from the costs: T_F, T_B and T_W of
each virtual stage (and T_comm) in multiples of a quantum, each pass at the first slot after its input
that is free in every period (a modulo reservation table per rank). With one slot per pass this gives
the paper's blocks exactly; with the real ratios (T_W about half of T_F, say) the steady state stays
tight where a unit-slot pattern would idle. `block_order` repeats a block for m microbatches and reads
each rank's order off it: every (op, chunk) stream in microbatch order, so W follows the order of B.
Pure Python, no torch.
"""
from __future__ import annotations

from dataclasses import dataclass

from .costs import Costs
from .ops import Op
from .schedule import Pass, rank_stages, stage_owner

LAYOUT = "v"  # blocks are laid out along the V (schedule.virtual_stage says which rank holds which stage)


@dataclass(frozen=True)
class Shape:
    """Extra slots a block waits along its chain, beyond the passes' own length and T_comm.

    down, up: before each forward of chunk 0 (down the V) and of chunk 1 (back up);
    back_up, back_down: before each backward of chunk 1 (from the loss up the V) and of chunk 0;
    turn, loss, back_turn: at the bottom of the V (forward), between the last F and the first B (rank 0),
    and at the bottom of the V (backward).
    """

    down: int = 0
    up: int = 0
    back_up: int = 0
    back_down: int = 0
    turn: int = 0
    loss: int = 0
    back_turn: int = 0


def paper_shape(stages: int, kind: str) -> Shape:
    """The paper's V-Min and V-Half blocks as chain gaps (in slots of one pass). The extra slots at the
    loss keep a block's copies from colliding when p is a multiple of 3 (V-Min) or even (V-Half)."""
    if kind == "min":
        return Shape(loss=2 if stages % 3 == 0 else 0)
    if kind == "half":
        return Shape(down=1, back_up=1, back_turn=1, loss=3 if stages % 2 == 0 else 0)
    raise ValueError(f"no paper block named {kind!r}")


@dataclass(frozen=True)
class Grid:
    """Slot lengths of every pass: per virtual stage for F, B and W, one for T_comm."""

    f: tuple[int, ...]
    b: tuple[int, ...]
    w: tuple[int, ...]
    comm: int = 0

    @classmethod
    def unit(cls, virtual_stages: int) -> "Grid":
        return cls((1,) * virtual_stages, (1,) * virtual_stages, (1,) * virtual_stages)

    @classmethod
    def of(cls, costs: Costs, quantum: float) -> "Grid":
        """The costs in whole slots of `quantum` (each pass at least one slot)."""
        def slots(times):
            return tuple(max(1, round(t / quantum)) for t in times)
        return cls(slots(costs.t_f), slots(costs.t_b), slots(costs.t_w), round(costs.t_comm / quantum))


@dataclass(frozen=True)
class Block:
    """Start slot of F, B and W of microbatch 0 on every virtual stage; microbatch k starts k periods later."""

    period: int
    f: tuple[int, ...]
    b: tuple[int, ...]
    w: tuple[int, ...]


def free_start(cells: bytearray, ready: int, length: int) -> int | None:
    """The first start from `ready` (within one period, len(cells)) whose `length` cells, read around the ring, are
    free; None if there is none. A taken cell rules out every start up to it, so the search jumps to the next free
    cell after it (fine grids, from costs that differ a hundredfold, have periods of thousands of cells)."""
    period, start = len(cells), ready
    while start < ready + period and length <= period:
        s = start % period
        taken_at = _first_taken(cells, s, length)
        if taken_at < 0:
            return start
        start += taken_at + _free_run_start(cells, (s + taken_at) % period)
    return None


def _first_taken(cells: bytearray, start: int, length: int) -> int:
    """Offset from `start` of the first taken cell among `length` cells read around the ring; -1 if all are free."""
    end = start + length
    if end <= len(cells):
        hit = cells.find(1, start, end)
        return hit - start if hit >= 0 else -1
    hit = cells.find(1, start)
    if hit >= 0:
        return hit - start
    hit = cells.find(1, 0, end - len(cells))
    return hit + len(cells) - start if hit >= 0 else -1


def _free_run_start(cells: bytearray, taken_at: int) -> int:
    """Cells from the taken cell `taken_at` to the next free one around the ring (len(cells) if none is free)."""
    free = cells.find(0, taken_at)
    if free < 0:
        free = cells.find(0, 0, taken_at)
        return len(cells) if free < 0 else free + len(cells) - taken_at
    return free - taken_at


def _take(cells: bytearray, start: int, length: int) -> None:
    head = min(length, len(cells) - start)
    cells[start:start + head] = b"\x01" * head
    cells[:length - head] = b"\x01" * (length - head)


def build_block(stages: int, grid: Grid, shape: Shape, extra: int = 0) -> Block | None:
    """Place one microbatch's passes along the V, each in the first slot after its input where it is free
    in every period; W passes last, in the order of their B. The period is the busiest rank's work plus
    `extra` slots. None when a pass finds no free slot (the grid is too fragmented)."""
    nv = 2 * stages
    owner = [stage_owner(LAYOUT, stages, v)[0] for v in range(nv)]
    period = max(sum(grid.f[v] + grid.b[v] + grid.w[v] for v in own) for own in rank_stages(LAYOUT, stages, 2)) + extra
    taken = [bytearray(period) for _ in range(stages)]

    def place(rank: int, ready: int, length: int) -> int | None:
        start = free_start(taken[rank], ready, length)
        if start is not None:
            _take(taken[rank], start % period, length)
        return start

    def hop(a: int, b: int) -> int:
        return grid.comm if owner[a] != owner[b] else 0

    f, b, w = [0] * nv, [0] * nv, [0] * nv
    for v in range(nv):
        ready = 0
        if v:
            gap = shape.turn if v == stages else (shape.down if v < stages else shape.up)
            ready = f[v - 1] + grid.f[v - 1] + hop(v - 1, v) + gap
        start = place(owner[v], ready, grid.f[v])
        if start is None:
            return None
        f[v] = start
    for v in reversed(range(nv)):
        if v == nv - 1:
            ready = f[v] + grid.f[v] + shape.loss
        else:
            gap = shape.back_turn if v == stages - 1 else (shape.back_up if v >= stages else shape.back_down)
            ready = b[v + 1] + grid.b[v + 1] + hop(v + 1, v) + gap
        start = place(owner[v], ready, grid.b[v])
        if start is None:
            return None
        b[v] = start
    for v in sorted(range(nv), key=lambda v: b[v]):
        start = place(owner[v], b[v] + grid.b[v], grid.w[v])
        if start is None:
            return None
        w[v] = start
    return Block(period, tuple(f), tuple(b), tuple(w))


def block_order(block: Block, stages: int, microbatches: int) -> list[list[Pass]]:
    """Each rank's passes for `microbatches` copies of the block, in the order of their slots."""
    nv = 2 * stages
    ranks: list[list[tuple]] = [[] for _ in range(stages)]
    for v in range(nv):
        rank, chunk = stage_owner(LAYOUT, stages, v)
        for k in range(microbatches):
            base = k * block.period
            ranks[rank] += [(base + block.f[v], 0, k, Op.F, chunk), (base + block.b[v], 1, k, Op.B, chunk),
                            (base + block.w[v], 2, k, Op.W, chunk)]
    make = Pass._make  # the ops are Op already
    return [[make((op, k, chunk)) for _, _, k, op, chunk in sorted(items)] for items in ranks]
