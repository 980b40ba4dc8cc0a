"""What `zb-schedule advise` knows of a training run: the model, its parallel layout, its numerics and kernels, as
read from a pretrain_gpt.py command line (command_line.py). Plain data; no torch, no megatron.

Sizes are the whole model's (heads, hidden size, ...); what one GPU holds is worked out from them and the layout by
parameters.py (weights, gradients, optimizer state) and activations.py (what a microbatch leaves for backward).
"""
from __future__ import annotations

from dataclasses import astuple, dataclass, field
from types import SimpleNamespace

from ..schedules.costs import even_layer_counts
from ..training.layer_layout import layer_counts_of

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}


@dataclass(frozen=True)
class Moe:
    """Mixture of experts: every layer whose entry in `layers` is True has a router and `experts` experts."""

    experts: int
    topk: int
    ffn_hidden: int  # of one expert
    shared_ffn_hidden: int  # of the shared experts together (0: none)
    layers: tuple[bool, ...]  # per transformer layer: MoE (True) or dense MLP (False)
    grouped_gemm: bool = False
    shared_expert_gate: bool = False


@dataclass(frozen=True)
class ModelShape:
    layers: int
    hidden: int
    ffn_hidden: int
    heads: int
    query_groups: int  # = heads without grouped-query attention
    kv_channels: int  # per head
    seq_length: int
    vocab: int  # padded as megatron pads it (a multiple of --make-vocab-size-divisible-by x TP)
    max_position_embeddings: int
    swiglu: bool = False
    normalization: str = "LayerNorm"  # or "RMSNorm"
    linear_bias: bool = True
    qkv_bias: bool = True
    qk_layernorm: bool = False
    tied_embeddings: bool = True
    position_embedding: str = "learned_absolute"  # "rope", "none", ...
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    moe: Moe | None = None

    def is_moe_layer(self, layer: int) -> bool:
        return self.moe is not None and self.moe.layers[layer]


@dataclass(frozen=True)
class LayerPlacement:
    """Megatron's flags that decide which layers each virtual stage holds (training/layer_layout.py reads them)."""

    num_layers: int
    pipeline_model_parallel_layout: str | None = None
    decoder_first_pipeline_num_layers: int | None = None
    decoder_last_pipeline_num_layers: int | None = None
    account_for_embedding_in_pipeline_split: bool = False
    account_for_loss_in_pipeline_split: bool = False
    allow_padding_num_layers: bool = False

    def counts(self, stages: int, chunks: int) -> list[int] | None:
        """Layers of each of the stages x chunks virtual stages (virtual-stage order), None where these flags
        cannot lay them out so (a layout string names another number of stages, the layers do not divide)."""
        if self.allow_padding_num_layers and self.pipeline_model_parallel_layout is None:
            counts = even_layer_counts(self.num_layers, stages * chunks)  # what the flag hands megatron
        else:
            counts = layer_counts_of(SimpleNamespace(**self.__dict__), stages, chunks)
            uneven = (self.pipeline_model_parallel_layout, self.decoder_first_pipeline_num_layers,
                      self.decoder_last_pipeline_num_layers, self.account_for_embedding_in_pipeline_split or None,
                      self.account_for_loss_in_pipeline_split or None)
            if all(flag is None for flag in uneven) and self.num_layers % (stages * chunks):
                return None
        if len(counts) != stages * chunks or sum(counts) != self.num_layers or min(counts) < 0:
            return None
        return counts


@dataclass(frozen=True)
class ParallelLayout:
    tp: int
    pp: int
    dp: int
    cp: int = 1
    ep: int = 1
    etp: int = 1  # expert tensor parallel size
    chunks: int = 1  # model chunks per rank the command line asks for (virtual pipeline size, or 1)
    sequence_parallel: bool = False
    micro_batch: int = 1
    global_batch: int = 1
    placement: LayerPlacement | None = None

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.cp * self.dp

    @property
    def microbatches(self) -> int:
        """Microbatches per pipeline in one iteration (m)."""
        return self.global_batch // (self.micro_batch * self.dp)

    @property
    def expert_dp(self) -> int:
        """Replicas of each expert weight (the expert data-parallel size): the GPUs of one pipeline stage over the
        expert model-parallel ones."""
        return self.tp * self.cp * self.dp // (self.ep * self.etp)


@dataclass(frozen=True)
class Numerics:
    params: str = "fp32"  # "fp32", "bf16" or "fp16": weights and activations
    fp8: str | None = None  # --fp8-format (Transformer Engine's linear layers in fp8)
    fp8_param_gather: bool = False
    grad: str = "fp32"  # megatron DDP's gradient buffer (main_grad)
    optimizer: str = "adam"  # or "sgd"
    sgd_momentum: bool = True
    distributed_optimizer: bool = False
    main_params: str | None = None  # the optimizer's fp32 copy of 16-bit weights (None: none)
    exp_avg: str = "fp32"
    exp_avg_sq: str = "fp32"
    softmax_in_fp32: bool = False  # --attention-softmax-in-fp32 (unfused attention only)

    @property
    def activation_bytes(self) -> int:
        return DTYPE_BYTES[self.params]


@dataclass(frozen=True)
class Kernels:
    """Which implementations run, as far as they change what is kept for backward."""

    device: str = "cuda"  # "cpu" with --zero-bubble-cpu
    transformer_impl: str = "transformer_engine"  # or "local"
    flash_attention: bool = True  # TE's fused/flash attention: no s x s scores kept
    fused_activation: bool = True  # megatron's bias-GeLU / bias-SwiGLU fusions

    def mask_bytes(self, activation_bytes: int) -> int:
        """A dropout mask per element: CUDA keeps a bool; the CPU's dropout multiplies by a mask of the data's type."""
        return 1 if self.device == "cuda" else activation_bytes


@dataclass(frozen=True)
class Recompute:
    granularity: str | None = None  # None, "selective" or "full"
    method: str | None = None  # "uniform" or "block" (full)
    num_layers: int | None = None
    modules: tuple[str, ...] = ()  # selective: megatron's --recompute-modules
    distribute_saved: bool = False  # --distribute-saved-activations: the checkpoints split over TP


@dataclass(frozen=True)
class Run:
    model: ModelShape
    layout: ParallelLayout
    numerics: Numerics = Numerics()
    kernels: Kernels = Kernels()
    recompute: Recompute = Recompute()
    attention_mask_in_batch: bool = True  # megatron's dataloader makes a b x s x s mask (--create-attention-mask-...)
    notes: tuple[str, ...] = ()  # what advise assumed or left out, said with its output
    argv: tuple[str, ...] = field(default=(), compare=False)  # the pretrain_gpt.py arguments it was read from


class Tally:
    """A frozen dataclass of byte or parameter counts that add field by field and scale together."""

    def __add__(self, other):
        return type(self)(*(a + b for a, b in zip(astuple(self), astuple(other))))

    def scaled(self, factor: float):
        return type(self)(*(a * factor for a in astuple(self)))
