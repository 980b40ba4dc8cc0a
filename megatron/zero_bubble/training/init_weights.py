"""Initialise a model chunk's weights by global parameter name, independently of the parallel layout.

Megatron draws initial weights from generators seeded per pipeline/tensor rank, so the same `--seed`
gives different models under PP=1, PP=4 or ZB-V. Here every parameter is filled from a generator seeded
by (seed, global name), where transformer layers are numbered over the whole model, and the full tensor
is sliced for this tensor-parallel rank: any layout of the same model starts from identical weights.
"""
from __future__ import annotations

import re
import zlib
from typing import Callable

import torch

_LAYER_NAME = re.compile(r"(.*\bdecoder\.layers\.)(\d+)\.(.*)")
_LOCAL_EXPERT = re.compile(r"(mlp\.experts\.local_experts\.)(\d+)\.(.*)")
INIT_STD = 0.02  # megatron's default --init-method-std


def unwrap(module):
    while hasattr(module, "module"):
        module = module.module
    return module


def global_parameter_names(chunk) -> dict[str, torch.nn.Parameter]:
    """{global name: parameter} of one model chunk; decoder layers are numbered by their depth in the model,
    the local experts of an MoE layer by their index among all experts (expert parallelism)."""
    model = unwrap(chunk)
    named = {}
    for name, param in model.named_parameters():
        match = _LAYER_NAME.match(name)
        if match:
            layer = model.decoder.layers[int(match.group(2))]
            rest = match.group(3)
            expert = _LOCAL_EXPERT.match(rest)
            if expert:
                index = layer.mlp.local_expert_indices[int(expert.group(2))]
                rest = f"{expert.group(1)}{index}.{expert.group(3)}"
            name = f"{match.group(1)}{layer.layer_number - 1}.{rest}"
        elif name == "output_layer.weight" and getattr(param, "shared_embedding", False):
            name = "embedding.word_embeddings.weight"  # the last stage's copy of a tied embedding
        named[name] = param
    return named


def initial_value(name: str, full_shape: list[int], seed: int, std: float = INIT_STD) -> torch.Tensor:
    """The full (unsharded) initial tensor of a parameter, as megatron initialises them: normal(0, std)
    weights, zero biases, norm scales of one (named "...norm.weight", or TE's fused "layer_norm_weight")."""
    module = name.split(".")[-2] if "." in name else ""
    if name.endswith("bias"):
        return torch.zeros(full_shape)
    if "norm" in module or name.endswith("layer_norm_weight"):
        return torch.ones(full_shape)
    generator = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{name}".encode()))
    return std * torch.randn(full_shape, generator=generator, dtype=torch.float32)


def init_weights_by_global_name(chunk, seed: int, tp_rank: int, tp_size: int, std: float = INIT_STD,
                                value: Callable[[str, list[int], int], torch.Tensor] | None = None) -> None:
    """Overwrite every parameter of `chunk` with the full tensor of its global name, sliced for TP (expert
    parameters, which megatron marks `allreduce=False`, for the expert tensor-parallel group).

    `value(name, full_shape, seed)` gives that tensor (default: `initial_value`, megatron's rule)."""
    value = value or (lambda name, shape, seed_: initial_value(name, shape, seed_, std))
    with torch.no_grad():
        for name, param in global_parameter_names(chunk).items():
            dim = param.partition_dim if getattr(param, "tensor_model_parallel", False) else None
            rank, size = (tp_rank, tp_size) if getattr(param, "allreduce", True) else _expert_tensor_parallel()
            full_shape = list(param.shape)
            if dim is not None:
                full_shape[dim] *= size
            full = value(name, full_shape, seed)
            local = full if dim is None else full.chunk(size, dim=dim)[rank]
            param.copy_(local.to(param.dtype))


def _expert_tensor_parallel() -> tuple[int, int]:
    """(rank, size) in megatron's expert tensor-parallel group, which slices the expert weights."""
    from megatron.core import parallel_state

    return (parallel_state.get_expert_tensor_parallel_rank(),
            parallel_state.get_expert_tensor_parallel_world_size())
