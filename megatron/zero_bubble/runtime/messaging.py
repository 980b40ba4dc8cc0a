"""What the runtime's messages need, made once per executor: the links, the operations, the watchdog, the faults.

`MessagingOptions` says how (the operations that post a batch: torch.distributed's, or a stand-in a test or the
rehearsal hands in; the watchdog's timeout and whether it ends the job; injected faults); `Messaging` keeps the
pipeline group's links (links.py), hands out a `PipelineTransport` per call, points the watchdog at it, and takes it
all down in `close()`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch.distributed as dist

from .faults import Fault, Faults
from .links import PipelineLinks
from .p2p import P2POps, PipelineTransport, TorchP2P
from .watchdog import PipelineWatchdog

DEFAULT_WATCHDOG_TIMEOUT_S = 120.0  # its line comes well before NCCL's timeout (megatron's default: 10 minutes)


@dataclass(frozen=True)
class MessagingOptions:
    p2p: Callable[[], P2POps] = TorchP2P  # makes the operations that post a batch
    watchdog_timeout_s: float = DEFAULT_WATCHDOG_TIMEOUT_S  # 0: no watchdog
    watchdog_abort: bool = False  # the watchdog ends the job (flight recorder, abort, exit) instead of only saying
    faults: tuple[Fault, ...] = ()


class Messaging:
    def __init__(self, options: MessagingOptions | None = None):
        self.options = options or MessagingOptions()
        self.ops = self.options.p2p()
        self._links: dict[int, PipelineLinks] = {}  # id(pipeline group) -> its links
        self.watchdog: PipelineWatchdog | None = None
        self._faults: Faults | None = None

    @property
    def faults(self) -> Faults:
        if self._faults is None:
            self._faults = Faults(self.options.faults, dist.get_rank() if dist.is_initialized() else 0)
        return self._faults

    def links(self, pp_group) -> PipelineLinks:
        links = self._links.get(id(pp_group))
        if links is None:
            links = self._links[id(pp_group)] = PipelineLinks(pp_group)
        return links

    def transport(self, pp_group, shape, dtype, device, **options) -> PipelineTransport:
        return PipelineTransport(self.links(pp_group), shape, dtype, device, ops=self.ops, **options)

    def watch(self, transport: PipelineTransport | None, needed_by=None) -> None:
        """Point the watchdog at the transport of the call in progress; it stays on it after the call, until the
        next one (where the backend reports completion, what the call posted may complete after it returns)."""
        if self.options.watchdog_timeout_s <= 0:
            return
        if self.watchdog is None:
            pp_rank = transport.links.rank if transport is not None else 0
            store = dist.distributed_c10d._get_default_store() if dist.is_initialized() else None
            self.watchdog = PipelineWatchdog(self.options.watchdog_timeout_s, dist.get_rank(), pp_rank, store=store,
                                             abort=self.options.watchdog_abort)
        self.watchdog.watch(transport, needed_by)

    def close(self) -> None:
        if self.watchdog is not None:
            self.watchdog.close()
            self.watchdog = None
        close = getattr(self.ops, "close", None)
        if close is not None:
            close()
        self._links.clear()
