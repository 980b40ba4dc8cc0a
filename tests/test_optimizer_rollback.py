"""Undoing one optimizer step (post-update validation): exact snapshot/restore and the in-place inverse.

Distances are in ulps of float32. The raw distance (how many floats lie between two values) explodes
for values near zero that a step moved through (a param of 1e-6 moved by an update of 1e-3 keeps only
the update's precision), so the in-place inverse is judged in "scaled ulps": |error| / ulp(s), where s is
the largest magnitude the element had across the compared step(s). Both figures are printed (run with
`-s` to see them).
"""
from __future__ import annotations

import pytest
import torch

from megatron.zero_bubble.runtime.optimizer_rollback import (
    RollbackError,
    StepRecord,
    invert,
    inverse_unsupported_reason,
    prepare,
    restore,
    snapshot,
)

SIZES = (3072, 2000, 1000)
HINT = "use --zero-bubble-exact-rollback."

pytestmark = pytest.mark.exactness  # in-process, number for number: CI runs it again (.ci/run)


# -- ulp measures -------------------------------------------------------------------------------------------
def _ordered_bits(x: torch.Tensor) -> torch.Tensor:
    bits = x.contiguous().view(torch.int32).to(torch.int64)
    return torch.where(bits < 0, -(bits & 0x7FFFFFFF), bits)  # monotone in the float's value, +0 == -0


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many float32 values lie between a and b (0 iff equal)."""
    return (_ordered_bits(a) - _ordered_bits(b)).abs()


def scaled_ulp_distance(a: torch.Tensor, b: torch.Tensor, *scales: torch.Tensor) -> torch.Tensor:
    """|a - b| in ulps of the largest magnitude among `scales` (elementwise)."""
    scale = torch.stack([s.abs() for s in scales]).amax(0)
    ulp = torch.nextafter(scale, torch.full_like(scale, float("inf"))) - scale
    return (a.double() - b.double()).abs() / ulp.double()


def test_ulp_distance_counts_floats_between_values_across_zero():
    x = torch.tensor([1.0, -1e-30, 0.0, 3.0])
    up = torch.nextafter(x, torch.full_like(x, float("inf")))
    assert ulp_distance(x, up).tolist() == [1, 1, 1, 1]
    tiny = torch.tensor([1e-45])  # smallest subnormal: -tiny, 0, tiny are consecutive floats
    assert ulp_distance(tiny, -tiny).item() == 2
    assert scaled_ulp_distance(torch.tensor([1.0]), torch.tensor([1.0 + 2**-22]), torch.tensor([1.0])).item() == 2


# -- optimizers under test ------------------------------------------------------------------------------------
class FakeApexFusedAdam(torch.optim.Optimizer):
    """apex FusedAdam's documented adam_w_mode rule in plain torch ops (apex is not installed here), to
    check the inverse's algebra and the per-group 'step' handling, not the CUDA kernel's rounding."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, adam_w_mode=True):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, bias_correction=True))
        self.adam_w_mode = 1 if adam_w_mode else 0
        self.capturable = False

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            group["step"] = group.get("step", 0) + 1
            (beta1, beta2), lr, wd = group["betas"], group["lr"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["exp_avg"], state["exp_avg_sq"] = torch.zeros_like(p), torch.zeros_like(p)
                m, v = state["exp_avg"], state["exp_avg_sq"]
                m.mul_(beta1).add_(p.grad, alpha=1 - beta1)
                v.mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                denom = (v / (1 - beta2 ** group["step"])).sqrt_().add_(group["eps"])
                update = (m / (1 - beta1 ** group["step"])).div_(denom).add_(p, alpha=wd)
                p.add_(update, alpha=-lr)


FakeApexFusedAdam.__name__ = "FusedAdam"
FakeApexFusedAdam.__module__ = "apex.optimizers.fused_adam"


def _groups(params, second_group_overrides):
    return [{"params": params[:2]}, {"params": params[2:], **second_group_overrides}]


OPTIMIZERS = {  # second group: other lr / weight decay, so per-group hyperparameters are exercised
    "AdamW": lambda ps: torch.optim.AdamW(_groups(ps, {"lr": 3e-4, "weight_decay": 0.0}), lr=1e-3, weight_decay=0.1),
    "AdamW-foreach": lambda ps: torch.optim.AdamW(_groups(ps, {"lr": 3e-4}), lr=1e-3, weight_decay=0.1, foreach=True),
    "AdamW-fused": lambda ps: torch.optim.AdamW(_groups(ps, {"lr": 3e-4}), lr=1e-3, weight_decay=0.1, fused=True),
    "Adam": lambda ps: torch.optim.Adam(_groups(ps, {"lr": 3e-4}), lr=1e-3),
    "Adam-decoupled": lambda ps: torch.optim.Adam(
        _groups(ps, {"lr": 3e-4}), lr=1e-3, weight_decay=0.05, decoupled_weight_decay=True
    ),
    "SGD": lambda ps: torch.optim.SGD(_groups(ps, {"weight_decay": 0.0}), lr=1e-2, weight_decay=0.1),
    "SGD-momentum": lambda ps: torch.optim.SGD(_groups(ps, {"lr": 3e-3}), lr=1e-2, momentum=0.9, weight_decay=0.1),
    "SGD-nesterov": lambda ps: torch.optim.SGD(
        _groups(ps, {"weight_decay": 0.0}), lr=1e-2, momentum=0.9, nesterov=True, weight_decay=0.1
    ),
    "FusedAdam(fake apex)": lambda ps: FakeApexFusedAdam(_groups(ps, {"lr": 3e-4}), lr=1e-3, weight_decay=0.1),
}
UNSUPPORTED_BUT_SNAPSHOTTABLE = {
    "Adam-amsgrad": lambda ps: torch.optim.Adam(ps, lr=1e-3, amsgrad=True),
    "SGD-dampening": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, dampening=0.1),
}
WITHOUT_WEIGHT_DECAY = {  # SGD's momentum buffer takes in wd * p, so it depends on grads only without wd
    "SGD-momentum (no wd)": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9),
    "SGD-nesterov (no wd)": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, nesterov=True),
}
STATE_TENSORS = ("exp_avg", "exp_avg_sq", "momentum_buffer")


