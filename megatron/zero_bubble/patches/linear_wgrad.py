"""B/W split for megatron-core's tensor-parallel linear layers (ColumnParallelLinear, RowParallelLinear).

`split_layers(module, store, layer_types)` hands a `WeightGradStore` (runtime/wgrad_store.py) to each such
layer that owns a trainable weight: the layer's own `_forward_impl` (megatron's per-layer hook that picks the
linear function; a method, shadowed on that one object) becomes a `SplitLinearForward`, whose autograd
function's forward is megatron's and whose backward computes the B part:
- grad_input = grad_output @ weight, with the same TP all-reduce or sequence-parallel reduce-scatter,
  and grad_bias as megatron computes it;
- a `DeferredLinearWeightGrad` holding the input activation (sharded under sequence parallelism,
  all-gathered again in W) and grad_output, handed to the store: deferred while the store is active
  (`split_backward()`, a B pass), run at once otherwise (a fused BW pass).
Running that work computes the weight gradient with megatron's ops and accumulates it where megatron's
backward would have put it (see `DeferredLinearWeightGrad.__call__`). The weight enters the autograd graph
detached, so its gradient is never autograd's: megatron DDP's per-parameter hook does not fire for it
(during a B pass it would see no gradient); the store tells DDP instead when the gradient is complete.
`undo()` of the returned PatchSet gives every layer megatron's own `_forward_impl` back.

Not split (megatron's function runs unchanged): Transformer Engine layers (they have their own
delay_wgrad_compute / backward_dw), a call with another weight than the layer's own (a tied output layer
handed the embedding's), megatron's embedding wgrad deferral (grad_output_buffer), GTP weight
rematerialisation (gtp_remat_size > 1), frozen weights.
"""
from __future__ import annotations

from types import SimpleNamespace

import torch

from ._patching import PatchError, PatchSet, megatron_core_version

# What the deferrable backward reuses from megatron's layers module (checked by split_layers).
_NEEDED_FROM_LAYERS = (
    "LinearWithGradAccumulationAndAsyncCommunication", "custom_bwd", "get_global_memory_buffer",
    "get_tensor_model_parallel_group_if_none", "prepare_input_tensors_for_wgrad_compute",
    "dist_all_gather_func", "dist_reduce_scatter_func",
)


def _layers():
    from megatron.core.tensor_parallel import layers

    return layers


def split_layers(module: torch.nn.Module, store, layer_types: tuple) -> tuple[list, PatchSet]:
    """Route the weight gradient of every `layer_types` layer of `module` that owns a trainable weight into
    `store`; returns (their weights, the PatchSet whose restore() undoes it). A layer another store holds
    already is refused: a weight belongs to one model chunk."""
    missing = [name for name in _NEEDED_FROM_LAYERS if not hasattr(_layers(), name)]
    if missing:
        raise PatchError(f"the B/W split: megatron.core.tensor_parallel.layers lacks {', '.join(missing)} in "
                         f"megatron-core {megatron_core_version()}; it was written for 0.19.x")
    patches, weights = PatchSet(f"linear_wgrad ({store.name})"), []
    try:
        for layer in module.modules():
            weight = getattr(layer, "weight", None) if isinstance(layer, layer_types) else None
            if weight is None or not weight.requires_grad:
                continue
            held = vars(layer).get("_forward_impl")
            if isinstance(held, SplitLinearForward):
                raise PatchError(f"the weight of {type(layer).__name__} is already split into WeightGradStore "
                                 f"{held.store.name!r}; a weight can belong to one model chunk only")
            patches.shadow(layer, "_forward_impl", SplitLinearForward(layer, store))
            weights.append(weight)
    except BaseException:
        patches.restore()
        raise
    return weights, patches


def split_store(layer):
    """The WeightGradStore `layer`'s weight gradient goes to, or None (megatron's own backward)."""
    held = vars(layer).get("_forward_impl")
    return held.store if isinstance(held, SplitLinearForward) else None


class SplitLinearForward:
    """A layer's `_forward_impl` with its weight gradient going to `store` (same signature as megatron's)."""

    def __init__(self, layer, store):
        self.layer, self.store = layer, store

    def __call__(self, input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad, sequence_parallel,
                 grad_output_buffer=None, wgrad_deferral_limit=0, tp_group=None, gtp_remat_size=1):
        args = (input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad, sequence_parallel,
                grad_output_buffer, wgrad_deferral_limit, tp_group, gtp_remat_size)
        own = weight is self.layer.weight and weight.requires_grad
        if not own or grad_output_buffer is not None or gtp_remat_size > 1:
            return type(self.layer)._forward_impl(self.layer, *args)
        tp_group = _layers().get_tensor_model_parallel_group_if_none(tp_group)
        # Detached, and the Parameter itself inside a tuple (autograd looks at tensor arguments only): the
        # weight's gradient is the store's to accumulate (no AccumulateGrad node, so no DDP hook).
        return _DeferrableLinear.apply(input, weight.detach(), *args[2:8], tp_group, gtp_remat_size, self.store,
                                       (weight,))


