"""B/W split of megatron-core's tensor-parallel linear layers: exactness, FIFO order, memory accounting.

The reference is megatron's own backward (no store attached). With the store active, B then W per
microbatch must give bit-identical grad_input, weight and bias gradients (torch.equal), accumulated over
several microbatches. The micro benchmark is
benchmarks/split_backward.py.
"""
from __future__ import annotations

import gc
import types

import pytest
import torch
import torch.distributed as dist

from megatron.zero_bubble.patches import imports

imports.install()

from megatron.core.model_parallel_config import ModelParallelConfig  # noqa: E402
from megatron.core.tensor_parallel import layers  # noqa: E402

from megatron.zero_bubble.patches._patching import PatchError  # noqa: E402
from megatron.zero_bubble.patches.megatron_adapter import MegatronAdapter  # noqa: E402
from megatron.zero_bubble.runtime.wgrad_store import WeightGradStore  # noqa: E402
from megatron.zero_bubble.schedules.schedule import ScheduleError  # noqa: E402

SEQ, BATCH, HIDDEN, FFN = 6, 2, 8, 12
MICROBATCHES = 3


@pytest.fixture
def tp_group():
    """A one-rank gloo group standing for TP=1 (the layers take it explicitly; no parallel_state).

    Made for each test and destroyed after it, default group included: this process forks the ranks of
    the spawned tests below, and a forked rank must not inherit a default process group.
    """
    owner = not dist.is_initialized()
    if owner:
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    group = dist.new_group([0], backend="gloo")
    yield group
    dist.destroy_process_group(group)
    if owner:
        dist.destroy_process_group()
    del group
    gc.collect()  # the test's layers hold the group in reference cycles: its gloo threads end with them, not later


MEGATRON = MegatronAdapter()


def make_layer(kind: str, bias: bool, group, seed: int = 0, fusion: bool = False, tp: int = 1, sp: bool = False):
    config = ModelParallelConfig(tensor_model_parallel_size=tp, sequence_parallel=sp,
                                 use_cpu_initialization=True, perform_initialization=False)
    cls = layers.ColumnParallelLinear if kind == "column" else layers.RowParallelLinear
    extra = {} if kind == "column" else {"input_is_parallel": True}
    size_in, size_out = (HIDDEN, FFN) if kind == "column" else (FFN, HIDDEN)
    layer = cls(size_in, size_out, config=config, init_method=torch.nn.init.zeros_, bias=bias,
                skip_bias_add=False, tp_group=group, **extra)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in layer.parameters():
            param.copy_(torch.randn(param.shape, generator=gen))
    layer.gradient_accumulation_fusion = fusion
    return layer


def microbatch_data(layer, seed: int = 1, tp: int = 1):
    """(input, output gradient) per microbatch, shaped for this TP rank (sequence-sharded under SP)."""
    gen = torch.Generator().manual_seed(seed)
    column = isinstance(layer, layers.ColumnParallelLinear)
    size_in = layer.input_size if column else layer.input_size_per_partition
    size_out = layer.output_size_per_partition if column else layer.output_size
    sp = layer.sequence_parallel
    seq_in = SEQ // tp if sp and column else SEQ
    seq_out = SEQ // tp if sp and not column else SEQ
    return [(torch.randn(seq_in, BATCH, size_in, generator=gen), torch.randn(seq_out, BATCH, size_out, generator=gen))
            for _ in range(MICROBATCHES)]


def forward_backward(layer, x, grad_y):
    x = x.clone().requires_grad_(True)
    y, _ = layer(x)
    y.backward(grad_y)
    return x.grad


def fused_run(layer, data):
    """megatron's backward (BW) for every microbatch; returns grad_inputs and the accumulated grads."""
    grad_inputs = [forward_backward(layer, x, gy) for x, gy in data]
    return grad_inputs, snapshot_grads(layer)


