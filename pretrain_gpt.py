#!/usr/bin/env python
"""Pretrain a GPT with Megatron's own training loop, optionally with zero-bubble pipeline schedules.

    torchrun --nproc-per-node 4 pretrain_gpt.py <megatron's flags> [--enable-zero-bubble | ...]

Everything but the GPT model below is megatron.training's `pretrain`: logging,
checkpoints (--save / --load), LR schedules, evaluation, tensorboard. The zero-bubble flags (see
`python pretrain_gpt.py --help`, group "zero bubble") pick the pipeline schedule; without them the run
is megatron's own. Without CUDA the CPU backend is installed and gloo is used.
"""
# The process set-up runs before megatron is imported (import shims, CPU backend). It must stay at the
# top: megatron's checkpoint writer starts a process that re-imports this module.
from megatron.zero_bubble.training.arguments import early_check
from megatron.zero_bubble.training.setup import prepare_process

if __name__ == "__main__":
    early_check()  # bad flags, paths and sizes: one line within seconds, before megatron is imported
prepare_process()

from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import (  # noqa: E402
    get_gpt_decoder_block_spec,
    get_gpt_decoder_layer_specs,
    get_gpt_layer_local_spec,
    get_gpt_mtp_block_spec,
)
from megatron.training import get_args, print_rank_0  # noqa: E402
from megatron.training.argument_utils import core_transformer_config_from_args  # noqa: E402

from megatron.zero_bubble.training import language_model, teardown  # noqa: E402


# ---------------------------------------------------------------- model


def layer_spec(args, config, vp_stage=None):
    """The layer specs megatron.training builds: for MoE models the decoder block spec (dense and MoE layers as
    --moe-layer-freq lays them out), else one layer spec for every layer; megatron's local modules, or Transformer
    Engine's when they are asked for (and installed)."""
    use_te = args.transformer_impl == "transformer_engine"
    if args.num_experts:
        return get_gpt_decoder_block_spec(config, use_transformer_engine=use_te, normalization=args.normalization,
                                          qk_l2_norm=args.qk_l2_norm, vp_stage=vp_stage)
    if use_te:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        return get_gpt_layer_with_transformer_engine_spec(
            args.num_experts, args.moe_grouped_gemm, args.qk_layernorm, args.multi_latent_attention,
            qk_l2_norm=args.qk_l2_norm,
        )
    return get_gpt_layer_local_spec(
        args.num_experts, args.moe_grouped_gemm, args.qk_layernorm, args.multi_latent_attention,
        normalization=args.normalization, qk_l2_norm=args.qk_l2_norm,
    )


def mtp_spec(args, config, vp_stage=None):
    """The multi-token-prediction block (--mtp-num-layers) as megatron.training builds it: its layers are the model's
    last decoder layer; None without MTP (and on the stages that hold none of its layers)."""
    if not args.mtp_num_layers:
        return None
    use_te = args.transformer_impl == "transformer_engine"
    last_layer = get_gpt_decoder_layer_specs(config, use_transformer_engine=use_te, normalization=args.normalization,
                                             qk_l2_norm=args.qk_l2_norm, vp_stage=vp_stage)[-1]
    return get_gpt_mtp_block_spec(config, last_layer, use_transformer_engine=use_te, vp_stage=vp_stage)


def model_provider(pre_process=True, post_process=True, vp_stage=None, config=None, pg_collection=None):
    """One GPTModel chunk (megatron calls this once per virtual pipeline stage held by this rank)."""
    args = get_args()
    print_rank_0("building GPT model ...")
    config = config if config is not None else core_transformer_config_from_args(args)
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec(args, config, vp_stage),
        mtp_block_spec=mtp_spec(args, config, vp_stage),
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        fp16_lm_cross_entropy=args.fp16_lm_cross_entropy,
        parallel_output=True,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base,
        rope_scaling=args.use_rope_scaling,
        pg_collection=pg_collection,
        vp_stage=vp_stage,
    )
    language_model.init_weights_if_asked(model, args)
    return model


# ---------------------------------------------------------------- main


def main():
    language_model.train(model_provider, "gpt")


if __name__ == "__main__":
    teardown.run_to_end(main)  # every process group destroyed before the interpreter ends
