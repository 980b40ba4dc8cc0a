#!/usr/bin/env python3
"""Compare the loss curves of Megatron runs against a reference run, iteration by iteration.

    python scripts/compare_loss_curves.py REF.log RUN.log [RUN2.log ...] [--labels 1f1b,zb-h1,...]
        [--metric "lm loss"|"grad norm"] [--atol 0] [--rtol 0] [-o curves.png]

Each input is a Megatron log (stdout of `pretrain_gpt.py`, rank-prefixed torchrun output is fine: the
iteration lines are found anywhere in a line) or a run's tensorboard directory (read with tensorboard's
event reader when that package is installed). The first input is the reference. Prints a table of the
values and their differences to the reference, then per run the first diverging iteration and the
largest absolute and relative differences. A value passes when |run - ref| <= atol + rtol * |ref|; the
defaults (0, 0) demand bit-identical printed values.

Exit status: 0 every run within tolerance, 1 some run beyond it, 2 unusable input (no iteration lines
with the metric, iterations that do not line up, unreadable files, bad options), reported in one line.
Note that log values are only as exact as Megatron prints them (lm loss 7 digits, grad norm 3 decimals).
"""
from __future__ import annotations

import argparse
import math
import re
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

METRICS = ("lm loss", "grad norm")
# Megatron writes these tensorboard tags for the same quantities (training.py, training_log).
TENSORBOARD_TAGS = {"lm loss": "lm loss", "grad norm": "grad-norm"}
ELAPSED_KEY = "elapsed time per iteration (ms)"
# ' iteration       3/      20 | consumed samples: ...'; 'validation loss at iteration 10' has no '/'.
ITERATION_LINE = re.compile(r"\biteration\s+(\d+)\s*/\s*\d+\s*\|(.*)")


class InputError(Exception):
    """An input that cannot be compared; reported as one line, exit status 2."""


@dataclass
class Curve:
    """One run: the metric and the elapsed time per iteration (ms), keyed by iteration."""

    label: str
    source: str
    values: dict[int, float] = field(default_factory=dict)
    elapsed_ms: dict[int, float] = field(default_factory=dict)

    def median_ms(self) -> float | None:
        """Median iteration time without the first iteration, which carries the warm-up."""
        times = [self.elapsed_ms[i] for i in sorted(self.elapsed_ms)[1:]] or list(self.elapsed_ms.values())
        return statistics.median(times) if times else None


@dataclass
class Comparison:
    """How one run differs from the reference over their common iterations."""

    label: str
    first_difference: int | None = None  # first iteration with any difference
    first_failure: int | None = None  # first iteration beyond the tolerance
    max_abs: float = 0.0
    max_abs_at: int | None = None
    max_rel: float = 0.0
    max_rel_at: int | None = None

    @property
    def ok(self) -> bool:
        return self.first_failure is None


def parse_log_text(text: str, metric: str, label: str, source: str) -> Curve:
    """The iteration lines of a Megatron log; a repeated iteration (a resumed run) keeps its last line."""
    curve = Curve(label, source)
    for line in text.splitlines():
        match = ITERATION_LINE.search(line)
        if not match:
            continue
        iteration = int(match.group(1))
        fields = {}
        for part in match.group(2).split("|"):
            key, colon, value = part.partition(":")
            if colon:
                fields[key.strip()] = value.strip()
        for key, store in ((metric, curve.values), (ELAPSED_KEY, curve.elapsed_ms)):
            if key in fields:
                try:
                    store[iteration] = float(fields[key])
                except ValueError:
                    raise InputError(f"{source}: iteration {iteration} has {key} {fields[key]!r}, not a number")
    if not curve.values:
        raise InputError(f"{source}: no iteration line with '{metric}' (is this a Megatron training log?)")
    return curve


