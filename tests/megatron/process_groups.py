"""Megatron's parallel state in a rank that runs many layouts one after another, and the threads it holds.

    rank_groups()                                the thread count right after each group made inside counts toward
                                                 the peak; groups of one rank made inside share one group per rank
    init_parallel_state(tp, pp, vpp, seed, ep)   megatron parallel state (re-initialisable); groups of the previous
                                                 one are reused or destroyed
    destroy_parallel_state(synchronize)          megatron's destroy, then every process group but WORLD
    thread_count() / check_thread_count(where) / now_running(where) / thread_peak()

Megatron's `destroy_model_parallel` only drops its references: a gloo group keeps its two worker threads and its
TCP-loop thread until `torch.distributed.destroy_process_group(group)` and the last reference to it are gone.
`init_parallel_state` reuses the previous groups where megatron asks for the same ones and destroys the rest, so a
rank holds one layout's groups at a time (34 to 59 threads, its groups of one rank shared). A rank whose groups are
made under `rank_groups` raises in `check_thread_count` if it reached MAX_RANK_THREADS at any time, so a leak fails
the test that causes it.
"""
from __future__ import annotations

import contextlib
import gc
import os

import torch

MAX_RANK_THREADS = 75  # a rank with one layout's groups holds 34 to 59; each leaked layout adds 30 or more


