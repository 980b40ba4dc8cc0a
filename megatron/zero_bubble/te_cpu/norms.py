"""TE's normalization kernels (`layernorm_fwd/bwd`, `rmsnorm_fwd/bwd`) in float32 on the CPU.

As TE's kernels: statistics in float32 over the last dimension (mu and rsigma = 1 / sqrt(var + eps) returned per row,
float32), `zero_centered_gamma` scales by (1 + gamma), the output in the requested dtype (into `out` when given), the
gradients of the input in its dtype and of gamma and beta in theirs. With a per-tensor FP8 quantizer the output is
quantized as TE's kernels do (fp8.quantize_into): delayed scaling casts the float32 result (the fused kernel); current
scaling rounds it to the output dtype and casts with the amax of the float32 result.
"""
from __future__ import annotations

import torch

from . import fp8
from .dtypes import torch_dtype


def _gamma(weight, zero_centered_gamma: bool):
    return weight.float() + 1.0 if zero_centered_gamma else weight.float()


def _write(result: torch.Tensor, out, out_dtype, like: torch.Tensor, quantizer=None, kernel: str = "") -> torch.Tensor:
    if quantizer is not None:
        dtype = torch_dtype(out_dtype) if out_dtype is not None else like.dtype
        return fp8.quantize_into(out, quantizer, result, kernel, fake_dtype=dtype, amax_of=result)
    if out is not None:
        out.copy_(result.reshape(out.shape))
        return out
    dtype = torch_dtype(out_dtype) if out_dtype is not None else like.dtype
    return result.to(dtype)


def layernorm_fwd(input, weight, bias, eps, out, quantizer, out_dtype, sm_margin, zero_centered_gamma):
    x = input.float().reshape(-1, input.shape[-1])
    mu = x.mean(dim=-1)
    centered = x - mu[:, None]
    rsigma = torch.rsqrt((centered * centered).mean(dim=-1) + eps)
    y = centered * rsigma[:, None] * _gamma(weight, zero_centered_gamma)
    if bias is not None:
        y = y + bias.float()
    return [_write(y.reshape(input.shape), out, out_dtype, input, quantizer, "layernorm_fwd"), mu, rsigma]


def layernorm_bwd(dz, x, mu, rsigma, gamma, sm_margin, zero_centered_gamma):
    g = dz.float().reshape(-1, x.shape[-1])
    xf = x.float().reshape(-1, x.shape[-1])
    xhat = (xf - mu[:, None]) * rsigma[:, None]
    dxhat = g * _gamma(gamma, zero_centered_gamma)
    dx = rsigma[:, None] * (dxhat - dxhat.mean(dim=-1, keepdim=True) - xhat * (dxhat * xhat).mean(dim=-1, keepdim=True))
    dgamma = (g * xhat).sum(dim=0)
    dbeta = g.sum(dim=0)
    return [dx.reshape(x.shape).to(x.dtype), dgamma.to(gamma.dtype), dbeta.to(gamma.dtype)]


def rmsnorm_fwd(input, weight, eps, out, quantizer, out_dtype, sm_margin, zero_centered_gamma):
    x = input.float().reshape(-1, input.shape[-1])
    rsigma = torch.rsqrt((x * x).mean(dim=-1) + eps)
    y = x * rsigma[:, None] * _gamma(weight, zero_centered_gamma)
    return [_write(y.reshape(input.shape), out, out_dtype, input, quantizer, "rmsnorm_fwd"), None, rsigma]


def rmsnorm_bwd(dz, x, rsigma, gamma, sm_margin, zero_centered_gamma):
    g = dz.float().reshape(-1, x.shape[-1])
    xf = x.float().reshape(-1, x.shape[-1])
    xhat = xf * rsigma[:, None]
    dxhat = g * _gamma(gamma, zero_centered_gamma)
    dx = rsigma[:, None] * (dxhat - xhat * (dxhat * xhat).mean(dim=-1, keepdim=True))
    dgamma = (g * xhat).sum(dim=0)
    return [dx.reshape(x.shape).to(x.dtype), dgamma.to(gamma.dtype)]


def kernels() -> dict:
    return {"layernorm_fwd": layernorm_fwd, "layernorm_bwd": layernorm_bwd,
            "rmsnorm_fwd": rmsnorm_fwd, "rmsnorm_bwd": rmsnorm_bwd}
