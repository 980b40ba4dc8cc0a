"""Multi-process CPU test harness for megatron-core (gloo), shared by the runtime tests.

Parent side (no megatron import unless asked for):
    spawn(scenario, world_size, *args, timeout=..., start_method="spawn", **kwargs) -> [result of each rank]
    preload_megatron(training=False)   import megatron once here, then spawn(..., start_method="fork")
                                       saves every rank the multi-second import
    merge_by_dp_rank(results) -> {dp_rank: {"losses": {mb: float}, "grads": {name: tensor}, ...}}
Rank side (inside a scenario; the CPU backend is installed by `spawn` before the scenario starts):
    init_parallel_state(tp, pp, vpp, seed)           megatron parallel state (re-initialisable)
    build_gpt_chunks(spec, init_seed) -> [GPTModel]   one per virtual stage held here, weights set
                                                      deterministically by global parameter name
    mock_microbatch(index, spec) -> batch dict        same batch for the same global microbatch index
    run_forward_backward(chunks, spec, m, first_microbatch, forward_step_func) -> {mb: loss}
    wrap_in_ddp(chunks, ddp_config) / make_optimizer(chunks, optimizer_config)
    full_grads(chunks) / full_params(chunks) -> {global name: full (TP-gathered) tensor}
    run_layout(layout, spec, num_microbatches, ...) -> this rank's report (the usual whole scenario step)

Global parameter names count transformer layers over the whole model ("decoder.layers.<global>."), so
PP, VPP and TP layouts of the same `ModelSpec` hold identical weights and can be compared tensor by tensor.
"""
from __future__ import annotations

import dataclasses
import os
import socket
import tempfile
import time
import zlib
from typing import Callable

import torch
import torch.multiprocessing

DEFAULT_TIMEOUT_S = 180.0


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """A tiny fp32 GPT: the default is 4 layers, hidden 64, 4 heads, sequence 32, vocabulary 128."""

    num_layers: int = 4
    hidden_size: int = 64
    num_attention_heads: int = 4
    seq_length: int = 32
    vocab_size: int = 128
    micro_batch_size: int = 2
    tie_embeddings: bool = False  # with PP > 1 the two copies' gradients are summed by DDP's finalize step


@dataclasses.dataclass(frozen=True)
class Layout:
    """Model-parallel sizes; data parallel is whatever world_size / (tp * pp) leaves."""

    tp: int = 1
    pp: int = 1
    vpp: int | None = None


# ---------------------------------------------------------------- parent side: processes and results


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def spawn(scenario: Callable, world_size: int, *args, timeout: float = DEFAULT_TIMEOUT_S,
          cpu_backend: bool = True, start_method: str = "spawn", **kwargs) -> list:
    """Run `scenario(*args, **kwargs)` on `world_size` spawned ranks joined by a gloo process group.

    `scenario` must be a module-level function (it is pickled by name). Returns the per-rank return
    values, in rank order, sent back with torch.save (tensors included). A rank that raises makes this
    raise with its traceback; ranks still running after `timeout` seconds are killed (TimeoutError).
    `start_method="fork"` reuses this process's imports (see `preload_megatron`); every rank sets one
    intra-op thread first, as PyTorch's forked DataLoader workers do.
    """
    with tempfile.TemporaryDirectory(prefix="zb_harness_") as result_dir:
        context = torch.multiprocessing.start_processes(
            _rank_main,
            args=(world_size, free_port(), result_dir, cpu_backend, scenario, args, kwargs),
            nprocs=world_size,
            join=False,
            start_method=start_method,
        )
        deadline = time.monotonic() + timeout
        try:
            while not context.join(timeout=max(0.0, deadline - time.monotonic())):
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"{scenario.__name__} did not finish on {world_size} ranks in {timeout:.0f} s")
        finally:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
        return [torch.load(os.path.join(result_dir, f"rank{rank}.pt"), weights_only=False)
                for rank in range(world_size)]


