"""`generic_gemm`: TE's GEMM with cuBLASLt's epilogues, in torch on the CPU.

TE names operands as cuBLAS does (column-major). In row-major terms, with A and B flattened to 2-D over all but their
last dimension, D = op(B) @ op(A), where op transposes when `transa` / `transb` is set: layout "TN" is the forward
(x @ W^T), "NN" the input gradient (dy @ W), "NT" the weight gradient (dy^T @ x). The output keeps B's leading
dimensions unless `transb`. As cuBLAS does, the product is formed in float32, then `alpha` scales it, `beta * D` is
added when accumulating, the epilogue (bias, GELU) is applied in float32, and the result is rounded once into D.
Per-tensor FP8 operands (fp8.py) are read as a Hopper GPU reads them: cuBLASLt runs FP8 GEMMs only as "TN", so an
operand used untransposed in cuBLAS terms (A without `transa`, B with `transb`) is read from its transpose buffer and
must have one; the product of the FP8 values is formed in float32 and scaled by both scale inverses. Both operands
are FP8 or neither. Arguments not honoured here (Userbuffers, an extra output, an output quantizer, an operand of any
other quantized kind) are refused.
"""
from __future__ import annotations

import math

import torch

from . import fp8
from .dtypes import torch_dtype
from .refusal import refuse

PLAIN = (torch.Tensor, torch.nn.Parameter)
SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def _plain(kernel: str, name: str, tensor) -> torch.Tensor:
    if tensor.__class__ not in PLAIN:
        raise refuse(kernel, f"operand {name} of type {type(tensor).__name__} (a quantized tensor)")
    return tensor


def _fp8_operand(name: str, tensor, rowwise: bool):
    """The float32 values (unscaled, in the operand's own shape) of the FP8 buffer cuBLASLt reads on Hopper, and the
    scale inverse."""
    values = fp8.rowwise_values(tensor) if rowwise else fp8.columnwise_values(tensor)
    if values is None:
        raise RuntimeError(f"generic_gemm: input {name} is missing {'row' if rowwise else 'column'}-wise usage")
    return values, tensor._scale_inv.float()


def operands(kernel: str, A, transa: bool, B, transb: bool):
    """A and B as float32 values, and the factor their product is scaled by (1 unless FP8)."""
    a_fp8, b_fp8 = fp8.is_per_tensor_fp8(A), fp8.is_per_tensor_fp8(B)
    if a_fp8 != b_fp8:
        raise refuse(kernel, f"one FP8 operand with one of type {type(B if a_fp8 else A).__name__}")
    if not a_fp8:
        return _plain(kernel, "A", A), _plain(kernel, "B", B), None
    (a, a_scale_inv), (b, b_scale_inv) = _fp8_operand("A", A, transa), _fp8_operand("B", B, not transb)
    return a, b, a_scale_inv * b_scale_inv


def _as_2d(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1]) if t.dim() != 2 else t


def product(A, transa: bool, B, transb: bool) -> torch.Tensor:
    """op(B) @ op(A) in float32, and the shape D has."""
    a, b = _as_2d(A).float(), _as_2d(B).float()
    d = (b.t() if transb else b) @ (a.t() if transa else a)
    shape = list(d.shape) if transb else list(B.shape[:-1]) + [d.shape[-1]]
    return d.reshape(shape)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """cuBLASLt's GELU epilogue: the tanh approximation."""
    return 0.5 * x * (1.0 + torch.tanh(SQRT_2_OVER_PI * (x + 0.044715 * x * x * x)))


def dgelu_tanh(x: torch.Tensor) -> torch.Tensor:
    inner = SQRT_2_OVER_PI * (x + 0.044715 * x * x * x)
    tanh = torch.tanh(inner)
    return 0.5 * (1.0 + tanh) + 0.5 * x * (1.0 - tanh * tanh) * SQRT_2_OVER_PI * (1.0 + 3 * 0.044715 * x * x)


