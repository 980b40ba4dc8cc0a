"""pretrain_gpt.py on CPU: megatron's own training loop with the zero-bubble flags, launched as users launch it.

Each run is one torchrun of pretrain_gpt.py that ends (tests/megatron/pretrain_runs.py), started the first time a
test reads it: what only a launch shows, megatron's training loop with our session (schedules, re-planning and its
dumps, evaluation, checkpoints across layouts, post-validation inside megatron's train_step, the distributed optimizer
with overlapped reduction, MoE and multi-token prediction). The runtime's exactness case by case, tensor for tensor,
is the multi-process harness's (test_runtime_exactness.py and its kin); bad command lines are
test_pretrain_refusals.py's. The tiny GPT has no dropout, so different layouts of the same weights
(--init-weights-by-global-name) compute the same losses, and megatron's printed loss must match to the last digit.
"""
from __future__ import annotations

import json
import os
import re

import pytest

from tests.megatron.pretrain_runs import (RunDefinition, Runs, iteration_figures, iteration_lines, parameters_per_rank,
                                          resumed_lines_like, resumes_like, same_training, same_validation,
                                          validation_losses)

# Not marked `exactness`: CI's second pass under the baseline instruction set re-runs the harness's tensor-for-tensor
# cases, which go through the same runtime paths; these launches compare megatron's printed figures once.

ITERS = 5
MODEL = (
    "--zero-bubble-cpu --num-layers 8 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 "
    "--micro-batch-size 2 --global-batch-size 16 --tokenizer-type NullTokenizer --vocab-size 128 --mock-data "
    "--hidden-dropout 0 --attention-dropout 0 --init-weights-by-global-name --seed 1234"
).split()
EVAL_INTERVAL = 3
TRAIN = (
    f"--train-iters {ITERS} --lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine --num-workers 0 "
    f"--log-interval 1 --eval-iters 1 --eval-interval {EVAL_INTERVAL}"
).split()
# Four stages where the layout is the point (the schedules and their re-planning, a V resuming 1F1B's checkpoint);
# two, half the launch, where a feature is (post-validation, MoE in fp16, the Llama MoE with MTP)
PP4 = ["--pipeline-model-parallel-size", "4"]
PP2 = ["--pipeline-model-parallel-size", "2"]
# Megatron's grad norm (and params norm) adds one partial norm per rank, so its last bit depends on which layers
# share a rank: ZB-V, whose layout megatron has no schedule for, is compared with megatron's 1F1B without clipping
# (the clip coefficient would differ in the last bit, differently on AVX-512 and AVX2), its norms to the printed
# digits. The PP=4 reference runs without clipping for that reason, and so do the schedules compared with it.
NO_CLIP = ["--clip-grad", "0", "--log-params-norm"]
# Post-validation runs (--log-params-norm is refused with it): the statistics chain runs from the first stage to the
# last, and with untied embeddings and --clip-grad 1.2 the first stage's partial norm of iteration 1 (1.11: the
# embedding and four layers) stays below the clip while the full norm (1.34) exceeds it, so that step is taken
# speculatively and rolled back (at clip 1.0, right for four stages, the first of two already defers its step).
PV_MODEL = ["--untie-embeddings-and-output-weights", "--clip-grad", "1.2"]
TIMERS = "--zero-bubble-pipeline-timers-start-iter 2 --zero-bubble-pipeline-timers-end-iter 4".split()
RESUMED_TIMERS = "--zero-bubble-pipeline-timers-start-iter 0 --zero-bubble-pipeline-timers-end-iter 1".split()
NO_ILP = ["--zero-bubble-ilp-time-limit", "0"]  # the planner's heuristic alone: seconds less per plan
EXACT_PV = ["--enable-optimizer-post-validation", "--zero-bubble-exact-rollback"]
# Mixture of experts (top-2 of 4, aux loss, alltoall, expert bias updated after each step); with post-validation
# in fp16: the dense and the expert optimizer each keep a loss scaler (overflows skip steps and move the scale the
# MoE aux loss's gradient follows); metrics averaged over two iterations. Iterations 2-3 overflow; clip 1.3 rolls
# iteration 4 back, whose first stage's partial norm (1.22) is below it and full norm (1.43) above (at clip 1.2,
# right for four stages, the first of two already defers its step).
MOE = ("--num-experts 4 --moe-router-topk 2 --moe-aux-loss-coeff 0.01 --moe-token-dispatcher-type alltoall "
       "--disable-bias-linear --moe-router-score-function sigmoid --moe-router-enable-expert-bias").split()