def split_run(layer, data, store, order=None, last=None):
    """B for each microbatch with the store active, W in `order` of events ("B0", "W0", ...); `last`: the
    microbatch whose B is the last (the store may then report complete gradients)."""
    order = order or [f"B{i}" for i in range(len(data))] + [f"W{i}" for i in range(len(data))]
    grad_inputs = {}
    for event in order:
        mb = int(event[1:])
        if event[0] == "B":
            with store.split_backward():
                grad_inputs[mb] = forward_backward(layer, *data[mb])
            store.close_microbatch(mb, last=mb == last)
        else:
            store.run_next(mb)
    return [grad_inputs[i] for i in range(len(data))], snapshot_grads(layer)


def run_b_passes(layer, data, store):
    """B of each microbatch in turn with the store active; their W stay pending."""
    for mb, (x, grad_y) in enumerate(data):
        with store.split_backward():
            forward_backward(layer, x, grad_y)
        store.close_microbatch(mb)


def snapshot_grads(layer):
    out = {}
    for name, param in layer.named_parameters():
        grad = getattr(param, "main_grad", None)
        out[name] = (grad if grad is not None else param.grad).clone()
    return out


def mismatches(got, want) -> list[str]:
    """Names of what differs (grad_input of microbatch i, or a parameter's gradient); [] if bit-identical."""
    (gi_got, grads_got), (gi_want, grads_want) = got, want
    bad = [f"grad_input[{i}]" for i, (a, b) in enumerate(zip(gi_got, gi_want, strict=True)) if not torch.equal(a, b)]
    bad += [name for name in grads_want if name not in grads_got or not torch.equal(grads_got[name], grads_want[name])]
    return bad + [name for name in grads_got if name not in grads_want]


def assert_bit_identical(got, want):
    assert mismatches(got, want) == []


CASES = [("column", True), ("column", False), ("row", True), ("row", False)]


@pytest.mark.parametrize("kind,bias", CASES)
def test_split_backward_then_w_in_order_matches_megatron_bit_for_bit(tp_group, kind, bias):
    reference = make_layer(kind, bias, tp_group)
    data = microbatch_data(reference)
    want = fused_run(reference, data)

    layer = make_layer(kind, bias, tp_group)
    store = WeightGradStore("test")
    assert store.attach(layer, MEGATRON) == 1
    got = split_run(layer, data, store)
    assert_bit_identical(got, want)
    assert store.pending_count == 0 and store.pending_bytes == 0


def test_saved_tensor_hooks_that_copy_still_accumulate_into_the_parameter(tp_group):
    """Activation offloading unpacks saved tensors as new objects; W must still reach the Parameter."""
    reference = make_layer("column", True, tp_group)
    data = microbatch_data(reference)
    want = fused_run(reference, data)

    layer = make_layer("column", True, tp_group)
    store = WeightGradStore("test")
    store.attach(layer, MEGATRON)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t.detach().clone(), lambda t: t):
        got = split_run(layer, data, store)
    assert_bit_identical(got, want)


@pytest.mark.parametrize("kind,bias", CASES)
def test_w_interleaved_with_later_b_passes_matches_megatron(tp_group, kind, bias):
    reference = make_layer(kind, bias, tp_group)
    data = microbatch_data(reference)
    want = fused_run(reference, data)

    layer = make_layer(kind, bias, tp_group)
    store = WeightGradStore("test")
    store.attach(layer, MEGATRON)
    got = split_run(layer, data, store, order=["B0", "B1", "W0", "B2", "W1", "W2"])
    assert_bit_identical(got, want)


def test_b_pass_defers_weight_grad_but_not_bias_grad_and_counts_bytes(tp_group):
    layer = make_layer("column", True, tp_group)
    data = microbatch_data(layer)
    store = WeightGradStore("test")
    store.attach(layer, MEGATRON)
    run_b_passes(layer, data[:2], store)
    assert layer.weight.grad is None and layer.bias.grad is not None
    per_mb = sum(t.numel() * t.element_size() for t in data[0])  # input + grad_output of the one layer
    assert store.pending_microbatches == [0, 1]
    assert store.pending_count == 2 and store.pending_bytes == 2 * per_mb
    store.run_next(0)
    assert store.pending_bytes == per_mb and layer.weight.grad is not None
    assert store.flush() == 1
    assert store.pending_count == 0 and store.pending_bytes == 0


