"""pretrain_hybrid.py on CPU: megatron's HybridModel (attention *, MLP -, MoE E layers by --hybrid-layer-pattern) in
megatron's own training loop with the zero-bubble schedules, launched as users launch it.

What only a launch shows: the entry script, the pattern's `|` cuts becoming the stages megatron and the runtime run,
the first plan costed per layer kind, and megatron's printed losses. Four runs of two ranks, each a torchrun of its
own (tests/megatron/pretrain_runs.py), all of the same eight layers `*-*-*-*-` cut three ways; the schedules' exactness
on hybrid models case by case, tensor for tensor (even, MoE and post-validation included), is
test_hybrid_models.py's. The models have no dropout and start from the same weights in any layout
(--init-weights-by-global-name), so megatron's printed losses must match to the last digit; the norms too on the same
layout (megatron adds one partial norm per rank: across layouts the norms match to their printed digits, so nothing
is clipped). The layers are megatron's default, Transformer Engine's (its Python over the CPU kernel layer).
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.launching import REPO, launch_environment, torchrun_command
from tests.megatron.pretrain_runs import RunDefinition, Runs, parameters_per_rank, same_training, same_validation
from tests.megatron.test_pretrain_gpt import ITERS, TRAIN

MODEL = ("--zero-bubble-cpu --hidden-size 64 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 "
         "--micro-batch-size 2 --global-batch-size 16 --tokenizer-type NullTokenizer --vocab-size 128 --mock-data "
         "--hidden-dropout 0 --attention-dropout 0 --init-weights-by-global-name --seed 1234 "
         "--clip-grad 0 --log-params-norm").split()  # megatron's default layers: Transformer Engine's
PP2 = ["--pipeline-model-parallel-size", "2"]
NO_ILP = ["--zero-bubble-ilp-time-limit", "0"]
# The same eight layers cut three ways: unevenly over two ranks, two chunks per rank, the V's 2p segments.
UNEVEN, TWO_CHUNKS, V_UNEVEN = "*-*|-*-*-", "*|-*-|*-*|-", "*-*|-*-|*|-"
EVEN = "*-*-|*-*-"


def _pattern(pattern: str) -> list[str]:
    return ["--hybrid-layer-pattern", pattern]


def definitions(work: str) -> dict[str, RunDefinition]:
    runs = {
        "uneven/megatron": _pattern(UNEVEN),
        "uneven/zb-auto": _pattern(UNEVEN) + ["--enable-zero-bubble", *NO_ILP, "--zero-bubble-dump-schedule",
                                              os.path.join(work, "dump")],
        "two-chunks/zb-auto": _pattern(TWO_CHUNKS) + ["--enable-zero-bubble", *NO_ILP],
        "v/zb-v": _pattern(V_UNEVEN) + ["--zero-bubble-v-schedule"],  # tied embeddings: both copies on rank 0
    }
    cache = ["--data-cache-path", os.path.join(work, "data-cache")]
    return {label: RunDefinition(2, MODEL + TRAIN + cache + PP2 + flags, script="pretrain_hybrid.py")
            for label, flags in runs.items()}


@pytest.fixture(scope="module")
def work_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("pretrain-hybrid"))


@pytest.fixture(scope="module")
def runs(work_dir) -> Runs:
    return Runs(definitions(work_dir), work_dir)


ITERATIONS = range(1, ITERS + 1)


def test_zb_auto_on_a_pattern_prints_megatrons_losses_and_norms(runs):
    same_training(runs["uneven/zb-auto"], runs["uneven/megatron"], ITERATIONS)
    same_validation(runs["uneven/zb-auto"], runs["uneven/megatron"])
    assert "zero-bubble:" not in runs["uneven/megatron"]


@pytest.mark.parametrize("run, schedule", [("two-chunks/zb-auto", "zb-auto (p=2, m=8, 2 chunks per rank)"),
                                           ("v/zb-v", "zb-v (p=2, m=8, 2 chunks per rank)")])
def test_two_chunks_per_rank_cut_by_the_pattern_print_megatrons_losses(runs, run, schedule):
    """Interleaved and V placements of the pattern's four segments against megatron's 1F1B on two: the losses to the
    last digit, the norms to their printed digits."""
    same_training(runs[run], runs["uneven/megatron"], ITERATIONS, norms_to_the_printed_digit=True)
    same_validation(runs[run], runs["uneven/megatron"])
    assert f"zero-bubble: running {schedule}" in runs[run]


def test_the_patterns_cuts_are_the_stages_megatron_and_the_runtime_run(runs):
    """The parameters megatron prints per rank: the uneven cut's 3 and 5 layers, the two-chunk cut's segments 0 and 2
    ("*", "*-*") on rank 0 and 1 and 3 ("-*-", "-") on rank 1, the V's segments 0 and 3 ("*-*", "-") on rank 0."""
    attention, mlp, embedding = 4 * 64 * 64 + 4 * 64 + 2 * 64, 8 * 64 * 64 + 5 * 64 + 2 * 64, 128 * 64 + 32 * 64
    final = 2 * 64  # the last stage's final norm
    output = 128 * 64  # the last stage's copy of the tied embedding
    last = {"uneven/zb-auto": 1, "two-chunks/zb-auto": 1, "v/zb-v": 0}
    expected = {"uneven/zb-auto": {0: embedding + 2 * attention + mlp, 1: 2 * attention + 3 * mlp},
                "two-chunks/zb-auto": {0: embedding + 3 * attention + mlp, 1: attention + 3 * mlp},
                "v/zb-v": {0: embedding + 2 * attention + 2 * mlp, 1: 2 * attention + 2 * mlp}}
    for run, counts in expected.items():
        counts[last[run]] += final + output
        assert parameters_per_rank(runs[run]) == counts, run


def test_the_first_plan_costs_each_stages_layers_by_kind(runs, work_dir):
    """The initial plan's costs are the cost model's for each rank's attention and MLP layers (megatron's validated
    args through plan_settings), not those of GPT layers counted per pattern character."""
    from megatron.zero_bubble.schedules.costs import Costs
    from megatron.zero_bubble.schedules.schedule import Schedule

    assert "zero-bubble: running zb-auto (p=2, m=8" in runs["uneven/zb-auto"]
    initial = Schedule.from_json(open(os.path.join(work_dir, "dump", "zb-auto-m8-initial.json")).read())
    costs = Costs.from_dict(initial.info["costs"])
    shape = dict(layers=8, hidden=64, heads=4, seq_length=32, micro_batch=2, vocab=128, num_virtual_stages=2)
    by_kind = Costs.from_model(**shape, stage_layers=["*-*", "-*-*-"])
    by_count = Costs.from_model(**shape, layer_counts=[3, 5])
    assert costs.t_f == pytest.approx(by_kind.t_f) and costs.m_f == pytest.approx(by_kind.m_f)
    assert costs.t_f != pytest.approx(by_count.t_f)


# ---------------------------------------------------------------- refusals as users meet them


def _refused(command: list[str], env: dict | None = None) -> tuple[int, list[str]]:
    done = subprocess.run(command, cwd=REPO, env=launch_environment() | (env or {}), capture_output=True, text=True,
                          timeout=600)
    return done.returncode, [line for line in done.stderr.splitlines() if "error:" in line]


def test_a_mamba_layer_on_cpu_stops_the_start_up_in_one_line_naming_the_character_and_the_fix():
    """Checked after megatron's parsing, on every rank; rank 0 prints it once."""
    status, errors = _refused(torchrun_command(2, ["pretrain_hybrid.py", *MODEL, *TRAIN, *PP2,
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