MOE_FP16_PV = ["--untie-embeddings-and-output-weights", "--clip-grad", "1.3", "--fp16", "--initial-loss-scale", "1e6",
               "--log-interval", "2"]
# A Llama-class model (docs/models.md): rotary positions, RMSNorm, SwiGLU, grouped-query attention, untied, no biases;
# as a DeepSeek/Qwen-style MoE stack: a dense first layer, top-2 of 4 SwiGLU experts beside a shared expert, and a
# multi-token-prediction layer on the last stage.
LLAMA = ("--position-embedding-type rope --normalization RMSNorm --swiglu --group-query-attention --num-query-groups 2 "
         "--untie-embeddings-and-output-weights --disable-bias-linear").split()
LLAMA_MOE = LLAMA + [f for f in MOE if f != "--disable-bias-linear"] + [
    "--moe-ffn-hidden-size", "64", "--moe-shared-expert-intermediate-size", "64", "--moe-layer-freq", "[0]+[1]*7",
    "--mtp-num-layers", "1"]
# DP=2 x PP=2 with the distributed optimizer and overlapped reduction and gathers: megatron buckets the first stage
# only, the runtime every stage, so the shards differ: no clipping, norms to their printed digits
DISTRIBUTED = ["--pipeline-model-parallel-size", "2", "--use-distributed-optimizer", "--overlap-grad-reduce",
               "--ddp-bucket-size", "20000", "--overlap-param-gather", *NO_CLIP]
# FP8 on Transformer Engine's layers (its Python over the CPU kernel layer's emulated per-tensor FP8 kernels): the
# Llama pairs train under the two recipes megatron's split takes, delayed scaling's amax histories and scales
# carried from iteration to iteration (the losses of later iterations depend on them)
FP8_DELAYED = ["--fp8-format", "hybrid", "--fp8-recipe", "delayed"]
FP8_TENSORWISE = ["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"]


def definitions(work: str) -> dict[str, RunDefinition]:
    """Every run: label -> (processes, flags after MODEL, TRAIN and the data cache, the run it resumes)."""
    path = lambda name: os.path.join(work, name)  # noqa: E731
    runs = {
        "pp4/megatron": (4, PP4 + NO_CLIP + ["--save", path("ckpt"), "--save-interval", "3"], None),
        # with the output layer's W kept inside B: another pass order on the last rank, the same numbers
        "pp4/zb-auto": (4, PP4 + NO_CLIP + ["--enable-zero-bubble", *TIMERS, "--zero-bubble-ilp-time-limit", "2",
                                            "--zero-bubble-dump-schedule", path("dump"),
                                            "--zero-bubble-output-layer-wgrad", "in-b"], None),
        "pp4/zb-v": (4, PP4 + NO_CLIP + ["--zero-bubble-v-schedule", *TIMERS, "--zero-bubble-dump-schedule",
                                         path("dump-v")], None),
        # megatron's distributed checkpoint names layers by their global number: a V resumes a 1F1B save; its timer
        # window counts from the resumed iteration (3): iteration 4 measured, re-planned for iteration 5
        "pp4/zb-v/from-megatron": (4, PP4 + NO_CLIP + ["--zero-bubble-v-schedule", "--load", path("ckpt"),
                                                       "--ckpt-step", "3", *RESUMED_TIMERS], "pp4/megatron"),
        # megatron resumes its own checkpoint bit for bit (its resumed run printed these lines, but the losses it
        # averages over a start): its uninterrupted run is the reference of our resumed run too
        "pp2/megatron/clip": (2, PP2 + PV_MODEL, None),
        # saved after every iteration: the first step is rolled back, so post-validation saves while a speculative
        # step awaits its validation (the checkpoint must hold the validated step)
        "pp2/zb-auto/post-validation-exact": (2, PP2 + PV_MODEL + ["--enable-zero-bubble", *EXACT_PV, *NO_ILP,
                                                                   "--save", path("ckpt-pv"), "--save-interval", "1"],
                                              None),
        "pp2/zb-auto/post-validation-exact/resumed": (
            2, PP2 + PV_MODEL + ["--enable-zero-bubble", *EXACT_PV, *NO_ILP, "--load", path("ckpt-pv"), "--ckpt-step",
                                 "1"], "pp2/zb-auto/post-validation-exact"),
        "pp2/moe/megatron/fp16": (2, PP2 + MOE + MOE_FP16_PV, None),
        "pp2/moe/post-validation/fp16": (2, PP2 + MOE + MOE_FP16_PV + ["--pipeline-schedule", "zb-h1", *EXACT_PV],
                                         None),
        "dp2pp2/llama/megatron/distributed/overlap": (4, LLAMA + DISTRIBUTED + FP8_TENSORWISE, None),
        "dp2pp2/llama/zb-auto/distributed/overlap": (4, LLAMA + DISTRIBUTED + FP8_TENSORWISE + [
            "--pipeline-schedule", "zb-auto", *NO_ILP], None),
        "pp2/llama-moe/megatron": (2, PP2 + LLAMA_MOE + NO_CLIP + FP8_DELAYED, None),
        "pp2/llama-moe/zb-auto": (2, PP2 + LLAMA_MOE + NO_CLIP + FP8_DELAYED + [
            "--enable-zero-bubble", *TIMERS, *NO_ILP, "--zero-bubble-dump-schedule", path("dump-moe")], None),
    }
    # megatron's index cache: the first run of each data configuration builds the mock dataset's indices (a shuffle of
    # 100000 documents, a quarter of a short run's CPU), the others load them
    cache = ["--data-cache-path", path("data-cache")]
    return {label: RunDefinition(ranks, MODEL + TRAIN + cache + flags, after)
            for label, (ranks, flags, after) in runs.items()}


