"""TE's per-tensor FP8 kernels on the CPU: quantize (delayed and current scaling), dequantize, transpose, amax, and
the delayed-scaling recipe's amax-history and scale update. An emulation, labelled as one.

What each does is what TE's CUDA kernels do with the same arguments (TE 2.20's csrc/quantizer.cpp, cast.cpp,
common/recipe/*.cu), for a Hopper GPU, which runs FP8 GEMMs only in the "TN" layout and so keeps a transposed copy
of every operand it reads column-wise:
- a quantized tensor holds FP8 data (`_data`) when its quantizer's row-wise usage is on and the transpose
  (`_transpose`, the last dimension first) when its column-wise usage is on, with one `_scale_inv` = 1 / scale;
- the cast multiplies by the scale in float32, saturates to the format's largest finite value (448 for E4M3, 57344 for
  E5M2) and rounds to nearest even; NaN stays NaN;
- delayed scaling (`Float8Quantizer`) casts with the quantizer's scale and raises its `amax` to the input's largest
  magnitude (NaN ignored, as the kernel's fmaxf does);
- current scaling (`Float8CurrentScalingQuantizer`) takes the amax of the input, max-reduces it over the
  quantizer's group when asked, and casts with scale = max / amax (epsilon floor, powers of two when forced).
Other quantizers (MXFP8, FP8 blockwise, NVFP4) are refused in one line.
"""
from __future__ import annotations

import inspect
import sys

import torch
import torch.distributed as dist

from .dtypes import torch_dtype
from .enums import DType
from .refusal import refuse

FP8_MAX = {DType.kFloat8E4M3: 448.0, DType.kFloat8E5M2: 57344.0}
TORCH_FP8 = {DType.kFloat8E4M3: torch.float8_e4m3fn, DType.kFloat8E5M2: torch.float8_e5m2}
FLOAT32_MAX = torch.finfo(torch.float32).max
PER_TENSOR = ("Float8Quantizer", "Float8CurrentScalingQuantizer")


def fp8_tag(dtype) -> DType:
    tag = DType(int(dtype))
    if tag not in FP8_MAX:
        raise ValueError(f"expected an FP8 dtype, got {tag.name}")
    return tag


def kind_of(kernel: str, quantizer) -> str:
    """"delayed" or "current"; any other quantizer is refused."""
    name = type(quantizer).__name__
    if name not in PER_TENSOR:
        raise refuse(kernel, f"the {name} (a recipe other than delayed or tensorwise FP8 scaling)")
    return "delayed" if name == "Float8Quantizer" else "current"


def cast(values: torch.Tensor, scale: torch.Tensor, dtype) -> torch.Tensor:
    """FP8 bytes (uint8) of float32 `values` times `scale`, saturated to the format's finite range."""
    tag = fp8_tag(dtype)
    scaled = values.float() * scale.float()
    return scaled.clamp(-FP8_MAX[tag], FP8_MAX[tag]).to(TORCH_FP8[tag]).view(torch.uint8)


def values_of(data: torch.Tensor, dtype) -> torch.Tensor:
    """The float32 values of FP8 bytes (unscaled)."""
    return data.view(TORCH_FP8[fp8_tag(dtype)]).float()


def absmax(values: torch.Tensor) -> torch.Tensor:
    """The largest magnitude as a one-element float32 tensor, NaN ignored (0 for an empty tensor)."""
    if values.numel() == 0:
        return torch.zeros(1)
    return torch.nan_to_num(values.float().abs(), nan=0.0).max().reshape(1)


