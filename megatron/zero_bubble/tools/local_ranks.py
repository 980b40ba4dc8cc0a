"""Ranks on one machine started by one process (the rehearsal, the tests' harness), joined without a port race.

Choosing a free port by binding to port 0, closing the socket and handing the number on leaves a window in which
another process can take the port; two launches that start together then fail with EADDRINUSE. Here rank 0 binds
its store to a port of the kernel's choice and keeps it listening, then writes the number into the run's directory;
the other ranks read it and connect to a store that already listens. torchrun does the same with `--standalone`
(its agent hosts the store), which is what `TORCHRUN_ONE_MACHINE` asks for.

    run_ranks(main, world_size, directory, args, timeout_s, start_method, what)   main(rank, world_size, directory, *args)
    init_group(backend, rank, world_size, directory)                               in each rank, instead of env://

torch is imported by the functions, not here: launchers that only need TORCHRUN_ONE_MACHINE (the demo's driver,
gpu_check's parent) do not pay for its import.
"""
from __future__ import annotations

import os
import time
from typing import Callable

TORCHRUN_ONE_MACHINE = ("--standalone",)  # torchrun's agent binds its store to a port of the kernel's choice
_PORT_FILE = "store_port"


def run_ranks(main: Callable, world_size: int, directory: str, args: tuple, timeout_s: float, start_method: str,
              what: str) -> None:
    """Start `world_size` processes running main(rank, world_size, directory, *args) and wait for them all.

    A rank that raises makes this raise with its traceback (torch.multiprocessing's ProcessRaisedException);
    ranks still running after `timeout_s` are killed and TimeoutError names `what`."""
    import torch.multiprocessing

    context = torch.multiprocessing.start_processes(main, args=(world_size, directory, *args), nprocs=world_size,
                                                    join=False, start_method=start_method)
    deadline = time.monotonic() + timeout_s
    try:
        while not context.join(timeout=max(0.0, deadline - time.monotonic())):
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{what} did not finish on {world_size} ranks in {timeout_s:.0f} s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()


def init_group(backend: str, rank: int, world_size: int, directory: str) -> None:
    """The default process group of a rank started by `run_ranks`, on a store that rank 0 hosts."""
    import torch.distributed as dist
    from torch.distributed.constants import default_pg_timeout

    path = os.path.join(directory, _PORT_FILE)
    timeout = default_pg_timeout  # what init_process_group gives its own store
    if rank == 0:
        store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, timeout=timeout, wait_for_workers=False)
        with open(path + ".tmp", "w") as file:
            file.write(str(store.port))
        os.replace(path + ".tmp", path)  # the others never read a half-written number
    else:
        store = dist.TCPStore("127.0.0.1", _published_port(path, timeout.total_seconds()), world_size,
                              is_master=False, timeout=timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)


def _published_port(path: str, timeout_s: float) -> int:
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path):
        if time.monotonic() >= deadline:
            raise TimeoutError(f"rank 0 did not publish its store's port in {path} within {timeout_s:.0f} s")
        time.sleep(0.01)
    with open(path) as file:
        return int(file.read())
