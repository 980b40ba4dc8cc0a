"""TE's fused softmax kernels for its unfused attention (`scaled_softmax`, `scaled_masked_softmax`,
`scaled_upper_triang_masked_softmax`, `scaled_aligned_causal_masked_softmax`, forward and backward) in float32.

As TE's kernels: the scores scaled, positions of a given mask (True: masked) set to -10000 before the softmax, positions
above the (top-left or bottom-right aligned) causal diagonal given probability 0, the result in the input's dtype. Each
backward is the softmax's: scale * y * (dy - sum(dy * y)).
"""
from __future__ import annotations

import torch

MASKED_SCORE = -10000.0


def _softmax(scores: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return torch.softmax(scores, dim=-1).to(like.dtype)


def _causal(scores: torch.Tensor, bottom_right: bool) -> torch.Tensor:
    sq, sk = scores.shape[-2], scores.shape[-1]
    above = torch.ones(sq, sk, dtype=torch.bool).triu(1 + (sk - sq if bottom_right else 0))
    return scores.masked_fill(above, float("-inf"))


def scaled_softmax_forward(input, scale):
    return _softmax(input.float() * scale, input)


def scaled_masked_softmax_forward(input, mask, scale):
    return _softmax((input.float() * scale).masked_fill(mask.bool(), MASKED_SCORE), input)


def scaled_upper_triang_masked_softmax_forward(input, scale):
    return _softmax(_causal(input.float() * scale, bottom_right=False), input)


def scaled_aligned_causal_masked_softmax_forward(input, scale):
    return _softmax(_causal(input.float() * scale, bottom_right=True), input)


def softmax_backward(output_grads, softmax_results, scale):
    dy, y = output_grads.float(), softmax_results.float()
    return (scale * y * (dy - (dy * y).sum(dim=-1, keepdim=True))).to(output_grads.dtype)


def kernels() -> dict:
    found = {}
    for name, forward in (("scaled_softmax", scaled_softmax_forward),
                          ("scaled_masked_softmax", scaled_masked_softmax_forward),
                          ("scaled_upper_triang_masked_softmax", scaled_upper_triang_masked_softmax_forward),
                          ("scaled_aligned_causal_masked_softmax", scaled_aligned_causal_masked_softmax_forward)):
        found[f"{name}_forward"] = forward
        found[f"{name}_backward"] = softmax_backward
    return found