def scale_from_amax(amax: torch.Tensor, dtype, force_pow_2_scales: bool, epsilon: float) -> torch.Tensor:
    """Current scaling's scale: max / max(amax, epsilon); 1 for a zero, infinite or NaN amax; float32's largest for
    an infinite quotient; the exponent alone when powers of two are forced."""
    a = amax.float().reshape(1).clone()
    a = torch.where(a < epsilon, torch.full_like(a, epsilon), a)
    if not torch.isfinite(a).all() or a.item() == 0.0:
        return torch.ones(1)
    scale = torch.tensor([FP8_MAX[fp8_tag(dtype)]]) / a
    if torch.isinf(scale).all():
        scale = torch.tensor([FLOAT32_MAX])
    if force_pow_2_scales:
        scale = (scale.view(torch.int32) & -8388608).view(torch.float32)  # 0xFF800000: sign and exponent
    return scale


def transpose_shape(shape) -> list:
    return [shape[-1], *shape[:-1]] if len(shape) else []


def transposed(data: torch.Tensor) -> torch.Tensor:
    """TE's FP8 transpose: the last dimension first, the others in order."""
    if data.dim() < 2:
        return data.clone()
    return data.reshape(-1, data.shape[-1]).t().contiguous().reshape(transpose_shape(list(data.shape)))


STORAGE_CLASSES = ("Float8TensorStorage", "Float8TensorBase")  # TE's per-tensor FP8 storage (2.8 on; before)


def _classes():
    """TE's Float8Tensor and its storage class (Float8TensorStorage; Float8TensorBase up to 2.7): loaded by the time
    TE's Python calls a kernel here (this layer does not import TE; TE imports it)."""
    tensor = sys.modules["transformer_engine.pytorch.tensor.float8_tensor"].Float8Tensor
    storage = next(cls for cls in tensor.__mro__ if cls.__name__ in STORAGE_CLASSES)
    return tensor, storage


def _accepted(cls, kwargs: dict) -> dict:
    """The arguments `cls(...)` takes by name in the release installed (2.5's Float8Tensor takes no device or stride,
    its storage no fake_dtype), as TE's own extension of that release passes them."""
    names = set()
    for klass in cls.__mro__:
        new = vars(klass).get("__new__")
        if new is not None and klass is not object:
            names |= {n for n, p in inspect.signature(new).parameters.items() if p.kind != p.VAR_KEYWORD}
    return {name: value for name, value in kwargs.items() if name in names}


def is_per_tensor_fp8(tensor) -> bool:
    return any(cls.__name__ in STORAGE_CLASSES for cls in type(tensor).__mro__)


def logical_shape(tensor) -> list:
    """The shape a per-tensor FP8 tensor stands for: its data's, or its transpose's with the first dimension last."""
    if tensor._data is not None:
        return list(tensor._data.shape)
    return [*tensor._transpose.shape[1:], tensor._transpose.shape[0]]


def rowwise_values(tensor) -> torch.Tensor | None:
    """The float32 values (unscaled) of the row-wise FP8 data, in the tensor's shape; None without it."""
    return None if tensor._data is None else values_of(tensor._data, tensor._fp8_dtype)


def columnwise_values(tensor) -> torch.Tensor | None:
    """The float32 values (unscaled) of the valid FP8 transpose, back in the tensor's shape; None without one."""
    if tensor._transpose is None or tensor._transpose_invalid:
        return None
    return values_of(tensor._transpose, tensor._fp8_dtype).movedim(0, -1)


def new_output(quantizer, shape, fake_dtype: torch.dtype):
    """An empty quantized tensor as TE's `create_tensor` makes it: data for row-wise usage, a transpose for
    column-wise usage, the scale's reciprocal (delayed scaling) or an empty scale inverse (current scaling)."""
    float8_tensor, storage = _classes()
    shape = [int(s) for s in shape]
    data = torch.empty(shape, dtype=torch.uint8) if quantizer.rowwise_usage else None
    transpose = torch.empty(transpose_shape(shape), dtype=torch.uint8) if quantizer.columnwise_usage else None
    scale_inv = torch.reciprocal(quantizer.scale.float()) if hasattr(quantizer, "scale") else torch.empty(1)
    common = dict(data=data, fp8_scale_inv=scale_inv, fp8_dtype=quantizer.dtype, data_transpose=transpose,
                  quantizer=quantizer)
    if quantizer.internal:
        return storage(**_accepted(storage, dict(fake_dtype=fake_dtype, **common)))
    stride = list(torch.empty(shape, device="meta").stride())  # contiguous, as TE's stride_from_shape
    return float8_tensor(**_accepted(float8_tensor, dict(shape=shape, stride=stride, dtype=fake_dtype,
                                                         device=torch.device("cpu"), **common)))