def make_params(seed: int = 0) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(n, generator=gen) * 0.02) for n in SIZES]  # megatron's init std


def set_grads(params, gen: torch.Generator, scale: float = 1e-2) -> list[torch.Tensor]:
    grads = [torch.randn(p.shape, generator=gen) * scale for p in params]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    return grads


def build(name: str, history_steps: int, seed: int = 0):
    """Params, optimizer and grad generator after `history_steps` steps with random grads."""
    params = make_params(seed)
    optimizer = {**OPTIMIZERS, **UNSUPPORTED_BUT_SNAPSHOTTABLE, **WITHOUT_WEIGHT_DECAY}[name](params)
    gen = torch.Generator().manual_seed(seed + 100)
    for _ in range(history_steps):
        set_grads(params, gen)
        optimizer.step()
    return params, optimizer, gen


def state_copy(optimizer, params):
    return [{k: v.clone() for k, v in optimizer.state[p].items()} if p in optimizer.state else None for p in params]


def _with_grads_and_copies(name, history_steps):
    """A built optimizer after `history_steps` steps, fresh grads set, and copies of what a step changes."""
    params, optimizer, gen = build(name, history_steps)
    set_grads(params, gen)
    group_steps = [g.get("step") for g in optimizer.param_groups]
    return params, optimizer, [p.detach().clone() for p in params], state_copy(optimizer, params), group_steps


