"""The schedules advise compares, each as pretrain_gpt.py runs it: the planner, its chunks and memory limit, and the
flags that ask training for it.

megatron's 1F1B and interleaved 1F1B (megatron's own schedules), ZB-H1 and ZB-H2, zb-auto at 1F1B's memory (p
microbatches in flight, ZB-1p), at twice it (2p, ZB-2p) and with two chunks per rank (at interleaved 1F1B's
memory), ZB-V and the V family's smaller budgets (V-Half, V-Min: ZB-V's planner under
--zero-bubble-v-schedule-mem-setup, as training plans them). A candidate applies when training's own start-up
checks accept its command line (training/checks.py) and the layers lay out over its virtual stages.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass

from ..schedules.planners import schedule_kind
from ..schedules.problem import MemoryLimit
from ..schedules.vbudget import mem_setup_limit
from ..training.checks import RUNTIME_ONLY_FLAGS, check_flags
from ..training.flags import StartupRefusal
from .run import Run

# The flags that choose the schedule, its memory or the chunks per rank, with how many words follow each: a
# candidate's command line drops the user's and adds its own.
SCHEDULE_FLAGS = {"--pipeline-schedule": 1, "--enable-zero-bubble": 0, "--zero-bubble-v-schedule": 0,
                  "--enable-zbh1-pipeline": 0, "--enable-zbh1-exact-semantics": 0, "--enable-zb-runtime": 0,
                  "--zero-bubble-max-pending-backward": 1, "--zero-bubble-v-schedule-mem-setup": 1}
CHUNK_FLAGS = {"--num-virtual-stages-per-pipeline-rank": 1, "--num-layers-per-virtual-pipeline-stage": 1}
# What only the zero-bubble runtime reads: dropped for megatron's own schedules (training refuses them there)
RUNTIME_FLAGS = {**{"--" + name.replace("_", "-"): 1 for name in RUNTIME_ONLY_FLAGS},
                 "--enable-optimizer-post-validation": 0, "--zero-bubble-exact-rollback": 0,
                 "--enable-exactly-numeric-match": 0, "--no-zero-bubble-split-check": 0}
ILP_FLAGS = {"--zero-bubble-ilp-time-limit": 1}  # dropped where the planner has no ILP


@dataclass(frozen=True)
class Candidate:
    label: str
    planner: str  # the planning registry's name
    chunks: int
    # in-flight microbatches, or a multiple of the largest activation memory a rank holds under 1F1B (MemoryLimit),
    # or GPU_MEMORY (what each rank's model state leaves of --gpu-memory); None: the schedule's own
    memory_limit: float | MemoryLimit | str | None
    flags: tuple[str, ...]  # what asks pretrain_gpt.py for it (beside the chunk flag, see `command_line`)
    megatron: bool = False  # megatron's own schedule (no zero-bubble flag)
    aim: float | None = None  # the most time over 1F1B's it is meant to take (the V family's memory-saving rows)


# A candidate's limit that is the GPU's own: each rank plans under what its model state leaves of --gpu-memory, as
# training's --zero-bubble-max-pending-backward auto plans under the free device memory
GPU_MEMORY = "gpu"

# What the controllable-memory paper has the V family's memory-saving members at: V-Half no slower than 1F1B,
# V-Min close to it (within 10%)
V_HALF_AIM, V_MIN_AIM = 1.0, 1.10


def candidates(run: Run) -> list[Candidate]:
    p = run.layout.pp
    v = run.layout.chunks if run.layout.chunks > 1 else 2  # interleaved: the command line's chunks, else two
    auto = ("--pipeline-schedule", "zb-auto")
    zb_v = ("--pipeline-schedule", "zb-v")
    return [
        Candidate("1f1b", "1f1b", 1, None, (), megatron=True),
        Candidate(f"interleaved-1f1b ({v} chunks)", "interleaved-1f1b", v, None, (), megatron=True),
        Candidate("zb-h1", "zb-h1", 1, None, ("--pipeline-schedule", "zb-h1")),
        Candidate("zb-h2", "zb-h2", 1, None, ("--pipeline-schedule", "zb-h2")),
        Candidate("zb-auto (1x 1F1B memory)", "zb-auto", 1, MemoryLimit.of_1f1b_peak(1.0),
                  auto + ("--zero-bubble-max-pending-backward", "1x")),
        Candidate("zb-auto (2x 1F1B memory)", "zb-auto", 1, MemoryLimit.of_1f1b_peak(2.0),
                  auto + ("--zero-bubble-max-pending-backward", "2x")),
        Candidate("zb-auto (auto: GPU memory)", "zb-auto", 1, GPU_MEMORY, auto),
        Candidate(f"zb-auto ({v} chunks)", "zb-auto", v, None, auto),
        Candidate("zb-v", "zb-v", 2, mem_setup_limit("zb", p), zb_v),
        Candidate("zb-v (V-Half memory)", "zb-v", 2, mem_setup_limit("half", p),
                  zb_v + ("--zero-bubble-v-schedule-mem-setup", "half"), aim=V_HALF_AIM),
        Candidate("zb-v (V-Min memory)", "zb-v", 2, mem_setup_limit("min", p),
                  zb_v + ("--zero-bubble-v-schedule-mem-setup", "min"), aim=V_MIN_AIM),
    ]


def _split(words: list[str], flags: dict[str, int]) -> tuple[list[str], list[tuple[str, ...]]]:
    """`words` without `flags`, and the removed flags as groups: (flag,) or (flag, value)."""
    kept, removed, k = [], [], 0
    while k < len(words):
        name, _, value = words[k].partition("=")
        if name not in flags:
            kept.append(words[k])
            k += 1
        elif value or flags[name] == 0:
            removed.append((name, value) if value else (name,))
            k += 1
        else:
            removed.append(tuple(words[k:k + 1 + flags[name]]))
            k += 1 + flags[name]
    return kept, removed


def _groups(flags: list[str]) -> list[tuple[str, ...]]:
    return _split(flags, {**SCHEDULE_FLAGS, **CHUNK_FLAGS})[1]


@dataclass(frozen=True)
class Change:
    """What turns the user's command line into a candidate's."""

    words: tuple[str, ...]  # the candidate's whole pretrain_gpt.py arguments
    add: tuple[str, ...]
    drop: tuple[str, ...]


def command_line(run: Run, candidate: Candidate) -> Change:
    """The candidate's pretrain_gpt.py arguments, and the flags to add to the user's and to drop from them."""
    words, removed = _split(list(run.argv), SCHEDULE_FLAGS)
    if candidate.megatron:
        words, dropped = _split(words, {**RUNTIME_FLAGS, **ILP_FLAGS})
        removed += dropped
    elif not schedule_kind(candidate.planner).ilp:
        words, dropped = _split(words, ILP_FLAGS)
        removed += dropped
    add = list(candidate.flags)
    if candidate.chunks != run.layout.chunks:
        words, removed_chunks = _split(words, CHUNK_FLAGS)
        removed += removed_chunks
        natural = 2 if candidate.planner == "zb-v" else 1  # training gives a V its two chunks itself
        if candidate.chunks != natural:
            add += ["--num-virtual-stages-per-pipeline-rank", str(candidate.chunks)]
    added = _groups(add)
    net_add = [group for group in added if group not in removed]
    net_drop = [group for group in removed if group not in added]
    return Change(words=tuple(words + add), add=tuple(w for g in net_add for w in g),
                  drop=tuple(w for g in net_drop for w in g))


def refusal(parser: argparse.ArgumentParser, run: Run, candidate: Candidate) -> str | None:
    """Why the candidate does not apply to this run (None: it does): training's start-up checks on its command
    line first (their messages name the fix), then whether the layers lay out over its virtual stages."""
    if run.layout.pp < 2:
        return "a pipeline schedule needs --pipeline-model-parallel-size 2 or more"
    try:
        check_flags(parser.parse_args(list(command_line(run, candidate).words)))
    except StartupRefusal as error:
        return str(error)
    if run.layout.placement.counts(run.layout.pp, candidate.chunks) is None:
        stages = run.layout.pp * candidate.chunks
        return (f"--num-layers {run.model.layers} does not divide into {run.layout.pp} x {candidate.chunks} = "
                f"{stages} virtual stages (or the layout flags name another number of stages)")
    return None
