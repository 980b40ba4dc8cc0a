"""The split check through pretrain_gpt.py (torchrun, 2 ranks, PP=2, CPU): a deliberately wrong W
(tests/megatron/split_check_wrong_w_driver.py) stops the run with exit status 2 and one line naming the layer, no
traceback of a rank. (That it passes by default with one line on rank 0 is checked by tests/test_gpu_check.py's run
on CPU, and that it leaves training as it was by every run of test_pretrain_gpt.py.)"""
from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = ("--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 "
        "--micro-batch-size 2 --global-batch-size 8 --tokenizer-type NullTokenizer --vocab-size 128 --mock-data "
        "--train-iters 2 --lr 1e-3 --num-workers 0 --eval-iters 0 --eval-interval 1000 --log-interval 1 "
        "--pipeline-model-parallel-size 2 --pipeline-schedule zb-h1").split()


def _torchrun(script: str, flags: list[str]) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    env.pop("CUDA_VISIBLE_DEVICES", None)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(port),
               script, *flags]
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_a_wrong_w_stops_pretrain_gpt_with_one_line_naming_the_layer():
    done = _torchrun("tests/megatron/split_check_wrong_w_driver.py", TINY)
    errors = [line for line in done.stderr.splitlines() if line.startswith("pretrain_gpt.py: error:")]
    assert done.returncode != 0 and len(errors) == 1, done.stderr[-3000:]
    # no rank's traceback (torchrun's own report that its processes exited with code 2 follows the line)
    assert "exitcode  : 2" in done.stderr and "SplitCheckFailed" not in done.stderr + done.stdout
    assert done.stderr.count("Traceback") == done.stderr.count("ChildFailedError:")
    assert errors[0].startswith("pretrain_gpt.py: error: zero-bubble: split check failed on rank 1, chunk 0: the "
                                "gradient of decoder.layers.0.mlp.linear_fc1.weight differs between megatron's fused "
                                "backward and B then W by up to 0.001"), errors[0]
