"""Multi-process CPU test harness for megatron-core (gloo), shared by the runtime tests.

Parent side (no megatron import unless asked for):
    spawn(scenario, world_size, *args, timeout=..., start_method="spawn", **kwargs) -> [result of each rank]
    preload_megatron(training=False)   import megatron once here, then spawn(..., start_method="fork")
                                       saves every rank the multi-second import
    run_cases(run_case, cases, world_size) -> {label: [each rank's report]}   every case in one group of ranks
    merge_by_dp_rank(results) -> {dp_rank: {"losses": {mb: float}, "grads": {name: tensor}, ...}}
    assert_identical(ours, reference)  torch.equal of losses, gradients and parameters per data-parallel replica
Rank side (inside a scenario; the CPU backend is installed by `spawn` before the scenario starts):
    init_parallel_state(tp, pp, vpp, seed) / destroy_parallel_state()   see process_groups.py
    build_gpt_chunks(spec, init_seed) -> [GPTModel]   one per virtual stage held here, weights set
                                                      deterministically by global parameter name
    mock_microbatch(index, spec) -> batch dict        same batch for the same global microbatch index
    run_forward_backward(chunks, spec, m, first_microbatch, forward_step_func) -> {mb: loss}
    wrap_in_ddp(chunks, ddp_config) / make_optimizer(chunks, optimizer_config)
    full_grads(chunks) / full_params(chunks) -> {global name: full (TP-gathered) tensor}
    with deferred_weights(chunks) as names: ...   the global names of the weights whose W a B pass deferred
    Case, CaseRun(case)        one training case: the zero-bubble session, parallel state, model, DDP,
                               optimizer, iterations and the report (what the test modules run)
    run_layout(layout, spec, num_microbatches, ...) -> this rank's report of one iteration
The device and process-group backend of every rank: rank_device(), in one place.

Global parameter names count transformer layers over the whole model ("decoder.layers.<global>."), so
PP, VPP and TP layouts of the same `ModelSpec` hold identical weights and can be compared tensor by tensor.
Every case runs in ranks forked for it alone (run_cases): what a case leaves behind ends with its processes.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import tempfile
import time
import zlib
from typing import Callable

import torch
import torch.multiprocessing

from tests.launching import free_port
from tests.megatron.process_groups import destroy_parallel_state, init_parallel_state

DEFAULT_TIMEOUT_S = 180.0
# Every case's messages go through the stand-in of NCCL's point-to-point (runtime/strict_p2p.py): in order per
# process group, a send done only with its receive. gloo alone would forgive what NCCL does not. A stuck operation
# fails the case after a minute, naming itself (the watchdog, which would end the process, is off here).


def _strict_messaging():
    from megatron.zero_bubble.runtime.messaging import MessagingOptions

    return MessagingOptions(strict=True, watchdog_timeout_s=0, strict_timeout_s=60.0)


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """A tiny fp32 GPT: the default is 4 layers, hidden 64, 4 heads, sequence 32, vocabulary 128, learned absolute
    positions, LayerNorm, GeLU; the Llama-class options below change that (test_llama_models.py's LLAMA)."""

    num_layers: int = 4
    hidden_size: int = 64
    num_attention_heads: int = 4
    seq_length: int = 32
    vocab_size: int = 128
    micro_batch_size: int = 2
    tie_embeddings: bool = False  # with PP > 1 the two copies' gradients are summed by DDP's finalize step
    add_bias_linear: bool = True
    # Mixture of experts (megatron-core's MoELayer, local experts: SequentialMLP) when num_experts is set
    num_experts: int | None = None
    moe_router_topk: int = 2
    moe_aux_loss_coeff: float = 0.0
    moe_token_dispatcher_type: str = "alltoall"
    moe_options: tuple = ()  # further TransformerConfig MoE settings as (name, value); a tuple value becomes a list
    sequence_parallel: bool = False  # with TP > 1 (the CPU backend supplies the norm that honours it)
    # Llama-class options (see LLAMA): rotary position embeddings, RMSNorm, SwiGLU, grouped-query attention
    position_embedding_type: str = "learned_absolute"  # "rope": rotary, megatron's unfused implementation
    rotary_percent: float = 1.0
    normalization: str = "LayerNorm"  # or "RMSNorm"
    swiglu: bool = False  # gated linear unit with SiLU (megatron's --swiglu)
    num_query_groups: int | None = None  # grouped-query attention: key/value heads (None: one per head)
    ffn_hidden_size: int | None = None  # None: megatron's default, 4 x hidden
    qk_layernorm: bool = False  # a norm (of `normalization`) on the queries and keys of each head
    moe_layer_freq: int | tuple | None = None  # MoE on some layers only (megatron's decoder block spec); None: all
    mtp_num_layers: int | None = None  # multi-token prediction layers on the last stage (megatron's MTP block)
    # A HybridModel of these layers (megatron's --hybrid-layer-pattern: *, -, E; | cuts the stages) instead of a GPT;
    # its layers are pretrain_hybrid.py's local spec, num_layers the pattern's count
    hybrid_pattern: str | None = None

    def config_overrides(self) -> dict:
        """The TransformerConfig settings this spec adds to the harness's defaults."""
        overrides = {"add_bias_linear": self.add_bias_linear, "sequence_parallel": self.sequence_parallel,
                     "normalization": self.normalization, "ffn_hidden_size": self.ffn_hidden_size,
                     "qk_layernorm": self.qk_layernorm, "mtp_num_layers": self.mtp_num_layers}
        if self.hybrid_pattern is not None:  # as megatron.training configures a hybrid model
            overrides.update(num_layers=len(self.hybrid_pattern.replace("|", "")), is_hybrid_model=True)
        if self.swiglu:  # as megatron.training sets it for --swiglu
            overrides.update(gated_linear_unit=True, activation_func=torch.nn.functional.silu,
                             bias_activation_fusion=False)
        if self.num_query_groups is not None:
            overrides["num_query_groups"] = self.num_query_groups
        if self.num_experts is not None:
            overrides.update(num_moe_experts=self.num_experts, moe_router_topk=self.moe_router_topk,
                             moe_aux_loss_coeff=self.moe_aux_loss_coeff,
                             moe_token_dispatcher_type=self.moe_token_dispatcher_type)
            overrides.update({name: list(value) if isinstance(value, tuple) else value
                              for name, value in self.moe_options})
            if self.moe_layer_freq is not None:
                freq = self.moe_layer_freq
                overrides["moe_layer_freq"] = list(freq) if isinstance(freq, tuple) else freq
        return overrides

    def layer_spec(self, config, vp_stage: int | None):
        """Megatron's local spec: one layer spec for every layer, or with `moe_layer_freq` the decoder block spec
        that megatron.training builds for MoE models (dense and MoE layers by the pattern)."""
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec

        if self.moe_layer_freq is not None:
            return get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization=self.normalization,
                                              vp_stage=vp_stage)
        return get_gpt_layer_local_spec(self.num_experts, qk_layernorm=self.qk_layernorm,
                                        normalization=self.normalization)

    def mtp_spec(self, config, vp_stage: int | None):
        """Megatron's multi-token-prediction block (its layers like the model's last layer); None without MTP."""
        if self.mtp_num_layers is None:
            return None
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

        layer = self.layer_spec(config, vp_stage)
        if hasattr(layer, "layer_specs"):  # a block spec: the model's last layer, whichever stage holds it
            from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_layer_specs

            layer = get_gpt_decoder_layer_specs(config, use_transformer_engine=False,
                                                normalization=self.normalization)[-1]
        return get_gpt_mtp_block_spec(config, layer, use_transformer_engine=False, vp_stage=vp_stage)


