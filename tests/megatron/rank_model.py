"""megatron-core set up on one rank of the harness (inside a scenario, after `harness.spawn` installed the backend).

    transformer_config(spec, **overrides)   fp32 TransformerConfig of a `harness.ModelSpec` on this parallel state
    build_gpt_chunks(spec, init_seed) -> [GPTModel]   one per virtual stage held here (a HybridModel for a hybrid
                                                      pattern), weights set deterministically by global name
    global_param_names(chunk) / init_weights_by_global_name(chunks, seed)
    mock_microbatch(index, spec) -> batch dict        same batch for the same global microbatch index
    gpt_forward_step / gpt_forward_step_per_token     megatron forward_step_funcs reporting the microbatch's loss
    run_forward_backward(chunks, spec, m, first_microbatch, forward_step_func) -> {mb: loss}
    wrap_in_ddp(chunks, ddp_config) / make_optimizer(chunks, optimizer_config)
    full_grads(chunks) / full_params(chunks) -> {global name: full (TP-gathered) tensor}
    with deferred_weights(chunks) as names: ...       the global names of the weights whose W a B pass deferred

Global parameter names count transformer layers over the whole model ("decoder.layers.<global>."), so PP, VPP and
TP layouts of the same spec hold identical weights and can be compared tensor by tensor. megatron is imported
inside each function: the parent imports this module without it.
"""
from __future__ import annotations

import contextlib
import zlib
from typing import Callable

import torch

from tests.megatron.harness import ModelSpec


# ---------------------------------------------------------------- model: config, chunks, weights


def transformer_config(spec: ModelSpec, **overrides):
    """fp32 TransformerConfig for `spec` on the current parallel state, with CPU-friendly defaults."""
    from megatron.core import parallel_state
    from megatron.core.transformer import TransformerConfig

    settings = dict(
        num_layers=spec.num_layers, hidden_size=spec.hidden_size, num_attention_heads=spec.num_attention_heads,
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=parallel_state.get_pipeline_model_parallel_world_size(),
        expert_model_parallel_size=parallel_state.get_expert_model_parallel_world_size(),
        virtual_pipeline_model_parallel_size=parallel_state.get_virtual_pipeline_model_parallel_world_size(),
        pipeline_dtype=torch.float32, params_dtype=torch.float32,
        hidden_dropout=0.0, attention_dropout=0.0, bias_dropout_fusion=False, gradient_accumulation_fusion=False,
        persist_layer_norm=False, masked_softmax_fusion=False, apply_rope_fusion=False,
    )
    if settings["virtual_pipeline_model_parallel_size"] is not None:
        # as megatron.training configures an interleaved schedule: one send/receive call per direction (batched
        # calls post a rank's two sends to the same peer out of its order at PP=2, which megatron refuses there)
        settings.update(overlap_p2p_comm=True, batch_p2p_comm=False)
    settings.update(spec.config_overrides())
    settings.update(overrides)
    return TransformerConfig(**settings)


