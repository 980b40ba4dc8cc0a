"""pretrain_hybrid.py on CPU: megatron's HybridModel (attention *, MLP -, MoE E layers by --hybrid-layer-pattern) in
megatron's own training loop, with the zero-bubble schedules against megatron's.

Few launches (megatron's import is the slow part; pretrain_driver.py runs many runs per launch):
- one `torchrun --nproc-per-node 2` of the driver (PP=2, 8 microbatches): megatron's 1F1B and interleaved 1F1B as
  references, zb-h1, zb-h2, zb-auto (one and two chunks per rank), ZB-V, post-validation, on even and uneven `|`
  layouts of the same layers, and an MoE pattern;
- one single-rank launch: the PP=1 references of ZB-V (untied embeddings, no clipping: at PP=1 a tied embedding's two
  gradients add per microbatch, every PP > 1 layout sums each copy over the microbatches first);
- two launches refused at start-up (before and after megatron's import).
The models have no dropout and start from the same weights in any layout (--init-weights-by-global-name), so
megatron's printed losses must match to the last digit; the grad norm too where the reference has the same layout
(megatron adds one partial norm per rank: across layouts the norms match to their printed digits).
"""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.markers import marks_tests, starts_in_background
from tests.megatron import pretrain_driver as driver
from tests.megatron.pretrain_driver import REPO
from tests.megatron.test_pretrain_gpt import (ITERS, TRAIN, TRAIN_PV, _same_training, _same_validation,
                                              iteration_figures, validation_losses)

MODEL = ("--zero-bubble-cpu --hidden-size 64 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 "
         "--micro-batch-size 2 --global-batch-size 16 --tokenizer-type NullTokenizer --vocab-size 128 --mock-data "
         "--hidden-dropout 0 --attention-dropout 0 --init-weights-by-global-name --seed 1234 "
         "--transformer-impl local").split()
PP2 = ["--pipeline-model-parallel-size", "2"]
NO_CLIP = ["--clip-grad", "0", "--untie-embeddings-and-output-weights"]
PV_MODEL = ["--untie-embeddings-and-output-weights", "--clip-grad", "1.0"]  # the grad norm is above 1: rollbacks
NO_ILP = ["--zero-bubble-ilp-time-limit", "0"]
EXACT_PV = ["--enable-optimizer-post-validation", "--zero-bubble-exact-rollback"]
MOE = ("--num-experts 4 --moe-router-topk 2 --moe-aux-loss-coeff 0.01 --moe-token-dispatcher-type alltoall "
       "--disable-bias-linear --moe-router-score-function sigmoid --moe-router-enable-expert-bias").split()
# The same eight layers cut four ways: even and uneven over two ranks, two chunks per rank, the V's 2p segments.
EVEN, UNEVEN, TWO_CHUNKS = "*-*-|*-*-", "*-*|-*-*-", "*|-*-|*-*|-"
V_EVEN, V_UNEVEN, WHOLE = "*-|*-|*-|*-", "*-*|-*-|*|-", "*-*-*-*-"
MOE_PP2, MOE_V, MOE_WHOLE = "*E*E|*E*E", "*E|*E|*E|*E", "*E*E*E*E"
SPLIT = "**|--"  # one rank of attention layers only, one of MLP layers only


def _pattern(pattern: str) -> list[str]:
    return ["--hybrid-layer-pattern", pattern]


