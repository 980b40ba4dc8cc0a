"""STAND-IN for Transformer Engine's deferring linear modules, for CPU tests only. It is not Transformer Engine.

Transformer Engine (TE) needs CUDA, so the code that drives its weight-gradient deferral (patches/te_wgrad.py:
which modules are switched, the order of the W work, readiness for megatron DDP, replays) is tested on CPU
against these small modules, which keep the contract TE documents and implements (read from its sources,
2.3 to 2.20; the numbers are plain torch, the behaviour around them TE's; `release`, (major, minor), picks where
the releases differ, the newest by default):

- a module holds `wgrad_store`, a per-module FIFO; with `delay_wgrad_compute()` True in backward the module
  computes the input gradient, `put`s ([tensors], gemm) and returns no weight gradient; `backward_dw()` pops one
  entry (the MLP two: fc2's, then fc1's), runs the GEMM and assigns `weight.grad` (not fused; from 2.8 on always,
  overwriting what is there, TE issue #3437; before, only where it is None) and `bias.grad` (where it is None),
  then runs the hooks given to `register_wgrad_accumulation_and_reduce_hooks`; popping an empty queue raises
  "Pop empty queue"; `need_backward_dw()` says whether the deferral is on;
- `fuse_wgrad_accumulation`: the GEMM accumulates into `weight.main_grad` (overwrites it for the first
  microbatch when the caller says so), and backward returns a placeholder gradient (here NaN, so that adding it
  anywhere shows) with `weight.grad_added_to_main_grad = True` when the weight has that attribute (megatron DDP);
- a forward hands the queue to its backward only if `delay_wgrad_compute()` answered True in the forward (TE's
  Linear 2.16+; here every module, which is stricter);
- a layer norm fused in front (the MLP's `layer_norm_*`) gets its gradients in B;
- a bias gradient formed in B (`bias_grad_in_b`: TE's Linear under FP8, LayerNormMLP's fc1 with its bias-GELU
  fusion) is returned to autograd and the W GEMM then gives none: `backward_dw` fails on it unless it finds
  `bias.grad` set (TE issue #3400), as LayerNormMLP's does in every release and Linear's before 2.20; 2.20's
  Linear skips a bias gradient the GEMM did not give;
- the Userbuffers options each TE module has (`USERBUFFERS`, all False here, as TE sets them without Userbuffers);
- `GroupedLinear` (StandInGroupedLinear): without fusion B returns to autograd the buffer W will write into, not
  yet written (here NaN); `backward_dw` returns at once on an empty queue (`context.empty()`); TE 2.19's and 2.20's
  grouped-tensor path (`grouped_tensor=True`) queues its operands as plain objects holding tensors (TE's
  GroupedTensorStorage) and forms the bias gradients in B.

The real-TE tests (tests/megatron/te_split_cases.py, run by test_te_releases.py) run the main checks (split against
fused, W order, BW passes, readiness) on TE's own modules: on the CPU over the labelled kernel layer (releases 2.5.0,
2.12.0, 2.19.0 and 2.20.2), on a GPU over TE's kernels (not run yet). Where the two disagree, TE wins: TE's LayerNormMLP
needs a bias gradient in `.grad` for backward_dw even after megatron DDP's hook accumulated the one B formed, which
this stand-in does not model. A GPT on TE's own layers through the runtime, FP8 included, is
tests/megatron/te_gpt_cases.py's. What this stand-in is still needed for, because TE's code cannot show it on the
CPU: each release line's behaviour side by side in one process (`release`), the Userbuffers options (TE builds
such modules only with its CUDA communicator), and the paths TE takes only on a GPU or with options megatron sets
there (GroupedLinear's grouped-tensor path, distributed weights).
"""
from __future__ import annotations

import queue

import torch
import torch.nn.functional as F