@pytest.mark.parametrize("kind,bias", CASES)
def test_attached_store_that_is_not_active_is_megatron(tp_group, kind, bias):
    reference = make_layer(kind, bias, tp_group)
    data = microbatch_data(reference)
    want = fused_run(reference, data)

    layer = make_layer(kind, bias, tp_group)
    store = WeightGradStore("test")
    store.attach(layer, MEGATRON)
    assert_bit_identical(fused_run(layer, data), want)  # store attached, not active: W runs at once
    assert store.pending_count == 0


def test_detach_gives_the_layer_megatrons_own_forward_back(tp_group):
    layer = make_layer("column", True, tp_group)
    assert "_forward_impl" not in vars(layer)
    store = WeightGradStore("test")
    assert store.attach(layer, MEGATRON) == 1
    assert "_forward_impl" in vars(layer)  # this layer's own, shadowing megatron's method
    store.detach()
    assert "_forward_impl" not in vars(layer)
    assert type(layer)._forward_impl is layers.ColumnParallelLinear._forward_impl
    assert store.weights == ()


def test_a_layer_handed_another_weight_runs_megatrons_backward(tp_group):
    """A tied output layer is handed the embedding's weight at each call: its gradient is autograd's, as in
    megatron, not the store's."""
    layer = make_layer("column", False, tp_group)
    other = torch.nn.Parameter(layer.weight.detach().clone())
    store = WeightGradStore("test")
    store.attach(layer, MEGATRON)
    x = torch.randn(SEQ, BATCH, HIDDEN, requires_grad=True)
    with store.split_backward():
        output = layer._forward_impl(input=x, weight=other, bias=None, gradient_accumulation_fusion=False,
                                     allreduce_dgrad=False, sequence_parallel=False, tp_group=tp_group)
        output.sum().backward()
    assert other.grad is not None and store.pending_count == 0


def test_w_out_of_order_raises_schedule_error(tp_group):
    layer = make_layer("row", False, tp_group)
    data = microbatch_data(layer)
    store = WeightGradStore("chunk0")
    store.attach(layer, MEGATRON)
    run_b_passes(layer, data[:2], store)
    with pytest.raises(ScheduleError, match="W of microbatch 1 requested .* microbatch 0 is next"):
        store.run_next(1)
    store.run_next(0)
    store.run_next(1)
    with pytest.raises(ScheduleError, match="no pending B"):
        store.run_next(2)


def test_store_state_errors_and_detach(tp_group):
    layer = make_layer("column", False, tp_group)
    store, other = WeightGradStore("a"), WeightGradStore("b")
    store.attach(layer, MEGATRON)
    with pytest.raises(PatchError, match="already split into WeightGradStore 'a'"):
        other.attach(layer, MEGATRON)
    with pytest.raises(RuntimeError, match="outside split_backward"):
        store.defer(object())
    store.close_microbatch(0)
    with pytest.raises(ScheduleError, match="already has pending"):
        store.close_microbatch(0)
    assert store.run_next(0) == 0  # a microbatch without deferred work still keeps FIFO order
    store.detach()
    assert "_forward_impl" not in vars(layer)


def test_fused_accumulation_into_main_grad_matches_megatron(tp_group, monkeypatch):
    """gradient_accumulation_fusion with a stand-in for apex's kernel (CPU has none)."""
    def wgrad_gemm_accum_fp32(total_input, grad_output, main_grad):
        main_grad.add_(grad_output.t().matmul(total_input))

    kernels = types.SimpleNamespace(wgrad_gemm_accum_fp32=wgrad_gemm_accum_fp32)
    monkeypatch.setattr(layers, "fused_weight_gradient_mlp_cuda", kernels, raising=False)

    def layer_with_main_grad():
        layer = make_layer("column", True, tp_group, fusion=True)
        layer.weight.main_grad = torch.zeros_like(layer.weight)
        return layer

    reference = layer_with_main_grad()
    data = microbatch_data(reference)
    want = fused_run(reference, data)
    assert reference.weight.grad is None  # megatron returns no weight grad without DDP's flag

    layer = layer_with_main_grad()
    layer.weight.grad_added_to_main_grad = False  # as megatron DDP sets it
    store = WeightGradStore("test")
    store.attach(layer, MEGATRON)
    assert_bit_identical(split_run(layer, data, store), want)
    assert layer.weight.grad_added_to_main_grad is True and layer.weight.grad is None