@pytest.fixture(scope="module")
def work_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("pretrain"))


@pytest.fixture(scope="module")
def runs(work_dir) -> Runs:
    return Runs(definitions(work_dir), work_dir)


def _iterations(first: int = 1):
    return range(first, ITERS + 1)


# ---------------------------------------------------------------- schedules, re-planning, checkpoints


def test_zb_auto_prints_the_losses_and_norms_of_megatrons_1f1b_on_every_iteration(runs):
    """With --zero-bubble-output-layer-wgrad in-b: the output layer's W runs inside B, before and after the re-plan,
    and the losses and norms stay megatron's to the last digit."""
    same_training(runs["pp4/zb-auto"], runs["pp4/megatron"], _iterations())
    same_validation(runs["pp4/zb-auto"], runs["pp4/megatron"])
    assert "zero-bubble:" not in runs["pp4/megatron"]  # megatron's own schedule: nothing of ours runs
    kept = [line for line in SCHEDULE_LINE_TEXT.findall(runs["pp4/zb-auto"]) if "W of output_layer kept in B" in line]
    assert len(kept) == 2, runs["pp4/zb-auto"][-3000:]  # the initial plan and the re-planned one


def test_zb_v_on_four_ranks_prints_the_losses_of_megatrons_1f1b(runs):
    """Both without clipping: the losses to the last digit, the norms to their printed digits."""
    same_training(runs["pp4/zb-v"], runs["pp4/megatron"], _iterations(), norms_to_the_printed_digit=True)
    same_validation(runs["pp4/zb-v"], runs["pp4/megatron"])


def _evaluations(first: int) -> int:
    """How many evaluations a run resumed at iteration `first` prints: the periodic ones, then the validation and
    test sets."""
    return sum(1 for i in _iterations(first) if i % EVAL_INTERVAL == 0) + 2


def test_a_v_resumes_megatrons_checkpoint_with_the_uninterrupted_losses(runs):
    """1F1B's checkpoint of iteration 3, read by the V placement: iterations 4-5 as megatron's uninterrupted run (the
    norms to their printed digits, as ZB-V against 1F1B everywhere)."""
    assert "successfully saved checkpoint" in runs["pp4/megatron"]
    resumes_like(runs["pp4/zb-v/from-megatron"], runs["pp4/megatron"], first=4, last=ITERS,
                 evaluations_after=_evaluations(4), norms_to_the_printed_digit=True)


def test_a_resumed_run_measures_and_re_plans_in_its_own_timer_window(runs):
    """The window counts from the checkpoint's iteration (3): a resumed run measures its own passes and re-plans on
    them, as a new run does, instead of keeping the guess from the model's shape for the rest of the run."""
    log = runs["pp4/zb-v/from-megatron"]
    assert "re-planned from measured pass times after iteration 4" in log
    assert re.search(r"zero-bubble: re-planned zb-v .*from costs measured in iterations 4-4 .*running it from "
                     r"iteration 5", log), log[-3000:]


SCHEDULE_LINE_TEXT = re.compile(r"zero-bubble: (?:running|re-planned) .*")
SCHEDULE_LINE = re.compile(r"zero-bubble: (running|re-planned) (\S+) .*predicted bubble rate ([0-9.]+)%")


