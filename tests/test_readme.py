"""The README's commands run as written: every code block parses as bash, names files the repository has, and the
torchrun quickstart passes pretrain_gpt.py's start-up checks at the world size it launches (the last in a process
that imports megatron, as refusal_checks.py does for the examples)."""
from __future__ import annotations

import shlex
import subprocess
from pathlib import Path

import pytest

from tests.launching import REPO
from tests.megatron.refusal_checks import start_up_refusals

README = Path(REPO) / "README.md"


def code_blocks(text: str) -> list[str]:
    """The indented code blocks of a Markdown text (four spaces after a blank line), each as one string."""
    blocks, current, previous_blank = [], [], True
    for line in text.splitlines():
        if line.startswith("    ") and (current or previous_blank):
            current.append(line[4:])
        elif current and not line.strip():
            current.append("")
        elif current:
            blocks.append("\n".join(current).strip())
            current = []
        previous_blank = not line.strip()
    if current:
        blocks.append("\n".join(current).strip())
    return blocks


def commands(block: str) -> list[list[str]]:
    """The block's commands as words: continuation lines joined, `&&` and `;` split."""
    words = shlex.split(block.replace("\\\n", " "), comments=True)
    split, current = [], []
    for word in words:
        if word in ("&&", ";"):
            split.append(current)
            current = []
        else:
            current.append(word)
    return [command for command in split + [current] if command]


BLOCKS = code_blocks(README.read_text())


def test_the_readme_has_its_install_demo_test_and_quickstart_blocks():
    text = "\n".join(BLOCKS)
    for command in ("scripts/install.sh", "scripts/demo.sh", "scripts/test.sh", "torchrun"):
        assert command in text, command


@pytest.mark.parametrize("block", BLOCKS)
def test_every_code_block_parses_as_bash(block):
    done = subprocess.run(["bash", "-n", "-c", block], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("block", BLOCKS)
def test_every_script_a_block_runs_is_in_the_repository(block):
    for words in commands(block):
        for path in (word.split("=")[-1] for word in words if word.endswith((".sh", ".py"))):  # VAR=path too
            assert (Path(REPO) / path).is_file(), f"{path} (in: {' '.join(words)})"


def quickstart() -> tuple[list[str], int]:
    """The torchrun block's pretrain_gpt.py arguments and its world size."""
    (words,) = [words for block in BLOCKS for words in commands(block) if words[0] == "torchrun"]
    script = words.index("pretrain_gpt.py")
    nproc = int(words[words.index("--nproc-per-node") + 1])
    return words[script + 1:], nproc


@pytest.mark.slow
def test_the_quickstart_passes_every_start_up_check_of_pretrain_gpt(tmp_path):
    """megatron's parser and pretrain_gpt.py's start-up checks (flags, layer split, schedule, a trial plan) on the
    README's torchrun command; training it is what tests/megatron/test_pretrain_gpt.py does with these sizes."""
    assert start_up_refusals({"README quickstart": quickstart()}, tmp_path) == {"README quickstart": None}
