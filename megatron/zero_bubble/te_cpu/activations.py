"""TE's activation kernels and their gradients (`gelu`, `dgelu`, `swiglu`, `dswiglu`, ...), in float32 on the CPU.

The formulas are those of TE's `common/util/math.h` (GELU in its tanh form). A gated kernel ("GLU": `swiglu`,
`geglu`, `reglu`, `glu`, `qgeglu`) reads its input's last dimension as [activated half, linear half] and returns
act(first) * second. Every kernel computes in float32 and returns the input's dtype, or with a per-tensor FP8
quantizer an FP8 tensor made as TE's kernels make it (fp8.quantize_into: delayed scaling casts the float32 result,
current scaling rounds it to the input's dtype and casts with the float32 result's amax). `dbias_d*` also return the
bias gradient (the rows of the activation's gradient summed in float32: of the float32 values when the kernel is
fused, of the rounded ones otherwise); `bgrad_quantize` the bias gradient of an output gradient and its quantized copy.
"""
from __future__ import annotations

import torch

from . import fp8


def _sigmoid(x):
    return 1.0 / (1.0 + torch.exp(-x))


def _gelu(x):
    return x * (0.5 + 0.5 * torch.tanh(x * (0.79788456 + 0.03567741 * x * x)))


def _dgelu(x):
    tanh_out = torch.tanh(0.79788456 * x * (1.0 + 0.044715 * x * x))
    return 0.5 * x * ((1.0 - tanh_out * tanh_out) * (0.79788456 + 0.1070322243 * x * x)) + 0.5 * (1.0 + tanh_out)


def _qgelu(x):
    return x * _sigmoid(1.702 * x)


def _dqgelu(x):
    s = _sigmoid(1.702 * x)
    return 1.702 * x * s * (1.0 - s) + s


def _silu(x):
    return x * _sigmoid(x)


def _dsilu(x):
    s = _sigmoid(x)
    return x * s * (1.0 - s) + s


def _relu(x):
    return torch.clamp_min(x, 0.0)


def _drelu(x):
    return (x > 0).float()


# name: (activation, its derivative, gated)
ACTIVATIONS = {
    "gelu": (_gelu, _dgelu, False), "geglu": (_gelu, _dgelu, True),
    "qgelu": (_qgelu, _dqgelu, False), "qgeglu": (_qgelu, _dqgelu, True),
    "silu": (_silu, _dsilu, False), "swiglu": (_silu, _dsilu, True),
    "relu": (_relu, _drelu, False), "reglu": (_relu, _drelu, True),
    "glu": (_sigmoid, lambda x: _sigmoid(x) * (1.0 - _sigmoid(x)), True),
}


def _output(kernel: str, values: torch.Tensor, quantizer, dtype: torch.dtype):
    if quantizer is None:
        return values.to(dtype)
    return fp8.quantize_into(None, quantizer, values, kernel, fake_dtype=dtype, amax_of=values)


def forward_kernel(name: str):
    act, _, gated = ACTIVATIONS[name]

    def kernel(input, quantizer=None):
        x = input.float()
        if gated:
            gate, linear = x.chunk(2, dim=-1)
            return _output(name, act(gate) * linear, quantizer, input.dtype)
        return _output(name, act(x), quantizer, input.dtype)

    kernel.__name__ = name
    return kernel


def backward_kernel(name: str):
    act, dact, gated = ACTIVATIONS[name]

    def kernel(grad, input, quantizer=None):
        return _output(f"d{name}", gradient(grad, input), quantizer, input.dtype)

    def gradient(grad, input) -> torch.Tensor:
        g, x = grad.float(), input.float()
        if gated:
            gate, linear = x.chunk(2, dim=-1)
            return torch.cat([g * linear * dact(gate), g * act(gate)], dim=-1)
        return g * dact(x)

    kernel.__name__ = f"d{name}"
    kernel.gradient = gradient
    return kernel


def dbias_kernel(name: str, dact_kernel):
    """dbias_d{name}: [the bias gradient, the activation's input gradient]; the gradient's dtype is grad's."""

    def kernel(grad, act_input, quantizer):
        values = dact_kernel.gradient(grad, act_input)
        fused = quantizer is not None and fp8.kind_of(f"dbias_d{name}", quantizer) == "delayed"
        summed = values if fused else values.to(grad.dtype).float()
        bias_grad = summed.reshape(-1, values.shape[-1]).sum(dim=0).to(grad.dtype)
        return [bias_grad, _output(f"dbias_d{name}", values, quantizer, grad.dtype)]

    kernel.__name__ = f"dbias_d{name}"
    return kernel


def bgrad_quantize(grad_output, quantizer):
    """[the bias gradient (rows summed in float32), the output gradient quantized (itself without a quantizer)]."""
    bias_grad = grad_output.float().reshape(-1, grad_output.shape[-1]).sum(dim=0).to(grad_output.dtype)
    if quantizer is None:
        return [bias_grad, grad_output.contiguous()]
    return [bias_grad, fp8.quantize(grad_output, quantizer)]


def kernels() -> dict:
    found = {"bgrad_quantize": bgrad_quantize}
    for name, (_, _, gated) in ACTIVATIONS.items():
        found[name] = forward_kernel(name)
        found[f"d{name}"] = backward_kernel(name)
        if not gated:
            found[f"dbias_d{name}"] = dbias_kernel(name, found[f"d{name}"])
    return found
