"""The Transformer Engine split (patches/te_wgrad.py) on more of TE's behaviours, as tests/te_standin.py has them.

GroupedLinear (its legacy and grouped-tensor paths: an unwritten gradient buffer handed to autograd in B, operands
queued as plain objects holding tensors, bias gradients formed in B), a bias gradient formed in B that TE's
backward_dw expects to find in `.grad` (TE's FP8 Linear before 2.20, LayerNormMLP's bias-GELU fusion in every release;
TE issue #3400), and the
TE modules whose W stays in B (distributed weights; parameters megatron runs through TE's operation-based modules).
The reference is the stand-in's own undeferred backward (megatron's schedules), compared with torch.equal. TE's own
modules show the bias gradients formed in B under FP8 and with LayerNormMLP's fusion (te_split_cases.py); the
stand-in keeps the release lines side by side and the paths TE takes only on a GPU.
"""
from __future__ import annotations

import pytest
import torch

from megatron.zero_bubble.patches import imports

imports.install()

from megatron.zero_bubble.patches.megatron_adapter import MegatronAdapter  # noqa: E402
from megatron.zero_bubble.runtime.wgrad_store import WeightGradStore  # noqa: E402
from tests import te_standin  # noqa: E402

HIDDEN, OUT, SPLITS, MICROBATCHES = 8, 6, [3, 5, 2], 3
TOKENS = sum(SPLITS)
ADAPTER = MegatronAdapter(te_layer_types=te_standin.KINDS)


def _seeded(module: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in module.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
    return module


def _with_main_grads(module: torch.nn.Module, ddp_flag: bool) -> torch.nn.Module:
    for name, param in module.named_parameters():
        if "weight" in name:
            param.main_grad = torch.zeros_like(param)
            if ddp_flag:
                param.grad_added_to_main_grad = False
    return module


class Grouped(torch.nn.Module):
    """The experts as megatron calls them: is_first_microbatch on the first forward of the iteration (with main_grad
    fusion TE's W then overwrites main_grad: W of another microbatch first would show)."""

    def __init__(self, grouped_tensor: bool, fuse: bool):
        super().__init__()
        self.experts = te_standin.StandInGroupedLinear(len(SPLITS), HIDDEN, OUT, grouped_tensor=grouped_tensor,
                                                       fuse_wgrad_accumulation=fuse)
        self.first = True

    def forward(self, x):
        first, self.first = self.first, False
        return self.experts(x, SPLITS, is_first_microbatch=first)


def _data(out: int, seed: int = 1):
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(TOKENS, HIDDEN, generator=generator), torch.randn(TOKENS, out, generator=generator))
            for _ in range(MICROBATCHES)]


def _grads(module: torch.nn.Module, inputs) -> dict:
    out = {name: (p.main_grad if getattr(p, "main_grad", None) is not None else p.grad).clone()
           for name, p in module.named_parameters()}
    out.update({f"input{i}": x.grad.clone() for i, x in enumerate(inputs)})
    return out


def _fused_run(module, batches) -> dict:
    inputs = []
    for x, dy in batches:
        x = x.clone().requires_grad_()
        module(x).backward(dy)
        inputs.append(x)
    return _grads(module, inputs)


def _split_run(module, batches, store: WeightGradStore) -> dict:
    inputs = []
    for mb, (x, dy) in enumerate(batches):
        x = x.clone().requires_grad_()
        out = module(x)
        with store.split_backward():
            out.backward(dy)
        store.close_microbatch(mb, last=mb == len(batches) - 1)
        inputs.append(x)
    for mb in store.pending_microbatches:
        store.run_next(mb)
    assert store.pending_count == 0 and store.pending_bytes == 0
    return _grads(module, inputs)


