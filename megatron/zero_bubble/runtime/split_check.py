"""The split check at start-up: the layers this run splits into B and W give megatron's gradients, bit for bit.

Before the first training iteration of a split schedule, every rank runs one microbatch of each of its model chunks
twice on its real layers, with megatron's own forward and backward steps: once fused (BW, what megatron's schedules
run) and once split (B, then W from the chunk's WeightGradStore, whoever holds the work: megatron's linear layers
or Transformer Engine's queues). It compares every parameter's gradient bit for bit, then puts back everything it
touched: gradients (`.grad`, `main_grad`, `grad_added_to_main_grad`), the data it read (replayed by the iteration),
random states (CPU, CUDA, megatron's tracker), what forward passes accumulate (MoE routers' counts, megatron's MoE
metrics, the FP8 recipe's state: delayed scaling's amax histories and scales, put back before each run too), the
`is_first_microbatch` flags of the layers and megatron's timers. The chunks' backward passes run inside
megatron's no_sync, so no gradient reduction starts. A chunk that gets no input from this rank (a later pipeline
stage) is fed a fixed random activation, and one whose output is not the loss a fixed random output gradient.

If megatron's fused backward is itself not bit-reproducible on this machine (non-deterministic kernels: after a
difference, two more fused runs differ from the first), split and fused are compared within four times the largest
difference among the three fused runs instead, and the line says so. A wrong W (a layer whose deferred gradient
differs) differs by far more than such noise.

Every rank runs the same passes, and so issues the same collectives (tensor and expert parallelism): before each
branch that a difference decides (the re-runs that measure the noise, stopping at the first chunk that differs), the
ranks agree on whether any of them found one (`any_rank`). A kernel that is not bit-reproducible may make one rank
differ and its tensor-parallel peer not; deciding alone, they would issue different collectives and hang.

`SplitCheck.run` returns this rank's `RankResult`; `SplitCheck.conclude` gathers every rank's and logs one line on
rank 0 (`zero-bubble: split check: ...`), or raises `SplitCheckFailed` with one line on every rank.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist

from ..schedules.ops import Op
from ..schedules.schedule import Pass
from .faults import Faults
from .p2p import current_device

NOISE_FACTOR = 4.0  # split may differ from fused by this many times fused's own run-to-run spread


class SplitCheckFailed(RuntimeError):
    """The split gave other gradients than megatron's fused backward (the message is one line)."""


@dataclass
class RankResult:
    rank: int
    deferred_layers: int  # layers whose weight gradient W computes
    compared: int  # parameter gradients compared
    seconds: float
    mismatch: str | None = None  # the first differing gradient, in words
    noise: float | None = None  # relative run-to-run difference of the fused backward (None: reproducible)
    kinds: dict = field(default_factory=dict)  # class name of each layer split -> how many


@dataclass
class ChunkRun:
    """What one microbatch of one chunk needs: its virtual stage, whether it ends in the loss, and the fixed tensors
    standing in for its neighbours (None where the chunk has none)."""

    chunk: int
    vstage: int
    is_last_stage: bool
    input_tensor: torch.Tensor | None