# -- exact snapshot / restore ---------------------------------------------------------------------------------
@pytest.mark.parametrize("history_steps", [0, 1, 5])
@pytest.mark.parametrize("name", [*OPTIMIZERS, *UNSUPPORTED_BUT_SNAPSHOTTABLE])
def test_restore_puts_params_and_state_back_bit_for_bit(name, history_steps):
    params, optimizer, before_params, before_state, before_group_steps = _with_grads_and_copies(name, history_steps)
    state_objects = [dict(optimizer.state[p]) if p in optimizer.state else {} for p in params]

    saved = snapshot(optimizer)
    for _ in range(2):  # one snapshot serves twice
        optimizer.step()
        restore(optimizer, saved)
        for p, data, state, objects in zip(params, before_params, before_state, state_objects):
            assert torch.equal(p.detach(), data)
            if state is None:
                assert p not in optimizer.state  # first step: no state, as before
                continue
            assert set(optimizer.state[p]) == set(state)
            for key, value in state.items():
                assert torch.equal(optimizer.state[p][key], value), key
                assert optimizer.state[p][key] is objects[key]  # written in place
        assert [g.get("step") for g in optimizer.param_groups] == before_group_steps


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_exact_rollback_then_clipped_step_equals_direct_clipped_step(name):
    params, optimizer, gen = build(name, 3)
    ref_params, ref_optimizer, _ = build(name, 3)
    for _ in range(4):
        grads = set_grads(params, gen)
        saved = snapshot(optimizer)
        optimizer.step()
        restore(optimizer, saved)
        for p, rp, g in zip(params, ref_params, grads):
            p.grad.mul_(0.5)
            rp.grad = g.clone().mul_(0.5)
        optimizer.step()
        ref_optimizer.step()
    for p, rp in zip(params, ref_params):
        assert torch.equal(p.detach(), rp.detach())
        for key in STATE_TENSORS:
            if key in ref_optimizer.state[rp]:
                assert torch.equal(optimizer.state[p][key], ref_optimizer.state[rp][key])


# -- in-place inverse: one step -------------------------------------------------------------------------------
def _bounds(name: str) -> tuple[float, float]:
    """(params, states) bound in scaled ulps for one step + invert.

    Params: the update is recomputed bit for bit from the post-step state and subtracted with the step's
    own op, so one rounding (0.5 ulp of the larger of p0, p1) plus, with decoupled weight decay, one
    division: <= 1. torch's fused kernel rounds its update differently from the recomputation: <= 4.
    States: (s1 - contribution) / beta takes up to three roundings at the scale of max(s0, s1), over
    beta ~ 0.9: <= 4."""
    return (4.0 if "fused" in name.lower() else 1.0), 4.0


@pytest.mark.parametrize("history_steps", [0, 1, 5])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_invert_undoes_one_step_within_a_few_ulps(name, history_steps):
    params, optimizer, before_params, before_state, before_group_steps = _with_grads_and_copies(name, history_steps)

    record = prepare(optimizer)
    optimizer.step()
    after_params = [p.detach().clone() for p in params]
    after_state = state_copy(optimizer, params)
    invert(optimizer, record)

    param_bound, state_bound = _bounds(name)
    raw = max(ulp_distance(p.detach(), b).max().item() for p, b in zip(params, before_params))
    scaled = max(
        scaled_ulp_distance(p.detach(), b, b, a).max().item() for p, b, a in zip(params, before_params, after_params)
    )
    assert scaled <= param_bound
    worst: dict[str, tuple[int, float]] = {"params": (raw, scaled)}  # per state key, over all params
    for p, state, post in zip(params, before_state, after_state):
        if state is None:
            assert p not in optimizer.state  # created by the step: removed again
            continue
        assert set(optimizer.state[p]) == set(state)
        for key, value in state.items():
            now = optimizer.state[p][key]
            if key == "step":
                assert torch.equal(now, value)
                continue
            key_raw = ulp_distance(now, value).max().item()
            key_scaled = scaled_ulp_distance(now, value, value, post[key]).max().item()
            assert key_scaled <= state_bound, key
            old_raw, old_scaled = worst.get(key, (0, 0.0))
            worst[key] = (max(old_raw, key_raw), max(old_scaled, key_scaled))
    assert [g.get("step") for g in optimizer.param_groups] == before_group_steps
    figures = "; ".join(f"{key} scaled {s:.2f} (raw {r})" for key, (r, s) in worst.items())
    print(f"\n[invert] {name} k={history_steps}: {figures}")


