"""The CPU backend runs megatron-core's own schedules exactly, and uninstalls without a trace.

One group of 4 ranks runs every core layout in turn, a second group of 2 ranks Megatron's `pretrain()`
with the training-loop patches. The ranks are forked from this process after it imported megatron once:
the import costs seconds of CPU per rank on a shared machine.
"""
from __future__ import annotations

import logging
import sys
import types

import pytest
import torch

from tests.megatron import harness, process_groups, training_case
from tests.megatron.harness import Layout, ModelSpec

SPEC = ModelSpec(num_layers=8)  # 8 layers so that PP=4 x VPP=2 holds one layer per chunk
TIED = ModelSpec(num_layers=4, tie_embeddings=True)
MICROBATCHES = 8
WORLD = 4
needs_cpu_only_machine = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU backend refuses CUDA machines")


def run_core_layouts() -> dict[str, dict]:
    """Every layout on the same 4 ranks; data parallelism fills whatever TP x PP leaves.

    Also this rank's process groups after each layout and after the harness destroyed them (under "groups":
    (label, groups in torch's map), in order).
    """
    half = MICROBATCHES // 2
    runs = {
        "pp1": lambda: training_case.run_layout(Layout(), SPEC, MICROBATCHES),
        "pp2": lambda: training_case.run_layout(Layout(pp=2), SPEC, MICROBATCHES),
        "pp4": lambda: training_case.run_layout(Layout(pp=4), SPEC, MICROBATCHES),
        "tp2_pp2": lambda: training_case.run_layout(Layout(tp=2, pp=2), SPEC, MICROBATCHES),
        "pp4_vpp2": lambda: training_case.run_layout(Layout(pp=4, vpp=2), SPEC, MICROBATCHES),
        # replica r runs microbatches [r*half, (r+1)*half): the two halves DP=2 x PP=2 averages
        "pp1_halves": lambda: training_case.run_layout(Layout(), SPEC, half, shard_data=True),
        "ddp_dp2_pp2": lambda: training_case.run_layout(Layout(pp=2), SPEC, half, ddp=True, optimizer_step=True),
        "tied_pp1": lambda: training_case.run_layout(Layout(), TIED, half),
        "tied_ddp_pp2": lambda: training_case.run_layout(Layout(pp=2), TIED, half, ddp=True, shard_data=False),
    }
    reports, groups = {}, []
    for name, run in runs.items():
        reports[name] = run()
        groups.append((name, _group_count()))
    process_groups.destroy_parallel_state()
    groups.append(("destroyed", _group_count()))
    return {"layouts": reports, "groups": groups}


def _group_count() -> int:
    return len(torch.distributed.distributed_c10d._world.pg_map)


@pytest.fixture(scope="module")
def core_runs() -> list[dict]:
    if torch.cuda.is_available():
        pytest.skip("the CPU backend refuses CUDA machines")
    harness.preload_megatron()
    return harness.spawn(run_core_layouts, WORLD, timeout=240, start_method="fork")


@pytest.fixture(scope="module")
def layouts(core_runs) -> dict[str, dict[int, dict]]:
    per_rank = [run["layouts"] for run in core_runs]
    return {name: harness.merge_by_dp_rank([ranks[name] for ranks in per_rank]) for name in per_rank[0]}


def test_every_layout_leaves_only_its_own_process_groups(core_runs):
    """megatron's destroy_model_parallel only drops references: without the harness destroying the groups each
    layout would add its gloo groups (three threads each) to the rank, and a rank that builds several layouts in one
    process would hold them all."""
    for run in core_runs:
        *layouts, (_, groups_left) = run["groups"]
        assert groups_left == 1  # WORLD only
        counts = [count for _, count in layouts]  # 11 to 24 with megatron-core 0.19 (WORLD included), by layout
        assert min(counts) > 10 and max(counts) < 2 * min(counts)  # never two layouts' groups at once


