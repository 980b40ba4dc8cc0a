"""pretrain_gpt.py on CPU: megatron's own training loop with the zero-bubble flags.

A few launches serve most tests (megatron's import is the slow part, so each launch runs many runs; see
pretrain_driver.py):
- one `torchrun --nproc-per-node 4` of the driver: it imports pretrain_gpt.py and calls its `main()` once per
  run, each rank's output captured per run; a run that fails fails the tests that read it, with its output;
- one process checking every bad flag combination with the entry script's start-up checks, plus launches of
  `pretrain_gpt.py` with bad flags for the real exit path.
The tiny GPT has no dropout, so different layouts of the same weights (--init-weights-by-global-name)
compute the same losses, and the loss line megatron prints on every iteration must match to the last digit.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import pytest

from tests.markers import marks_tests, starts_in_background
from tests.megatron import pretrain_driver as driver
from tests.megatron import process_groups
from tests.megatron.pretrain_driver import REPO
ITERS = 5
MODEL = (
    "--zero-bubble-cpu --num-layers 8 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 "
    "--micro-batch-size 2 --global-batch-size 16 --tokenizer-type NullTokenizer --vocab-size 128 --mock-data "
    "--hidden-dropout 0 --attention-dropout 0 --init-weights-by-global-name --seed 1234"
).split()
EVAL_INTERVAL = 3
TRAIN = (
    f"--train-iters {ITERS} --lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine --num-workers 0 "
    f"--log-interval 1 --log-params-norm --eval-iters 1 --eval-interval {EVAL_INTERVAL}"
).split()
PP4 = ["--pipeline-model-parallel-size", "4"]
# Megatron's grad norm (and params norm) adds one partial norm per rank, so its last bit depends on which layers
# share a rank: ZB-V, whose layout megatron has no schedule for, is compared with megatron's 1F1B without clipping
# (the clip coefficient would differ in the last bit, differently on AVX-512 and AVX2), its norms to the printed
# digits. Not with a PP=1 run: there the tied embedding's two gradients add per microbatch, sum(a_i + b_i), where
# every PP > 1 layout (megatron's too) sums each copy over the microbatches first, sum(a_i) + sum(b_i).
NO_CLIP = ["--clip-grad", "0"]
# Post-validation runs: no --log-params-norm (refused with it); untied embeddings and --clip-grad 1.0 make the
# early stages' partial norms stay below the clip while the full norm exceeds it, so steps are rolled back.
TRAIN_PV = [flag for flag in TRAIN if flag != "--log-params-norm"]
PV_MODEL = ["--untie-embeddings-and-output-weights", "--clip-grad", "1.0"]
# fp16 starts with a loss scale that overflows: megatron skips steps and halves the scale, and so must we.
# It undoes steps exactly; bf16 with the in-place inverse (an ulp off in fp32 main params after an undo).
PRECISIONS = {"bf16": ["--bf16"], "fp16": ["--fp16", "--initial-loss-scale", "1e6"]}
ROLLBACK = {"bf16": [], "fp16": ["--zero-bubble-exact-rollback"]}
POST_VALIDATION_RUNS = ("pp4/megatron/clip", "pp4/megatron/clip/resumed", "pp4/zb-h1/post-validation",
                        "pp4/zb-auto/post-validation-exact", "pp4/zb-auto/post-validation-exact/resumed",
                        "pp4/zb-v/clip", "pp4/zb-v/post-validation-exact",
                        "pp4/interleaved/clip",
                        "pp4/interleaved/post-validation-exact", "pp4/zb-auto/interleaved/post-validation-exact",
                        *(f"pp4/{kind}/{precision}" for kind in ("megatron", "post-validation") for precision in PRECISIONS),
                        "dp2pp2/megatron/distributed", "dp2pp2/post-validation/distributed",
                        "dp2pp2/zb-auto/distributed/overlap", "dp2pp2/post-validation/distributed/overlap", "pp4/moe/megatron/fp16",
                        "pp4/moe/post-validation/fp16", "pp4/llama/megatron", "pp4/llama/zb-h1",
                        "pp4/llama/zb-auto/post-validation-exact")
DISTRIBUTED = ["--pipeline-model-parallel-size", "2", "--use-distributed-optimizer"] + PV_MODEL
OVERLAP = ["--overlap-grad-reduce", "--ddp-bucket-size", "20000"]  # several buckets on the first stage
TIMERS = "--zero-bubble-pipeline-timers-start-iter 2 --zero-bubble-pipeline-timers-end-iter 4".split()
ILP = ["--zero-bubble-ilp-time-limit", "2"]
UNEVEN = ["--decoder-first-pipeline-num-layers", "1", "--decoder-last-pipeline-num-layers", "3"]  # 1, 2, 2, 3
LAYOUT = ["--pipeline-model-parallel-layout", "Et|t|t|tt|t|t|t|L"]  # as a V: ranks hold 1, 2, 2, 3 layers
SIX_LAYERS = ["--num-layers", "6"]
ACCOUNTING = ["--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split"]
NO_ILP = ["--zero-bubble-ilp-time-limit", "0"]  # the planner's heuristic alone: seconds less per plan
ZB_AUTO_PV = ["--enable-zero-bubble", "--enable-optimizer-post-validation", "--zero-bubble-exact-rollback", *NO_ILP]
CHECKPOINTS = ("ckpt", "ckpt-v", "ckpt-clip", "ckpt-pv")
# Mixture of experts (top-2 of 4, aux loss, alltoall, expert bias updated after each step) and sequence parallelism
MOE = ("--num-experts 4 --moe-router-topk 2 --moe-aux-loss-coeff 0.01 --moe-token-dispatcher-type alltoall "
       "--disable-bias-linear --moe-router-score-function sigmoid --moe-router-enable-expert-bias").split()
# MoE with post-validation: the dense and the expert optimizer each keep an fp16 loss scaler (overflows skip steps and
# move the scale the MoE aux loss's gradient follows); clip 1.2 rolls a step back; the MoE metrics, reported at
# the printed iterations only under post-validation, are averaged over two iterations.
MOE_PV = PV_MODEL[:1] + ["--clip-grad", "1.2", *PRECISIONS["fp16"], "--log-interval", "2"]
TP2PP2_SP = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--sequence-parallel",
             "--num-layers", "4"]  # half the layers: SP's gathers and scatters make these the slowest runs on gloo
# A Llama-class model (docs/models.md): rotary positions (megatron's unfused RoPE: the CPU default), RMSNorm, SwiGLU,
# grouped-query attention, untied embeddings, no biases. The harness (test_llama_models.py) compares the rest tensor
# by tensor; here the main cases as users launch them.
LLAMA = ("--position-embedding-type rope --normalization RMSNorm --swiglu --group-query-attention --num-query-groups 2 "
         "--untie-embeddings-and-output-weights --disable-bias-linear").split()
# On top of it, an MoE stack as DeepSeek-V3 and Qwen lay it out: a dense first layer (--moe-layer-freq), top-2 of 4
# SwiGLU experts beside a shared expert, and a multi-token-prediction layer on the last stage.
LLAMA_MOE = LLAMA + MOE[:MOE.index("--disable-bias-linear")] + MOE[MOE.index("--disable-bias-linear") + 1:] + ["--moe-ffn-hidden-size", "64", "--moe-shared-expert-intermediate-size", "64",
                                "--moe-layer-freq", "[0]+[1]*7", "--mtp-num-layers", "1"]
LLAMA_DISTRIBUTED = ["--pipeline-model-parallel-size", "2", "--use-distributed-optimizer", *OVERLAP,
                     "--overlap-param-gather", *NO_CLIP]


def _runs(work: str) -> dict[str, list[str]]:
    """Every run of the 4-rank launch: label -> extra flags (in this order: the resume needs the save)."""
    dump, dump_v, dump_moe = (os.path.join(work, name) for name in ("dump", "dump-v", "dump-moe"))
    ckpt, ckpt_v, ckpt_clip, ckpt_pv = (os.path.join(work, name) for name in CHECKPOINTS)
    return {
        "pp4/megatron": PP4,
        # checkpoints cross layouts: one written under megatron's 1F1B resumes under ZB-V and the other way round
        "pp4/megatron/no-clip": PP4 + NO_CLIP + ["--save", ckpt, "--save-interval", "3"],
        "pp4/zb-v/from-megatron": PP4 + NO_CLIP + ["--zero-bubble-v-schedule", "--load", ckpt, "--ckpt-step", "3"],
        "pp4/zb-auto": PP4 + ["--enable-zero-bubble", *TIMERS, *ILP, "--zero-bubble-dump-schedule", dump],
        "pp4/zb-h1": PP4 + ["--pipeline-schedule", "zb-h1"],
        "pp4/1f1b-runtime": PP4 + ["--enable-zb-runtime"],
        "pp4/interleaved": PP4 + ["--pipeline-schedule", "interleaved-1f1b"],
        "pp4/interleaved-runtime": PP4 + ["--pipeline-schedule", "interleaved-1f1b", "--enable-zb-runtime"],
        "pp4/zb-auto/interleaved": PP4 + ["--num-virtual-stages-per-pipeline-rank", "2", "--enable-zero-bubble",
                                          *TIMERS, *NO_ILP],
        "pp4/interleaved-runtime/layers-per-stage": PP4 + ["--num-layers-per-virtual-pipeline-stage", "1",
                                                           "--pipeline-schedule", "interleaved-1f1b", "--enable-zb-runtime"],
        "pp4/zb-v": PP4 + NO_CLIP + ["--zero-bubble-v-schedule", *TIMERS, "--zero-bubble-dump-schedule", dump_v,
                                     "--save", ckpt_v, "--save-interval", "3"],
        "pp4/megatron/from-zb-v": PP4 + NO_CLIP + ["--load", ckpt_v, "--ckpt-step", "3"],
        # megatron's uneven layouts: first/last stage sizes, a layout string (a V reads its i-th stage as virtual
        # stage i), the embedding and loss counted as layers, and --allow-padding-num-layers (6 layers over 4 or 8
        # stages: the ends get fewer, as a layout string megatron's own 1F1B runs too)
        "pp4/megatron/uneven": PP4 + UNEVEN,
        "pp4/zb-h1/uneven": PP4 + UNEVEN + ["--pipeline-schedule", "zb-h1"],
        "pp4/interleaved/layout": PP4 + NO_CLIP + LAYOUT + ["--pipeline-schedule", "interleaved-1f1b"],
        "pp4/interleaved-runtime/layout": PP4 + NO_CLIP + LAYOUT + ["--pipeline-schedule", "interleaved-1f1b",
                                                                  "--enable-zb-runtime"],
        "pp4/zb-v/layout": PP4 + NO_CLIP + LAYOUT + ["--zero-bubble-v-schedule"],
        "pp4/megatron/padding": PP4 + NO_CLIP + SIX_LAYERS + ["--allow-padding-num-layers"],
        "pp4/zb-v/padding": PP4 + NO_CLIP + SIX_LAYERS + ["--allow-padding-num-layers", "--zero-bubble-v-schedule"],
        "pp4/zb-v/accounting": PP4 + NO_CLIP + SIX_LAYERS + ACCOUNTING + ["--zero-bubble-v-schedule"],
        "dp2pp2/megatron": ["--pipeline-model-parallel-size", "2"],
        "dp2pp2/zb-h2": ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zb-h2"],
        # saved after every iteration: the first step is rolled back, so post-validation saves while a speculative
        # step awaits its validation (the checkpoint must hold the validated step)
        "pp4/megatron/clip": PP4 + PV_MODEL + ["--save", ckpt_clip, "--save-interval", "1"],
        "pp4/megatron/clip/resumed": PP4 + PV_MODEL + ["--load", ckpt_clip, "--ckpt-step", "1"],
        "pp4/zb-h1/post-validation": PP4 + PV_MODEL + ["--pipeline-schedule", "zb-h1", "--enable-optimizer-post-validation"],
        "pp4/zb-auto/post-validation-exact": PP4 + PV_MODEL + ZB_AUTO_PV + ["--save", ckpt_pv, "--save-interval", "1"],
        "pp4/zb-auto/post-validation-exact/resumed": PP4 + PV_MODEL + ZB_AUTO_PV + ["--load", ckpt_pv, "--ckpt-step", "1"],
        # two chunks per rank: the result walks from rank 0 in a V, from rank 3 in the interleaved layout; a V
        # layout's reference is megatron's synchronous step on the same layout (its norm adds the same partial norms)
        "pp4/zb-v/clip": PP4 + PV_MODEL + ["--zero-bubble-v-schedule"],
        "pp4/zb-v/post-validation-exact": PP4 + PV_MODEL + ["--zero-bubble-v-schedule", "--enable-optimizer-post-validation",
                                                            "--zero-bubble-exact-rollback"],
        "pp4/interleaved/clip": PP4 + PV_MODEL + ["--pipeline-schedule", "interleaved-1f1b"],
        "pp4/zb-auto/interleaved/post-validation-exact": PP4 + PV_MODEL + [
            "--num-virtual-stages-per-pipeline-rank", "2", "--enable-zero-bubble", "--enable-optimizer-post-validation",
            "--zero-bubble-exact-rollback", *NO_ILP],
        "pp4/interleaved/post-validation-exact": PP4 + PV_MODEL + [
            "--pipeline-schedule", "interleaved-1f1b", "--enable-zb-runtime", "--enable-optimizer-post-validation",
            "--zero-bubble-exact-rollback"],
        **{f"pp4/megatron/{precision}": PP4 + PV_MODEL + flags for precision, flags in PRECISIONS.items()},
        **{f"pp4/post-validation/{precision}": PP4 + PV_MODEL + flags + ROLLBACK[precision] + [
            "--pipeline-schedule", "zb-h2", "--enable-optimizer-post-validation"]
           for precision, flags in PRECISIONS.items()},
        "dp2pp2/zb-auto/overlap": ["--pipeline-model-parallel-size", "2", *OVERLAP, "--enable-zero-bubble", *NO_ILP],
        "pp4/moe/megatron": PP4 + MOE,
        "pp4/moe/zb-auto": PP4 + MOE + ["--enable-zero-bubble", *TIMERS, *NO_ILP, "--zero-bubble-dump-schedule", dump_moe],
        "pp4/moe/megatron/fp16": PP4 + MOE + MOE_PV,
        "pp4/moe/post-validation/fp16": PP4 + MOE + MOE_PV + ["--pipeline-schedule", "zb-h1",
                                                              "--enable-optimizer-post-validation", "--zero-bubble-exact-rollback"],
        "tp2pp2/sp/megatron": TP2PP2_SP,
        "tp2pp2/sp/zb-auto": TP2PP2_SP + ["--enable-zero-bubble", *NO_ILP],
        "dp2pp2/megatron/distributed": DISTRIBUTED,
        # the synchronous step on the same buckets, hence the same distributed-optimizer shards and norm
        "dp2pp2/zb-auto/distributed/overlap": DISTRIBUTED + OVERLAP + ["--overlap-param-gather", "--pipeline-schedule",
                                                                        "zb-auto", *NO_ILP],
        "dp2pp2/post-validation/distributed/overlap": DISTRIBUTED + OVERLAP + [
            "--overlap-param-gather", "--pipeline-schedule", "zb-auto", "--enable-optimizer-post-validation",
            "--zero-bubble-exact-rollback", *NO_ILP],
        "dp2pp2/post-validation/distributed": DISTRIBUTED + ["--pipeline-schedule", "zb-h1",
                                                             "--enable-optimizer-post-validation", "--zero-bubble-exact-rollback"],
        "pp4/llama/megatron": PP4 + LLAMA,
        "pp4/llama/zb-h1": PP4 + LLAMA + ["--pipeline-schedule", "zb-h1"],
        "pp4/llama/zb-auto/post-validation-exact": PP4 + LLAMA + ZB_AUTO_PV,
        "pp4/llama/megatron/no-clip": PP4 + LLAMA + NO_CLIP,
        "pp4/llama/zb-v": PP4 + LLAMA + NO_CLIP + ["--zero-bubble-v-schedule"],
        # megatron buckets the first stage only, the runtime every stage: other distributed-optimizer shards, so no
        # clipping (the grad norm sums other partial norms: its last bit may differ)
        "dp2pp2/llama/megatron/distributed/overlap": LLAMA + LLAMA_DISTRIBUTED,
        "dp2pp2/llama/zb-auto/distributed/overlap": LLAMA + LLAMA_DISTRIBUTED + ["--pipeline-schedule", "zb-auto", *NO_ILP],
        "pp4/llama-moe/megatron": PP4 + LLAMA_MOE,
        "pp4/llama-moe/zb-auto": PP4 + LLAMA_MOE + ["--enable-zero-bubble", *NO_ILP],
    }


def _command_lines(work: str) -> dict[str, list[str]]:
    # megatron's index cache: the first run of each data configuration builds the mock dataset's indices (a shuffle of
    # 100000 documents on two ranks, a quarter of a short run's CPU there), the others load them
    cache = ["--data-cache-path", os.path.join(work, "data-cache")]
    return {label: MODEL + (TRAIN_PV if label in POST_VALIDATION_RUNS else TRAIN) + cache + flags
            for label, flags in _runs(work).items()}


# ---------------------------------------------------------------- parsing megatron's log


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


# ---------------------------------------------------------------- launches (parent side)


# This session's launches, each started once: by conftest.py as soon as the tests are collected, if a selected test
# needs it (markers.starts_in_background: they run while the tests before this module do), else by its fixture.
_STARTED: dict = {}


def _work(tmp_path_factory) -> str:
    """The runs' checkpoints, dumps and per-rank logs (pytest keeps the last few sessions' for a look afterwards)."""
    if "work" not in _STARTED:
        _STARTED["work"] = str(tmp_path_factory.mktemp("pretrain"))
    return _STARTED["work"]


def _start_side_launches(tmp_path_factory) -> list[driver.Background]:
    """The launches that take no timings: the start-up checks, a refusal after megatron's import."""
    if "side" not in _STARTED:
        work = _work(tmp_path_factory)
        cases = {label: ((case[3] if len(case) > 3 else BASE) + case[0], case[1]) for label, case in REFUSALS.items()}
        _STARTED["side"] = {
            "refusals": driver.start_refusals(cases, work, timeout=900),
            "misspelled flag": driver.Background(
                "misspelled-flag", driver.torchrun_command(2, ["pretrain_gpt.py", *BASE, *MISSPELLED]), work, 900),
        }
    return list(_STARTED["side"].values())


