"""What pretrain_gpt.py and pretrain_hybrid.py share: the token data, the batch, the loss, the forward step and main.

Both train a decoder-only language model on megatron's GPT datasets (its indexed datasets with --data-path, else
mock data); only the model differs, so each entry script keeps its `model_provider` and hands it to `train`.
Imported by the entry scripts after `setup.prepare_process()` (it imports megatron).
"""
from __future__ import annotations

from functools import partial

import torch
from megatron.core import parallel_state
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron.core.enums import ModelType
from megatron.core.utils import get_attr_wrapped_model
from megatron.training import get_args, get_tokenizer, pretrain, print_rank_0
from megatron.training.argument_utils import pretrain_cfg_container_from_args
from megatron.training.utils import get_blend_and_blend_per_split, is_first_or_last_pipeline_stage

from . import arguments, setup
from .init_weights import init_weights_by_global_name

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
    """Megatron's forward_step_func for a decoder-only language model (GPTModel, HybridModel): returns the
    per-token losses and the loss function."""
    vp_stage = get_attr_wrapped_model(model, "vp_stage")
    tokens, labels, loss_mask, attention_mask, position_ids = get_batch(data_iterator, vp_stage)
    output_tensor = model(tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask)
    return output_tensor, partial(loss_func, loss_mask)


# ---------------------------------------------------------------- the model


def init_weights_if_asked(model, args) -> None:
    """--init-weights-by-global-name: every weight from its global name, so that layouts of the same model start
    alike (training/init_weights.py)."""
    if args.init_weights_by_global_name:
        init_weights_by_global_name(
            model, args.seed, parallel_state.get_tensor_model_parallel_rank(),
            parallel_state.get_tensor_model_parallel_world_size(), std=args.init_method_std,
        )


# ---------------------------------------------------------------- main


def train(model_provider, model: str) -> None:
    """Parse and check the command line for `model` ("gpt" or "hybrid": the entry script's model), then megatron's
    `pretrain` with `model_provider`, inside the zero-bubble session the flags ask for."""
    args, options = arguments.parse_and_validate(model)  # megatron's parsing + the zero-bubble checks
    cfg = pretrain_cfg_container_from_args(args)
    with setup.zero_bubble_session(args, options):
        pretrain(cfg, train_valid_test_datasets_provider, ModelType.encoder_or_decoder, forward_step,
                 model_provider=model_provider)
