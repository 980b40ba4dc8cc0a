"""The example scripts of examples/: what megatron gets from them (their DRY_RUN commands), that their tiny CPU mode
keeps every flag but the sizes, that the full-size commands pass pretrain_gpt.py's start-up checks, and that each
tiny mode trains to its end under torchrun, as a user starts it.

Every test here starts a process (bash for a dry run, which takes milliseconds; torchrun for the tiny runs), so the
suite's rule marks them all slow. The tiny runs and the start-up checks are one background launch, started as soon
as the tests are collected.
"""
from __future__ import annotations

import math
import os
import re
import shlex
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

import pytest

from megatron.zero_bubble.training import arguments, devices
from megatron.zero_bubble.tools.local_ranks import TORCHRUN_ONE_MACHINE
from megatron.zero_bubble.training.teardown import THREADS_OUTLIVE
from tests.megatron.refusal_checks import start_up_refusals

pytestmark = pytest.mark.slow  # every example runs as a process (dry runs: bash; tiny runs: torchrun)

REPO = Path(__file__).resolve().parents[1]
EXAMPLES_DIR = REPO / "examples"
EXAMPLES = ("llama3_8b", "gpt3_175b", "mixtral_8x7b", "deepseek_moe")
# Every knob an example reads from the environment (examples/*.sh headers, examples/common.sh)
KNOBS = ("TINY", "DRY_RUN", "ARGS_FILE", "EXTRA_ARGS", "TP", "PP", "EP", "VPP", "MLA", "MICRO_BATCH", "GLOBAL_BATCH",
         "TRAIN_ITERS", "NPROC_PER_NODE", "NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHRUN")
CPU_FLAGS = {"--zero-bubble-cpu": True, "--distributed-backend": "gloo", "--no-persist-layer-norm": True,
             "--no-masked-softmax-fusion": True, "--num-workers": "0"}
# Flags whose value the tiny mode shrinks (sizes, layout, length of the run); every other flag keeps its value.
SHRUNK = {"--num-layers", "--hidden-size", "--ffn-hidden-size", "--num-attention-heads", "--num-query-groups",
          "--kv-channels", "--seq-length", "--max-position-embeddings", "--vocab-size", "--num-experts",
          "--moe-router-topk", "--moe-ffn-hidden-size", "--moe-shared-expert-intermediate-size", "--moe-layer-freq",
          "--global-batch-size", "--train-iters", "--lr-warmup-iters", "--lr-decay-iters", "--eval-interval",
          "--eval-iters", "--save-interval", "--tensor-model-parallel-size", "--pipeline-model-parallel-size",
          "--expert-model-parallel-size", "--zero-bubble-max-pending-backward",
          "--zero-bubble-pipeline-timers-start-iter", "--zero-bubble-pipeline-timers-end-iter",
          "--zero-bubble-ilp-time-limit", "--nproc-per-node", "--nnodes"}


# ---------------------------------------------------------------- dry runs


def run_example(name: str, *positional: str, timeout: float = 30, **knobs: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in KNOBS}
    env.update(knobs)
    return subprocess.run(["bash", str(EXAMPLES_DIR / f"{name}.sh"), *positional], env=env, capture_output=True,
                          text=True, timeout=timeout)


@lru_cache(maxsize=None)
def dry_run(name: str, *positional: str, **knobs: str) -> subprocess.CompletedProcess:
    return run_example(name, *positional, DRY_RUN="1", **knobs)


def command_of(output: str) -> list[str]:
    (line,) = [line for line in output.splitlines() if line.startswith("torchrun command: ")]
    return shlex.split(line[len("torchrun command: "):])


def pretrain_argv(command: list[str]) -> list[str]:
    """The arguments pretrain_gpt.py gets (after its path in the torchrun command)."""
    return command[[Path(word).name for word in command].index("pretrain_gpt.py") + 1:]


def flag_values(command: list[str]) -> dict:
    """Last value of every `--flag value` (later flags win, as with argparse); bare flags map to True."""
    values = {}
    for i, word in enumerate(command):
        if word.startswith("--"):
            nxt = command[i + 1] if i + 1 < len(command) else None
            values[word] = True if nxt is None or nxt.startswith("--") else nxt
    return values


def flags_of(name: str, *positional: str, **knobs: str) -> dict:
    result = dry_run(name, *positional, **knobs)
    assert result.returncode == 0, result.stderr
    return flag_values(command_of(result.stdout))


