"""pretrain_gpt.py's bad command lines: refused with one line naming the flag and the fix, never a traceback.

The start-up checks of every case run in one process (refusal_checks.py: megatron's parser and ours, as the script
runs them); the checks that need no megatron run here, in-process; a few launches show the real exit paths (the
script alone, torchrun with four ranks).
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import pytest

from tests.launching import REPO, launch_environment, torchrun_command
from tests.megatron.test_pretrain_gpt import LLAMA_MOE, MODEL, MOE, PP4, TRAIN

TRAIN_PV = TRAIN  # post-validation refuses --log-params-norm, which TRAIN leaves out
PARAMS_NORM = ["--log-params-norm"]


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
    "megatron's message overlap with the runtime": (PP4 + ["--enable-zero-bubble", "--no-overlap-p2p-communication"], 4,
                                                    ["--no-overlap-p2p-communication", "batches of its own", "drop"]),
    "megatron's ring exchange with the runtime": (PP4 + ["--pipeline-schedule", "zb-h1", "--use-ring-exchange-p2p"], 4,
                                                  ["--use-ring-exchange-p2p", "batches of its own", "drop"]),
    "UCC for pipeline messages with the runtime": (PP4 + ["--enable-zero-bubble", "--pipeline-model-parallel-comm-backend",
                                                          "ucc"], 4,
                                                   ["--pipeline-model-parallel-comm-backend ucc", "NCCL's rules",
                                                    "use nccl"]),
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
    "post-validation with the parameter norm": (PP4 + PARAMS_NORM + ["--enable-zero-bubble",
                                                                     "--enable-optimizer-post-validation"], 4,
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
    "local experts with linear biases": (PP4 + ["--num-experts", "4", "--transformer-impl", "local"], 4, ["--num-experts", "--disable-bias-linear"]),
    "grouped experts on CPU's local layers": (PP4 + MOE + ["--moe-grouped-gemm", "--transformer-impl", "local"], 4,
                                              ["--moe-grouped-gemm needs CUDA", "SequentialMLP"]),
    "grouped experts on TE's layers on CPU": (PP4 + MOE + ["--moe-grouped-gemm"], 4, None),
    "flash attention on CPU": (PP4 + ["--attention-backend", "flash"], 4,
                               ["--attention-backend flash needs CUDA", "TE's unfused attention"]),
    "flex dispatcher on CPU": (PP4 + MOE + ["--moe-token-dispatcher-type", "flex"], 4,
                               ["--moe-token-dispatcher-type flex needs CUDA", "alltoall"]),
    "shared-expert overlap on CPU": (PP4 + MOE + ["--moe-shared-expert-intermediate-size", "64", "--moe-shared-expert-overlap"],
                                     4, ["--moe-shared-expert-overlap needs CUDA", "drop"]),
    "expert all-to-all overlap with the runtime": (PP4 + MOE + ["--enable-zero-bubble", "--overlap-moe-expert-parallel-comm"],
                                                   4, ["--overlap-moe-expert-parallel-comm", "--enable-zero-bubble"]),
    "MoE paged stash with a split schedule": (PP4 + MOE + ["--pipeline-schedule", "zb-h1", "--moe-paged-stash"], 4,
                                              ["--moe-paged-stash does not work with the zero-bubble runtime "
                                               "(--pipeline-schedule zb-h1)", "the stash would stay off",
                                               "drop --moe-paged-stash"]),
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
    "multi-latent attention on megatron's local layers": (PP4 + ["--multi-latent-attention", "--enable-zero-bubble",
                                                                 "--transformer-impl", "local"], 4,
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
def checked(tmp_path_factory) -> subprocess.CompletedProcess:
    """refusal_checks.py over every case of REFUSALS, in one process."""
    cases = {label: ((case[3] if len(case) > 3 else BASE) + case[0], case[1]) for label, case in REFUSALS.items()}
    path = tmp_path_factory.mktemp("refusals") / "cases.json"
    path.write_text(json.dumps(cases))
    return subprocess.run([sys.executable, "tests/megatron/refusal_checks.py", str(path)], cwd=REPO,
                          env=launch_environment(), capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def refusals(checked) -> dict:
    found = _reported(checked, "REFUSALS")
    refused = "".join(line for line in checked.stdout.splitlines(True) if not line.startswith("HELP ")) + checked.stderr
    assert "usage:" not in refused  # a bad megatron flag is one line too, not argparse's usage
    return {**found, "early flags": _reported(checked, "EARLY_FLAGS")}


def test_help_lists_megatron_and_zero_bubble_flags(checked):
    """`pretrain_gpt.py --help` prints megatron's flags and ours (megatron-core 0.19.2 ships a help text with a stray
    '%' that makes argparse raise; the start-up code escapes it by argparse's own formatting rule)."""
    help_ = _reported(checked, "HELP")
    assert help_["status"] == 0
    for flag in ("--num-layers", "--enable-zero-bubble", "--zero-bubble-v-schedule", "--allow-padding-num-layers",
                 "--moe-paged-stash-buffer-size-factor-cuda"):
        assert flag in help_["text"]


