"""Pictures and text views of a simulated schedule.

`draw` writes PNG or SVG (chosen by the file suffix) with matplotlib, imported only when a picture is
drawn so the planning layer imports without it: one row per rank, F/B/W/BW as coloured boxes, bubbles
left blank, passes that take no time of their own (the post-validation pass V) as a thin dark marker.
`render_text` gives a rough picture for the terminal; `simulation_report` and `comparison_table` are the
tables `zb-schedule` prints.
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

from .ops import OPS, facts, per_rank_ops
from .schedule import ScheduleError
from .simulate import Timeline

OP_COLOURS = {"F": "#5b9bd5", "B": "#70ad47", "W": "#f4a442", "BW": "#a58bd0"}
OP_NAMES = {op: f"{op} ({facts(op).noun})" for op in OPS}  # "F (forward)", ..., "V (post-validation)"
# Passes that take no time (V, S) are a line, not a box, in a style of their own each.
MARKER_STYLES = [{"color": "#222222", "linestyle": "solid"}, {"color": "#8a2be2", "linestyle": "dashed"}]
PICTURE_SUFFIXES = (".png", ".svg")

_ROW_INCHES = 0.42  # height of one rank's row
_INCHES_PER_PASS = 0.2  # width given to each pass of the busiest rank, before the width is capped
_MIN_WIDTH, _MAX_WIDTH = 8.0, 30.0
_MAX_ASPECT = 4.0  # width / height of the whole figure
_MIN_FONT = 4.5  # below this a label is unreadable, so it is dropped


def describe_memory(value: float, unit: str) -> str:
    """Activation memory with its unit: multiples of M_B, or MiB/GiB (3 significant digits) for bytes."""
    if unit == "bytes":
        return f"{value / 2**30:.3g} GiB" if value >= 2**30 else f"{value / 2**20:.3g} MiB"
    return f"{value:.3g} M_B"


def _fmt(x: float) -> str:
    return f"{x:.4g}"


def summary(timeline: Timeline) -> str:
    """One line: schedule name, p, m, bubble rates and peak memory, as in the picture's title."""
    s, unit = timeline.schedule, timeline.costs.time_unit
    chunks = f", {s.chunks} chunks ({s.layout})" if s.chunks > 1 else ""
    peak = describe_memory(max(timeline.peak_memory, default=0.0), timeline.costs.memory_unit)
    return (
        f"{s.name or 'schedule'}: p={s.stages}, m={s.microbatches}{chunks}; bubble rate "
        f"{timeline.bubble_rate:.2%} (per-rank span; {timeline.bubble_rate_from_zero:.2%} from time 0); "
        f"makespan {_fmt(timeline.makespan)} {unit}; peak activation memory {peak}"
    )


def memory_legend(unit: str) -> str:
    if unit == "bytes":
        return "peak memory: the most activation memory any rank holds at once"
    return "peak memory: the most activation memory any rank holds at once, in M_B (one microbatch's activations on one rank)"


BUBBLE_LEGEND = (
    "bubble (span): idle share of each rank between its own first and last pass, the paper's measure; it\n"
    "  assumes the next iteration's warm-up overlaps this one's cool-down, so it can reach 0 while the\n"
    "  makespan still holds the (p-1)-pass start-up\n"
    "bubble (t=0): idle share of every rank from time 0 to the makespan: one isolated iteration"
)