# The published shapes (Llama 3, GPT-3, Mixtral, DeepSeekMoE 16B papers and model cards) and the layouts the scripts
# document in their headers.
FULL_SIZE = {
    "llama3_8b": {"--num-layers": "32", "--hidden-size": "4096", "--ffn-hidden-size": "14336",
                  "--num-attention-heads": "32", "--group-query-attention": True, "--num-query-groups": "8",
                  "--kv-channels": "128", "--seq-length": "8192", "--position-embedding-type": "rope",
                  "--rotary-base": "500000", "--normalization": "RMSNorm", "--swiglu": True,
                  "--untie-embeddings-and-output-weights": True, "--disable-bias-linear": True,
                  "--vocab-size": "128256",
                  "--bf16": True, "--clip-grad": "1.0",
                  "--tensor-model-parallel-size": "1", "--pipeline-model-parallel-size": "4",
                  "--pipeline-schedule": "zb-v", "--use-distributed-optimizer": True,
                  "--nproc-per-node": "8", "--nnodes": "1"},
    "gpt3_175b": {"--num-layers": "96", "--hidden-size": "12288", "--num-attention-heads": "96", "--seq-length": "2048",
                  "--max-position-embeddings": "2048", "--vocab-size": "50257", "--fp16": True,
                  "--initial-loss-scale": "65536", "--clip-grad": "1.0", "--lr-decay-style": "cosine",
                  "--tensor-model-parallel-size": "8", "--pipeline-model-parallel-size": "16",
                  "--num-virtual-stages-per-pipeline-rank": "2", "--pipeline-schedule": "zb-auto",
                  "--sequence-parallel": True, "--nproc-per-node": "8", "--nnodes": "16"},
    "mixtral_8x7b": {"--num-layers": "32", "--hidden-size": "4096", "--ffn-hidden-size": "14336",
                     "--num-attention-heads": "32", "--num-query-groups": "8", "--seq-length": "4096",
                     "--rotary-base": "1000000", "--num-experts": "8", "--moe-router-topk": "2",
                     "--moe-token-dispatcher-type": "alltoall", "--moe-grouped-gemm": True, "--vocab-size": "32000",
                     "--bf16": True, "--clip-grad": "1.0",
                     "--tensor-model-parallel-size": "1", "--pipeline-model-parallel-size": "4",
                     "--expert-model-parallel-size": "8", "--pipeline-schedule": "zb-auto",
                     "--zero-bubble-max-pending-backward": "auto", "--use-distributed-optimizer": True,
                     "--nproc-per-node": "8", "--nnodes": "4"},
    "deepseek_moe": {"--num-layers": "28", "--hidden-size": "2048", "--num-attention-heads": "16",
                     "--ffn-hidden-size": "10944", "--seq-length": "4096", "--num-experts": "64",
                     "--moe-ffn-hidden-size": "1408", "--moe-router-topk": "6",
                     "--moe-shared-expert-intermediate-size": "2816", "--moe-layer-freq": "[0]+[1]*27",
                     "--moe-router-pre-softmax": True, "--moe-grouped-gemm": True, "--vocab-size": "102400",
                     "--bf16": True, "--clip-grad": "1.0",
                     "--tensor-model-parallel-size": "1", "--pipeline-model-parallel-size": "4",
                     "--expert-model-parallel-size": "2", "--pipeline-schedule": "zb-auto",
                     "--zero-bubble-max-pending-backward": "8", "--use-distributed-optimizer": True,
                     "--nproc-per-node": "8", "--nnodes": "1"},
}
ABSENT = {"llama3_8b": ("--fp16", "--sequence-parallel", "--num-virtual-stages-per-pipeline-rank"),
          "gpt3_175b": ("--bf16", "--swiglu", "--position-embedding-type", "--untie-embeddings-and-output-weights"),
          "mixtral_8x7b": ("--fp16", "--sequence-parallel"),
          "deepseek_moe": ("--fp16", "--multi-latent-attention", "--group-query-attention")}


def world_and_layout(flags: dict) -> tuple[int, int, int, int, int]:
    """(world size, TP, PP, DP, chunks per rank) of a command."""
    world = int(flags["--nproc-per-node"]) * int(flags["--nnodes"])
    tp, pp = int(flags["--tensor-model-parallel-size"]), int(flags["--pipeline-model-parallel-size"])
    chunks = 2 if flags.get("--pipeline-schedule") == "zb-v" else int(
        flags.get("--num-virtual-stages-per-pipeline-rank", 1))
    return world, tp, pp, world // (tp * pp), chunks