def read_tensorboard(path: Path, metric: str, label: str) -> Curve:
    """Scalars written by Megatron's tensorboard writer, via tensorboard's own event reader."""
    try:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    except ImportError:
        # torch.utils.tensorboard only writes events; reading them needs the tensorboard package.
        raise InputError(f"{path}: reading tensorboard events needs the 'tensorboard' package, which is "
                         "not installed; pass the run's log file instead") from None
    accumulator = EventAccumulator(str(path), size_guidance={"scalars": 0})  # 0: keep every event
    accumulator.Reload()
    tags = accumulator.Tags().get("scalars", [])
    tag = TENSORBOARD_TAGS[metric]
    if tag not in tags:
        raise InputError(f"{path}: no '{tag}' scalars in the tensorboard events (found: {', '.join(tags) or 'none'})")
    curve = Curve(label, str(path))
    curve.values = {event.step: float(event.value) for event in accumulator.Scalars(tag)}
    if "iteration-time" in tags:  # seconds, written with --log-timers-to-tensorboard
        curve.elapsed_ms = {e.step: 1000.0 * float(e.value) for e in accumulator.Scalars("iteration-time")}
    return curve


def load_curve(path_text: str, metric: str, label: str) -> Curve:
    path = Path(path_text)
    if path.is_dir() or path.name.startswith("events.out.tfevents"):
        return read_tensorboard(path, metric, label)
    try:
        text = path.read_text(errors="replace")
    except OSError as error:
        raise InputError(f"{path}: cannot read ({error.strerror or error})") from None
    return parse_log_text(text, metric, label, str(path))


def describe_iterations(iterations) -> str:
    """[1, 2, 3, 7, 9, 10] -> '1-3, 7, 9-10'."""
    spans, ordered = [], sorted(iterations)
    for i in ordered:
        if spans and i == spans[-1][1] + 1:
            spans[-1][1] = i
        else:
            spans.append([i, i])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def check_alignment(reference: Curve, run: Curve) -> None:
    missing = reference.values.keys() - run.values.keys()
    extra = run.values.keys() - reference.values.keys()
    if missing or extra:
        what = f"lacks iterations {describe_iterations(missing)}" if missing else \
            f"has iterations {describe_iterations(extra)} that the reference lacks"
        raise InputError(f"{run.label} ({run.source}) {what}; reference {reference.label} has iterations "
                         f"{describe_iterations(reference.values)}: the curves do not line up")


def compare(reference: Curve, run: Curve, atol: float, rtol: float) -> Comparison:
    result = Comparison(run.label)
    for iteration in sorted(reference.values):
        ref, value = reference.values[iteration], run.values[iteration]
        if value == ref or (math.isnan(value) and math.isnan(ref)):
            continue
        abs_diff = abs(value - ref)
        if math.isnan(abs_diff):  # nan against a number, or inf against -inf
            abs_diff = math.inf
        rel_diff = abs_diff / abs(ref) if ref else math.inf
        if result.first_difference is None:
            result.first_difference = iteration
        if result.first_failure is None and not abs_diff <= atol + rtol * abs(ref):
            result.first_failure = iteration
        if result.max_abs_at is None or abs_diff > result.max_abs:
            result.max_abs, result.max_abs_at = abs_diff, iteration
        if result.max_rel_at is None or rel_diff > result.max_rel:
            result.max_rel, result.max_rel_at = rel_diff, iteration
    return result


def format_table(curves: list[Curve], metric: str) -> str:
    reference, runs = curves[0], curves[1:]
    header = ["iteration", f"{reference.label}"] + [c for run in runs for c in (run.label, "diff")]
    rows = []
    for iteration in sorted(reference.values):
        ref = reference.values[iteration]
        row = [str(iteration), f"{ref:.7g}"]
        for run in runs:
            value = run.values[iteration]
            same = value == ref or (math.isnan(value) and math.isnan(ref))
            row += [f"{value:.7g}", "0" if same else f"{value - ref:+.3e}"]
        rows.append(row)
    widths = [max(len(r[i]) for r in rows + [header]) for i in range(len(header))]
    lines = [f"{metric} per iteration (diff = run - {reference.label}):",
             "  ".join(h.rjust(w) for h, w in zip(header, widths))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in rows]
    return "\n".join(lines)


def format_time(curve: Curve, reference: Curve) -> str:
    ms, ref_ms = curve.median_ms(), reference.median_ms()
    if ms is None:
        return "no iteration times"
    ratio = f" ({ms / ref_ms:.2f}x the reference)" if ref_ms and curve is not reference else ""
    return f"median {ms:.1f} ms/iteration{ratio}"


