"""A message the last passes need that never comes, on the strict stand-in of NCCL with NCCL's own wait.

On NCCL a wait orders the GPU's stream after the batch and the host goes on: out of the forward-backward call and into
megatron's optimizer step, where it blocks reading the gradient norm. The watchdog must still name the message there,
and with `--zero-bubble-watchdog-abort` dump the flight recorder and end the job with exit code 3, also when the dump
fails. Two ranks (PP=2, zb-h1, four microbatches) run the real lowering, iteration, transport and watchdog over
`StrictP2P(host_waits=False)` (tools/strict_p2p.py: waits return at once, `synchronize()` is the optimizer step's
read); their passes are the rehearsal's timed waits, which never read what they receive. Rank 1 never posts its last
gradient send (runtime/faults.py `lost-message`), which rank 0's B of microbatch 3 needs.
"""
from __future__ import annotations

import multiprocessing
import os
import re
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # starts processes

WATCHDOG_S, STAND_IN_TIMEOUT_S = 1.0, 3.0
LINE = re.compile(r"zero-bubble: pipeline watchdog: rank 0 of the pipeline \(global rank 0\) has waited \d+ s for the "
                  r"gradient of microbatch 3 from stage 1 to stage 0 from rank 1, which B of microbatch 3 needs")


def _rank(rank: int, directory: str, abort: bool, dump_prefix: str | None) -> None:
    import torch
    import torch.distributed as dist

    from megatron.zero_bubble.runtime.faults import Fault, Faults
    from megatron.zero_bubble.runtime.iteration import Iteration, LoweredRun
    from megatron.zero_bubble.runtime.links import PipelineLinks
    from megatron.zero_bubble.runtime.p2p import PipelineTransport
    from megatron.zero_bubble.runtime.watchdog import PipelineWatchdog
    from megatron.zero_bubble.runtime.wgrad_store import WeightGradStore
    from megatron.zero_bubble.schedules.costs import Costs
    from megatron.zero_bubble.schedules.planners import plan
    from megatron.zero_bubble.schedules.problem import PlanRequest
    from megatron.zero_bubble.tools.local_ranks import init_group
    from megatron.zero_bubble.tools.rehearsal import RehearsalPasses
    from megatron.zero_bubble.tools.strict_p2p import StrictP2P

    if dump_prefix is not None:
        os.environ["TORCH_FR_DUMP_TEMP_FILE"] = dump_prefix  # what megatron sets from --flight-recorder-dump-path
    torch.set_num_threads(1)
    log = open(os.path.join(directory, f"rank{rank}.log"), "w", buffering=1)
    init_group("gloo", rank, 2, directory)
    schedule = plan("zb-h1", PlanRequest(stages=2, microbatches=4, ilp_time_limit=0))
    lowered = LoweredRun.of(schedule)
    ops = StrictP2P(STAND_IN_TIMEOUT_S, host_waits=False)
    transport = PipelineTransport(PipelineLinks(dist.group.WORLD), (16,), torch.float32, torch.device("cpu"), ops=ops)
    watchdog = PipelineWatchdog(WATCHDOG_S, rank, rank, store=dist.distributed_c10d._get_default_store(), abort=abort,
                                log=lambda line: print(line, file=log))
    watchdog.watch(transport, lowered.consumers(rank).get)  # as runtime/messaging.py points it
    compute = RehearsalPasses(Costs.make(2), 1e-3, torch.zeros(16), None, None, lambda chunk: rank)
    iteration = Iteration(schedule=lowered.schedule, rank=rank, compute=compute, transport=transport,
                          stores=[WeightGradStore()], faults=Faults((Fault("lost-message", 1),), rank))
    iteration.run(lowered.programs[rank])
    print("the call returned", file=log)
    try:
        ops.synchronize()  # megatron's optimizer step: the gradient norm's .item() waits for the GPU
        print("synchronized", file=log)
    except RuntimeError as error:
        print(f"the step failed: {error}", file=log)
    if rank == 1:  # the peer stays until rank 0 is done: a peer that leaves would fail rank 0's receive
        deadline = time.monotonic() + 60
        while not os.path.exists(os.path.join(directory, "rank0.ended")) and time.monotonic() < deadline:
            time.sleep(0.05)
    log.close()
    os._exit(0)  # no teardown with a peer that may be gone


def _run(tmp_path: Path, abort: bool, dump_prefix: str | None = None) -> tuple[int, list[str]]:
    context = multiprocessing.get_context("fork")
    ranks = [context.Process(target=_rank, args=(rank, str(tmp_path), abort, dump_prefix)) for rank in range(2)]
    for process in ranks:
        process.start()
    try:
        ranks[0].join(timeout=90)
        (tmp_path / "rank0.ended").touch()
        ranks[1].join(timeout=30)
    finally:
        for process in ranks:
            if process.is_alive():
                process.kill()
    return ranks[0].exitcode, (tmp_path / "rank0.log").read_text().splitlines()


def test_the_watchdog_names_a_late_lost_message_after_the_call_returned(tmp_path):
    """The host leaves the call (no wait blocked it) and blocks in the step; the watchdog's line comes there, once."""
    exitcode, lines = _run(tmp_path, abort=False)
    assert exitcode == 0 and lines[0] == "the call returned", lines
    reported = [line for line in lines if line.startswith("zero-bubble: pipeline watchdog")]
    assert len(reported) == 1 and LINE.match(reported[0]), lines
    assert lines.index(reported[0]) == 1 and lines[-1].startswith("the step failed: strict p2p: the batch of receive "
                                                                  "from rank 1 did not complete"), lines


@pytest.mark.parametrize("dump", ["written", "fails"])
def test_with_abort_the_watchdog_dumps_and_ends_the_job_with_exit_code_3_also_when_the_dump_fails(tmp_path, dump):
    """--zero-bubble-watchdog-abort: the flight recorder written where megatron points it, or a line saying it could
    not be (a path that does not exist), and the exit either way."""
    prefix = str(tmp_path / "fr_") if dump == "written" else str(tmp_path / "missing" / "fr_")
    exitcode, lines = _run(tmp_path, abort=True, dump_prefix=prefix)
    assert exitcode == 3, lines
    assert lines[0] == "the call returned" and LINE.match(lines[1]), lines
    if dump == "written":
        assert lines[2] == f"zero-bubble: pipeline watchdog: rank 0 wrote the flight recorder to {prefix}0", lines
        assert Path(f"{prefix}0").stat().st_size > 0
    else:
        assert lines[2].startswith("zero-bubble: pipeline watchdog: rank 0 could not write the flight recorder "
                                   "(FileNotFoundError"), lines
    assert not any(line.startswith(("synchronized", "the step failed")) for line in lines), lines
