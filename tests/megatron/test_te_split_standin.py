"""The Transformer Engine split's driving code (patches/te_wgrad.py) on CPU, against the labelled stand-in.

tests/te_standin.py keeps TE's deferral contract (per-module FIFO, backward_dw pops one entry, "Pop empty
queue", main_grad fusion with a placeholder gradient); here the runtime's WeightGradStore drives it: which modules
are switched, the W order, BW passes, readiness, undo. The reference is the stand-in's own undeferred backward (what
megatron's schedules run), compared with torch.equal. The same checks on TE's own modules are in te_split_cases.py
(TE's Python on the CPU over the kernel layer, for one release of each line; FP8 included), and a GPT on TE's layers
through the runtime in te_gpt_cases.py; what stays here is what TE's own code cannot show on the CPU: each release
line's behaviour side by side in one process, and the refusals of modules TE builds only on a GPU (Userbuffers).
"""
from __future__ import annotations

import types

import pytest
import torch

from megatron.zero_bubble.patches import imports

imports.install()

from megatron.zero_bubble.patches import te_wgrad  # noqa: E402
from megatron.zero_bubble.patches._patching import PatchError  # noqa: E402
from megatron.zero_bubble.patches.megatron_adapter import MegatronAdapter  # noqa: E402
from megatron.zero_bubble.runtime.wgrad_store import WeightGradStore  # noqa: E402
from megatron.zero_bubble.schedules.schedule import ScheduleError  # noqa: E402
from tests import te_standin  # noqa: E402

HIDDEN, FFN, TOKENS, MICROBATCHES = 8, 12, 10, 3
ADAPTER = MegatronAdapter(te_layer_types=te_standin.KINDS)


class Block(torch.nn.Module):
    """Two stand-in TE modules and a plain torch Linear (not TE: never switched)."""

    def __init__(self, fuse: bool = False, seed: int = 0, release: tuple = te_standin.NEWEST_RELEASE):
        super().__init__()
        self.proj = te_standin.StandInLinear(HIDDEN, HIDDEN, fuse_wgrad_accumulation=fuse, release=release)
        self.mlp = te_standin.StandInLayerNormMLP(HIDDEN, FFN, fuse_wgrad_accumulation=fuse, release=release)
        self.head = torch.nn.Linear(HIDDEN, HIDDEN)
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for param in self.parameters():
                param.copy_(torch.randn(param.shape, generator=generator) * 0.3)

    def forward(self, x):
        return self.head(self.mlp(self.proj(x)))


def data(seed: int = 1):
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(TOKENS, HIDDEN, generator=generator), torch.randn(TOKENS, HIDDEN, generator=generator))
            for _ in range(MICROBATCHES)]


def with_main_grads(block: Block, ddp_flag: bool = False) -> Block:
    """Weights of the TE modules accumulate into main_grad (the stand-in's fusion); ddp_flag: megatron DDP's
    grad_added_to_main_grad on them too (TE then returns its placeholder gradient)."""
    for layer in (block.proj, block.mlp):
        for name, param in layer.named_parameters():
            if name.endswith("weight") and not name.startswith("layer_norm"):
                param.main_grad = torch.zeros_like(param)
                if ddp_flag:
                    param.grad_added_to_main_grad = False
    return block


def grads(block: Block, inputs) -> dict:
    out = {name: (p.main_grad if getattr(p, "main_grad", None) is not None else p.grad).clone()
           for name, p in block.named_parameters()}
    out.update({f"input{i}": x.grad.clone() for i, x in enumerate(inputs)})
    return out


def fused_run(block: Block, batches) -> dict:
    inputs = []
    for x, dy in batches:
        x = x.clone().requires_grad_()
        block(x).backward(dy)
        inputs.append(x)
    return grads(block, inputs)


def split_run(block: Block, batches, store: WeightGradStore, w_after_each_b: bool = False) -> dict:
    inputs = []
    for mb, (x, dy) in enumerate(batches):
        x = x.clone().requires_grad_()
        out = block(x)
        with store.split_backward():
            out.backward(dy)
        store.close_microbatch(mb, last=mb == len(batches) - 1)
        inputs.append(x)
        if w_after_each_b:
            store.run_next(mb)
    for mb in store.pending_microbatches:
        store.run_next(mb)
    return grads(block, inputs)


