"""The kinds of pass a schedule is made of, and ONE table of facts per kind.

The simulator, the validator, the memory model, the communication lowering and the pictures read these
rows instead of branching on op names, so a new kind of pass (as the post-validation pass V was) is a new
row here. Costs fields are named, not read, so the rows also apply to anything with the same per-stage
tuples (the automatic planner's Problem).
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from .errors import ScheduleError


class Op(StrEnum):
    """A kind of pass. A str, so `p.op == "F"`, dict keys and the JSON form ("op": "F") work unchanged."""

    F = "F"  # forward
    B = "B"  # gradient w.r.t. the input: on the critical path
    W = "W"  # gradient w.r.t. the weights: deferred into the bubbles
    BW = "BW"  # fused backward (B and W at once), as 1F1B runs it
    V = "V"  # post-validation of the previous optimizer step (post_validation.py)
    S = "S"  # the optimizer step's gradient statistics, summed along the ranks (post_validation.py)


class Kind(StrEnum):
    """What a point-to-point message between ranks carries."""

    ACT = "act"  # an F's output activation
    GRAD = "grad"  # a B's (or BW's) gradient w.r.t. its input
    VALID = "valid"  # the validation result of the optimizer step, on to the next rank of its chain
    STATS = "stats"  # the partial sums of the step's gradient statistics, on to the next rank


KIND_NOUNS = {Kind.ACT: "activation", Kind.GRAD: "gradient", Kind.VALID: "validation result",
              Kind.STATS: "partial step statistics"}

PassKey = tuple[Op, int, int]  # a pass's identity across ranks: (op, microbatch, virtual stage)


@dataclass(frozen=True)
class Needs:
    """A pass runs only after `op` of the same microbatch has ended at virtual stage (its own + offset)."""

    op: Op
    offset: int = 0  # -1: the previous virtual stage, +1: the next; out of range: no such need


@dataclass(frozen=True)
class OpFacts:
    noun: str  # "forward": legends read "F (forward)"
    symbol: str  # one character in text pictures (lower case for later chunks)
    needs: tuple[Needs, ...]  # dependencies; one across stages at most, which is what it receives
    completes: tuple[Op, ...]  # what it counts as for the passes that need it (BW is a B and a W)
    time: tuple[str, ...]  # Costs fields summed into its duration; none: it takes no time of its own
    memory: tuple[tuple[str, int], ...]  # (Costs field, sign) summed into the activation memory it adds
    sends: tuple[Kind, int] | None  # its output's message kind and the virtual stage offset it goes to
    # False: once per rank, as microbatch 0 on the rank's last chunk; its needs and messages then follow the
    # last chunks' virtual stages only (one per rank, so the chain visits every rank once in any layout)
    per_microbatch: bool = True
    precedes: tuple[Op, ...] = ()  # on its rank it must come before every pass of these kinds
    last: bool = False  # on its rank it comes after every other pass
    replay_point: bool = False  # a rollback re-runs what ran before it, so later receives go after it
    split: bool = False  # one half of a split backward (needs the runtime's deferred weight gradients)
    # the pass runs only once the send of this op's output (same microbatch and chunk) completed: the runtime frees
    # that output, so a backward waits for its forward's send
    frees_output_of: "Op | None" = None
    syncs_host: bool = False  # the host reads its result before posting anything after it (nccl_model.py)

    @property
    def takes_time(self) -> bool:
        return bool(self.time)

    def duration(self, costs, vstage: int) -> float:
        return sum((getattr(costs, name)[vstage] for name in self.time), 0.0)

    def memory_change(self, costs, vstage: int) -> float:
        """Activation memory the pass adds (negative: frees), in the costs' memory unit."""
        return sum((sign * getattr(costs, name)[vstage] for name, sign in self.memory), 0.0)

    def linked_stage(self, vstage: int, offset: int, num_vstages: int, stages: int) -> int | None:
        """The virtual stage `offset` away that this op's needs and messages reach, None if there is none
        (past either end; for a once-per-rank op, outside the last chunks' stages)."""
        other = vstage + offset
        lowest = 0 if self.per_microbatch else num_vstages - stages
        return other if lowest <= other < num_vstages else None

    def needed_stages(self, vstage: int, num_vstages: int, stages: int) -> tuple[tuple[Op, int], ...]:
        """The (op, virtual stage) of each need that exists (any microbatch: the same one as the pass's)."""
        linked = ((n.op, self.linked_stage(vstage, n.offset, num_vstages, stages)) for n in self.needs)
        return tuple((op, other) for op, other in linked if other is not None)

    def needs_at(self, mb: int, vstage: int, num_vstages: int, stages: int) -> tuple[PassKey, ...]:
        """The passes that must end first, as (op, microbatch, virtual stage)."""
        return tuple((op, mb, other) for op, other in self.needed_stages(vstage, num_vstages, stages))