@pytest.mark.parametrize("name", EXAMPLES)
def test_full_size_commands_give_megatron_the_published_shape_layout_and_schedule(name):
    flags = flags_of(name)
    assert {flag: flags.get(flag) for flag in FULL_SIZE[name]} == FULL_SIZE[name]
    for flag in ABSENT[name]:
        assert flag not in flags
    assert not set(CPU_FLAGS) & set(flags)  # the full size is a GPU run: NCCL, Transformer Engine
    assert "--mock-data" in flags and flags["--tokenizer-type"] == "NullTokenizer"  # no paths given
    world, tp, pp, dp, chunks = world_and_layout(flags)
    assert world % (tp * pp) == 0
    assert int(flags["--num-layers"]) % (pp * chunks) == 0  # every chunk gets the same layers
    assert int(flags["--global-batch-size"]) % (int(flags["--micro-batch-size"]) * dp) == 0
    if "--expert-model-parallel-size" in flags:
        assert dp % int(flags["--expert-model-parallel-size"]) == 0
    limit = flags.get("--zero-bubble-max-pending-backward")
    if flags["--pipeline-schedule"] == "zb-auto" and limit not in (None, "auto"):
        assert int(limit) == 2 * pp  # ZB-2p


@pytest.mark.parametrize("name", EXAMPLES)
def test_the_tiny_mode_keeps_every_flag_but_the_sizes_and_adds_the_cpu_flags(name):
    """Its layers too: megatron's default, Transformer Engine's (on the CPU over the labelled kernel layer)."""
    full, tiny = flags_of(name), flags_of(name, TINY="1")
    assert "--transformer-impl" not in tiny
    assert set(tiny) == set(full) | set(CPU_FLAGS)
    for flag, value in CPU_FLAGS.items():
        assert tiny[flag] == value
    kept = {flag: value for flag, value in full.items() if flag in tiny and flag not in SHRUNK}
    assert {flag: tiny[flag] for flag in kept} == kept
    world, tp, pp, dp, chunks = world_and_layout(tiny)
    assert world == 4 and world % (tp * pp) == 0 and int(tiny["--num-layers"]) % (pp * chunks) == 0
    assert pp >= 2 and int(tiny["--hidden-size"]) == 64 and int(tiny["--seq-length"]) <= 64
    if "--expert-model-parallel-size" in tiny:
        assert int(tiny["--expert-model-parallel-size"]) == 2 and dp % 2 == 0


def test_multi_latent_attention_is_added_at_full_size_and_kept_in_the_tiny_mode():
    full = flags_of("deepseek_moe", MLA="1")
    assert full["--multi-latent-attention"] is True and full["--kv-lora-rank"] == "512"
    tiny = dry_run("deepseek_moe", TINY="1", MLA="1")
    assert tiny.returncode == 0, tiny.stderr
    assert flag_values(command_of(tiny.stdout))["--multi-latent-attention"] is True
    assert "multi-latent attention) at CPU size" in tiny.stdout


@pytest.mark.parametrize("name, positional, expected", [
    ("llama3_8b", ("/ckpt", "/tb", "meta-llama/Meta-Llama-3-8B", "/data/text_document"),
     {"--save": "/ckpt", "--load": "/ckpt", "--save-interval": "1000", "--tensorboard-dir": "/tb",
      "--tokenizer-type": "HuggingFaceTokenizer", "--tokenizer-model": "meta-llama/Meta-Llama-3-8B",
      "--data-path": "/data/text_document", "--split": "99,1,0"}),
    ("gpt3_175b", ("/ckpt", "MOCK", "/v.json", "/m.txt", "/data/text_document"),
     {"--save": "/ckpt", "--tokenizer-type": "GPT2BPETokenizer", "--vocab-file": "/v.json", "--merge-file": "/m.txt",
      "--data-path": "/data/text_document"}),
    ("mixtral_8x7b", ("", "", "/tokenizer"),
     {"--tokenizer-type": "HuggingFaceTokenizer", "--tokenizer-model": "/tokenizer", "--mock-data": True}),
])
def test_positional_paths_turn_on_checkpoints_tensorboard_a_tokenizer_and_real_data(name, positional, expected):
    flags = flags_of(name, *positional)
    assert {flag: flags.get(flag) for flag in expected} == expected
    if "--data-path" in expected:
        assert "--mock-data" not in flags
    if positional[1] in ("", "MOCK"):
        assert "--tensorboard-dir" not in flags
    assert "--vocab-size" not in flags or "--tokenizer-model" not in flags