def preload_megatron(training: bool = False) -> None:
    """Import megatron-core (and megatron.training) in this process, so that forked ranks inherit it."""
    import importlib

    from megatron.zero_bubble.patches import imports

    imports.install()
    for name in ("megatron.core.pipeline_parallel", "megatron.core.models.gpt",
                 "megatron.core.models.gpt.gpt_layer_specs", "megatron.core.distributed", "megatron.core.optimizer"):
        importlib.import_module(name)
    if training:
        importlib.import_module("megatron.training.training")


def _rank_main(rank, world_size, port, result_dir, cpu_backend, scenario, args, kwargs):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world_size), CUDA_DEVICE_MAX_CONNECTIONS="1")
    torch.set_num_threads(1)  # ranks share a few cores; more threads only contend
    if cpu_backend:
        from megatron.zero_bubble.patches import cpu_backend as backend

        backend.install()
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world_size)
    try:  # an exception reaches the parent with its traceback through torch.multiprocessing
        result = scenario(*args, **kwargs)
        torch.save(result, os.path.join(result_dir, f"rank{rank}.pt"))
    finally:
        _destroy_parallel_state()
        torch.distributed.destroy_process_group()


def run_cases(run_case: Callable, cases: list, world_size: int, timeout: float = DEFAULT_TIMEOUT_S) -> dict:
    """Every case (with a `label`) in one spawned group, in turn: {label: [each rank's report]}."""
    results = spawn(_run_cases_on_rank, world_size, run_case, cases, timeout=timeout)
    return {case.label: [r[case.label] for r in results] for case in cases}


def _run_cases_on_rank(run_case: Callable, cases: list) -> dict:
    return {case.label: run_case(case) for case in cases}


def merge_by_dp_rank(results: list[dict]) -> dict[int, dict]:
    """Combine `run_layout` reports of all ranks: per data-parallel replica, losses and full tensors."""
    merged: dict[int, dict] = {}
    for report in results:
        replica = merged.setdefault(report["dp_rank"], {"losses": {}, "grads": {}, "params": {}, "grad_norm": None})
        for key in ("losses", "grads", "params"):
            replica[key].update(report[key])
        if report.get("grad_norm") is not None:
            replica["grad_norm"] = report["grad_norm"]
    return merged


# ---------------------------------------------------------------- rank side: megatron set-up


def init_parallel_state(tp: int = 1, pp: int = 1, vpp: int | None = None, seed: int = 1234) -> None:
    """(Re)initialise megatron's model-parallel groups and RNG tracker; dp = world_size / (tp * pp)."""
    from megatron.core import parallel_state, tensor_parallel

    _destroy_parallel_state()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp
    )
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def _destroy_parallel_state() -> None:
    import sys

    parallel_state = sys.modules.get("megatron.core.parallel_state")  # never import megatron just for this
    if parallel_state is not None and parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()


def transformer_config(spec: ModelSpec, **overrides):
    """fp32 TransformerConfig for `spec` on the current parallel state, with CPU-friendly defaults."""
    from megatron.core import parallel_state
    from megatron.core.transformer import TransformerConfig

    settings = dict(
        num_layers=spec.num_layers, hidden_size=spec.hidden_size, num_attention_heads=spec.num_attention_heads,
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=parallel_state.get_pipeline_model_parallel_world_size(),
        virtual_pipeline_model_parallel_size=parallel_state.get_virtual_pipeline_model_parallel_world_size(),
        pipeline_dtype=torch.float32, params_dtype=torch.float32,
        hidden_dropout=0.0, attention_dropout=0.0, bias_dropout_fusion=False, gradient_accumulation_fusion=False,
        persist_layer_norm=False, masked_softmax_fusion=False, apply_rope_fusion=False,
    )
    settings.update(overrides)
    return TransformerConfig(**settings)