class _DeferrableLinear(torch.autograd.Function):
    """megatron's LinearWithGradAccumulationAndAsyncCommunication with a deferrable weight gradient."""

    @staticmethod
    def forward(ctx, *args):
        *megatron_args, store, (weight,) = args
        ctx.wgrad_store = store
        # The Parameter itself, not what ctx.saved_tensors unpacks: under saved-tensor hooks (activation
        # offloading) that is a copy without main_grad, and W would accumulate into a throw-away tensor.
        ctx.weight_param = weight
        # megatron's forward (with its custom_fwd autocast bookkeeping) fills ctx exactly as it would, but
        # reads main_grad from the tensor it gets, here the detached one: take the Parameter's.
        output = _layers().LinearWithGradAccumulationAndAsyncCommunication.forward(ctx, *megatron_args)
        ctx.main_grad = getattr(weight, "main_grad", None) if ctx.gradient_accumulation_fusion else None
        return output

    @staticmethod
    def backward(ctx, grad_output):
        grads = _layers().custom_bwd(_input_grad_and_hand_over)(ctx, grad_output)
        return (*grads, None, None)


def _input_grad_and_hand_over(ctx, grad_output):
    """B of megatron's backward: grad_input (with its TP collective) and grad_bias; W goes to the store, which
    defers it (B pass) or runs it now (BW pass: the same GEMM and accumulation as megatron's backward)."""
    layers = _layers()
    input, weight = ctx.saved_tensors
    tp_group = ctx.tp_group
    handle = None
    grad_input = grad_output.matmul(weight)
    if ctx.allreduce_dgrad:
        handle = torch.distributed.all_reduce(grad_input, group=tp_group, async_op=True)
    if ctx.sequence_parallel:
        assert not ctx.allreduce_dgrad
        sub_grad_input = torch.empty(input.size(), dtype=input.dtype, device=input.device, requires_grad=False)
        handle = layers.dist_reduce_scatter_func(sub_grad_input, grad_input, group=tp_group, async_op=True)
        grad_input = sub_grad_input

    # While the collective runs: the tensors W needs and the bias gradient, as megatron forms them
    # (prepare_input_tensors_for_wgrad_compute: contiguous, then [s, b, h] viewed as [s*b, h]).
    grad_output = grad_output.contiguous()
    grad_bias = _as_2d(grad_output).sum(dim=0) if ctx.use_bias else None
    ctx.wgrad_store.hand_over(DeferredLinearWeightGrad(ctx, input, ctx.weight_param, grad_output))

    if handle is not None:
        handle.wait()
    return grad_input, None, grad_bias, None, None, None, None, None, None, None


def _as_2d(tensor):
    return tensor.view(tensor.shape[0] * tensor.shape[1], tensor.shape[2]) if tensor.dim() == 3 else tensor


