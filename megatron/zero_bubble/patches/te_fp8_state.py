"""What Transformer Engine's FP8 recipes keep between passes, kept and put back around the start-up split check.

Under delayed scaling every TE module holds, per direction (`fp8_meta["scaling_fwd"]`, `["scaling_bwd"]`), a recipe
state whose `amax_history` and `scale` each forward and backward update in place (its quantizers read views of them).
The split check's extra passes would leave those one update ahead of megatron's 1F1B, and every later FP8 cast would
differ. The other per-tensor recipe (current scaling) keeps nothing. A state the check itself created (the module's
first forward happened inside it) goes back to how TE creates one: scales 1, histories 0. Reads attributes only
(no TE import), so it costs nothing on runs without TE.
"""
from __future__ import annotations

from typing import Callable

import torch

STATE_KEYS = ("scaling_fwd", "scaling_bwd")
INITIAL = {"scale": 1.0, "amax_history": 0.0}  # DelayedScalingRecipeState's buffers as TE allocates them


def _states(chunks: list) -> list:
    """(module, key, state) of every recipe state the modules of `chunks` hold now."""
    found = []
    for chunk in chunks:
        for module in chunk.modules():
            meta = getattr(module, "fp8_meta", None)
            if isinstance(meta, dict):
                found += [(module, key, meta[key]) for key in STATE_KEYS if key in meta]
    return found


def _tensors(state) -> dict:
    return {name: value for name, value in vars(state).items() if torch.is_tensor(value)}


def keep_recipe_state(chunks: list) -> Callable[[], None]:
    """The FP8 recipe state of every TE module in `chunks` now; returns what puts it back in place."""
    kept = {id(state): {name: t.clone() for name, t in _tensors(state).items()} for _, _, state in _states(chunks)}

    def restore() -> None:
        for module, key, state in _states(chunks):
            tensors = _tensors(state)
            if id(state) in kept:
                for name, value in kept[id(state)].items():
                    tensors[name].copy_(value)
                continue
            unknown = sorted(set(tensors) - set(INITIAL))
            if unknown:
                raise RuntimeError(f"zero-bubble: {type(module).__name__}.fp8_meta[{key!r}] holds {unknown}, which the "
                                   f"split check cannot put back; run with --no-zero-bubble-split-check")
            for name, tensor in tensors.items():
                tensor.fill_(INITIAL[name])

    return restore
