"""Which device a rank computes on: the shared-GPU mode's refusals (one line naming the flag and the fix), where its
messages travel, and the patch of megatron's coalesced gradient reduction it needs. No process launched."""
from __future__ import annotations

import os
import types

import pytest
import torch

from megatron.zero_bubble.runtime.p2p import wire_device
from megatron.zero_bubble.training.devices import check_gpu_kernels, check_shared_gpus
from megatron.zero_bubble.training.flags import SHARE_GPUS, StartupRefusal

SHARED = dict(zero_bubble_share_gpus=True, distributed_backend="gloo", tensor_model_parallel_size=1,
              context_parallel_size=1, expert_model_parallel_size=1, overlap_grad_reduce=False,
              overlap_param_gather=False, use_distributed_optimizer=False)


def _refusal(cuda: bool = True, through_runtime: bool = True, **changes) -> str | None:
    try:
        check_shared_gpus(types.SimpleNamespace(**{**SHARED, **changes}), through_runtime, cuda=cuda)
    except StartupRefusal as refusal:
        assert "\n" not in str(refusal) and str(refusal).startswith(SHARE_GPUS)
        return str(refusal)
    return None


def test_the_shared_mode_runs_pipeline_ranks_through_the_runtime_over_gloo():
    assert _refusal() is None
    assert _refusal(zero_bubble_share_gpus=False, distributed_backend="nccl", through_runtime=False) is None


@pytest.mark.parametrize("changes, fix", [
    ({"cuda": False}, "drop the flag"),
    ({"distributed_backend": "nccl"}, "--distributed-backend gloo"),
    ({"through_runtime": False}, "--enable-zb-runtime"),
    ({"tensor_model_parallel_size": 2}, "drop --tensor-model-parallel-size"),
    ({"context_parallel_size": 2}, "drop --context-parallel-size"),
    ({"expert_model_parallel_size": 2}, "drop --expert-model-parallel-size"),
    ({"overlap_grad_reduce": True}, "--overlap-grad-reduce"),
    ({"use_distributed_optimizer": True}, "--use-distributed-optimizer"),
])
def test_what_the_shared_mode_cannot_run_is_refused_naming_the_fix(changes, fix):
    message = _refusal(**changes)
    assert message is not None and fix in message


def test_gloo_messages_of_cuda_tensors_travel_through_host_memory(one_rank_gloo):
    """gloo's send of a CUDA tensor fails ('writev ... Bad address' on an H100): such messages are staged on the host;
    CPU tensors are sent where they are."""
    assert wire_device(one_rank_gloo, torch.device("cuda", 0)) == torch.device("cpu")
    assert wire_device(one_rank_gloo, torch.device("cpu")) == torch.device("cpu")


LOCAL = dict(transformer_impl="local", no_persist_layer_norm=False, masked_softmax_fusion=True,
             gradient_accumulation_fusion=True)


def _kernels_refusal(apex: bool, te: bool, **changes) -> str | None:
    try:
        check_gpu_kernels(types.SimpleNamespace(**{**LOCAL, **changes}), apex=apex, transformer_engine=te)
    except StartupRefusal as refusal:
        assert "\n" not in str(refusal)
        return str(refusal)
    return None


def test_megatrons_local_layers_without_apex_are_refused_naming_the_flags_that_still_ask_for_it():
    """Each of these stopped a run on a GPU without apex inside megatron (an assert, a missing module)."""
    assert _kernels_refusal(apex=False, te=False) == (
        "--transformer-impl local without apex: megatron's defaults ask for apex's kernels; add --no-persist-layer-norm "
        "--no-masked-softmax-fusion --no-gradient-accumulation-fusion (or install apex)")
    assert _kernels_refusal(apex=False, te=False, no_persist_layer_norm=True, gradient_accumulation_fusion=False) \
        .endswith("add --no-masked-softmax-fusion (or install apex)")
    assert _kernels_refusal(apex=False, te=False, no_persist_layer_norm=True, masked_softmax_fusion=False,
                            gradient_accumulation_fusion=False) is None
    assert _kernels_refusal(apex=True, te=False) is None


def test_rotary_embeddings_on_local_layers_without_transformer_engine_need_the_fusion_off():
    """megatron's RoPE fusion is on by default and is Transformer Engine's kernel whatever the layers: without TE
    megatron's config stops with a ValueError. (On CPU the fusion is off by default: there is no TE there.)"""
    rope = dict(position_embedding_type="rope", apply_rope_fusion=True)
    message = _kernels_refusal(apex=True, te=False, **rope)
    assert message is not None and message.startswith("--position-embedding-type rope")
    assert "--no-rope-fusion" in message
    assert _kernels_refusal(apex=True, te=False, **{**rope, "apply_rope_fusion": False}) is None
    assert _kernels_refusal(apex=True, te=True, **rope) is None
    learned = dict(position_embedding_type="learned_absolute", apply_rope_fusion=True)
    assert _kernels_refusal(apex=True, te=False, **learned) is None
    legacy = dict(learned, use_rotary_position_embeddings=True)
    assert "--no-rope-fusion" in _kernels_refusal(apex=True, te=False, **legacy)


def test_transformer_engine_layers_need_transformer_engine():
    message = _kernels_refusal(apex=False, te=False, transformer_impl="transformer_engine")
    assert message is not None and "--transformer-impl local" in message
    assert _kernels_refusal(apex=False, te=True, transformer_impl="transformer_engine") is None


def test_the_cpu_is_used_only_when_asked_for():
    """A GPU node whose driver is broken would otherwise train on the CPU without a word."""
    from megatron.zero_bubble.training.devices import check_device_choice

    def refusal(cuda: bool, **flags) -> str | None:
        try:
            check_device_choice(types.SimpleNamespace(**flags), cuda=cuda)
        except StartupRefusal as refused:
            return str(refused)
        return None

    assert refusal(cuda=False).endswith("to train on the CPU with gloo (slow), add --zero-bubble-cpu")
    assert refusal(cuda=False, zero_bubble_cpu=True) is None
    assert refusal(cuda=True) is None
    assert "keep one of them" in refusal(cuda=True, zero_bubble_cpu=True, zero_bubble_share_gpus=True)


@pytest.mark.slow  # a process
def test_without_cuda_pretrain_gpt_stops_in_one_line_naming_the_opt_in():
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "pretrain_gpt.py", "--num-layers", "2"], capture_output=True, text=True,
                          timeout=120, cwd=__file__.rsplit("/tests/", 1)[0], env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip().splitlines()[-1] == (
        "pretrain_gpt.py: error: no CUDA device here (torch.cuda.is_available() is False: check the driver and "
        "CUDA_VISIBLE_DEVICES); to train on the CPU with gloo (slow), add --zero-bubble-cpu")


def test_asking_for_the_cpu_hides_the_gpus_before_torch_looks(monkeypatch):
    from megatron.zero_bubble.training.devices import hide_gpus_if_asked

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    hide_gpus_if_asked(["pretrain_gpt.py", "--num-layers", "2"])
    assert "CUDA_VISIBLE_DEVICES" not in os.environ
    hide_gpus_if_asked(["pretrain_gpt.py", "--zero-bubble-cpu"])
    assert os.environ["CUDA_VISIBLE_DEVICES"] == ""


def test_the_help_is_not_stopped_by_the_missing_gpu():
    """`pretrain_gpt.py --help` lists the flags on any machine, --zero-bubble-cpu among them."""
    from megatron.zero_bubble.training.early import check_early

    check_early(["--help"])
    check_early(["-h", "--num-layers", "2"])