def assert_same_tensors(actual: dict, expected: dict, exact: bool = True, atol: float = 0.0, rtol: float = 0.0) -> None:
    assert actual.keys() == expected.keys()
    for name, tensor in expected.items():
        if exact:
            assert torch.equal(actual[name], tensor), f"{name}: max diff {(actual[name] - tensor).abs().max()}"
        else:
            torch.testing.assert_close(actual[name], tensor, rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("layout", ["pp2", "pp4", "pp4_vpp2"])
def test_pipeline_layouts_match_single_stage_bit_for_bit(layouts, layout):
    reference = layouts["pp1"][0]
    assert len(reference["losses"]) == MICROBATCHES
    for replica in layouts[layout].values():
        assert replica["losses"] == reference["losses"]
        assert_same_tensors(replica["grads"], reference["grads"])


def test_tensor_and_pipeline_parallel_matches_up_to_all_reduce_order(layouts):
    reference = layouts["pp1"][0]
    replica = layouts["tp2_pp2"][0]
    assert replica["losses"].keys() == reference["losses"].keys()
    assert replica["losses"] == pytest.approx(reference["losses"], rel=1e-6)
    assert_same_tensors(replica["grads"], reference["grads"], exact=False, atol=1e-6)


def test_megatron_ddp_averages_the_data_parallel_halves_exactly(layouts):
    halves = layouts["pp1_halves"]
    # DDP scales each replica's gradient by 1/2 and sums two values: exact in floating point.
    expected = {name: 0.5 * halves[0]["grads"][name] + 0.5 * halves[1]["grads"][name] for name in halves[0]["grads"]}
    ddp = layouts["ddp_dp2_pp2"]
    assert set(ddp) == {0, 1}
    for replica in ddp.values():
        assert_same_tensors(replica["grads"], expected)
    assert ddp[0]["losses"] == halves[0]["losses"] and ddp[1]["losses"] == halves[1]["losses"]


def test_optimizer_step_after_ddp_is_adam_on_the_clipped_gradient(layouts):
    ddp = layouts["ddp_dp2_pp2"]
    halves = layouts["pp1_halves"]
    grads = {name: 0.5 * halves[0]["grads"][name] + 0.5 * halves[1]["grads"][name] for name in halves[0]["grads"]}
    norm = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads.values()])))
    assert norm > 1.0  # so that clipping to 1.0 acts
    assert ddp[0]["grad_norm"] == pytest.approx(norm, rel=1e-5)
    assert_same_tensors(ddp[0]["params"], ddp[1]["params"])  # the replicas stay identical
    before = layouts["pp1"][0]["params"]  # same initialisation, no step taken
    clip = 1.0 / (ddp[0]["grad_norm"] + 1e-6)
    # First Adam step, no weight decay: p -= lr * g / (|g| + eps) with lr 1e-3, eps 1e-8.
    expected = {name: p - 1e-3 * (grads[name] * clip) / ((grads[name] * clip).abs() + 1e-8)
                for name, p in before.items()}
    assert_same_tensors(ddp[0]["params"], expected, exact=False, atol=1e-8, rtol=1e-6)  # ulps of p, not of the step


def test_tied_embeddings_across_pipeline_stages_match_single_stage(layouts):
    reference = layouts["tied_pp1"][0]
    for replica in layouts["tied_ddp_pp2"].values():
        assert replica["losses"] == reference["losses"]
        # Every gradient is exact except the tied embedding, summed over two stages in another order.
        tied = "embedding.word_embeddings.weight"
        assert_same_tensors({k: v for k, v in replica["grads"].items() if k != tied},
                            {k: v for k, v in reference["grads"].items() if k != tied})
        torch.testing.assert_close(replica["grads"][tied], reference["grads"][tied], rtol=0.0, atol=1e-7)


def _attribute_snapshot() -> dict[str, dict]:
    """Every attribute of every loaded megatron module, of torch's patchable namespaces, and of typing."""
    namespaces = {name: module for name, module in sys.modules.items()
                  if name.startswith(("megatron.core", "megatron.training")) and isinstance(module, types.ModuleType)}
    from megatron.core.models.common.language_module.language_module import LanguageModule
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    namespaces.update({"torch": torch, "torch.cuda": torch.cuda, "typing": __import__("typing"),
                       "Tensor": torch.Tensor, "Module": torch.nn.Module, "LanguageModule": LanguageModule,
                       "TopKRouter": TopKRouter, "WrappedTorchNorm": WrappedTorchNorm,
                       "MoEAlltoAllTokenDispatcher": MoEAlltoAllTokenDispatcher})
    return {name: dict(vars(namespace)) for name, namespace in namespaces.items()}