def test_ddp_style_main_grad_without_fusion_matches_megatron_hook(tp_group):
    """Without fusion megatron DDP's post-hook does main_grad.add_(param.grad); W must do the same."""
    def with_ddp_hook(layer):
        for param in layer.parameters():
            param.main_grad = torch.zeros_like(param)
            param.grad_added_to_main_grad = False
            accumulate = param.expand_as(param).grad_fn.next_functions[0][0]

            def hook(*_, param=param):
                if param.grad is not None and not param.grad_added_to_main_grad:
                    param.main_grad.add_(param.grad.data)
                param.grad = None

            accumulate.register_hook(hook)
            layer._keep = getattr(layer, "_keep", []) + [accumulate]
        return layer

    reference = with_ddp_hook(make_layer("row", True, tp_group))
    data = microbatch_data(reference)
    want = fused_run(reference, data)

    layer = with_ddp_hook(make_layer("row", True, tp_group))
    ready = []
    store = WeightGradStore("test", grad_ready=ready.append)
    store.attach(layer, MEGATRON)
    assert_bit_identical(split_run(layer, data, store, last=MICROBATCHES - 1), want)
    assert ready == [layer.weight]  # once, when the last microbatch's W completed it
    assert layer.weight.grad is None


def _with_ddp_hook(layer):
    """megatron DDP's backward post-hook without fusion: main_grad.add_(param.grad) once autograd has the gradient."""
    for param in layer.parameters():
        param.main_grad = torch.zeros_like(param)
        accumulate = param.expand_as(param).grad_fn.next_functions[0][0]

        def hook(*_, param=param):
            if param.grad is not None:
                param.main_grad.add_(param.grad.data)
            param.grad = None

        accumulate.register_hook(hook)
        layer._keep = getattr(layer, "_keep", []) + [accumulate]
    return layer


def _uses_of_one_layer(layer, inputs, grad_ys, uses: int):
    """One backward through `uses` calls of the same layer (as the LM head computes the main logits and each MTP
    layer's): the sum of their outputs, scaled apart so that each use's gradient differs."""
    xs = [x.clone().requires_grad_(True) for x in inputs[:uses]]
    total = sum(layer(x)[0] * (1.0 + k / 3) for k, x in enumerate(xs))
    total.backward(grad_ys[0])
    return [x.grad for x in xs]


