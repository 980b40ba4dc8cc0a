#!/usr/bin/env python
"""Pretrain a hybrid model (megatron-core's HybridModel) with Megatron's own training loop, optionally with
zero-bubble pipeline schedules.

    torchrun --nproc-per-node 2 pretrain_hybrid.py --hybrid-layer-pattern '*-*-|*-*-' <megatron's flags> \
        [--enable-zero-bubble | --pipeline-schedule zb-h1 | --zero-bubble-v-schedule | ...]

`--hybrid-layer-pattern` names the layers (`*` attention, `-` MLP, `E` MoE, `M` Mamba, `G` GDN, ...) and, with `|`,
the pipeline stages: p segments give one model chunk per rank, 2p segments two (interleaved, or the V's virtual
stages in order with --zero-bubble-v-schedule). Everything else is pretrain_gpt.py's: the same flags, checks,
data, loss and zero-bubble session (megatron/zero_bubble/training/language_model.py); docs/hybrid.md says what
runs where. Layers: megatron's hybrid spec (Transformer Engine's modules) with --transformer-impl
transformer_engine, a user's with --spec, else megatron's local modules for `*`, `-` and `E` (the CPU's).
"""
# The process set-up runs before megatron is imported (import shims, CPU backend). It must stay at the
# top: megatron's checkpoint writer starts a process that re-imports this module.
from megatron.zero_bubble.training.arguments import early_check
from megatron.zero_bubble.training.setup import prepare_process

if __name__ == "__main__":
    early_check(model="hybrid")  # bad flags, paths, sizes and patterns: one line, before megatron is imported
prepare_process()

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_submodules  # noqa: E402
from megatron.core.models.hybrid.hybrid_block import HybridStack, HybridStackSubmodules  # noqa: E402
from megatron.core.models.hybrid.hybrid_model import HybridModel  # noqa: E402
from megatron.core.ssm.mlp_layer import MLPLayer  # noqa: E402
from megatron.core.transformer.identity_op import IdentityOp  # noqa: E402
from megatron.core.transformer.spec_utils import ModuleSpec, build_module, import_module  # noqa: E402
from megatron.core.transformer.transformer_layer import (  # noqa: E402
    MoETransformerLayer,
    TransformerLayer,
    TransformerLayerSubmodules,
)
from megatron.training import get_args, print_rank_0  # noqa: E402
from megatron.training.argument_utils import core_transformer_config_from_args  # noqa: E402

from megatron.zero_bubble.training import language_model, teardown  # noqa: E402


# ---------------------------------------------------------------- the local layers' spec


class HybridStackWithLocalNorm(HybridStack):
    """megatron's HybridStack whose final norm is megatron's local norm (`final_norm`, the layers' own): megatron's
    stack builds it with Transformer Engine's TENorm whatever the layer spec. Same module names and order."""

    def __init__(self, *args, final_norm=None, post_layer_norm: bool = True, **kwargs):
        super().__init__(*args, post_layer_norm=False, **kwargs)
        self.post_layer_norm = post_layer_norm  # forward reads it: norm the last stage's output
        if self.post_process and post_layer_norm:
            self.final_norm = build_module(final_norm, config=self.config, hidden_size=self.config.hidden_size,
                                           eps=self.config.layernorm_epsilon)


def local_stack_spec(args) -> ModuleSpec:
    """The hybrid stack of megatron's local modules (as its GPT local spec builds them): attention `*` is the
    GPT layer's attention half (input norm, attention, residual), MLP `-` its MLP half, MoE `E` the MoE half of
    megatron's local MoE layer (SequentialMLP experts)."""
    norms = dict(normalization=args.normalization)
    dense = get_gpt_layer_local_submodules(qk_layernorm=args.qk_layernorm, qk_l2_norm=args.qk_l2_norm, **norms)
    attention = TransformerLayerSubmodules(input_layernorm=dense.input_layernorm, self_attention=dense.self_attention,
                                           self_attn_bda=dense.self_attn_bda)
    mlp = TransformerLayerSubmodules(pre_mlp_layernorm=dense.pre_mlp_layernorm, mlp=dense.mlp, mlp_bda=dense.mlp_bda)
    moe_layer = IdentityOp
    if args.num_experts:
        moe = get_gpt_layer_local_submodules(num_experts=args.num_experts, moe_grouped_gemm=args.moe_grouped_gemm,
                                             **norms)
        moe_layer = ModuleSpec(module=MoETransformerLayer, submodules=TransformerLayerSubmodules(
            pre_mlp_layernorm=moe.pre_mlp_layernorm, mlp=moe.mlp, mlp_bda=moe.mlp_bda))
    return ModuleSpec(module=HybridStackWithLocalNorm, params={"final_norm": dense.input_layernorm},
                      submodules=HybridStackSubmodules(
                          attention_layer=ModuleSpec(module=TransformerLayer, submodules=attention),
                          mlp_layer=ModuleSpec(module=MLPLayer, submodules=mlp), moe_layer=moe_layer))


def stack_spec(args) -> ModuleSpec:
    """--spec if given; megatron's hybrid spec for Transformer Engine (its inference spec for inference_optimized);
    else the local modules' spec."""
    if args.spec is not None:
        return import_module(args.spec)
    if args.transformer_impl == "local":
        return local_stack_spec(args)
    from megatron.core.models.hybrid import hybrid_layer_specs

    if args.transformer_impl == "inference_optimized":
        return hybrid_layer_specs.hybrid_inference_stack_spec
    return hybrid_layer_specs.hybrid_stack_spec


# ---------------------------------------------------------------- model


def model_provider(pre_process=True, post_process=True, vp_stage=None, config=None, pg_collection=None):
    """One HybridModel chunk (megatron calls this once per virtual pipeline stage held by this rank)."""
    args = get_args()
    print_rank_0("building hybrid model ...")
    config = config if config is not None else core_transformer_config_from_args(args)
    model = HybridModel(
        config=config,
        hybrid_stack_spec=stack_spec(args),
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        hybrid_layer_pattern=args.hybrid_layer_pattern,
        pre_process=pre_process,
        post_process=post_process,
        fp16_lm_cross_entropy=args.fp16_lm_cross_entropy,
        parallel_output=True,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base,
        seq_len_interpolation_factor=args.rotary_seq_len_interpolation_factor,
        pg_collection=pg_collection,
        vp_stage=vp_stage,
    )
    language_model.init_weights_if_asked(model, args)
    return model


# ---------------------------------------------------------------- main


def main():
    language_model.train(model_provider, "hybrid")


if __name__ == "__main__":
    teardown.run_to_end(main)  # every process group destroyed before the interpreter ends