def _changed(before: dict[str, dict], after: dict[str, dict]) -> set[str]:
    changed = set()
    for space, attributes in before.items():
        now = after.get(space, {})
        changed |= {f"{space}.{key}" for key in attributes.keys() | now.keys()
                    if key not in attributes or key not in now or attributes[key] is not now[key]}
    return changed


def test_uninstall_restores_every_patched_attribute_and_leaves_torch_alone():
    from megatron.zero_bubble.patches import cpu_backend, cpu_backend_core, cpu_backend_moe, cpu_backend_training, imports

    imports.install()
    cpu_backend.install(training=True, force=True)  # a first round imports everything the patches touch
    cpu_backend.uninstall()
    original = _attribute_snapshot()

    cpu_backend.install(training=True, force=True)
    cpu_backend.install(training=True, force=True)  # idempotent: nothing is wrapped twice
    patched = _changed(original, _attribute_snapshot())
    cpu_backend.uninstall()
    assert not cpu_backend.installed()

    assert not _changed(original, _attribute_snapshot())
    assert not logging.getLogger(cpu_backend_core.RNG_TRACKER_LOGGER).filters
    assert not {name for name in patched if name.split(".")[0] in ("torch", "Tensor", "Module", "typing")}
    expected_torch_names = {f"{module}.torch" for module in cpu_backend_core.MODULES_SEEING_CPU_AS_CUDA
                            + cpu_backend_moe.MOE_MODULES_SEEING_CPU_AS_CUDA
                            + cpu_backend_training.TRAINING_MODULES_SEEING_CPU_AS_CUDA
                            + ("megatron.training.initialize",)}
    assert expected_torch_names <= patched
    assert "megatron.core.tensor_parallel.random._set_cuda_rng_state" in patched
    assert "LanguageModule.setup_embeddings_and_output_layer" in patched
    assert {"WrappedTorchNorm.__new__", "TopKRouter._apply_expert_bias",
            "megatron.core.transformer.moe.token_dispatcher.maybe_move_tensor_to_cpu"} <= patched
    assert {"megatron.core.tensor_parallel.layers.fused_weight_gradient_mlp_cuda",
            "megatron.core.tensor_parallel.layers._grad_accum_fusion_available"} <= patched
    assert len(patched) == len(expected_torch_names) + 15  # the function replacements, one line each


@needs_cpu_only_machine
def test_rotary_embeddings_are_built_and_computed_on_the_cpu_with_the_backend_and_not_without():
    """megatron's RotaryEmbedding puts its inverse frequencies on torch.cuda.current_device() when built and again at
    its first forward (get_emb): with the backend both stay on the CPU and the embedding is RoPE's, cos/sin angles
    position x base^(-2i/d); without it the construction fails as it did before the backend covered the module. YaRN's
    embedding (its own module) likewise."""
    from megatron.zero_bubble.patches import cpu_backend

    cpu_backend.install()
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import YarnRotaryEmbedding

    try:
        rope = RotaryEmbedding(kv_channels=16, rotary_percent=0.5, rotary_base=10000)
        emb = rope.get_emb(32)
        yarn, _ = YarnRotaryEmbedding(kv_channels=16, scaling_factor=4.0, original_max_position_embeddings=8)(32)
    finally:
        cpu_backend.uninstall()
    assert yarn.device.type == "cpu" and yarn.shape == (32, 1, 1, 16)  # --position-embedding-type yarn, MLA's
    inverse = 1.0 / 10000 ** (torch.arange(0, 8, 2, dtype=torch.float32) / 8)  # half of 16 dimensions turn
    angles = torch.outer(torch.arange(32, dtype=torch.float32), inverse)
    assert emb.device.type == "cpu" and torch.equal(emb, torch.cat((angles, angles), dim=-1)[:, None, None, :])
    with pytest.raises((AssertionError, RuntimeError), match="CUDA"):
        RotaryEmbedding(kv_channels=16, rotary_percent=1.0)