def _start_driver(tmp_path_factory) -> list[driver.Background]:
    """The 4-rank driver with every run of `_runs`."""
    if "driver" not in _STARTED:
        work = _work(tmp_path_factory)
        _STARTED["driver"] = driver.start_driver(_command_lines(work), work, nproc=4, timeout=900)
    return [_STARTED["driver"]]


@pytest.fixture(scope="module")
def work_dir(tmp_path_factory) -> str:
    yield _work(tmp_path_factory)
    _STARTED.pop("work", None)


@pytest.fixture(scope="module")
@starts_in_background(_start_side_launches)
def side_launches(tmp_path_factory, work_dir) -> dict[str, driver.Background]:
    _start_side_launches(tmp_path_factory)
    yield _STARTED["side"]
    for launch in _STARTED.pop("side").values():
        launch.stop()


@pytest.fixture(scope="module")
@starts_in_background(_start_driver)
@marks_tests(pytest.mark.exactness)
def runs(tmp_path_factory, work_dir, side_launches) -> driver.Runs:
    """label -> the combined output of all ranks of that run (4-rank launch of the driver); reading a run that
    did not finish on every rank fails the test with that run's output."""
    (launch,) = _start_driver(tmp_path_factory)
    try:
        return driver.driver_results(launch, list(_runs(work_dir)), work_dir, nproc=4)
    finally:
        _STARTED.pop("driver").stop()


