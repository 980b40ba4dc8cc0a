"""Runs that go wrong stop cleanly: faults injected through pretrain_gpt.py (--zero-bubble-inject-fault), each a
torchrun launch on CPU that must end, with one line per rank and no hang; and the strict stand-in of NCCL's
point-to-point, which must refuse what NCCL refuses where gloo forgives it."""
from __future__ import annotations

import json
import os
import re
import subprocess
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


@pytest.mark.slow
def test_a_lost_message_stops_every_rank_with_a_line_saying_what_it_waits_for():
    """Rank 1 never posts its last gradient send (PP=2): rank 0 waits for it until its watchdog fires; every rank
    then prints where it stands (rank 1 waits for no message: it is in megatron's step) and the job ends non-zero,
    well before NCCL's or gloo's own timeouts."""
    done, seconds = _launch(2, ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zb-h1",
                                "--train-iters", "3", "--zero-bubble-inject-fault", "lost-message:1",
                                "--zero-bubble-watchdog-timeout", "5"])
    assert done.returncode != 0, done.stdout[-2000:] + done.stderr[-3000:]
    lines = [line for line in done.stderr.splitlines() if "zero-bubble: pipeline watchdog" in line]
    assert sorted(int(WATCHDOG_LINE.search(line).group(2)) for line in lines) == [0, 1], done.stderr[-4000:]
    first = next(line for line in lines if "(global rank 0)" in line)
    assert first.startswith("zero-bubble: pipeline watchdog: rank 0 of the pipeline (global rank 0) has waited 5 s for "
                            "the gradient of microbatch 3 from stage 1 to stage 0 from rank 1, which B of microbatch 3 "
                            "needs; heads of its links: with rank 1: the receive of the gradient of microbatch 3"), first
    assert all("waits for no pipeline message" in line for line in lines if line is not first)
    assert seconds < 120 and "iteration        1/" not in done.stdout  # no iteration completed


@pytest.mark.slow
def test_a_split_check_difference_on_one_tensor_parallel_rank_stops_every_rank_in_seconds_with_one_line():
    """TP=2 x PP=2: only global rank 1 sees a difference. Its tensor-parallel peer must take the same branch (the
    re-runs that measure noise, the stop), or the two would issue different collectives and hang."""
    done, seconds = _launch(4, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                                "--pipeline-schedule", "zb-h1", "--train-iters", "2",
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
    done, _ = _launch(3, ["--pipeline-model-parallel-size", "3", "--num-layers", "6", "--enable-zero-bubble",
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
    from megatron.zero_bubble.runtime.strict_p2p import StrictP2P

    init_group("gloo", rank, world_size, directory)
    ops = StrictP2P(timeout_s=3.0) if strict else TorchP2P()
    pair = dist.new_group([0, 1])
    peer = 1 - rank
    inbox, outbox = torch.zeros(4), torch.full((4,), float(rank))
    try:  # both ranks post their receive first, then their send: NCCL's in-order stream never gets to the send
        works = [ops.irecv(inbox, peer, pair), ops.isend(outbox, peer, pair)]
        for work in works:
            work.wait()
        result = ("done", inbox.tolist())
    except RuntimeError as error:
        result = ("failed", str(error))
    Path(directory, f"r.{rank}").write_text(json.dumps(result))
    if strict:
        os._exit(0)  # its streams stay stuck in gloo's receive, on purpose
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
