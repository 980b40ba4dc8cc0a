"""`pretrain_gpt.py --help` prints megatron's flags and ours (megatron-core 0.19.2 ships a help text with a
stray '%' that makes argparse raise; the start-up code escapes it by argparse's own formatting rule)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow
def test_help_lists_megatron_and_zero_bubble_flags():
    done = subprocess.run([sys.executable, "pretrain_gpt.py", "--help"], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    for flag in ("--num-layers", "--enable-zero-bubble", "--zero-bubble-v-schedule", "--allow-padding-num-layers",
                 "--moe-paged-stash-buffer-size-factor-cuda"):
        assert flag in done.stdout
