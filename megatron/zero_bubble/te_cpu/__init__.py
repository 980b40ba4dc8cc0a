"""Transformer Engine's own Python on the CPU, over a labelled CPU implementation of its kernels.

TE's modules, quantizers and weight-gradient deferral are TE's Python; only its compiled extension
(`transformer_engine_torch`, imported by TE as `tex`) needs CUDA. This package provides that extension in torch on the
CPU, for `--zero-bubble-cpu` runs and the test suite, where TE's Python is installed without its CUDA packages:

- loader.py: the import hook that puts it in front of TE, before anything imports TE;
- extension.py: the module itself; a kernel it lacks stops the run in one line naming it (refusal.py);
- gemm.py (the GEMM and the grouped GEMM), norms.py, activations.py, softmax.py: the kernels, each honouring its
  arguments or refusing them.

The numbers are the CPU's, not a GPU's: these kernels are TE's in what they take and return, not in their rounding.
A GPU install (TE with its extension) is never touched.
"""
from .loader import install, installed, te_python_version, uninstall

__all__ = ["install", "installed", "te_python_version", "uninstall"]
