"""Timelines anyone can open, and a rank's actions as a line of text.

`chrome_trace(rows)` turns passes with their start and end into Chrome trace JSON (the "Trace Event Format"
that Perfetto and chrome://tracing open): one process per source (simulated, rehearsed, measured), one
thread per pipeline rank, one complete event ("ph": "X") per pass, named as the pass prints (`F3`, `B3.1`, `V`),
with its microbatch, chunk, virtual stage and, where known, its planned start in the event's arguments.
Times are given in milliseconds and written in the format's microseconds. The simulator's, the rehearsal's
and training's timelines all go through it.

`actions_text(schedule, rank)` writes one rank's passes as `F0 F1 B0 W0 ...` (chunk > 0 as `F0.1`), the form
the passes print in; `parse_actions(text, chunks)` reads it back.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from .ops import Op, facts, per_rank_chunk
from .schedule import Pass, Schedule, ScheduleError
from .simulate import Timeline


@dataclass(frozen=True)
class TraceRow:
    """One pass on one rank, times in milliseconds."""

    rank: int
    op: Pass
    start: float
    end: float
    vstage: int | None = None
    args: dict = field(default_factory=dict)  # shown with the event (e.g. planned_start)


def chrome_trace(rows, source: str = "simulated", ranks: int | None = None) -> dict:
    """The trace of `rows` (TraceRow, times in ms) under one process named `source`; `ranks`: how many thread
    names to declare (default: the ranks that have rows)."""
    rows = list(rows)
    count = ranks if ranks is not None else 1 + max((row.rank for row in rows), default=-1)
    events = [{"ph": "M", "name": "process_name", "pid": 0, "tid": 0, "args": {"name": source}}]
    events += [{"ph": "M", "name": "thread_name", "pid": 0, "tid": rank, "args": {"name": f"rank {rank}"}}
               for rank in range(count)]
    for row in rows:
        args = {"microbatch": row.op.mb, "chunk": row.op.chunk, **row.args}
        if row.vstage is not None:
            args["virtual_stage"] = row.vstage
        events.append({"ph": "X", "name": str(row.op), "cat": facts(row.op.op).noun, "pid": 0, "tid": row.rank,
                       "ts": round(row.start * 1000.0, 3), "dur": round(max(0.0, row.end - row.start) * 1000.0, 3),
                       "args": args})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def timeline_rows(timeline: Timeline, unit_ms: float = 1.0) -> list[TraceRow]:
    """The simulator's passes as trace rows (times in the costs' unit, `unit_ms` milliseconds each)."""
    return [TraceRow(t.rank, t.op, t.start * unit_ms, t.end * unit_ms, t.vstage)
            for passes in timeline.ranks for t in passes]


def write_trace(trace: dict, path: str) -> None:
    with open(path, "w") as f:
        json.dump(trace, f)


def actions_text(schedule: Schedule, rank: int) -> str:
    """One rank's passes in order, as they print, separated by spaces."""
    return " ".join(str(p) for p in schedule.ranks[rank])


_ACTION = re.compile(r"(BW|F|B|W|V|S)(?:(\d+)(?:\.(\d+))?)?")


def parse_actions(text: str, chunks: int = 1) -> list[Pass]:
    """The passes of `actions_text` (a once-per-rank pass, V or S, sits on the rank's last chunk)."""
    passes = []
    for word in text.split():
        match = _ACTION.fullmatch(word)
        if match is None:
            raise ScheduleError(f"cannot read the action {word!r}: expected e.g. F3, B3.1, W0, BW2 or V")
        op = Op(match.group(1))
        per_microbatch = facts(op).per_microbatch
        if per_microbatch != (match.group(2) is not None):
            raise ScheduleError(f"cannot read the action {word!r}: {op} "
                                + ("needs a microbatch" if per_microbatch else "takes no microbatch"))
        chunk = int(match.group(3) or 0) if per_microbatch else per_rank_chunk(chunks)
        if chunk >= chunks:
            raise ScheduleError(f"the action {word!r} names chunk {chunk}, but there are {chunks} chunk(s) per rank")
        passes.append(Pass(op, int(match.group(2) or 0), chunk))
    return passes