def test_no_run_leaves_its_process_groups_behind(runs):
    """Each rank runs every training run in one process; with the groups of earlier runs left alive a rank
    held over 1,000 threads by the end."""
    for line_start in (driver.THREADS_LINE, driver.PEAK_THREADS_LINE):
        counts = {label: [int(line[len(line_start):]) for line in log.splitlines() if line.startswith(line_start)]
                  for label, log in runs.finished().items()}
        assert counts and all(counts.values()), counts  # every run reported
        assert max(max(c) for c in counts.values()) < process_groups.MAX_RANK_THREADS, (line_start, counts)


# ---------------------------------------------------------------- tests: losses


# Relative difference allowed between a run whose rollbacks use the in-place inverse (an ulp or two off in the fp32
# parameters after each undo) and megatron's: about ten ulps of fp32 at the loss; a step lost, doubled or clipped
# with a wrong norm moves the loss by 1e-4 and more.
INVERSE_TOLERANCE = 1e-6


def _same_training(ours: str, reference: str, iterations=range(1, ITERS + 1), norms_to_the_printed_digit=False,
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


def _same_validation(ours: str, reference: str, tolerance: float = 0.0) -> None:
    mine, theirs = validation_losses(ours), validation_losses(reference)
    assert len(mine) == len(theirs) and theirs, (mine, theirs)
    for got, expected in zip(mine, theirs):
        assert abs(float(got) - float(expected)) <= tolerance * abs(float(expected)) if tolerance else got == expected


@pytest.mark.parametrize("run", ["pp4/zb-auto", "pp4/zb-h1", "pp4/1f1b-runtime"])
def test_pp4_schedules_print_the_losses_of_megatrons_1f1b_on_every_iteration(runs, run):
    _same_training(runs[run], runs["pp4/megatron"])
    assert validation_losses(runs[run]) == validation_losses(runs["pp4/megatron"]) != []


def test_zb_v_on_four_ranks_prints_the_losses_of_megatrons_1f1b(runs):
    """Both without clipping (NO_CLIP): the losses to the last digit, the norms to their printed digits."""
    _same_training(runs["pp4/zb-v"], runs["pp4/megatron/no-clip"], norms_to_the_printed_digit=True)
    _same_validation(runs["pp4/zb-v"], runs["pp4/megatron/no-clip"])


@pytest.mark.parametrize("run", ["pp4/interleaved-runtime", "pp4/interleaved-runtime/layers-per-stage",
                                 "pp4/zb-auto/interleaved"])
def test_interleaved_schedules_through_the_runtime_print_megatrons_interleaved_losses(runs, run):
    """Two chunks per rank given by the schedule or by megatron's --num-layers-per-virtual-pipeline-stage; zb-auto
    over two chunks per rank, re-planned from the measured costs after iteration 4."""
    _same_training(runs[run], runs["pp4/interleaved"])
    assert validation_losses(runs[run]) == validation_losses(runs["pp4/interleaved"]) != []
    schedule = "zb-auto" if "zb-auto" in run else "interleaved-1f1b"
    assert f"zero-bubble: running {schedule} (p=4, m=8, 2 chunks per rank)" in runs[run]
    assert ("zero-bubble: re-planned zb-auto" in runs[run]) == (schedule == "zb-auto")
    assert "zero-bubble:" not in runs["pp4/interleaved"]


@pytest.mark.parametrize("run, reference", [
    ("pp4/zb-h1/post-validation", "pp4/megatron/clip"), ("pp4/zb-auto/post-validation-exact", "pp4/megatron/clip"),
    ("pp4/zb-v/post-validation-exact", "pp4/zb-v/clip"),
    ("pp4/interleaved/post-validation-exact", "pp4/interleaved/clip"),
    ("pp4/zb-auto/interleaved/post-validation-exact", "pp4/interleaved/clip"),
])
def test_optimizer_post_validation_prints_megatrons_losses_and_grad_norms_and_counts_rollbacks(runs, run, reference):
    """Exact rollback against megatron's synchronous step on the same layout, digit for digit; the in-place inverse
    (pp4/zb-h1/post-validation) within INVERSE_TOLERANCE."""
    tolerance = 0.0 if run.endswith("-exact") else INVERSE_TOLERANCE
    _same_training(runs[run], runs[reference], tolerance=tolerance)
    _same_validation(runs[run], runs[reference], tolerance=tolerance)
    rollbacks = [int(n) for n in re.findall(r"number of optimizer rollbacks: +(\d+) \|", runs[run])]
    assert len(rollbacks) == ITERS and sum(rollbacks) >= 1  # the first step is rolled back and re-stepped
    assert "number of optimizer rollbacks" not in runs["pp4/megatron/clip"]
    assert "optimizer post-validation on" in runs[run]


def _iteration_lines(log: str) -> list[str]:
    """Everything megatron prints per iteration but the clock, and our extra count."""
    found = re.findall(r"( iteration +\d+/.*)", log)
    return [re.sub(r"elapsed time per iteration \(ms\): [0-9.]+ \|| number of optimizer rollbacks: +\d+ \|", "", line)
            for line in found]


def _without_figures(log: str) -> list[str]:
    return [re.sub(r"(lm loss|grad norm): [0-9.E+-]+ \|", "", line) for line in _iteration_lines(log)]


@pytest.mark.parametrize("precision", list(PRECISIONS))
def test_optimizer_post_validation_with_mixed_precision_prints_megatrons_iteration_lines(runs, precision):
    """bf16/fp16 with fp32 main params (fp16 with loss-scale overflows, skipped steps and scale updates)."""
    ours, reference = runs[f"pp4/post-validation/{precision}"], runs[f"pp4/megatron/{precision}"]
    if precision == "fp16":
        assert _iteration_lines(ours) == _iteration_lines(reference) and len(_iteration_lines(reference)) == ITERS
    else:  # the in-place inverse: the numbers within INVERSE_TOLERANCE, the rest of the line as megatron's
        assert _without_figures(ours) == _without_figures(reference) and len(_iteration_lines(reference)) == ITERS
        _same_training(ours, reference, tolerance=INVERSE_TOLERANCE)
    if precision == "fp16":  # exact rollback: the evaluations after the last step agree to the last digit too
        assert validation_losses(ours) == validation_losses(reference) != []
        assert "number of skipped iterations:   1" in reference  # the overflow path was exercised
    assert "number of optimizer rollbacks:   1" in ours


def test_optimizer_post_validation_with_the_distributed_optimizer_prints_megatrons_losses(runs):
    _same_training(runs["dp2pp2/post-validation/distributed"], runs["dp2pp2/megatron/distributed"])
    assert validation_losses(runs["dp2pp2/post-validation/distributed"]) == validation_losses(
        runs["dp2pp2/megatron/distributed"]) != []


def test_overlapped_gradient_reduction_prints_the_losses_of_megatrons_1f1b(runs):
    _same_training(runs["dp2pp2/zb-auto/overlap"], runs["dp2pp2/megatron"])
    assert validation_losses(runs["dp2pp2/zb-auto/overlap"]) == validation_losses(runs["dp2pp2/megatron"]) != []


def test_post_validation_with_overlapped_reduction_and_parameter_gathers_prints_megatrons_losses(runs):
    """Against megatron's synchronous step on the same buckets (every stage bucketed, so the same distributed-optimizer
    shards: with other shards the norm's partial sums, and so its last bit, differ). Rollbacks while a parameter
    gather is in flight: test_post_validation.py, pp2/distributed/overlap."""
    ours, reference = runs["dp2pp2/post-validation/distributed/overlap"], runs["dp2pp2/zb-auto/distributed/overlap"]
    _same_training(ours, reference)
    _same_validation(ours, reference)
    assert "optimizer post-validation on" in ours


def test_a_data_parallel_run_prints_megatrons_losses(runs):
    _same_training(runs["dp2pp2/zb-h2"], runs["dp2pp2/megatron"])


def test_a_tensor_and_sequence_parallel_run_prints_the_losses_of_megatrons_1f1b_with_the_same_flags(runs):
    _same_training(runs["tp2pp2/sp/zb-auto"], runs["tp2pp2/sp/megatron"])
    assert validation_losses(runs["tp2pp2/sp/zb-auto"]) == validation_losses(runs["tp2pp2/sp/megatron"]) != []


MOE_AUX_LOSS = re.compile(r" iteration +(\d+)/ *\d+ \|.*? load_balancing_loss: ([0-9.E+-]+) \|")


def test_moe_zb_auto_prints_megatrons_losses_and_moe_auxiliary_loss(runs):
    _same_training(runs["pp4/moe/zb-auto"], runs["pp4/moe/megatron"])
    assert validation_losses(runs["pp4/moe/zb-auto"]) == validation_losses(runs["pp4/moe/megatron"]) != []
    aux = [dict(MOE_AUX_LOSS.findall(runs[label])) for label in ("pp4/moe/zb-auto", "pp4/moe/megatron")]
    assert aux[0] == aux[1] and sorted(aux[1]) == [str(i) for i in range(1, ITERS + 1)]
    assert len(set(aux[1].values())) > 1  # the load balance changes as the experts and their biases train


def test_moe_with_post_validation_prints_megatrons_iteration_lines_and_moe_loss(runs):
    """Two statistics groups (dense, experts) and two fp16 loss scalers; a step rolled back, steps skipped; the
    load-balancing loss megatron averages over the iterations since the last line (here two) is the same."""
    ours, reference = runs["pp4/moe/post-validation/fp16"], runs["pp4/moe/megatron/fp16"]
    assert _iteration_lines(ours) == _iteration_lines(reference)
    assert sorted(iteration_figures(reference)) == [1, *range(2, ITERS + 1, 2)] and "load_balancing_loss" in reference
    assert validation_losses(ours) == validation_losses(reference) != []
    assert "number of skipped iterations:   1" in reference  # the fp16 overflows were exercised
    assert sum(int(n) for n in re.findall(r"number of optimizer rollbacks: +(\d+) \|", ours)) >= 1
    assert "optimizer post-validation on" in ours


def test_replanning_measures_the_moe_layers_like_any_other(runs, work_dir):
    """Every stage's MoE layers: T_F, T_B and a deferred T_W measured, M_B and M_W in bytes, and a plan on them."""
    from megatron.zero_bubble.schedules import Costs
    from megatron.zero_bubble.schedules.schedule import Schedule

    lines = SCHEDULE_LINE.findall(runs["pp4/moe/zb-auto"])
    assert [(kind, schedule) for kind, schedule, _ in lines] == [("running", "zb-auto"), ("re-planned", "zb-auto")]
    replanned = Schedule.from_json(open(os.path.join(work_dir, "dump-moe", "zb-auto-m8-iter5.json")).read())
    costs = Costs.from_dict(replanned.info["costs"])
    assert costs.memory_unit == "bytes" and len(costs.t_w) == 4
    assert min(costs.t_f) > 0 and min(costs.t_b) > 0 and min(costs.t_w) > 0 and min(costs.m_w) > 0


# ---------------------------------------------------------------- tests: Llama-class models


def _llama_layer_parameters(hidden: int = 64, heads: int = 4, groups: int = 2, ffn: int = 128) -> int:
    """One layer of the Llama model: queries of every head and keys and values of each group (GQA), SwiGLU's gate and
    up projection in fc1 (megatron sizes its ffn to 8/3 hidden, a multiple of 64), no biases, RMSNorm scales."""
    head = hidden // heads
    return hidden * (heads + 2 * groups) * head + hidden * hidden + 2 * ffn * hidden + ffn * hidden + 2 * hidden


def test_the_llama_runs_build_the_llama_model(runs):
    """Two layers per rank; the first stage adds the word embedding (no position embedding: rotary), the last the final
    norm and its own output layer (untied)."""
    per_rank, layers, embedding = _parameters_per_rank(runs["pp4/llama/megatron"]), 2 * _llama_layer_parameters(), 128 * 64
    assert per_rank == {0: embedding + layers, 1: layers, 2: layers, 3: layers + 64 + embedding}


@pytest.mark.parametrize("run", ["pp4/llama/zb-h1", "pp4/llama/zb-auto/post-validation-exact"])
def test_a_llama_class_model_prints_megatrons_losses_and_grad_norms(runs, run):
    """Clipped steps (the grad norm is above 1.0): with post-validation and exact rollback the first is taken on
    partial norms, rolled back and re-stepped, and every printed figure is still megatron's."""
    _same_training(runs[run], runs["pp4/llama/megatron"])
    _same_validation(runs[run], runs["pp4/llama/megatron"])
    if "post-validation" in run:
        assert sum(int(n) for n in re.findall(r"number of optimizer rollbacks: +(\d+) \|", runs[run])) >= 1


@pytest.mark.parametrize("run, reference", [("pp4/llama/zb-v", "pp4/llama/megatron/no-clip"),
                                            ("dp2pp2/llama/zb-auto/distributed/overlap",
                                             "dp2pp2/llama/megatron/distributed/overlap")])
def test_a_llama_class_model_without_clipping_prints_megatrons_losses(runs, run, reference):
    """ZB-V's layout, and the distributed optimizer's shards of every stage bucketed (megatron buckets the first
    only): the losses to the last digit, the norms (sums of other partial norms) to their printed digits."""
    _same_training(runs[run], runs[reference], norms_to_the_printed_digit=True)
    _same_validation(runs[run], runs[reference])


MTP_LOSS = re.compile(r" iteration +(\d+)/ *\d+ \|.*? mtp_1 loss: ([0-9.E+-]+) \|")


def test_a_llama_moe_with_a_dense_first_layer_shared_experts_and_mtp_prints_megatrons_figures(runs):
    """The MoE and MTP losses megatron logs too, every iteration: the split check and the W passes leave the MTP
    layer's loss tracker as megatron's schedule leaves it, and the LM head, used for the main and the MTP logits,
    accumulates its weight gradient as megatron's autograd does."""
    ours, reference = runs["pp4/llama-moe/zb-auto"], runs["pp4/llama-moe/megatron"]
    _same_training(ours, reference)
    _same_validation(ours, reference)
    for pattern in (MTP_LOSS, MOE_AUX_LOSS):
        figures = [dict(pattern.findall(log)) for log in (ours, reference)]
        assert figures[0] == figures[1] and sorted(figures[1]) == [str(i) for i in range(1, ITERS + 1)]
    per_rank = _parameters_per_rank(reference)  # rank 0: a dense and an MoE layer, and the embedding; rank 1: two MoE
    moe_mlp = 5 * 3 * 64 * 64 + 4 * 64  # four SwiGLU experts and a shared one (ffn 64 each), the router
    assert per_rank[1] - per_rank[0] == moe_mlp - 3 * 128 * 64 - 128 * 64  # the MoE MLP in place of the dense one


def _resumes_like(resumed: str, uninterrupted: str, first: int, norms_to_the_printed_digit: bool = False) -> None:
    """A run resumed from the checkpoint of iteration first-1 against the uninterrupted run: the norms of every
    iteration; the loss where megatron prints one iteration's own (its second logged iteration after a start
    averages two, as in any megatron run); the final evaluations."""
    assert "successfully loaded checkpoint" in resumed and min(iteration_figures(resumed)) == first
    mine, theirs = iteration_figures(resumed), iteration_figures(uninterrupted)
    for iteration in range(first, ITERS + 1):
        keys = ("grad norm", "params norm", *(("lm loss",) if iteration != first + 1 else ()))
        for key in keys:
            got, expected = mine[iteration][key], theirs[iteration][key]
            if norms_to_the_printed_digit and key.endswith("norm"):
                assert abs(float(got) - float(expected)) <= 0.0011, f"{key} at iteration {iteration}"
            else:
                assert got == expected, f"{key} at iteration {iteration}"
    # the evaluations after the checkpoint: every EVAL_INTERVAL iterations, then the validation and test sets at the end
    after = sum(1 for iteration in range(first, ITERS + 1) if iteration % EVAL_INTERVAL == 0) + 2
    assert validation_losses(resumed) == validation_losses(uninterrupted)[-after:] != []


@pytest.mark.parametrize("resumed, saved", [("pp4/zb-v/from-megatron", "pp4/megatron/no-clip"),
                                            ("pp4/megatron/from-zb-v", "pp4/zb-v")])
def test_a_checkpoint_resumes_across_megatrons_1f1b_and_zb_v_with_the_uninterrupted_losses(runs, resumed, saved):
    """Megatron's distributed checkpoint names layers by their global number, so the V placement reads what
    1F1B's wrote and the other way round; compared with megatron's uninterrupted 1F1B run (norms to their printed
    digits, as ZB-V against 1F1B everywhere)."""
    assert "successfully saved checkpoint" in runs[saved]
    _resumes_like(runs[resumed], runs["pp4/megatron/no-clip"], first=4, norms_to_the_printed_digit=True)


def test_post_validation_saves_the_validated_step_and_resumes_as_megatrons_own_save_and_resume(runs):
    """Saved after every iteration: the first step, stepped on partial sums, is rolled back and re-stepped clipped
    when its validation arrives, and the checkpoint of iteration 1 is written only after that validation (else it
    would hold the speculative step). The resumed run prints megatron's resumed run's lines, digit for digit."""
    saving = runs["pp4/zb-auto/post-validation-exact"]
    first_rollbacks = re.search(r" iteration +1/.*?number of optimizer rollbacks: +(\d+) \|", saving)
    assert first_rollbacks and first_rollbacks.group(1) == "1"  # the checkpointed step had been rolled back
    ours, reference = runs["pp4/zb-auto/post-validation-exact/resumed"], runs["pp4/megatron/clip/resumed"]
    assert "successfully loaded checkpoint" in ours and min(iteration_figures(ours)) == 2
    assert _iteration_lines(ours) == _iteration_lines(reference) and len(_iteration_lines(reference)) == ITERS - 1
    assert validation_losses(ours) == validation_losses(reference) != []


PARAMETERS_LINE = re.compile(r"number of parameters on \(tensor, \S+ pipeline\) model parallel rank "
                             r"\(0, 0, (\d+)\): (\d+)")


def _parameters_per_rank(log: str) -> dict[int, int]:
    return {int(rank): int(count) for rank, count in PARAMETERS_LINE.findall(log)}


def test_megatrons_uneven_first_and_last_stages_give_megatrons_losses_under_zb_h1(runs):
    _same_training(runs["pp4/zb-h1/uneven"], runs["pp4/megatron/uneven"])
    assert validation_losses(runs["pp4/zb-h1/uneven"]) == validation_losses(runs["pp4/megatron/uneven"]) != []
    per_rank = _parameters_per_rank(runs["pp4/megatron/uneven"])
    assert per_rank[1] == per_rank[2] and per_rank[3] > per_rank[1]  # 2, 2 and 3 layers: the layout was used


def test_a_layout_string_runs_interleaved_through_the_runtime_and_as_a_v_with_megatrons_losses(runs):
    """The same layout string: megatron's interleaved placement (stage i = chunk i // p of rank i % p) through
    megatron and through the runtime, digit for digit; as a V (stage i = the V's virtual stage i), with the
    layers it names on each rank, to the norms' printed digits."""
    reference = runs["pp4/interleaved/layout"]
    _same_training(runs["pp4/interleaved-runtime/layout"], reference)
    _same_training(runs["pp4/zb-v/layout"], reference, norms_to_the_printed_digit=True)
    _same_validation(runs["pp4/zb-v/layout"], reference)
    per_rank = _parameters_per_rank(runs["pp4/zb-v/layout"])  # virtual stages (r, 7-r): 1+1, 1+1 and 2+1 layers
    assert per_rank[1] == per_rank[2] and 2 * per_rank[3] == 3 * per_rank[1]


@pytest.mark.parametrize("run", ["pp4/zb-v/padding", "pp4/zb-v/accounting"])
def test_layers_that_do_not_divide_into_the_v_give_megatrons_losses_with_padding_or_accounting(runs, run):
    """Six layers over the V's eight virtual stages: the two at the ends (both on rank 0, with the embedding and
    the loss) get none, through --allow-padding-num-layers or megatron's --account-for-*-in-pipeline-split;
    compared with megatron's 1F1B on --allow-padding-num-layers' layout for four stages (1, 2, 2, 1)."""
    _same_training(runs[run], runs["pp4/megatron/padding"], norms_to_the_printed_digit=True)
    _same_validation(runs[run], runs["pp4/megatron/padding"])
    per_rank, reference = _parameters_per_rank(runs[run]), _parameters_per_rank(runs["pp4/megatron/padding"])
    assert per_rank[1] == per_rank[2] == per_rank[3] == reference[1]  # two layers on every rank but 0


# ---------------------------------------------------------------- tests: planning and re-planning


SCHEDULE_LINE = re.compile(r"zero-bubble: (running|re-planned) (\S+) .*predicted bubble rate ([0-9.]+)%")


@pytest.mark.parametrize("run,name,dump", [("pp4/zb-auto", "zb-auto", "dump"), ("pp4/zb-v", "zb-v", "dump-v")])
def test_after_the_timer_window_the_log_shows_the_replanned_schedule_and_the_dump_validates(runs, work_dir, run, name, dump):
    from megatron.zero_bubble.schedules import Costs
    from megatron.zero_bubble.schedules.schedule import Schedule
    from megatron.zero_bubble.schedules.validate import validate

    lines = SCHEDULE_LINE.findall(runs[run])
    assert [(kind, schedule) for kind, schedule, _ in lines] == [("running", name), ("re-planned", name)]
    # timers 2..4 in megatron's counter: logged iterations 3-4 measured, the new schedule from logged 5 on
    assert "running it from iteration 5" in runs[run] and "measured in iterations 3-4" in runs[run]
    files = sorted(os.listdir(os.path.join(work_dir, dump)))
    assert files == [f"{name}-m8-initial.json", f"{name}-m8-initial.png", f"{name}-m8-iter5.json", f"{name}-m8-iter5.png",
                     f"{name}-m8-measured-iter4.trace.json"]
    replanned = Schedule.from_json(open(os.path.join(work_dir, dump, f"{name}-m8-iter5.json")).read())
    costs = Costs.from_dict(replanned.info["costs"])
    assert costs.memory_unit == "bytes" and min(costs.m_f) > 0 and min(costs.t_f) > 0 and min(costs.t_w) > 0
    timeline = validate(replanned, costs)
    assert abs(100 * timeline.bubble_rate - float(lines[1][2])) < 0.01
    # the measured timeline of the last profiled iteration (logged 4): every rank's passes of the schedule that
    # ran then, in its order, each with its planned start
    ran = Schedule.from_json(open(os.path.join(work_dir, dump, f"{name}-m8-initial.json")).read())
    trace = json.load(open(os.path.join(work_dir, dump, f"{name}-m8-measured-iter4.trace.json")))
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    for rank in range(4):
        mine = [e for e in events if e["tid"] == rank]
        assert [e["name"] for e in mine] == [str(p) for p in ran.ranks[rank]]
        assert all(e["dur"] > 0 and e["args"]["planned_start_ms"] >= 0 for e in mine)
        assert [e["ts"] for e in mine] == sorted(e["ts"] for e in mine)


def test_megatrons_own_schedule_runs_without_the_runtime(runs):
    assert "zero-bubble:" not in runs["pp4/megatron"] and "zero-bubble:" not in runs["tp2pp2/sp/megatron"]


# ---------------------------------------------------------------- tests: the measuring pieces (no launch)


def test_saved_activation_bytes_counts_what_autograd_keeps_once_and_skips_weights():
    import torch

    from megatron.zero_bubble.runtime.profiling import saved_activation_bytes

    weight = torch.nn.Parameter(torch.randn(8, 8))
    x = torch.randn(4, 8, requires_grad=True)
    hidden = x.exp()  # saves its result (4 x 8 floats)
    out = (hidden * weight[:4]).sum()  # saves `hidden` again (counted once) and a view of the weight (skipped)
    assert saved_activation_bytes(out, [weight]) == hidden.numel() * 4
    out.backward()  # reading the graph left it usable
    assert torch.equal(x.grad, (weight[:4] * hidden).detach())


def test_measured_costs_take_the_slowest_replica_of_each_virtual_stage():
    from megatron.zero_bubble.runtime.planning import measured_costs

    def report(pp_rank, t_f, t_b, t_w, bw=None):
        return {"pp_rank": pp_rank, "t_f": [t_f], "t_b": [t_b], "t_w": [t_w], "t_bw": [bw], "m_f": [100.0 * (pp_rank + 1)],
                "m_w": [50.0]}

    costs = measured_costs([report(0, 1.0, 2.0, 0.5), report(1, 3.0, 1.0, 0.7), report(0, 1.5, 1.0, 0.4),
                            report(1, 2.0, None, None, bw=4.0)], "single", 2, 1, t_comm=0.1)
    assert costs.t_f == (1.5, 3.0) and costs.t_b == (2.0, 1.0) and costs.t_w == (0.5, 0.7)
    assert costs.m_f == (100.0, 200.0) and costs.t_comm == 0.1 and costs.memory_unit == "bytes"
    only_fused = measured_costs([report(0, 1.0, None, None, bw=3.0), report(1, 1.0, None, None, bw=2.0)], "single", 2, 1, 0.0)
    assert only_fused.t_b == (3.0, 2.0) and only_fused.t_w == (0.0, 0.0)  # a 1F1B run: BW counted as B


# ---------------------------------------------------------------- bad input


BASE = MODEL + TRAIN
REFUSALS = {  # label -> (extra flags, world size, words the one-line refusal must contain)
    "conflicting schedule flags": (PP4 + ["--enable-zero-bubble", "--zero-bubble-v-schedule"], 4,
                                   ["--enable-zero-bubble", "--zero-bubble-v-schedule"]),
    "conflicting --pipeline-schedule": (PP4 + ["--pipeline-schedule", "zb-h1", "--enable-zero-bubble"], 4,
                                        ["--pipeline-schedule zb-h1", "--enable-zero-bubble"]),
    "zb-v layers not divisible by 2p": (["--pipeline-model-parallel-size", "2", "--zero-bubble-v-schedule",
                                         "--num-layers", "6"], 2,
                                        ["--num-layers 6", "multiple of 4", "--allow-padding-num-layers"]),
    "padding with a layout flag": (["--pipeline-model-parallel-size", "2", "--zero-bubble-v-schedule", "--num-layers", "6",
                                    "--allow-padding-num-layers", "--account-for-loss-in-pipeline-split"], 2,
                                   ["--allow-padding-num-layers", "--account-for-loss-in-pipeline-split", "keep one"]),
    "padding that leaves a stage empty": (PP4 + ["--zero-bubble-v-schedule", "--num-layers", "5",
                                                 "--allow-padding-num-layers"], 4,
                                          ["--allow-padding-num-layers", "give at least 6 layers"]),
    "ILP time limit without zb-auto": (PP4 + ["--pipeline-schedule", "zb-h1", "--zero-bubble-ilp-time-limit", "2"], 4,
                                       ["--zero-bubble-ilp-time-limit", "--pipeline-schedule", "drop the flag"]),
    "zb-v with megatron's uneven first stage": (PP4 + ["--zero-bubble-v-schedule", "--decoder-first-pipeline-num-layers",
                                                       "1"], 4,
                                                ["--decoder-first-pipeline-num-layers", "rank 0",
                                                 "--pipeline-model-parallel-layout"]),
    "zb-v budget below V-Min's": (PP4 + ["--zero-bubble-v-schedule", "--zero-bubble-max-pending-backward", "1"], 4,
                                  ["--zero-bubble-v-schedule", "below V-Min's floor((p+4)/3) = 2 M_B"]),
    "V memory setup without zb-v": (PP4 + ["--enable-zero-bubble", "--zero-bubble-v-schedule-mem-setup", "half"], 4,
                                    ["--zero-bubble-v-schedule-mem-setup", "add --zero-bubble-v-schedule"]),
    "V memory set twice": (PP4 + ["--zero-bubble-v-schedule", "--zero-bubble-v-schedule-mem-setup", "half",
                                  "--zero-bubble-max-pending-backward", "3"], 4,
                           ["--zero-bubble-v-schedule-mem-setup and --zero-bubble-max-pending-backward"]),
    "memory limit below one microbatch": (PP4 + ["--enable-zero-bubble", "--zero-bubble-max-pending-backward", "0.5"], 4,
                                          ["--zero-bubble-max-pending-backward", "below one microbatch"]),
    "megatron's own wgrad deferral with the runtime": (PP4 + ["--pipeline-schedule", "zb-h1", "--delay-wgrad-compute"],
                                                       4, ["--delay-wgrad-compute", "backward_dw", "drop"]),
    "missing --data-path": (["--pipeline-model-parallel-size", "2", "--enable-zero-bubble", "--data-path",
                             "/nonexistent/corpus_text_document"], 2, ["--data-path", "corpus_text_document.bin"]),
    "pipeline schedule with PP=1": (["--pipeline-schedule", "zb-h1"], 1, ["--pipeline-model-parallel-size", "2 or more"]),
    "zero bubble with PP=1": (["--enable-zero-bubble"], 1, ["--enable-zero-bubble", "--pipeline-model-parallel-size"]),
    "post-validation with result validation": (PP4 + ["--enable-zero-bubble", "--enable-optimizer-post-validation",
                                                       "--rerun-mode", "validate_results"], 4,
                                                ["--rerun-mode validate_results", "--rerun-mode disabled"]),
    "post-validation in place with tied embeddings, good flags": (
        PP4 + ["--enable-zero-bubble", "--enable-optimizer-post-validation"], 4, None, MODEL + TRAIN_PV),
    "post-validation with multi-token prediction": (
        PP4 + ["--enable-zero-bubble", "--enable-optimizer-post-validation", "--mtp-num-layers", "1"], 4,
        ["--mtp-num-layers", "--enable-optimizer-post-validation"], MODEL + TRAIN_PV),
    "variable sequence lengths": (PP4 + ["--enable-zero-bubble", "--sft"], 4, ["--sft", "variable sequence lengths"]),
    "post-validation with the parameter norm": (PP4 + ["--enable-zero-bubble", "--enable-optimizer-post-validation"], 4,
                                                ["--log-params-norm", "--enable-optimizer-post-validation"]),
    "post-validation without a schedule": (PP4 + ["--enable-optimizer-post-validation"], 4,
                                           ["--enable-optimizer-post-validation", "--enable-zero-bubble"]),
    "exact rollback without post-validation": (PP4 + ["--enable-zero-bubble", "--zero-bubble-exact-rollback"], 4,
                                               ["--zero-bubble-exact-rollback", "--enable-optimizer-post-validation"]),
    "post-validation with megatron's own schedule": (PP4 + ["--pipeline-schedule", "1f1b", "--enable-optimizer-post-validation"],
                                                     4, ["--enable-optimizer-post-validation", "--pipeline-schedule 1f1b"]),
    "one-chunk schedule with a virtual pipeline": (PP4 + ["--pipeline-schedule", "zb-h2", "--num-virtual-stages-per-pipeline-rank",
                                                          "2"], 4, ["--pipeline-schedule zb-h2", "one model chunk", "zb-auto"]),
    "runtime flag with PP=1": (["--enable-zb-runtime"], 1, ["--enable-zb-runtime", "--pipeline-model-parallel-size"]),
    "zero-bubble option without a schedule": (PP4 + ["--zero-bubble-max-pending-backward", "4"], 4,
                                              ["--zero-bubble-max-pending-backward", "--enable-zero-bubble"]),
    "timer window without the runtime": (PP4 + ["--pipeline-schedule", "1f1b", "--zero-bubble-pipeline-timers-end-iter", "3"],
                                         4, ["--zero-bubble-pipeline-timers-end-iter", "--enable-zb-runtime"]),
    "misspelled megatron flag": (["--num-layer", "8"], 1, ["unrecognized arguments: --num-layer 8", "--help"]),
    "local experts with linear biases": (PP4 + ["--num-experts", "4"], 4, ["--num-experts", "--disable-bias-linear"]),
    "grouped experts on CPU": (PP4 + MOE + ["--moe-grouped-gemm"], 4, ["--moe-grouped-gemm needs CUDA", "SequentialMLP"]),
    "flex dispatcher on CPU": (PP4 + MOE + ["--moe-token-dispatcher-type", "flex"], 4,
                               ["--moe-token-dispatcher-type flex needs CUDA", "alltoall"]),
    "shared-expert overlap on CPU": (PP4 + MOE + ["--moe-shared-expert-intermediate-size", "64", "--moe-shared-expert-overlap"],
                                     4, ["--moe-shared-expert-overlap needs CUDA", "drop"]),
    "expert all-to-all overlap with the runtime": (PP4 + MOE + ["--enable-zero-bubble", "--overlap-moe-expert-parallel-comm"],
                                                   4, ["--overlap-moe-expert-parallel-comm", "--enable-zero-bubble"]),
    "post-validation with mixture of experts, good flags": (
        PP4 + MOE + ["--enable-zero-bubble", "--enable-optimizer-post-validation"], 4, None, MODEL + TRAIN_PV),
    "post-validation with the MoE router trace": (
        PP4 + MOE + ["--enable-zero-bubble", "--enable-optimizer-post-validation", "--moe-routing-trace-path", "trace"],
        4, ["--moe-routing-trace-path", "--enable-optimizer-post-validation"], MODEL + TRAIN_PV),
    "mixture of experts and sequence parallelism, good flags": (
        ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--sequence-parallel",
         "--pipeline-schedule", "zb-h1", *MOE], 4, None),
    "multi-token prediction with a V": (PP4 + ["--zero-bubble-v-schedule", "--mtp-num-layers", "1"], 4,
                                        ["--mtp-num-layers does not work with --zero-bubble-v-schedule", "interleaved"]),
    "multi-latent attention on megatron's local layers": (PP4 + ["--multi-latent-attention", "--enable-zero-bubble"], 4,
                                                          ["--multi-latent-attention", "--transformer-impl transformer_engine",
                                                           "not on CPU"]),
    "a Llama-class MoE with MTP, good flags": (PP4 + LLAMA_MOE + ["--pipeline-schedule", "zb-h1"], 4, None),
    "no zero-bubble flag": ([], 1, None),
    "zero bubble, good flags": (PP4 + ["--enable-zero-bubble"], 4, None),
}