class StandInWeightGradStore:
    """TE's per-module FIFO of deferred weight-gradient GEMMs."""

    def __init__(self, delay_wgrad_compute: bool = False):
        self.context = queue.Queue() if delay_wgrad_compute else None
        self.enabled = bool(delay_wgrad_compute)

    def delay_wgrad_compute(self) -> bool:
        return self.enabled

    def enable_delay_wgrad_compute(self) -> None:
        self.enabled = True

    def disable_delay_wgrad_compute(self) -> None:
        self.enabled = False

    def put(self, tensor_list, func) -> None:
        assert self.enabled, "delay_wgrad_compute is not enabled"
        self.context.put([tensor_list, func])

    def pop(self):
        assert self.enabled, "delay_wgrad_compute is not enabled"
        if self.context.qsize() > 0:
            tensor_list, func = self.context.get()
            return func(*tensor_list), tensor_list
        raise RuntimeError("Pop empty queue. No distributed environment detected.")


_PLACEHOLDERS: dict = {}


def _placeholder(shape, dtype) -> torch.Tensor:
    """TE's cached stand-in gradient for a weight it accumulates into main_grad itself (here NaN)."""
    key = (tuple(shape), dtype)
    if key not in _PLACEHOLDERS:
        _PLACEHOLDERS[key] = torch.full(shape, float("nan"), dtype=dtype)
    return _PLACEHOLDERS[key]


NEWEST_RELEASE = (2, 20)


class StandInTEModule(torch.nn.Module):
    """TE's TransformerEngineBaseModule: the deferral and backward_dw()."""

    weight_names: tuple = ()
    bias_names: tuple = ()
    USERBUFFERS: tuple = ()  # the module's Userbuffers options (TE's attribute names)

    def __init__(self, fuse_wgrad_accumulation: bool = False, delay_wgrad_compute: bool = False,
                 release: tuple = NEWEST_RELEASE):
        super().__init__()
        self.fuse_wgrad_accumulation = fuse_wgrad_accumulation
        self.release = tuple(release)
        self.wgrad_store = StandInWeightGradStore(delay_wgrad_compute)
        self.wgrad_accumulation_and_reduce_hooks = []
        for option in self.USERBUFFERS:
            setattr(self, option, False)

    def register_wgrad_accumulation_and_reduce_hooks(self, hook) -> None:
        self.wgrad_accumulation_and_reduce_hooks.append(hook)

    def need_backward_dw(self) -> bool:
        return self.wgrad_store is not None and self.wgrad_store.delay_wgrad_compute()

    def _forward_store(self):
        return self.wgrad_store if self.wgrad_store.delay_wgrad_compute() else None

    def backward_dw(self) -> None:
        if not self.need_backward_dw():
            return
        for weight_name, bias_name in zip(self.weight_names, self.bias_names):  # one entry per GEMM
            (wgrad, bgrad), _ = self.wgrad_store.pop()
            weight, bias = getattr(self, weight_name), getattr(self, bias_name, None)
            if not self.fuse_wgrad_accumulation and (self.release >= (2, 8) or weight.grad is None):
                weight.grad = wgrad.to(weight.dtype)
            if bias is not None and bias.grad is None and self._backfills_bias(bgrad):
                bias.grad = bgrad.to(bias.dtype)  # fails on a missing bgrad (TE issue #3400)
        for hook in self.wgrad_accumulation_and_reduce_hooks:
            hook()

    def _backfills_bias(self, bgrad) -> bool:
        """Whether backward_dw puts the GEMM's bias gradient into an empty `bias.grad`: always before 2.20; from
        2.20 on (TE #3400's guard in the base class) only where the GEMM gave one."""
        return self.release < (2, 20) or (bgrad is not None and bgrad.numel() != 0)


def _wgrad_gemm(weight, use_bias: bool, fused: bool, accumulate: bool):
    """The weight-gradient GEMM one backward hands over (dw = dy^T x, db = sum dy), into main_grad when fused."""
    main_grad = weight.main_grad if fused else None

    def gemm(x, dy):
        dw = dy.t().matmul(x)
        db = dy.sum(dim=0) if use_bias else None
        if main_grad is not None:
            main_grad.add_(dw) if accumulate else main_grad.copy_(dw)
            dw = None
        return dw, db

    return gemm


def _weight_grad_for_autograd(weight, wgrad, fused: bool):
    """What TE's backward returns for the weight: with fusion a placeholder (megatron DDP) or nothing."""
    if fused and hasattr(weight, "grad_added_to_main_grad"):
        weight.grad_added_to_main_grad = True
        return _placeholder(weight.shape, weight.dtype)
    return None if fused else wgrad