def generic_gemm(A, transa, B, transb, D, quantizer, out_dtype, bias, bias_type, gelu, gelu_in, grad,
                 workspace, workspace_size, accumulate, use_split_accumulator, comm_overlap=None, comm_type=None,
                 extra_output=None, bulk_overlap=False, alpha=1.0, beta=None):
    name = "generic_gemm"
    if comm_overlap is not None or comm_type is not None or bulk_overlap:
        raise refuse(name, "Userbuffers communication overlap")
    if extra_output is not None:
        raise refuse(name, "an extra output")
    if quantizer is not None:
        raise refuse(name, f"an output quantizer ({type(quantizer).__name__})")
    A, B, factor = operands(name, A, transa, B, transb)
    if D is not None:
        _plain(name, "D", D)
    beta = (1.0 if accumulate else 0.0) if beta is None else beta
    if not accumulate and beta != 0.0:
        raise ValueError("generic_gemm: a non-zero beta without accumulate")
    dtype = torch_dtype(out_dtype) if out_dtype is not None else A.dtype
    if D is not None and out_dtype is not None and D.dtype != dtype:
        raise ValueError(f"generic_gemm: output dtype {D.dtype}, expected {dtype}")
    result = product(A, transa, B, transb)
    result = (result if factor is None else result * factor) * alpha
    if D is not None and tuple(D.shape) != tuple(result.shape):
        raise ValueError(f"generic_gemm: output shape {tuple(D.shape)}, expected {tuple(result.shape)}")
    if accumulate and D is not None:
        result = result + beta * D.float()
    bias_grad, pre_gelu = None, None
    if gelu and grad:
        if gelu_in is None or bias is not None:
            raise refuse(name, "the GELU-gradient epilogue without its input, or with a bias gradient")
        result = result * dgelu_tanh(gelu_in.float())
    elif bias is not None and grad and factor is not None:
        raise refuse(name, "the bias-gradient epilogue on FP8 operands (TE forms that gradient in bgrad_quantize)")
    elif bias is not None and grad:  # the bias gradient: B's columns summed (the output gradient of a weight GEMM)
        bias_grad = _as_2d(B).float().sum(dim=0).to(D.dtype if D is not None else dtype)
    elif bias is not None:
        result = result + bias.float()
    if gelu and not grad:
        gelu_dtype = D.dtype if D is not None else dtype
        pre_gelu = result.to(gelu_dtype)
        result = gelu_tanh(result)
    if D is None:
        D = result.to(dtype)
    else:
        D.copy_(result)
    return [D, bias_grad, pre_gelu, None]


def te_general_grouped_gemm(A, transa, B, transb, D, D_type, m_splits, bias, bias_type, single_output, pre_gelu_out,
                            grad, workspace, workspace_size, accumulate, use_split_accumulator, math_sm_count):
    """One GEMM per group, as `generic_gemm` does each: D[i] = op(B[i]) @ op(A[i]) (+ bias[i], or bias[i] := the bias
    gradient when `grad`), into D[i], or with `single_output` into consecutive row blocks of D[0]. An empty bias means
    none; a GELU epilogue is refused. Returns the biases (the gradients when `grad`)."""
    name = "te_general_grouped_gemm"
    if any(t.numel() for t in pre_gelu_out):
        raise refuse(name, "the GELU epilogue")
    if D is None:
        raise refuse(name, "outputs it would allocate itself (TE's Python passes them)")
    dtype = torch_dtype(D_type)
    row = 0
    for i, (a, b) in enumerate(zip(A, B)):
        a, b, factor = operands(name, a, transa, b, transb)
        result = product(a, transa, b, transb)
        result = result if factor is None else result * factor
        if single_output:
            rows = result.shape[0]
            out = D[0][row:row + rows].view(result.shape)
            row += rows
        else:
            out = D[i]
        has_bias = bias[i].numel() != 0
        if a.numel() == 0 or b.numel() == 0:  # TE zeroes the output (unless accumulating) and the bias gradient
            if not accumulate:
                out.zero_()
            if has_bias and grad:
                bias[i].zero_()
            continue
        if accumulate:
            result = result + out.float()
        if has_bias and grad and factor is not None:
            raise refuse(name, "the bias-gradient epilogue on FP8 operands")
        if has_bias and grad:
            bias[i].copy_(_as_2d(b).float().sum(dim=0))
        elif has_bias:
            result = result + bias[i].float()
        if out.dtype != dtype:
            raise ValueError(f"te_general_grouped_gemm: output dtype {out.dtype}, expected {dtype}")
        out.copy_(result)
    return bias