# Refused before megatron is imported (pretrain_gpt.py's `early_check`, a second after start), with the same line.
EARLY = ("conflicting schedule flags", "conflicting --pipeline-schedule", "zb-v layers not divisible by 2p",
         "padding with a layout flag", "padding that leaves a stage empty", "zb-v with megatron's uneven first stage",
         "memory limit below one microbatch", "missing --data-path",
         "V memory setup without zb-v", "V memory set twice",
         "pipeline schedule with PP=1", "zero bubble with PP=1", "post-validation without a schedule",
         "exact rollback without post-validation", "one-chunk schedule with a virtual pipeline", "runtime flag with PP=1",
         "zero-bubble option without a schedule", "timer window without the runtime", "multi-token prediction with a V")


def _reported(done, tag: str):
    """The JSON the refusals process printed on its line starting with `tag` (REFUSALS, EARLY_FLAGS, HELP,
    MEGATRON_ASSERT)."""
    line = next((line for line in done.stdout.splitlines() if line.startswith(tag + " ")), None)
    assert line is not None, done.stderr[-4000:]
    return json.loads(line[len(tag) + 1:])


@pytest.fixture(scope="module")
def refusals(side_launches) -> dict:
    done = side_launches["refusals"].result()
    found = _reported(done, "REFUSALS")
    refused = "".join(line for line in done.stdout.splitlines(True) if not line.startswith("HELP ")) + done.stderr
    assert "usage:" not in refused  # a bad megatron flag is one line too, not argparse's usage
    return {**found, "early flags": _reported(done, "EARLY_FLAGS")}