TABLE: dict[Op, OpFacts] = {
    Op.F: OpFacts(
        "forward", "F", needs=(Needs(Op.F, -1),), completes=(Op.F,), time=("t_f",),
        memory=(("m_f", 1),), sends=(Kind.ACT, +1),
    ),
    Op.B: OpFacts(
        "input grad", "B", needs=(Needs(Op.F), Needs(Op.B, +1)), completes=(Op.B,), time=("t_b",),
        memory=(("m_w", 1), ("m_f", -1)), sends=(Kind.GRAD, -1), split=True,  # keeps M_W for its W
        frees_output_of=Op.F,
    ),
    Op.W: OpFacts(
        "weight grad", "W", needs=(Needs(Op.B),), completes=(Op.W,), time=("t_w",),
        memory=(("m_w", -1),), sends=None, split=True,
    ),
    Op.BW: OpFacts(
        "fused backward", "#", needs=(Needs(Op.F), Needs(Op.B, +1)), completes=(Op.B, Op.W),
        time=("t_b", "t_w"), memory=(("m_f", -1),), sends=(Kind.GRAD, -1), frees_output_of=Op.F,
    ),
    # The result of the optimizer step walks from the rank of the last virtual stage (p-1; rank 0 in a V)
    # to the others, one rank at a time, before each one's first backward; only its messages' T_comm is
    # planned for (a re-step after a rollback is not).
    Op.V: OpFacts(
        "post-validation", "V", needs=(Needs(Op.V, +1),), completes=(Op.V,), time=(), memory=(),
        sends=(Kind.VALID, -1), per_microbatch=False, precedes=(Op.B, Op.BW), replay_point=True,
        syncs_host=True,  # whether to replay is decided on the host
    ),
    # After its last pass each rank adds its gradient statistics (squared norm, inf/NaN) to the partial
    # sums and passes them on towards the rank of the last virtual stage, which then holds the full sums.
    Op.S: OpFacts(
        "step statistics", "S", needs=(Needs(Op.S, -1),), completes=(Op.S,), time=(), memory=(),
        sends=(Kind.STATS, +1), per_microbatch=False, last=True,
    ),
}
OPS = tuple(Op)
# What every microbatch must get done on each of its virtual stages, whichever passes do it.
MICROBATCH_WORK = tuple(dict.fromkeys(c for f in TABLE.values() if f.per_microbatch for c in f.completes))
# What each op receives: the output (message kind) of its dependency on another stage, and that stage's
# offset; derived from the rows, so sending and receiving cannot disagree.
RECEIVES: dict[Op, tuple[Kind, int] | None] = {
    op: next(((TABLE[n.op].sends[0], n.offset) for n in f.needs if n.offset), None) for op, f in TABLE.items()
}


def facts(op: Op | str) -> OpFacts:
    return TABLE[op]


_BY_NAME = {op.value: op for op in Op}  # a dict lookup: planners build hundreds of thousands of passes


def as_op(value) -> Op:
    try:
        return _BY_NAME[value]
    except (KeyError, TypeError):
        raise ScheduleError(f"unknown op {value!r}; expected one of {', '.join(OPS)}") from None


def per_rank_ops() -> tuple[Op, ...]:
    """Ops that run once per rank rather than once per microbatch (V, S)."""
    return tuple(op for op, f in TABLE.items() if not f.per_microbatch)


def per_rank_chunk(chunks: int) -> int:
    """The chunk a once-per-rank pass names: the rank's last (its stages form a chain over all ranks)."""
    return chunks - 1


def carries_microbatch(kind: Kind) -> bool:
    """Whether messages of this kind belong to one microbatch (not so for a once-per-rank op's output)."""
    return any(f.sends is not None and f.sends[0] == kind for f in TABLE.values() if f.per_microbatch)
