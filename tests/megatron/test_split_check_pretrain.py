"""The split check through pretrain_gpt.py (torchrun, 2 ranks, PP=2, CPU): a deliberately wrong W
(tests/megatron/split_check_wrong_w_driver.py) stops the run with exit status 2 and one line naming the layer, no
traceback of a rank. (That it passes by default with one line on rank 0 is checked by tests/test_gpu_check.py's run
on CPU, and that it leaves training as it was by every run of test_pretrain_gpt.py.)"""
from __future__ import annotations

import pytest

from tests.launching import torchrun

TINY = ("--zero-bubble-cpu --num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 "
        "--micro-batch-size 2 --global-batch-size 8 --tokenizer-type NullTokenizer --vocab-size 128 --mock-data "
        "--train-iters 2 --lr 1e-3 --num-workers 0 --eval-iters 0 --eval-interval 1000 --log-interval 1 "
        "--pipeline-model-parallel-size 2 --pipeline-schedule zb-h1").split()


@pytest.fixture(scope="module")
def wrong_w_run():
    return torchrun(2, ["tests/megatron/split_check_wrong_w_driver.py", *TINY], timeout=300)


@pytest.mark.slow
def test_a_wrong_w_stops_pretrain_gpt_with_one_line_naming_the_layer(wrong_w_run):
    done = wrong_w_run
    errors = [line for line in done.stderr.splitlines() if line.startswith("pretrain_gpt.py: error:")]
    assert done.returncode != 0 and len(errors) == 1, done.stderr[-3000:]
    # no rank's traceback (torchrun's own report that its processes exited with code 2 follows the line)
    assert "exitcode  : 2" in done.stderr and "SplitCheckFailed" not in done.stderr + done.stdout
    assert done.stderr.count("Traceback") == done.stderr.count("ChildFailedError:")
    assert errors[0].startswith("pretrain_gpt.py: error: zero-bubble: split check failed on rank 1, chunk 0: the "
                                "gradient of decoder.layers.0.mlp.linear_fc1.weight differs between megatron's fused "
                                "backward and B then W by up to 0.001"), errors[0]
