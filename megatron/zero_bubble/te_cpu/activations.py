"""TE's activation kernels and their gradients (`gelu`, `dgelu`, `swiglu`, `dswiglu`, ...), in float32 on the CPU.

The formulas are those of TE's `common/util/math.h` (GELU in its tanh form). A gated kernel ("GLU": `swiglu`,
`geglu`, `reglu`, `glu`, `qgeglu`) reads its input's last dimension as [activated half, linear half] and returns
act(first) * second. Every kernel computes in float32 and returns the input's dtype. A quantizer (an FP8 output)
is refused.
"""
from __future__ import annotations

import torch

from .refusal import refuse


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


def _no_quantizer(kernel: str, quantizer) -> None:
    if quantizer is not None:
        raise refuse(kernel, f"an output quantizer ({type(quantizer).__name__})")


def forward_kernel(name: str):
    act, _, gated = ACTIVATIONS[name]

    def kernel(input, quantizer=None):
        _no_quantizer(name, quantizer)
        x = input.float()
        if gated:
            gate, linear = x.chunk(2, dim=-1)
            return (act(gate) * linear).to(input.dtype)
        return act(x).to(input.dtype)

    kernel.__name__ = name
    return kernel


def backward_kernel(name: str):
    act, dact, gated = ACTIVATIONS[name]

    def kernel(grad, input, quantizer=None):
        _no_quantizer(f"d{name}", quantizer)
        g, x = grad.float(), input.float()
        if gated:
            gate, linear = x.chunk(2, dim=-1)
            return torch.cat([g * linear * dact(gate), g * act(gate)], dim=-1).to(input.dtype)
        return (g * dact(x)).to(input.dtype)

    kernel.__name__ = f"d{name}"
    return kernel


def kernels() -> dict:
    found = {}
    for name in ACTIVATIONS:
        found[name] = forward_kernel(name)
        found[f"d{name}"] = backward_kernel(name)
    return found
