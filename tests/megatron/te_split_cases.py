"""The Transformer Engine split (patches/te_wgrad.py) on Transformer Engine's own modules: TE's Python, with CUDA or
on the CPU over the labelled CPU kernel layer (megatron/zero_bubble/te_cpu). Run by test_te_releases.py, one pytest
process per release (it imports TE and patches it for the CPU for the life of the process).

The same checks as test_te_split_standin.py, which runs them on CPU against the labelled stand-in: B then W in
microbatch order gives the gradients of TE's own undeferred backward bit for bit (plain autograd accumulation, and
accumulation into main_grad with megatron DDP's hook and TE's gradient-accumulation fusion), each module's entries
are popped oldest first, a BW pass is TE's fused backward, readiness reports every weight and bias once; and one
megatron GPT layer of TE's spec, fused against split (benchmarks/split_layer.py, on a GPU). Skipped, with the reason,
where `import transformer_engine.pytorch` fails. On the CPU the control flow (the deferral, the queue, main_grad, the
bias rules) is TE's and the arithmetic the kernel layer's; on a GPU both are TE's.
"""
from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import os
from pathlib import Path

import pytest
import torch

from megatron.zero_bubble.patches import imports  # noqa: E402

imports.install(transformer_engine=True)  # on the CPU: TE's Python over the CPU kernel layer
te = pytest.importorskip("transformer_engine.pytorch", reason="transformer_engine does not import here")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    from megatron.zero_bubble.patches import cpu_backend_te  # noqa: E402

    cpu_backend_te.install()

from megatron.zero_bubble.patches import te_wgrad  # noqa: E402
from megatron.zero_bubble.patches.megatron_adapter import MegatronAdapter  # noqa: E402
from megatron.zero_bubble.runtime.wgrad_store import WeightGradStore  # noqa: E402
from megatron.zero_bubble.schedules.schedule import ScheduleError  # noqa: E402

HIDDEN, FFN, TOKENS, MICROBATCHES = 128, 256, 64, 3
KINDS = ("Linear", "LayerNormLinear", "LayerNormMLP", "GroupedLinear")
VERSION = te_wgrad.installed_version()


def _adapter() -> MegatronAdapter:
    return MegatronAdapter(te_layer_types=te_wgrad.layer_types())


def _make(kind: str, fuse: bool, seed: int = 0):
    torch.manual_seed(seed)
    options = dict(bias=True, fuse_wgrad_accumulation=fuse, params_dtype=torch.float32, device=DEVICE)
    if kind == "Linear":
        module = te.Linear(HIDDEN, FFN, **options)
    elif kind == "LayerNormLinear":
        module = te.LayerNormLinear(HIDDEN, FFN, **options)
    elif kind == "LayerNormMLP":
        module = te.LayerNormMLP(HIDDEN, FFN, **options)
    else:
        module = te.GroupedLinear(2, HIDDEN, FFN, **options)
    if fuse:  # megatron DDP: main_grad, grad_added_to_main_grad and its per-parameter hook
        return _split_layer().with_megatron_ddp_main_grads(module, DEVICE)
    return module


@functools.lru_cache(maxsize=None)
def _split_layer():
    """benchmarks/split_layer.py, loaded as a module (benchmarks/ is not a package)."""
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "split_layer.py"
    spec = importlib.util.spec_from_file_location("split_layer", path)
    split_layer = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(split_layer)
    return split_layer


