"""ZB-V layer placement for megatron-core: rank r holds virtual stage r as chunk 0 and 2p-1-r as chunk 1.

megatron-core 0.19.x only knows the interleaved placement (chunk k of rank r = virtual stage k*p + r).
`install(p)` makes it build and run the V placement with virtual pipeline size 2:

- layers: `get_transformer_layer_offset` (transformer_layer.py) and `get_num_layers_to_build`
  (transformer_block.py), at their source and at every binding already imported by name, give chunk k of
  rank r the layers of virtual stage `virtual_stage("v", p, r, k)`; global layer numbers are true depth,
  so checkpoint names and initialisation by global layer index match a PP=1 model. The 2p virtual stages
  hold L/(2p) layers each, or what megatron's uneven layouts say, read in virtual-stage order:
  `--pipeline-model-parallel-layout` with 2p stages (its i-th stage is the V's virtual stage i) and
  `--account-for-embedding-in-pipeline-split` / `--account-for-loss-in-pipeline-split` (the embedding and
  the loss count as a layer of the first and the last virtual stage, both on rank 0).
- stage roles: the first virtual stage is (rank 0, chunk 0), as in megatron; the last is (rank 0,
  chunk 1). So only "last" changes: `parallel_state.is_pipeline_last_stage` (all callers), and the
  bindings of `pipeline_parallel.utils.is_pp_last_stage` that mean "this rank holds the loss"
  (megatron.training.training: get_model's post_process, train_step's and evaluate's loss reduction;
  megatron.training.models.gpt), and training.training's `print_rank_last` (its log lines with the
  losses print on that rank of the global last rank's pipeline). The bindings used for p2p (p2p_communication, schedules, utils'
  get_pp_next_rank) keep the physical ring meaning.
- embeddings: both ends of the model live on rank 0, so the embedding group is [first pipeline rank]
  (`parallel_state.default_embedding_ranks`, read when the groups are created: install first). Tied
  embeddings keep two copies on rank 0 (chunk 0's embedding, chunk 1's output layer): get_model copies
  the first into the second (`tie_v_output_weights`) and finalize_model_grads sums their gradients
  (`sum_v_tied_embedding_grads`); `get_pp_last_rank` there (source of the num_tokens broadcast) is rank 0.
- Float16Module (fp16/bf16) upcasts the output of (rank 0, chunk 1), not of (rank p-1, chunk 1).

Every replacement falls back to megatron's function when the config or process group has one pipeline
stage (a PP=1 reference model can be built while installed) or after `uninstall()`.
"""
from __future__ import annotations

import importlib
import importlib.util
import sys

from ..schedules.costs import accounted_layer_counts
from ..schedules.schedule import stage_owner, virtual_stage
from . import imports
from ._patching import MegatronPatch, PatchError, module_functions

LAYOUT = "v"
CHUNKS = 2  # model chunks per rank under V
# Config options that place layers by rules the V cannot follow: "the first/last pipeline stage" is one rank
# of megatron's ring, but the V's first and last virtual stages are both on rank 0 (use a layout instead).
_CONFLICTING_OPTIONS = ("num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage", "mtp_num_layers")


# ---------------------------------------------------------------- the V rule (pure)


def v_stage_layer_counts(num_layers: int, stages: int, layout: list[int] | None = None, embedding: bool = False,
                         loss: bool = False) -> list[int]:
    """Transformer layers of each of the 2p virtual stages, in virtual-stage order: `layout` when given (one
    count per virtual stage), else an even split of L (+1 for the embedding, +1 for the loss when they count as
    layers, taken off the first and the last virtual stage)."""
    virtual_stages = CHUNKS * stages
    if layout is not None:
        if len(layout) != virtual_stages or sum(layout) != num_layers:
            raise PatchError(f"a V layout has {virtual_stages} virtual stages holding {num_layers} layers, got "
                             f"{len(layout)} stages holding {sum(layout)}")
        return list(layout)
    extra = int(embedding) + int(loss)
    total = num_layers + extra
    if total % virtual_stages:
        counted = f" + {extra} (embedding and loss counted as layers)" if extra else ""
        raise PatchError(
            f"ZB-V splits the model into 2p = {virtual_stages} virtual stages (p={stages}), but num_layers = "
            f"{num_layers}{counted} is not a multiple of {virtual_stages} ({total} % {virtual_stages} = "
            f"{total % virtual_stages}); choose a num_layers that splits evenly, or lay the layers out with "
            f"pipeline_model_parallel_layout"
        )
    return accounted_layer_counts(num_layers, virtual_stages, embedding, loss)  # the rule training's checks use


