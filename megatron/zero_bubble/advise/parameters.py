"""The model state on one GPU: weights, gradients and optimizer state, from the parameters its pipeline rank holds.

Parameters are counted per GPU of a pipeline stage, as megatron-core shards them: attention and MLP weights over
tensor parallelism (the row-parallel biases and the norms whole), the vocabulary over tensor parallelism, experts
over expert parallelism (E/EP experts per GPU) and expert tensor parallelism. Dense parameters are replicated over
the data-parallel GPUs (with context parallelism: DP x CP of them), expert parameters over the expert data-parallel
ones; the distributed optimizer shards the optimizer state (and the fp32 main weights) over those replicas, not
the weights or megatron DDP's gradient buffer.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..schedules.schedule import stage_owner
from .run import DTYPE_BYTES, ModelShape, ParallelLayout, Run, Tally


@dataclass(frozen=True)
class ParamCount(Tally):
    """Parameters one GPU holds: `dense` ones replicated over data parallelism, `expert` ones over expert data
    parallelism."""

    dense: float = 0.0
    expert: float = 0.0

    @property
    def total(self) -> float:
        return self.dense + self.expert


def _norm(model: ModelShape, width: int) -> int:
    return width * (1 if model.normalization == "RMSNorm" else 2)  # LayerNorm has a bias


def _mlp(model: ModelShape, ffn: int, tp: int) -> float:
    """One MLP's weights and biases per GPU: fc1 column-parallel (two halves with SwiGLU), fc2 row-parallel."""
    fc1_out = ffn * (2 if model.swiglu else 1)
    weights = (model.hidden * fc1_out + ffn * model.hidden) / tp
    biases = fc1_out / tp + model.hidden if model.linear_bias else 0
    return weights + biases


def attention_params(model: ModelShape, tp: int) -> float:
    kv, h = model.kv_channels, model.hidden
    qkv_out = (model.heads + 2 * model.query_groups) * kv
    count = (h * qkv_out + model.heads * kv * h) / tp
    count += qkv_out / tp if model.qkv_bias else 0
    count += h if model.linear_bias else 0  # the output projection's bias, whole on every GPU
    count += 2 * _norm(model, h)  # the norms before attention and before the MLP
    if model.qk_layernorm:
        count += 2 * _norm(model, kv)
    return count


def layer_params(model: ModelShape, layout: ParallelLayout, layer: int) -> ParamCount:
    """One transformer layer on one GPU of its stage."""
    dense = attention_params(model, layout.tp)
    if not model.is_moe_layer(layer):
        return ParamCount(dense + _mlp(model, model.ffn_hidden, layout.tp))
    moe = model.moe
    dense += moe.experts * model.hidden  # the router, whole on every GPU
    if moe.shared_ffn_hidden:
        dense += _mlp(model, moe.shared_ffn_hidden, layout.tp) + (model.hidden if moe.shared_expert_gate else 0)
    experts = moe.experts // layout.ep * _mlp(model, moe.ffn_hidden, layout.etp)
    return ParamCount(dense, experts)


def embedding_params(model: ModelShape, layout: ParallelLayout) -> ParamCount:
    count = model.vocab * model.hidden / layout.tp
    if model.position_embedding == "learned_absolute":
        count += model.max_position_embeddings * model.hidden
    return ParamCount(count)


def head_params(model: ModelShape, layout: ParallelLayout, virtual_stages: int) -> ParamCount:
    """The final norm and the output layer; with tied embeddings the last stage keeps its own copy of the word
    embeddings unless the first stage is the same model chunk (a single stage)."""
    output = model.vocab * model.hidden / layout.tp
    if model.tied_embeddings and virtual_stages == 1:
        output = 0.0
    return ParamCount(_norm(model, model.hidden) + output)