def _runs(work: str) -> dict[str, list[str]]:
    """The two-rank launch's runs: label -> flags beyond MODEL and TRAIN."""
    v, auto = ["--zero-bubble-v-schedule"], ["--enable-zero-bubble", *NO_ILP]
    return {
        "even/megatron": _pattern(EVEN),
        "even/zb-h1": _pattern(EVEN) + ["--pipeline-schedule", "zb-h1"],
        "even/zb-h2": _pattern(EVEN) + ["--pipeline-schedule", "zb-h2"],
        "even/zb-auto": _pattern(EVEN) + auto,
        "uneven/megatron": _pattern(UNEVEN),
        "uneven/zb-h1": _pattern(UNEVEN) + ["--pipeline-schedule", "zb-h1"],
        "uneven/zb-auto": _pattern(UNEVEN) + auto,
        "two-chunks/megatron": _pattern(TWO_CHUNKS),  # megatron's interleaved 1F1B
        "two-chunks/zb-auto": _pattern(TWO_CHUNKS) + auto,
        "two-chunks/interleaved-runtime": _pattern(TWO_CHUNKS) + ["--pipeline-schedule", "interleaved-1f1b",
                                                                 "--enable-zb-runtime"],
        "split/megatron": _pattern(SPLIT),
        "split/zb-auto": _pattern(SPLIT) + auto + ["--zero-bubble-dump-schedule", os.path.join(work, "dump-split")],
        "v/even": NO_CLIP + _pattern(V_EVEN) + v,
        "v/uneven": NO_CLIP + _pattern(V_UNEVEN) + v,
        "even/megatron/no-clip-tied": ["--clip-grad", "0"] + _pattern(EVEN),
        "v/tied": ["--clip-grad", "0"] + _pattern(V_UNEVEN) + v,
        "pv/megatron": PV_MODEL + _pattern(EVEN),
        "pv/zb-h1": PV_MODEL + _pattern(EVEN) + ["--pipeline-schedule", "zb-h1", *EXACT_PV],
        "pv/zb-auto": PV_MODEL + _pattern(UNEVEN) + auto + EXACT_PV,
        "pv/uneven/megatron": PV_MODEL + _pattern(UNEVEN),
        "pv/v/clip": PV_MODEL + _pattern(V_UNEVEN) + v,
        "pv/v/post-validation": PV_MODEL + _pattern(V_UNEVEN) + v + EXACT_PV,
        "moe/megatron": MOE + _pattern(MOE_PP2),
        "moe/zb-h1": MOE + _pattern(MOE_PP2) + ["--pipeline-schedule", "zb-h1"],
        "moe/zb-auto": MOE + _pattern(MOE_PP2) + auto,
        "moe/v": MOE + NO_CLIP + _pattern(MOE_V) + v,
    }


PP1_RUNS = {"pp1/dense": NO_CLIP + _pattern(WHOLE), "pp1/moe": MOE + NO_CLIP + _pattern(MOE_WHOLE)}
PV_RUNS = {"pv/megatron", "pv/zb-h1", "pv/zb-auto", "pv/uneven/megatron", "pv/v/clip", "pv/v/post-validation"}


def _command_lines(runs: dict[str, list[str]], work: str, pp: list[str]) -> dict[str, list[str]]:
    cache = ["--data-cache-path", os.path.join(work, "data-cache")]
    return {label: MODEL + (TRAIN_PV if label in PV_RUNS else TRAIN) + cache + pp + flags
            for label, flags in runs.items()}


# ---------------------------------------------------------------- launches (parent side)


_STARTED: dict = {}


def _work(tmp_path_factory) -> str:
    if "work" not in _STARTED:
        _STARTED["work"] = str(tmp_path_factory.mktemp("pretrain-hybrid"))
    return _STARTED["work"]


def _start_drivers(tmp_path_factory) -> list[driver.Background]:
    if "drivers" not in _STARTED:
        work = _work(tmp_path_factory)
        _STARTED["drivers"] = {
            2: driver.start_driver(_command_lines(_runs(work), work, PP2), work, nproc=2, timeout=1500,
                                   script="pretrain_hybrid", name="hybrid-pp2"),
            1: driver.start_driver(_command_lines(PP1_RUNS, work, []), work, nproc=1, timeout=1500,
                                   script="pretrain_hybrid", name="hybrid-pp1"),
        }
    return list(_STARTED["drivers"].values())


@pytest.fixture(scope="module")
def work_dir(tmp_path_factory) -> str:
    yield _work(tmp_path_factory)
    _STARTED.pop("work", None)


@pytest.fixture(scope="module")
@starts_in_background(_start_drivers)
@marks_tests(pytest.mark.exactness)
def runs(tmp_path_factory, work_dir) -> dict:
    """label -> the combined output of every rank of that run (both launches)."""
    _start_drivers(tmp_path_factory)
    launches = _STARTED["drivers"]
    try:
        found = {}
        for nproc, labels in ((2, list(_runs(work_dir))), (1, list(PP1_RUNS))):
            results = driver.driver_results(launches[nproc], labels, work_dir, nproc=nproc)
            found.update({label: results for label in labels})
        return _Lookup(found)
    finally:
        for launch in _STARTED.pop("drivers").values():
            launch.stop()