def _assert_identical(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    assert [name for name in want if not torch.equal(got[name], want[name])] == []


def _pair(make, mode: str = "plain"):
    """(reference, split) built alike; mode: plain, main_grad, main_grad+ddp_flag."""
    modules = [_seeded(make(mode != "plain")) for _ in range(2)]
    if mode != "plain":
        modules = [_with_main_grads(m, mode.endswith("ddp_flag")) for m in modules]
    return modules


@pytest.mark.parametrize("mode", ["plain", "main_grad", "main_grad+ddp_flag"])
@pytest.mark.parametrize("grouped_tensor", [False, True], ids=["legacy", "grouped-tensor"])
def test_grouped_linear_split_into_b_and_w_matches_its_fused_backward_bit_for_bit(grouped_tensor, mode):
    reference, split = _pair(lambda fuse: Grouped(grouped_tensor, fuse), mode)
    want = _fused_run(reference, _data(OUT))
    store = WeightGradStore("chunk 0")
    assert store.attach(split, ADAPTER) == 2 * len(SPLITS)
    _assert_identical(_split_run(split, _data(OUT), store), want)


def test_grouped_linear_hands_autograd_an_unwritten_buffer_in_b_which_the_split_drops():
    module = _seeded(Grouped(grouped_tensor=False, fuse=False))
    store = WeightGradStore("chunk 0")
    store.attach(module, ADAPTER)
    (x, dy), = _data(OUT)[:1]
    with store.split_backward():
        module(x).backward(dy)
    store.close_microbatch(0, last=True)
    experts = module.experts
    assert all(getattr(experts, f"weight{i}").grad is None for i in range(len(SPLITS)))
    queued = experts.wgrad_store._entries[0][0][2]
    assert all(torch.isnan(buffer).all() for buffer in queued)  # what autograd was handed in B: not yet written
    store.run_next(0)
    assert not any(torch.isnan(getattr(experts, f"weight{i}").grad).any() for i in range(len(SPLITS)))


@pytest.mark.parametrize("fuse", [False, True], ids=["own-buffer", "main_grad"])
def test_grouped_tensor_operands_held_for_w_are_counted_by_what_they_hold(fuse):
    """TE's grouped path (2.19, 2.20) queues objects that are no tensors; what W keeps alive is their rows (input and
    output gradient) and, without fusion, the gradient buffer W writes into; main_grad is not counted."""
    module = _seeded(Grouped(grouped_tensor=True, fuse=fuse))
    if fuse:
        _with_main_grads(module, ddp_flag=True)
    store = WeightGradStore("chunk 0")
    store.attach(module, ADAPTER)
    (x, dy), = _data(OUT)[:1]
    with store.split_backward():
        module(x).backward(dy)
    store.close_microbatch(0, last=True)
    rows = (TOKENS * HIDDEN + TOKENS * OUT) * 4
    buffer = 0 if fuse else len(SPLITS) * OUT * HIDDEN * 4
    assert store.pending_bytes == rows + buffer
    store.run_next(0)
    assert store.pending_bytes == 0


class BiasInB(torch.nn.Module):
    """A Linear whose bias gradient comes in B (TE's FP8 path) and an MLP whose fc1 bias gradient does (bias-GELU)."""

    def __init__(self, fuse: bool, release: tuple = te_standin.NEWEST_RELEASE):
        super().__init__()
        self.proj = te_standin.StandInLinear(HIDDEN, HIDDEN, bias_grad_in_b=True, fuse_wgrad_accumulation=fuse,
                                             release=release)
        self.mlp = te_standin.StandInLayerNormMLP(HIDDEN, 12, bias_grad_in_b=True, fuse_wgrad_accumulation=fuse,
                                                  release=release)

    def forward(self, x):
        return self.mlp(self.proj(x))


RELEASES = {"2.19": (2, 19), "2.20": (2, 20)}  # backward_dw's bias rule differs between them (TE #3400's guard)


@pytest.mark.parametrize("release", list(RELEASES.values()), ids=list(RELEASES))
@pytest.mark.parametrize("mode", ["plain", "main_grad+ddp_flag"])
def test_a_bias_gradient_formed_in_b_is_handed_back_to_backward_dw_and_accumulated_once(mode, release):
    reference, split = _pair(lambda fuse: BiasInB(fuse, release), mode)
    want = _fused_run(reference, _data(HIDDEN))
    store = WeightGradStore("chunk 0")
    store.attach(split, ADAPTER)
    _assert_identical(_split_run(split, _data(HIDDEN), store), want)


def _bias_in_b_layer(kind: str, release: tuple):
    if kind == "Linear":
        return te_standin.StandInLinear(HIDDEN, HIDDEN, bias_grad_in_b=True, delay_wgrad_compute=True, release=release)
    return te_standin.StandInLayerNormMLP(HIDDEN, 12, bias_grad_in_b=True, delay_wgrad_compute=True, release=release)


@pytest.mark.parametrize("kind, release", [("Linear", (2, 19)), ("LayerNormMLP", (2, 19)), ("LayerNormMLP", (2, 20))])
def test_the_stand_in_fails_as_te_does_when_a_bias_gradient_formed_in_b_was_cleared(kind, release):
    """backward_dw calls .to() on the GEMM's missing bias gradient when it finds bias.grad None (TE issue #3400):
    LayerNormMLP's in every release, Linear's before 2.20. The stand-in does the same, so the test above would fail
    if the split did not hand the B gradient back."""
    layer = _seeded(_bias_in_b_layer(kind, release))
    bias = layer.bias if kind == "Linear" else layer.fc1_bias
    (x, dy), = _data(HIDDEN)[:1]
    layer(x).backward(dy)
    assert bias.grad is not None
    bias.grad = None  # an external consumer moved it away
    with pytest.raises(AttributeError, match="'NoneType' object has no attribute 'to'"):
        layer.backward_dw()


def test_the_stand_in_of_2_20_linear_skips_a_bias_gradient_the_gemm_did_not_give():
    """TE 2.20's base backward_dw (#3400's guard): no failure, and no bias gradient from W."""
    layer = _seeded(_bias_in_b_layer("Linear", (2, 20)))
    (x, dy), = _data(HIDDEN)[:1]
    layer(x).backward(dy)
    layer.bias.grad = None
    layer.backward_dw()
    assert layer.bias.grad is None and layer.weight.grad is not None


class KeptInB(torch.nn.Module):
    """megatron's TEFusedMLP (TE modules run through TE ops) and a Linear with a distributed weight (GTP)."""

    def __init__(self, fuse: bool):
        super().__init__()
        self.mlp = te_standin.StandInFusedMLP(HIDDEN, 12, fuse_wgrad_accumulation=fuse)
        self.gtp = te_standin.StandInLinear(HIDDEN, HIDDEN, fuse_wgrad_accumulation=fuse)
        self.gtp.weight.is_distributed_weight = True  # TE's DistributedWeight marker (megatron's GTP weights)
        self.proj = te_standin.StandInLinear(HIDDEN, HIDDEN, fuse_wgrad_accumulation=fuse)

    def forward(self, x):
        return self.proj(self.gtp(self.mlp(x)))


def test_te_modules_run_through_te_ops_or_with_distributed_weights_keep_their_w_in_b():
    reference, split = _pair(KeptInB)
    want = _fused_run(reference, _data(HIDDEN))
    store = WeightGradStore("chunk 0")
    assert store.attach(split, ADAPTER) == 2  # proj's weight and bias only
    assert not isinstance(split.mlp.linear_fc1.wgrad_store, type(split.proj.wgrad_store))
    assert not isinstance(split.gtp.wgrad_store, type(split.proj.wgrad_store))
    assert [layer for layer in ADAPTER.transformer_engine_layers(split)] == [split.proj]
    _assert_identical(_split_run(split, _data(HIDDEN), store), want)