@pytest.mark.parametrize("name, positional, knobs, words", [
    ("gpt3_175b", ("", "", "/v.json"), {}, "give both VOCAB_FILE and MERGE_FILE"),
    ("llama3_8b", ("a", "b", "c", "d", "e"), {}, "takes at most 4 arguments"),
    ("gpt3_175b", (), {"NNODES": "1"}, "TP 8 x PP 16 does not divide 8 processes"),
    ("mixtral_8x7b", (), {"TINY": "1", "NPROC_PER_NODE": "2"}, "EP 2 does not divide the 1 data-parallel ranks"),
])
def test_a_launch_that_cannot_work_stops_in_one_line_before_torchrun(name, positional, knobs, words):
    result = dry_run(name, *positional, **knobs)
    assert result.returncode == 1 and "torchrun command" not in result.stdout
    assert result.stderr.count("\n") == 1 and f"{name}.sh: " in result.stderr and words in result.stderr


def test_knobs_change_the_layout_and_extra_args_come_last():
    flags = flags_of("llama3_8b", TP="2", PP="2", NNODES="2", EXTRA_ARGS="--seed 7 --lr 1e-4")
    assert flags["--tensor-model-parallel-size"] == "2" and flags["--pipeline-model-parallel-size"] == "2"
    assert flags["--sequence-parallel"] is True  # with TP > 1
    assert flags["--nnodes"] == "2" and flags["--lr"] == "1e-4"
    command = command_of(dry_run("llama3_8b", EXTRA_ARGS="--seed 7 --lr 1e-4").stdout)
    assert command[-4:] == ["--seed", "7", "--lr", "1e-4"]
    assert "TP 2 x PP 2 x DP 4 on 16 processes" in dry_run("llama3_8b", TP="2", PP="2", NNODES="2").stdout


@pytest.mark.parametrize("name", EXAMPLES)
def test_args_file_holds_the_arguments_of_the_dry_run_one_per_line(name, tmp_path):
    path = tmp_path / "run.args"
    written = run_example(name, "/ckpt", TINY="1", ARGS_FILE=str(path), EXTRA_ARGS="--seed 3")
    assert written.returncode == 0, written.stderr
    assert "torchrun command" not in written.stdout and f"written to {path}" in written.stdout
    expected = pretrain_argv(command_of(dry_run(name, "/ckpt", TINY="1", EXTRA_ARGS="--seed 3").stdout))
    assert path.read_text().splitlines() == expected


# ---------------------------------------------------------------- the launches: start-up checks and tiny runs


def cpu_side_case(name: str) -> tuple[list[str], int]:
    """A full-size command for the start-up checks on this CPU machine (--zero-bubble-cpu added); the world size it
    launches."""
    flags = flag_values(command_of(dry_run(name).stdout))
    argv = pretrain_argv(command_of(dry_run(name).stdout))
    return argv + ["--zero-bubble-cpu"], int(flags["--nproc-per-node"]) * int(flags["--nnodes"])


def start_up_cases() -> dict[str, tuple[list[str], int]]:
    cases = {name: cpu_side_case(name) for name in EXAMPLES}
    mla = pretrain_argv(command_of(dry_run("deepseek_moe", MLA="1").stdout))
    cases["deepseek_moe MLA on local layers"] = ([word for word in mla if word != "--moe-grouped-gemm"]
                                                 + ["--zero-bubble-cpu", "--transformer-impl", "local"], 8)
    return cases


TINY_RUNS = {"llama3_8b": ("CKPT",), "gpt3_175b": (), "mixtral_8x7b": (), "deepseek_moe": ()}  # CKPT: a directory


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("examples")


@pytest.fixture(scope="module")
def start_up_checks(work) -> dict:
    """The start-up checks of the full-size commands, every case in one process (tests/megatron/refusal_checks.py)."""
    return start_up_refusals(start_up_cases(), work)


@pytest.mark.parametrize("name", EXAMPLES)
def test_full_size_commands_pass_every_start_up_check_of_pretrain_gpt(name, start_up_checks):
    """megatron's parser and pretrain_gpt.py's start-up checks (layer split, schedule, memory limit, a trial plan at
    the full size's p and m) at the world size the script launches; only the GPU itself is missing here."""
    assert start_up_checks[name] is None