def _forward(module, x):
    if isinstance(module, te.GroupedLinear):
        return module(x, [TOKENS // 2, TOKENS - TOKENS // 2])
    out = module(x)
    return out[0] if isinstance(out, tuple) else out


def _recipe(name):
    """TE's recipe object for megatron's --fp8-recipe NAME with --fp8-format hybrid (None: no FP8)."""
    if name is None:
        return None
    from transformer_engine.common import recipe

    made = {"delayed": recipe.DelayedScaling, "tensorwise": recipe.Float8CurrentScaling}[name]
    return made(fp8_format=recipe.Format.HYBRID)


def _forward_under(recipe, module, x):
    if recipe is None:
        return _forward(module, x)
    with te.fp8_autocast(enabled=True, fp8_recipe=recipe):
        return _forward(module, x)


def _scaling_state(module) -> list:
    """Every delayed-scaling amax history and scale of the module (none for other recipes)."""
    meta = getattr(module, "fp8_meta", {})
    states = [meta[key] for key in ("scaling_fwd", "scaling_bwd") if key in meta]
    return [t.clone() for state in states for t in (getattr(state, "amax_history", None), getattr(state, "scale", None))
            if t is not None]


def _data(kind: str):
    generator = torch.Generator().manual_seed(1)
    out = HIDDEN if kind == "LayerNormMLP" else FFN
    return [(torch.randn(TOKENS, HIDDEN, generator=generator).to(DEVICE),
             torch.randn(TOKENS, out, generator=generator).to(DEVICE)) for _ in range(MICROBATCHES)]


def _grads(module) -> dict:
    return {name: (p.main_grad if getattr(p, "main_grad", None) is not None else p.grad).clone()
            for name, p in module.named_parameters()}


def _skip_unless_supported(fuse: bool) -> None:
    reason = te_wgrad.version_refusal(VERSION, fuse)
    if reason is not None:
        pytest.skip(reason)


def test_the_release_under_test_is_the_one_asked_for():
    """test_te_releases.py names the release it put first on PYTHONPATH (or the installed one): it must be imported."""
    asked = os.environ.get("ZB_TE_RELEASE_UNDER_TEST")
    if asked is None:
        pytest.skip("run by test_te_releases.py, which names the release under test")
    assert VERSION == asked and importlib.metadata.version("transformer-engine") == asked


@pytest.mark.parametrize("fuse", [False, True], ids=["plain", "main_grad-fusion"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("fp8", [None, "delayed", "tensorwise"], ids=["bf16", "fp8-delayed", "fp8-tensorwise"])
def test_te_modules_split_into_b_and_w_match_tes_fused_backward_bit_for_bit(kind, fuse, fp8):
    """Under FP8 too (--fp8-format hybrid): the gradients, and the delayed-scaling amax histories and scales."""
    _skip_unless_supported(fuse)
    recipe = _recipe(fp8)
    reference, split = _make(kind, fuse), _make(kind, fuse)
    for x, dy in _data(kind):
        _forward_under(recipe, reference, x).backward(dy)
    store = WeightGradStore("chunk 0")
    assert store.attach(split, _adapter()) > 0
    for mb, (x, dy) in enumerate(_data(kind)):
        out = _forward_under(recipe, split, x)
        with store.split_backward():
            out.backward(dy)
        store.close_microbatch(mb, last=mb == MICROBATCHES - 1)
    assert store.pending_count > 0
    for mb in store.pending_microbatches:
        store.run_next(mb)
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    want, got = _grads(reference), _grads(split)
    assert [n for n in want if not torch.equal(want[n], got[n])] == []
    want_state, got_state = _scaling_state(reference), _scaling_state(split)
    assert len(want_state) == (4 if fp8 == "delayed" else 0)
    assert all((scale != 1).any() for scale in want_state[1::2])  # the recipe moved every scale
    assert all(torch.equal(a, b) for a, b in zip(want_state, got_state))
    store.detach()


@pytest.mark.parametrize("kind", KINDS)
def test_a_bw_pass_on_switched_te_modules_is_their_fused_backward(kind):
    _skip_unless_supported(True)
    reference, split = _make(kind, True), _make(kind, True)
    store = WeightGradStore("chunk 0")
    store.attach(split, _adapter())
    for mb, (x, dy) in enumerate(_data(kind)):
        _forward(reference, x).backward(dy)
        with store.fused_backward(last=mb == MICROBATCHES - 1):
            _forward(split, x).backward(dy)
        assert store.pending_count == 0
    want, got = _grads(reference), _grads(split)
    assert [n for n in want if not torch.equal(want[n], got[n])] == []


def test_w_runs_in_b_order_and_reports_every_te_weight_and_bias_once():
    _skip_unless_supported(True)
    module = _make("LayerNormMLP", True)
    reported = []
    store = WeightGradStore("chunk 0", grad_ready=reported.append)
    store.attach(module, _adapter())
    for mb, (x, dy) in enumerate(_data("LayerNormMLP")):
        with store.split_backward():
            _forward(module, x).backward(dy)
        store.close_microbatch(mb, last=mb == MICROBATCHES - 1)
    with pytest.raises(ScheduleError, match="microbatch 0 is next"):
        store.run_next(1)
    for mb in store.pending_microbatches:
        store.run_next(mb)
    held = [p for n, p in module.named_parameters() if not n.startswith("layer_norm")]
    assert sorted(map(id, reported)) == sorted(map(id, held))
    with pytest.raises(RuntimeError, match="Pop empty queue"):
        module.wgrad_store.pop()


@pytest.mark.parametrize("impl", ["local", "transformer_engine"])
def test_one_megatron_gpt_layer_split_matches_its_fused_backward(impl):
    if DEVICE != "cuda":
        pytest.skip("a GPU measurement (benchmarks/split_layer.py times the layer in bf16 on CUDA)")
    _skip_unless_supported(True)
    split_layer = _split_layer()
    split_layer._set_up("cuda")
    result = split_layer.measure(impl, 1024, 16, 2, 512, torch.bfloat16, 1, "cuda")
    assert result["bit_identical"], result["first_difference"]
    assert result["deferred"] > 0


def _storage_bytes(obj, seen: set, found: dict) -> None:
    """The storages of the plain tensors reachable from obj (through containers and TE's quantized tensors)."""
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if type(obj) in (torch.Tensor, torch.nn.Parameter):
        found[obj.untyped_storage().data_ptr()] = obj.untyped_storage().nbytes()
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            _storage_bytes(item, seen, found)
    elif isinstance(obj, dict):
        for item in obj.values():
            _storage_bytes(item, seen, found)
    elif hasattr(obj, "__dict__") and not isinstance(obj, torch.nn.Module):
        for name, item in vars(obj).items():
            if name not in ("_quantizer", "quantizer"):
                _storage_bytes(item, seen, found)


@pytest.mark.parametrize("fp8", [None, "delayed", "tensorwise"], ids=["bf16", "fp8-delayed", "fp8-tensorwise"])
def test_w_holds_per_linear_layer_what_the_advisor_counts(fp8):
    """M_W of a bf16 TE Linear as advise/activations.py counts it: the input at 2 bytes an element, or under FP8 its
    FP8 transpose alone (1 byte), and the output gradient at 2 bytes (bf16, or its two FP8 copies)."""
    _skip_unless_supported(False)
    module = te.Linear(HIDDEN, FFN, bias=True, params_dtype=torch.bfloat16, device=DEVICE, delay_wgrad_compute=True)
    x = torch.randn(TOKENS, HIDDEN, dtype=torch.bfloat16, device=DEVICE, requires_grad=True)
    out = _forward_under(_recipe(fp8), module, x)
    out.backward(torch.randn_like(out))
    found = {}
    _storage_bytes(list(module.wgrad_store.context.queue), set(), found)
    for p in module.parameters():
        found.pop(p.untyped_storage().data_ptr(), None)
    held = sum(nbytes for nbytes in found.values() if nbytes > 64)  # scale inverses and amaxes are 4 bytes
    input_bytes = 2 if fp8 is None else 1
    assert held == TOKENS * (HIDDEN * input_bytes + FFN * 2)