def test_help_lists_megatron_and_zero_bubble_flags(side_launches):
    """`pretrain_gpt.py --help` prints megatron's flags and ours (megatron-core 0.19.2 ships a help text with a stray
    '%' that makes argparse raise; the start-up code escapes it by argparse's own formatting rule)."""
    help_ = _reported(side_launches["refusals"].result(), "HELP")
    assert help_["status"] == 0
    for flag in ("--num-layers", "--enable-zero-bubble", "--zero-bubble-v-schedule", "--allow-padding-num-layers",
                 "--moe-paged-stash-buffer-size-factor-cuda"):
        assert flag in help_["text"]


def test_a_failed_megatron_assert_is_one_line_naming_megatrons_check(side_launches):
    """A mistake megatron's own argument validation catches with a bare assert (--save without --save-interval)
    stops the start-up with one line naming megatron's check (its file, line and asserted expression), exit
    status 2, not a traceback."""
    stopped = _reported(side_launches["refusals"].result(), "MEGATRON_ASSERT")
    errors = [line for line in stopped["stderr"].splitlines() if line.startswith("pretrain_gpt.py: error:")]
    assert stopped["status"] == 2 and len(errors) == 1, stopped
    assert "Traceback" not in stopped["stderr"] + stopped["stdout"]
    assert "megatron's argument check failed at megatron/training/arguments.py:" in errors[0]
    assert "assert args.save_interval is not None" in errors[0]


