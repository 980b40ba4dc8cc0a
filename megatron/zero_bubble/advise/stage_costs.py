"""The planner's costs for one layout of a run: T_F, T_B, T_W and M_F, M_W per virtual stage, and T_comm.

From the model (`model_costs`): times from the paper's per-layer FLOP counts, generalised to grouped queries,
any FFN size, SwiGLU and experts: per token a layer's F does 2 FLOPs per weight of the linear layers it passes
through (attention's QKV and projection, the MLP, or the router and k experts plus the shared experts) and 4 s x
(heads x head size) for attention's two products; B does the linear part again and attention's twice, W the linear
part (F = Lin + Att, B = Lin + 2 Att, W = Lin; the paper's sbh(24h + 4s), sbh(24h + 8s), 24sbh^2 for a GPT layer,
which Costs.from_model computes). The LM head adds 2 s b h V to each on the last stage; recomputed layers add
their F to B. Memory from activations.py. Default throughput and link as Costs.from_model's (the paper's A100).

From a profile (`profiled_costs`): a schedule JSON dumped by a profiled pretrain_gpt.py run (its "costs", measured
per virtual stage of that run's layout) spread per layer over the stages without the LM head, the last stage's
excess kept as the head's: so the same measurements serve any layout of the same model.
"""
from __future__ import annotations

import glob
import json
import os
import re
from dataclasses import dataclass

from ..schedules.costs import Costs
from .activations import head_saved, pipeline_tensor_bytes, row_parallel_wgrad, stage_saved
from .run import Run

FLOPS_PER_SECOND = 125e12  # as Costs.from_model: the paper's profiled 1.5B model on A100
LINK_BYTES_PER_SECOND = 25e9
_EMPTY_STAGE = 0.01  # a stage without layers is planned as 1% of one (as Costs.from_model)


def _linear_weights(run: Run, layer: int) -> float:
    """Weights of the linear layers one token passes through in `layer`, per GPU (biases and norms left out)."""
    m, layout = run.model, run.layout
    kv = m.kv_channels
    attention = (m.hidden * (m.heads + 2 * m.query_groups) * kv + m.heads * kv * m.hidden) / layout.tp

    def mlp(ffn: int, tp: int) -> float:
        return m.hidden * ffn * (3 if m.swiglu else 2) / tp

    if not m.is_moe_layer(layer):
        return attention + mlp(m.ffn_hidden, layout.tp)
    moe = m.moe
    routed = moe.topk * mlp(moe.ffn_hidden, layout.etp) + moe.experts * m.hidden
    return attention + routed + (mlp(moe.shared_ffn_hidden, layout.tp) if moe.shared_ffn_hidden else 0)


@dataclass(frozen=True)
class _Flops:
    f: float
    b: float
    w: float

    def __add__(self, other: "_Flops") -> "_Flops":
        return _Flops(self.f + other.f, self.b + other.b, self.w + other.w)


def layer_flops(run: Run, layer: int) -> _Flops:
    m, layout = run.model, run.layout
    tokens = m.seq_length // layout.cp * layout.micro_batch
    linear = 2 * _linear_weights(run, layer) * tokens
    attention = 4 * m.seq_length * m.heads * m.kv_channels / layout.tp * tokens
    recomputed = 0.0
    if run.recompute.granularity == "full":
        recomputed = linear + attention
    elif "core_attn" in run.recompute.modules:
        recomputed = attention
    return _Flops(linear + attention, linear + 2 * attention + recomputed, linear)


def row_parallel_flops(run: Run, layer: int) -> float:
    """W's FLOPs of a layer's row-parallel layers (attention's output projection, a dense MLP's second layer)."""
    m, layout = run.model, run.layout
    tokens = m.seq_length // layout.cp * layout.micro_batch
    weights = m.heads * m.kv_channels * m.hidden + (0 if m.is_moe_layer(layer) else m.ffn_hidden * m.hidden)
    return 2 * weights / layout.tp * tokens


def head_flops(run: Run) -> _Flops:
    m, layout = run.model, run.layout
    flops = 2 * m.seq_length // layout.cp * layout.micro_batch * m.hidden * m.vocab / layout.tp
    return _Flops(flops, flops, flops)


