"""Measured against planned, at the end of a timer window: what each rank held between passes, next to the model.

Every rank adds what its memory probe read in the last profiled iteration to its profiler report
(`Profiler.record_memory`); rank 0, re-planning, turns the gathered reports into a `memory_record`: per pipeline
rank the most held after a pass (the largest over data-parallel replicas), the planner's prediction for the
schedule that ran (schedules/held_memory.py: its order on the measured M_B and M_W, plus the pipeline tensors
its program keeps) and its activations alone, and the prediction for the re-planned schedule. The record goes
into the re-planned schedule's JSON (info["memory"]); `describe_memory` is the log line. The record also has each
rank's model state (the tensors alive as the call started: weights, gradient buffers, optimizer state, megatron's
buffers; memory_probe.py) and its peak, the model state plus the most held after a pass
(`describe_memory_per_device`): what `zb-schedule advise` predicts per GPU. The first iteration under the re-planned
schedule reads the allocator too, and rank 0 says what it held against that prediction (`describe_replanned_memory`).
"""
from __future__ import annotations

from ..schedules.costs import Costs
from ..schedules.held_memory import held_memory_profile
from ..schedules.memory import memory_profile
from ..schedules.schedule import Schedule

MIB = 2**20


def _peaks(profiles: list[list[float]]) -> list[float]:
    return [max(profile, default=0.0) for profile in profiles]


def _per_pipeline_rank(reports: list[dict], key: str, stages: int) -> list[float | None]:
    """The largest figure over each pipeline rank's replicas (None where no replica measured it)."""
    figures = []
    for rank in range(stages):
        values = [r[key] for r in reports if r["pp_rank"] == rank and r.get(key) is not None]
        figures.append(max(values) if values else None)
    return figures


def memory_record(ran: Schedule, costs: Costs, reports: list[dict], replanned: Schedule | None,
                  iteration: int) -> dict | None:
    """The comparison for the schedule that ran (None if the reports carry no memory figures); `costs` are the
    measured ones (bytes), `iteration` is megatron's logged number of the iteration measured."""
    if not reports or "held_peak_bytes" not in reports[0] or costs.memory_unit != "bytes":
        return None
    tensor_bytes = max(r["pipeline_tensor_bytes"] for r in reports)
    freed = all(r["outputs_freed_when_sent"] for r in reports)
    sources = sorted({r["held_source"] for r in reports})
    record = {
        "iteration": iteration,
        "schedule": ran.name,
        "source": "; ".join(sources),
        "measured_bytes": _per_pipeline_rank(reports, "held_peak_bytes", ran.stages),
        "measured_in_passes_bytes": _per_pipeline_rank(reports, "held_in_passes_bytes", ran.stages),
        "planned_bytes": _peaks(held_memory_profile(ran, costs, tensor_bytes, outputs_freed_when_sent=freed)),
        "planned_activation_bytes": _peaks(memory_profile(ran, costs)),
        "pipeline_tensor_bytes": tensor_bytes,
        "outputs_freed_when_sent": freed,
        "replanned_bytes": None,
    }
    record["model_state_bytes"] = _per_pipeline_rank(reports, "model_state_bytes", ran.stages)
    devices = [dict(r, peak_bytes=r["model_state_bytes"] + r["held_peak_bytes"]) for r in reports
               if r.get("model_state_bytes") is not None and r["held_peak_bytes"] is not None]
    record["peak_bytes"] = _per_pipeline_rank(devices, "peak_bytes", ran.stages)  # each device's, then the largest
    if replanned is not None:
        record["replanned_bytes"] = _peaks(held_memory_profile(replanned, costs, tensor_bytes,
                                                               outputs_freed_when_sent=freed))
    return record


def describe_memory_per_device(record: dict) -> str:
    """One log line: each rank's model state and its peak with the activations (see the module docstring)."""
    return (f"zero-bubble: memory per device in iteration {record['iteration']}: model state (weights, gradient "
            f"buffers, optimizer state, megatron's buffers: the tensors alive as the call starts) "
            f"{_mib(record['model_state_bytes'])}, peak with the activations {_mib(record['peak_bytes'])}")


def _mib(values) -> str:
    return ", ".join("-" if v is None else f"{v / MIB:.3g}" for v in values) + " MiB"


def describe_replanned_memory(iteration: int, measured: list, planned: list) -> str:
    """One log line: what each pipeline rank held in the first iteration under the re-planned schedule, against the
    re-plan's prediction (pipeline tensors included)."""
    return (f"zero-bubble: activation memory per rank in iteration {iteration}, the first under the re-planned "
            f"schedule: measured {_mib(measured)}, planned {_mib(planned)}")


def describe_memory(record: dict) -> str:
    """One log line: measured and planned peaks per pipeline rank."""
    planned = f"planned {_mib(record['planned_bytes'])}"
    if all(v is None for v in record["measured_bytes"]):
        measured = f"{record['source']}; "
    else:
        measured = (f"measured {_mib(record['measured_bytes'])} ({record['source']}, after each pass, above the "
                    f"call's start), ")
    line = (f"zero-bubble: activation memory per rank in iteration {record['iteration']}: {measured}{planned} "
            f"({record['schedule']} on the measured M_B and M_W, pipeline tensors included)")
    if any(v is not None for v in record["measured_in_passes_bytes"]):
        line += f"; peak inside passes {_mib(record['measured_in_passes_bytes'])}"
    if record["replanned_bytes"] is not None:
        line += f"; the re-planned schedule: planned {_mib(record['replanned_bytes'])}"
    return line
