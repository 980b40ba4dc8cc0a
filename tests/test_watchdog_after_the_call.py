"""The pipeline watchdog after a forward-backward call returns, on a backend whose waits do not block the host
(NCCL: a wait orders the compute stream after the batch, and the host goes on to megatron's optimizer step, which
blocks on the gradient norm). A batch the call waited for stays in the watchdog's view until the backend reports it
complete, so a message the last passes need that never comes is still reported.

The operations here are a test double of NCCL's as the watchdog sees them (labelled: `NcclLikeOps`): waits return at
once, completion is reported per batch and only when the test says so."""
from __future__ import annotations

import types

import pytest
import torch

from megatron.zero_bubble.runtime.p2p import PipelineTransport
from megatron.zero_bubble.runtime.watchdog import PipelineWatchdog
from megatron.zero_bubble.schedules.comm import Batch, Message, Recv


class NcclLikeWork:
    """TEST DOUBLE of an NCCL batch's work: wait() orders a stream and returns; is_completed() only once done."""

    def __init__(self):
        self.done = False

    def wait(self) -> bool:
        return True

    def is_completed(self) -> bool:
        return self.done


class NcclLikeOps:
    reports_completion = True

    def __init__(self):
        self.works = []

    def batch(self, posts, group):
        self.works.append(NcclLikeWork())
        return self.works[-1]


def test_a_receive_the_last_pass_waited_for_stays_watched_after_the_call_until_it_completes(one_rank_gloo):
    ops, now = NcclLikeOps(), [0.0]
    links = types.SimpleNamespace(group=one_rank_gloo, rank=0, global_rank=lambda stage_rank: 0)
    transport = PipelineTransport(links, (4, 2), torch.float32, torch.device("cpu"), ops=ops, clock=lambda: now[0])
    grad = Message("grad", 3, 1, 0, 1, 0)  # the gradient of microbatch 3, from stage 1 to stage 0
    transport.post_batch(Batch([Recv(grad)]), outgoing=None)
    transport.wait_recv(grad)  # B of microbatch 3 takes it: on NCCL the stream waits, the host goes on
    transport.finish()  # the end of the call
    assert [p.msg for p in transport.in_flight()] == [grad] and transport.in_flight()[0].tensor is None
    lines = []
    watchdog = PipelineWatchdog(timeout_s=10.0, rank=0, pp_rank=0, log=lines.append, end=pytest.fail,
                                clock=lambda: now[0])
    watchdog.watch(transport)  # the executor leaves it on the call's transport until the next call
    watchdog.close()  # its thread is not needed: poll() is what the thread calls
    now[0] = 11.0
    line = watchdog.poll()
    assert line is not None and line.startswith("zero-bubble: pipeline watchdog: rank 0 of the pipeline (global rank "
                                                "0) has waited 11 s for the gradient of microbatch 3")
    ops.works[0].done = True
    assert transport.in_flight() == [] and watchdog.poll() is None