def simulation_report(timeline: Timeline) -> str:
    """Both bubble rates (saying which is which), the makespan, and per rank its span, work and peak memory."""
    s, unit, tu = timeline.schedule, timeline.costs.memory_unit, timeline.costs.time_unit
    lines = [
        f"schedule {s.name or '(unnamed)'}: p={s.stages}, m={s.microbatches}, chunks={s.chunks} ({s.layout} layout)",
        f"bubble rate, paper's measure (each rank from its own first to its own last pass): "
        f"{timeline.bubble_rate:.4f}",
        f"bubble rate, every rank from time 0 to the makespan: {timeline.bubble_rate_from_zero:.4f}",
        f"makespan: {_fmt(timeline.makespan)} {tu}   peak activation memory (max over ranks): "
        f"{describe_memory(max(timeline.peak_memory), unit)}",
        "",
        f"{'rank':>4}  {'start':>9}  {'end':>9}  {'busy':>9}  {'idle in span':>12}  peak memory",
        f"{'':>4}  {'(' + tu + ')':>9}  {'(' + tu + ')':>9}  {'(' + tu + ')':>9}  {'(' + tu + ')':>12}",
    ]
    for r, passes in enumerate(timeline.ranks):
        start, end, busy = passes[0].start, passes[-1].end, timeline.busy(r)
        lines.append(
            f"{r:>4}  {_fmt(start):>9}  {_fmt(end):>9}  {_fmt(busy):>9}  {_fmt(end - start - busy):>12}  "
            f"{describe_memory(timeline.peak_memory[r], unit)}"
        )
    if unit != "bytes":
        lines.append("M_B: one microbatch's activation memory on one rank")
    return "\n".join(lines)


def comparison_table(rows: Sequence[tuple[str, Timeline, float]]) -> str:
    """One line per (name, timeline, planning seconds), followed by a legend saying what each column is."""
    time_unit = rows[0][1].costs.time_unit if rows else "ms"
    memory_unit = rows[0][1].costs.memory_unit if rows else "microbatches"
    lines = [
        f"{'schedule':<17} {'chunks':>6} {'bubble (span)':>13} {'bubble (t=0)':>12} {'makespan':>10} "
        f"{'peak memory':>12} {'planning':>8}",
    ]
    for name, t, seconds in rows:
        peak = describe_memory(max(t.peak_memory), t.costs.memory_unit)
        makespan = f"{_fmt(t.makespan)} {t.costs.time_unit}"
        lines.append(
            f"{name:<17} {t.schedule.chunks:>6} {t.bubble_rate:>13.4f} {t.bubble_rate_from_zero:>12.4f} "
            f"{makespan:>10} {peak:>12} {seconds:>6.2f} s"
        )
    lines += [
        "",
        BUBBLE_LEGEND,
        f"makespan: end of the iteration's last pass ({time_unit}); planning: wall time to plan and validate",
        "each schedule as its program runs on the model of NCCL and CUDA (schedules/nccl_model.py): batched messages,\n"
        "  T_comm each, one in-order stream, one launch queue",
        memory_legend(memory_unit),
    ]
    return "\n".join(lines)


def chunk_colour(op: str, chunk: int, chunks: int) -> tuple[float, float, float]:
    """The op's colour, lighter for later chunks so chunk 1 of a V or interleaved layout stands out."""
    base = OP_COLOURS.get(op, "#999999")
    rgb = tuple(int(base[i : i + 2], 16) / 255 for i in (1, 3, 5))
    lighten = 0.55 * chunk / max(chunks - 1, 1)
    return tuple(c + (1 - c) * lighten for c in rgb)


def _figure_width(timelines: Sequence[Timeline]) -> float:
    passes = max(len(r) for t in timelines for r in t.ranks)
    return min(max(2.0 + _INCHES_PER_PASS * passes, _MIN_WIDTH), _MAX_WIDTH)


