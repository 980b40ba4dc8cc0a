"""Start-up checks for Transformer Engine layers split into B and W (patches/te_wgrad.py): one line naming the
flag or the version, and the fix. No megatron or TE import (the version comes from the package metadata)."""
from __future__ import annotations

from .flags import StartupRefusal

# FP8 recipes whose split into B and W has been shown bit for bit with megatron's 1F1B (on the CPU, TE's own Python
# over the emulated per-tensor FP8 kernels of te_cpu/fp8.py): gradients, losses and the recipe's scaling state.
EXACT_FP8_RECIPES = ("delayed", "tensorwise")
# megatron's flags that quantize TE's GEMM operands or weights beyond those recipes (dest: flag, why refused).
LOW_PRECISION_FLAGS = {
    "fp4": ("--fp4-format", "FP4's kernels are not emulated, so its split has not been shown exact"),
    "fp8_param_gather": ("--fp8-param-gather", "FP8 primary weights are quantized by the optimizer step, which the "
                                               "split has not been shown exact with"),
    "fp4_param_gather": ("--fp4-param-gather", "FP4's kernels are not emulated, so its split has not been shown exact"),
}


def check_transformer_engine_split(args, flag: str) -> None:
    """What splitting Transformer Engine's layers into B and W needs: a TE version whose deferral was read, full
    precision, and none of the TE features that cannot defer their weight gradients."""
    if getattr(args, "transformer_impl", "local") != "transformer_engine":
        return
    from ..patches import te_wgrad

    reason = te_wgrad.version_refusal(te_wgrad.installed_version(), args.gradient_accumulation_fusion)
    if reason is not None:
        raise StartupRefusal(f"{flag} with --transformer-impl transformer_engine: {reason}; install "
                             f"{te_wgrad.VERSIONS_READ} or use --transformer-impl local")
    _check_precision(args, flag)
    if getattr(args, "tp_comm_overlap", False):
        raise StartupRefusal(f"--tp-comm-overlap does not work with {flag} on Transformer Engine layers (with TE's "
                             f"Userbuffers overlap a deferred W would read buffers that later passes overwrite); drop "
                             f"--tp-comm-overlap")
    if getattr(args, "cuda_graph_impl", "none") not in ("none", None):
        raise StartupRefusal(f"--cuda-graph-impl {args.cuda_graph_impl} does not work with {flag} (a captured backward "
                             f"would replay one pass's choice of deferring the weight gradients); drop --cuda-graph-impl")
    if getattr(args, "overlap_dispatch_backward_with_experts_wgrad", False):
        option = "--overlap-dispatch-backward-with-experts-wgrad"
        raise StartupRefusal(f"{option} does not work with {flag} (megatron's MoE layer then runs the experts' "
                             f"backward_dw() inside B, taking the weight gradients the schedule defers to W); "
                             f"drop {option}")


def _check_precision(args, flag: str) -> None:
    if getattr(args, "fp8", None) and getattr(args, "fp8_recipe", "delayed") not in EXACT_FP8_RECIPES:
        raise StartupRefusal(f"--fp8-recipe {args.fp8_recipe} does not work with {flag} on Transformer Engine layers "
                             f"yet (its kernels are not emulated on the CPU, so its split has not been shown exact); "
                             f"use --fp8-recipe {' or '.join(EXACT_FP8_RECIPES)}, or keep it with a schedule that does "
                             f"not split the backward (--pipeline-schedule 1f1b)")
    for name, (option, why) in LOW_PRECISION_FLAGS.items():
        value = getattr(args, name, None)
        if value not in (None, False):
            given = option if value is True else f"{option} {value}"
            raise StartupRefusal(f"{given} does not work with {flag} on Transformer Engine layers yet ({why}); drop "
                                 f"{option}, or keep it with a schedule that does not split the backward "
                                 f"(--pipeline-schedule 1f1b)")
