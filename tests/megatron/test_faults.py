"""Runs that go wrong stop cleanly: faults injected through pretrain_gpt.py (--zero-bubble-inject-fault), each a
torchrun launch on CPU that must end, with one line per rank and no hang; and the strict stand-in of NCCL's
point-to-point, which must refuse what NCCL refuses where gloo forgives it."""
from __future__ import annotations

import json
import os
import pickle
import re
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from megatron.zero_bubble.tools.local_ranks import init_group, run_ranks
from tests.launching import REPO, launch_environment, torchrun_command

TINY = ("--zero-bubble-cpu --num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
        "--max-position-embeddings 32 --micro-batch-size 2 --global-batch-size 8 --tokenizer-type NullTokenizer "
        "--vocab-size 128 --mock-data --lr 1e-3 --num-workers 0 --eval-iters 0 --eval-interval 1000 --log-interval 1 "
        "--seed 1234 --hidden-dropout 0 --attention-dropout 0").split()
WATCHDOG_LINE = re.compile(r"zero-bubble: pipeline watchdog: rank (\d) of the pipeline \(global rank (\d)\)")


def _launch(nproc: int, flags: list[str], timeout: float = 300) -> tuple[subprocess.CompletedProcess, float]:
    start = time.monotonic()
    done = subprocess.run(torchrun_command(nproc, ["pretrain_gpt.py", *TINY, *flags]), cwd=REPO,
                          env=launch_environment(), capture_output=True, text=True, timeout=timeout)
    return done, time.monotonic() - start


LOST = ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zb-h1", "--train-iters", "3",
        "--zero-bubble-inject-fault", "lost-message:1"]
RANK_0_WAITS = ("zero-bubble: pipeline watchdog: rank 0 of the pipeline (global rank 0) has waited {} s for the gradient "
                "of microbatch 3 from stage 1 to stage 0 from rank 1, which B of microbatch 3 needs; heads of its links: "
                "with rank 1: the receive of the gradient of microbatch 3")


def _watchdog_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if WATCHDOG_LINE.match(line)]


@pytest.mark.slow
def test_with_watchdog_abort_a_lost_message_writes_the_flight_recorder_and_ends_the_job_with_a_line(tmp_path):
    """Rank 1 never posts its last gradient send (PP=2): rank 0 waits for it until its watchdog fires; it prints where
    it stands, writes PyTorch's flight recorder where megatron points it, and ends the job non-zero, long before
    gloo's own timeout."""
    done, seconds = _launch(2, [*LOST, "--zero-bubble-watchdog-timeout", "3", "--zero-bubble-watchdog-abort",
                                "--flight-recorder-dump-path", str(tmp_path)])
    assert "exitcode  : 3" in done.stderr and done.returncode != 0, done.stdout[-2000:] + done.stderr[-3000:]
    lines = _watchdog_lines(done.stderr)
    assert len(lines) == 1 and lines[0].startswith(RANK_0_WAITS.format(3)), done.stderr[-4000:]
    assert lines[0].endswith("(--zero-bubble-watchdog-timeout 3); the first rank to report")
    dump = pickle.loads((tmp_path / "_dump_0").read_bytes())  # megatron's prefix for a directory, then the rank
    # PyTorch's own dump format; gloo's recorder keeps collectives only (NCCL's keeps point-to-point too)
    assert dump["pg_config"] and any(e["profiling_name"] == "gloo:all_reduce" for e in dump["entries"])
    assert f"rank 0 wrote the flight recorder to {tmp_path / '_dump_0'}" in done.stderr
    assert seconds < 100 and "iteration        1/" not in done.stdout  # no iteration completed


@pytest.mark.slow
def test_by_default_the_watchdog_prints_its_line_and_leaves_the_job_running(tmp_path):
    """The same lost message with the default watchdog: after 2 s rank 0 says where it stands, and the job goes on
    waiting (ending it is left to the process group's timeout, --distributed-timeout-minutes, which writes the flight
    recorder): 10 s after the line, five times the watchdog's timeout, it still runs, with that one line."""
    out, err = tmp_path / "stdout", tmp_path / "stderr"
    with open(out, "w") as stdout, open(err, "w") as stderr:
        job = subprocess.Popen(torchrun_command(2, ["pretrain_gpt.py", *TINY, *LOST, "--zero-bubble-watchdog-timeout", "2"]),
                               cwd=REPO, env=launch_environment(), stdout=stdout, stderr=stderr, start_new_session=True)
        try:
            deadline = time.monotonic() + 120
            while not _watchdog_lines(err.read_text()) and job.poll() is None and time.monotonic() < deadline:
                time.sleep(0.5)
            time.sleep(10)
            running = job.poll() is None
        finally:  # torchrun ends its ranks on SIGTERM (they run in process groups of their own)
            job.terminate()
            try:
                job.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(job.pid, signal.SIGKILL)
                job.wait()
    lines = _watchdog_lines(err.read_text())
    assert running and len(lines) == 1 and lines[0].startswith(RANK_0_WAITS.format(2)), err.read_text()[-4000:]


