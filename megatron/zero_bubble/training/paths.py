"""The files and directories a run reads and writes, checked at start-up (before megatron is imported, too).

`check_input_files`: megatron's indexed datasets, the data-args files, the tokenizer's files exist;
`check_paths`: the directories the run writes into can be created and written to. Refusals are StartupRefusals.
"""
from __future__ import annotations

import os
import tempfile

from .flags import StartupRefusal


def _remote(path: str) -> bool:
    return "://" in path  # object storage (msc://, s3://): megatron's to reach


def check_input_files(args) -> None:
    """Files the run reads: megatron's indexed datasets (PREFIX.bin and PREFIX.idx for every --data-path
    prefix), the data-args files and the tokenizer's vocabulary and merges."""
    paths = []
    for flag in ("data_path", "train_data_path", "valid_data_path", "test_data_path"):
        paths += list(getattr(args, flag, None) or [])
    for prefix in paths:
        if _is_number(prefix) or _remote(prefix):
            continue  # a blend weight
        missing = [prefix + suffix for suffix in (".bin", ".idx") if not os.path.exists(prefix + suffix)]
        if missing:
            raise StartupRefusal(
                f"--data-path: {', '.join(missing)} {'does not exist' if len(missing) == 1 else 'do not exist'}; "
                f"pass the prefix of a megatron indexed dataset (PREFIX.bin and PREFIX.idx), or drop --data-path "
                f"for mock data"
            )
    for name in ("data_args_path", "per_split_data_args_path", "vocab_file", "merge_file"):
        path = getattr(args, name, None)
        if path and not _remote(path) and not os.path.isfile(path):
            flag = "--" + name.replace("_", "-")
            what = "is a directory" if os.path.isdir(path) else "does not exist"
            raise StartupRefusal(f"{flag} {path} {what}; pass an existing file or drop {flag}")


# Directories the run writes into (megatron's and ours): created and written to once at start-up.
WRITTEN_DIRECTORIES = ("zero_bubble_dump_schedule", "save", "tensorboard_dir", "data_cache_path")


def check_paths(args) -> None:
    """Directories the run writes into must be creatable and writable before anything starts."""
    for name in WRITTEN_DIRECTORIES:
        path = getattr(args, name, None)
        if path and not _remote(path):
            _writable_directory(path, "--" + name.replace("_", "-"))


def _writable_directory(path: str, flag: str) -> None:
    """Create `path` (with its parents) and write a file into it, or refuse naming the flag."""
    fix = "pass a directory you can write to"
    existing = os.path.abspath(path)
    while not os.path.exists(existing) and os.path.dirname(existing) != existing:
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise StartupRefusal(f"{flag} {path}: cannot create the directory ({existing} is a file); {fix}")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as error:
        raise StartupRefusal(f"{flag} {path}: cannot create the directory ({error.strerror}); {fix}") from None
    try:
        with tempfile.NamedTemporaryFile(dir=path, prefix=".pretrain_gpt-write-check-"):
            pass
    except OSError as error:
        raise StartupRefusal(f"{flag} {path}: cannot write into the directory ({error.strerror}); {fix}") from None


def _is_number(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False