def _accumulate_flag(fused: bool, is_first_microbatch) -> bool:
    return fused and not is_first_microbatch if is_first_microbatch is not None else fused


class _LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, weight, inp, bias, module, store, is_first_microbatch):
        ctx.save_for_backward(inp, weight)
        ctx.weight, ctx.store, ctx.use_bias = weight, store, bias is not None
        ctx.bias_in_b = bias is not None and getattr(module, "bias_grad_in_b", False)
        ctx.fused = module.fuse_wgrad_accumulation
        ctx.accumulate = _accumulate_flag(ctx.fused, is_first_microbatch)
        out = inp.matmul(weight.t())
        return out + bias if bias is not None else out

    @staticmethod
    def backward(ctx, grad_out):
        inp, weight = ctx.saved_tensors
        dgrad = grad_out.matmul(weight)
        x2, dy2 = inp.reshape(-1, inp.shape[-1]), grad_out.reshape(-1, grad_out.shape[-1])
        early_bias = dy2.sum(dim=0) if ctx.bias_in_b else None  # TE's FP8 path: the bias gradient comes in B
        gemm = _wgrad_gemm(ctx.weight, ctx.use_bias and not ctx.bias_in_b, ctx.fused, ctx.accumulate)
        if ctx.store is not None and ctx.store.delay_wgrad_compute():
            ctx.store.put([x2, dy2], gemm)
            wgrad = bgrad = None
        else:
            wgrad, bgrad = gemm(x2, dy2)
        bgrad = early_bias if ctx.bias_in_b else bgrad
        return _weight_grad_for_autograd(ctx.weight, wgrad, ctx.fused), dgrad, bgrad, None, None, None


class StandInLinear(StandInTEModule):
    """te.pytorch.Linear: y = x W^T + b."""

    weight_names, bias_names = ("weight",), ("bias",)
    USERBUFFERS = ("ub_overlap_ag_fprop", "ub_overlap_rs_dgrad", "ub_bulk_dgrad", "ub_bulk_wgrad",
                   "ub_overlap_rs_fprop", "ub_overlap_ag_dgrad")

    def __init__(self, in_features: int, out_features: int, bias: bool = True, bias_grad_in_b: bool = False,
                 **options):
        super().__init__(**options)
        self.bias_grad_in_b = bias_grad_in_b
        self.weight = torch.nn.Parameter(torch.empty(out_features, in_features))
        self.bias = torch.nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, inp, is_first_microbatch=None):
        return _LinearFunction.apply(self.weight, inp, self.bias, self, self._forward_store(), is_first_microbatch)


class _MLPFunction(torch.autograd.Function):
    """fc2(gelu(fc1(x))); backward queues fc2's GEMM, then fc1's."""

    @staticmethod
    def forward(ctx, w1, b1, w2, b2, x, module, store):
        h = x.matmul(w1.t()) + b1
        a = F.gelu(h)
        ctx.save_for_backward(x, h, a, w1, w2)
        ctx.weights, ctx.store, ctx.fused = (w1, w2), store, module.fuse_wgrad_accumulation
        ctx.fc1_bias_in_b = module.bias_grad_in_b
        return a.matmul(w2.t()) + b2

    @staticmethod
    def backward(ctx, grad_out):
        x, h, a, w1, w2 = ctx.saved_tensors
        p1, p2 = ctx.weights
        dy2 = grad_out.reshape(-1, grad_out.shape[-1])
        da = grad_out.matmul(w2)
        with torch.enable_grad():
            h_ = h.detach().requires_grad_()
            dh, = torch.autograd.grad(F.gelu(h_), h_, da)
        dx = dh.matmul(w1)
        fc2 = _wgrad_gemm(p2, True, ctx.fused, ctx.fused)
        fc1 = _wgrad_gemm(p1, not ctx.fc1_bias_in_b, ctx.fused, ctx.fused)
        operands = ((a.reshape(-1, a.shape[-1]), dy2), (x.reshape(-1, x.shape[-1]), dh.reshape(-1, dh.shape[-1])))
        if ctx.store is not None and ctx.store.delay_wgrad_compute():
            ctx.store.put(list(operands[0]), fc2)
            ctx.store.put(list(operands[1]), fc1)
            (w2g, b2g), (w1g, b1g) = (None, None), (None, None)
        else:
            w2g, b2g = fc2(*operands[0])
            w1g, b1g = fc1(*operands[1])
        if ctx.fc1_bias_in_b:  # TE's bias-GELU fusion: fc1's bias gradient in B, whatever the deferral
            b1g = operands[1][1].sum(dim=0)
        return (_weight_grad_for_autograd(p1, w1g, ctx.fused), b1g, _weight_grad_for_autograd(p2, w2g, ctx.fused), b2g,
                dx, None, None)