def v_layer_range(num_layers: int, stages: int, rank: int, chunk: int, counts: list[int] | None = None) -> range:
    """Global 0-based indices of the transformer layers held by (rank, chunk) under V.

    The model is cut into 2p virtual stages (`counts` layers each, default L/(2p)); (rank, chunk) holds
    virtual stage `virtual_stage("v", p, rank, chunk)`, i.e. r for chunk 0 and 2p-1-r for chunk 1.
    """
    if stages < 1:
        raise PatchError(f"ZB-V needs at least one pipeline stage, got p={stages}")
    if not 0 <= rank < stages:
        raise PatchError(f"pipeline rank {rank} is outside 0..{stages - 1} for p={stages}")
    if chunk not in range(CHUNKS):
        raise PatchError(f"ZB-V has model chunks 0 and 1 on each rank, got chunk {chunk}")
    counts = v_stage_layer_counts(num_layers, stages) if counts is None else counts
    vstage = virtual_stage(LAYOUT, stages, rank, chunk)
    start = sum(counts[:vstage])
    return range(start, start + counts[vstage])


def layout_layer_counts(layout) -> list[int]:
    """Decoder layers per stage of megatron's PipelineParallelLayerLayout, in pipeline order (its i-th stage)."""
    from megatron.core.transformer.enums import LayerType

    p, v = layout.pipeline_model_parallel_size, layout.virtual_pipeline_model_parallel_size
    return [layout.layout[i % p][i // p].count(LayerType.decoder) for i in range(p * v)]


def v_first_stage_owner(stages: int) -> tuple[int, int]:
    """(rank, chunk) holding the embedding: (0, 0)."""
    return stage_owner(LAYOUT, stages, 0)


def v_last_stage_owner(stages: int) -> tuple[int, int]:
    """(rank, chunk) holding final norm, output layer and loss: (0, 1)."""
    return stage_owner(LAYOUT, stages, CHUNKS * stages - 1)


def v_embedding_ranks(pp_ranks: list[int]) -> list[int]:
    """Global ranks holding word embeddings (first and last virtual stage) in one pipeline: [pp_ranks[0]].

    Pass as `get_embedding_ranks` to `initialize_model_parallel` (the installed patch does it by default).
    """
    stages = len(pp_ranks)
    if stages == 1:
        return [pp_ranks[0]]
    owners = sorted({v_first_stage_owner(stages)[0], v_last_stage_owner(stages)[0]})
    return [pp_ranks[rank] for rank in owners]


# ---------------------------------------------------------------- tied embeddings on rank 0 (torch)


def _tied_pair(model_chunks):
    """(chunk 0's embedding weight, chunk 1's output weight) if this rank holds both ends with tied
    embeddings and separate weights, else None."""
    from megatron.core.utils import get_attr_wrapped_model

    if not isinstance(model_chunks, (list, tuple)) or len(model_chunks) != CHUNKS:
        return None
    first, last = (get_attr_wrapped_model(c, "pre_process", return_model_obj=True) for c in model_chunks)
    if not (first.pre_process and last.post_process and not last.pre_process):
        return None
    if not getattr(last, "share_embeddings_and_output_weights", False):
        return None
    return first.shared_embedding_or_output_weight(), last.shared_embedding_or_output_weight()


def tie_v_output_weights(model_chunks) -> bool:
    """Copy chunk 0's word embedding into chunk 1's output layer on the rank holding both (tied
    embeddings; megatron zeroes that copy and expects a cross-rank all-reduce). True if copied."""
    import torch

    pair = _tied_pair(model_chunks)
    if pair is None:
        return False
    with torch.no_grad():
        pair[1].data.copy_(pair[0].data)
    return True


def sum_v_tied_embedding_grads(model_chunks) -> bool:
    """Give both copies of a tied embedding the sum of their gradients (main_grad under megatron DDP),
    as megatron's first/last-stage all-reduce does across ranks. True if summed."""
    pair = _tied_pair(model_chunks)
    if pair is None:
        return False
    attr = "main_grad" if hasattr(pair[0], "main_grad") else "grad"
    grads = [getattr(weight, attr, None) for weight in pair]
    if any(g is None for g in grads):
        return False
    total = grads[0] + grads[1]
    for grad in grads:
        grad.copy_(total)
    return True


# ---------------------------------------------------------------- the patch


class VShapePlacement(MegatronPatch):
    """Installed with p (`install(stages)`); the replacements below consult `self.stages`."""

    name = "vshape_layout"

    def __init__(self):
        super().__init__()
        # megatron's functions replaced everywhere, kept for bindings made while installed (see below)
        self._originals: dict[str, object] = {}

    @property
    def stages(self) -> int | None:
        """p while installed, else None."""
        return self.options[0] if self.options is not None else None

    def install(self, stages: int) -> None:
        if not isinstance(stages, int) or stages < 2:
            raise PatchError(f"the V placement needs a pipeline of at least 2 ranks, got p={stages!r}")
        super().install(stages)

    def apply(self, stages: int) -> None:
        imports.ensure_installed()  # megatron.core must import without triton
        parallel_state = importlib.import_module("megatron.core.parallel_state")
        self._refuse_existing_embedding_group(parallel_state)
        layer = importlib.import_module("megatron.core.transformer.transformer_layer")
        block = importlib.import_module("megatron.core.transformer.transformer_block")
        finalize = importlib.import_module("megatron.core.distributed.finalize_model_grads")
        float16_module = importlib.import_module("megatron.core.transformer.module").Float16Module
        loss_holders = self._training_loss_holders()

        patches = self.patches
        for source, attr, new in ((layer, "get_transformer_layer_offset", self.get_transformer_layer_offset),
                                  (block, "get_num_layers_to_build", self.get_num_layers_to_build),
                                  (parallel_state, "is_pipeline_last_stage", self.is_pipeline_last_stage),
                                  (parallel_state, "default_embedding_ranks", self.default_embedding_ranks)):
            self._originals[attr] = patches.replace_everywhere(source, attr, new)
        patches.replace(finalize, "get_pp_last_rank", self.get_pp_last_rank)
        patches.replace(finalize, "_allreduce_word_embedding_grads", self.allreduce_word_embedding_grads)
        patches.replace(float16_module, "forward", self._float16_forward(float16_module.forward))
        for module in loss_holders:
            patches.replace(module, "is_pp_last_stage", self.is_pp_last_stage)
        if loss_holders:
            self._originals["get_model"] = patches.replace_everywhere(loss_holders[0], "get_model", self.get_model)
            patches.replace(loss_holders[0], "print_rank_last", self.print_rank_last)

    @staticmethod
    def _training_loss_holders() -> list:
        """megatron.training modules whose `is_pp_last_stage` means "holds the loss", training.training
        (with get_model) first; imported now so that their by-name bindings exist to be patched."""
        if importlib.util.find_spec("megatron.training") is None:
            return []
        names = ("megatron.training.training", "megatron.training.models.gpt")
        return [importlib.import_module(name) for name in names]

    @staticmethod
    def _refuse_existing_embedding_group(parallel_state) -> None:
        # The embedding group is made from default_embedding_ranks when the groups are created; every
        # rank refuses (a middle rank cannot see the group of the ends), so all ranks agree.
        if parallel_state.model_parallel_is_initialized() and (
            parallel_state.get_pipeline_model_parallel_world_size() > 1
        ):
            raise PatchError(
                "megatron's pipeline groups already exist; install the V placement patch before "
                "initialize_model_parallel, whose embedding group must hold only the first pipeline rank "
                "(both ends of the V live there)"
            )

    # -- checks shared by the replacements

    def _applies_to_config(self, config) -> bool:
        """Whether V places this config's layers; PatchError for configs V cannot build."""
        size = config.pipeline_model_parallel_size
        if not self.installed or size == 1:
            return False
        self._check_pipeline_size(size)
        if config.virtual_pipeline_model_parallel_size != CHUNKS:
            raise PatchError(
                f"ZB-V needs virtual_pipeline_model_parallel_size={CHUNKS} (two chunks per rank), "
                f"got {config.virtual_pipeline_model_parallel_size}"
            )
        for option in _CONFLICTING_OPTIONS:
            if getattr(config, option, None):
                raise PatchError(f"the V placement does not support {option}={getattr(config, option)!r}")
        return True

    def _check_pipeline_size(self, size: int) -> None:
        if size != self.stages:
            raise PatchError(
                f"the V placement patch was installed for p={self.stages} pipeline ranks, "
                f"but megatron runs with pipeline_model_parallel_size={size}"
            )

    def _chunk_layers(self, config, vp_stage, pp_rank) -> range:
        if vp_stage is None:
            raise PatchError("under the V placement every model chunk must be built with vp_stage 0 or 1")
        if pp_rank is None:
            from megatron.core import parallel_state

            pp_rank = parallel_state.get_pipeline_model_parallel_rank()
        layout = config.pipeline_model_parallel_layout
        counts = v_stage_layer_counts(
            config.num_layers, self.stages, layout_layer_counts(layout) if layout is not None else None,
            config.account_for_embedding_in_pipeline_split, config.account_for_loss_in_pipeline_split)
        return v_layer_range(config.num_layers, self.stages, pp_rank, vp_stage, counts)

    # -- replacements (signatures as in megatron-core 0.19.2)

    def get_transformer_layer_offset(self, config, vp_stage=None, pp_rank=None):
        if not self._applies_to_config(config):
            return self._originals["get_transformer_layer_offset"](config, vp_stage, pp_rank)
        return self._chunk_layers(config, vp_stage, pp_rank).start

    def get_num_layers_to_build(self, config, vp_stage=None, pp_rank=None) -> int:
        if not self._applies_to_config(config):
            return self._originals["get_num_layers_to_build"](config, vp_stage, pp_rank)
        # chunk 0 stands in when the caller has no vp_stage
        return len(self._chunk_layers(config, 0 if vp_stage is None else vp_stage, pp_rank))

    def is_pipeline_last_stage(self, ignore_virtual=True, vp_stage=None) -> bool:
        from megatron.core import parallel_state

        size = parallel_state.get_pipeline_model_parallel_world_size()
        if not self.installed or size == 1:
            return self._originals["is_pipeline_last_stage"](ignore_virtual=ignore_virtual, vp_stage=vp_stage)
        self._check_pipeline_size(size)
        rank = parallel_state.get_pipeline_model_parallel_rank()
        last_rank, last_chunk = v_last_stage_owner(self.stages)
        if ignore_virtual:
            return rank == last_rank  # "this rank holds the last stage" (data loading, loss)
        vp_size = parallel_state.get_virtual_pipeline_model_parallel_world_size()
        if vp_size != CHUNKS or vp_stage is None:
            raise PatchError(
                f"under the V placement is_pipeline_last_stage(ignore_virtual=False) needs virtual pipeline "
                f"size {CHUNKS} and a vp_stage, got size {vp_size} and vp_stage {vp_stage}"
            )
        return (rank, vp_stage) == (last_rank, last_chunk)

    def is_pp_last_stage(self, pp_group) -> bool:
        """Binding used where megatron asks whether this rank holds the loss."""
        from megatron.core.utils import get_pg_rank, get_pg_size

        size = get_pg_size(pp_group)
        if not self.installed or size == 1:
            from megatron.core.pipeline_parallel import utils

            return utils.is_pp_last_stage(pp_group)  # the source is never replaced
        self._check_pipeline_size(size)
        return get_pg_rank(pp_group) == v_last_stage_owner(self.stages)[0]

    def print_rank_last(self, message) -> None:
        """megatron.training.training's log lines (losses included) print on the global last rank, whose
        pipeline rank holds no loss under V: print on the rank of that pipeline holding the V's last stage."""
        import torch
        from megatron.core import parallel_state
        from megatron.training.utils import print_rank_last

        if not self.installed or not torch.distributed.is_initialized() or (
                parallel_state.get_pipeline_model_parallel_world_size() == 1):
            return print_rank_last(message)
        ranks = torch.distributed.get_process_group_ranks(parallel_state.get_pipeline_model_parallel_group())
        if torch.distributed.get_world_size() - 1 in ranks and (
                torch.distributed.get_rank() == ranks[v_last_stage_owner(self.stages)[0]]):
            print(message, flush=True)

    def get_pp_last_rank(self, pp_group) -> int:
        import torch

        ranks = torch.distributed.get_process_group_ranks(pp_group)
        if not self.installed or len(ranks) == 1:
            from megatron.core.pipeline_parallel import utils

            return utils.get_pp_last_rank(pp_group)
        self._check_pipeline_size(len(ranks))
        return ranks[v_last_stage_owner(self.stages)[0]]

    def default_embedding_ranks(self, pp_ranks):
        if not self.installed:
            return self._originals["default_embedding_ranks"](pp_ranks)
        if len(pp_ranks) > 1:
            self._check_pipeline_size(len(pp_ranks))
        return v_embedding_ranks(pp_ranks)

    def allreduce_word_embedding_grads(self, model, config, embd_group=None, pp_group=None):
        finalize = sys.modules["megatron.core.distributed.finalize_model_grads"]  # the package hides it
        self.patches.original(finalize, "_allreduce_word_embedding_grads")(model, config, embd_group, pp_group)
        if self.installed:
            sum_v_tied_embedding_grads(model)

    def get_model(self, *args, **kwargs):
        model = self._originals["get_model"](*args, **kwargs)
        if self.installed:
            tie_v_output_weights(model if isinstance(model, list) else [model])
        return model

    def _float16_forward(self, original):
        """Float16Module.forward with the fp32 upcast on the V last stage instead of (p-1, chunk 1)."""
        placement = self

        def forward(module, *inputs, fp32_output=True, **kwargs):
            if not placement.installed or module.vp_size is None:
                return original(module, *inputs, fp32_output=fp32_output, **kwargs)
            from megatron.core import parallel_state
            from megatron.core.transformer.module import float16_to_fp32
            from megatron.core.utils import get_pg_rank, get_pg_size

            pp_group = module.pg_collection.pp if module.pg_collection is not None else (
                parallel_state.get_pipeline_model_parallel_group())
            if get_pg_size(pp_group) == 1:
                return original(module, *inputs, fp32_output=fp32_output, **kwargs)
            # Inputs are cast on (rank 0, chunk 0) as megatron does; only the upcast moves.
            outputs = original(module, *inputs, fp32_output=False, **kwargs)
            if fp32_output and (get_pg_rank(pp_group), module.vp_stage) == v_last_stage_owner(placement.stages):
                outputs = float16_to_fp32(outputs)
            return outputs

        return forward


install, uninstall, installed = module_functions(VShapePlacement())