def test_multi_latent_attention_is_refused_on_local_layers_as_the_tiny_mode_says(start_up_checks):
    refusal = start_up_checks["deepseek_moe MLA on local layers"]
    assert refusal is not None and refusal.startswith("--multi-latent-attention needs Transformer Engine's attention")


ITERATION = re.compile(r" iteration +(\d+)/ +(\d+) \|.*? lm loss: ([0-9.E+-]+) \|(.*)")
EXPECTED_LINES = {
    "llama3_8b": [r"zero-bubble: running zb-v \(p=2, m=8, 2 chunks per rank\)", r"^ +bf16 \.+ True$"],
    "gpt3_175b": [r"zero-bubble: running zb-auto \(p=2, m=16, 2 chunks per rank\)", r"^ +fp16 \.+ True$",
                  r"^ +sequence_parallel \.+ True$"],
    "mixtral_8x7b": [r"zero-bubble: running zb-auto \(p=2, m=8\)", r"zero-bubble: re-planned zb-auto",
                     r"^ +expert_model_parallel_size \.+ 2$", r"^ +num_experts \.+ 8$"],
    "deepseek_moe": [r"zero-bubble: running zb-auto \(p=2, m=8, memory limit 4 microbatches\)",
                     r"zero-bubble: re-planned zb-auto", r"^ +expert_model_parallel_size \.+ 2$",
                     r"^ +moe_layer_freq \.+ \[0, 1, 1, 1\]$"],
}


@pytest.fixture(scope="module")
def tiny_runs(work) -> dict[str, tuple[int, str, Path]]:
    """name -> (exit status, what it printed, its work directory): each tiny run a torchrun of 4 ranks, as a user
    starts it, one after another."""
    results = {}
    for name, positional in TINY_RUNS.items():
        args = [str(work / f"{name}-ckpt") if word == "CKPT" else word for word in positional]
        done = run_example(name, *args, timeout=900, TINY="1",
                           TORCHRUN=" ".join([sys.executable, "-m", "torch.distributed.run", *TORCHRUN_ONE_MACHINE]))
        results[name] = (done.returncode, done.stdout + done.stderr, work)
    return results


@pytest.mark.parametrize("name", EXAMPLES)
def test_each_tiny_example_trains_to_its_end_with_its_schedule(name, tiny_runs):
    rc, log, work = tiny_runs[name]
    assert rc == 0, log[-6000:]
    assert THREADS_OUTLIVE not in log, log[-6000:]  # every group destroyed on every rank before the process ended
    iterations = ITERATION.findall(log)
    assert [(int(i), int(n)) for i, n, _, _ in iterations] == [(i, 6) for i in range(1, 7)], log[-6000:]
    losses = [float(loss) for _, _, loss, _ in iterations]
    assert all(math.isfinite(loss) and 0 < loss < 10 for loss in losses)  # ln(128) = 4.85 at the start
    assert losses[-1] < losses[0]  # six steps at the example's learning rate move the loss down
    assert "split check: passed" in log
    assert re.search(r"validation loss at iteration 6 .*\| lm loss value: ", log)
    for pattern in EXPECTED_LINES[name]:
        assert re.search(pattern, log, re.M), pattern
    if name == "gpt3_175b":
        assert all(" loss scale: 65536.0 |" in rest for _, _, _, rest in iterations)  # fp16, dynamic scaling
    if name in ("mixtral_8x7b", "deepseek_moe"):
        assert all(" load_balancing_loss: " in rest for _, _, _, rest in iterations)
    if name == "llama3_8b":  # its checkpoint directory was given: megatron saved at the last iteration
        assert (work / "llama3_8b-ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "6"


def test_the_gpu_stand_in_of_the_early_checks_answers_only_the_device_question(monkeypatch):
    """The full-size commands before megatron's import (as torchrun starts them on a GPU node): the early checks with
    torch's CUDA question answered yes (a stand-in for the GPU node, nothing else faked)."""
    monkeypatch.setattr(devices, "cuda_available", lambda: True)
    for name in EXAMPLES:
        flags = flag_values(command_of(dry_run(name).stdout))
        monkeypatch.setenv("WORLD_SIZE", str(int(flags["--nproc-per-node"]) * int(flags["--nnodes"])))
        arguments.check_early(pretrain_argv(command_of(dry_run(name).stdout)))