class StandInLayerNormMLP(StandInTEModule):
    """te.pytorch.LayerNormMLP: fc2(gelu(fc1(layer_norm(x)))); the norm's gradients come in B."""

    weight_names, bias_names = ("fc2_weight", "fc1_weight"), ("fc2_bias", "fc1_bias")  # the order backward_dw pops
    USERBUFFERS = ("ub_overlap_ag", "ub_overlap_rs", "ub_overlap_rs_dgrad", "ub_bulk_wgrad", "ub_bulk_dgrad")

    def __init__(self, hidden: int, ffn: int, bias_grad_in_b: bool = False, **options):
        super().__init__(**options)
        self.bias_grad_in_b = bias_grad_in_b
        self.layer_norm_weight = torch.nn.Parameter(torch.empty(hidden))
        self.layer_norm_bias = torch.nn.Parameter(torch.empty(hidden))
        self.fc1_weight = torch.nn.Parameter(torch.empty(ffn, hidden))
        self.fc1_bias = torch.nn.Parameter(torch.empty(ffn))
        self.fc2_weight = torch.nn.Parameter(torch.empty(hidden, ffn))
        self.fc2_bias = torch.nn.Parameter(torch.empty(hidden))

    def _backfills_bias(self, bgrad) -> bool:
        return True  # LayerNormMLP's backward_dw has no guard in any release read (2.3 to 2.20)

    def forward(self, x):
        normed = F.layer_norm(x, x.shape[-1:], self.layer_norm_weight, self.layer_norm_bias)
        return _MLPFunction.apply(self.fc1_weight, self.fc1_bias, self.fc2_weight, self.fc2_bias, normed, self,
                                  self._forward_store())


class StandInGroupedStorage:
    """TE's GroupedTensorStorage as GroupedLinear's grouped-tensor path queues it: a plain object (no tensor)
    holding the packed rows of every GEMM and their split sizes."""

    def __init__(self, data: torch.Tensor, split_sizes: list):
        self.data, self.split_sizes = data, list(split_sizes)
        self.quantizer = None

    def pieces(self) -> list:
        return list(torch.split(self.data, self.split_sizes))


class _GroupedFunction(torch.autograd.Function):
    """y_i = x_i W_i^T + b_i for the rows of GEMM i; backward as TE's GroupedLinear (2.19 and 2.20 alike)."""

    @staticmethod
    def forward(ctx, x, m_splits, module, store, is_first_microbatch, *params):
        n = module.num_gemms
        weights, biases = params[:n], params[n:]
        ctx.save_for_backward(x, *weights)
        ctx.m_splits, ctx.module, ctx.store, ctx.n = list(m_splits), module, store, n
        ctx.accumulate = _accumulate_flag(module.fuse_wgrad_accumulation, is_first_microbatch)
        outs = [xi.matmul(w.t()) + b for xi, w, b in zip(torch.split(x, m_splits), weights, biases)]
        return torch.cat(outs)

    @staticmethod
    def backward(ctx, grad_out):
        x, *weights = ctx.saved_tensors
        module, n = ctx.module, ctx.n
        xs, dys = torch.split(x, ctx.m_splits), torch.split(grad_out, ctx.m_splits)
        dgrad = torch.cat([dy.matmul(w) for dy, w in zip(dys, weights)])
        fused, grouped = module.fuse_wgrad_accumulation, module.grouped_tensor
        if fused:
            targets = [w.main_grad for w in weights]
        else:  # the buffer W writes into; NaN until it does (TE's is torch.empty)
            packed = torch.full((n, *weights[0].shape), float("nan"), dtype=weights[0].dtype)
            targets = [packed[i] for i in range(n)]
        delayed = ctx.store is not None and ctx.store.delay_wgrad_compute()
        accumulate = ctx.accumulate
        early_biases = [dy.sum(dim=0) for dy in dys] if grouped else None  # grouped path: bias gradients in B

        def gemm(inputs, grads, outputs):
            if grouped:
                inputs, grads = inputs.pieces(), grads.pieces()
            for xi, dy, out in zip(inputs, grads, outputs):
                dw = dy.t().matmul(xi)
                out.add_(dw) if accumulate else out.copy_(dw)
            return None, ([None] * n if grouped else [dy.sum(dim=0) for dy in grads]), None

        if grouped:
            operands = [StandInGroupedStorage(x, ctx.m_splits), StandInGroupedStorage(grad_out, ctx.m_splits), targets]
        else:
            operands = [list(xs), list(dys), targets]
        if delayed:
            ctx.store.put(operands, gemm)
            bias_grads = early_biases if grouped else [None] * n
        else:
            _, bias_grads, _ = gemm(*operands)
            bias_grads = early_biases if grouped else bias_grads
        weight_grads = [_weight_grad_for_autograd(w, t, fused) for w, t in zip(weights, targets)]
        return (dgrad, None, None, None, None, *weight_grads, *bias_grads)