@pytest.mark.parametrize("label", list(REFUSALS))
def test_bad_input_is_refused_with_one_line_naming_the_flag(refusals, label):
    words = REFUSALS[label][2]
    if words is None:
        assert refusals[label] is None
        return
    message = refusals[label]
    assert message is not None and "\n" not in message
    for word in words:
        assert word in message, f"{word!r} not in {message!r}"


def _early_refusal(flags: list[str], world_size: int, monkeypatch) -> str | None:
    from megatron.zero_bubble.training import arguments

    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    try:
        arguments.check_early(flags)
    except arguments.StartupRefusal as refusal:
        return str(refusal)
    return None


@pytest.mark.parametrize("label", list(REFUSALS))
def test_what_needs_no_megatron_is_refused_before_its_import_with_the_same_line(label, monkeypatch):
    case = REFUSALS[label]
    message = _early_refusal((case[3] if len(case) > 3 else BASE) + case[0], case[1], monkeypatch)
    if label not in EARLY:
        assert message is None  # needs megatron's parsed arguments (or the flags are good)
        return
    assert message is not None and "\n" not in message
    for word in case[2]:
        assert word in message, f"{word!r} not in {message!r}"


def test_the_early_parse_reads_megatrons_flags_as_megatron_declares_them(refusals):
    """Type, nargs, action and destination of each megatron flag the early checks read, against megatron's parser."""
    from megatron.zero_bubble.training.arguments import EARLY_MEGATRON_FLAGS

    declared = refusals["early flags"]
    assert set(EARLY_MEGATRON_FLAGS) <= set(declared)
    for flag in EARLY_MEGATRON_FLAGS:
        ours, megatrons = declared[flag]
        assert megatrons is not None, f"megatron has no {flag}"
        assert ours == megatrons, f"{flag}: ours {ours}, megatron's {megatrons}"


