"""What a run meets when TE's Python calls a kernel the CPU layer does not implement: one line, then the run stops."""
from __future__ import annotations

# What to change, by the family a kernel belongs to (the first matching prefix of its name wins).
HINTS = (
    (("fused_attn", "fa_prepare", "thd_", "convert_thd", "convert_bshd", "copy_to_kv_cache"),
     "TE's fused and flash attention need CUDA: run with NVTE_FUSED_ATTN=0 NVTE_FLASH_ATTN=0 (set by "
     "--zero-bubble-cpu) and without --attention-backend flash/fused"),
    (("fused_rope", "fused_qkv_rope"), "add --no-rope-fusion"),
    (("moe_permute", "moe_unpermute", "fused_topk", "fused_score_for_moe", "fused_moe_aux", "ep_"),
     "leave out --moe-permute-fusion and --moe-router-fusion"),
    (("multi_tensor_", "newton_schulz", "cusolvermp"), "use megatron's torch optimizer (--optimizer adam or sgd)"),
    (("nvfp4",), "FP4 is not emulated on the CPU: leave out --fp4-format"),
    (("quantize", "split_quantize", "group_quantize", "bgrad_group_quantize", "group_requantize", "mxfp8_",
      "fp8_block", "create_empty_quantized_tensor", "dequantize", "swizzle"),
     "the CPU emulates FP8 with per-tensor scaling only: use --fp8-recipe delayed or tensorwise"),
    (("CommOverlap", "bulk_overlap", "ubuf", "device_supports_multicast"), "leave out --tp-comm-overlap"),
)
GENERIC_HINT = "use --transformer-impl local, or a GPU with Transformer Engine's CUDA kernels"


class KernelNotOnCpu(NotImplementedError):
    """A `transformer_engine_torch` kernel (or an argument of one) the CPU kernel layer does not implement."""


def hint_for(name: str) -> str:
    for prefixes, hint in HINTS:
        if name.startswith(prefixes):
            return hint
    return GENERIC_HINT


def refuse(kernel: str, what: str | None = None) -> KernelNotOnCpu:
    """The error to raise: `what` names the argument not honoured (None: the kernel itself is missing)."""
    missing = f"tex.{kernel} has no CPU implementation" if what is None else f"tex.{kernel}: {what} is not emulated"
    return KernelNotOnCpu(f"zero-bubble: Transformer Engine on the CPU: {missing}; {hint_for(kernel)}")


def missing_kernel(name: str):
    """A stand-in for kernel `name` that raises as soon as TE's Python calls it."""

    def kernel(*args, **kwargs):
        raise refuse(name)

    kernel.__name__ = kernel.__qualname__ = name
    kernel.missing_on_cpu = True
    return kernel
