"""A mistake megatron's own argument validation catches with a bare assert stops pretrain_gpt.py with one line
naming megatron's check (its file, line and asserted expression), not a traceback on every rank."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = ("--num-layers 2 --hidden-size 8 --num-attention-heads 2 --seq-length 8 --max-position-embeddings 8 "
        "--micro-batch-size 1 --global-batch-size 1 --train-iters 1 --lr 1e-3 --tokenizer-type NullTokenizer "
        "--vocab-size 16 --mock-data").split()


@pytest.mark.slow
def test_a_failed_megatron_assert_is_one_line_naming_megatrons_check(tmp_path):
    env = dict(os.environ, WORLD_SIZE="1", PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run([sys.executable, "pretrain_gpt.py", *TINY, "--save", str(tmp_path / "ckpt")], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=300)
    errors = [line for line in done.stderr.splitlines() if line.startswith("pretrain_gpt.py: error:")]
    assert done.returncode == 2 and len(errors) == 1, done.stderr[-3000:]
    assert "Traceback" not in done.stderr + done.stdout
    assert "megatron's argument check failed at megatron/training/arguments.py:" in errors[0]
    assert "assert args.save_interval is not None" in errors[0]
