"""Start-up checks for Transformer Engine layers split into B and W (patches/te_wgrad.py): one line naming the
flag or the version, and the fix. No megatron or TE import (the version comes from the package metadata)."""
from __future__ import annotations

from .flags import StartupRefusal

# megatron's flags that quantize TE's GEMM operands or weights (dest: flag). FP8 and FP4 weight gradients deferred
# by TE have never run on a GPU here, the held-memory model has not been checked against quantized tensors, and
# TE's backward_dw fails on an FP8 bias gradient formed in B when it finds bias.grad cleared (TE issue #3400).
LOW_PRECISION_FLAGS = {"fp8": "--fp8-format", "fp4": "--fp4-format", "fp8_param_gather": "--fp8-param-gather",
                       "fp4_param_gather": "--fp4-param-gather"}


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
    for name, option in LOW_PRECISION_FLAGS.items():
        value = getattr(args, name, None)
        if value not in (None, False):
            given = option if value is True else f"{option} {value}"
            raise StartupRefusal(f"{given} does not work with {flag} on Transformer Engine layers yet (TE's FP8 / FP4 "
                                 f"weight gradients deferred to W have never run on a GPU); drop {option}, or keep "
                                 f"it with a schedule that does not split the backward (--pipeline-schedule 1f1b)")