class DeferredLinearWeightGrad:
    """W of one linear layer for one microbatch: weight gradient GEMM plus its accumulation.

    Keeps only `input` (the sharded input under sequence parallelism) and `grad_output`; `nbytes` is
    their size. Accumulates where megatron's backward would have ended up:
    - gradient_accumulation_fusion: the same fused kernel into weight.main_grad (megatron-FSDP's path
      included), then weight.grad_added_to_main_grad = True when DDP tracks it;
    - weight.main_grad present (megatron DDP, no fusion): main_grad.add_(wgrad), what DDP's backward
      post-hook does with the param.grad autograd would have produced;
    - otherwise weight.grad as autograd's AccumulateGrad: assigned first, added in place afterwards.
    A weight used again in the same backward (`absorb`): without fusion autograd sums the uses' gradients, in the
    order they arrive, before that one accumulation, and so does W; megatron's fused kernel accumulates each use.
    """

    __slots__ = ("input", "weight", "grad_output", "main_grad", "fusion", "sequence_parallel", "tp_group",
                 "autocast_state", "nbytes", "later_uses")

    def __init__(self, ctx, input, weight, grad_output):
        self.input = input.detach()  # drop the autograd history: only the values are needed
        self.weight = weight
        # Detached too: a gradient may carry a grad_fn (the LM head's is its logits, which megatron's cross entropy
        # turned into the softmax in place), which would keep the microbatch's whole backward graph until W.
        self.grad_output = grad_output.detach()
        self.main_grad = ctx.main_grad
        self.fusion = ctx.gradient_accumulation_fusion
        self.sequence_parallel = ctx.sequence_parallel
        self.tp_group = ctx.tp_group
        # W runs under the autocast state megatron's custom_bwd would have restored in backward.
        self.autocast_state = SimpleNamespace(_fwd_used_autocast=ctx._fwd_used_autocast, _dtype=ctx._dtype)
        self.nbytes = _nbytes(input) + _nbytes(grad_output)
        self.later_uses: list[DeferredLinearWeightGrad] = []

    def absorb(self, later) -> bool:
        """Take over `later`, the work of another use of this weight in the same backward, where autograd would
        have summed the two gradients (no fusion); False where each use accumulates on its own."""
        if not isinstance(later, DeferredLinearWeightGrad) or later.weight is not self.weight:
            return False
        if self.fusion or later.fusion:
            return False
        self.later_uses.append(later)
        self.nbytes += later.nbytes
        return True

    def __call__(self) -> None:
        with torch.no_grad():
            _layers().custom_bwd(_compute_and_accumulate)(self.autocast_state, self)
        for work in (self, *self.later_uses):
            work.input = work.grad_output = None  # release M_W now, even if the caller keeps the object


def _compute_and_accumulate(_autocast_state, work: DeferredLinearWeightGrad) -> None:
    weight = work.weight
    if work.fusion:
        total_input, grad_output = _wgrad_operands(work)
        weight.main_grad = work.main_grad  # megatron restores it too (a layer may be reused, e.g. MTP)
        _fused_wgrad_accumulate(_layers(), weight, total_input, grad_output)
        if hasattr(weight, "grad_added_to_main_grad"):
            weight.grad_added_to_main_grad = True
        return
    grad_weight = _weight_grad(work)
    for later in work.later_uses:  # autograd's input buffer: the first gradient plus each later one
        grad_weight = grad_weight + _weight_grad(later)
    main_grad = getattr(weight, "main_grad", None)
    if main_grad is not None:
        main_grad.add_(grad_weight)
    elif weight.grad is None:
        weight.grad = grad_weight
    else:
        weight.grad.add_(grad_weight)


def _wgrad_operands(work: DeferredLinearWeightGrad) -> tuple:
    """(the input, all-gathered again under sequence parallelism, and grad_output), as megatron forms them."""
    layers = _layers()
    input = work.input
    if work.sequence_parallel:
        dim_size = list(input.size())
        dim_size[0] = dim_size[0] * work.tp_group.size()
        total_input = layers.get_global_memory_buffer().get_tensor(dim_size, input.dtype, "mpu")
        layers.dist_all_gather_func(total_input, input, group=work.tp_group)
    else:
        total_input = input
    grad_output, total_input = layers.prepare_input_tensors_for_wgrad_compute(work.grad_output, total_input)
    return total_input, grad_output


def _weight_grad(work: DeferredLinearWeightGrad) -> torch.Tensor:
    total_input, grad_output = _wgrad_operands(work)
    return grad_output.t().matmul(total_input)


def _fused_wgrad_accumulate(layers, weight, total_input, grad_output) -> None:
    """megatron's gradient-accumulation-fusion branch, unchanged (kernels looked up in its module)."""
    if hasattr(weight, "__fsdp_param__"):
        weight.main_grad = weight.get_main_grad()
        from megatron.core.extensions.transformer_engine import te_general_gemm

        if te_general_gemm is not None:
            te_general_gemm(total_input, grad_output, out_dtype=weight.main_grad.dtype, layout="NT",
                            out=weight.main_grad, grad=True)
        else:
            torch.matmul(grad_output.t(), total_input, out=weight.main_grad)
        return
    kernels = layers.fused_weight_gradient_mlp_cuda
    if weight.main_grad.dtype == torch.float32:
        kernels.wgrad_gemm_accum_fp32(total_input, grad_output, weight.main_grad)
    elif weight.main_grad.dtype in (torch.float16, torch.bfloat16):
        kernels.wgrad_gemm_accum_fp16(total_input, grad_output, weight.main_grad)
    else:
        raise RuntimeError("Unsupported gradient type for gradient accumulation fusion")


def _nbytes(tensor) -> int:
    return tensor.numel() * tensor.element_size()