def build_gpt_chunks(spec: ModelSpec, init_seed: int = 0, **config_overrides) -> list:
    """This rank's GPTModel chunks (local layer spec), weights set by global name."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    config = transformer_config(spec, **config_overrides)
    vpp = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    chunks = []
    for vp_stage in range(vpp or 1):
        stage = None if vpp is None else vp_stage
        if spec.hybrid_pattern is not None:
            chunks.append(_hybrid_chunk(spec, config, stage))
            continue
        chunks.append(GPTModel(
            config=config, vocab_size=spec.vocab_size, max_sequence_length=spec.seq_length,
            transformer_layer_spec=spec.layer_spec(config, stage), mtp_block_spec=spec.mtp_spec(config, stage),
            position_embedding_type=spec.position_embedding_type, rotary_percent=spec.rotary_percent,
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage),
            share_embeddings_and_output_weights=spec.tie_embeddings, vp_stage=stage,
        ))
    init_weights_by_global_name(chunks, init_seed)
    return chunks


def _hybrid_chunk(spec: ModelSpec, config, vp_stage: int | None):
    """One HybridModel chunk of pretrain_hybrid.py's local stack spec (imported in the rank: the entry script
    installs the CPU backend, as every rank has it)."""
    from types import SimpleNamespace

    from megatron.core import parallel_state
    from megatron.core.models.hybrid.hybrid_model import HybridModel

    import pretrain_hybrid

    options = SimpleNamespace(normalization=spec.normalization, qk_layernorm=spec.qk_layernorm, qk_l2_norm=False,
                              num_experts=spec.num_experts, moe_grouped_gemm=False)
    return HybridModel(
        config=config, hybrid_stack_spec=pretrain_hybrid.local_stack_spec(options), vocab_size=spec.vocab_size,
        max_sequence_length=spec.seq_length, hybrid_layer_pattern=spec.hybrid_pattern,
        position_embedding_type=spec.position_embedding_type, rotary_percent=spec.rotary_percent,
        pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
        post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
        share_embeddings_and_output_weights=spec.tie_embeddings, vp_stage=vp_stage)


def global_param_names(chunk) -> dict[str, object]:
    """{global name: parameter} of one chunk; layer indices are counted over the whole model."""
    from megatron.zero_bubble.training.init_weights import global_parameter_names

    return global_parameter_names(chunk)


def init_weights_by_global_name(chunks: list, seed: int = 0) -> None:
    """training/init_weights.py's fill by global name, with a rule that leaves no parameter at a constant:
    biases and norm scales random too (near 0 and 1), so a wrong bias or norm gradient cannot hide."""
    from megatron.core import parallel_state

    from megatron.zero_bubble.training import init_weights

    for chunk in chunks:
        init_weights.init_weights_by_global_name(
            chunk, seed, parallel_state.get_tensor_model_parallel_rank(),
            parallel_state.get_tensor_model_parallel_world_size(), value=_test_value)


def _test_value(name: str, full_shape: list[int], seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{name}".encode()))
    full = torch.randn(full_shape, generator=generator, dtype=torch.float32)
    return 1.0 + 0.1 * full if name.endswith("norm.weight") else 0.05 * full  # norm scales near 1


# ---------------------------------------------------------------- batches and forward-backward


def mock_microbatch(index: int, spec: ModelSpec) -> dict:
    """Deterministic batch number `index` (tokens, labels, loss mask, positions; causal mask in the model)."""
    generator = torch.Generator().manual_seed(10_000 + index)
    tokens = torch.randint(0, spec.vocab_size, (spec.micro_batch_size, spec.seq_length + 1), generator=generator)
    positions = torch.arange(spec.seq_length).unsqueeze(0).expand(spec.micro_batch_size, -1).contiguous()
    return {"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous(),
            "loss_mask": torch.ones(spec.micro_batch_size, spec.seq_length), "position_ids": positions,
            "microbatch": index}


def gpt_forward_step(data_iterator, model):
    """Megatron forward_step_func: GPT forward, masked mean loss, reporting {"lm loss", "microbatch"}."""
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])

    def loss_func(output_tensor):
        mask = batch["loss_mask"].view(-1)
        loss = torch.sum(output_tensor.view(-1).float() * mask) / mask.sum()
        return loss, {"lm loss": loss.detach().clone(), "microbatch": batch["microbatch"]}

    return output, loss_func


def gpt_forward_step_per_token(data_iterator, model):
    """Megatron forward_step_func with --calculate-per-token-loss: the loss summed over the tokens the mask keeps
    (a mask that drops every label divisible by 5, so that microbatches count different numbers of tokens) and
    that count, which megatron's finalize_model_grads (or post-validation's S pass) divides the gradients by."""
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])

    def loss_func(output_tensor):
        mask = (batch["labels"] % 5 != 0).float().view(-1)
        loss = torch.sum(output_tensor.view(-1).float() * mask)
        tokens = mask.sum().to(torch.int)
        return loss, tokens, {"lm loss": (loss / tokens).detach().clone(), "microbatch": batch["microbatch"]}

    return output, loss_func


@contextlib.contextmanager
def deferred_weights(chunks):
    """Global names of the weights whose gradient a B pass handed to a WeightGradStore (their W deferred)."""
    from megatron.zero_bubble.runtime.wgrad_store import WeightGradStore

    names = {id(p): n for chunk in chunks for n, p in global_param_names(chunk).items()}
    deferred, defer = set(), WeightGradStore.defer

    def recording_defer(store, work):
        deferred.add(names[id(work.weight)])
        return defer(store, work)

    WeightGradStore.defer = recording_defer
    try:
        yield deferred
    finally:
        WeightGradStore.defer = defer


def run_forward_backward(chunks: list, spec: ModelSpec, num_microbatches: int, first_microbatch: int = 0,
                         forward_step_func: Callable = gpt_forward_step, forward_only: bool = False) -> dict[int, float]:
    """One call of megatron's `get_forward_backward_func()`; returns {microbatch index: loss} (last stage)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    indices = range(first_microbatch, first_microbatch + num_microbatches)
    iterators = [iter([mock_microbatch(i, spec) for i in indices]) for _ in chunks]
    reported = get_forward_backward_func()(
        forward_step_func=forward_step_func, data_iterator=iterators if len(chunks) > 1 else iterators[0],
        model=chunks if len(chunks) > 1 else chunks[0], num_microbatches=num_microbatches,
        seq_length=spec.seq_length, micro_batch_size=spec.micro_batch_size, forward_only=forward_only,
    )
    return {int(item["microbatch"]): float(item["lm loss"]) for item in reported}


