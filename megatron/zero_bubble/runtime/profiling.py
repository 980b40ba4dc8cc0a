"""Measure the costs the planner needs on this rank: T_F, T_B, T_W per model chunk, T_comm, M_B and M_W.

During the timer window a `Profiler` takes every pass time from the executor's pass observer, the bytes
each F saves for backward (`saved_activation_bytes`, tensors autograd keeps, weights excluded), and
the bytes each B leaves in the chunk's WeightGradStore for its W (the iteration's stats), into a `PassProfile`. `measure_p2p_seconds` times a
ping-pong of one pipeline tensor between neighbouring ranks, posted as the runtime posts its messages. Medians make the figures robust to the odd
slow pass; `summary()` is plain data (lists of floats) so that it can be gathered to one rank.
"""
from __future__ import annotations

import functools
import statistics
import time
from collections import defaultdict

import torch
import torch.distributed as dist

from .memory_probe import HeldMemory
from .p2p import wire_device
from .tensor_bytes import storages


class PassProfile:
    """Samples of one rank: pass times per (op, chunk) and activation bytes per chunk."""

    def __init__(self):
        self.seconds: dict[tuple[str, int], list[float]] = defaultdict(list)
        self.forward_bytes: dict[int, list[int]] = defaultdict(list)  # M_F: saved for backward by one F
        self.wgrad_bytes: dict[int, list[int]] = defaultdict(list)  # M_W: kept by one B for its W
        self.iterations = 0

    def record_pass(self, op: str, chunk: int, seconds: float) -> None:
        self.seconds[(op, chunk)].append(seconds)

    def record_forward_bytes(self, chunk: int, nbytes: int) -> None:
        self.forward_bytes[chunk].append(nbytes)

    def record_wgrad_bytes(self, chunk: int, nbytes: int) -> None:
        self.wgrad_bytes[chunk].append(nbytes)

    def summary(self, chunks: int) -> dict:
        """Per chunk medians: {"t_f", "t_b", "t_w", "t_bw", "m_f", "m_w"} lists indexed by chunk (None where
        that pass never ran), plus how many iterations were measured."""
        def median(samples):
            return float(statistics.median(samples)) if samples else None

        out = {key: [] for key in ("t_f", "t_b", "t_w", "t_bw", "m_f", "m_w")}
        for chunk in range(chunks):
            for op in ("F", "B", "W", "BW"):
                out[f"t_{op.lower()}"].append(median(self.seconds.get((op, chunk))))
            out["m_f"].append(median(self.forward_bytes.get(chunk)))
            out["m_w"].append(median(self.wgrad_bytes.get(chunk)))
        out["iterations"] = self.iterations
        return out


class Profiler:
    """Records one rank's passes during the timer window, for `report()` at its end."""

    def __init__(self, chunks: int):
        self.profile = PassProfile()
        self.memory: HeldMemory | None = None  # what the allocator said after each pass of the last iteration

    def forward_step(self, forward_step_func, model):
        """forward_step_func that also records the activation bytes of each F (first timed iteration only:
        they do not change, and walking the graph costs time that would count in T_F)."""
        if self.profile.iterations > 0:
            return forward_step_func
        chunks = model if isinstance(model, list) else [model]
        index = {id(c): k for k, c in enumerate(chunks)}
        parameters = {id(c): list(c.parameters()) for c in chunks}

        @functools.wraps(forward_step_func)
        def forward_step(data_iterator, model, *args, **kwargs):
            output, loss_func = forward_step_func(data_iterator, model, *args, **kwargs)
            self.profile.record_forward_bytes(index[id(model)], saved_activation_bytes(output, parameters[id(model)]))
            return output, loss_func

        return forward_step

    def record_pass(self, op: str, chunk: int, seconds: float) -> None:
        self.profile.record_pass(op, chunk, seconds)

    def end_iteration(self, stats=None) -> None:
        """stats: the iteration's (iteration.IterationStats): what each B left for its W, the allocator's figures."""
        self.profile.iterations += 1
        if stats is None:
            return
        for chunk, nbytes in stats.wgrad_bytes:
            self.profile.record_wgrad_bytes(chunk, nbytes)
        if stats.memory is not None:
            self.memory = stats.memory

    def report(self, chunks: int, pp_rank: int) -> dict:
        """The summary of the window; with memory figures (memory_report.py) when a probe read them."""
        report = dict(self.profile.summary(chunks), pp_rank=pp_rank)
        if self.memory is not None:
            report.update(held_peak_bytes=self.memory.peak, held_in_passes_bytes=self.memory.peak_in_passes,
                          held_source=self.memory.source, model_state_bytes=self.memory.model_state)
        return report