@pytest.mark.parametrize("run,name,dump", [("pp4/zb-auto", "zb-auto", "dump"), ("pp4/zb-v", "zb-v", "dump-v"),
                                           ("pp2/llama-moe/zb-auto", "zb-auto", "dump-moe")])
def test_after_the_timer_window_the_log_shows_the_replanned_schedule_and_the_dump_validates(runs, work_dir, run, name,
                                                                                          dump):
    from megatron.zero_bubble.schedules import Costs
    from megatron.zero_bubble.schedules.schedule import Schedule
    from megatron.zero_bubble.schedules.validate import validate

    lines = SCHEDULE_LINE.findall(runs[run])
    assert [(kind, schedule) for kind, schedule, _ in lines] == [("running", name), ("re-planned", name)]
    # timers 2..4 in megatron's counter: logged iterations 3-4 measured, the new schedule from logged 5 on
    assert "running it from iteration 5" in runs[run] and "measured in iterations 3-4" in runs[run]
    # the first iteration under the re-planned schedule reads the allocator too: what each rank held, against the plan
    after = re.search(r"activation memory per rank in iteration 5, the first under the re-planned schedule: measured "
                      r"([0-9., ]+) MiB, planned ([0-9., ]+) MiB", runs[run])
    stages = runs.definitions[run].nproc  # one GPU per pipeline rank in these runs
    assert after and all(len(group.split(", ")) == stages for group in after.groups()), runs[run][-3000:]
    files = sorted(os.listdir(os.path.join(work_dir, dump)))
    assert files == [f"{name}-m8-initial.json", f"{name}-m8-initial.png", f"{name}-m8-iter5.json",
                     f"{name}-m8-iter5.png", f"{name}-m8-measured-iter4.trace.json"]
    replanned = Schedule.from_json(open(os.path.join(work_dir, dump, f"{name}-m8-iter5.json")).read())
    assert replanned.info.get("wgrad_in_b") == (["output_layer"] if run == "pp4/zb-auto" else None)
    costs = Costs.from_dict(replanned.info["costs"])
    assert costs.memory_unit == "bytes" and min(costs.m_f) > 0 and min(costs.t_f) > 0 and min(costs.t_w) > 0
    assert min(costs.t_b) > 0 and min(costs.m_w) > 0  # every stage, MoE layers included, measured
    timeline = validate(replanned, costs)
    assert abs(100 * timeline.bubble_rate - float(lines[1][2])) < 0.01
    # the measured timeline of the last profiled iteration (logged 4): every rank's passes of the schedule that
    # ran then, in its order, each with its planned start
    ran = Schedule.from_json(open(os.path.join(work_dir, dump, f"{name}-m8-initial.json")).read())
    trace = json.load(open(os.path.join(work_dir, dump, f"{name}-m8-measured-iter4.trace.json")))
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(ran.ranks) == runs.definitions[run].nproc  # one timeline per rank of the run
    for rank in range(len(ran.ranks)):
        mine = [e for e in events if e["tid"] == rank]
        assert [e["name"] for e in mine] == [str(p) for p in ran.ranks[rank]]
        assert all(e["dur"] > 0 and e["args"]["planned_start_ms"] >= 0 for e in mine)
        assert [e["ts"] for e in mine] == sorted(e["ts"] for e in mine)


# ---------------------------------------------------------------- optimizer post-validation


def _rollbacks(log: str) -> list[int]:
    return [int(n) for n in re.findall(r"number of optimizer rollbacks: +(\d+) \|", log)]


def _without_our_count(lines: list[str]) -> list[str]:
    return [re.sub(r" number of optimizer rollbacks: +\d+ \|", "", line) for line in lines]


def test_optimizer_post_validation_prints_megatrons_losses_and_grad_norms_and_counts_rollbacks(runs):
    """Exact rollback against megatron's synchronous step, digit for digit; the first step, stepped on partial sums,
    is rolled back and re-stepped clipped."""
    ours, reference = runs["pp2/zb-auto/post-validation-exact"], runs["pp2/megatron/clip"]
    same_training(ours, reference, _iterations())
    same_validation(ours, reference)
    assert len(_rollbacks(ours)) == ITERS and _rollbacks(ours)[0] == 1
    assert "number of optimizer rollbacks" not in reference and "optimizer post-validation on" in ours


