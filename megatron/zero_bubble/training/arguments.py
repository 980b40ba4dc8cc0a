"""The zero-bubble command line of `pretrain_gpt.py`: flags (flags.py), start-up checks (checks.py, model_options.py),
the checks before megatron's import (early.py) and the one-line stop (refusal.py), put together here.

`parse_and_validate()` parses the command line once without megatron's validation, refuses bad combinations
with one line naming the flag and the fix (`StartupRefusal`), then runs megatron's own `parse_and_validate_args`.
Without any zero-bubble flag the run is megatron's own.
"""
from __future__ import annotations

import os
import sys
import traceback

from ..schedules.planners import natural_chunks
from .checks import ZeroBubbleOptions, padding_chunks
from .checks import check as check_flags_and_schedule
from .devices import place_ranks
from .hybrid_checks import GPT, check_entry_model, check_layers, check_pattern, normalize
from .hybrid_pattern import pattern_of
from .layer_layout import padding_layout
from .model_options import check_model_options
from .early import EARLY_MEGATRON_FLAGS, check_early, early_check, early_parser
from .flags import PIPELINE_SCHEDULES, SPLIT_BACKWARD_SCHEDULES, StartupRefusal, add_arguments, cuda_available
from .refusal import EXIT_REFUSED, refuse

__all__ = ["EXIT_REFUSED", "PIPELINE_SCHEDULES", "SPLIT_BACKWARD_SCHEDULES", "StartupRefusal", "ZeroBubbleOptions",
           "EARLY_MEGATRON_FLAGS", "add_arguments", "check", "check_early", "early_check", "early_parser",
           "megatron_defaults", "parse_and_validate", "refuse"]


def check(args, argv: list[str], model: str = GPT) -> ZeroBubbleOptions | None:
    """Every start-up check on the parsed command line: the model the entry script builds (`model`: "gpt" or
    "hybrid") and its options (model_options.py, hybrid_checks.py), then the flags and the schedule (checks.py's
    `check`, which returns the run's ZeroBubbleOptions, None for megatron's own schedule)."""
    check_entry_model(args, model)
    normalize(args)  # the layer count and MTP depths a hybrid pattern gives, as megatron derives them
    check_pattern(args)
    check_layers(args, cuda_available())
    check_model_options(args)
    return check_flags_and_schedule(args, argv)


def megatron_defaults(options: ZeroBubbleOptions | None, args) -> dict:
    """Values handed to megatron as `args_defaults` (used only where the command line leaves them unset): the
    layout --allow-padding-num-layers asks for, or a V schedule's two chunks per rank, unless the command line
    lays the chunks out itself (megatron allows one of its three virtual-pipeline flags at a time)."""
    schedule = options.schedule if options is not None else None
    if args.allow_padding_num_layers:
        stages = args.pipeline_model_parallel_size * padding_chunks(args, schedule)
        layout = padding_layout(args.num_layers, stages)
        if layout is not None:  # the layout names the chunks per rank too (megatron takes no other count with it)
            return {"pipeline_model_parallel_layout": layout}
    laid_out = (args.num_virtual_stages_per_pipeline_rank, args.num_layers_per_virtual_pipeline_stage,
                args.pipeline_model_parallel_layout, pattern_of(args))  # a hybrid pattern's | give the chunks
    if schedule is None or natural_chunks(schedule) == 1 or any(value is not None for value in laid_out):
        return {}
    return {"num_virtual_stages_per_pipeline_rank": natural_chunks(schedule)}


def megatron_check_failed(failed: AssertionError) -> str:
    """One line for an assert of megatron's argument validation: its file and line, the asserted expression and
    megatron's message if it gave one."""
    frame = traceback.extract_tb(failed.__traceback__)[-1]
    parts = frame.filename.replace(os.sep, "/").rsplit("/megatron/", 1)
    where = f"megatron/{parts[1]}" if len(parts) == 2 else os.path.basename(frame.filename)
    message = " ".join(str(failed).split())
    return (f"megatron's argument check failed at {where}:{frame.lineno}: {(frame.line or '').strip()}"
            + (f" ({message})" if message else "") + "; change the flags it names")


def parse_and_validate(model: str = GPT):
    """megatron's parse_and_validate_args with the zero-bubble flags, for the entry script building `model` ("gpt" or
    "hybrid"); refuses bad input with one line.

    Returns (megatron's args, ZeroBubbleOptions or None for megatron's own schedule).
    """
    from megatron.training.arguments import parse_and_validate_args, parse_args

    try:  # our parser's errors (megatron's flags included: see add_arguments) and the checks raise StartupRefusal
        parsed = parse_args(add_arguments)
        options = check(parsed, sys.argv[1:], model)  # megatron's parse_args reads the same command line
        args = parse_and_validate_args(add_arguments, args_defaults=megatron_defaults(options, parsed))
    except StartupRefusal as refusal:
        refuse(str(refusal))
    except AssertionError as failed:  # megatron validates many flag combinations with a bare assert
        refuse(megatron_check_failed(failed))
    place_ranks(args)
    if options is not None and options.post_validation:
        # megatron's default result validation reduces over every rank each iteration: a global barrier
        args.rerun_mode = "disabled"
    if args.padded_vocab_size is None:  # megatron's FLOP count reads it; the model needs it
        from megatron.training import get_tokenizer
        from megatron.training.vocab_utils import calculate_padded_vocab_size

        args.padded_vocab_size = calculate_padded_vocab_size(
            get_tokenizer().vocab_size, args.make_vocab_size_divisible_by, args.tensor_model_parallel_size
        )
    return args, options
