"""Model options that `pretrain_gpt.py` cannot build where it runs, refused at start-up in one line.

What the zero-bubble runtime cannot keep exact is refused with the schedule that needs it (checks.py: multi-token
prediction with optimizer post-validation; planners.py: megatron's placements a V cannot follow, MTP's included).
Here: what megatron-core 0.19.2 itself cannot build with the chosen layers, which would otherwise stop inside its
model construction with a stack trace. docs/models.md lists what is exact under which schedule.
"""
from __future__ import annotations

from .flags import StartupRefusal


def check_model_options(args) -> None:
    """Refuse (StartupRefusal) the model options megatron cannot build with the chosen layer implementation."""
    if getattr(args, "multi_latent_attention", False) and getattr(args, "transformer_impl", None) == "local":
        raise StartupRefusal("--multi-latent-attention needs Transformer Engine's attention (megatron-core 0.19.2's "
                             "local DotProductAttention takes no head size of its own for the keys); add "
                             "--transformer-impl transformer_engine (a GPU with transformer-engine; not on CPU)")