def assert_identical(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    different = [name for name in want if not torch.equal(got[name], want[name])]
    assert not different, f"differ: {different}"


# The stand-in's behaviour of each line of the version table that the split accepts (docs/transformer-engine.md):
# before 2.8 backward_dw sets weight.grad only where it is None (accepted with main_grad fusion alone), 2.20 skips a
# bias gradient the GEMM did not give.
ACCEPTED_RELEASES = {"2.3 to 2.7": (2, 7), "2.8 to 2.19": (2, 19), "2.20": (2, 20)}
SPLIT_CASES = [(mode, release) for mode in ("plain", "main_grad", "main_grad+ddp_flag")
               for release in ACCEPTED_RELEASES.values()
               if te_wgrad.version_refusal(f"{release[0]}.{release[1]}.0", mode != "plain") is None]


def test_every_accepted_line_of_the_version_table_has_a_stand_in_case():
    assert {release for _, release in SPLIT_CASES} == set(ACCEPTED_RELEASES.values())
    assert ("plain", (2, 7)) not in SPLIT_CASES and ("plain", (2, 20)) in SPLIT_CASES


def _case_id(case) -> str:
    mode, (major, minor) = case
    return f"{mode}-te{major}.{minor}"


@pytest.mark.parametrize("w_after_each_b", [False, True])
@pytest.mark.parametrize("mode, release", SPLIT_CASES, ids=[_case_id(case) for case in SPLIT_CASES])
def test_standin_te_modules_split_into_b_and_w_match_their_fused_backward_bit_for_bit(mode, release, w_after_each_b):
    fuse = mode != "plain"
    reference = Block(fuse, release=release)
    split = Block(fuse, release=release)
    if fuse:
        with_main_grads(reference, mode.endswith("ddp_flag"))
        with_main_grads(split, mode.endswith("ddp_flag"))
    want = fused_run(reference, data())
    store = WeightGradStore("chunk 0")
    assert store.attach(split, ADAPTER) == 6  # proj: weight, bias; mlp: fc1/fc2 weights and biases
    got = split_run(split, data(), store, w_after_each_b)
    assert_identical(got, want)
    assert store.pending_count == 0 and store.pending_bytes == 0


def test_b_pass_leaves_te_weight_gradients_queued_and_the_norm_gradients_computed():
    block = Block()
    store = WeightGradStore("chunk 0")
    store.attach(block, ADAPTER)
    x, dy = data()[0]
    with store.split_backward():
        block(x).backward(dy)
    store.close_microbatch(0)
    assert block.proj.weight.grad is None and block.proj.bias.grad is None
    assert block.mlp.fc1_weight.grad is None and block.mlp.fc2_bias.grad is None
    assert block.mlp.layer_norm_weight.grad is not None and block.head.weight.grad is not None
    assert block.proj.wgrad_store.qsize() == 1 and block.mlp.wgrad_store.qsize() == 2  # the MLP queues two GEMMs
    assert store.pending_microbatches == [0] and store.pending_count == 3
    assert store.pending_bytes == sum(t.numel() * 4 for q in (block.proj.wgrad_store, block.mlp.wgrad_store)
                                      for tensors, _ in q._entries for t in tensors)
    store.run_next(0)
    assert block.proj.weight.grad is not None and block.mlp.fc1_weight.grad is not None
    assert block.proj.wgrad_store.empty() and block.mlp.wgrad_store.empty()


def test_the_switch_answers_defer_in_forwards_and_b_passes_only():
    block = Block()
    store = WeightGradStore("chunk 0")
    store.attach(block, ADAPTER)
    queue = block.proj.wgrad_store
    assert queue.delay_wgrad_compute()  # grad mode on: a forward keeps the queue for its backward
    with torch.no_grad():
        assert not queue.delay_wgrad_compute()  # a backward outside a B pass: computed at once
        with store.split_backward():
            assert queue.delay_wgrad_compute()
    queue.disable_delay_wgrad_compute()
    assert not queue.delay_wgrad_compute()


def test_a_bw_pass_on_switched_modules_is_their_fused_backward():
    want = fused_run(Block(), data())
    block = Block()
    store = WeightGradStore("chunk 0")
    store.attach(block, ADAPTER)
    inputs = []
    for mb, (x, dy) in enumerate(data()):
        x = x.clone().requires_grad_()
        with store.fused_backward(last=mb == MICROBATCHES - 1):
            block(x).backward(dy)
        inputs.append(x)
    assert store.pending_count == 0 and block.proj.wgrad_store.empty()
    assert_identical(grads(block, inputs), want)


def test_w_runs_in_b_order_and_an_empty_queue_raises_tes_error():
    block = Block()
    store = WeightGradStore("chunk 0")
    store.attach(block, ADAPTER)
    for mb, (x, dy) in enumerate(data()[:2]):
        with store.split_backward():
            block(x).backward(dy)
        store.close_microbatch(mb)
    with pytest.raises(ScheduleError, match="microbatch 0 is next"):
        store.run_next(1)
    store.run_next(0)
    store.run_next(1)
    with pytest.raises(RuntimeError, match="Pop empty queue"):
        block.proj.wgrad_store.pop()
    with pytest.raises(RuntimeError, match="Pop empty queue"):
        te_standin.StandInLinear(2, 2).wgrad_store.__class__(True).pop()


def test_w_of_one_microbatch_pops_each_modules_oldest_entry():
    """Work items are per queued entry: W of microbatch 0 pops what B of microbatch 0 queued, even after B of
    microbatch 1 queued more (per-module FIFO), and an MLP's two entries are popped by one backward_dw."""
    block = Block()
    store = WeightGradStore("chunk 0")
    store.attach(block, ADAPTER)
    batches = data()
    for mb, (x, dy) in enumerate(batches[:2]):
        with store.split_backward():
            block(x).backward(dy)
        store.close_microbatch(mb)
    store.run_next(0)
    assert block.proj.wgrad_store.pops == 1 and block.mlp.wgrad_store.pops == 2
    assert block.proj.wgrad_store.qsize() == 1 and block.mlp.wgrad_store.qsize() == 2
    reference = Block()
    x, dy = batches[0]
    reference(x).backward(dy)
    assert torch.equal(block.proj.weight.grad, reference.proj.weight.grad)
    assert torch.equal(block.mlp.fc1_weight.grad, reference.mlp.fc1_weight.grad)


def test_readiness_reports_every_te_weight_and_bias_once_after_its_last_microbatch():
    block = Block()
    reported = []
    store = WeightGradStore("chunk 0", grad_ready=reported.append)
    store.attach(block, ADAPTER)
    held = [block.proj.weight, block.proj.bias, block.mlp.fc1_weight, block.mlp.fc1_bias, block.mlp.fc2_weight,
            block.mlp.fc2_bias]
    for mb, (x, dy) in enumerate(data()):
        with store.split_backward():
            block(x).backward(dy)
        store.close_microbatch(mb, last=mb == MICROBATCHES - 1)
        assert not reported
    for mb in store.pending_microbatches:
        store.run_next(mb)
    assert sorted(map(id, reported)) == sorted(map(id, held))  # the norm's parameters complete in B (DDP's hook)


def test_which_modules_are_switched_and_undo_gives_each_its_own_queue_back():
    block = Block()
    frozen = te_standin.StandInLinear(HIDDEN, HIDDEN)
    frozen.weight.requires_grad_(False)
    frozen.bias.requires_grad_(False)
    block.frozen = frozen
    originals = {name: m.wgrad_store for name, m in block.named_modules() if hasattr(m, "wgrad_store")}
    store = WeightGradStore("chunk 0")
    store.attach(block, ADAPTER)
    switched = {name for name, m in block.named_modules() if isinstance(getattr(m, "wgrad_store", None),
                                                                        te_wgrad.ModuleWgradQueue)}
    assert switched == {"proj", "mlp"}
    with pytest.raises(PatchError, match="already split"):
        WeightGradStore("chunk 1").attach(block, ADAPTER)
    store.detach()
    assert all(block.get_submodule(name).wgrad_store is queue for name, queue in originals.items())


def test_a_deferral_outside_a_b_pass_is_refused():
    block = Block()
    store = WeightGradStore("chunk 0")
    store.attach(block, ADAPTER)
    with pytest.raises(RuntimeError, match="outside a B pass"):
        block.proj.wgrad_store.put([torch.zeros(1)], lambda t: (None, None))


@pytest.mark.parametrize("version, fused, needed", [
    (None, True, "not installed"), ("2.2.1", True, "2.3 to 2.20"), ("2.3.0", True, None),
    ("2.7.0", False, "2.8 to 2.20"),
    ("2.8.0", False, None), ("2.14.0+cu13", False, None), ("2.19.0", False, None), ("2.20.2", False, None),
    ("2.20.2", True, None), ("2.21.0", True, "newer"),
])
def test_te_versions_that_cannot_defer_are_refused_naming_the_version_needed(version, fused, needed):
    reason = te_wgrad.version_refusal(version, fused)
    assert (reason is None) == (needed is None)
    if needed is not None:
        assert needed in reason



# -- TE issue #3437: without main_grad fusion backward_dw assigns weight.grad instead of adding to it -------------
class CalledTwice(torch.nn.Module):
    """One stand-in Linear applied twice in a forward: its weight gets two gradients in one backward."""

    def __init__(self, fuse: bool, release: tuple):
        super().__init__()
        self.proj = te_standin.StandInLinear(HIDDEN, HIDDEN, fuse_wgrad_accumulation=fuse, release=release)
        generator = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for param in self.parameters():
                param.copy_(torch.randn(param.shape, generator=generator) * 0.3)

    def forward(self, x):
        return self.proj(torch.tanh(self.proj(x)))


def test_the_stand_in_assigns_weight_grad_in_backward_dw_as_te_does():
    """What makes #3437: a second backward_dw overwrites the first one's weight gradient (TE 2.8 on)."""
    layer = CalledTwice(fuse=False, release=(2, 20)).proj
    layer.wgrad_store = te_standin.StandInWeightGradStore(delay_wgrad_compute=True)
    x, dy = data()[0]
    layer(x).backward(dy)
    layer(x).backward(dy)
    layer.backward_dw()
    first = layer.weight.grad.clone()
    layer.backward_dw()
    assert torch.equal(layer.weight.grad, first)  # assigned again, not added: 2 * first is what autograd would hold


TWO_GRADIENT_CASES = [case for case in SPLIT_CASES if case[1] >= (2, 8)]


@pytest.mark.parametrize("mode, release", TWO_GRADIENT_CASES, ids=[_case_id(case) for case in TWO_GRADIENT_CASES])
def test_a_weight_with_two_gradients_per_microbatch_gets_their_sum_although_backward_dw_assigns(mode, release):
    fuse = mode != "plain"
    modules = [CalledTwice(fuse, release) for _ in range(2)]
    if fuse:
        for module in modules:
            module.proj.weight.main_grad = torch.zeros_like(module.proj.weight)
            if mode.endswith("ddp_flag"):
                module.proj.weight.grad_added_to_main_grad = False
    reference, split = modules
    want = fused_run(reference, data())
    store = WeightGradStore("chunk 0")
    store.attach(split, ADAPTER)
    got = split_run(split, data(), store)
    assert split.proj.wgrad_store.puts == 2 * MICROBATCHES  # two entries, two assignments, per microbatch
    assert_identical(got, want)



# -- refused per module -------------------------------------------------------------------------------------
USERBUFFERS_CASES = [(kind, option) for kind in te_standin.KINDS for option in kind.USERBUFFERS]


def _standin(kind):
    if kind is te_standin.StandInGroupedLinear:
        return kind(2, HIDDEN, HIDDEN)
    return kind(HIDDEN, FFN) if kind is te_standin.StandInLayerNormMLP else kind(HIDDEN, HIDDEN)


@pytest.mark.parametrize("kind, option", USERBUFFERS_CASES,
                         ids=[f"{kind.__name__}-{option}" for kind, option in USERBUFFERS_CASES])
def test_a_te_module_with_a_userbuffers_option_is_refused_in_one_line_naming_it(kind, option):
    block = torch.nn.Module()
    block.first = te_standin.StandInLinear(HIDDEN, HIDDEN)
    block.overlapped = _standin(kind)
    setattr(block.overlapped, option, True)
    originals = {name: m.wgrad_store for name, m in block.named_children()}
    with pytest.raises(PatchError) as refused:
        WeightGradStore("chunk 0").attach(block, ADAPTER)
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith(f"overlapped: Transformer Engine's Userbuffers option {option} does not work with a "
                              f"schedule that splits the backward (")
    assert message.endswith("build overlapped without Userbuffers options (megatron: drop --tp-comm-overlap), or use "
                            "a schedule that does not split it (--pipeline-schedule 1f1b)")
    if option in te_wgrad.USERBUFFERS_IN_W:
        assert te_wgrad.USERBUFFERS_IN_W[option] in message
    assert all(getattr(block, name).wgrad_store is queue for name, queue in originals.items())


def test_userbuffers_options_that_are_off_are_no_refusal():
    block = Block()
    assert all(getattr(layer, option) is False for layer in (block.proj, block.mlp) for option in layer.USERBUFFERS)
    assert WeightGradStore("chunk 0").attach(block, ADAPTER) == 6


class Tied(torch.nn.Module):
    """Two stand-in Linears sharing one weight (#3437's case)."""

    def __init__(self):
        super().__init__()
        self.first = te_standin.StandInLinear(HIDDEN, HIDDEN, bias=False)
        self.second = te_standin.StandInLinear(HIDDEN, HIDDEN, bias=False)
        self.second.weight = self.first.weight

    def forward(self, x):
        return self.second(self.first(x))


def test_a_parameter_that_a_te_module_shares_with_another_is_refused_in_one_line():
    block = Tied()
    originals = {name: m.wgrad_store for name, m in block.named_children()}
    with pytest.raises(PatchError) as refused:
        WeightGradStore("chunk 0").attach(block, ADAPTER)
    message = str(refused.value)
    assert "\n" not in message
    assert message == ("first.weight and second.weight are one parameter (tied), and a schedule that splits the "
                       "backward sets a B pass's gradient of a Transformer Engine module's parameters aside, which "
                       "would drop the other use's; untie them, or use a schedule that does not split the backward "
                       "(--pipeline-schedule 1f1b)")
    assert all(getattr(block, name).wgrad_store is queue for name, queue in originals.items())


def test_a_te_weight_tied_to_a_module_outside_te_is_refused_too():
    block = Block()
    block.head.weight = block.proj.weight  # a plain torch Linear using the TE module's weight
    with pytest.raises(PatchError, match=r"^proj.weight and head.weight are one parameter \(tied\)"):
        WeightGradStore("chunk 0").attach(block, ADAPTER)


def test_a_module_the_split_refuses_stops_a_training_run_in_one_line(monkeypatch, capsys):
    """Met when the runtime first takes the chunks over, inside megatron's training loop: the session turns it into
    the one-line refusal (exit status 2, no traceback), as it does a failed split check."""
    from megatron.zero_bubble.training import setup

    class Session:  # stands for ZeroBubbleSession: nothing installed
        def __init__(self, **options):
            self.pipeline = None

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(setup, "ZeroBubbleSession", Session)
    monkeypatch.setattr(setup, "plan_settings", lambda args, options: types.SimpleNamespace(chunks=1))
    monkeypatch.setattr(setup, "messaging_options", lambda args: None)
    monkeypatch.setenv("RANK", "0")
    args = types.SimpleNamespace(transformer_impl="local", pipeline_model_parallel_size=4, overlap_grad_reduce=False)
    options = types.SimpleNamespace(through_runtime=True, schedule="zb-h1", split_check=True, post_validation=False)
    block = Block()
    WeightGradStore("chunk 0").attach(block, ADAPTER)
    with pytest.raises(SystemExit) as stopped:
        with setup.zero_bubble_session(args, options):
            WeightGradStore("chunk 1").attach(block, ADAPTER)  # what the executor does at the first training call
    assert stopped.value.code == 2
    printed = capsys.readouterr()
    assert printed.err.count("\n") == 1 and "Traceback" not in printed.err + printed.out
    assert printed.err.endswith(": error: proj is already split into WeightGradStore 'chunk 0'; a layer can belong to "
                                "one model chunk only\n")
