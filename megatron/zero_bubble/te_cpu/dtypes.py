"""TE's DType tags and torch's dtypes, both ways."""
from __future__ import annotations

import torch

from .enums import DType

TORCH_OF = {
    DType.kByte: torch.uint8, DType.kInt32: torch.int32, DType.kFloat32: torch.float32,
    DType.kFloat16: torch.float16, DType.kBFloat16: torch.bfloat16, DType.kFloat8E4M3: torch.float8_e4m3fn,
    DType.kFloat8E5M2: torch.float8_e5m2,
}


def torch_dtype(tag) -> torch.dtype:
    """The torch dtype of a TE tag (TE's own IntEnum, ours, or a torch dtype passed through)."""
    if isinstance(tag, torch.dtype):
        return tag
    return TORCH_OF[DType(int(tag))]