class SplitCheck:
    """One per executor: `done` once the check has run (it runs once, before the first training iteration)."""

    def __init__(self, log: Callable[[str], None] = print, faults: tuple = (),
                 agree: Callable[[bool], bool] | None = None):
        self.log = log
        self.faults = faults  # faults.Fault of the run (split-mismatch perturbs this rank's split gradients)
        self.agree = agree or any_rank  # whether any rank of the job found a difference
        self.done = False
        self.results: list[RankResult] = []

    def run(self, compute, stores: list, chunks: list, runs: list[ChunkRun], names: Callable, rewind,
            restore_extra: Callable[[], None]) -> RankResult:
        """compute: a fresh PassCompute over a Rewind's iterators; names(chunk) -> {name: parameter};
        rewind: puts data, random states and forward accumulators back; restore_extra: the rest (flags, timers)."""
        start = time.perf_counter()
        saved = GradientState([p for chunk in chunks for p in chunk.parameters() if p.requires_grad])
        result = RankResult(dist.get_rank() if dist.is_initialized() else 0, 0, 0, 0.0)
        perturb = Faults(self.faults, result.rank).split_mismatch
        try:
            for run in runs:
                _count_split_layers(chunks[run.chunk], stores[run.chunk], result)
                self._check_chunk(compute, stores[run.chunk], names(chunks[run.chunk]), run, rewind, saved, result,
                                  perturb)
                if self.agree(result.mismatch is not None):  # every rank stops at the same chunk
                    break
        finally:
            compute.grad_sync.release_all()
            saved.restore()
            rewind.rewind()
            compute.restart()
            restore_extra()
        result.seconds = time.perf_counter() - start
        self.done = True
        return result

    def _check_chunk(self, compute, store, named: dict, run: ChunkRun, rewind, saved, result: RankResult,
                     perturb: bool = False) -> None:
        def one(split: bool) -> dict:
            rewind.rewind()
            compute.restart()
            saved.clear()
            _one_microbatch(compute, store, run, split)
            return {name: _grad_of(p).clone() for name, p in named.items() if _grad_of(p) is not None}

        fused, split = one(split=False), one(split=True)
        if perturb:  # the injected fault: this rank's split differs, its peers' not
            split = _perturbed(split)
        result.compared += len(fused)
        first = _first_difference(fused, split)
        if not self.agree(first is not None):
            return
        noise = _relative_spread([fused, one(split=False), one(split=False)])  # on every rank: same collectives
        if first is None:
            return
        if noise > 0.0:
            result.noise = max(result.noise or 0.0, noise)
            first = _first_difference(fused, split, tolerance=NOISE_FACTOR * noise)
        if first is not None:
            name, difference, scale = first
            result.mismatch = (f"chunk {run.chunk}: the gradient of {_readable(name)} differs between megatron's fused "
                               f"backward and B then W by up to {difference:.3g} (its largest element {scale:.3g})")

    # -- all ranks --------------------------------------------------------------------------------------------
    def conclude(self, mine: RankResult) -> None:
        """Gather every rank's result; one line on rank 0, or SplitCheckFailed (one line) on every rank."""
        results = [mine]
        if dist.is_initialized():
            results = [None] * dist.get_world_size()
            dist.all_gather_object(results, mine)
        self.results = results
        failed = next((r for r in results if r.mismatch is not None), None)
        if failed is not None:
            raise SplitCheckFailed(
                f"zero-bubble: split check failed on rank {failed.rank}, {failed.mismatch}; the B/W split of this "
                f"layer is wrong with the installed versions, do not train with it (please report it; "
                f"--no-zero-bubble-split-check skips the check)")
        noisy = [r.noise for r in results if r.noise is not None]
        how = "bit-identical" if not noisy else (
            f"within {NOISE_FACTOR:g}x of megatron's own run-to-run difference (relative {max(noisy):.1g}: its fused "
            f"backward is not bit-reproducible here)")
        kinds: dict = {}
        for r in results:
            for kind, count in r.kinds.items():
                kinds[kind] = kinds.get(kind, 0) + count
        self.log(f"zero-bubble: split check: passed, {sum(r.deferred_layers for r in results)} layers split into B and W "
                 f"on {len(results)} ranks ({', '.join(f'{count} {kind}' for kind, count in sorted(kinds.items()))}; "
                 f"{sum(r.compared for r in results)} parameter gradients compared, fused and split {how}), "
                 f"{max(r.seconds for r in results):.2f} s")


def _count_split_layers(chunk, store, result: RankResult) -> None:
    """The layers of `chunk` whose weight gradients `store` defers, counted by class (megatron's or TE's names)."""
    deferred = {id(p) for p in store.weights}
    for module in chunk.modules():
        if any(id(p) in deferred for p in module.parameters(recurse=False)):
            result.deferred_layers += 1
            result.kinds[type(module).__name__] = result.kinds.get(type(module).__name__, 0) + 1


def any_rank(found: bool) -> bool:
    """Whether any rank of the job found it (every rank calls this at the same point)."""
    if not dist.is_initialized():
        return found
    flag = torch.tensor([int(found)], dtype=torch.int32, device=current_device())  # NCCL reduces device tensors
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def _perturbed(grads: dict) -> dict:
    """The gradients with the first one's first element moved by one: a difference no noise explains."""
    name = next(iter(grads), None)
    if name is None:
        return grads
    changed = grads[name].clone()
    changed.view(-1)[0] += 1.0
    return {**grads, name: changed}


