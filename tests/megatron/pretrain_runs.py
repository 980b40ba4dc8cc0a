"""pretrain_gpt.py (and pretrain_hybrid.py) runs for the tests, each a torchrun of its own that ends, as users launch it, and what they printed.

    Runs(definitions, work)[label] -> Run   launched on first use (once per test session), its dependencies first
    Run.log                                  every rank's output, rank after rank (torchrun's --log-dir)
    iteration_figures(log), validation_losses(log), same_training(ours, reference, ...), resumes_like(...),
    resumed_lines_like(...)
A run that fails (non-zero exit), or whose teardown left a process group's gloo threads alive on a rank (such a
process can abort at its end, training/teardown.py), fails every test that reads it, with its tail.
"""
from __future__ import annotations

import glob
import os
import re
from dataclasses import dataclass

from megatron.zero_bubble.training.teardown import THREADS_OUTLIVE
from tests.launching import torchrun

TAIL_CHARS = 4000


class RunFailed(AssertionError):
    pass


@dataclass
class Run:
    label: str
    returncode: int
    log: str  # every rank's stdout and stderr, rank after rank
    launcher: str  # torchrun's own output


@dataclass(frozen=True)
class RunDefinition:
    nproc: int
    flags: list
    after: str | None = None  # the run whose checkpoint this one loads
    script: str = "pretrain_gpt.py"  # or pretrain_hybrid.py


class Runs:
    """label -> Run, each launched the first time a test asks for it."""

    def __init__(self, definitions: dict[str, RunDefinition], work: str, timeout: float = 600):
        self.definitions, self.work, self.timeout = definitions, work, timeout
        self._done: dict[str, Run] = {}

    def __getitem__(self, label: str) -> str:
        run = self.run(label)
        if run.returncode != 0:
            raise RunFailed(f"run {label!r} exited with {run.returncode}:\n{run.log[-TAIL_CHARS:]}\n"
                            f"{run.launcher[-TAIL_CHARS // 2:]}")
        if THREADS_OUTLIVE in run.log:
            lines = sorted({line for line in run.log.splitlines() if THREADS_OUTLIVE in line})
            raise RunFailed(f"run {label!r} ended with a process group alive: " + "; ".join(lines))
        return run.log

    def run(self, label: str) -> Run:
        if label not in self._done:
            definition = self.definitions[label]
            if definition.after is not None:
                self[definition.after]  # its checkpoint first (and it must have succeeded)
            logs = os.path.join(self.work, "logs", label.replace("/", "_"))
            done = torchrun(definition.nproc, ["--log-dir", logs, "--redirects", "3", definition.script,
                                               *definition.flags], timeout=self.timeout)
            ranks = sorted(glob.glob(os.path.join(logs, "**", "attempt_0", "*", "std*.log"), recursive=True),
                           key=lambda path: (int(os.path.basename(os.path.dirname(path))), path))
            log = "\n".join(open(path).read() for path in ranks)
            self._done[label] = Run(label, done.returncode, log, done.stdout + done.stderr)
        return self._done[label]


# ---------------------------------------------------------------- reading megatron's log


ITERATION_LINE = re.compile(r" iteration +(\d+)/ *\d+ \|(.*)")


def iteration_figures(log: str) -> dict[int, dict[str, str]]:
    """{iteration: {"lm loss": "4.866174E+00", "grad norm": ..., "params norm": ...}} as printed."""
    figures = {}
    for match in ITERATION_LINE.finditer(log):
        fields = dict(re.findall(r" ([a-z ]+): ([0-9.E+-]+) ", match.group(2) + " "))
        figures[int(match.group(1))] = {k: v for k, v in fields.items() if k in ("lm loss", "grad norm", "params norm")}
    return figures


def validation_losses(log: str) -> list[str]:
    return re.findall(r"validation loss at iteration \d+[^|]*\| lm loss value: ([0-9.E+-]+)", log)


def iteration_lines(log: str) -> list[str]:
    """Megatron's iteration lines without their timing fields."""
    return [re.sub(r"\[[^\]]*\] | elapsed time per iteration \(ms\): [0-9.]+ \||throughput[^|]*\|", "", line)
            for line in re.findall(r".* iteration +\d+/ *\d+ \|.*", log)]