def virtual_stage_params(run: Run, counts: list[int]) -> list[ParamCount]:
    """Parameters of each virtual stage (per GPU), for the layer counts of a layout (virtual-stage order)."""
    model, layout = run.model, run.layout
    stages, first = [], 0
    for v, count in enumerate(counts):
        total = ParamCount()
        for layer in range(first, first + count):
            total += layer_params(model, layout, layer)
        if v == 0:
            total += embedding_params(model, layout)
        if v == len(counts) - 1:
            total += head_params(model, layout, len(counts))
        stages.append(total)
        first += count
    return stages


def rank_params(run: Run, counts: list[int], layout_name: str) -> list[ParamCount]:
    """Parameters per pipeline rank under a layout ("single", "interleaved", "v") of these virtual stages."""
    stages = run.layout.pp
    ranks = [ParamCount() for _ in range(stages)]
    for v, params in enumerate(virtual_stage_params(run, counts)):
        ranks[stage_owner(layout_name, stages, v)[0]] += params
    return ranks


@dataclass(frozen=True)
class ModelState:
    """Bytes one GPU holds for the whole iteration."""

    weights: float
    gradients: float  # megatron DDP's gradient buffer
    optimizer: float  # main (fp32) weights and the optimizer's moments, sharded by the distributed optimizer
    buffers: float = 0.0  # unfused attention's score buffer; the input batch on the first and last stage

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.buffers


def optimizer_bytes_per_param(run: Run) -> float:
    """State bytes per parameter before any sharding: main weights (16-bit training) and the moments."""
    n = run.numerics
    state = DTYPE_BYTES[n.main_params] if n.main_params else 0
    if n.optimizer == "adam":
        state += DTYPE_BYTES[n.exp_avg] + DTYPE_BYTES[n.exp_avg_sq]
    elif n.sgd_momentum:
        state += 4
    return state


def ends_per_rank(run: Run, counts: list[int], layout_name: str) -> list[tuple[bool, bool]]:
    """Per pipeline rank: (holds the first virtual stage, holds the last)."""
    last = len(counts) - 1
    first_rank = stage_owner(layout_name, run.layout.pp, 0)[0]
    last_rank = stage_owner(layout_name, run.layout.pp, last)[0]
    return [(first_rank == rank, last_rank == rank) for rank in range(run.layout.pp)]


def model_state(run: Run, params: ParamCount, first: bool = False, last: bool = False) -> ModelState:
    """The model state of a GPU holding `params`; `first` / `last`: it embeds tokens / computes the loss."""
    n, layout = run.numerics, run.layout
    weight_bytes = 1 if n.fp8_param_gather else DTYPE_BYTES[n.params]
    state = optimizer_bytes_per_param(run)
    if n.distributed_optimizer:
        optimizer = state * (params.dense / (layout.dp * layout.cp) + params.expert / layout.expert_dp)
    else:
        optimizer = state * params.total
    buffers = attention_workspace(run) + (input_batch(run) if first or last else 0.0)
    return ModelState(weights=params.total * weight_bytes, gradients=params.total * DTYPE_BYTES[n.grad],
                      optimizer=optimizer, buffers=buffers)


def input_batch(run: Run) -> float:
    """The input batch on the device: per microbatch int64 tokens, labels and positions, the fp32 loss mask, and
    the dataloader's b x s x s boolean attention mask unless --no-create-attention-mask-in-dataloader. On a GPU
    one microbatch (copied there for its F); on the CPU the iteration's m microbatches, which megatron's rerun
    data iterator keeps in host memory and which there are the very tensors the passes read."""
    layout = run.layout
    tokens = run.model.seq_length // layout.cp * layout.micro_batch
    mask = tokens * run.model.seq_length if run.attention_mask_in_batch else 0
    microbatches = layout.microbatches if run.kernels.device == "cpu" else 1
    return (tokens * (3 * 8 + 4) + mask) * microbatches


def attention_workspace(run: Run) -> float:
    """Unfused attention computes its scores into megatron's global buffer of b x heads/TP x s x s elements."""
    if run.kernels.flash_attention:
        return 0.0
    model, layout = run.model, run.layout
    s = model.seq_length // layout.cp
    return layout.micro_batch * model.heads // layout.tp * s * s * run.numerics.activation_bytes
