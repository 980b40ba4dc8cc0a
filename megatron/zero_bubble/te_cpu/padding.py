"""TE's row padding of grouped GEMM inputs (`fused_multi_row_padding` / `_unpadding`): FP8 GEMMs need each group's
row count a multiple of 16, so megatron's MoE layers pad every expert's block of rows with zero rows and drop them
from the output."""
from __future__ import annotations

import torch


def _blocks(tensor: torch.Tensor, rows: list) -> list:
    return list(torch.split(tensor, [int(r) for r in rows], dim=0))


def fused_multi_row_padding(input, output, input_row_list, padded_input_row_list):
    """Each block of `input_row_list[i]` rows of `input` into the block of `padded_input_row_list[i]` rows of
    `output`, the rows after it zeroed."""
    if len(input_row_list) != len(padded_input_row_list):
        raise ValueError("Number of input row list and padded row list must match.")
    for source, target in zip(_blocks(input, input_row_list), _blocks(output, padded_input_row_list)):
        target[:source.shape[0]].copy_(source)
        target[source.shape[0]:].zero_()


def fused_multi_row_unpadding(input, output, input_row_list, unpadded_input_row_list):
    """The first `unpadded_input_row_list[i]` rows of each padded block of `input`, one after another into `output`."""
    if len(input_row_list) != len(unpadded_input_row_list):
        raise ValueError("Number of input row list and padded row list must match.")
    for source, target in zip(_blocks(input, input_row_list), _blocks(output, unpadded_input_row_list)):
        target.copy_(source[:target.shape[0]])


def kernels() -> dict:
    return {"fused_multi_row_padding": fused_multi_row_padding,
            "fused_multi_row_unpadding": fused_multi_row_unpadding}
