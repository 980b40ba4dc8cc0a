"""Everything the runtime uses of megatron-core, in one object: `MegatronAdapter` (checked for 0.19.x).

The runtime (`runtime/`) imports nothing of megatron: the session builds one adapter and hands it to the
executor, the re-planning pipeline and the post-validation controller as a constructor argument. Building it
checks the installed megatron-core version and that every function and method the adapter calls exists, so
a release that moved one fails at start-up with one line naming it, not deep inside a training step.
"""
from __future__ import annotations

import contextlib

from types import SimpleNamespace

from ._patching import PatchError, check_megatron_core_version, megatron_core_version

# (module, names) the adapter calls; checked when it is built
_REQUIRED = {
    "megatron.core.pipeline_parallel.schedules": (
        "forward_step", "backward_step", "check_first_val_step", "deallocate_output_tensor", "get_tensor_shapes",
        "_build_default_pg_collection", "_get_moe_loss_scale"),
    "megatron.core.tensor_parallel.random": ("get_cuda_rng_tracker",),
    "megatron.core.tensor_parallel.layers": ("ColumnParallelLinear", "RowParallelLinear"),
    "megatron.core.optimizer.clip_grads": ("multi_tensor_applier", "l2_norm_impl", "clip_grad_by_total_norm_fp32"),
    "megatron.core.utils": ("get_model_config",),
    "megatron.core.parallel_state": (
        "get_pipeline_model_parallel_group", "get_tensor_model_parallel_group",
        "get_tensor_and_data_parallel_group", "get_expert_tensor_and_model_parallel_group",
        "get_data_parallel_group"),
    "megatron.core.transformer.moe.moe_logging": ("get_moe_metrics_tracker",),
    "megatron.core.transformer.moe.router": ("MoEAuxLossAutoScaler",),
    "megatron.core.transformer.multi_token_prediction": ("MTPLossLoggingHelper",),
}
# The per-layer sums megatron's multi-token-prediction layers add to at each training forward (for the log).
MTP_TRACKED = ("loss_values", "correct_values", "total_values")

# What an MoE router's training forward adds to, and megatron zeroes after the iteration's last backward
# (finalize_model_grads: reset_model_temporary_tensors): tokens per expert for the expert-bias update, the
# global aux loss's tokens and steps, quantile balancing's per-microbatch quantiles.
ROUTER_ACCUMULATORS = ("local_tokens_per_expert", "global_tokens_per_expert", "ga_steps", "qb_beta_accum",
                       "qb_beta_count")


def _modules() -> SimpleNamespace:
    import importlib

    loaded = {}
    for path, names in _REQUIRED.items():
        module = importlib.import_module(path)
        missing = [name for name in names if not hasattr(module, name)]
        if missing:
            raise PatchError(f"megatron-core {megatron_core_version()}: {path} has no {', '.join(missing)}; the "
                             f"zero-bubble runtime was written for 0.19.x")
        loaded[path.rsplit(".", 1)[1]] = module
    return SimpleNamespace(**loaded)