@pytest.mark.slow
def test_a_split_check_difference_on_one_tensor_parallel_rank_stops_every_rank_in_seconds_with_one_line():
    """TP=2 x PP=2: only global rank 1 sees a difference. Its tensor-parallel peer must take the same branch (the
    re-runs that measure noise, the stop), or the two would issue different collectives and hang."""
    # megatron's local layers: the agreement is the point, not the layers (TE's import makes each rank slower)
    done, seconds = _launch(4, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                                "--transformer-impl", "local", "--pipeline-schedule", "zb-h1", "--train-iters", "2",
                                "--zero-bubble-inject-fault", "split-mismatch:1",
                                "--distributed-timeout-minutes", "2"], timeout=200)
    errors = [line for line in done.stderr.splitlines() if line.startswith("pretrain_gpt.py: error:")]
    assert done.returncode != 0 and len(errors) == 1, done.stderr[-4000:]
    assert errors[0].startswith("pretrain_gpt.py: error: zero-bubble: split check failed on rank 1, chunk 0: the "
                                "gradient of "), errors[0]
    assert "SplitCheckFailed" not in done.stderr and seconds < 100


@pytest.mark.slow
def test_a_slow_rank_leaves_its_neighbours_measured_pass_times_as_they_were(tmp_path):
    """Rank 1 of PP=3 sleeps 0.15 s before each pass; ranks 0 and 2 wait for it, but their pass clocks start once
    the input has arrived, so their measured T_F / T_B / T_W stay those of passes of milliseconds (1.7-8.4 ms
    without the sleep, measured on the 2-core machine), where waiting would add a tenth of a second or more."""
    # megatron's local layers, whose passes the thresholds below were measured on (TE's over the CPU kernels are slower)
    done, _ = _launch(3, ["--pipeline-model-parallel-size", "3", "--num-layers", "6", "--transformer-impl", "local",
                          "--enable-zero-bubble",
                          "--zero-bubble-ilp-time-limit", "0", "--train-iters", "4",
                          "--zero-bubble-pipeline-timers-start-iter", "2", "--zero-bubble-pipeline-timers-end-iter",
                          "3", "--zero-bubble-dump-schedule", str(tmp_path), "--zero-bubble-inject-fault",
                          "slow-rank:1:0.15"])
    assert done.returncode == 0, done.stderr[-3000:]
    costs = json.loads(next(tmp_path.glob("zb-auto-m*-iter4.json")).read_text())["costs"]
    for name in ("t_f", "t_b", "t_w"):
        for stage in (0, 2):
            assert costs[name][stage] < 0.05, (name, stage, costs[name])  # a third of one wait for the slow rank
        assert costs[name][1] < 0.12  # the sleep is not the slow rank's pass time either


def _head_to_head(rank: int, world_size: int, directory: str, strict: bool) -> None:
    from megatron.zero_bubble.runtime.p2p import TorchP2P
    from megatron.zero_bubble.tools.strict_p2p import StrictP2P

    init_group("gloo", rank, world_size, directory)
    ops = StrictP2P(timeout_s=3.0) if strict else TorchP2P()
    group = dist.group.WORLD
    peer = 1 - rank
    inbox, outbox = torch.zeros(4), torch.full((4,), float(rank))
    try:  # both ranks post a batch with their receive first, then one with their send: NCCL's in-order stream
        # never gets to the second batch, and under one launch queue nothing after it runs
        works = [ops.batch([(False, inbox, peer)], group), ops.batch([(True, outbox, peer)], group)]
        for work in works:
            work.wait()
        result = ("done", inbox.tolist())
    except RuntimeError as error:
        result = ("failed", str(error))
    Path(directory, f"r.{rank}").write_text(json.dumps(result))
    if strict:
        os._exit(0)  # its stream stays stuck in gloo's receive, on purpose
    dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("strict", (False, True), ids=("gloo", "strict"))
def test_the_strict_transport_refuses_receives_posted_head_to_head_where_gloo_forgives_them(strict, tmp_path):
    run_ranks(_head_to_head, 2, str(tmp_path), (strict,), 120, "spawn", "the head-to-head exchange")
    results = [json.loads((tmp_path / f"r.{rank}").read_text()) for rank in range(2)]
    if strict:
        assert all(r[0] == "failed" and "did not complete within 3 s" in r[1] for r in results), results
    else:
        assert results == [["done", [1.0] * 4], ["done", [0.0] * 4]]


