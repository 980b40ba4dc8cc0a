"""Multi-process CPU test harness for megatron-core (gloo), shared by the runtime tests: the parent side.

Parent side (no megatron import unless asked for):
    spawn(scenario, world_size, *args, timeout=..., start_method="spawn", **kwargs) -> [result of each rank]
    preload_megatron(training=False)   import megatron once here, then spawn(..., start_method="fork")
                                       saves every rank the multi-second import
    run_cases(run_case, cases, world_size) -> {label: [each rank's report]}   every case in one group of ranks
    merge_by_dp_rank(results) -> {dp_rank: {"losses": {mb: float}, "grads": {name: tensor}, ...}}
    assert_identical(ours, reference)  torch.equal of losses, gradients and parameters per data-parallel replica
Shared with the rank side: ModelSpec (the tiny model), Layout (the model-parallel sizes), strict_messaging() (the
messaging every case runs under), and the device and process-group backend of every rank: rank_device(), in one place.
Rank side (inside a scenario; the CPU backend is installed by `spawn` before the scenario starts), in modules of
their own that import this one:
    process_groups.py   init_parallel_state(tp, pp, vpp, seed) / destroy_parallel_state()
    rank_model.py       the model by global parameter name, batches, forward-backward, DDP, optimizer, full tensors
    training_case.py    Case, CaseRun(case): one training case (what the test modules run); run_layout(...)

Global parameter names count transformer layers over the whole model ("decoder.layers.<global>."), so
PP, VPP and TP layouts of the same `ModelSpec` hold identical weights and can be compared tensor by tensor.
Every case runs in ranks forked for it alone (run_cases): what a case leaves behind ends with its processes.
"""
from __future__ import annotations

import dataclasses
import os
import tempfile
from typing import Callable

import torch
from megatron.zero_bubble.tools.local_ranks import init_group, run_ranks
from tests.megatron.process_groups import destroy_parallel_state

DEFAULT_TIMEOUT_S = 180.0
# Every case's messages go through the stand-in of NCCL's point-to-point (tools/strict_p2p.py): the rules of the model
# the programs are proven on (in order per process group, a batch posted only once the previous one completed, a send
# done only with its receive, a link's first use blocking until the peer's). gloo alone would forgive what NCCL does
# not. A stuck batch fails the case after a minute, naming itself (the watchdog is off here).


def strict_messaging():
    """The messaging options every case's session runs under (training_case.CaseRun)."""
    from functools import partial

    from megatron.zero_bubble.runtime.messaging import MessagingOptions
    from megatron.zero_bubble.tools.strict_p2p import StrictP2P

    return MessagingOptions(p2p=partial(StrictP2P, 60.0), watchdog_timeout_s=0)


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
    # "transformer_engine": megatron's default layers, TE's (its Python over the CPU kernel layer: the process must
    # have installed TE's import hook before importing megatron, as tests/megatron/te_gpt_cases.py does)
    transformer_impl: str = "local"

    def config_overrides(self) -> dict:
        """The TransformerConfig settings this spec adds to the harness's defaults."""
        overrides = {"add_bias_linear": self.add_bias_linear, "sequence_parallel": self.sequence_parallel,
                     "normalization": self.normalization, "ffn_hidden_size": self.ffn_hidden_size,
                     "qk_layernorm": self.qk_layernorm, "mtp_num_layers": self.mtp_num_layers}
        if self.transformer_impl == "transformer_engine":  # as pretrain_gpt.py --zero-bubble-cpu configures it
            from megatron.core.transformer.enums import AttnBackend

            overrides["attention_backend"] = AttnBackend.unfused
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

        if self.transformer_impl == "transformer_engine":
            from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

            assert self.moe_layer_freq is None and self.mtp_num_layers is None, "TE spec: one layer spec for all"
            return get_gpt_layer_with_transformer_engine_spec(self.num_experts, qk_layernorm=self.qk_layernorm)
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
        run_ranks(_rank_main, world_size, result_dir, (scenario, args, kwargs), timeout, start_method,
                  scenario.__name__)
        return [torch.load(os.path.join(result_dir, f"rank{rank}.pt"), weights_only=False)
                for rank in range(world_size)]


def preload_megatron(training: bool = False, transformer_engine: bool = False) -> None:
    """Import megatron-core (and megatron.training) in this process, so that forked ranks inherit it (with TE's
    Python over the CPU kernel layer when `transformer_engine`, else TE hidden)."""
    import importlib

    from megatron.zero_bubble.patches import imports

    imports.install(transformer_engine=transformer_engine)
    for name in ("megatron.core.pipeline_parallel", "megatron.core.models.gpt",
                 "megatron.core.models.gpt.gpt_layer_specs", "megatron.core.distributed", "megatron.core.optimizer"):
        importlib.import_module(name)
    if training:
        importlib.import_module("megatron.training.training")


def _rank_main(rank, world_size, result_dir, scenario, args, kwargs):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world_size), CUDA_DEVICE_MAX_CONNECTIONS="1")
    torch.set_num_threads(1)  # ranks share a few cores; more threads only contend
    device = rank_device()
    if device.cpu_backend:
        from megatron.zero_bubble.patches import cpu_backend

        cpu_backend.install()
    init_group(device.backend, rank, world_size, result_dir)
    finished = False
    try:  # an exception reaches the parent with its traceback through torch.multiprocessing
        result = scenario(*args, **kwargs)
        torch.save(result, os.path.join(result_dir, f"rank{rank}.pt"))
        finished = True
    finally:
        # after a failure the other ranks may never reach a barrier: only tear down, the process ends anyway
        destroy_parallel_state(synchronize=finished)
        torch.distributed.destroy_process_group()


def run_cases(run_case: Callable, cases: list, world_size: int, timeout: float = DEFAULT_TIMEOUT_S,
              transformer_engine: bool = False) -> dict:
    """Every case (with a `label`) in ranks of its own, forked afresh, as a run starts its processes:
    {label: [each rank's report]}. megatron-core is imported here first, once, so that the forks start at once
    (`transformer_engine`: with TE's layers on the CPU kernel layer). `timeout`: seconds for each case."""
    preload_megatron(transformer_engine=transformer_engine)
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