class MegatronAdapter:
    """megatron-core as the runtime sees it (see the module docstring).

    te_layer_types: the Transformer Engine module classes whose weight gradients are split through their own
    deferral (patches/te_wgrad.py); None: those of the TE megatron imported, version-checked (tests hand a
    stand-in's classes, unchecked)."""

    def __init__(self, te_layer_types: tuple | None = None):
        check_megatron_core_version()
        self._m = _modules()
        self._te_layer_types = te_layer_types

    # -- one pipeline pass, as megatron's own schedules run it ------------------------------------------
    def model_config(self, chunk):
        return self._m.utils.get_model_config(chunk)

    def default_pg_collection(self):
        """The process groups megatron's pipeline schedules use when the caller passes none."""
        return self._m.schedules._build_default_pg_collection()

    def pipeline_tensor_shape(self, config, pg_collection, seq_length: int, micro_batch_size: int,
                              decoder_seq_length: int | None = None) -> tuple[int, ...]:
        """The shape of the activations and gradients that travel between stages, as megatron makes it."""
        return tuple(self._m.schedules.get_tensor_shapes(
            seq_length=seq_length, micro_batch_size=micro_batch_size, decoder_seq_length=decoder_seq_length,
            config=config, tp_group=pg_collection.tp, cp_group=pg_collection.cp,
        )[0])

    def forward_step(self, run, chunk: int, microbatch: int, input_tensor, first_of_chunk: bool,
                     is_last_stage: bool):
        """megatron's forward_step for one microbatch of one chunk; `run` holds the call's arguments
        (megatron_passes.MegatronRun). Returns (output, number of tokens)."""
        schedules = self._m.schedules
        return schedules.forward_step(
            run.forward_step_func, run.iterators[chunk], run.chunks[chunk], run.num_microbatches, input_tensor,
            run.forward_data_store, run.config, cp_group_size=run.cp_size,
            collect_non_loss_data=run.collect_non_loss_data,
            is_first_microbatch=schedules.check_first_val_step(run.first_val_step, run.forward_only, first_of_chunk),
            current_microbatch=microbatch, vp_stage=chunk if len(run.chunks) > 1 else None,
            is_last_stage=is_last_stage,
        )

    def backward_step(self, input_tensor, output, output_grad, config):
        return self._m.schedules.backward_step(input_tensor, output, output_grad, config)

    def free_output(self, output, config) -> None:
        """What megatron does to a stage's output once it has been sent (keeps its grad_fn, drops the data)."""
        self._m.schedules.deallocate_output_tensor(output, config.deallocate_pipeline_outputs)

    # -- megatron DDP and MoE ----------------------------------------------------------------------------
    @staticmethod
    def grad_ready_hook(model_chunk):
        """For a megatron DistributedDataParallel chunk, `ready(param)`: what DDP's per-parameter hook does with
        a gradient accumulated into main_grad under overlap_grad_reduce, for gradients the W passes accumulate:
        register the parameter with its bucket group (`register_grad_ready`, counted once megatron's no_sync is
        left), which starts the group's reduction once all its parameters are in. None for anything else."""
        groups = getattr(model_chunk, "param_to_bucket_group", None)
        if groups is None:
            return None

        def ready(param) -> None:
            group = groups.get(param)
            if group is not None:
                group.register_grad_ready(param, getattr(model_chunk, "force_all_reduce", False))

        return ready

    def forward_accumulators(self, model_chunks):
        """What megatron's training forward passes accumulate into (MoE routers' running counts, the MoE metrics
        tracker's per-layer losses, the multi-token-prediction layers' losses and accuracies, the FP8 recipe's
        amax histories and scales that TE's modules update in their forward and backward passes), kept as it is
        now; returns `restore()`, which puts it back (replay.Rewind). A metric a tracker starts after this call is
        zeroed: its entry would have been made from zeros."""
        import torch

        from . import te_fp8_state

        kept = [(tensor, tensor.clone()) for chunk in model_chunks for module in chunk.modules()
                for name in ROUTER_ACCUMULATORS if torch.is_tensor(tensor := getattr(module, name, None))]
        tracker = self._m.moe_logging.get_moe_metrics_tracker()
        metrics = {name: entry.values.clone() for name, entry in tracker.metrics.items()}
        mtp = self._m.multi_token_prediction.MTPLossLoggingHelper.tracker  # a class attribute: one dict per process
        mtp_values = {name: mtp[name].clone() for name in MTP_TRACKED if name in mtp}
        recipe_state = te_fp8_state.keep_recipe_state(model_chunks)

        def restore() -> None:
            recipe_state()
            for tensor, value in kept:
                tensor.copy_(value)
            for name, entry in tracker.metrics.items():
                if name in metrics:
                    entry.values.copy_(metrics[name])
                else:
                    entry.values.zero_()
            for name in MTP_TRACKED:
                if name in mtp_values:
                    mtp[name].copy_(mtp_values[name])
                elif name in mtp:
                    mtp[name].zero_()

        return restore

    def reset_forward_loss_scales(self, config, num_microbatches: int, cp_size: int) -> None:
        """Set again what megatron's forward_step hands from the loss scale to the backward passes that follow
        it: the MoE auxiliary losses' gradient scale (MoEAuxLossAutoScaler, a class attribute each forward sets
        from config.grad_scale_func). Post-validation may change the loss scale between a forward and those."""
        if getattr(config, "num_moe_experts", None) is None:
            return
        scale = self._m.schedules._get_moe_loss_scale(config, _device())
        self._m.router.MoEAuxLossAutoScaler.set_loss_scale(
            scale if config.calculate_per_token_loss else scale * cp_size / num_microbatches)

    # -- random state (an exact replay draws the same dropout masks) --------------------------------------
    def rng_tracker_states(self) -> dict:
        return {name: s.clone() for name, s in self._m.random.get_cuda_rng_tracker().get_states().items()}

    def set_rng_tracker_states(self, states: dict) -> None:
        self._m.random.get_cuda_rng_tracker().set_states({name: s.clone() for name, s in states.items()})

    # -- the B/W split: megatron's own linear layers (linear_wgrad.py), Transformer Engine's (te_wgrad.py) --
    def split_linear_layers(self, module, store):
        """Hand `store` the weight gradients of `module`'s layers: every tensor-parallel linear layer of megatron
        that owns a trainable weight, and every Transformer Engine linear module (through TE's own deferral);
        returns (the parameters whose gradients now come in W, undo)."""
        from . import linear_wgrad, te_wgrad

        layer_types = (self._m.layers.ColumnParallelLinear, self._m.layers.RowParallelLinear)
        weights, local = linear_wgrad.split_layers(module, store, layer_types)
        given = self._te_layer_types is not None
        kinds = self._te_layer_types if given else te_wgrad.layer_types()
        if not kinds:
            return weights, local
        try:
            te_params, te = te_wgrad.split_modules(module, store, kinds, check_version=not given)
        except BaseException:
            local.restore()
            raise
        return weights + te_params, _Undo((te, local))

    @staticmethod
    def named_layer_weights(module, names) -> list:
        """The weights of `module`'s layers with one of these names (the last part of the qualified name:
        "output_layer"), as a schedule's info["wgrad_in_b"] names the layers whose W stays in B."""
        wanted = set(names)
        return [layer.weight for name, layer in module.named_modules()
                if name.rsplit(".", 1)[-1] in wanted and getattr(layer, "weight", None) is not None]

    def transformer_engine_layers(self, module) -> list:
        """The Transformer Engine modules of `module` whose weight gradients split_linear_layers defers."""
        from . import te_wgrad

        kinds = self._te_layer_types if self._te_layer_types is not None else te_wgrad.layer_types()
        return [layer for _, layer, _, _ in te_wgrad.splittable_layers(module, kinds)] if kinds else []

    # -- megatron's timers ------------------------------------------------------------------------------
    @staticmethod
    @contextlib.contextmanager
    def timed_forward_backward(config):
        """megatron's "forward-backward" timer around one call, as its own schedules time it."""
        timers = config.timers
        if timers is not None:
            timers("forward-backward", log_level=1).start(barrier=config.barrier_with_L1_time)
        try:
            yield
        finally:
            if timers is not None:
                timers("forward-backward").stop()

    @staticmethod
    def pause_timers(config):
        """Switch megatron's timers off (the split check's extra passes must not count); returns what restores them."""
        timers, config.timers = config.timers, None

        def restore() -> None:
            config.timers = timers

        return restore

    # -- the optimizer step, kept stage-local (post-validation) ------------------------------------------
    @staticmethod
    def leaf_optimizers(optimizer) -> list:
        """megatron's leaf optimizers, as post-validation steps them (megatron_optimizer.LeafOptimizer)."""
        from .megatron_optimizer import leaf_optimizers

        return leaf_optimizers(optimizer)

    def squared_grad_norm(self, grads: list, device):
        """The sum of squares of `grads` as megatron's get_grad_norm_fp32 computes it before reducing."""
        import torch

        clip_grads = self._m.clip_grads
        overflow = torch.zeros(1, dtype=torch.int, device=device)
        norm, _ = clip_grads.multi_tensor_applier(clip_grads.l2_norm_impl, overflow, [grads], False)
        return (norm**2.0).reshape(()).float()

    def clip_by_total_norm(self, params: list, max_norm: float, total_norm: float) -> None:
        self._m.clip_grads.clip_grad_by_total_norm_fp32(params, max_norm, total_norm)

    def statistics_groups(self) -> SimpleNamespace:
        """The process groups post-validation reduces statistics in: this rank's pipeline group, the ranks of
        its stage (tensor x data parallel, context parallel included), in-stage groups that may hold the part of
        a leaf's statistics group lying in this stage (step_statistics.blocks_for), and the data-parallel group
        (context parallel included) megatron sums a per-token loss's token count over."""
        ps = self._m.parallel_state
        stage = ps.get_tensor_and_data_parallel_group(with_context_parallel=True)
        return SimpleNamespace(pipeline=ps.get_pipeline_model_parallel_group(), stage=stage,
                               data_parallel=ps.get_data_parallel_group(with_context_parallel=True),
                               in_stage=[ps.get_tensor_model_parallel_group,
                                         ps.get_expert_tensor_and_model_parallel_group, lambda: stage])


class _Undo:
    """Several undos as one (restored in order)."""

    def __init__(self, parts):
        self.parts = parts

    def restore(self) -> None:
        for part in self.parts:
            part.restore()


def _device():
    import torch

    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