def same_training(ours: str, reference: str, iterations, norms_to_the_printed_digit: bool = False,
                  tolerance: float = 0.0) -> None:
    """Every iteration's printed loss and norms equal; `norms_to_the_printed_digit`: the norms (printed with three
    decimals) may differ by one in the last digit; `tolerance`: the loss and grad norm may differ by that much,
    relatively."""
    mine, theirs = iteration_figures(ours), iteration_figures(reference)
    for iteration in iterations:
        assert iteration in theirs and theirs[iteration].get("lm loss"), f"no loss printed at iteration {iteration}"
        got, expected = mine.get(iteration) or {}, theirs[iteration]
        assert got.keys() == expected.keys(), f"iteration {iteration}: {got} != {expected}"
        for key, value in expected.items():
            allowed = tolerance * abs(float(value)) if key != "params norm" else 0.0
            if norms_to_the_printed_digit and key.endswith("norm"):
                allowed += 0.0011
            if allowed:
                assert abs(float(got[key]) - float(value)) <= allowed, f"iteration {iteration}: {got} != {expected}"
            else:
                assert got[key] == value, f"iteration {iteration}: {got} != {expected}"


def same_validation(ours: str, reference: str, tolerance: float = 0.0) -> None:
    mine, theirs = validation_losses(ours), validation_losses(reference)
    assert len(mine) == len(theirs) and theirs, (mine, theirs)
    for got, expected in zip(mine, theirs):
        assert abs(float(got) - float(expected)) <= tolerance * abs(float(expected)) if tolerance else got == expected


def averaged_losses(first: int) -> set[int]:
    """The iterations whose printed loss a run resumed at `first` and the uninterrupted run average differently (at
    --log-interval 1): megatron's second logged iteration after a start prints the mean of two iterations' losses,
    the uninterrupted run's 2 and the resumed run's first + 1."""
    return {2, first + 1}


def resumes_like(resumed: str, uninterrupted: str, first: int, last: int, evaluations_after: int,
                 norms_to_the_printed_digit: bool = False) -> None:
    """A run resumed from the checkpoint of iteration first-1 against the uninterrupted run: the norms of every
    iteration; the loss where both print one iteration's own (averaged_losses); the last `evaluations_after`
    evaluations."""
    assert "successfully loaded checkpoint" in resumed and min(iteration_figures(resumed)) == first
    mine, theirs = iteration_figures(resumed), iteration_figures(uninterrupted)
    for iteration in range(first, last + 1):
        keys = [key for key in theirs[iteration] if key != "lm loss" or iteration not in averaged_losses(first)]
        for key in keys:
            got, expected = mine[iteration][key], theirs[iteration][key]
            if norms_to_the_printed_digit and key.endswith("norm"):
                assert abs(float(got) - float(expected)) <= 0.0011, f"{key} at iteration {iteration}"
            else:
                assert got == expected, f"{key} at iteration {iteration}"
    assert validation_losses(resumed) == validation_losses(uninterrupted)[-evaluations_after:] != []


LOSS_FIELD = re.compile(r" lm loss: [0-9.E+-]+ \|")


def resumed_lines_like(resumed: list[str], uninterrupted: list[str], first: int) -> None:
    """iteration_lines of a run resumed at `first` against the uninterrupted run's from `first` on, field for field
    (learning rate, loss scale, skipped iterations...): the loss where both print one iteration's own."""
    by_iteration = lambda lines: {int(ITERATION_LINE.search(line).group(1)): line for line in lines}  # noqa: E731
    mine, theirs = by_iteration(resumed), by_iteration(uninterrupted)
    assert sorted(mine) == [iteration for iteration in sorted(theirs) if iteration >= first], (mine, theirs)
    for iteration, line in mine.items():
        expected = theirs[iteration]
        if iteration in averaged_losses(first):
            line, expected = (LOSS_FIELD.sub(" lm loss: (averaged) |", text) for text in (line, expected))
        assert line == expected, f"iteration {iteration}:\n{line}\n{expected}"


PARAMETERS_LINE = re.compile(r"number of parameters on \(tensor, \S+ pipeline\) model parallel rank "
                             r"\(0, 0, (\d+)\): (\d+)")


def parameters_per_rank(log: str) -> dict[int, int]:
    return {int(rank): int(count) for rank, count in PARAMETERS_LINE.findall(log)}