# ---------------------------------------------------------------- DDP, optimizer and the full tensors


def wrap_in_ddp(chunks: list, ddp_config=None) -> list:
    """Megatron DistributedDataParallel around each chunk, wired into the config like megatron.training."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads

    ddp_config = ddp_config or DistributedDataParallelConfig()
    wrapped = [DistributedDataParallel(config=chunk.config, ddp_config=ddp_config, module=chunk,
                                       disable_bucketing=index > 0) for index, chunk in enumerate(chunks)]
    config = wrapped[0].config
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = [c.no_sync for c in wrapped] if len(wrapped) > 1 else wrapped[0].no_sync
    return wrapped


def make_optimizer(chunks: list, optimizer_config=None):
    """Megatron's optimizer (default: Adam, lr 1e-3, no weight decay, fp32, clip 1.0) over the chunks."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    optimizer_config = optimizer_config or OptimizerConfig(optimizer="adam", lr=1e-3, weight_decay=0.0, clip_grad=1.0)
    return get_megatron_optimizer(optimizer_config, chunks)


def full_grads(chunks: list) -> dict[str, torch.Tensor]:
    """{global name: gradient}, TP shards gathered; DDP's main_grad is read where there is one."""
    return _full_tensors(chunks, lambda p: p.main_grad if getattr(p, "main_grad", None) is not None else p.grad)


def full_params(chunks: list) -> dict[str, torch.Tensor]:
    """{global name: parameter value}, TP shards gathered."""
    return _full_tensors(chunks, lambda p: p.data)


def _partition_dim(param) -> int | None:
    return param.partition_dim if getattr(param, "tensor_model_parallel", False) else None


def _full_tensors(chunks: list, read: Callable) -> dict[str, torch.Tensor]:
    from megatron.core import parallel_state

    groups = {True: parallel_state.get_tensor_model_parallel_group(),
              False: parallel_state.get_expert_tensor_parallel_group()}  # by param.allreduce: False for experts
    tensors = {}
    for chunk in chunks:
        for name, param in global_param_names(chunk).items():
            value = read(param)
            if value is None:
                continue
            value = value.detach().clone().view(param.shape)
            dim = _partition_dim(param)
            group = groups[getattr(param, "allreduce", True)]
            tp_size = group.size()
            if dim is not None and tp_size > 1:
                shards = [torch.empty_like(value) for _ in range(tp_size)]
                torch.distributed.all_gather(shards, value.contiguous(), group=group)
                value = torch.cat(shards, dim=dim)
            tensors[name] = value
    return tensors