def test_post_validation_saves_the_validated_step_and_resumes_with_megatrons_uninterrupted_lines(runs):
    """The checkpoint of iteration 1 is written only after its validation (else it would hold the speculative
    step): the resumed run prints the lines of megatron's uninterrupted run from iteration 2 on, digit for digit, as
    megatron's own save and resume does, but the losses the two runs average differently (averaged_losses)."""
    ours, reference = runs["pp2/zb-auto/post-validation-exact/resumed"], runs["pp2/megatron/clip"]
    resumes_like(ours, reference, first=2, last=ITERS, evaluations_after=_evaluations(2))
    resumed_lines_like(_without_our_count(iteration_lines(ours)), iteration_lines(reference), first=2)


def test_moe_with_post_validation_in_fp16_prints_megatrons_iteration_lines(runs):
    """Two statistics groups (dense, experts) and two fp16 loss scalers; a step rolled back, steps skipped; the
    load-balancing loss megatron averages over the iterations since the last line (here two) is the same."""
    ours, reference = runs["pp2/moe/post-validation/fp16"], runs["pp2/moe/megatron/fp16"]
    assert _without_our_count(iteration_lines(ours)) == iteration_lines(reference)
    assert sorted(iteration_figures(reference)) == [1, *range(2, ITERS + 1, 2)] and "load_balancing_loss" in reference
    assert validation_losses(ours) == validation_losses(reference) != []
    assert "number of skipped iterations:   1" in reference  # the fp16 overflows were exercised
    assert sum(_rollbacks(ours)) >= 1 and "optimizer post-validation on" in ours


# ---------------------------------------------------------------- data parallelism, Llama-class models, MoE, MTP


def _llama_layer_parameters(hidden: int = 64, heads: int = 4, groups: int = 2, ffn: int = 128) -> int:
    """One layer of the Llama model: queries of every head and keys and values of each group (GQA), SwiGLU's gate and
    up projection in fc1 (megatron sizes its ffn to 8/3 hidden, a multiple of 64), no biases, RMSNorm scales."""
    head = hidden // heads
    return hidden * (heads + 2 * groups) * head + hidden * hidden + 2 * ffn * hidden + ffn * hidden + 2 * hidden


def test_the_distributed_optimizer_with_overlapped_reduction_and_gathers_prints_megatrons_losses(runs):
    """A Llama-class model at DP=2 x PP=2: the losses to the last digit, the norms (sums of other partial norms: the
    runtime buckets every stage) to their printed digits; four layers per rank, untied, rotary (no position
    embedding)."""
    ours, reference = runs["dp2pp2/llama/zb-auto/distributed/overlap"], runs["dp2pp2/llama/megatron/distributed/overlap"]
    same_training(ours, reference, _iterations(), norms_to_the_printed_digit=True)
    same_validation(ours, reference)
    per_rank, layers, embedding = parameters_per_rank(reference), 4 * _llama_layer_parameters(), 128 * 64
    assert per_rank == {0: embedding + layers, 1: layers + 64 + embedding}


MTP_LOSS = re.compile(r" iteration +(\d+)/ *\d+ \|.*? mtp_1 loss: ([0-9.E+-]+) \|")
MOE_AUX_LOSS = re.compile(r" iteration +(\d+)/ *\d+ \|.*? load_balancing_loss: ([0-9.E+-]+) \|")


def test_a_llama_moe_with_a_dense_first_layer_shared_experts_and_mtp_prints_megatrons_figures(runs):
    """The MoE and MTP losses megatron logs too, every iteration: the split check and the W passes leave the MTP
    layer's loss tracker as megatron's schedule leaves it, and the LM head, used for the main and the MTP logits,
    accumulates its weight gradient as megatron's autograd does; re-planned on the measured costs."""
    ours, reference = runs["pp2/llama-moe/zb-auto"], runs["pp2/llama-moe/megatron"]
    same_training(ours, reference, _iterations())
    same_validation(ours, reference)
    for pattern in (MTP_LOSS, MOE_AUX_LOSS):
        figures = [dict(pattern.findall(log)) for log in (ours, reference)]
        assert figures[0] == figures[1] and sorted(figures[1]) == [str(i) for i in _iterations()]
    # rank 0: the embedding, the dense layer and three MoE layers; rank 1: four MoE layers, the final norm, the
    # output layer and the MTP layer
    dense, embedding = _llama_layer_parameters(), 128 * 64
    moe = dense - 3 * 128 * 64 + 5 * 3 * 64 * 64 + 4 * 64  # for the dense MLP: 4 SwiGLU experts, a shared one, a router
    mtp = embedding + 2 * 64 + 2 * 64 * 64 + moe + 64  # its own embedding copy, 2 norms, the 2h -> h projection, a norm
    assert parameters_per_rank(reference) == {0: embedding + dense + 3 * moe, 1: 4 * moe + 64 + embedding + mtp}
