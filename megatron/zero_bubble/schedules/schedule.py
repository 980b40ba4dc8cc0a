"""A pipeline schedule as plain data: for each rank, the ordered compute passes it runs.

Passes are F (forward), B (gradient w.r.t. the input), W (gradient w.r.t. the weights) and BW (fused
backward, as 1F1B runs it). Each names a microbatch and a model chunk; the layout maps (rank, chunk) to a
virtual stage. V and S are the post-validation passes (post_validation.py): one each per rank, as
microbatch 0 on the rank's last chunk.
What each kind of pass needs, costs and sends is in ops.TABLE.
The JSON form is the contract the README states ("The schedule JSON") and what outside tools read.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Iterator, NamedTuple

from .errors import ScheduleError
from .ops import OPS, Op, as_op, facts

__all__ = ["LAYOUTS", "OPS", "Op", "Pass", "Schedule", "ScheduleError", "rank_stages", "stage_owner", "virtual_stage"]
LAYOUTS = ("single", "interleaved", "v")


class _PassFields(NamedTuple):
    op: Op
    mb: int
    chunk: int


class Pass(_PassFields):
    """One compute pass: an op (given as Op or its string, "F"; an unknown string is refused here), a
    microbatch and a model chunk. An immutable tuple: planners make and compare hundreds of thousands."""

    __slots__ = ()

    def __new__(cls, op, mb: int, chunk: int = 0):
        return tuple.__new__(cls, (op if type(op) is Op else as_op(op), mb, chunk))

    def __str__(self) -> str:
        if not facts(self.op).per_microbatch:  # once per rank: its name says it all
            return self.op.value
        return f"{self.op}{self.mb}" + (f".{self.chunk}" if self.chunk else "")

    def describe(self) -> str:
        if not facts(self.op).per_microbatch:
            return f"the {facts(self.op).noun} pass"
        chunk = f" (chunk {self.chunk})" if self.chunk else ""
        return f"{self.op} of microbatch {self.mb}{chunk}"


def virtual_stage(layout: str, stages: int, rank: int, chunk: int) -> int:
    """Virtual stage held by (rank, chunk): single r; interleaved k*p + r; v r or 2p-1-r."""
    if layout == "single":
        return rank
    if layout == "interleaved":
        return chunk * stages + rank
    if layout == "v":
        return rank if chunk == 0 else 2 * stages - 1 - rank
    raise ScheduleError(f"unknown layout {layout!r}; expected one of {', '.join(LAYOUTS)}")


def stage_owner(layout: str, stages: int, vstage: int) -> tuple[int, int]:
    """(rank, chunk) holding a virtual stage; the inverse of `virtual_stage`."""
    if layout == "single":
        return vstage, 0
    if layout == "interleaved":
        return vstage % stages, vstage // stages
    if layout == "v":
        return (vstage, 0) if vstage < stages else (2 * stages - 1 - vstage, 1)
    raise ScheduleError(f"unknown layout {layout!r}; expected one of {', '.join(LAYOUTS)}")


def rank_stages(layout: str, stages: int, chunks: int) -> list[tuple[int, ...]]:
    """The virtual stages each rank holds, by chunk: rank_stages(...)[r][k] = virtual_stage(layout, p, r, k)."""
    return [tuple(virtual_stage(layout, stages, r, k) for k in range(chunks)) for r in range(stages)]


@dataclass
class Schedule:
    stages: int  # p, the number of pipeline ranks
    chunks: int  # model chunks per rank
    microbatches: int  # m
    layout: str
    ranks: list[list[Pass]]
    name: str = ""
    info: dict = field(default_factory=dict)  # extra JSON keys: costs, predictions, planner options

    @property
    def num_virtual_stages(self) -> int:
        return self.stages * self.chunks

    def virtual_stage(self, rank: int, chunk: int) -> int:
        return virtual_stage(self.layout, self.stages, rank, chunk)

    def owner(self, vstage: int) -> tuple[int, int]:
        return stage_owner(self.layout, self.stages, vstage)

    def uses_split_backward(self) -> bool:
        return any(facts(p.op).split for passes in self.ranks for p in passes)

    def has_post_validation(self) -> bool:
        return any(p.op in (Op.V, Op.S) for passes in self.ranks for p in passes)

    def passes(self) -> Iterator[tuple[int, int, Pass]]:
        """(rank, position, pass) for every pass."""
        for rank, passes in enumerate(self.ranks):
            for pos, p in enumerate(passes):
                yield rank, pos, p

    def to_dict(self) -> dict:
        out = {
            "stages": self.stages,
            "chunks": self.chunks,
            "microbatches": self.microbatches,
            "layout": self.layout,
            "ranks": [[{"op": p.op.value, "mb": p.mb, "chunk": p.chunk} for p in r] for r in self.ranks],
        }
        if self.name:
            out["name"] = self.name
        out.update(self.info)
        return out

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, data: dict) -> "Schedule":
        missing = [k for k in ("stages", "chunks", "microbatches", "layout", "ranks") if k not in data]
        if missing:
            raise ScheduleError(f"schedule JSON lacks the key(s) {', '.join(missing)}")
        try:
            ranks = [[Pass(str(a["op"]), int(a["mb"]), int(a.get("chunk", 0))) for a in r] for r in data["ranks"]]
        except ScheduleError:  # an unknown op: the message names it already
            raise
        except (KeyError, TypeError, ValueError) as e:
            raise ScheduleError(f"schedule JSON has a malformed pass ({e}); each needs op, mb and chunk") from None
        known = {"stages", "chunks", "microbatches", "layout", "ranks", "name"}
        return cls(
            stages=int(data["stages"]),
            chunks=int(data["chunks"]),
            microbatches=int(data["microbatches"]),
            layout=str(data["layout"]),
            ranks=ranks,
            name=str(data.get("name", "")),
            info={k: v for k, v in data.items() if k not in known},
        )

    @classmethod
    def from_json(cls, text: str) -> "Schedule":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ScheduleError(f"schedule file is not valid JSON: {e}") from None
        return cls.from_dict(data)