def _label_font(timeline: Timeline, axes_width_in: float, xmax: float) -> float:
    """One font size for the whole row set, from the typical (median) box width and the digits needed."""
    widths = sorted(t.end - t.start for r in timeline.ranks for t in r if t.end > t.start)
    if not widths:
        return 0.0
    points_per_time = axes_width_in * 72 / xmax
    typical = widths[len(widths) // 2] * points_per_time
    digits = len(str(timeline.schedule.microbatches - 1))
    return min(8.0, _ROW_INCHES * 72 * 0.45, typical / (0.62 * digits + 0.5))


def _draw_rows(ax, timeline: Timeline, axes_width_in: float, xmax: float, time_unit: str | None = None) -> None:
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    s = timeline.schedule
    # One broken_barh per (op, chunk, rank): thousands of boxes stay fast to draw.
    groups: dict[tuple[str, int, int], list[tuple[float, float]]] = {}
    markers: list[tuple[float, int, str]] = []  # (time, rank, op) of each pass that takes no time: no box
    for rank, passes in enumerate(timeline.ranks):
        for t in passes:
            if not facts(t.op.op).takes_time:
                markers.append((t.start, rank, t.op.op))
            else:
                groups.setdefault((t.op.op, t.op.chunk, rank), []).append((t.start, t.end - t.start))
    for (op, chunk, rank), spans in groups.items():
        colour = chunk_colour(op, chunk, s.chunks)
        ax.broken_barh(spans, (rank - 0.4, 0.8), facecolors=colour, edgecolors="white", linewidth=0.4)
    style = {op: MARKER_STYLES[i % len(MARKER_STYLES)] for i, op in enumerate(per_rank_ops())}
    for op in dict.fromkeys(op for _, _, op in markers):
        times, rows = zip(*[(x, r) for x, r, o in markers if o == op])
        ax.vlines(times, [r - 0.45 for r in rows], [r + 0.45 for r in rows], colors=style[op]["color"],
                  linestyles=style[op]["linestyle"], linewidth=1.6, zorder=3)

    font = _label_font(timeline, axes_width_in, xmax)
    if font >= _MIN_FONT:
        points_per_time = axes_width_in * 72 / xmax
        for passes in timeline.ranks:
            for t in passes:
                text = str(t.op.mb)
                if (t.end - t.start) * points_per_time >= font * (0.62 * len(text) + 0.2):
                    ax.text((t.start + t.end) / 2, t.rank, text, ha="center", va="center", fontsize=font)

    ax.set_ylim(len(timeline.ranks) - 0.5, -0.5)  # rank 0 on top, as in the paper's figures
    ax.set_xlim(0, xmax)
    step = max(1, len(timeline.ranks) // 16)
    ax.set_yticks(range(0, len(timeline.ranks), step))
    ax.set_yticklabels([f"rank {r}" for r in range(0, len(timeline.ranks), step)], fontsize=8)
    ax.set_xlabel(f"time ({time_unit or timeline.costs.time_unit})")
    ax.set_title(summary(timeline), fontsize=9)
    ax.grid(axis="x", color="#dddddd", linewidth=0.5)
    ax.set_axisbelow(True)

    ops = [op for op in OPS if any(key[0] == op for key in groups)]
    handles = [Patch(facecolor=chunk_colour(op, 0, s.chunks), label=OP_NAMES[op]) for op in ops]
    if s.chunks > 1:
        handles += [
            Patch(facecolor=chunk_colour(op, s.chunks - 1, s.chunks), label=f"{op}, chunk {s.chunks - 1}") for op in ops
        ]
    for op in dict.fromkeys(op for _, _, op in markers):
        handles.append(Line2D([], [], linewidth=1.6, label=OP_NAMES[op], **style[op]))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=7, frameon=False)


def check_picture_path(path: str | Path) -> None:
    """Refuse file names we cannot draw to, before any (possibly slow) planning happens."""
    path = Path(path)
    if path.suffix.lower() not in PICTURE_SUFFIXES:
        raise ScheduleError(f"cannot draw to {path.name!r}: the file name must end in .png or .svg")


def draw(timeline: Timeline, path: str | Path, time_unit: str | None = None) -> Path:
    """Write the timeline as a picture; the suffix (.png or .svg) picks the format; time_unit overrides
    the costs' own unit in the axis label."""
    return draw_stacked([timeline], path, time_unit)


def draw_stacked(timelines: Sequence[Timeline], path: str | Path, time_unit: str | None = None) -> Path:
    """Several timelines on one shared time axis, one panel each, to compare schedules at a glance."""
    path = Path(path)
    check_picture_path(path)
    if not timelines:
        raise ScheduleError("nothing to draw: no schedules were given")
    # The object-oriented API with the Agg canvas: no pyplot state, no display needed.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    width = _figure_width(timelines)
    heights = [len(t.ranks) * _ROW_INCHES + 1.0 for t in timelines]
    stretch = max(1.0, width / _MAX_ASPECT / sum(heights))  # a long thin strip is hard to read when shrunk
    heights = [h * stretch for h in heights]
    fig = Figure(figsize=(width, sum(heights) + 0.3))
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(timelines), 1, squeeze=False, gridspec_kw={"height_ratios": heights})[:, 0]
    left, right = 0.9 / width, 1 - 1.6 / width  # room for rank labels and the legend
    fig.subplots_adjust(left=left, right=right, top=1 - 0.35 / sum(heights), bottom=0.55 / sum(heights), hspace=0.6)
    xmax = max(t.makespan for t in timelines) or 1.0
    for ax, timeline in zip(axes, timelines):
        _draw_rows(ax, timeline, width * (right - left), xmax, time_unit)
    fig.savefig(path, dpi=110 if width * sum(heights) > 300 else 140)
    return path


