"""Device bytes a value keeps alive: the storages of the plain tensors it reaches, each storage counted once.

Why not `numel() * element_size()`: Transformer Engine keeps some tensors as torch wrapper subclasses (its
quantized tensors, `GroupedTensor` parameters), which have no storage of their own: numel and element_size
give the nominal shape and dtype, `data_ptr()` is 0 and `untyped_storage()` raises; and some as plain Python
objects holding tensors (its `*Storage` classes, e.g. the grouped operands `GroupedLinear` queues for W). The
bytes of either are those of the tensors they hold, read from their attributes; the helper objects those point
to (quantizers) are shared between passes, not held by one, and are not followed.
"""
from __future__ import annotations

import torch

_MAX_DEPTH = 4  # value -> list -> storage object -> attribute list -> tensor


def storages(value) -> dict[int, int]:
    """{storage data pointer: storage bytes} of the plain tensors `value` reaches: tensors, lists, tuples and
    dicts of them, wrapper subclasses and other objects holding tensors (through their attributes)."""
    found: dict[int, int] = {}
    _walk(value, found, set(), 0, follow_objects=True)
    return found


def held_bytes(value, exclude: dict[int, int] | set[int] = frozenset()) -> int:
    """Bytes of the storages `value` reaches, except those in `exclude` (data pointers)."""
    return sum(nbytes for pointer, nbytes in storages(value).items() if pointer not in exclude)


def _walk(value, found: dict, seen: set, depth: int, follow_objects: bool) -> None:
    if value is None or depth > _MAX_DEPTH or id(value) in seen:
        return
    seen.add(id(value))
    if torch.is_tensor(value):
        storage = _storage(value)
        if storage is not None:
            found[storage[0]] = storage[1]
        else:  # a wrapper subclass: what it holds
            _walk_attributes(value, found, seen, depth)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _walk(item, found, seen, depth + 1, follow_objects=True)
    elif isinstance(value, dict):
        for item in value.values():
            _walk(item, found, seen, depth + 1, follow_objects=True)
    elif follow_objects and not isinstance(value, (str, bytes, int, float, bool)):
        _walk_attributes(value, found, seen, depth)


def _walk_attributes(value, found: dict, seen: set, depth: int) -> None:
    for attribute in getattr(value, "__dict__", {}).values():
        if torch.is_tensor(attribute) or isinstance(attribute, (list, tuple)):
            _walk(attribute, found, seen, depth + 1, follow_objects=False)


def _storage(tensor: torch.Tensor) -> tuple[int, int] | None:
    """(data pointer, bytes) of the tensor's storage; None for a wrapper subclass, whose storage either cannot be
    had or is a placeholder without data (which of the two depends on how it was built)."""
    try:
        storage = tensor.untyped_storage()
        return storage.data_ptr(), storage.nbytes()
    except (RuntimeError, NotImplementedError):
        return None