def test_a_failed_megatron_assert_is_one_line_naming_megatrons_check(checked):
    """A mistake megatron's own argument validation catches with a bare assert (--save without --save-interval)
    stops the start-up with one line naming megatron's check (its file, line and asserted expression), exit
    status 2, not a traceback."""
    stopped = _reported(checked, "MEGATRON_ASSERT")
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


def test_every_run_of_test_pretrain_gpt_passes_the_early_checks_and_they_create_the_directories(tmp_path, monkeypatch):
    from tests.megatron.test_pretrain_gpt import definitions

    runs = definitions(str(tmp_path))
    for label, run in runs.items():
        assert _early_refusal(run.flags, run.nproc, monkeypatch) is None, label
    created = sorted(os.listdir(tmp_path))
    assert "data-cache" in created and "ckpt" in created and "dump" in created
    assert all(os.listdir(tmp_path / name) == [] for name in created)  # created, and empty: the write check cleans up


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
    # others were stopped by torchrun afterwards: SIGTERM, or SIGKILL 30 s later where a rank got no core to act on it.
    root_cause = output.split("Root Cause (first observed failure):")[1]
    assert re.search(r"rank +: 0 \(local_rank: 0\)\s+exitcode +: 2 ", root_cause), root_cause
    statuses = re.findall(r"exitcode +: (-?\d+)", output)
    assert len(statuses) == nproc and set(statuses) <= {"2", "-15", "-9"}, statuses


def test_the_script_stops_a_bad_command_line_with_one_error_line_and_no_traceback():
    done = subprocess.run([sys.executable, "pretrain_gpt.py", *BASE, *PP4, "--enable-zero-bubble",
                           "--zero-bubble-v-schedule"], cwd=REPO, env=dict(launch_environment(), WORLD_SIZE="4"),
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
    command = torchrun_command(4, ["pretrain_gpt.py", *BASE, *(f.replace("{file}", a_file) for f in flags)])
    done = subprocess.run(command, cwd=REPO, env=launch_environment(), capture_output=True, text=True, timeout=120)
    seconds = time.monotonic() - started
    assert seconds < 30, seconds
    _one_line_refusal(done, words, nproc=4)


MISSPELLED = ["--pipeline-model-parallel-size", "2", "--num-layer", "8"]  # megatron's --num-layers


def test_torchrun_refuses_a_misspelled_megatron_flag_in_one_line_after_megatrons_import():
    """A refusal after each rank has imported megatron (ranks reach it seconds apart): still one line, by rank 0."""
    done = subprocess.run(torchrun_command(2, ["pretrain_gpt.py", *BASE, *MISSPELLED]), cwd=REPO,
                          env=launch_environment(), capture_output=True, text=True, timeout=300)
    _one_line_refusal(done, ["unrecognized arguments: --num-layer 8"], nproc=2)