def format_summary(reference: Curve, comparisons: list[Comparison], runs: list[Curve]) -> str:
    count = len(reference.values)
    lines = [f"{reference.label}: reference, {count} iterations, {format_time(reference, reference)}"]
    for result, run in zip(comparisons, runs):
        if result.first_difference is None:
            verdict = f"identical to the reference over {count} iterations"
        else:
            verdict = "DIVERGES" if not result.ok else "within tolerance"
            verdict += f": first difference at iteration {result.first_difference}"
            if result.first_failure not in (None, result.first_difference):
                verdict += f", beyond tolerance from iteration {result.first_failure}"
            verdict += (f"; max abs diff {result.max_abs:.3e} (iteration {result.max_abs_at}), "
                        f"max rel diff {result.max_rel:.3e} (iteration {result.max_rel_at})")
        lines.append(f"{run.label}: {verdict}; {format_time(run, reference)}")
    return "\n".join(lines)


def draw_curves(curves: list[Curve], metric: str, output: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    reference = curves[0]
    iterations = sorted(reference.values)
    figure, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(8, 6), height_ratios=(2, 1))
    for index, curve in enumerate(curves):
        # Later runs are drawn thinner and dashed so that identical curves stay visible on top of each other.
        top.plot(iterations, [curve.values[i] for i in iterations], label=curve.label, color=f"C{index}",
                 linewidth=2.5 - 1.5 * index / max(1, len(curves) - 1), linestyle="-" if index == 0 else "--")
        if index:
            bottom.plot(iterations, [curve.values[i] - reference.values[i] for i in iterations],
                        marker="o", markersize=3, color=f"C{index}", label=curve.label)
    bottom.axhline(0.0, color="black", linewidth=0.6)
    top.set_ylabel(metric)
    top.legend()
    top.set_title(f"{metric}: runs against the reference {reference.label}")
    bottom.set_ylabel(f"run - {reference.label}")
    bottom.set_xlabel("iteration")
    bottom.xaxis.set_major_locator(MaxNLocator(integer=True))
    figure.tight_layout()
    figure.savefig(output, dpi=110)
    plt.close(figure)


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line instead of argparse's usage block
        raise InputError(message)


def parse_args(argv):
    parser = _Parser(description=__doc__.split("\n")[0])
    parser.add_argument("inputs", nargs="+", metavar="LOG_OR_TB_DIR", help="the first one is the reference")
    parser.add_argument("--labels", help="comma-separated names, one per input (default: the file names)")
    parser.add_argument("--metric", default="lm loss", choices=METRICS)
    parser.add_argument("--atol", type=float, default=0.0, help="absolute tolerance (default 0: exact)")
    parser.add_argument("--rtol", type=float, default=0.0, help="relative tolerance (default 0: exact)")
    parser.add_argument("-o", "--output", help="write a picture of the curves and differences (PNG)")
    args = parser.parse_args(argv)
    if len(args.inputs) < 2:
        raise InputError("give at least two runs: the reference first, then the runs to compare with it")
    labels = args.labels.split(",") if args.labels else [Path(p).stem or p for p in args.inputs]
    if len(labels) != len(args.inputs):
        raise InputError(f"--labels names {len(labels)} runs but {len(args.inputs)} inputs were given")
    if args.atol < 0 or args.rtol < 0 or math.isnan(args.atol) or math.isnan(args.rtol):
        raise InputError("--atol and --rtol must be non-negative numbers")
    return args, labels


def main(argv=None) -> int:
    try:
        args, labels = parse_args(argv)
        curves = [load_curve(path, args.metric, label) for path, label in zip(args.inputs, labels)]
        for run in curves[1:]:
            check_alignment(curves[0], run)
    except InputError as error:
        print(f"compare_loss_curves: {error}", file=sys.stderr)
        return 2
    reference, runs = curves[0], curves[1:]
    comparisons = [compare(reference, run, args.atol, args.rtol) for run in runs]
    print(format_table(curves, args.metric))
    print()
    print(format_summary(reference, comparisons, runs))
    if args.output:
        draw_curves(curves, args.metric, args.output)
        print(f"picture: {args.output}")
    failed = [c.label for c in comparisons if not c.ok]
    tolerance = "exact" if args.atol == args.rtol == 0 else f"atol={args.atol:g}, rtol={args.rtol:g}"
    if failed:
        print(f"FAIL: {', '.join(failed)} beyond tolerance ({tolerance}) of {reference.label}")
        return 1
    print(f"OK: {len(runs)} run(s) match {reference.label} ({tolerance})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
