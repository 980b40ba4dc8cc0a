#!/usr/bin/env python
"""Pretrain a GPT with Megatron's own training loop, optionally with zero-bubble pipeline schedules.

    torchrun --nproc-per-node 4 pretrain_gpt.py <megatron's flags> [--enable-zero-bubble | ...]

Everything but the GPT pieces below (model, data, loss) is megatron.training's `pretrain`: logging,
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

from functools import partial  # noqa: E402

import torch  # noqa: E402
from megatron.core import parallel_state  # noqa: E402
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder  # noqa: E402
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset  # noqa: E402
from megatron.core.enums import ModelType  # noqa: E402
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.utils import get_attr_wrapped_model  # noqa: E402
from megatron.training import get_args, get_tokenizer, pretrain, print_rank_0  # noqa: E402
from megatron.training.argument_utils import (  # noqa: E402
    core_transformer_config_from_args,
    pretrain_cfg_container_from_args,
)
from megatron.training.utils import get_blend_and_blend_per_split, is_first_or_last_pipeline_stage  # noqa: E402

from megatron.zero_bubble.training import arguments, setup, teardown  # noqa: E402
from megatron.zero_bubble.training.init_weights import init_weights_by_global_name  # noqa: E402


# ---------------------------------------------------------------- model


def layer_spec(args):
    """Megatron's local layer spec; Transformer Engine's when it is asked for (and installed)."""
    if args.transformer_impl == "transformer_engine":
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        return get_gpt_layer_with_transformer_engine_spec(
            args.num_experts, args.moe_grouped_gemm, args.qk_layernorm, args.multi_latent_attention
        )
    return get_gpt_layer_local_spec(
        args.num_experts, args.moe_grouped_gemm, args.qk_layernorm, args.multi_latent_attention,
        normalization=args.normalization,
    )


def model_provider(pre_process=True, post_process=True, vp_stage=None, config=None, pg_collection=None):
    """One GPTModel chunk (megatron calls this once per virtual pipeline stage held by this rank)."""
    args = get_args()
    print_rank_0("building GPT model ...")
    config = config if config is not None else core_transformer_config_from_args(args)
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec(args),
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
    if args.init_weights_by_global_name:
        init_weights_by_global_name(
            model, args.seed, parallel_state.get_tensor_model_parallel_rank(),
            parallel_state.get_tensor_model_parallel_world_size(), std=args.init_method_std,
        )
    return model


# ---------------------------------------------------------------- data


def dataset_config(args) -> GPTDatasetConfig:
    blend, blend_per_split = get_blend_and_blend_per_split(args)
    return GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=blend,
        blend_per_split=blend_per_split,
        split=args.split,
        path_to_cache=args.data_cache_path,
        mmap_bin_files=args.mmap_bin_files,
        tokenizer=get_tokenizer(),
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=args.create_attention_mask_in_dataloader,
        num_dataset_builder_threads=args.num_dataset_builder_threads,
        mid_level_dataset_surplus=args.mid_level_dataset_surplus,
    )


def train_valid_test_datasets_provider(train_val_test_num_samples, vp_stage=None):
    """Megatron's GPT datasets (its indexed datasets with --data-path, else mock data).

    Every rank whose chunk takes tokens or computes the loss builds them itself, tensor-parallel ranks
    included (hence `is_distributed`): they draw the same samples, so no broadcast within TP is needed.
    """
    args = get_args()
    config = dataset_config(args)
    dataset_type = MockGPTDataset if config.mock else GPTDataset
    print_rank_0(f"> building train, validation, and test datasets for GPT ({dataset_type.__name__}) ...")
    datasets = BlendedMegatronDatasetBuilder(
        dataset_type, train_val_test_num_samples, lambda: is_first_or_last_pipeline_stage(vp_stage), config
    ).build()
    print_rank_0("> finished creating GPT datasets ...")
    return datasets


train_valid_test_datasets_provider.is_distributed = True


# ---------------------------------------------------------------- forward step and loss


def get_batch(data_iterator, vp_stage=None):
    """This chunk's part of the next microbatch (nothing on chunks that neither embed nor compute the loss)."""
    if not is_first_or_last_pipeline_stage(vp_stage):
        return None, None, None, None, None
    batch = next(data_iterator)
    device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
    batch = {k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()}
    return (batch["tokens"], batch["labels"], batch["loss_mask"], batch.get("attention_mask"),
            batch["position_ids"])


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Sum of the masked per-token losses, the token count, and {'lm loss': [sum, tokens]} for the log."""
    losses = output_tensor.view(-1).float()
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().clone().detach().to(torch.int)
    report = torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])
    return loss, num_tokens, {"lm loss": report}


def forward_step(data_iterator, model):
    """Megatron's forward_step_func for GPT: returns the per-token losses and the loss function."""
    vp_stage = get_attr_wrapped_model(model, "vp_stage")
    tokens, labels, loss_mask, attention_mask, position_ids = get_batch(data_iterator, vp_stage)
    output_tensor = model(tokens, position_ids, attention_mask, labels=labels)
    return output_tensor, partial(loss_func, loss_mask)


# ---------------------------------------------------------------- main


def main():
    args, options = arguments.parse_and_validate()  # megatron's parsing + the zero-bubble checks
    cfg = pretrain_cfg_container_from_args(args)
    with setup.zero_bubble_session(args, options):
        pretrain(cfg, train_valid_test_datasets_provider, ModelType.encoder_or_decoder, forward_step,
                 model_provider=model_provider)


def end_process() -> None:
    """Every process group destroyed before the interpreter ends (training/teardown.py: else a gloo worker thread
    that lags can abort the process at its very end). Only after a run that ended well on this rank."""
    import sys

    teardown.end_distributed(log=lambda line: print(line, file=sys.stderr, flush=True))


if __name__ == "__main__":
    status = None
    try:
        main()
    except SystemExit as stop:  # megatron's early exits (--exit-interval, --exit-duration-in-mins) end well too
        if stop.code not in (None, 0):
            raise
        status = stop.code  # the exception goes at the end of this block, and its traceback's frames (which hold
        # the model, its groups among them) with it
    end_process()
    raise SystemExit(status)