class _Lookup:
    """label -> log, from whichever launch ran it (a run that did not finish fails the test reading it)."""

    def __init__(self, by_label: dict):
        self._by_label = by_label

    def __getitem__(self, label: str) -> str:
        return self._by_label[label][label]


# ---------------------------------------------------------------- tests: every schedule prints megatron's losses


@pytest.mark.parametrize("run, reference", [
    ("even/zb-h1", "even/megatron"), ("even/zb-h2", "even/megatron"), ("even/zb-auto", "even/megatron"),
    ("uneven/zb-h1", "uneven/megatron"), ("uneven/zb-auto", "uneven/megatron"),
    ("two-chunks/zb-auto", "two-chunks/megatron"), ("two-chunks/interleaved-runtime", "two-chunks/megatron"),
    ("split/zb-auto", "split/megatron"),
    ("moe/zb-h1", "moe/megatron"), ("moe/zb-auto", "moe/megatron"),
])
def test_zero_bubble_schedules_print_megatrons_losses_and_norms_on_the_same_pattern(runs, run, reference):
    """Tied embeddings, clipped steps (the grad norm is above 1.0), --log-params-norm: every printed figure."""
    _same_training(runs[run], runs[reference])
    _same_validation(runs[run], runs[reference])
    assert "zero-bubble:" not in runs[reference]


def test_the_patterns_cuts_are_the_stages_megatron_and_the_runtime_run(runs):
    """The number of parameters megatron prints per rank: the uneven cut's 3 and 5 layers, the two-chunk cut's
    segments 0 and 2 ("*", "*-*") on rank 0 and 1 and 3 ("-*-", "-") on rank 1, the split's attention-only and
    MLP-only ranks."""
    attention, mlp, embedding = 4 * 64 * 64 + 4 * 64 + 2 * 64, 8 * 64 * 64 + 5 * 64 + 2 * 64, 128 * 64 + 32 * 64
    final = 2 * 64  # the last stage's final norm (the output layer is the tied embedding's copy)
    expected = {"uneven/zb-h1": {0: embedding + 2 * attention + mlp, 1: 2 * attention + 3 * mlp + final},
                "two-chunks/zb-auto": {0: embedding + 3 * attention + mlp, 1: attention + 3 * mlp + final},
                "split/zb-auto": {0: embedding + 2 * attention, 1: 2 * mlp + final}}
    for run, counts in expected.items():
        assert _parameters_per_rank(runs[run]) == {rank: count + (128 * 64 if rank == 1 else 0)
                                                   for rank, count in counts.items()}, run


@pytest.mark.parametrize("run, reference", [("v/even", "pp1/dense"), ("v/uneven", "pp1/dense"),
                                            ("moe/v", "pp1/moe")])
def test_zb_v_on_the_patterns_2p_segments_prints_the_losses_of_the_unpipelined_model(runs, run, reference):
    """Untied embeddings, no clipping: the losses to the last digit, the norms (one partial norm per rank here, one
    sum at PP=1) to their printed digits."""
    _same_training(runs[run], runs[reference], norms_to_the_printed_digit=True)
    _same_validation(runs[run], runs[reference])
    assert "zero-bubble: running zb-v (p=2, m=8, 2 chunks per rank)" in runs[run]


def test_zb_v_with_tied_embeddings_prints_the_losses_of_megatrons_1f1b(runs):
    """The V keeps both copies of a tied embedding on rank 0 and sums their gradients as megatron does across ranks."""
    _same_training(runs["v/tied"], runs["even/megatron/no-clip-tied"], norms_to_the_printed_digit=True)
    _same_validation(runs["v/tied"], runs["even/megatron/no-clip-tied"])


@pytest.mark.parametrize("run, reference", [("pv/zb-h1", "pv/megatron"), ("pv/zb-auto", "pv/uneven/megatron"),
                                            ("pv/v/post-validation", "pv/v/clip")])