class StandInGroupedLinear(StandInTEModule):
    """te.pytorch.GroupedLinear (per-GEMM weight{i} / bias{i}); forward(x, m_splits, is_first_microbatch): with
    main_grad fusion the first microbatch's W overwrites main_grad, as TE's does."""

    USERBUFFERS = ("ub_overlap_rs", "ub_overlap_ag")  # TE refuses either at construction

    def __init__(self, num_gemms: int, in_features: int, out_features: int, grouped_tensor: bool = False,
                 **options):
        super().__init__(**options)
        self.num_gemms, self.grouped_tensor = num_gemms, grouped_tensor
        for i in range(num_gemms):
            setattr(self, f"weight{i}", torch.nn.Parameter(torch.empty(out_features, in_features)))
            setattr(self, f"bias{i}", torch.nn.Parameter(torch.empty(out_features)))

    def forward(self, x, m_splits, is_first_microbatch=None):
        params = [getattr(self, f"weight{i}") for i in range(self.num_gemms)]
        params += [getattr(self, f"bias{i}") for i in range(self.num_gemms)]
        return _GroupedFunction.apply(x, m_splits, self, self._forward_store(), is_first_microbatch, *params)

    def backward_dw(self) -> None:
        if not self.need_backward_dw():
            return
        if self.wgrad_store.context is None or self.wgrad_store.context.empty():
            return
        (_, grad_biases, _), tensor_list = self.wgrad_store.pop()
        for i, wgrad in enumerate(tensor_list[2]):
            weight = getattr(self, f"weight{i}")
            if not self.fuse_wgrad_accumulation and (self.release >= (2, 8) or weight.grad is None):
                weight.grad = wgrad.to(weight.dtype)
        present = [g is not None for g in grad_biases]
        if any(present) and self.grouped_tensor:
            raise RuntimeError("GroupedLinear(use_grouped_tensor=True) produced bias gradients in delayed wgrad")
        for i, grad in enumerate(grad_biases):
            bias = getattr(self, f"bias{i}")
            if present[i] and bias.grad is None:
                bias.grad = grad.to(bias.dtype)
        for hook in self.wgrad_accumulation_and_reduce_hooks:
            hook()


class StandInFusedMLP(torch.nn.Module):
    """megatron's TEFusedMLP: holds TE modules (linear_fc1, linear_fc2) but runs their parameters through TE's
    operation-based modules (here plain torch ops), kept out of the module tree in `_fused_impl`; the TE modules'
    own forward never runs."""

    def __init__(self, hidden: int, ffn: int, **options):
        super().__init__()
        self.linear_fc1 = StandInLinear(hidden, ffn, **options)
        self.linear_fc2 = StandInLinear(ffn, hidden, **options)
        self._fused_impl = None

    def forward(self, x):
        fc1, fc2 = self.linear_fc1, self.linear_fc2
        return F.linear(F.gelu(F.linear(x, fc1.weight, fc1.bias)), fc2.weight, fc2.bias)


KINDS = (StandInLinear, StandInLayerNormMLP, StandInGroupedLinear)  # what the adapter switches (as TE's ...)