@pytest.mark.parametrize("name", ["AdamW", "Adam", *WITHOUT_WEIGHT_DECAY, "FusedAdam(fake apex)"])
def test_state_removed_by_invert_is_recreated_by_next_step_as_on_a_first_step(name):
    params, optimizer, gen = build(name, 0)
    set_grads(params, gen)
    record = prepare(optimizer)
    optimizer.step()
    invert(optimizer, record)
    assert all(p not in optimizer.state for p in params)
    grads = set_grads(params, gen)
    optimizer.step()
    fresh_params, fresh_optimizer, _ = build(name, 0)
    for p, g in zip(fresh_params, grads):
        p.grad = g.clone()
    fresh_optimizer.step()
    for p, fp in zip(params, fresh_params):  # first-step state depends on the grads only
        assert set(optimizer.state[p]) == set(fresh_optimizer.state[fp])
        for key, value in fresh_optimizer.state[fp].items():
            assert torch.equal(optimizer.state[p][key], value), key
    assert [g.get("step") for g in optimizer.param_groups] == [g.get("step") for g in fresh_optimizer.param_groups]


@pytest.mark.parametrize("name", ["AdamW", "Adam", "Adam-decoupled", *WITHOUT_WEIGHT_DECAY])
def test_moments_that_were_exactly_zero_return_to_exactly_zero(name):
    """Like embedding rows of tokens not seen yet: state exists, but is 0 where the grads always were."""
    params, optimizer, gen = build(name, 0)
    for _ in range(3):
        for g in set_grads(params, gen):
            g[:500] = 0
        for p in params:
            p.grad[:500] = 0
        optimizer.step()
    set_grads(params, gen)  # now the zero rows get grads
    record = prepare(optimizer)
    optimizer.step()
    invert(optimizer, record)
    for p in params:
        for key in STATE_TENSORS:
            if key in optimizer.state[p]:
                assert torch.equal(optimizer.state[p][key][:500], torch.zeros(500)), key


