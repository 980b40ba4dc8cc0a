"""Gradient buckets on every pipeline stage, as megatron DDP makes them on the first (--overlap-grad-reduce).

megatron-core 0.19's DistributedDataParallel cuts the gradients into buckets only on pipeline rank 0 and
gives every other stage one bucket: under 1F1B the other stages finish their backward passes earlier, so
their reduction is off the critical path. Under a zero-bubble schedule every stage ends its iteration
with W passes at about the same time, and a bucket can start its reduction while the remaining W passes
run (runtime/wgrad_store.py): one bucket would start only after the last. `install()` makes DDP decide
its bucketing as on the first stage, everywhere; the model chunks after the first keep the one bucket
megatron.training asks for (disable_bucketing). DDP reads its pipeline group for that decision alone, so
during its constructor the group it is given answers rank 0, and afterwards it holds the real one.
"""
from __future__ import annotations

from ._patching import MegatronPatch, PatchError, megatron_core_version, module_functions


class _AsFirstStage:
    """A pipeline group that answers rank 0 (DDP's constructor asks nothing else of it)."""

    def __init__(self, group):
        self.group = group

    def rank(self) -> int:
        return 0


class DdpBucketing(MegatronPatch):
    name = "ddp_bucketing"

    def apply(self) -> None:
        from megatron.core.distributed import DistributedDataParallel
        from megatron.core.process_groups_config import ProcessGroupCollection

        if not hasattr(ProcessGroupCollection, "setup_process_groups_for_ddp"):
            raise PatchError(f"patch 'ddp_bucketing': megatron-core {megatron_core_version()} has no "
                             f"ProcessGroupCollection.setup_process_groups_for_ddp; written for 0.19.x")
        setup = ProcessGroupCollection.setup_process_groups_for_ddp  # DDP's constructor is its only caller
        ddp_init = DistributedDataParallel.__init__

        def as_first_stage(*args, **kwargs):
            groups = dict(setup(*args, **kwargs))
            pp = groups["pp_group"]
            groups["pp_group"] = [_AsFirstStage(g) for g in pp] if isinstance(pp, list) else _AsFirstStage(pp)
            return groups

        def __init__(ddp, *args, **kwargs):
            ddp_init(ddp, *args, **kwargs)
            pp = ddp.pp_group  # the real group again, for anyone who reads it later
            ddp.pp_group = [g.group for g in pp] if isinstance(pp, list) else pp.group

        self.patches.replace(ProcessGroupCollection, "setup_process_groups_for_ddp", staticmethod(as_first_stage))
        self.patches.replace(DistributedDataParallel, "__init__", __init__)


install, uninstall, installed = module_functions(DdpBucketing())
