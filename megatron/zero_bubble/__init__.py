"""Zero-bubble pipeline parallelism for megatron-core (Qi et al., ICLR 2024).

Layers: `schedules` (pure-Python planning), `runtime` (torch executor), `patches` (megatron-core hooks).
"""
__version__ = "0.1.0"
