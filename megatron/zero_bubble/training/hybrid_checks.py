"""Start-up checks of --hybrid-layer-pattern (pretrain_hybrid.py), each refusal one line naming the flag and the fix.

- `check_entry_model`: the pattern goes with pretrain_hybrid.py, and pretrain_hybrid.py needs one.
- `check_pattern`: what megatron-core 0.19.2 would stop on later with an assert or a stack trace (unknown layer
  characters, segments that do not divide into the ranks, megatron's other layout flags beside the `|`), refused
  before megatron is imported too.
- `check_schedule_chunks`: the chunks per rank the `|` segments give must be the chosen schedule's (a V needs 2p
  segments in V order, zb-h1 one segment per rank, interleaved 1F1B two or more).
- `check_layers`: the layer kinds the machine and the layer implementation can build (Mamba and GDN run CUDA
  kernels; megatron builds them, DSA, MLA and the hybrid MTP block from Transformer Engine's modules only).
"""
from __future__ import annotations

import importlib.util

from ..schedules.planners import accepts_chunks, layout_of, multi_chunk_schedules
from .flags import PIPELINE_SCHEDULES, StartupRefusal
from .hybrid_pattern import (ATTENTION, DSA, GDN, LAYER_NAMES, MAMBA, MLA, MOE, MTP, PIPE, cut_evenly, decoder_layers,
                             main_pattern, mtp_depths, pattern_of, segments, unknown_symbols)

GPT, HYBRID = "gpt", "hybrid"  # the model an entry script builds
ENTRY_SCRIPTS = {GPT: "pretrain_gpt.py", HYBRID: "pretrain_hybrid.py"}
FLAG = "--hybrid-layer-pattern"
# megatron's layout flags that the pattern's `|` replace (megatron asserts on each beside a pattern)
_LAID_OUT_BY_PIPES = ("num_layers_per_virtual_pipeline_stage", "num_virtual_stages_per_pipeline_rank",
                      "pipeline_model_parallel_layout", "account_for_embedding_in_pipeline_split",
                      "account_for_loss_in_pipeline_split", "allow_padding_num_layers")
# layer kinds that run CUDA kernels of another package: (its import name, what to install)
_CUDA_KERNELS = {MAMBA: ("mamba_ssm", "mamba-ssm and causal-conv1d"), GDN: ("fla", "flash-linear-attention")}
_LOCAL_KINDS = (ATTENTION, "-", MOE)  # what pretrain_hybrid.py's spec of megatron's local layers builds


def _quoted(pattern: str) -> str:
    return f"'{pattern}'"


def check_entry_model(args, model: str) -> None:
    """A hybrid pattern only with pretrain_hybrid.py, and pretrain_hybrid.py only with one."""
    pattern = pattern_of(args)
    if model == GPT and pattern is not None:
        raise StartupRefusal(f"{FLAG} describes a hybrid model (megatron's HybridModel), which pretrain_gpt.py does "
                             f"not build; launch pretrain_hybrid.py with the same flags")
    if model == HYBRID and not pattern:
        raise StartupRefusal(f"pretrain_hybrid.py builds its layers from {FLAG}; give one, e.g. {FLAG} '*-*-|*-*-' "
                             f"(attention *, MLP -, MoE E, Mamba M, GDN G; | separates pipeline stages)")


def normalize(args) -> None:
    """What megatron derives from the pattern in its validation, set early so that every check reads it: the layer
    count (--num-layers) and the multi-token-prediction depths (--mtp-num-layers)."""
    pattern = pattern_of(args)
    if pattern:
        args.num_layers = len(decoder_layers(pattern))
        if mtp_depths(pattern) and hasattr(args, "mtp_num_layers"):
            args.mtp_num_layers = mtp_depths(pattern)


def check_pattern(args) -> None:
    """Refuse a pattern megatron would stop on later (StartupRefusal); nothing without a pattern."""
    pattern = pattern_of(args)
    if not pattern:
        return
    unknown = unknown_symbols(pattern)
    if unknown:
        known = " ".join(f"{char} ({name})" for char, name in LAYER_NAMES.items())
        raise StartupRefusal(f"{FLAG} {_quoted(pattern)}: {', '.join(map(repr, unknown))} names no layer; use "
                             f"{known}, | between pipeline stages and / before multi-token-prediction layers")
    if ATTENTION in pattern and (DSA in pattern or MLA in pattern):
        raise StartupRefusal(f"{FLAG} {_quoted(pattern)} mixes attention * with MLA + / DSA D, which megatron "
                             f"does not build in one model; keep one kind of attention")
    mtp = [part for part in pattern.split(MTP)[1:] if part]
    if len(set(mtp)) > 1 or PIPE in "".join(mtp):
        raise StartupRefusal(f"{FLAG} {_quoted(pattern)}: the multi-token-prediction patterns after / must be one "
                             f"and the same pattern per depth, without |")
    for name in _LAID_OUT_BY_PIPES:
        if getattr(args, name, None):
            option = "--" + name.replace("_", "-")
            raise StartupRefusal(f"{option} does not work with {FLAG}: the pattern lays the pipeline stages out "
                                 f"with |; drop {option} and cut the pattern where the stages should end")
    _check_segments(args, pattern)