EARLY_ONLY = {  # label -> (flags after BASE, WORLD_SIZE, words of the one line): checks only the early parse can do
    "pipeline size that does not divide the processes": (["--pipeline-model-parallel-size", "3"], 4,
                                                         ["--pipeline-model-parallel-size 3", "does not divide the 4 processes"]),
    "model-parallel sizes without a launcher": (PP4, 1, ["does not divide the 1 processes", "torchrun"]),
    "pipeline size that does not divide the layers": (["--pipeline-model-parallel-size", "4", "--num-layers", "6"], 4,
                                                      ["--num-layers 6", "--pipeline-model-parallel-size 4", "4 or 8"]),
    "interleaved chunks that do not divide the layers": (
        ["--pipeline-model-parallel-size", "2", "--num-layers", "6", "--pipeline-schedule", "interleaved-1f1b"], 2,
        ["--num-layers 6", "2 model chunks per rank (interleaved-1f1b)", "4 or 8"]),
    "virtual stages that do not divide the layers": (PP4 + ["--num-virtual-stages-per-pipeline-rank", "4"], 4,
                                                     ["--num-virtual-stages-per-pipeline-rank 4", "--num-layers 16"]),
    "unknown schedule name": (PP4 + ["--pipeline-schedule", "zb-h3"], 4,
                              ["--pipeline-schedule", "'zb-h3'", "1f1b, interleaved-1f1b, zb-h1, zb-h2, zb-auto, zb-v"]),
    "planner-only schedule": (PP4 + ["--pipeline-schedule", "v-min"], 4, ["--pipeline-schedule", "planner-only"]),
    "missing schedule name": (PP4 + ["--pipeline-schedule"], 4, ["--pipeline-schedule", "expected one argument"]),
    "dump directory under a file": (PP4 + ["--enable-zero-bubble", "--zero-bubble-dump-schedule", "{file}/dump"], 4,
                                    ["--zero-bubble-dump-schedule {file}/dump", "cannot create", "{file} is a file"]),
    "dump directory in /proc": (PP4 + ["--enable-zero-bubble", "--zero-bubble-dump-schedule", "/proc/zb-dump"], 4,
                                ["--zero-bubble-dump-schedule /proc/zb-dump", "cannot create"]),
    "checkpoint directory that is a file": (PP4 + ["--save", "{file}"], 4, ["--save {file}", "is a file"]),
    "tensorboard directory under a file": (["--tensorboard-dir", "{file}/tb"], 1, ["--tensorboard-dir", "cannot create"]),
    "missing vocabulary file": (["--vocab-file", "{file}.missing"], 1, ["--vocab-file {file}.missing", "does not exist"]),
}