@dataclasses.dataclass(frozen=True)
class Layout:
    """Model-parallel sizes; data parallel is whatever world_size / (tp * pp) leaves."""

    tp: int = 1
    pp: int = 1
    vpp: int | None = None
    ep: int = 1  # expert model parallel (MoE specs), carved out of data parallel


# ---------------------------------------------------------------- where ranks run


@dataclasses.dataclass(frozen=True)
class Device:
    """Where a rank computes and how ranks talk: chosen in one place (`rank_device`)."""

    type: str  # torch device type of the model chunks and batches
    backend: str  # torch.distributed backend of every process group
    cpu_backend: bool  # megatron-core runs there only with patches/cpu_backend.py installed


def rank_device() -> Device:
    """The CPU, gloo and the CPU backend (ranks on a GPU are issue 21's)."""
    return Device("cpu", "gloo", cpu_backend=True)


# ---------------------------------------------------------------- parent side: processes and results


def spawn(scenario: Callable, world_size: int, *args, timeout: float = DEFAULT_TIMEOUT_S,
          start_method: str = "spawn", **kwargs) -> list:
    """Run `scenario(*args, **kwargs)` on `world_size` spawned ranks joined by a gloo process group.

    `scenario` must be a module-level function (it is pickled by name). Returns the per-rank return
    values, in rank order, sent back with torch.save (tensors included). A rank that raises makes this
    raise with its traceback; ranks still running after `timeout` seconds are killed (TimeoutError).
    `start_method="fork"` reuses this process's imports (see `preload_megatron`); every rank sets one
    intra-op thread first, as PyTorch's forked DataLoader workers do. A parent that has a default process
    group of its own cannot fork ranks (they would inherit it): those ranks are spawned instead.
    """
    if start_method == "fork" and torch.distributed.is_available() and torch.distributed.is_initialized():
        start_method = "spawn"
    with tempfile.TemporaryDirectory(prefix="zb_harness_") as result_dir:
        context = torch.multiprocessing.start_processes(
            _rank_main,
            args=(world_size, free_port(), result_dir, scenario, args, kwargs),
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


def _rank_main(rank, world_size, port, result_dir, scenario, args, kwargs):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world_size), CUDA_DEVICE_MAX_CONNECTIONS="1")
    torch.set_num_threads(1)  # ranks share a few cores; more threads only contend
    device = rank_device()
    if device.cpu_backend:
        from megatron.zero_bubble.patches import cpu_backend

        cpu_backend.install()
    torch.distributed.init_process_group(device.backend, rank=rank, world_size=world_size)
    finished = False
    try:  # an exception reaches the parent with its traceback through torch.multiprocessing
        result = scenario(*args, **kwargs)
        torch.save(result, os.path.join(result_dir, f"rank{rank}.pt"))
        finished = True
    finally:
        # after a failure the other ranks may never reach a barrier: only tear down, the process ends anyway
        destroy_parallel_state(synchronize=finished)
        torch.distributed.destroy_process_group()