@pytest.mark.parametrize("uses", (2, 3))
@pytest.mark.parametrize("pass_kind", ("B then W", "BW"))
def test_a_weight_used_several_times_in_one_backward_sums_its_gradients_before_accumulating(tp_group, uses, pass_kind):
    """Without gradient-accumulation fusion autograd adds a weight's gradients from every use in the backward, in
    the order they arrive, and megatron DDP's hook adds that sum to main_grad once: (m + (g1 + g2)), not
    ((m + g1) + g2), which differs in the last bit. The store's W (deferred, or run as a BW pass ends) does the same,
    microbatch after microbatch."""
    data = microbatch_data(make_layer("column", False, tp_group))
    inputs, grad_ys = [x for x, _ in data], [gy for _, gy in data]
    reference = _with_ddp_hook(make_layer("column", False, tp_group))
    want = [_uses_of_one_layer(reference, inputs, grad_ys[mb:], uses) for mb in range(MICROBATCHES)]

    layer = _with_ddp_hook(make_layer("column", False, tp_group))
    store = WeightGradStore("test")
    store.attach(layer, MEGATRON)
    got = []
    for mb in range(MICROBATCHES):
        if pass_kind == "BW":
            with store.fused_backward(last=mb == MICROBATCHES - 1):
                got.append(_uses_of_one_layer(layer, inputs, grad_ys[mb:], uses))
            continue
        with store.split_backward():
            got.append(_uses_of_one_layer(layer, inputs, grad_ys[mb:], uses))
        assert store.pending_count == mb + 1  # one work per microbatch: the later uses absorbed
        store.close_microbatch(mb)
    store.flush()
    assert all(torch.equal(a, b) for mine, theirs in zip(got, want) for a, b in zip(mine, theirs))
    assert torch.equal(layer.weight.main_grad, reference.weight.main_grad)
    separately = torch.zeros_like(layer.weight)  # what accumulating each use on its own gives: another last bit
    for mb in range(MICROBATCHES):
        for k in range(uses):
            grad_output = grad_ys[mb] * (1.0 + k / 3)
            separately.add_(grad_output.reshape(-1, grad_output.shape[-1]).t().matmul(inputs[k].reshape(-1, HIDDEN)))
    assert not torch.equal(separately, reference.weight.main_grad)


# ---- TP=2 (and a tiny GPTModel) in spawned gloo ranks: one group runs every scenario -----------------
INTERLEAVED = ["B0", "B1", "W0", "B2", "W1", "W2"]
GPT_MICROBATCHES = 3


def _tp2_layer_cases() -> dict:
    """Per case: what B+W got different from megatron's grad_input, weight and bias grads, bytes left."""
    from tests.megatron import process_groups

    from megatron.core.tensor_parallel import mappings
    from megatron.zero_bubble.patches._patching import PatchSet
    from megatron.zero_bubble.patches.cpu_backend_torch import CpuTorch

    process_groups.init_parallel_state(tp=2)
    # The CPU backend leaves mappings.py alone (GPTModel on CPU never uses sequence parallelism), but its
    # sequence-parallel reduce-scatter allocates on torch.cuda.current_device(): seen as the CPU here.
    sequence_parallel_on_cpu = PatchSet("test_sequence_parallel_on_cpu")
    if mappings.torch is torch:
        sequence_parallel_on_cpu.replace(mappings, "torch", CpuTorch())
    try:
        return _tp2_layer_cases_on(dist.get_rank())
    finally:
        sequence_parallel_on_cpu.restore()


def _tp2_layer_cases_on(rank: int) -> dict:
    out = {}
    for kind, bias in CASES:
        for sp in (False, True):
            reference = make_layer(kind, bias, None, tp=2, sp=sp)
            data = microbatch_data(reference, seed=1 + rank, tp=2)
            want = fused_run(reference, data)
            layer = make_layer(kind, bias, None, tp=2, sp=sp)
            store = WeightGradStore("tp2")
            store.attach(layer, MEGATRON)
            got = split_run(layer, data, store, order=INTERLEAVED)
            out[(kind, bias, sp)] = {"mismatches": mismatches(got, want), "pending_bytes": store.pending_bytes}
    return out


