"""ZB-V placement of a hybrid model's pattern segments (megatron-core's HybridModel).

A HybridModel chunk takes its layers from `hybrid_layer_allocation.select_pipeline_segment`: with the pattern cut
into s segments by `|`, megatron's interleaved rule gives rank r's chunk k segment k*p + r. Under the V, chunk 0 of
rank r is virtual stage r and chunk 1 is 2p-1-r (patches/vshape_layout.py does the rest of the V: stage roles,
embeddings, the loss); `install(p)` makes segment `virtual_stage("v", p, r, k)` that chunk's layers, with the layer
offset counted over the segments before it, so layer numbers (and checkpoint names) are the model's true depth as at
PP=1. A V needs exactly 2p segments (the start-up checks refuse other counts in one line); megatron's function runs
unchanged at PP=1 and after `uninstall()`.
"""
from __future__ import annotations

import importlib

from ..schedules.schedule import virtual_stage
from . import imports
from ._patching import MegatronPatch, PatchError

ALLOCATION = "megatron.core.models.hybrid.hybrid_layer_allocation"
PIPE = "|"


def v_segment(segments: list[str], stages: int, rank: int, chunk: int) -> tuple[str, int]:
    """(the segment (rank, chunk) holds under the V, the number of decoder layers before it)."""
    if len(segments) != 2 * stages:
        raise PatchError(f"ZB-V places 2p = {2 * stages} pattern segments (p={stages}), the hybrid layer pattern has "
                         f"{len(segments)}; cut it into {2 * stages} segments with '|'")
    if chunk not in (0, 1):
        raise PatchError(f"under the V every model chunk is built with vp_stage 0 or 1, got {chunk!r}")
    stage = virtual_stage("v", stages, rank, chunk)
    return segments[stage], sum(len(segment) for segment in segments[:stage])


class VHybridSegments(MegatronPatch):
    """Installed with p (`install(stages)`)."""

    name = "vshape_hybrid"

    def apply(self, stages: int) -> None:
        if not isinstance(stages, int) or stages < 2:
            raise PatchError(f"the V placement needs a pipeline of at least 2 ranks, got p={stages!r}")
        imports.ensure_installed()  # megatron.core must import without triton
        allocation = importlib.import_module(ALLOCATION)
        self._megatron = self.patches.replace_everywhere(allocation, "select_pipeline_segment",
                                                         self.select_pipeline_segment)
        self._validate = allocation.validate_segment_layers

    def select_pipeline_segment(self, main_pattern, pp_group, vp_stage, first_stage_layers=None,
                                last_stage_layers=None, tp_group=None, dp_cp_group=None):
        """megatron's signature (0.19.2); its result, (layer characters, layer offset), for the V's segment."""
        import torch

        size = torch.distributed.get_world_size(pp_group) if pp_group is not None else 1
        if not self.installed or size == 1:
            return self._megatron(main_pattern, pp_group, vp_stage, first_stage_layers, last_stage_layers,
                                  tp_group=tp_group, dp_cp_group=dp_cp_group)
        stages = self.options[0]
        if size != stages:
            raise PatchError(f"the V placement was installed for p={stages} pipeline ranks, but the hybrid model "
                             f"runs on {size}")
        segment, offset = v_segment((main_pattern or "").split(PIPE), stages,
                                    torch.distributed.get_rank(pp_group), vp_stage)
        return self._validate(segment), offset


_PATCH = VHybridSegments()


def install(stages: int) -> None:
    """Build HybridModel chunks of the V for p = `stages` ranks (idempotent; another p re-installs)."""
    _PATCH.install(stages)


def uninstall() -> None:
    _PATCH.uninstall()


def installed() -> bool:
    return _PATCH.installed