def run_cases(run_case: Callable, cases: list, world_size: int, timeout: float = DEFAULT_TIMEOUT_S) -> dict:
    """Every case (with a `label`) in ranks of its own, forked afresh, as a run starts its processes:
    {label: [each rank's report]}. megatron-core is imported here first, once, so that the forks start at once.
    `timeout`: seconds for each case."""
    preload_megatron()
    return {case.label: spawn(run_case, world_size, case, timeout=timeout, start_method="fork") for case in cases}


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


def assert_identical(ours: list[dict], reference: list[dict], replicas=None, losses: bool = True,
                     grads: bool = True) -> None:
    """torch.equal per data-parallel replica (all of the reference's, or `replicas`): losses, gradients and
    parameters of the reports of every rank."""
    ours, reference = merge_by_dp_rank(ours), merge_by_dp_rank(reference)
    if replicas is None:
        assert ours.keys() == reference.keys()
    for dp in replicas or reference:
        if losses:
            assert ours[dp]["losses"] == reference[dp]["losses"] and reference[dp]["losses"]
        for kind in ("grads", "params") if grads else ("params",):
            assert ours[dp][kind].keys() == reference[dp][kind].keys()
            for name, value in reference[dp][kind].items():
                assert torch.equal(ours[dp][kind][name], value), f"{kind[:-1]} of {name} differs"


# ---------------------------------------------------------------- rank side: megatron set-up


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
               optimizer_step: bool = False, shard_data: bool | None = None) -> dict:
    """Initialise `layout`, build the model, run one forward-backward (+ optional Adam step); this rank's report.

    With `shard_data` (default: `ddp`) data-parallel replica r runs microbatches [r*m, (r+1)*m);
    otherwise every replica runs [0, m). The report has dp_rank, losses, grads, params (at the end, so
    after the step if there is one) and grad_norm (None without a step); merge with `merge_by_dp_rank`.
    """
    case = Case("layout", layout, spec=spec, microbatches=num_microbatches, ddp=ddp,
                optimizer="adam" if optimizer_step else None, shard_data=ddp if shard_data is None else shard_data)
    with CaseRun(case) as run:
        run.iteration(0)
        grad_norm = None
        if optimizer_step:
            success, grad_norm, _ = run.step()
            assert success, "optimizer step was skipped"
        return run.report(grad_norm=None if grad_norm is None else float(grad_norm))


