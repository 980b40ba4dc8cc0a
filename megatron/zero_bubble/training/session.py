"""One object for what a zero-bubble run installs into megatron-core, and takes out again.

    with ZeroBubbleSession(schedule_for=plans, v_stages=None, bucket_every_stage=False) as session:
        ...  # megatron's get_forward_backward_func now hands out session.pipeline
        session.start_post_validation(optimizer, model, exact=True)  # once the optimizer exists, if wanted

The session builds what runs with what it needs, as constructor arguments: the adapter to megatron-core
(patches/megatron_adapter.py, version-checked), then a PipelineExecutor for fixed plans (`schedule_for`) or a
ReplanningPipeline that plans on rank 0, measures and re-plans (`plan_settings`, training). Installed in this
order (V placement first: it must be in place before megatron makes its process groups), removed in the
reverse order, also when an install fails half way. `training/setup.py` builds one from the command line;
tests and tools build one around plans of their own.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable


@dataclass
class ZeroBubbleSession:
    schedule_for: Callable | None = None  # m -> Schedule: fixed plans (tests, tools)
    plan_settings: object = None  # runtime.replan.PlanSettings: plan, measure, re-plan (training)
    v_stages: int | None = None  # ZB-V: place the V-shaped layers for this many pipeline ranks
    bucket_every_stage: bool = False  # megatron DDP buckets every stage's gradients (overlapped reduction)
    observer: Callable | None = None  # iteration.PassObserver of every pass (fixed plans)
    current_iteration: Callable[[], int] | None = None  # megatron's iteration counter (re-planning)
    log: Callable[[str], None] = print  # one line on rank 0 (re-planning)
    te_layer_types: tuple | None = None  # Transformer Engine classes to split (None: TE's own; tests: a stand-in's)
    split_check: bool = False  # fused against split on the real layers before the first training call (split_check.py)
    messaging: object = None  # runtime.messaging.MessagingOptions: how batches are posted, the watchdog, faults
    pipeline: object = field(default=None, init=False)  # what get_forward_backward_func hands out; None: megatron's
    megatron: object = field(default=None, init=False)  # the adapter, once installed
    _installed: list = field(default_factory=list, init=False, repr=False)

    def __post_init__(self):
        if self.schedule_for is not None and self.plan_settings is not None:
            raise ValueError("ZeroBubbleSession: give schedule_for (fixed plans) or plan_settings (re-planning), not both")

    def install(self) -> "ZeroBubbleSession":
        from ..patches import ddp_bucketing, schedule_selection, vshape_hybrid, vshape_layout
        from ..patches.megatron_adapter import MegatronAdapter

        try:
            if self.v_stages is not None:
                self._install(vshape_layout, self.v_stages)
                self._install(vshape_hybrid, self.v_stages)  # a hybrid model's pattern segments in V order
            if self.bucket_every_stage:
                self._install(ddp_bucketing)
            self.megatron = MegatronAdapter(te_layer_types=self.te_layer_types)
            self.pipeline = self._build_pipeline()
            if self.pipeline is not None:
                self._install(schedule_selection, self.pipeline)
        except BaseException:
            self.close()
            raise
        return self

    def _build_pipeline(self):
        from ..runtime.split_check import SplitCheck

        faults = getattr(self.messaging, "faults", ())
        check = SplitCheck(self.log, faults=faults) if self.split_check else None
        if self.schedule_for is not None:
            from ..runtime.executor import PipelineExecutor

            return PipelineExecutor(self.schedule_for, self.megatron, observer=self.observer, split_check=check,
                                    messaging=self.messaging)
        if self.plan_settings is not None:
            from ..runtime.replan import ReplanningPipeline

            return ReplanningPipeline(self.plan_settings, self.current_iteration, self.megatron, log=self.log,
                                      split_check=check, messaging=self.messaging)
        return None

    def on_optimizer_built(self, attach: Callable) -> None:
        """megatron.training: call `attach(model, optimizer, scheduler)` once setup_model_and_optimizer built
        them (and validate a pending step before checkpoints and at the end of training)."""
        from ..patches import post_validation_training

        self._install(post_validation_training, attach)

    def start_post_validation(self, optimizer, model, **options):
        """The optimizer's step goes through a PostValidation (options: exact, scheduler, layout, chunks); the
        executor runs its S and V passes. Returns the controller."""
        from ..patches import optimizer_step
        from ..runtime.post_validation import PostValidation

        chunks = list(model)
        config = self.megatron.model_config(chunks[0])
        check_no_pipeline_group_collectives(config)
        if config.calculate_per_token_loss:
            options["model_chunks"] = chunks  # the S pass divides by the token count (post_validation.py)
        controller = PostValidation.for_optimizer(optimizer, self.megatron, **options)
        self._install(optimizer_step, controller, model)
        self.executor.attach_post_validation(controller)
        return controller

    @property
    def executor(self):
        return getattr(self.pipeline, "executor", self.pipeline)

    def close(self) -> None:
        """Everything installed, removed last-in first-out; the pipeline lets go of the layers and buffers."""
        if self.pipeline is not None:
            self.pipeline.close()
        while self._installed:
            self._installed.pop().uninstall()

    def _install(self, patch_module, *options) -> None:
        patch_module.install(*options)
        if patch_module not in self._installed:
            self._installed.append(patch_module)

    def __enter__(self) -> "ZeroBubbleSession":
        return self.install()

    def __exit__(self, *exc) -> None:
        self.close()


# TransformerConfig attributes (set by models built on megatron, not by its flags) with which megatron's
# finalize_model_grads all-reduces gradients over the pipeline group: replicated conditional embedders (diffusion
# models), Flextron's router.
PIPELINE_GROUP_REDUCTIONS = ("has_cond_embedder", "flextron")


def check_no_pipeline_group_collectives(config) -> None:
    """Post-validation runs finalize_model_grads inside its S pass, between the pipeline's batches, whose stream an
    all-reduce over the pipeline group shares on NCCL: rank r's stream can hold [a batch receiving from r-1, the
    all-reduce] while r-1's holds [the all-reduce, the batch sending to r], which wait on each other. Refused."""
    if getattr(config, "pipeline_model_parallel_size", 1) <= 1:
        return
    for name in PIPELINE_GROUP_REDUCTIONS:
        if getattr(config, name, False):
            raise ValueError(f"optimizer post-validation does not work with config.{name}: megatron's "
                             f"finalize_model_grads then all-reduces over the pipeline group inside the S pass, "
                             f"between pipeline messages it could wait on in a cycle; drop "
                             f"--enable-optimizer-post-validation")
