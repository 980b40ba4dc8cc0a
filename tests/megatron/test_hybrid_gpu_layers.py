"""Mamba (M) and gated delta net (G) layers split into B and W: needs CUDA, Transformer Engine, mamba-ssm and
flash-linear-attention; skipped, with the reason, anywhere else (never run on CPU, where pretrain_hybrid.py refuses
these layers at start-up: tests/test_hybrid_pattern.py).

megatron-core 0.19.2 builds both from Transformer Engine's modules (its hybrid spec): the input projection a
TELayerNormColumnParallelLinear, the output projection a TERowParallelLinear, so the runtime's store splits them
through TE's own deferral (patches/te_wgrad.py) like any TE layer; the scan's or the delta rule's own parameters
(convolution, A, D, dt, norms) get their gradients in B from the layer's kernel. Each test builds one megatron layer
of the spec, checks that the store defers exactly the two projections' weights, and that B then W (three
microbatches) gives the gradients of the layer's fused backward bit for bit (into main_grad, as megatron DDP with
gradient-accumulation fusion).
"""
from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device (Mamba's and GDN's kernels run on GPUs only)", allow_module_level=True)
pytest.importorskip("transformer_engine.pytorch", reason="transformer_engine does not import here")

from megatron.zero_bubble.patches import imports, te_wgrad  # noqa: E402

imports.install()

from megatron.zero_bubble.patches.megatron_adapter import MegatronAdapter  # noqa: E402
from megatron.zero_bubble.runtime.wgrad_store import WeightGradStore  # noqa: E402

from tests.megatron.te_split_cases import _split_layer  # noqa: E402

HIDDEN, HEADS, SEQ, MICRO_BATCH, MICROBATCHES = 256, 8, 128, 2, 3
PACKAGES = {"M": "mamba_ssm", "G": "fla"}


def _layer(kind: str):
    """One layer of megatron's hybrid spec (bf16, TP = 1), with megatron DDP's main_grad set-up."""
    from megatron.core.models.hybrid.hybrid_layer_specs import hybrid_stack_spec
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.spec_utils import build_module

    split_layer = _split_layer()
    split_layer._set_up("cuda")
    config = TransformerConfig(
        num_layers=1, hidden_size=HIDDEN, num_attention_heads=HEADS, params_dtype=torch.bfloat16,
        pipeline_dtype=torch.bfloat16, bf16=True, hidden_dropout=0.0, attention_dropout=0.0, bias_dropout_fusion=False,
        gradient_accumulation_fusion=True, is_hybrid_model=True, mamba_num_groups=2, mamba_head_dim=32,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32)
    spec = hybrid_stack_spec.submodules.mamba_layer if kind == "M" else hybrid_stack_spec.submodules.gdn_layer
    layer = build_module(spec, config=config, layer_number=1,
                         pg_collection=ProcessGroupCollection.use_mpu_process_groups()).cuda()
    return split_layer.with_megatron_ddp_main_grads(layer, "cuda")


def _forward(layer, x):
    out = layer(hidden_states=x, attention_mask=None)
    return out[0] if isinstance(out, tuple) else out


@pytest.mark.cuda
@pytest.mark.transformer_engine
@pytest.mark.parametrize("kind", ["M", "G"])
def test_mamba_and_gdn_layers_split_their_projections_into_w_and_match_their_fused_backward(kind):
    pytest.importorskip(PACKAGES[kind], reason=f"{PACKAGES[kind]} does not import here")
    reason = te_wgrad.version_refusal(te_wgrad.installed_version(), True)
    if reason is not None:
        pytest.skip(reason)
    reference, split = _layer(kind), _layer(kind)
    split.load_state_dict(reference.state_dict())
    generator = torch.Generator().manual_seed(0)
    data = [(torch.randn(SEQ, MICRO_BATCH, HIDDEN, generator=generator).cuda().bfloat16(),
             torch.randn(SEQ, MICRO_BATCH, HIDDEN, generator=generator).cuda().bfloat16()) for _ in range(MICROBATCHES)]
    for x, dy in data:
        _forward(reference, x.clone().requires_grad_()).backward(dy)
    store = WeightGradStore("chunk 0")
    store.attach(split, MegatronAdapter(te_layer_types=te_wgrad.layer_types()))
    names = {id(param): name for name, param in split.named_parameters()}
    deferred = {names[id(param)] for param in store.weights}
    projections = {name for name in names.values() if name.endswith(("in_proj.weight", "out_proj.weight"))}
    assert len(projections) == 2 and {name for name in deferred if name.endswith(".weight")} == projections
    assert all(name.split(".")[-2] in ("in_proj", "out_proj") for name in deferred)  # a bias at most besides
    for mb, (x, dy) in enumerate(data):
        out = _forward(split, x.clone().requires_grad_())
        with store.split_backward():
            out.backward(dy)
        store.close_microbatch(mb, last=mb == MICROBATCHES - 1)
    for mb in store.pending_microbatches:
        store.run_next(mb)
    torch.cuda.synchronize()
    want = {name: p.main_grad for name, p in reference.named_parameters()}
    got = {name: p.main_grad for name, p in split.named_parameters()}
    assert [name for name in want if not torch.equal(want[name], got[name])] == []
    store.detach()
