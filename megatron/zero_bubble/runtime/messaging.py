"""What the runtime's messages need, made once per executor: the links, the operations, the watchdog, the faults.

`MessagingOptions` says how (torch.distributed's operations or the strict stand-in of NCCL's, the watchdog's timeout,
injected faults); `Messaging` makes the pair groups of a pipeline on first use (links.py), hands out a
`PipelineTransport` per call, points the watchdog at it, and takes it all down in `close()`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from .faults import Fault, Faults
from .links import PipelineLinks
from .p2p import PipelineTransport, TorchP2P
from .strict_p2p import StrictP2P
from .watchdog import PipelineWatchdog

DEFAULT_WATCHDOG_TIMEOUT_S = 120.0  # well under NCCL's (megatron's --distributed-timeout-minutes: 10)


@dataclass(frozen=True)
class MessagingOptions:
    strict: bool = False  # StrictP2P: NCCL's in-order streams and rendezvous on CPU (tests, rehearsals)
    watchdog_timeout_s: float = DEFAULT_WATCHDOG_TIMEOUT_S  # 0: no watchdog
    faults: tuple[Fault, ...] = ()
    strict_timeout_s: float = DEFAULT_WATCHDOG_TIMEOUT_S  # a strict operation that waits longer fails


class Messaging:
    def __init__(self, options: MessagingOptions | None = None):
        self.options = options or MessagingOptions()
        self.ops = StrictP2P(self.options.strict_timeout_s) if self.options.strict else TorchP2P()
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
            links = self._links[id(pp_group)] = PipelineLinks.make(pp_group)
        return links

    def transport(self, pp_group, shape, dtype, device, **options) -> PipelineTransport:
        return PipelineTransport(self.links(pp_group), shape, dtype, device, ops=self.ops, **options)

    def watch(self, transport: PipelineTransport | None, needed_by=None) -> None:
        """Point the watchdog at the transport of the call in progress (None between calls)."""
        if self.options.watchdog_timeout_s <= 0:
            return
        if self.watchdog is None:
            pp_rank = transport.links.rank if transport is not None else 0
            store = dist.distributed_c10d._get_default_store() if dist.is_initialized() else None
            self.watchdog = PipelineWatchdog(self.options.watchdog_timeout_s, dist.get_rank(), pp_rank, store=store)
        self.watchdog.watch(transport, needed_by)

    def close(self) -> None:
        if self.watchdog is not None:
            self.watchdog.close()
            self.watchdog = None
        if isinstance(self.ops, StrictP2P):
            self.ops.close()
        for links in self._links.values():
            links.close()
        self._links.clear()