# ---------------------------------------------------------------- rank side: one training case


@dataclasses.dataclass(frozen=True)
class Case:
    """One training run that `CaseRun` sets up on every rank; a test module's cases may add fields of their own."""

    label: str
    layout: Layout
    schedule: str | None = None  # a planner's name, run by our executor; None: megatron-core's own schedule
    spec: ModelSpec = ModelSpec()
    microbatches: int = 8
    steps: int = 1  # iterations, each followed by an optimizer step where there is an optimizer
    optimizer: str | None = None  # megatron's "adam" or "sgd" (over DDP), "local" (torch Adam per rank, no DDP)
    ddp: bool = False  # megatron DDP without a megatron optimizer (one implies it)
    clip_grad: float = 1.0
    weight_decay: float = 0.0
    distributed: bool = False  # megatron's distributed optimizer
    overlap: bool = False  # DDP's overlapped reduction in small buckets (distributed: overlapped parameter gathers)
    every_stage_buckets: bool = False  # patches/ddp_bucketing.py buckets every stage (megatron: the first only)
    shard_data: bool = False  # data-parallel replica r trains on microbatches of its own; else all on the same
    forward_only: bool = False
    post_validation: bool = False  # the plan has post-validation's V and S passes
    costs: tuple | None = None  # (T_F, T_B, T_W per virtual stage, T_comm) to plan on (see `planned`); None: unit
    dropout: float = 0.0  # hidden dropout
    per_token: bool = False  # --calculate-per-token-loss (gpt_forward_step_per_token): gradients divided by tokens

    @property
    def megatron_optimizer(self) -> bool:
        return self.optimizer in ("adam", "sgd")


BUCKET_ELEMENTS = 12_000  # a few buckets per stage of the tiny model, so that their reductions can start apart


@functools.lru_cache(maxsize=None)
def planned(name: str, stages: int, microbatches: int, costs: tuple | None = None, post_validation: bool = False,
            chunks: int | None = None):
    """Schedule `name` as its planner makes it (ILP off), for `chunks` model chunks per rank (None: the schedule's
    natural count). `costs` as in `Case`: a plan of n virtual stages takes the last n entries of each tuple."""
    from megatron.zero_bubble.schedules import Costs
    from megatron.zero_bubble.schedules.planners import PlanRequest, natural_chunks, plan

    chunks = chunks or natural_chunks(name)
    if costs is not None:
        n = stages * chunks
        t_f, t_b, t_w, t_comm = costs
        costs = Costs.make(n, t_f=t_f[-n:], t_b=t_b[-n:], t_w=t_w[-n:], t_comm=t_comm, chunks=chunks)
    return plan(name, PlanRequest(stages=stages, microbatches=microbatches, costs=costs, ilp_time_limit=0,
                                  post_validation=post_validation, chunks=chunks))