@pytest.mark.parametrize("label", list(EARLY_ONLY))
def test_paths_sizes_and_names_are_refused_before_megatron_is_imported(label, tmp_path, monkeypatch):
    flags, world_size, words = EARLY_ONLY[label]
    a_file = str(tmp_path / "a-regular-file")
    open(a_file, "w").close()
    message = _early_refusal(BASE + [flag.replace("{file}", a_file) for flag in flags], world_size, monkeypatch)
    assert message is not None and "\n" not in message
    for word in words:
        assert word.replace("{file}", a_file) in message, f"{word!r} not in {message!r}"


def test_every_run_of_this_file_passes_the_early_checks_and_they_create_the_directories(tmp_path, monkeypatch):
    for label, flags in _command_lines(str(tmp_path)).items():
        assert _early_refusal(flags, 4, monkeypatch) is None, label
    created = sorted([*CHECKPOINTS, "data-cache", "dump", "dump-moe", "dump-v"])
    assert sorted(os.listdir(tmp_path)) == created  # created, and empty: the write check cleans up
    assert all(os.listdir(tmp_path / name) == [] for name in created)


def _one_line_refusal(done: subprocess.CompletedProcess, words: list[str], nproc: int) -> None:
    """One error line, printed once (by rank 0), no usage text, no traceback but torchrun's own report."""
    output = done.stdout + done.stderr
    errors = [line for line in output.splitlines() if "pretrain_gpt.py: error:" in line]
    assert done.returncode not in (0, None), output[-3000:]  # None: still running at its deadline
    assert len(errors) == 1, output[-3000:]  # printed once (rank 0), not by every rank
    assert errors[0].startswith("pretrain_gpt.py: error: ") and "(rank " not in errors[0]
    for word in words:
        assert word in errors[0], f"{word!r} not in {errors[0]!r}"
    assert "usage:" not in output  # no argparse usage dump
    # The one traceback is torchrun's own (ChildFailedError: a child exited non-zero); none from the ranks.
    assert output.count("Traceback") == 1 and "ChildFailedError" in output, output[-3000:]
    frames = [line for line in output.splitlines() if line.strip().startswith('File "')]
    launcher = ("torch/distributed", "bin/torchrun", "<frozen runpy>")
    assert all(any(name in frame for name in launcher) for frame in frames), frames
    # Rank 0 exited first, with status 2 (no rank that refused before it had it killed before it printed); the
    # others were stopped by torchrun afterwards: SIGTERM, or SIGKILL 30 s later where a rank of a launch in the
    # background (the lowest priority, background_site) got no core to act on the SIGTERM while the tests ran.
    root_cause = output.split("Root Cause (first observed failure):")[1]
    assert re.search(r"rank +: 0 \(local_rank: 0\)\s+exitcode +: 2 ", root_cause), root_cause
    statuses = re.findall(r"exitcode +: (-?\d+)", output)
    assert len(statuses) == nproc and set(statuses) <= {"2", "-15", "-9"}, statuses


def test_the_script_stops_a_bad_command_line_with_one_error_line_and_no_traceback():
    done = subprocess.run([sys.executable, "pretrain_gpt.py", *BASE, *PP4, "--enable-zero-bubble",
                           "--zero-bubble-v-schedule"], cwd=REPO, env=dict(driver.launch_environment(), WORLD_SIZE="4"),
                          capture_output=True, text=True, timeout=300)
    errors = [line for line in done.stderr.splitlines() if line.startswith("pretrain_gpt.py: error:")]
    assert done.returncode == 2 and len(errors) == 1 and "Traceback" not in done.stderr + done.stdout
    assert "keep one of them" in errors[0] and done.stdout == ""


TORCHRUN_REFUSALS = {  # label -> (flags after BASE, words of the one line); under torchrun with 4 processes
    "unknown schedule name": (PP4 + ["--pipeline-schedule", "zb-h3"], ["--pipeline-schedule", "'zb-h3'", "zb-h1"]),
    "dump directory that cannot be created": (PP4 + ["--enable-zero-bubble", "--zero-bubble-dump-schedule", "{file}/dump"],
                                              ["--zero-bubble-dump-schedule", "cannot create", "is a file"]),
}


@pytest.mark.parametrize("label", list(TORCHRUN_REFUSALS))
def test_torchrun_refuses_bad_flags_in_one_line_on_rank_0_within_seconds(tmp_path, label):
    flags, words = TORCHRUN_REFUSALS[label]
    a_file = str(tmp_path / "a-regular-file")
    open(a_file, "w").close()
    started = time.monotonic()
    command = driver.torchrun_command(4, ["pretrain_gpt.py", *BASE, *(f.replace("{file}", a_file) for f in flags)])
    done = subprocess.run(command, cwd=REPO, env=driver.launch_environment(), capture_output=True, text=True,
                          timeout=120)
    seconds = time.monotonic() - started
    assert seconds < 30, seconds
    _one_line_refusal(done, words, nproc=4)


MISSPELLED = ["--pipeline-model-parallel-size", "2", "--num-layer", "8"]  # megatron's --num-layers


def test_torchrun_refuses_a_misspelled_megatron_flag_in_one_line_after_megatrons_import(side_launches):
    """A refusal after each rank has imported megatron (ranks reach it seconds apart): still one line, by rank 0."""
    _one_line_refusal(side_launches["misspelled flag"].result(), ["unrecognized arguments: --num-layer 8"], nproc=2)