def create_empty_quantized_tensor(quantizer, shape, dtype, device=None, pin_memory=False):
    """tex.create_empty_quantized_tensor: what `new_output` makes, for a per-tensor FP8 quantizer."""
    kind_of("create_empty_quantized_tensor", quantizer)
    return new_output(quantizer, list(shape), dtype)


def prepared_output(quantizer, output):
    """An existing quantized tensor made to hold what the quantizer's usages ask (TE's convert_and_update_tensor)."""
    if not is_per_tensor_fp8(output):
        raise ValueError(f"{type(quantizer).__name__} must output to a Float8Tensor, got {type(output).__name__}")
    if output._data is None and output._transpose is None:
        raise ValueError("Float8Tensor has no data")
    shape = logical_shape(output)
    if not quantizer.rowwise_usage:
        output._data = None
    elif output._data is None:
        output._data = torch.empty(shape, dtype=torch.uint8)
    if not quantizer.columnwise_usage:
        output._transpose = None
    elif output._transpose is None:
        output._transpose = torch.empty(transpose_shape(shape), dtype=torch.uint8)
    output._transpose_invalid = not quantizer.columnwise_usage
    output._fp8_dtype = quantizer.dtype
    return output


def _write(output, values: torch.Tensor, scale: torch.Tensor, dtype) -> None:
    data = cast(values, scale, dtype).reshape(logical_shape(output))
    if output._data is not None:
        output._data.copy_(data)
    if output._transpose is not None:
        output._transpose.copy_(transposed(data))
    output._scale_inv.copy_(torch.reciprocal(scale.float()).reshape(output._scale_inv.shape))


def _reduced(amax: torch.Tensor, quantizer) -> torch.Tensor:
    if getattr(quantizer, "with_amax_reduction", False):
        group = quantizer._canonicalized_amax_reduction_group()
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    return amax


def quantize_into(output, quantizer, values: torch.Tensor, kernel: str, *, fake_dtype: torch.dtype,
                  amax_of=None, noop=None):
    """Quantize float32 `values` into `output` (made when None) as `quantizer` does, and return it.

    Delayed scaling casts `values` as given (a fused kernel's float32 result). Current scaling casts `values` rounded
    to `fake_dtype` (TE computes such a result in high precision first) with the amax of `amax_of` (default: the
    rounded values), as TE's fused "amax in high precision, then quantize" paths do."""
    kind = kind_of(kernel, quantizer)
    if output is None:
        output = new_output(quantizer, list(values.shape), fake_dtype)
    else:
        output = prepared_output(quantizer, output)
    if values.numel() == 0 or (noop is not None and noop.float().reshape(-1)[0].item() == 1.0):
        return output
    if kind == "delayed":
        quantizer.amax.copy_(torch.fmax(quantizer.amax.float(), absmax(values).reshape(quantizer.amax.shape)))
        _write(output, values, quantizer.scale.float().reshape(1), quantizer.dtype)
        return output
    rounded = values.to(fake_dtype).float()
    amax = _reduced(absmax(rounded if amax_of is None else amax_of), quantizer)
    scale = scale_from_amax(amax, quantizer.dtype, quantizer.force_pow_2_scales, quantizer.amax_epsilon)
    _write(output, rounded, scale, quantizer.dtype)
    return output