def test_zero_initialised_adam_state_returns_to_exact_zero_and_step_zero():
    """State created before any step (as megatron's init_state_fn does, with a 'step' of 0)."""
    params = make_params()
    optimizer = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1)
    for p in params:
        zeros = {"exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
        optimizer.state[p] = {"step": torch.tensor(0.0), **zeros}
    set_grads(params, torch.Generator().manual_seed(3))
    record = prepare(optimizer)
    optimizer.step()
    invert(optimizer, record)
    for p in params:
        state = optimizer.state[p]
        assert state["step"].item() == 0
        assert torch.equal(state["exp_avg"], torch.zeros_like(p))
        assert torch.equal(state["exp_avg_sq"], torch.zeros_like(p))


def test_second_moment_never_goes_negative_when_the_new_grad_dominates():
    # v0 ~ 1e-8 * (1 - 0.999^3) against a new (1 - beta2) * g^2 ~ 10: v0 is lost in v1, and a negated
    # addcmul (an FMA on this CPU) would leave about half of the elements negative, NaN under sqrt.
    params = make_params()
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    gen = torch.Generator().manual_seed(5)
    for _ in range(3):
        set_grads(params, gen, scale=1e-4)
        optimizer.step()
    set_grads(params, gen, scale=1e2)
    record = prepare(optimizer)
    optimizer.step()
    invert(optimizer, record)
    assert all(optimizer.state[p]["exp_avg_sq"].min().item() >= 0 for p in params)
    set_grads(params, gen, scale=1e-4)
    optimizer.step()
    assert all(torch.isfinite(p).all() for p in params)


def test_params_without_grad_keep_their_bits_and_state():
    params, optimizer, gen = build("AdamW", 2)
    set_grads(params, gen)
    params[1].grad = None
    kept_param, kept_state = params[1].detach().clone(), state_copy(optimizer, params)[1]
    record = prepare(optimizer)
    optimizer.step()
    invert(optimizer, record)
    assert torch.equal(params[1].detach(), kept_param)
    assert all(torch.equal(optimizer.state[params[1]][k], v) for k, v in kept_state.items())


def test_invert_refuses_a_record_whose_grads_no_longer_match():
    params, optimizer, gen = build("AdamW", 1)
    set_grads(params, gen)
    record = prepare(optimizer)
    optimizer.step()
    params[0].grad = None
    with pytest.raises(RollbackError, match="grad"):
        invert(optimizer, record)
    other = torch.optim.AdamW(make_params(1))
    with pytest.raises(RollbackError, match="other parameters"):
        invert(other, record)
    assert isinstance(record, StepRecord)


# -- the use that matters: speculative step, invert, clipped re-step ---------------------------------------
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_speculative_step_invert_and_clipped_restep_tracks_direct_clipped_steps(name):
    params, optimizer, _ = build(name, 0)
    ref_params, ref_optimizer, _ = build(name, 0)
    gen = torch.Generator().manual_seed(7)
    largest = [p.detach().abs().clone() for p in ref_params]  # scale of every value each element took
    for _ in range(10):
        clip = 0.3 + 0.6 * torch.rand((), generator=gen).item()
        grads = set_grads(params, gen)
        record = prepare(optimizer)
        optimizer.step()
        invert(optimizer, record)
        for p, rp, g in zip(params, ref_params, grads):
            p.grad.mul_(clip)
            rp.grad = g.clone().mul_(clip)
        optimizer.step()
        ref_optimizer.step()
        for scale, rp in zip(largest, ref_params):
            torch.maximum(scale, rp.detach().abs(), out=scale)
    raw = torch.cat([ulp_distance(p.detach(), rp.detach()) for p, rp in zip(params, ref_params)])
    scaled = torch.cat(
        [scaled_ulp_distance(p.detach(), rp.detach(), s) for p, rp, s in zip(params, ref_params, largest)]
    )
    identical = (raw == 0).double().mean().item()
    print(
        f"\n[clip x10] {name}: max scaled ulps {scaled.max().item():.2f}, raw ulps max {raw.max().item()} "
        f"p99.9 {raw.double().quantile(0.999).item():.0f}, bit-identical {identical:.1%}"
    )
    # Each iteration's invert leaves <= 1 scaled ulp in a param (see _bounds) and the re-step from that
    # param rounds at most 1 ulp differently: <= 2 per iteration, 20 over 10. The moments' inverse
    # errors (<= 4 ulps of the moments) reach the params only through an update of size lr, far below
    # a param ulp (measured: 8 at most).
    assert scaled.max().item() <= 20


# -- which optimizers the inverse supports ----------------------------------------------------------------
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_supported_optimizers_have_no_refusal_reason(name):
    assert inverse_unsupported_reason(OPTIMIZERS[name](make_params())) is None


class _CustomOptimizer(torch.optim.Optimizer):
    def __init__(self, params):
        super().__init__(params, {"lr": 1e-3})


class _FakeTransformerEngineFusedAdam(FakeApexFusedAdam):
    def __init__(self, params):
        super().__init__(params)
        self.master_weights = True


_FakeTransformerEngineFusedAdam.__name__ = "FusedAdam"
_FakeTransformerEngineFusedAdam.__module__ = "transformer_engine.pytorch.optimizers.fused_adam"

REFUSED = {
    "amsgrad": (lambda ps: torch.optim.Adam(ps, amsgrad=True), "amsgrad"),
    "Adam with coupled weight decay": (lambda ps: torch.optim.Adam(ps, weight_decay=0.1), "coupled"),
    "SGD with dampening": (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, dampening=0.5), "dampening"),
    "custom optimizer class": (_CustomOptimizer, "_CustomOptimizer"),
    "AdamW subclass": (type("MyAdamW", (torch.optim.AdamW,), {}), "MyAdamW"),
    "maximize": (lambda ps: torch.optim.SGD(ps, lr=0.1, maximize=True), "maximize"),
    "bf16 params": (lambda ps: torch.optim.AdamW([p.detach().bfloat16().requires_grad_() for p in ps]), "bfloat16"),
    "apex FusedAdam without adam_w_mode": (lambda ps: FakeApexFusedAdam(ps, adam_w_mode=False), "adam_w_mode"),
    "TE FusedAdam with master weights": (_FakeTransformerEngineFusedAdam, "master_weights"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_unsupported_optimizers_get_one_sentence_naming_the_exact_flag(case):
    factory, mentioned = REFUSED[case]
    optimizer = factory(make_params())
    reason = inverse_unsupported_reason(optimizer)
    assert reason is not None and mentioned in reason
    assert reason.endswith(HINT) and ". " not in reason  # one sentence
    with pytest.raises(RollbackError, match="zero-bubble-exact-rollback"):
        prepare(optimizer)
