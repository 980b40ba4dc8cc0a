"""How the transformer layers are laid out over the virtual stages, as far as the zero-bubble flags decide it.

Megatron has three ways to lay out an uneven pipeline: `--pipeline-model-parallel-layout` (a string naming the
layers of every virtual stage in pipeline order, e.g. "Et|tt|tt|tL"), `--decoder-first/last-pipeline-num-layers`,
and `--account-for-embedding/loss-in-pipeline-split`. `--allow-padding-num-layers` (the original zero-bubble
implementation's flag) lets --num-layers not divide into the virtual stages: the middle stages get the layers
that do not divide, the stages at both ends, which also hold the embedding and the LM head with the loss, the
fewest (the original's advice is k*p - 2 layers for the same reason); megatron gets it as a layout string.
"""
from __future__ import annotations

import re

from ..schedules.costs import accounted_layer_counts, even_layer_counts
from ..schedules.layer_costs import GPT_LAYER, LayerOptions
from .hybrid_pattern import pattern_of, stage_layers

# Megatron's flags that lay the layers out themselves (with --allow-padding-num-layers one layout is enough).
LAYOUT_FLAGS = ("pipeline_model_parallel_layout", "decoder_first_pipeline_num_layers",
                "decoder_last_pipeline_num_layers", "account_for_embedding_in_pipeline_split",
                "account_for_loss_in_pipeline_split", "num_layers_per_virtual_pipeline_stage")


def layout_stages(layout: str) -> list[str]:
    """The virtual stages a layout string names, each as its letters ("E", "t", "L", "m"): "|" separates
    stages; "(...)*n" and "x*n" repeat (megatron's grammar, expanded as megatron does, parentheses first)."""
    text = layout.replace(",", "")
    for pattern in (r"\(([^)]+)\)\*(\d+)", r"(.)\*(\d+)"):
        text = re.sub(pattern, lambda match: match.group(1) * int(match.group(2)), text)
    return text.split("|")


def layout_stage_count(layout: str) -> int:
    return len(layout_stages(layout))


def standalone_mtp_rank(layout: str, pipeline_size: int) -> int | None:
    """The pipeline rank, not the last, whose last virtual stage holds the multi-token-prediction layers ("m"):
    megatron's mtp_standalone, read as megatron reads it (virtual stage v of rank r is the layout's stage
    v * pipeline_size + r); None if there is none."""
    stages = layout_stages(layout)
    last_chunk = (len(stages) // pipeline_size - 1) * pipeline_size
    return next((rank for rank in range(pipeline_size - 1) if "m" in stages[last_chunk + rank]), None)


def layout_string(counts: list[int]) -> str:
    """Megatron's layout string for these counts: the embedding on the first stage, the loss on the last."""
    stages = ["t" * count for count in counts]
    stages[0], stages[-1] = "E" + stages[0], stages[-1] + "L"
    return "|".join(stages)


def padding_layout(num_layers: int, stages: int) -> str | None:
    """The layout --allow-padding-num-layers hands megatron for `stages` virtual stages (None: an even split):
    what does not divide goes to the middle stages first (schedules.costs.even_layer_counts, the rule the
    planner's model-shape costs follow too). ValueError when a middle stage would be left without a layer."""
    if num_layers % stages == 0:
        return None
    counts = even_layer_counts(num_layers, stages)
    if min(counts[1:-1], default=1) < 1:
        raise ValueError(f"{num_layers} layers leave a middle stage of {stages} virtual stages empty; give at "
                         f"least {stages - 2} layers")
    return layout_string(counts)


def layer_counts_of(args, stages: int, chunks: int) -> list[int]:
    """Transformer layers of each virtual stage (in virtual-stage order) as megatron lays out the parsed and
    validated `args` for `stages` pipeline ranks of `chunks` model chunks (for a V, its i-th stage is the V's
    virtual stage i: patches/vshape_layout.py reads the same flags)."""
    layers, total = args.num_layers, stages * chunks
    if args.pipeline_model_parallel_layout is not None:
        return [stage.count("t") for stage in layout_stages(str(args.pipeline_model_parallel_layout))]
    first, last = args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers
    if first is not None or last is not None:  # per rank, each rank's layers split evenly over its chunks
        middle = layers - (first or 0) - (last or 0)
        inner = stages - (first is not None) - (last is not None)
        per_rank = [middle // inner if inner else 0] * stages
        per_rank[0] = per_rank[0] if first is None else first
        per_rank[-1] = per_rank[-1] if last is None else last
        return [per_rank[v % stages] // chunks for v in range(total)]
    embedding, loss = bool(args.account_for_embedding_in_pipeline_split), bool(args.account_for_loss_in_pipeline_split)
    return accounted_layer_counts(layers, total, embedding, loss)


def stage_layers_of(args, stages: int, chunks: int) -> list[str]:
    """Each virtual stage's layers by kind, in virtual-stage order, for the planner's costs (schedules/layer_costs.py):
    a hybrid pattern's characters where it places them, else GPT layers ("t") as megatron lays them out."""
    pattern = pattern_of(args)
    if pattern:
        return stage_layers(pattern, stages, args.decoder_first_pipeline_num_layers,
                            args.decoder_last_pipeline_num_layers)
    return [GPT_LAYER * count for count in layer_counts_of(args, stages, chunks)]


def layer_options_of(args) -> LayerOptions:
    """The layer sizes megatron's (validated) args give the planner's costs."""
    return LayerOptions(
        ffn_hidden=getattr(args, "ffn_hidden_size", None), gated_mlp=bool(getattr(args, "swiglu", False)),
        query_groups=args.num_query_groups if getattr(args, "group_query_attention", False) else None,
        experts=getattr(args, "num_experts", None) or 0, moe_topk=getattr(args, "moe_router_topk", None) or 1,
        moe_ffn_hidden=getattr(args, "moe_ffn_hidden_size", None),
        moe_shared_ffn=getattr(args, "moe_shared_expert_intermediate_size", None) or 0,
        **{ours: getattr(args, theirs) for ours, theirs in _MEGATRON_SIZES.items()
           if getattr(args, theirs, None) is not None})


# LayerOptions' Mamba and GDN sizes: megatron's argument names
_MEGATRON_SIZES = {"mamba_state": "mamba_state_dim", "mamba_head_dim": "mamba_head_dim",
                   "mamba_groups": "mamba_num_groups", "mamba_heads": "mamba_num_heads",
                   "gdn_key_head_dim": "linear_key_head_dim", "gdn_value_head_dim": "linear_value_head_dim",
                   "gdn_key_heads": "linear_num_key_heads", "gdn_value_heads": "linear_num_value_heads"}