def _gpt_manual_run(chunk, spec, store=None, order=None) -> dict:
    """F and backward per microbatch by hand; with a store, B under split_backward and W in `order`."""
    from tests.megatron import rank_model

    def forward(mb):
        batch = rank_model.mock_microbatch(mb, spec)
        losses = chunk(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
        mask = batch["loss_mask"].view(-1)
        return torch.sum(losses.view(-1) * mask) / mask.sum()

    order = order or [f"B{mb}" for mb in range(GPT_MICROBATCHES)]
    peak_pending = 0
    for event in order:
        mb = int(event[1:])
        if event[0] == "W":
            store.run_next(mb)
        elif store is None:
            forward(mb).backward()
        else:
            loss = forward(mb)
            with store.split_backward():
                loss.backward()
            store.close_microbatch(mb)
            peak_pending = max(peak_pending, store.pending_bytes)
    return rank_model.full_grads([chunk]), peak_pending


def _gpt_case(tp: int, sp: bool, ddp: bool, schedule: bool) -> dict:
    """Megatron's backward vs B/W split on a tiny GPTModel; returns {"equal": ..., "deferred": ...}."""
    from tests.megatron import harness, process_groups, rank_model

    spec = harness.ModelSpec()
    process_groups.init_parallel_state(tp=tp)

    def build():
        chunks = rank_model.build_gpt_chunks(spec, init_seed=0, sequence_parallel=sp)
        if ddp:
            chunks = rank_model.wrap_in_ddp(chunks)
            chunks[0].config.finalize_model_grads_func = None  # compare grads before any DP reduction
        return chunks[0]

    if schedule:  # megatron's own no-pipelining schedule, W flushed after it returns
        reference = build()
        rank_model.run_forward_backward([reference], spec, GPT_MICROBATCHES)
        want = rank_model.full_grads([reference])
    else:
        want, _ = _gpt_manual_run(build(), spec)
    chunk = build()
    store = WeightGradStore("gpt")
    deferred = store.attach(chunk, MEGATRON)
    if schedule:
        with store.split_backward():
            rank_model.run_forward_backward([chunk], spec, GPT_MICROBATCHES)
        peak_pending = store.pending_bytes
        store.flush()
        got = rank_model.full_grads([chunk])
    else:
        got, peak_pending = _gpt_manual_run(chunk, spec, store, INTERLEAVED)
    assert store.pending_count == 0 and store.pending_bytes == 0
    differing = sorted(name for name in want if not torch.equal(got.get(name), want[name]))
    return {"names": sorted(want) == sorted(got), "differing": differing, "deferred": deferred,
            "peak_pending_bytes": peak_pending}


# Sequence parallelism is covered by the layer cases: megatron's local-spec LayerNorm refuses it.
GPT_CASES = {  # label: (tp, sequence parallel, megatron DDP, megatron's schedule)
    "tp2": (2, False, False, False),
    "tp2-ddp": (2, False, True, False),
    "tp2-schedule": (2, False, False, True),
    "tp1xdp2-ddp": (1, False, True, False),
}


def _all_spawned_cases() -> dict:
    return {"layers": _tp2_layer_cases(), **{label: _gpt_case(*case) for label, case in GPT_CASES.items()}}


@pytest.fixture(scope="module")
def spawned():
    from tests.megatron import harness

    harness.preload_megatron()
    return harness.spawn(_all_spawned_cases, 2, timeout=600, start_method="fork")


@pytest.mark.exactness
@pytest.mark.parametrize("kind,bias", CASES)
@pytest.mark.parametrize("sp", (False, True), ids=("tp2", "tp2-sequence-parallel"))
def test_tp2_split_matches_megatron_bit_for_bit_with_its_collectives(spawned, kind, bias, sp):
    for rank in spawned:
        assert rank["layers"][(kind, bias, sp)] == {"mismatches": [], "pending_bytes": 0}


@pytest.mark.exactness
@pytest.mark.parametrize("label", list(GPT_CASES))
def test_tiny_gpt_split_gradients_are_bit_identical_to_megatron(spawned, label):
    for rank in spawned:
        case = rank[label]
        assert case["names"] and case["differing"] == []
        assert case["deferred"] == 4 * 4 + 1  # qkv, proj, fc1, fc2 per layer and the output layer
        assert case["peak_pending_bytes"] > 0  # W really was held back until its W pass


def test_split_backward_benchmark_runs_at_tiny_size(tp_group):
    """benchmarks/split_backward.py's measurement, both layers, at a size that takes milliseconds."""
    from benchmarks.split_backward import measure

    for kind in ("column", "row"):
        result = measure(kind, hidden=16, micro_batch=1, dtype=torch.float32, reps=2, group=tp_group, seq=8)
        assert all(len(result[key]) == 2 and min(result[key]) > 0 for key in ("fused", "b", "w"))