def build_gpt_chunks(spec: ModelSpec, init_seed: int = 0, **config_overrides) -> list:
    """This rank's GPTModel chunks (local layer spec), weights set by global name."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    config = transformer_config(spec, **config_overrides)
    vpp = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    chunks = []
    for vp_stage in range(vpp or 1):
        stage = None if vpp is None else vp_stage
        chunks.append(GPTModel(
            config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=spec.vocab_size,
            max_sequence_length=spec.seq_length,
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage),
            share_embeddings_and_output_weights=spec.tie_embeddings, vp_stage=stage,
        ))
    init_weights_by_global_name(chunks, init_seed)
    return chunks


def global_param_names(chunk) -> dict[str, object]:
    """{global name: parameter} of one chunk; layer indices are counted over the whole model."""
    from megatron.zero_bubble.training.init_weights import global_parameter_names

    return global_parameter_names(chunk)


def init_weights_by_global_name(chunks: list, seed: int = 0) -> None:
    """Fill every parameter from a generator seeded by (seed, global name), sliced for this TP rank."""
    from megatron.core import parallel_state

    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    with torch.no_grad():
        for chunk in chunks:
            for name, param in global_param_names(chunk).items():
                generator = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{name}".encode()))
                full_shape = list(param.shape)
                dim = _partition_dim(param)
                if dim is not None:
                    full_shape[dim] *= tp_size
                full = torch.randn(full_shape, generator=generator, dtype=torch.float32)
                full = 1.0 + 0.1 * full if name.endswith("norm.weight") else 0.05 * full  # norm scales near 1
                local = full if dim is None else full.chunk(tp_size, dim=dim)[tp_rank]
                param.copy_(local)


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


def run_layout(layout: Layout, spec: ModelSpec, num_microbatches: int, *, ddp: bool = False,
               optimizer_step: bool = False, shard_data: bool | None = None, init_seed: int = 0) -> dict:
    """Initialise `layout`, build the model, run one forward-backward (+ optional step); this rank's report.

    With `shard_data` (default: `ddp`) data-parallel replica r runs microbatches [r*m, (r+1)*m);
    otherwise every replica runs [0, m). The report has dp_rank, losses, grads, params (at the end, so
    after the step if there is one) and grad_norm (None without a step); merge with `merge_by_dp_rank`.
    """
    from megatron.core import parallel_state

    init_parallel_state(layout.tp, layout.pp, layout.vpp)
    chunks = build_gpt_chunks(spec, init_seed)
    if ddp:
        chunks = wrap_in_ddp(chunks)
    optimizer = make_optimizer(chunks) if optimizer_step else None
    if optimizer is not None:
        optimizer.zero_grad()
    dp_rank = parallel_state.get_data_parallel_rank()
    first = dp_rank * num_microbatches if (ddp if shard_data is None else shard_data) else 0
    report = {"dp_rank": dp_rank, "losses": run_forward_backward(chunks, spec, num_microbatches, first),
              "grads": full_grads(chunks), "grad_norm": None}
    if optimizer is not None:
        success, grad_norm, _ = optimizer.step()
        assert success, "optimizer step was skipped"
        report["grad_norm"] = float(grad_norm)
    report["params"] = full_params(chunks)
    return report


# ---------------------------------------------------------------- helpers


def _partition_dim(param) -> int | None:
    return param.partition_dim if getattr(param, "tensor_model_parallel", False) else None


def _full_tensors(chunks: list, read: Callable) -> dict[str, torch.Tensor]:
    from megatron.core import parallel_state

    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    group = parallel_state.get_tensor_model_parallel_group()
    tensors = {}
    for chunk in chunks:
        for name, param in global_param_names(chunk).items():
            value = read(param)
            if value is None:
                continue
            value = value.detach().clone().view(param.shape)
            dim = _partition_dim(param)
            if dim is not None and tp_size > 1:
                shards = [torch.empty_like(value) for _ in range(tp_size)]
                torch.distributed.all_gather(shards, value.contiguous(), group=group)
                value = torch.cat(shards, dim=dim)
            tensors[name] = value
    return tensors
