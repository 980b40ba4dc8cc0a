"""The model state in the runtime's memory report (runtime/memory_probe.py, runtime/memory_report.py), in one process:
what the probe counts as a call starts on the CPU, and how the record and its log line put it next to the
activations. The whole report against a training run: tests/megatron/test_memory_as_planned.py and
tests/megatron/test_advise_measured.py (slow), benchmarks/advise_memory.py."""
from __future__ import annotations

import torch

from megatron.zero_bubble.runtime.memory_probe import MemoryProbe, live_tensor_bytes
from megatron.zero_bubble.runtime.memory_report import describe_memory_per_device, memory_record
from megatron.zero_bubble.schedules.costs import Costs
from megatron.zero_bubble.schedules.planners import PlanRequest, plan

MIB = 2**20


def test_live_tensors_are_counted_once_per_storage():
    before = live_tensor_bytes(torch.device("cpu"))
    weights = torch.zeros(MIB // 4)  # 1 MiB of fp32
    views = [weights[: MIB // 8], weights.view(256, -1), weights[1:]]  # share its storage
    grown = live_tensor_bytes(torch.device("cpu")) - before
    assert grown == MIB and len(views) == 3


def test_a_calls_model_state_is_what_is_alive_as_it_starts():
    probe = MemoryProbe(torch.device("cpu"), read=lambda: 0, source="a given reader")
    probe.start()
    first = probe.held.model_state
    state = torch.ones(3 * MIB // 4)  # 3 MiB that a later call finds in place (an optimizer's moments, say)
    probe.start()
    assert probe.held.model_state - first == 3 * MIB and state.numel()


def _report(pp_rank: int, state: int | None, held: int) -> dict:
    return {"pp_rank": pp_rank, "held_peak_bytes": held, "held_in_passes_bytes": None, "held_source": "test",
            "model_state_bytes": state, "pipeline_tensor_bytes": 1024, "outputs_freed_when_sent": True}


def test_the_record_adds_each_ranks_model_state_to_its_activation_peak():
    schedule = plan("1f1b", PlanRequest(stages=2, microbatches=4, ilp_time_limit=0))
    costs = Costs.make(2, m_f=[MIB, MIB], memory_unit="bytes")
    reports = [_report(0, 10 * MIB, 4 * MIB), _report(0, 11 * MIB, 3 * MIB), _report(1, 9 * MIB, 2 * MIB)]
    record = memory_record(schedule, costs, reports, None, iteration=3)
    # the largest over each pipeline rank's data-parallel replicas, for the state and the activations alike
    assert record["model_state_bytes"] == [11 * MIB, 9 * MIB]
    assert record["measured_bytes"] == [4 * MIB, 2 * MIB]
    assert record["peak_bytes"] == [14 * MIB, 11 * MIB]  # each device's sum, not the two largest parts
    assert describe_memory_per_device(record) == (
        "zero-bubble: memory per device in iteration 3: model state (weights, gradient buffers, optimizer state, "
        "megatron's buffers: the tensors alive as the call starts) 11, 9 MiB, peak with the activations 14, 11 MiB")
    unmeasured = memory_record(schedule, costs, [_report(0, None, MIB), _report(1, None, MIB)], None, iteration=3)
    assert unmeasured["model_state_bytes"] == [None, None] and unmeasured["peak_bytes"] == [None, None]