class CaseRun:
    """`case` on this rank: the zero-bubble session, megatron's parallel state, the model (DDP) and optimizer,
    then the iterations the test module drives:

        with CaseRun(case) as run:       # run.session, run.chunks, run.optimizer built
            for step in range(case.steps):
                run.iteration(step)      # gradients zeroed, forward-backward on this replica's microbatches
                run.step()               # the optimizer's: megatron's (update_successful, grad_norm, zeros)
            return run.report()          # dp/pp/tp rank, losses {(step, microbatch)}, grads (last step), params

    `observer` sees every pass of our executor; `forward_step` replaces `gpt_forward_step`.
    """

    def __init__(self, case: Case, observer: Callable | None = None, forward_step: Callable | None = None):
        self.case, self.observer = case, observer
        self.forward_step = forward_step or (gpt_forward_step_per_token if case.per_token else gpt_forward_step)
        self.losses, self.grads = {}, {}
        self._exit = contextlib.ExitStack()

    def __enter__(self) -> "CaseRun":
        from megatron.zero_bubble.schedules.planners import layout_of
        from megatron.zero_bubble.training.session import ZeroBubbleSession

        case = self.case
        plans = None
        if case.schedule is not None:
            plans = functools.partial(_plan_for_microbatches, case)
        v_stages = case.layout.pp if case.schedule is not None and layout_of(case.schedule) == "v" else None
        if v_stages is not None:  # the V placement must be in place before the groups are made
            destroy_parallel_state()
        self.session = self._exit.enter_context(ZeroBubbleSession(
            schedule_for=plans, v_stages=v_stages, bucket_every_stage=case.every_stage_buckets, observer=self.observer,
            messaging=_strict_messaging()))
        try:
            init_parallel_state(case.layout.tp, case.layout.pp, case.layout.vpp, ep=case.layout.ep)
            if self.session.executor is not None:  # the pair groups, made before any iteration is looked at
                from megatron.core import parallel_state

                self.session.executor.connect(parallel_state.get_pipeline_model_parallel_group())
            self.chunks = build_gpt_chunks(case.spec, init_seed=0, hidden_dropout=case.dropout,
                                           calculate_per_token_loss=case.per_token)
            self.ddp = case.ddp or case.megatron_optimizer
            if self.ddp:
                self.chunks = wrap_in_ddp(self.chunks, _ddp_config(case))
            self.optimizer = _optimizer(case, self.chunks)
        except BaseException:
            self._exit.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self._exit.close()

    def iteration(self, step: int, keep_grads: bool = True) -> dict[int, float]:
        """Zero the gradients, run forward-backward on this step's microbatches; returns its losses, and keeps them
        and (with `keep_grads`, unless forward only) the full gradients (an all-gather over TP ranks)."""
        from megatron.core import parallel_state

        case, m = self.case, self.case.microbatches
        if self.optimizer is not None:
            self.optimizer.zero_grad()
            for chunk in self.chunks if self.ddp else ():
                chunk.zero_grad_buffer()
        first = step * m
        if case.shard_data:
            first = (step * parallel_state.get_data_parallel_world_size() + parallel_state.get_data_parallel_rank()) * m
        losses = run_forward_backward(self.chunks, case.spec, m, first, forward_step_func=self.forward_step,
                                      forward_only=case.forward_only)
        self.losses.update({(step, k): v for k, v in losses.items()})
        if keep_grads and not case.forward_only:
            self.grads = full_grads(self.chunks)
        return losses

    def step(self) -> tuple:
        """The optimizer's step: megatron's (update_successful, grad_norm, num_zeros); a local one's (True, None,
        None)."""
        if self.case.optimizer == "local":
            self.optimizer.step()
            return True, None, None
        return self.optimizer.step()

    def report(self, **extras) -> dict:
        """This rank's ranks, losses, last gradients and parameters (gathered first under overlapped parameter
        gathers), and `extras`."""
        from megatron.core import parallel_state

        if self.case.overlap and self.case.distributed:  # the last step's parameters, gathered
            for chunk in self.chunks:
                chunk.start_param_sync(force_sync=True)
        return {"dp_rank": parallel_state.get_data_parallel_rank(),
                "pp_rank": parallel_state.get_pipeline_model_parallel_rank(),
                "tp_rank": parallel_state.get_tensor_model_parallel_rank(),
                "losses": self.losses, "grads": self.grads, "params": full_params(self.chunks), **extras}


def _plan_for_microbatches(case: Case, microbatches: int):
    """The case's plan for the layout's chunks per rank (vpp; zb-auto plans any number)."""
    return planned(case.schedule, case.layout.pp, microbatches, case.costs, case.post_validation, case.layout.vpp)


def _ddp_config(case: Case):
    from megatron.core.distributed import DistributedDataParallelConfig

    return DistributedDataParallelConfig(
        use_distributed_optimizer=case.distributed, overlap_grad_reduce=case.overlap,
        overlap_param_gather=case.overlap and case.distributed, bucket_size=BUCKET_ELEMENTS if case.overlap else None)


def _optimizer(case: Case, chunks: list):
    if case.optimizer is None:
        return None
    if case.optimizer == "local":  # each rank's own torch Adam: no reduction whose order depends on the layout
        return torch.optim.Adam([p for chunk in chunks for p in chunk.parameters()], lr=1e-3)
    from megatron.core.optimizer import OptimizerConfig

    settings = dict(lr=1e-3) if case.optimizer == "adam" else dict(lr=0.05, sgd_momentum=0.9)
    return make_optimizer(chunks, OptimizerConfig(
        optimizer=case.optimizer, weight_decay=case.weight_decay, clip_grad=case.clip_grad,
        use_distributed_optimizer=case.distributed, **settings))


# ---------------------------------------------------------------- helpers


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
