"""megatron's start-up compiles its dataset helpers only where no compiled module is installed.

`megatron.training.initialize._compile_dependencies` runs `make` in megatron/core/datasets on global rank 0 and
exits the run when it fails. The megatron-core wheel (and the sdist build) install the compiled `helpers_cpp` but no
Makefile, so every run from a pip install stops before its first iteration with "Failed to compile the C++ dataset
helper functions" (megatron-core 0.19.2's py3.12 wheel among them). Where `helpers_cpp` is installed the
compile is skipped; elsewhere (a source checkout, which has the Makefile) megatron's own step runs. Either way every
rank then meets megatron's barrier, so the ranks issue the same collectives whatever each found.
"""
from __future__ import annotations

import importlib
import importlib.util

from ._patching import MegatronPatch, module_functions

HELPERS = "megatron.core.datasets.helpers_cpp"


def prebuilt() -> bool:
    return importlib.util.find_spec(HELPERS) is not None


class PrebuiltHelpers(MegatronPatch):
    name = "prebuilt_helpers"

    def apply(self) -> None:
        initialize = importlib.import_module("megatron.training.initialize")
        compile_dependencies = initialize._compile_dependencies

        def compile_unless_prebuilt(*args, **kwargs):
            if not prebuilt():
                return compile_dependencies(*args, **kwargs)
            import torch.distributed as dist

            dist.barrier()  # megatron's own step ends with it on every rank

        self.patches.replace(initialize, "_compile_dependencies", compile_unless_prebuilt)


install, uninstall, installed = module_functions(PrebuiltHelpers())