def _plan_that_raises(rank: int, world_size: int, directory: str) -> None:
    from megatron.zero_bubble.runtime.agreement import agree, schedule_of
    from megatron.zero_bubble.schedules.schedule import ScheduleError

    init_group("gloo", rank, world_size, directory)

    def decide(gathered):
        raise ValueError(f"a planner bug, seen with {len(gathered)} ranks' facts")

    try:
        schedule_of(agree({"rank": rank}, decide))
        result = "planned"
    except ScheduleError as error:
        result = str(error)
    Path(directory, f"r.{rank}").write_text(result)
    dist.destroy_process_group()


@pytest.mark.slow
def test_any_exception_in_planning_reaches_every_rank_as_the_plans_error():
    """Rank 0 plans; anything it raises (not only a ScheduleError) comes to every rank as the decision's error, instead
    of leaving the others in the broadcast until NCCL's timeout: all stop with the same line."""
    with tempfile.TemporaryDirectory() as directory:
        run_ranks(_plan_that_raises, 3, directory, (), 120, "spawn", "planning that raises")
        results = [Path(directory, f"r.{rank}").read_text() for rank in range(3)]
    assert results == ["zero-bubble: planning failed on rank 0: ValueError: a planner bug, seen with 3 ranks' facts"] * 3


def _run_program(rank: int, world_size: int, directory: str, early: bool, strict: bool) -> None:
    """Run this rank's program of interleaved 1F1B (p=3, 2 chunks) with one-element messages and no compute: the
    lowering's (batched, warmed up, on the pipeline group) or the early-posting one the runtime used to run."""
    from megatron.zero_bubble.runtime.p2p import TorchP2P
    from megatron.zero_bubble.schedules.comm import Batch, Send, Warmup, consumed, lower, produced
    from megatron.zero_bubble.schedules.ops import facts
    from megatron.zero_bubble.schedules.planners import PlanRequest, plan
    from megatron.zero_bubble.schedules.schedule import Pass
    from megatron.zero_bubble.tools.strict_p2p import StrictP2P
    from tests.test_nccl_model import early_posting

    init_group("gloo", rank, world_size, directory)
    schedule = plan("interleaved-1f1b", PlanRequest(stages=3, microbatches=3, chunks=2, ilp_time_limit=0))
    programs = early_posting(lower(schedule)) if early else lower(schedule)
    names = sorted({item.group for program in programs for item in program if type(item) is Batch})
    groups = {name: dist.group.WORLD if name == "pipeline" else
              dist.new_group([int(r) for r in name.split()[-1].split("-")]) for name in names}  # every rank, in order
    ops = StrictP2P(timeout_s=5.0) if strict else TorchP2P()
    works = {}
    try:
        for item in programs[rank]:
            if type(item) is Warmup:
                ops.batch([(s, torch.zeros(1), q) for q in item.peers for s in (True, False)], groups[item.group]).wait()
            elif type(item) is Batch:
                work = ops.batch([(type(post) is Send, torch.zeros(1), post.msg.dst if type(post) is Send else
                                   post.msg.src) for post in item.ops], groups[item.group])
                works.update({post.msg: work for post in item.ops})
            else:
                frees = facts(item.op).frees_output_of
                for msg in (consumed(schedule, rank, item),
                            frees and produced(schedule, rank, Pass(frees, item.mb, item.chunk))):
                    if msg:
                        works[msg].wait()
        for work in works.values():
            work.wait()
        result = "done"
    except RuntimeError as error:
        result = f"failed: {error}"
    Path(directory, f"r.{rank}").write_text(result)
    if result != "done":  # a stuck stream stays in gloo's receive, on purpose: once every rank has its result
        while len(list(Path(directory).glob("r.*"))) < world_size:
            time.sleep(0.05)
        os._exit(0)
    if strict:
        ops.close()
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("early, strict", [(False, True), (True, True), (True, False)],
                         ids=("batched-strict", "early-strict", "early-gloo"))
def test_the_early_posting_programs_are_stuck_on_the_strict_transport_where_gloo_forgives_them(early, strict):
    """The programs the runtime used to run start rank 0 with a receive on the ring link to rank 2, each rank's first
    post going to the rank before it: on the stand-in of NCCL that is a cycle of first uses, stuck; gloo runs it.
    The lowering's programs (a warm-up first, then batches) run to their end on the stand-in."""
    with tempfile.TemporaryDirectory() as directory:
        run_ranks(_run_program, 3, directory, (early, strict), 120, "spawn", "the programs")
        results = [Path(directory, f"r.{rank}").read_text() for rank in range(3)]
    if early and strict:
        assert all(r.startswith("failed: strict p2p: the first use of") for r in results), results
    else:
        assert results == ["done"] * 3, results
