"""Zero-bubble pipeline parallelism for megatron-core (Qi et al., ICLR 2024).

Layers: `schedules` (pure-Python planning), `runtime` (torch executor), `patches` (megatron-core hooks, and the
adapter through which the runtime reaches megatron), `training` (pretrain_gpt.py's flags, checks and session),
`tools` (the rehearsal).
"""
from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("megatron-zero-bubble")
except PackageNotFoundError:  # run from a checkout that was never installed
    __version__ = "unknown"
