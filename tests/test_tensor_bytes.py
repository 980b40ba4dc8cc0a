"""What the held-memory measurements count (runtime/tensor_bytes.py): storages, once each, reached through plain
tensors, wrapper subclasses (as Transformer Engine's quantized and grouped tensors are) and plain objects holding
tensors (TE's *Storage classes). The wrapper below is a labelled stand-in built the way TE builds its own (a
`_make_wrapper_subclass` with a nominal dtype over uint8 data); it is not TE."""
from __future__ import annotations

import pytest
import torch

from megatron.zero_bubble.runtime.profiling import saved_activation_bytes
from megatron.zero_bubble.runtime.tensor_bytes import held_bytes, storages


class StandInQuantizedTensor(torch.Tensor):
    """STAND-IN for TE's Float8Tensor: nominal bf16 of `shape`, holding uint8 data, its transpose and a scale."""

    @staticmethod
    def __new__(cls, shape, quantizer=None):
        tensor = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=torch.bfloat16, requires_grad=False)
        tensor._data = torch.zeros(shape, dtype=torch.uint8)
        tensor._transpose = torch.zeros(shape[::-1], dtype=torch.uint8)
        tensor._scale_inv = torch.ones(1)
        tensor._quantizer = quantizer
        return tensor

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise NotImplementedError(f"stand-in: {func}")


class StandInQuantizer:
    """Shared between passes (TE's quantizers hold scales and amax histories): not held by one entry."""

    def __init__(self):
        self.scale, self.amax_history = torch.ones(1024), torch.zeros(1024)


class StandInGroupedStorage:
    """STAND-IN for TE's GroupedTensorStorage: a plain object holding tensors, a list of members, a quantizer."""

    def __init__(self, rows: torch.Tensor, quantizer):
        self.rowwise_data, self.first_dims = rows, torch.tensor([2, 2])
        self.quantized_tensors = [rows[:2], rows[2:]]  # views of rowwise_data: the same storage
        self.quantizer = quantizer


def test_plain_tensors_count_their_storage_once():
    base = torch.zeros(6, 4)
    assert held_bytes([base, base[:2], (base.t(),)]) == 6 * 4 * 4
    assert held_bytes([torch.zeros(3), torch.zeros(5, dtype=torch.float64)]) == 3 * 4 + 5 * 8


def test_a_wrapper_subclass_counts_what_it_holds_not_its_nominal_size():
    quantized = StandInQuantizedTensor((16, 8), StandInQuantizer())
    assert quantized.numel() * quantized.element_size() == 16 * 8 * 2  # what numel * element_size would say
    assert quantized.data_ptr() == 0
    with pytest.raises(RuntimeError):
        quantized.untyped_storage().data_ptr()
    assert held_bytes(quantized) == 16 * 8 + 8 * 16 + 4  # data, transpose, scale; not the quantizer's tensors


def test_an_object_holding_tensors_counts_them_and_not_its_quantizer():
    rows = torch.zeros(4, 8)
    grouped = StandInGroupedStorage(rows, StandInQuantizer())
    assert held_bytes([grouped]) == 4 * 8 * 4 + 2 * 8  # rows (members are views of them) and first_dims (int64)
    assert held_bytes([grouped], exclude=set(storages(rows))) == 2 * 8


def test_saved_activation_bytes_skips_wrapper_subclass_parameters_without_reading_their_storage():
    weight = torch.nn.Parameter(torch.randn(8, 8))
    quantized = StandInQuantizedTensor((8, 8))
    x = torch.randn(4, 8, requires_grad=True)
    hidden = x.exp()
    out = (hidden * weight[:4]).sum()
    assert saved_activation_bytes(out, [weight, quantized]) == hidden.numel() * 4