@needs_cpu_only_machine
def test_gradient_accumulation_fusion_adds_into_main_grad_with_the_backend_and_is_refused_without():
    """megatron's default, --gradient-accumulation-fusion: its layers' weight-gradient GEMM adds into main_grad
    through apex's kernel, emulated by the backend (float32 product, one addition); without the backend megatron
    refuses the layer for want of apex."""
    from megatron.zero_bubble.patches import cpu_backend, cpu_backend_core

    cpu_backend.install()
    x, dy, main_grad = torch.randn(2, 3, 4), torch.randn(2, 3, 5, dtype=torch.bfloat16), torch.randn(5, 4)
    want = main_grad + dy.reshape(6, 5).float().t() @ x.reshape(6, 4)
    try:
        from megatron.core.tensor_parallel import layers

        assert layers.fused_weight_gradient_mlp_cuda is cpu_backend_core.ApexWgradOnCpu
        layers.fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32(x, dy, main_grad)
        assert torch.equal(main_grad, want)
        half = main_grad.to(torch.bfloat16)
        layers.fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp16(x, dy, half)
        assert torch.equal(half, (main_grad.to(torch.bfloat16).float() + dy.reshape(6, 5).float().t()
                                  @ x.reshape(6, 4)).to(torch.bfloat16))
    finally:
        cpu_backend.uninstall()
    assert not layers._grad_accum_fusion_available and not hasattr(layers, "fused_weight_gradient_mlp_cuda")


def test_install_refuses_a_machine_with_cuda_unless_forced(monkeypatch):
    from megatron.zero_bubble.patches import PatchError, cpu_backend

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert cpu_backend.cuda_available()
    with pytest.raises(PatchError, match="CUDA is available"):
        cpu_backend.install()
    assert not cpu_backend.installed()
    cpu_backend.install(force=True)
    try:
        assert cpu_backend.installed()
    finally:
        cpu_backend.uninstall()


def test_import_shims_stub_only_the_triton_module_and_alias_override():
    import importlib.util
    import typing

    from megatron.zero_bubble.patches import imports

    imports.install()
    import megatron.core.pipeline_parallel  # noqa: F401  (fails without the shims on a triton-less machine)

    stub = sys.modules[imports.TRITON_KERNEL_MODULE]
    if importlib.util.find_spec("triton") is None:
        assert stub.GLOBAL_BLOCK_SIZE == 1024
        with pytest.raises(RuntimeError, match="triton"):
            stub.paged_stash_copy_kernel()
    if sys.version_info < (3, 12):
        import typing_extensions

        assert typing.override is typing_extensions.override


UNCOMPILED_CHILD = """
import json, sys
import torch
from megatron.zero_bubble.patches import uncompiled_import
from megatron.zero_bubble.training.setup import prepare_process

compile_before = torch.compile
sys.argv[1:] = ["--transformer-impl", "local"]  # TE's own import brings torch's compiler in; megatron's must not
prepare_process()  # what pretrain_gpt.py runs before its megatron imports
import megatron.core.jit as jit
from megatron.core.transformer.moe import router

print("RESULT " + json.dumps({
    "inductor_imported": "torch._inductor" in sys.modules,
    "torch_compile_restored": torch.compile is compile_before,
    "patch_installed": uncompiled_import.installed(),
    "jit_fuser": jit.jit_fuser.__name__,
    "router_compiled": hasattr(router.TopKRouter.__dict__["_apply_expert_bias"], "_torchdynamo_orig_callable"),
}))
"""


@needs_cpu_only_machine
def test_on_cpu_megatron_is_imported_without_compiling_and_torch_compile_is_torchs_again():
    """In a process of its own (torch.compile is process-wide): megatron's decorations neither compile nor import
    Inductor, megatron's jit_fuser is its own no-op after, and torch.compile is torch's own again."""
    from tests.launching import child_result

    assert child_result(["-c", UNCOMPILED_CHILD]) == {"inductor_imported": False, "torch_compile_restored": True,
                                                  "patch_installed": False, "jit_fuser": "noop_decorator",
                                                  "router_compiled": False}


# ---------------------------------------------------------------- Megatron's training loop

PRETRAIN_FLAGS = (
    "--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 "
    "--micro-batch-size 2 --global-batch-size 8 --train-iters 3 --lr 1e-2 --lr-decay-style constant "
    "--tokenizer-type NullTokenizer --vocab-size 128 --distributed-backend gloo --no-gradient-accumulation-fusion "
    "--no-persist-layer-norm --transformer-impl local --no-masked-softmax-fusion --no-bias-dropout-fusion "
    "--no-bias-gelu-fusion --attention-dropout 0 --hidden-dropout 0 --eval-iters 0 --eval-interval 1000 "
    "--num-workers 0 --log-interval 1 --seed 1234 --pipeline-model-parallel-size 2"
)