def quantize(tensor, quantizer, output=None, noop=None):
    """tex.quantize: a high-precision tensor into a quantized one (a new one, or `output` updated in place)."""
    if quantizer is None:
        return tensor.contiguous() if output is None else output.copy_(tensor)
    return quantize_into(output, quantizer, tensor.contiguous().float(), "quantize", fake_dtype=tensor.dtype,
                         noop=noop)


def split_quantize(tensor, split_sections, quantizer_list, disable_bulk_allocation=False):
    """tex.split_quantize for per-tensor FP8: the blocks of rows `split_sections` cut from `tensor`, each quantized by
    its own quantizer (TE allocates and casts them one by one for these quantizers)."""
    if len(quantizer_list) != len(split_sections):
        raise ValueError(f"Expected {len(split_sections)} quantizers, but got {len(quantizer_list)}")
    blocks = torch.split(tensor.contiguous(), [int(s) for s in split_sections], dim=0)
    return [quantize(block, quantizer) for block, quantizer in zip(blocks, quantizer_list)]


def dequantize(tensor, dtype):
    """tex.dequantize: the high-precision values of a per-tensor FP8 tensor."""
    if not is_per_tensor_fp8(tensor):
        raise refuse("dequantize", f"a {type(tensor).__name__}")
    values = rowwise_values(tensor)
    if values is None and (values := columnwise_values(tensor)) is not None:
        values = values.contiguous()
    if values is None:
        raise RuntimeError("Float8Tensor has no data")
    return (values * tensor._scale_inv.float()).to(torch_dtype(dtype))


def fp8_transpose(input, dtype, out=None):
    result = transposed(input)
    if out is None:
        return result
    out.copy_(result.reshape(out.shape))
    return out


def compute_amax(input, amax):
    amax.copy_(absmax(input).reshape(amax.shape))


def fused_amax_and_scale_update_after_reduction(amax_reduction_buffer, amax_histories, scales, amax_compute_algo,
                                                fp8_dtype, margin):
    """The delayed-scaling recipe's update, per scaling factor of each history: the newest amax (the reduced one when
    non-zero, else the history's first row); if it is non-zero, the history rolls (the first row zeroed, the newest
    amax last); the amax is the newest ("most_recent") or the largest of the rolled values ("max"); a positive
    finite amax sets scale = max * 2^-margin / amax (float32's largest if that overflows), else the scale stays."""
    if amax_compute_algo not in ("max", "most_recent"):
        raise ValueError(f"Unsupported amax compute algorithm ({amax_compute_algo})")
    scaled_max = torch.tensor(FP8_MAX[fp8_tag(fp8_dtype)], dtype=torch.float32) * torch.tensor(
        2.0, dtype=torch.float32).pow(-float(margin))
    offset = 0
    for history, scale in zip(amax_histories, scales):
        count = history.shape[1]
        reduced = amax_reduction_buffer.reshape(-1)[offset:offset + count].float()
        offset += count
        for j in range(count):
            last = reduced[j] if reduced[j].item() != 0.0 else history[0, j].clone()
            amax = torch.zeros((), dtype=torch.float32)
            if last.item() != 0.0:
                rolled = torch.cat([history[1:, j], last.reshape(1)])
                amax = torch.nan_to_num(rolled, nan=0.0).clamp_min(0.0).max()
                rolled[0] = 0.0
                history[:, j] = rolled
            if amax_compute_algo == "most_recent":
                amax = last
            if torch.isfinite(amax) and amax.item() > 0.0:
                new_scale = scaled_max / amax
                scale[j] = FLOAT32_MAX if torch.isinf(new_scale) else new_scale


def kernels() -> dict:
    return {"quantize": quantize, "split_quantize": split_quantize, "dequantize": dequantize,
            "create_empty_quantized_tensor": create_empty_quantized_tensor,
            "fp8_transpose": fp8_transpose,
            "compute_amax": compute_amax,
            "fused_amax_and_scale_update_after_reduction": fused_amax_and_scale_update_after_reduction}