def test_optimizer_post_validation_prints_megatrons_figures_with_rollbacks(runs, run, reference):
    """Exact rollback against megatron's synchronous step on the same layout (the V's: the V without
    post-validation), digit for digit, the first step rolled back and re-stepped clipped."""
    _same_training(runs[run], runs[reference])
    _same_validation(runs[run], runs[reference])
    rollbacks = [int(n) for n in re.findall(r"number of optimizer rollbacks: +(\d+) \|", runs[run])]
    assert len(rollbacks) == ITERS and sum(rollbacks) >= 1
    assert "optimizer post-validation on" in runs[run]


MOE_AUX_LOSS = re.compile(r" iteration +(\d+)/ *\d+ \|.*? load_balancing_loss: ([0-9.E+-]+) \|")


def test_the_moe_pattern_prints_megatrons_load_balancing_loss(runs):
    aux = [dict(MOE_AUX_LOSS.findall(runs[label])) for label in ("moe/zb-auto", "moe/megatron")]
    assert aux[0] == aux[1] and sorted(aux[1]) == [str(i) for i in range(1, ITERS + 1)]


def test_the_first_plan_costs_each_stages_layers_by_kind(runs, work_dir):
    """The initial plan's costs of the attention-only and the MLP-only rank are the cost model's for those layers
    (megatron's validated args through plan_settings), not one GPT layer per pattern character."""
    from megatron.zero_bubble.schedules.costs import Costs
    from megatron.zero_bubble.schedules.schedule import Schedule

    initial = Schedule.from_json(open(os.path.join(work_dir, "dump-split", "zb-auto-m8-initial.json")).read())
    costs = Costs.from_dict(initial.info["costs"])
    expected = Costs.from_model(layers=4, hidden=64, heads=4, seq_length=32, micro_batch=2, vocab=128,
                                num_virtual_stages=2, stage_layers=["**", "--"])
    assert costs.t_f == pytest.approx(expected.t_f) and costs.m_f == pytest.approx(expected.m_f)
    assert "zero-bubble: running zb-auto (p=2, m=8" in runs["split/zb-auto"]


PARAMETERS_LINE = re.compile(r"number of parameters on \(tensor, \S+ pipeline\) model parallel rank "
                             r"\(0, 0, (\d+)\): (\d+)")


def _parameters_per_rank(log: str) -> dict[int, int]:
    return {int(rank): int(count) for rank, count in PARAMETERS_LINE.findall(log)}


# ---------------------------------------------------------------- refusals as users meet them


def _refused(command: list[str], env: dict | None = None) -> tuple[int, list[str]]:
    done = subprocess.run(command, cwd=REPO, env=driver.launch_environment() | (env or {}), capture_output=True,
                          text=True, timeout=600)
    return done.returncode, [line for line in done.stderr.splitlines() if "error:" in line]


def test_a_mamba_layer_on_cpu_stops_the_start_up_in_one_line_naming_the_character_and_the_fix():
    """Checked after megatron's parsing, on every rank; rank 0 prints it once."""
    status, errors = _refused(driver.torchrun_command(2, ["pretrain_hybrid.py", *MODEL, *TRAIN, *PP2,
                                                          *_pattern("*M*-|*M*-"), "--pipeline-schedule", "zb-h1"]))
    assert status != 0 and len(errors) == 1, errors
    assert errors[0].startswith("pretrain_hybrid.py: error: --hybrid-layer-pattern '*M*-|*M*-': M (Mamba) layers "
                                "need CUDA") and "on CPU use * (attention), - (MLP) and E (MoE) layers" in errors[0]


def test_a_v_on_one_segment_per_rank_stops_before_megatron_is_imported():
    status, errors = _refused([sys.executable, "pretrain_hybrid.py", *MODEL, *TRAIN, *PP2, *_pattern(EVEN),
                               "--zero-bubble-v-schedule"], env={"WORLD_SIZE": "2"})
    assert status == 2 and errors == [
        "pretrain_hybrid.py: error: --zero-bubble-v-schedule places 2p = 4 virtual stages in V order (rank r holds "
        "segments r and 3-r), but --hybrid-layer-pattern '*-*-|*-*-' has 2 segments; cut it into 4 segments with | "
        "(evenly: '*-|*-|*-|*-')"]