def saved_activation_bytes(output: torch.Tensor, parameters) -> int:
    """Bytes autograd keeps for the backward of `output`: the tensors saved by every node of its graph.

    Walks the graph from output.grad_fn (built-in nodes expose `_saved_*`, custom Functions
    `saved_tensors`). Each storage counts once; weights (saved by linear layers, not activation memory)
    are skipped. Reading the graph changes nothing, unlike saved-tensor hooks, whose unpacked tensors are
    new objects without the weights' attributes that the deferred weight gradients rely on.
    """
    skip = set(storages(list(parameters)))  # wrapper-subclass parameters (TE's) included: tensor_bytes.py
    seen: set[int] = set()
    total = 0
    stack, visited = [getattr(output, "grad_fn", None)], set()
    while stack:
        node = stack.pop()
        if node is None or id(node) in visited:
            continue
        visited.add(id(node))
        for pointer, nbytes in storages(_saved_tensors(node)).items():
            if pointer not in skip and pointer not in seen:
                seen.add(pointer)
                total += nbytes
        stack.extend(next_node for next_node, _ in node.next_functions)
    return total


def _saved_tensors(node) -> list[torch.Tensor]:
    tensors = []
    try:
        tensors += [t for t in getattr(node, "saved_tensors", ()) or () if torch.is_tensor(t)]
    except RuntimeError:  # already freed (a backward ran) or not a custom Function
        pass
    for name in dir(node):
        if name.startswith("_saved_") and not name.startswith("_saved_tensors"):
            try:
                value = getattr(node, name)
            except RuntimeError:
                continue
            values = value if isinstance(value, (tuple, list)) else (value,)
            tensors += [t for t in values if torch.is_tensor(t)]
    return tensors


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def measure_p2p_seconds(pp_group, shape, dtype, device, ops, repeats: int = 5) -> list[float]:
    """One-way seconds of one pipeline tensor, from a ping-pong with each neighbouring rank, posted as the runtime
    posts its messages: batches (`ops`, p2p.P2POps) on the pipeline group, so on the communicator it sends on.

    Every rank of the pipeline group must call this. Pairs (0, 1), (1, 2), ... run one after another;
    the left rank of each pair times `repeats` round trips after one warm-up and returns half the median
    (a list with one figure per pair it led; empty on the last rank).
    """
    rank, size = pp_group.rank(), pp_group.size()
    buffer = torch.zeros(shape, dtype=dtype, device=wire_device(pp_group, device))
    figures = []
    for left in range(size - 1):
        if rank not in (left, left + 1):
            continue
        peer = dist.get_global_rank(pp_group, left + 1 if rank == left else left)
        round_trips = []
        for attempt in range(repeats + 1):
            if rank == left:
                _synchronize(device)
                start = time.perf_counter()
                ops.batch([(True, buffer, peer)], pp_group).wait()
                ops.batch([(False, buffer, peer)], pp_group).wait()
                _synchronize(device)
                if attempt:  # the first exchange may still set the link up
                    round_trips.append(time.perf_counter() - start)
            else:
                ops.batch([(False, buffer, peer)], pp_group).wait()
                ops.batch([(True, buffer, peer)], pp_group).wait()
        if round_trips:
            figures.append(statistics.median(round_trips) / 2)
    return figures