def _one_microbatch(compute, store, run: ChunkRun, split: bool) -> None:
    """F, then BW (fused) or B and W, of microbatch 0 of one chunk, through the iteration's own PassCompute."""
    k = run.chunk
    input_tensor = None if run.input_tensor is None else run.input_tensor.detach().clone().requires_grad_()
    output = compute.forward(Pass(Op.F, 0, k), run.vstage, input_tensor, run.is_last_stage)
    output_grad = None if run.is_last_stage else _fixed_random(output.shape, output.dtype, output.device, 7919 + k)
    compute.release_output(output)
    compute.backward(Pass(Op.B if split else Op.BW, 0, k), run.vstage, input_tensor, output, output_grad, store,
                     last=False)
    if split:
        compute.weight(Pass(Op.W, 0, k), store)


def fixed_input(shape, dtype, device, chunk: int) -> torch.Tensor:
    """The activation that stands in for the previous stage's output (the same in every run)."""
    return _fixed_random(shape, dtype, device, 104729 + chunk)


def _fixed_random(shape, dtype, device, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(tuple(shape), generator=generator).to(device=device, dtype=dtype)


def _grad_of(param):
    main_grad = getattr(param, "main_grad", None)
    return main_grad if main_grad is not None else param.grad


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if torch.equal(a, b):
        return True
    as_int = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}.get(a.element_size())
    return as_int is not None and torch.equal(a.contiguous().view(as_int), b.contiguous().view(as_int))  # NaN == NaN


def _max_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().nan_to_num(float("inf")).max()) if a.numel() else 0.0


def _scale(t: torch.Tensor) -> float:
    return max(float(t.double().abs().nan_to_num(0.0).max()) if t.numel() else 0.0, 1e-30)


def _relative_spread(runs: list[dict]) -> float:
    """The largest difference between any two of the same fused runs, relative to each gradient's largest element."""
    first = runs[0]
    return max((_max_difference(a[name], b[name]) / _scale(first[name]) for name in first
                for i, a in enumerate(runs) for b in runs[i + 1:]), default=0.0)


def _first_difference(fused: dict, split: dict, tolerance: float | None = None):
    """(name, largest absolute difference, largest element) of the first gradient that differs, or None."""
    for name, want in fused.items():
        got = split.get(name)
        if got is None:
            return name, float("inf"), _scale(want)
        if tolerance is None and _bits_equal(want, got):
            continue
        difference = _max_difference(want, got)
        if tolerance is not None and difference <= tolerance * _scale(want):
            continue
        return name, difference, _scale(want)
    missing = next((name for name in split if name not in fused), None)
    return None if missing is None else (missing, float("inf"), 0.0)


def keep_attributes(chunks: list, name: str) -> Callable[[], None]:
    """Every module's `name` attribute now (is_first_microbatch: megatron's Transformer Engine layers pass it on, and
    it changes after their first forward); returns what puts them back."""
    kept = [(module, getattr(module, name)) for chunk in chunks for module in chunk.modules() if hasattr(module, name)]

    def restore() -> None:
        for module, value in kept:
            setattr(module, name, value)

    return restore


def _readable(name: str) -> str:
    return name[len("module."):] if name.startswith("module.") else name


class GradientState:
    """Every parameter's `.grad` (the tensor itself: the runs start from None), `main_grad` (a buffer written in
    place: copied, or kept as "zero" when all zeros, the usual case before the first iteration) and
    `grad_added_to_main_grad`, to put back."""

    def __init__(self, params: list):
        self.params = params
        self.kept = [(p.grad, self._keep(getattr(p, "main_grad", None)), getattr(p, "grad_added_to_main_grad", None))
                     for p in params]

    @staticmethod
    def _keep(t):
        if t is None:
            return None
        return "zero" if not bool(torch.any(t != 0)) else t.detach().clone()

    def clear(self) -> None:
        """As megatron's zero_grad_buffer leaves them."""
        for p in self.params:
            p.grad = None
            if getattr(p, "main_grad", None) is not None:
                p.main_grad.zero_()
            if hasattr(p, "grad_added_to_main_grad"):
                p.grad_added_to_main_grad = False

    def restore(self) -> None:
        for p, (grad, main_grad, added) in zip(self.params, self.kept):
            p.grad = grad
            if main_grad is not None:
                p.main_grad.zero_() if isinstance(main_grad, str) else p.main_grad.copy_(main_grad)
            if added is not None:
                p.grad_added_to_main_grad = added