def thread_count() -> int:
    """Threads of this process now (Linux: /proc; elsewhere the Python threads only)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        import threading

        return threading.active_count()


# The most threads this process has held so far and where: noted right after each group `rank_groups` makes, which is
# when a rank's thread count grows (so a short-lived excess, groups made before the old ones go, counts too).
_THREAD_PEAK: dict = {"count": 0, "where": None, "now": "start-up"}


def now_running(where: str, reset_peak: bool = False) -> None:
    """Name what runs now (a peak of the thread count is reported with it); `reset_peak` starts a new peak."""
    _THREAD_PEAK["now"] = where
    if reset_peak:
        _THREAD_PEAK["count"] = 0


def thread_peak() -> int:
    return _THREAD_PEAK["count"]


def _note_thread_count() -> None:
    count = thread_count()
    if count > _THREAD_PEAK["count"]:
        _THREAD_PEAK.update(count=count, where=_THREAD_PEAK["now"])


@contextlib.contextmanager
def rank_groups():
    """Every group made inside through torch.distributed.new_group (megatron's create_group looks it up at each call):
    the thread count right after it is noted for `thread_peak` and `check_thread_count` (a sampling thread did this
    every 5 ms: four ranks listing /proc 800 times a second, for nothing between two groups); groups of one rank
    share one group per rank (`_one_rank_group`)."""
    new_group = torch.distributed.new_group

    def new_group_then_note_threads(*args, **kwargs):
        group = _one_rank_group(new_group, args, kwargs)
        if group is None:
            group = new_group(*args, **kwargs)
            _note_thread_count()
        return group

    torch.distributed.new_group = new_group_then_note_threads
    try:
        yield
    finally:
        torch.distributed.new_group = new_group
        _ONE_RANK_GROUPS.clear()


# Groups of one rank share one group per rank: megatron makes 17 of a pp4 rank's 23 groups of one rank (tensor,
# context, data and expert parallel, ...), and each gloo group has three threads and a transport device whose event
# loop wakes every 10 ms whether or not anything is sent: 1.9% of a core per rank with 23 groups, for nothing. A
# collective over one rank is local, so which group carries it changes no result. Megatron's explicit gloo groups
# (backend="gloo") stay their own: its destroy_model_parallel destroys each of them. {rank: its one-rank group}, the
# same keys on every rank (all make the same calls, and torch numbers its groups by call: a rank that skipped a call
# others made would name every later group differently); forgotten whenever groups are destroyed.
_ONE_RANK_GROUPS: dict[int, object] = {}


def _one_rank_group(new_group, args: tuple, kwargs: dict):
    """The group of one rank that new_group(*args, **kwargs) asks for, shared; None where it asks for another."""
    asked = _new_group_arguments(args, kwargs)
    ranks = asked.get("ranks")
    if (ranks is None or len(ranks) != 1 or asked.get("backend") is not None or asked.get("pg_options") is not None
            or asked.get("use_local_synchronization")):
        return None
    (rank,) = ranks
    if rank not in _ONE_RANK_GROUPS:
        _ONE_RANK_GROUPS[rank] = new_group(*args, **kwargs)  # on every rank: the others get NON_GROUP_MEMBER
        _note_thread_count()
    return _ONE_RANK_GROUPS[rank]


def check_thread_count(where: str, limit: int = MAX_RANK_THREADS) -> int:
    """Raise if this process holds `limit` threads or more now, or held that many right after a group was made
    (leaked or doubled process groups); returns the count now."""
    count = thread_count()
    if count >= limit:
        raise RuntimeError(f"{count} threads after {where} (limit {limit}): process groups were left alive")
    if _THREAD_PEAK["count"] >= limit:
        raise RuntimeError(f"{_THREAD_PEAK['count']} threads during {_THREAD_PEAK['where']} (limit {limit}, "
                           f"checked after {where}): process groups were left alive")
    return count


# The groups megatron's current parallel state was built from: {new_group's arguments and occurrence: group}.
_LAYOUT_GROUPS: dict[tuple, object] = {}


def init_parallel_state(tp: int = 1, pp: int = 1, vpp: int | None = None, seed: int = 1234, ep: int = 1) -> None:
    """(Re)initialise megatron's model-parallel groups and RNG tracker; dp = world_size / (tp * pp), of which
    `ep` ranks hold different experts of MoE layers.

    Megatron's state is built afresh each time, but a process group that the new state asks for with the
    same arguments as the previous one (same ranks, backend, description, ...) is handed back instead of
    made again. At the first group that differs the previous groups not yet handed back are destroyed, and
    at the end every other group but WORLD. So a rank holds one layout's groups at a time, and a run of
    scenarios on the same layout creates none after the first.
    """
    from megatron.core import parallel_state, tensor_parallel

    dist = torch.distributed
    _release_training_cycles()
    gc.collect()  # the previous scenario's model, DDP and optimizer (cycles) let go of its groups
    _destroy_megatron_state()
    reusable, made = dict(_LAYOUT_GROUPS), {}
    _LAYOUT_GROUPS.clear()
    new_group = dist.new_group

    def new_or_reused_group(*args, **kwargs):
        key = _group_key(args, kwargs)
        key += (sum(1 for made_key in made if made_key[:-1] == key),)  # the same arguments twice: two groups
        group = reusable.pop(key, None)
        if group not in (None, dist.GroupMember.NON_GROUP_MEMBER) and group not in dist.distributed_c10d._world.pg_map:
            # Only its members could tell (and they would make it anew alone): refuse rather than hang.
            raise RuntimeError("a process group of the previous parallel state was destroyed outside the harness "
                               "(megatron's destroy_model_parallel?): call harness.destroy_parallel_state() instead")
        if group is None and reusable:
            # Another layout: destroy the rest of the previous one before making groups (all ranks get here
            # at the same call), so that a rank never holds two layouts' groups at once.
            reusable.clear()  # first: a group's threads end with its last reference
            _destroy_groups(keep={id(g) for g in made.values()})
        made[key] = group if group is not None else new_group(*args, **kwargs)
        return made[key]

    dist.new_group = new_or_reused_group  # megatron's create_group looks it up at each call
    try:
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp,
            expert_model_parallel_size=ep,
        )
    finally:
        dist.new_group = new_group
        _LAYOUT_GROUPS.update(made)
    _destroy_groups(keep={id(group) for group in made.values()})
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def destroy_parallel_state(synchronize: bool = True) -> None:
    """Megatron's destroy_model_parallel, then destroy every process group but WORLD (megatron's, and any
    other made since: they are all in torch's group map).

    With `synchronize` all ranks first meet at a barrier on WORLD, so that no rank closes a group's
    connections while a peer is still in a collective on it; every rank must then call this together.
    """
    _destroy_megatron_state()
    _release_training_cycles()
    _LAYOUT_GROUPS.clear()
    _destroy_groups(keep=set(), synchronize=synchronize)


def _release_training_cycles() -> None:
    """The reference cycles the garbage collector cannot see, broken as a process's end breaks them
    (training/teardown.py), so that a finished run's groups can go."""
    from megatron.zero_bubble.training import teardown

    teardown.release_training_cycles()


def _destroy_megatron_state() -> None:
    """megatron's destroy_model_parallel and the globals it forgets (training/teardown.py), except that it may not
    destroy groups (the harness does)."""
    from megatron.zero_bubble.training import teardown

    destroy_process_group = torch.distributed.destroy_process_group
    torch.distributed.destroy_process_group = lambda group=None: None  # it destroys its gloo DP groups itself
    try:
        teardown.forget_megatron_groups()
    finally:
        torch.distributed.destroy_process_group = destroy_process_group


def _new_group_arguments(args: tuple, kwargs: dict) -> dict:
    """The arguments of a torch.distributed.new_group call by name (those given)."""
    import inspect

    return inspect.signature(torch.distributed.distributed_c10d.new_group).bind(*args, **kwargs).arguments


def _group_key(args: tuple, kwargs: dict) -> tuple:
    key = []
    for name, value in sorted(_new_group_arguments(args, kwargs).items()):
        if name == "pg_options" and value is not None:
            value = object()  # options compare by identity: never reused
        key.append((name, tuple(value) if isinstance(value, (list, range)) else value))
    return tuple(key)


def _destroy_groups(keep: set[int], synchronize: bool = True) -> None:
    """Destroy every process group in torch's map but WORLD and those whose id() is in `keep`."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return
    if synchronize:  # on every rank: whether a rank holds groups to destroy depends on its rank
        dist.barrier()
    _ONE_RANK_GROUPS.clear()  # on every rank alike (a kept one is made again when asked for: one more, no leak)
    groups = [group for group in dist.distributed_c10d._world.pg_map
              if group is not dist.GroupMember.WORLD and id(group) not in keep]
    if not groups:
        return
    while groups:  # popped, so that no reference outlives the loop
        dist.destroy_process_group(groups.pop())
    # A gloo group's threads end with its C++ object, when the last reference goes: the model, DDP buffers
    # and optimizer of a scenario hold some in reference cycles, some freed only by a later collection
    # (post-validation with overlapped reduction: one that the first collection's finalizers let go).
    while gc.collect():
        pass