def render_text(timeline: Timeline, width: int = 100) -> str:
    """A terminal picture: one line per rank, one character per time slice.

    F, B, W and # (fused BW) for chunk 0, lower case f, b, w and + for later chunks, '.' for idle, and V
    for the post-validation pass (drawn over whatever else falls in its time slice).
    """
    if width < 10:
        raise ScheduleError(f"text width must be at least 10 characters, got {width}")
    span = timeline.makespan or 1.0
    label_width = len(f"rank {len(timeline.ranks) - 1} ")
    cols = max(width - label_width - 2, 1)
    lines = [summary(timeline)]
    for rank, passes in enumerate(timeline.ranks):
        row = ["."] * cols
        # Passes that take no time (V) last, drawn over whatever shares their time slice.
        for t in sorted(passes, key=lambda t: not facts(t.op.op).takes_time):
            first, last = int(t.start / span * cols), max(int(t.end / span * cols) - 1, int(t.start / span * cols))
            char = facts(t.op.op).symbol
            if t.op.chunk:
                char = char.lower() if char != "#" else "+"
            for c in range(first, min(last, cols - 1) + 1):
                row[c] = char
        lines.append(f"rank {rank}".ljust(label_width) + "|" + "".join(row) + "|")
    return "\n".join(lines)


def draw_budget_curve(curve: Sequence[tuple[float, float]], named: Sequence[tuple[str, float, float]],
                      others: Sequence[tuple[str, float, float]], path: str | Path, memory_unit: str,
                      title: str) -> Path:
    """Bubble rate against the per-rank memory budget: the V planner's best plan for each budget it plans
    for (a step line: a budget between two levels gets the lower level's plan), its named members
    (V-Min, V-Half, ZB-V) and other schedules at their own peak memory, as points.

    curve: (budget, bubble); named and others: (label, peak memory, bubble); memory in the costs' unit.
    """
    path = Path(path)
    check_picture_path(path)
    if not curve and not others:
        raise ScheduleError("nothing to draw: no plan was made")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    scale, unit = (2**30, "GiB") if memory_unit == "bytes" else (1.0, "M_B")
    fig = Figure(figsize=(8.0, 4.8))
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    if curve:
        xs, ys = [x / scale for x, _ in curve], [y for _, y in curve]
        ax.step(xs, ys, where="post", color=OP_COLOURS["F"], linewidth=1.8, label="V planner, best plan per budget")
        ax.plot(xs, ys, "o", color=OP_COLOURS["F"], markersize=3)
    for label, peak, bubble in named:
        ax.plot(peak / scale, bubble, "D", color=OP_COLOURS["F"], markersize=7)
        ax.annotate(label, (peak / scale, bubble), textcoords="offset points", xytext=(6, 6), fontsize=8)
    for label, peak, bubble in others:
        ax.plot(peak / scale, bubble, "s", color=OP_COLOURS["W"], markersize=7)
        ax.annotate(label, (peak / scale, bubble), textcoords="offset points", xytext=(6, -12), fontsize=8)
    if others:
        ax.plot([], [], "s", color=OP_COLOURS["W"], label="other schedules, at their peak memory")
    what = "M_B: one microbatch's activations on one rank" if unit == "M_B" else "bytes of activations"
    ax.set_xlabel(f"memory budget per rank ({unit}; {what})")
    ax.set_ylabel("bubble rate (paper's measure: each rank's own span)")
    ax.set_ylim(bottom=0)
    ax.grid(color="#dddddd", linewidth=0.5)
    ax.set_axisbelow(True)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    return path