class RandomTokens(torch.utils.data.Dataset):
    """Eight distinct samples of 33 tokens, repeated: every iteration sees the same global batch."""

    def __init__(self, size: int):
        self.size = size

    def __len__(self):
        return self.size

    def __getitem__(self, index):
        tokens = torch.randint(0, 128, (33,), generator=torch.Generator().manual_seed(index % 8))
        return {"tokens": tokens[:-1], "labels": tokens[1:], "position_ids": torch.arange(32)}


def random_token_datasets(num_samples):
    return tuple(RandomTokens(max(n, 1)) for n in num_samples)


random_token_datasets.is_distributed = True  # every rank builds its loader (no TP broadcast needed)


def tied_gpt_provider(pre_process=True, post_process=True, vp_stage=None, config=None, pg_collection=None):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.training import get_args
    from megatron.training.argument_utils import core_transformer_config_from_args

    args = get_args()
    return GPTModel(config=core_transformer_config_from_args(args), transformer_layer_spec=get_gpt_layer_local_spec(),
                    vocab_size=args.padded_vocab_size, max_sequence_length=args.max_position_embeddings,
                    pre_process=pre_process, post_process=post_process,
                    share_embeddings_and_output_weights=True, vp_stage=vp_stage)


def run_pretrain() -> list[float]:
    """Megatron's pretrain() for 3 iterations at PP=2; returns the microbatch losses seen on this rank."""
    from megatron.zero_bubble.patches import cpu_backend, prebuilt_helpers

    cpu_backend.install(training=True)
    prebuilt_helpers.install()  # as pretrain_gpt.py's prepare_process: the install has no Makefile for megatron's `make`
    from megatron.core.enums import ModelType
    from megatron.training import pretrain
    from megatron.training.argument_utils import pretrain_cfg_container_from_args
    from megatron.training.arguments import parse_and_validate_args

    losses = []

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])

        def loss_func(output_tensor):
            loss = output_tensor.float().mean()
            losses.append(float(loss))
            return loss, {"lm loss": loss.detach()}

        return output, loss_func

    sys.argv = ["pretrain", *PRETRAIN_FLAGS.split()]
    config = pretrain_cfg_container_from_args(parse_and_validate_args())
    pretrain(config, random_token_datasets, ModelType.encoder_or_decoder, forward_step, model_provider=tied_gpt_provider)
    return losses


@pytest.mark.slow
@needs_cpu_only_machine
def test_megatron_pretrain_trains_with_tied_embeddings_across_two_stages():
    harness.preload_megatron(training=True)
    first_stage, last_stage = harness.spawn(run_pretrain, 2, timeout=240, start_method="fork")
    assert first_stage == []
    assert len(last_stage) == 3 * 4  # 3 iterations x (global batch 8 / micro-batch 2)
    per_iteration = [sum(last_stage[i:i + 4]) / 4 for i in range(0, 12, 4)]
    assert all(torch.isfinite(torch.tensor(per_iteration)))
    assert per_iteration[2] < per_iteration[0]  # the optimizer steps work: the loss goes down


def test_gradient_clipping_scales_cpu_gradients_that_megatron_would_reject():
    from megatron.zero_bubble.patches import cpu_backend, imports

    imports.install()
    from megatron.core.optimizer import clip_grads, optimizer

    params = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))]
    for param, grad in zip(params, (torch.tensor([3.0, 0.0, 4.0]), torch.tensor([1.0, -2.0]))):
        param.grad = grad.clone()
    with pytest.raises(AssertionError):  # megatron's own: grads must be torch.cuda.FloatTensor
        clip_grads.clip_grad_by_total_norm_fp32(params, max_norm=1.0, total_norm=5.0)
    cpu_backend.install(force=True)
    try:
        assert optimizer.clip_grad_by_total_norm_fp32 is clip_grads.clip_grad_by_total_norm_fp32
        clip_grads.clip_grad_by_total_norm_fp32(params, max_norm=1.0, total_norm=5.0)
    finally:
        cpu_backend.uninstall()
    coefficient = 1.0 / (5.0 + 1.0e-6)
    assert torch.equal(params[0].grad, torch.tensor([3.0, 0.0, 4.0]) * coefficient)
    assert torch.equal(params[1].grad, torch.tensor([1.0, -2.0]) * coefficient)
