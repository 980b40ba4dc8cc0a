"""A stand-in for the `torch` name inside chosen megatron modules, on which the CPU is "the GPU".

megatron-core calls `torch.cuda.current_device()`, `torch.cuda.synchronize()`, `torch.cuda.current_stream()`
and `torch.zeros(..., device="cuda")` in many functions. Rather than editing or re-implementing those
functions, the CPU backend replaces the module global `torch` of the modules that do so with a
`CpuTorch`: every attribute is the real torch's, except that

- `.cuda` is a `CpuCuda` namespace (current device = cpu, streams/events do nothing, the RNG calls act on
  the CPU generator), and
- the tensor factories map a CUDA `device=` argument to the CPU.

torch itself is not changed, so the rest of the process (tests, the runtime, user code) is unaffected.
The one exception is `cuda_calls_stay_on_cpu()`, confined to the duration of a wrapped megatron call.
"""
from __future__ import annotations

import contextlib
import functools
import types

import torch

CPU = torch.device("cpu")

# Factories megatron calls with device="cuda" or device=torch.cuda.current_device().
TENSOR_FACTORIES = (
    "tensor", "as_tensor", "zeros", "ones", "empty", "full", "arange", "rand", "randn", "randint",
    "eye", "zeros_like", "ones_like", "empty_like", "full_like",
)


def cpu_if_cuda(device):
    """The CPU for any CUDA device spec ("cuda", "cuda:0", torch.device("cuda"), a bare index)."""
    if isinstance(device, str) and device.startswith("cuda"):
        return CPU
    if isinstance(device, torch.device) and device.type == "cuda":
        return CPU
    if isinstance(device, int) and not isinstance(device, bool):  # torch reads a bare int as a CUDA index
        return CPU
    return device


class NullEvent:
    """A CUDA event on a machine where all work is synchronous: always complete."""

    def __init__(self, *args, **kwargs):
        pass

    def record(self, stream=None):
        pass

    def wait(self, stream=None):
        pass

    def query(self) -> bool:
        return True

    def synchronize(self):
        pass


class NullStream:
    """A CUDA stream on a machine where all work is synchronous: ordering is already guaranteed."""

    def __init__(self, device=None, priority: int = 0, **kwargs):
        self.device = CPU
        self.priority = priority

    def wait_stream(self, stream):
        pass

    def wait_event(self, event):
        pass

    def record_event(self, event=None):
        return event if event is not None else NullEvent()

    def synchronize(self):
        pass

    def query(self) -> bool:
        return True

    @staticmethod
    def priority_range():
        return (0, 0)


class CpuCuda:
    """What `torch.cuda` looks like to a patched module. Anything not defined here is the real torch.cuda.

    `report_device=True` makes `is_available()` / `device_count()` claim one device: used only where
    Megatron's initialisation skips model-parallel set-up when it sees no GPU.
    """

    Stream = NullStream
    Event = NullEvent

    def __init__(self, report_device: bool = False):
        self.report_device = report_device

    def __getattr__(self, name):
        return getattr(torch.cuda, name)

    def is_available(self) -> bool:
        return self.report_device

    def device_count(self) -> int:
        return 1 if self.report_device else 0

    def current_device(self) -> torch.device:
        return CPU

    def set_device(self, device) -> None:
        pass

    def synchronize(self, device=None) -> None:
        pass

    def current_stream(self, device=None) -> NullStream:
        return NullStream()

    default_stream = current_stream

    def set_stream(self, stream) -> None:
        pass

    def stream(self, stream):
        return contextlib.nullcontext(stream)

    # The CPU generator plays the role of the device generator (Megatron's RNG tracker forks it).
    def get_rng_state(self, device="cuda") -> torch.Tensor:
        return torch.get_rng_state()

    def set_rng_state(self, new_state: torch.Tensor, device="cuda") -> None:
        torch.set_rng_state(new_state)

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    manual_seed_all = manual_seed


class CpuTorch(types.ModuleType):
    """The `torch` module with a `CpuCuda` for `.cuda` and CPU-mapping tensor factories."""

    def __init__(self, report_device: bool = False):
        super().__init__("torch", "torch as seen by megatron modules patched for the CPU backend")
        self.cuda = CpuCuda(report_device)
        for name in TENSOR_FACTORIES:
            setattr(self, name, _factory_on_cpu(getattr(torch, name)))

    def __getattr__(self, name):
        return getattr(torch, name)


def _factory_on_cpu(factory):
    @functools.wraps(factory)
    def make(*args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = cpu_if_cuda(kwargs["device"])
        return factory(*args, **kwargs)

    return make


@contextlib.contextmanager
def cuda_calls_stay_on_cpu():
    """While the block runs, `Tensor.cuda()` and `Module.cuda()` return their object unchanged.

    A few megatron functions call `.cuda()` on a tensor or module, a method no name rebinding reaches.
    This is the only change to torch itself; it is undone when the block exits (nesting is fine).
    """
    owners = (torch.Tensor, torch.nn.Module)
    saved = [(owner, owner.__dict__.get("cuda")) for owner in owners]  # None: inherited, not own
    for owner in owners:
        owner.cuda = _stay_on_cpu
    try:
        yield
    finally:
        for owner, own in saved:
            if own is None:
                del owner.cuda
            else:
                owner.cuda = own


def _stay_on_cpu(self, device=None, non_blocking=False, **kwargs):
    return self


def with_cuda_calls_on_cpu(function):
    """`function` wrapped so that its `.cuda()` calls stay on the CPU while it runs."""

    @functools.wraps(function)
    def run_on_cpu(*args, **kwargs):
        with cuda_calls_stay_on_cpu():
            return function(*args, **kwargs)

    return run_on_cpu
