"""Undo one optimizer step: bit-exact snapshot/restore, or an in-place inverse of the update rule.

Post-update validation (issue 5) lets a pipeline stage step its optimizer speculatively, before the
globally reduced grad norm / inf flag is known. When that result later shows inf/NaN, or that clipping
was needed, the step is undone (and, for clipping, redone with the clipped grads). Two ways:

- `prepare(opt)` before the step (no tensor copies), then `invert(opt, record)`: recomputes the update
  from the post-step state and the grads the step used, and subtracts it. No extra memory beyond
  per-parameter temporaries, but only accurate to a few ulps (at the scale of the values involved).
- `snapshot(opt)` before the step, then `restore(opt, snapshot)` (`--zero-bubble-exact-rollback`):
  clones params and the full optimizer state, restores them bit for bit, for any optimizer.

Supported by `invert` (see `inverse_unsupported_reason`): torch Adam/AdamW with decoupled (or no)
weight decay, torch SGD with dampening 0, apex / Transformer Engine FusedAdam in adam_w_mode. Params and
states must be fp32 (megatron's main params).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch

EXACT_FLAG_HINT = "use --zero-bubble-exact-rollback"
_FUSED_ADAM_MODULES = ("apex.", "transformer_engine.")  # apex / TE FusedAdam, identified by origin


class RollbackError(ValueError):
    """An optimizer step cannot be undone as asked (unsupported optimizer or mismatched record)."""


# -- which optimizers can be inverted -------------------------------------------------------------------
def _kind(optimizer: torch.optim.Optimizer) -> str | None:
    """'torch_adam', 'torch_sgd', 'fused_adam' (apex/TE) or None for anything else."""
    cls = type(optimizer)
    if cls in (torch.optim.Adam, torch.optim.AdamW):  # exact classes: a subclass may change step()
        return "torch_adam"
    if cls is torch.optim.SGD:
        return "torch_sgd"
    if cls.__name__ == "FusedAdam" and cls.__module__.startswith(_FUSED_ADAM_MODULES):
        return "fused_adam"
    return None


def _group_reason(kind: str, optimizer: torch.optim.Optimizer, group: dict) -> str | None:
    name = type(optimizer).__name__
    if kind in ("torch_adam", "torch_sgd"):
        for flag in ("maximize", "capturable", "differentiable", "amsgrad"):
            if group.get(flag, False):
                return f"{name} with {flag}=True has no in-place inverse here"
        for key in ("lr", "betas", "weight_decay", "momentum", "eps"):
            values = group.get(key, ())
            if any(isinstance(v, torch.Tensor) for v in (values if isinstance(values, tuple) else (values,))):
                return f"{name} with a tensor-valued {key} has no in-place inverse here"
    if kind == "torch_adam" and group["weight_decay"] != 0 and not group.get("decoupled_weight_decay"):
        return f"{name} with coupled (L2) weight decay folds the pre-step params into the moments"
    if kind == "torch_sgd" and group["dampening"] != 0:
        return "SGD with dampening != 0 has no in-place inverse here"
    return None


def _fused_adam_reason(optimizer: torch.optim.Optimizer) -> str | None:
    name = f"{type(optimizer).__module__.split('.')[0]} FusedAdam"
    if getattr(optimizer, "adam_w_mode", 1) != 1:
        return f"{name} without adam_w_mode (L2 weight decay) has no in-place inverse here"
    for flag in ("capturable", "master_weights", "use_master", "use_decoupled_grad", "store_param_remainders"):
        if getattr(optimizer, flag, False):
            return f"{name} with {flag}=True has no in-place inverse here"
    for attr in ("exp_avg_dtype", "exp_avg_sq_dtype"):
        if getattr(optimizer, attr, torch.float32) != torch.float32:
            return f"{name} with a non-fp32 {attr} has no in-place inverse here"
    return None


def inverse_unsupported_reason(optimizer: torch.optim.Optimizer) -> str | None:
    """None when `invert` supports this optimizer and its settings, else one sentence saying why not."""
    kind = _kind(optimizer)
    if kind is None:
        reason = f"{type(optimizer).__name__} is not an optimizer whose update rule is known here"
    elif kind == "fused_adam":
        reason = _fused_adam_reason(optimizer)
    else:
        reason = next(filter(None, (_group_reason(kind, optimizer, g) for g in optimizer.param_groups)), None)
    if reason is None:
        reason = _dtype_reason(optimizer)
    return None if reason is None else f"{reason}; {EXACT_FLAG_HINT}."


def _dtype_reason(optimizer: torch.optim.Optimizer) -> str | None:
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.dtype != torch.float32:
                return f"a {p.dtype} parameter is not supported (the inverse assumes fp32 main params)"
            for key, value in optimizer.state.get(p, {}).items():
                if isinstance(value, torch.Tensor) and key != "step" and value.dtype != torch.float32:
                    return f"optimizer state '{key}' is {value.dtype}, not fp32"
    return None


# -- in-place inverse -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class StepRecord:
    """What the inverse needs that the step destroys, taken by `prepare` right before the step.

    Per parameter (in param-group order): its identity, whether it had a grad (the step skips those that
    did not), and the state keys it had (None: no state entry at all). Per group: the group-level 'step'
    counter of apex/TE FusedAdam ((False, None) where absent). No tensor is copied.
    """

    param_ids: tuple[int, ...]
    had_grad: tuple[bool, ...]
    state_keys: tuple[frozenset | None, ...]
    group_steps: tuple[tuple[bool, Any], ...]


def _all_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def prepare(optimizer: torch.optim.Optimizer) -> StepRecord:
    """Remember, cheaply, what `invert` needs; call right before `optimizer.step()`."""
    reason = inverse_unsupported_reason(optimizer)
    if reason is not None:
        raise RollbackError(reason)
    params = _all_params(optimizer)
    return StepRecord(
        param_ids=tuple(id(p) for p in params),
        had_grad=tuple(p.grad is not None for p in params),
        state_keys=tuple(frozenset(optimizer.state[p]) if p in optimizer.state else None for p in params),
        group_steps=tuple(("step" in g, g.get("step")) for g in optimizer.param_groups),
    )


def invert(optimizer: torch.optim.Optimizer, record: StepRecord) -> None:
    """Undo, in place, the one step taken since `prepare` returned `record`.

    The caller guarantees each param's `.grad` and the groups' hyperparameters (lr, betas, eps, weight
    decay, momentum) are exactly those the step used. State that the step created is removed again, so
    a later step recreates it exactly as the first time would.
    """
    reason = inverse_unsupported_reason(optimizer)
    if reason is not None:
        raise RollbackError(reason)
    kind = _kind(optimizer)
    params = _all_params(optimizer)
    if tuple(id(p) for p in params) != record.param_ids:
        raise RollbackError("the record was prepared for other parameters than this optimizer holds")
    if tuple(p.grad is not None for p in params) != record.had_grad:
        raise RollbackError("the params that have a grad differ from those when the record was prepared")
    if any(p.grad is not None and p.grad.is_sparse for p in params):
        raise RollbackError(f"sparse grads have no in-place inverse; {EXACT_FLAG_HINT}.")
    keys_before = dict(zip(record.param_ids, record.state_keys))
    with torch.no_grad():
        for group_index, group in enumerate(optimizer.param_groups):
            for p in group["params"]:
                if p.grad is None:
                    continue
                keys = keys_before[id(p)] or frozenset()
                state = optimizer.state[p]
                if kind == "torch_adam":
                    _invert_torch_adam(group, p, state, had_state="step" in keys)
                elif kind == "torch_sgd":
                    _invert_torch_sgd(group, p, state, had_buffer="momentum_buffer" in keys)
                else:
                    _invert_fused_adam(group, p, state, had_state="exp_avg" in keys)
            present, value = record.group_steps[group_index]
            if present:
                group["step"] = value
            else:
                group.pop("step", None)
    _drop_state_created_by_step(optimizer, params, record.state_keys)


def _drop_state_created_by_step(optimizer, params, state_keys) -> None:
    for p, keys in zip(params, state_keys):
        if keys is None:
            optimizer.state.pop(p, None)
        elif p in optimizer.state:
            for key in set(optimizer.state[p]) - keys:
                del optimizer.state[p][key]


def _undo_moment(moment: torch.Tensor, contribution: torch.Tensor, beta: float) -> None:
    """moment <- (moment - contribution) / beta, where `contribution` is what the step added to a zero
    moment (computed with the step's own op on zeros): a moment that was exactly 0 returns to exactly 0."""
    moment.sub_(contribution).div_(beta)


def _invert_torch_adam(group: dict, p: torch.Tensor, state: dict, had_state: bool) -> None:
    """Inverse of torch.optim.Adam/AdamW's single-tensor update (the foreach path has the same math):
    step += 1; p *= 1 - lr*wd; m.lerp_(g, 1-b1); v.mul_(b2).addcmul_(g, g, 1-b2);
    p.addcdiv_(m, sqrt(v)/sqrt(bc2) + eps, value=-lr/bc1)."""
    grad, (beta1, beta2) = p.grad, group["betas"]
    lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
    exp_avg, exp_avg_sq, step_t = state["exp_avg"], state["exp_avg_sq"], state["step"]
    step = float(step_t)  # post-step value, as the step used it
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    step_size = lr / bias_correction1
    # The same denominator, bit for bit, as the step computed from the (unchanged) post-step state.
    denom = (exp_avg_sq.sqrt() / bias_correction2**0.5).add_(eps)
    p.addcdiv_(exp_avg, denom, value=step_size)
    del denom
    if wd != 0:  # only decoupled weight decay is accepted
        p.div_(1 - lr * wd)
    if not had_state:
        return  # state removed by the caller: a later step starts from zeros and step 0 as the first did
    _undo_moment(exp_avg, torch.zeros_like(grad).lerp_(grad, 1 - beta1), beta1)
    _undo_moment(exp_avg_sq, torch.zeros_like(grad).addcmul_(grad, grad, value=1 - beta2), beta2)
    # The step's addcmul is monotone in v, so v1 >= its value on zero and the result is >= 0 here; an
    # addcmul with the negated coefficient (an FMA on CPU) would leave tiny negatives, NaN under sqrt.
    # The clamp guards kernels (fused/GPU) whose rounding differs from the op recomputed here.
    exp_avg_sq.clamp_min_(0)
    step_t.sub_(1)  # exact: an integer-valued float


def _invert_torch_sgd(group: dict, p: torch.Tensor, state: dict, had_buffer: bool) -> None:
    """Inverse of torch.optim.SGD (dampening 0): ge = g + wd*p0; buf = ge (new) or buf*mom + ge;
    d = ge + mom*buf (nesterov) or buf (momentum) or ge; p1 = p0 - lr*d."""
    grad, lr, wd = p.grad, group["lr"], group["weight_decay"]
    momentum, nesterov = group["momentum"], group["nesterov"]
    buf = state.get("momentum_buffer") if momentum != 0 else None
    if buf is not None and (not nesterov or not had_buffer):
        # d depends only on the post-step buffer: recompute it bit for bit (a new buffer is ge itself).
        direction = buf.add(buf, alpha=momentum) if nesterov else buf
    else:
        # d depends on ge, hence on p0 through weight decay: solve p1 = p0 - lr*(ge(p0) + mom*buf) in
        # closed form for an estimate of p0, then take ge from it (lr*wd << 1, so the error this leaves
        # in p0 is lr*wd times the estimate's) and undo with d computed as the step did.
        known = grad.add(buf, alpha=momentum) if buf is not None else grad
        if wd != 0:
            estimate = p.add(known, alpha=lr).div_(1 - lr * wd)
            effective_grad = grad.add(estimate, alpha=wd)
            del estimate
        else:
            effective_grad = grad
        direction = effective_grad.add(buf, alpha=momentum) if buf is not None else effective_grad
    p.add_(direction, alpha=lr)
    if buf is not None and had_buffer:
        # ge from the recovered p0: where g and wd*p0 cancel, the estimate's error would show in ge.
        effective_grad = grad.add(p, alpha=wd) if wd != 0 else grad
        _undo_moment(buf, effective_grad, momentum)


def _invert_fused_adam(group: dict, p: torch.Tensor, state: dict, had_state: bool) -> None:
    """Inverse of apex / Transformer Engine FusedAdam in adam_w_mode, by the documented update rule,
    not tested (the tests run without apex or TE): per-group 'step'; m = b1*m + (1-b1)*g;
    v = b2*v + (1-b2)*g*g; update = (m/bc1) / (sqrt(v/bc2) + eps) + wd*p; p -= lr*update.
    The kernel's fp32 rounding (and FMA contraction) cannot be reproduced with torch ops, so this is
    accurate to a few ulps, not to the bit."""
    grad, (beta1, beta2) = p.grad, group["betas"]
    lr, wd, eps, step = group["lr"], group["weight_decay"], group["eps"], group["step"]
    exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
    bias_correction1 = 1 - beta1**step if group.get("bias_correction", True) else 1.0
    bias_correction2 = 1 - beta2**step if group.get("bias_correction", True) else 1.0
    denom = (exp_avg_sq / bias_correction2).sqrt_().add_(eps)
    update = (exp_avg / bias_correction1).div_(denom)
    del denom
    # p1 = p0*(1 - lr*wd) - lr*update  =>  p0 = (p1 + lr*update) / (1 - lr*wd)
    p.add_(update, alpha=lr)
    if wd != 0:
        p.div_(1 - lr * wd)
    del update
    if not had_state:
        return
    _undo_moment(exp_avg, grad * (1 - beta1), beta1)
    _undo_moment(exp_avg_sq, grad * (1 - beta2) * grad, beta2)
    exp_avg_sq.clamp_min_(0)


# -- exact snapshot --------------------------------------------------------------------------------------
@dataclass
class Snapshot:
    """Clones of every param's data and its full optimizer state, and the per-group 'step' counters.

    Costs one copy of the params plus one of the state (3x the fp32 params for Adam)."""

    param_ids: tuple[int, ...]
    param_data: list[torch.Tensor]
    states: list[dict | None]  # None: the param had no state entry at all
    group_steps: list[tuple[bool, Any]]


def _copy_value(value: Any) -> Any:
    return value.detach().clone() if isinstance(value, torch.Tensor) else copy.deepcopy(value)


def snapshot(optimizer: torch.optim.Optimizer) -> Snapshot:
    """Copy everything a step may change; works for any optimizer."""
    params = _all_params(optimizer)
    with torch.no_grad():
        return Snapshot(
            param_ids=tuple(id(p) for p in params),
            param_data=[p.detach().clone() for p in params],
            states=[
                {k: _copy_value(v) for k, v in optimizer.state[p].items()} if p in optimizer.state else None
                for p in params
            ],
            group_steps=[("step" in g, _copy_value(g.get("step"))) for g in optimizer.param_groups],
        )


def restore(optimizer: torch.optim.Optimizer, saved: Snapshot) -> None:
    """Put params and optimizer state back bit for bit. Tensors are written in place where they still
    exist (views into megatron's buffers stay valid); the snapshot stays reusable."""
    params = _all_params(optimizer)
    if tuple(id(p) for p in params) != saved.param_ids:
        raise RollbackError("the snapshot was taken of other parameters than this optimizer holds")
    with torch.no_grad():
        for p, data, state in zip(params, saved.param_data, saved.states):
            p.copy_(data)
            if state is None:
                optimizer.state.pop(p, None)
                continue
            current = optimizer.state[p]
            for key in set(current) - set(state):
                del current[key]
            for key, value in state.items():
                old = current.get(key)
                if isinstance(value, torch.Tensor) and isinstance(old, torch.Tensor) and _same_layout(old, value):
                    old.copy_(value)
                else:
                    current[key] = _copy_value(value)
        for group, (present, value) in zip(optimizer.param_groups, saved.group_steps):
            if present:
                group["step"] = _copy_value(value)
            else:
                group.pop("step", None)


def _same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and a.device == b.device
