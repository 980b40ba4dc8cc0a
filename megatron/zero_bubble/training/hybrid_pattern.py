"""megatron's --hybrid-layer-pattern, read without megatron (start-up checks, the planner's costs).

The pattern names one layer per character (megatron-core 0.19.2's grammar): `*` attention, `-` MLP, `E` MoE, `M`
Mamba, `G` gated delta net (GDN), `D` DeepSeek sparse attention, `+` multi-latent attention; `|` cuts the stack into
pipeline segments and `/` starts the multi-token-prediction (MTP) layers, one `/`-separated pattern per depth.
Megatron places segment i on virtual stage i: with s segments over p pipeline ranks, s = p gives one chunk per
rank, s = c p gives c chunks per rank (rank r's chunk k is segment k p + r, megatron's interleaved rule); the V
places its 2p segments as its virtual stages (chunk 0 of rank r segment r, chunk 1 segment 2p-1-r:
patches/vshape_hybrid.py). A pattern without `|` is split by megatron evenly over the ranks (or by
--decoder-first/last-pipeline-num-layers), one chunk per rank.
"""
from __future__ import annotations

ATTENTION, MLP, MOE, MAMBA, GDN, DSA, MLA = "*", "-", "E", "M", "G", "D", "+"
PIPE, MTP = "|", "/"
LAYER_NAMES = {ATTENTION: "attention", MLP: "MLP", MOE: "MoE", MAMBA: "Mamba", GDN: "gated delta net",
               DSA: "DeepSeek sparse attention", MLA: "multi-latent attention"}


def pattern_of(args) -> str | None:
    """The pattern the command line gives (megatron forwards the deprecated --hybrid-override-pattern to it)."""
    return getattr(args, "hybrid_layer_pattern", None) or getattr(args, "hybrid_override_pattern", None)


def main_pattern(pattern: str) -> str:
    """The decoder's part of the pattern, `|` included (what comes before the first `/`)."""
    return pattern.split(MTP)[0]


def segments(pattern: str) -> list[str]:
    """The decoder's pipeline segments, each as its layer characters."""
    return main_pattern(pattern).split(PIPE)


def decoder_layers(pattern: str) -> str:
    """The decoder's layer characters in order, without the `|`."""
    return main_pattern(pattern).replace(PIPE, "")


def mtp_depths(pattern: str) -> int:
    """Multi-token-prediction depths: the non-empty patterns after `/` (megatron's --mtp-num-layers)."""
    return sum(1 for part in pattern.split(MTP)[1:] if part)


def unknown_symbols(pattern: str) -> list[str]:
    """Characters of the pattern that name no layer and no separator, in order of appearance."""
    known = set(LAYER_NAMES) | {PIPE, MTP}
    return list(dict.fromkeys(char for char in pattern if char not in known))


def pattern_chunks(pattern: str, stages: int) -> int | None:
    """Model chunks per rank as megatron derives them (its virtual pipeline size): segments / p when there are more
    segments than ranks, else None (one chunk). ValueError when the segments do not divide into the ranks."""
    count = len(segments(pattern))
    if count == 1:
        return None
    if count % stages:
        raise ValueError(f"{count} segments do not divide into {stages} pipeline ranks")
    return count // stages if count > stages else None


def stage_layers(pattern: str, stages: int, first: int | None = None, last: int | None = None) -> list[str]:
    """The layer characters of every virtual stage, in virtual-stage order: the segments when the pattern has `|`;
    without, megatron's split over the `stages` ranks (--decoder-first/last-pipeline-num-layers, else even)."""
    parts = segments(pattern)
    if len(parts) > 1 or stages == 1:
        return parts
    layers = parts[0]
    if first is None and last is None:
        size = len(layers) // stages
        return [layers[r * size:(r + 1) * size] for r in range(stages)]
    inner = stages - (first is not None) - (last is not None)
    middle = (len(layers) - (first or 0) - (last or 0)) // inner if inner else 0
    sizes = [middle] * stages
    sizes[0] = middle if first is None else first
    sizes[-1] = middle if last is None else last
    starts = [sum(sizes[:r]) for r in range(stages)]
    return [layers[start:start + size] for start, size in zip(starts, sizes)]


def cut_evenly(pattern: str, parts: int) -> str | None:
    """The decoder's layers cut into `parts` equal segments with `|` (the MTP part kept), or None if they do not
    divide: the pattern a refusal suggests."""
    layers = decoder_layers(pattern)
    if not layers or len(layers) % parts:
        return None
    size = len(layers) // parts
    cut = PIPE.join(layers[i * size:(i + 1) * size] for i in range(parts))
    rest = pattern[len(main_pattern(pattern)):]
    return cut + rest
