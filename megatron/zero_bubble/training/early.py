"""The checks before megatron is imported (top of pretrain_gpt.py: a second, not minutes, under torchrun).

`early_check()` parses our flags and the few megatron flags it needs and refuses what needs no megatron: bad
values, conflicting flags, directories that cannot be written, missing input files, model-parallel sizes that
divide neither the processes nor the layers; one line, printed once by rank 0 (`refuse`).
"""
from __future__ import annotations

import argparse
import os
import sys

from ..schedules.planners import natural_chunks
from .checks import nearest_multiples, check_flags
from .paths import check_input_files, check_paths
from .devices import check_device_choice
from .flags import StartupRefusal, add_zero_bubble_flags, given, refuse_argparse_error
from .hybrid_checks import GPT, check_entry_model, check_pattern, normalize
from .hybrid_pattern import pattern_of
from .refusal import refuse

# Megatron's flags that the checks before megatron's import read, declared as megatron-core 0.19.2 declares
# them (same destination, type, nargs and action: tests compare them with megatron's parser), so that the
# early parse reads them exactly as megatron will.
_COUNTS = ("--num-layers", "--num-virtual-stages-per-pipeline-rank", "--num-layers-per-virtual-pipeline-stage",
           "--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers", "--mtp-num-layers")
_SIZES = ("--pipeline-model-parallel-size", "--tensor-model-parallel-size", "--context-parallel-size")  # default 1
_STRINGS = ("--pipeline-model-parallel-layout", "--hybrid-layer-pattern", "--hybrid-override-pattern", "--save",
            "--tensorboard-dir", "--data-args-path", "--per-split-data-args-path", "--vocab-file", "--merge-file",
            "--yaml-cfg")
_PATH_LISTS = ("--data-path", "--train-data-path", "--valid-data-path", "--test-data-path")
_SWITCHES = ("--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split",
             "--use-checkpoint-args")
EARLY_MEGATRON_FLAGS = {
    **{flag: {"type": int} for flag in _COUNTS},
    **{flag: {"type": int, "default": 1} for flag in _SIZES},
    **{flag: {"type": str} for flag in _STRINGS},
    "--data-cache-path": {},  # megatron declares it without a type
    **{flag: {"nargs": "*"} for flag in _PATH_LISTS},
    **{flag: {"action": "store_true"} for flag in _SWITCHES},
}
# Flags that lay the layers out unevenly over the stages: the divisibility of --num-layers is megatron's to check.
_UNEVEN_SPLIT = ("decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers",
                 "pipeline_model_parallel_layout", "account_for_embedding_in_pipeline_split",
                 "account_for_loss_in_pipeline_split")


def early_parser() -> argparse.ArgumentParser:
    """Our flags and the few megatron flags the early checks read; everything else is left for megatron."""
    parser = argparse.ArgumentParser(prog="pretrain_gpt.py", add_help=False, allow_abbrev=False)
    parser.error = refuse_argparse_error
    add_zero_bubble_flags(parser)
    for flag, keywords in EARLY_MEGATRON_FLAGS.items():
        parser.add_argument(flag, **keywords)
    return parser


def early_check(argv: list[str] | None = None, model: str = GPT) -> None:
    """What can be refused before megatron is even imported (a second, not minutes, under torchrun): our flags'
    values and combinations, paths the run reads or writes, and model-parallel sizes that divide neither the
    processes nor the layers. Prints one line on rank 0 and exits 2 (see `refuse`)."""
    try:
        check_early(sys.argv[1:] if argv is None else argv, model)
    except StartupRefusal as refusal:
        refuse(str(refusal))


def check_early(argv: list[str], model: str = GPT) -> None:
    """The checks of `early_check` for the entry script building `model` ("gpt", "hybrid"); raises StartupRefusal."""
    args, _ = early_parser().parse_known_args(argv)
    check_entry_model(args, model)
    if "--help" not in argv and "-h" not in argv:  # the help prints on any machine
        check_device_choice(args)
    check_paths(args)
    check_input_files(args)
    if args.yaml_cfg:
        _check_yaml(argv)
    if args.yaml_cfg or args.use_checkpoint_args:
        return  # the sizes and the layer count may come from the YAML file or the checkpoint: megatron's to check
    _check_world_size(args)
    normalize(args)  # a hybrid pattern's layer count
    check_pattern(args)
    schedule, _ = check_flags(args)
    _check_layer_split(args, schedule)


def _check_yaml(argv: list[str]) -> None:
    """megatron's --yaml-cfg replaces every command-line flag by the YAML file's (its experimental YAML arguments):
    zero-bubble flags given with it would be dropped unseen, and the checks that read the command line skipped."""
    ours = argparse.ArgumentParser(add_help=False)
    add_zero_bubble_flags(ours)
    for action in ours._actions:
        for option in action.option_strings:
            if given(argv, option):
                raise StartupRefusal(f"--yaml-cfg makes megatron ignore the command line, {option} with it (its YAML "
                                     f"arguments replace every flag); pass megatron's flags on the command line "
                                     f"instead of --yaml-cfg")


def _check_world_size(args) -> None:
    tp, pp, cp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.context_parallel_size
    world = int(os.environ.get("WORLD_SIZE", "1"))  # as megatron reads it
    if world % (tp * pp * cp):
        launch = " (launch with torchrun --nproc-per-node N)" if world == 1 else ""
        raise StartupRefusal(
            f"--tensor-model-parallel-size {tp} x --pipeline-model-parallel-size {pp}"
            + (f" x --context-parallel-size {cp}" if cp > 1 else "")
            + f" = {tp * pp * cp} does not divide the {world} processes{launch}; choose sizes whose product "
            f"divides the process count (the rest is data parallel)")


def _check_layer_split(args, schedule: str | None) -> None:
    """An even split of --num-layers over the pipeline stages (and model chunks) must come out whole."""
    pp, layers = args.pipeline_model_parallel_size, args.num_layers
    if not layers or pp < 2 or args.num_layers_per_virtual_pipeline_stage is not None:
        return
    if args.allow_padding_num_layers or any(getattr(args, name) for name in _UNEVEN_SPLIT) or pattern_of(args):
        return  # a hybrid pattern's segments were checked by check_pattern
    chunks = args.num_virtual_stages_per_pipeline_rank or (natural_chunks(schedule) if schedule else 1)
    if layers % (pp * chunks):
        what = f"--pipeline-model-parallel-size {pp}"
        if args.num_virtual_stages_per_pipeline_rank:
            what += f" x --num-virtual-stages-per-pipeline-rank {chunks}"
        elif chunks > 1:
            what += f" x {chunks} model chunks per rank ({schedule})"
        raise StartupRefusal(f"--num-layers {layers} is not divisible by {what} = {pp * chunks}; use --num-layers "
                             f"{nearest_multiples(layers, pp * chunks)}")