def _check_segments(args, pattern: str) -> None:
    p, parts = args.pipeline_model_parallel_size, segments(pattern)
    first, last = args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers
    if len(parts) > 1 and (first is not None or last is not None):
        raise StartupRefusal(f"--decoder-first/last-pipeline-num-layers does not work with a {FLAG} cut by |: the "
                             f"cuts lay the stages out; drop the flag or the cuts")
    if len(parts) > 1 and len(parts) % p:
        raise StartupRefusal(f"{FLAG} {_quoted(pattern)} has {len(parts)} segments, which do not divide into "
                             f"--pipeline-model-parallel-size {p}; cut it into {p} segments (one per rank) or a "
                             f"multiple of {p} (that many model chunks per rank)")
    layers = len(parts[0])
    if len(parts) == 1 and p > 1 and first is None and last is None and layers % p:
        raise StartupRefusal(f"{FLAG} {_quoted(pattern)} has {layers} layers and no |, which megatron splits evenly "
                             f"over --pipeline-model-parallel-size {p}; mark where each of the {p} stages ends with "
                             f"| (stages may differ in size)")


def check_schedule_chunks(args, schedule: str, flag: str) -> None:
    """The chunks per rank of the pattern's segments must be the ones `schedule` runs (StartupRefusal)."""
    pattern = pattern_of(args)
    if not pattern:
        return
    p, parts = args.pipeline_model_parallel_size, segments(pattern)
    chunks = len(parts) // p if len(parts) > p else 1
    if layout_of(schedule) == "v":
        if mtp_depths(pattern):
            raise StartupRefusal(f"{flag} does not place the multi-token-prediction layers after / in {FLAG} "
                                 f"{_quoted(pattern)} (megatron puts them on its interleaved last stage); drop the "
                                 f"/ part or use another schedule")
        if len(parts) != 2 * p:
            raise StartupRefusal(f"{flag} places 2p = {2 * p} virtual stages in V order (rank r holds segments r "
                                 f"and {2 * p - 1}-r), but {FLAG} {_quoted(pattern)} has {len(parts)} segment"
                                 f"{'s' if len(parts) > 1 else ''}; {_cut_into(pattern, 2 * p)}")
        return
    if accepts_chunks(schedule, chunks):
        return
    if chunks == 1:
        raise StartupRefusal(f"{flag} needs two or more model chunks per rank, which {FLAG} gives by its segments; "
                             f"{_cut_into(pattern, 2 * p)} (or any multiple of {p} above {p})")
    multi = " / ".join(name for name in multi_chunk_schedules() if name in PIPELINE_SCHEDULES)
    raise StartupRefusal(f"{flag} runs one model chunk per rank, but the {len(parts)} segments of {FLAG} "
                         f"{_quoted(pattern)} give {chunks} per rank at --pipeline-model-parallel-size {p}; "
                         f"{_cut_into(pattern, p)}, or use --pipeline-schedule {multi}")


def _cut_into(pattern: str, parts: int) -> str:
    suggestion = cut_evenly(pattern, parts)
    how = f" (evenly: {_quoted(suggestion)})" if suggestion else ""
    return f"cut it into {parts} segments with |{how}"


def check_layers(args, cuda: bool, installed=lambda name: importlib.util.find_spec(name) is not None) -> None:
    """The pattern's layer kinds against the machine (`cuda`), the layer implementation and the packages their
    kernels need (`installed(import name)`); --num-experts against the MoE layers."""
    pattern = pattern_of(args)
    if not pattern:
        return
    kinds = set(main_pattern(pattern) + "".join(pattern.split(MTP)[1:])) - {PIPE}
    for kind in (MAMBA, GDN):
        if kind in kinds and not cuda:
            package, install = _CUDA_KERNELS[kind]
            raise StartupRefusal(f"{FLAG} {_quoted(pattern)}: {kind} ({LAYER_NAMES[kind]}) layers need CUDA "
                                 f"(megatron's layer runs {install}'s GPU kernels); on CPU use * (attention), - (MLP) "
                                 f"and E (MoE) layers, or train this pattern on GPUs")
    local = args.transformer_impl == "local" and getattr(args, "spec", None) is None
    beyond_local = sorted(kinds - set(_LOCAL_KINDS), key="".join(LAYER_NAMES).find)
    if local and (beyond_local or mtp_depths(pattern)):
        what = ", ".join(f"{kind} ({LAYER_NAMES[kind]})" for kind in beyond_local) or "/ (multi-token prediction)"
        fix = "--transformer-impl transformer_engine on GPUs" if cuda else "* (attention), - (MLP) and E (MoE) layers"
        raise StartupRefusal(f"{FLAG} {_quoted(pattern)}: megatron builds {what} from Transformer Engine's modules "
                             f"only, and pretrain_hybrid.py's spec of megatron's local layers has *, - and E; use "
                             f"{fix}")
    for kind in (MAMBA, GDN):
        package, install = _CUDA_KERNELS[kind]
        if kind in kinds and not installed(package):
            raise StartupRefusal(f"{FLAG} {_quoted(pattern)}: {kind} ({LAYER_NAMES[kind]}) layers need {install}, "
                                 f"which is not installed; pip install {install.replace(' and ', ' ')}")
    if MOE in kinds and not args.num_experts:
        raise StartupRefusal(f"{FLAG} {_quoted(pattern)} has MoE layers E; give their experts with --num-experts")
    if args.num_experts and MOE not in kinds:
        raise StartupRefusal(f"--num-experts configures the MoE layers E of {FLAG}, and {_quoted(pattern)} has "
                             f"none; add E layers or drop --num-experts")