def model_costs(run: Run, counts: list[int], flops_per_second: float = FLOPS_PER_SECOND,
                link_bytes_per_second: float = LINK_BYTES_PER_SECOND) -> Costs:
    """Costs in ms and bytes for virtual stages holding `counts` layers each (virtual-stage order)."""
    per_ms = flops_per_second / 1e3
    times, row_t_w, row_m_w, first = [], [], [], 0
    for v, count in enumerate(counts):
        flops = _Flops(0.0, 0.0, 0.0)
        for layer in range(first, first + count):
            flops += layer_flops(run, layer)
        row_t_w.append(sum(row_parallel_flops(run, layer) for layer in range(first, first + count)) / per_ms)
        row_m_w.append(sum(row_parallel_wgrad(run, layer) for layer in range(first, first + count)))
        if count == 0:
            one = layer_flops(run, min(first, run.model.layers - 1))
            flops = _Flops(_EMPTY_STAGE * one.f, _EMPTY_STAGE * one.b, _EMPTY_STAGE * one.w)
        if v == len(counts) - 1:
            flops += head_flops(run)
        times.append(flops)
        first += count
    saved = stage_saved(run, counts)
    return Costs(t_f=tuple(t.f / per_ms for t in times), t_b=tuple(t.b / per_ms for t in times),
                 t_w=tuple(t.w / per_ms for t in times), m_f=tuple(s.forward for s in saved),
                 m_w=tuple(s.wgrad for s in saved),
                 t_comm=pipeline_tensor_bytes(run) / link_bytes_per_second * 1e3, memory_unit="bytes",
                 time_unit="ms", head_t_w=head_flops(run).w / per_ms, head_m_w=head_saved(run).wgrad,
                 row_t_w=tuple(row_t_w), row_m_w=tuple(row_m_w))


# ---------------------------------------------------------------- profiled costs


@dataclass(frozen=True)
class Profile:
    """Measured costs per layer and of the LM head, from one profiled run."""

    source: str  # the file
    per_layer: dict  # {"t_f", "t_b", "t_w", "m_f", "m_w"} of one layer
    head: dict  # what the last stage has beyond its layers
    t_comm: float
    time_unit: str

    def costs(self, counts: list[int]) -> Costs:
        fields = {}
        for name, value in self.per_layer.items():
            fields[name] = tuple(max(count, _EMPTY_STAGE) * value + (self.head[name] if v == len(counts) - 1 else 0)
                                 for v, count in enumerate(counts))
        # the last stage's excess over its layers is the head's: its W time and what its W keeps are known parts
        return Costs(**fields, t_comm=self.t_comm, memory_unit="bytes", time_unit=self.time_unit,
                     head_t_w=self.head["t_w"], head_m_w=self.head["m_w"])


def _replanned_iteration(path: str) -> int:
    match = re.search(r"-iter(\d+)\.json$", path)
    return int(match.group(1)) if match else -1


def find_profile(directory: str) -> str:
    """The newest schedule JSON in `directory` whose costs were measured (pretrain_gpt.py writes one after its
    timer window, NAME-mM-iterN.json; the initial one carries estimated costs)."""
    if not os.path.isdir(directory):
        raise ValueError(f"--profile {directory}: no such directory")
    measured = []
    for path in glob.glob(os.path.join(directory, "*.json")):
        if path.endswith(".trace.json"):
            continue
        with open(path) as f:
            info = json.load(f)
        if str(info.get("costs_from", "")).startswith("measured") and "costs" in info:
            measured.append(path)
    if not measured:
        raise ValueError(f"--profile {directory}: no schedule JSON with measured costs (pretrain_gpt.py writes one "
                         f"with --zero-bubble-dump-schedule DIR after its timer window)")
    return max(measured, key=lambda path: (_replanned_iteration(path), path))


def load_profile(run: Run, path: str) -> Profile:
    """The profile in `path` as per-layer costs for `run` (whose layer placement gives the profiled stages'
    layer counts)."""
    with open(path) as f:
        info = json.load(f)
    stages, chunks = int(info["stages"]), int(info["chunks"])
    if stages != run.layout.pp:
        raise ValueError(f"--profile {path}: a run with {stages} pipeline stages, the command line has "
                         f"--pipeline-model-parallel-size {run.layout.pp}")
    costs = Costs.from_dict(info["costs"])
    if costs.memory_unit != "bytes":
        raise ValueError(f"--profile {path}: its costs carry no bytes (memory unit {costs.memory_unit!r})")
    counts = run.layout.placement.counts(stages, chunks)
    if counts is None:
        raise ValueError(f"--profile {path}: the command line's layers do not lay out over its {stages * chunks} "
                         f"virtual stages")
    body = range(len(counts) - 1)  # the stages without the LM head (the embedding's cost is small)
    layers = sum(counts[v] for v in body)
    per_layer, head = {}, {}
    for name in ("t_f", "t_b", "t_w", "m_f", "m_w"):
        values = getattr(costs, name)
        per_layer[name] = sum(values[v] for v in body) / layers if layers else values[-1] / max(counts[-1], 1)
        head[name] = max(0.0, values[-1] - counts[-1] * per_layer[name])
    return Profile(source=path, per_layer=per_layer, head=head, t_comm=costs.t_comm, time_unit=costs.time_unit)
