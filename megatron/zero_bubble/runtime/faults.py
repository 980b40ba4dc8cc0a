"""Faults injected on purpose, to prove that a run stops cleanly (no hang, one line per rank) when they happen.

In the convention of megatron's `--error-injection-*` flags, `--zero-bubble-inject-fault KIND:RANK[:SECONDS]` (global
rank; may be given more than once):
- `split-mismatch`: the split check sees a difference on that rank only (its split gradient is perturbed), as a GPU
  kernel that is not bit-reproducible could make one tensor-parallel rank differ from its peer;
- `lost-message`: that rank never posts its last send of an activation or gradient in an iteration (an earlier one
  would shift every later message of its stream onto the wrong receive, as NCCL and gloo match in order);
- `slow-rank`: that rank sleeps SECONDS (default 0.2) before each compute pass.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..schedules.comm import Send, posts
from ..schedules.ops import carries_microbatch

KINDS = ("split-mismatch", "lost-message", "slow-rank")
DEFAULT_SLOW_S = 0.2


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int
    seconds: float = DEFAULT_SLOW_S


def parse_fault(text: str) -> Fault:
    """KIND:RANK[:SECONDS]; ValueError (one line) when it is not one."""
    parts = text.split(":")
    if len(parts) not in (2, 3) or parts[0] not in KINDS:
        raise ValueError(f"expected KIND:RANK[:SECONDS] with KIND one of {', '.join(KINDS)}, got {text!r}")
    try:
        rank, seconds = int(parts[1]), float(parts[2]) if len(parts) == 3 else DEFAULT_SLOW_S
    except ValueError:
        raise ValueError(f"expected a global rank (and seconds) after {parts[0]}:, got {text!r}") from None
    if rank < 0 or seconds < 0:
        raise ValueError(f"rank and seconds must not be negative, got {text!r}")
    return Fault(parts[0], rank, seconds)


class Faults:
    """The faults of one rank (global rank `rank`)."""

    def __init__(self, faults: tuple[Fault, ...] = (), rank: int = 0):
        self.mine = {f.kind: f for f in faults if f.rank == rank}
        self._dropped = False

    def __bool__(self) -> bool:
        return bool(self.mine)

    @property
    def split_mismatch(self) -> bool:
        return "split-mismatch" in self.mine

    def lost_send(self, program: list):
        """The send of `program` (a lowered program) that is lost: its last activation or gradient, once per run."""
        if "lost-message" not in self.mine or self._dropped:
            return None
        sends = [post.msg for post in posts(program) if type(post) is Send and carries_microbatch(post.msg.kind)]
        if not sends:
            return None
        self._dropped = True
        return sends[-1]

    @property
    def delay_s(self) -> float:
        slow = self.mine.get("slow-rank")
        return slow.seconds if slow is not None else 0.0
