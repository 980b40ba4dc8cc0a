"""The cost model: time and activation memory of each pass, per virtual stage.

Notation of the paper: T_F, T_B, T_W (time of F, B, W), T_comm (stage-to-stage send), M_B (activation
memory an F adds, all freed by B+W; named m_f here because F adds it) and M_W (what B keeps for W).
Per-stage tuples let the first and last stages carry the embedding and the LM head. `head_t_w` and `head_m_w` are
the output layer's share of the last virtual stage's T_W and M_W, where the costs know it: its W may stay in B
(`head_wgrad_in_b`), which a planner weighs (planners.py) when the output layer's deferred operands are large.
`row_t_w` and `row_m_w` are, per virtual stage, the row-parallel layers' share (attention's output projection and
the dense MLP's second layer, whose output gradients are full width on every tensor-parallel rank): the same choice
for them (`rows_wgrad_in_b`).
Memory is in `memory_unit`: "microbatches" (1.0 = one microbatch's activations of one rank) or "bytes";
times are in `time_unit` ("ms" or "s"), which every printed or drawn figure names.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from functools import partial
from typing import Sequence

from .errors import ScheduleError
from .layer_costs import GPT_LAYER, LayerOptions, LayerWork, layer_work, row_parallel_work

TIME_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6}  # seconds per unit
# Paper's activation-memory ratio M_W / M_B for a typical layer (32sbh vs ~sb(34h+5as)).
DEFAULT_MW_RATIO = 0.5


def _per_stage(value, n: int, what: str) -> tuple[float, ...]:
    if isinstance(value, (int, float)):
        return (float(value),) * n
    values = tuple(float(v) for v in value)
    if len(values) != n:
        raise ScheduleError(f"{what} has {len(values)} values but the pipeline has {n} virtual stages")
    return values


_EMPTY_STAGE = 0.01  # layers a stage without any is planned as (its embedding lookup, its pipeline copies)


def even_layer_counts(layers: int, stages: int) -> list[int]:
    """Layers per virtual stage, as even as they come: what does not divide goes to the middle stages first,
    since the first and the last also carry the embedding and the LM head."""
    per_stage, extra = divmod(layers, stages)
    order = sorted(range(stages), key=lambda v: abs(v - (stages - 1) / 2))
    counts = [per_stage] * stages
    for v in order[:extra]:
        counts[v] += 1
    return counts


def _stage_layers(layers: int, stages: int, counts: Sequence[int] | None,
                  kinds: Sequence[str] | None) -> list[str]:
    """Each virtual stage's layers by kind (a GPT layer is "t"), from `kinds` or from GPT layer counts."""
    if kinds is not None:
        if counts is not None:
            raise ScheduleError("model shape: give the layers per virtual stage as counts or by kind, not both")
        kinds = list(kinds)
        if len(kinds) != stages or sum(map(len, kinds)) != layers:
            raise ScheduleError(f"model shape: {stages} virtual stages holding {layers} layers, got stages {kinds}")
        return kinds
    counts = even_layer_counts(layers, stages) if counts is None else list(counts)
    if len(counts) != stages or sum(counts) != layers or min(counts) < 0:
        raise ScheduleError(f"model shape: {stages} virtual stages holding {layers} layers, got "
                            f"layer counts {counts}")
    return [GPT_LAYER * n for n in counts]


def _scaled(work: LayerWork, factor: float) -> LayerWork:
    return LayerWork(*(factor * getattr(work, name) for name in ("f", "b", "w", "m_b", "m_w")))


def accounted_layer_counts(layers: int, stages: int, embedding: bool = False, loss: bool = False) -> list[int]:
    """megatron's --account-for-embedding-in-pipeline-split / --account-for-loss-in-pipeline-split: the embedding and
    the loss each count as a layer in the even split, taken off the first and the last virtual stage."""
    counts = even_layer_counts(layers + int(embedding) + int(loss), stages)
    counts[0] -= int(embedding)
    counts[-1] -= int(loss)
    return counts


@dataclass(frozen=True)
class Costs:
    t_f: tuple[float, ...]
    t_b: tuple[float, ...]
    t_w: tuple[float, ...]
    m_f: tuple[float, ...]
    m_w: tuple[float, ...]
    t_comm: float = 0.0
    memory_unit: str = "microbatches"
    time_unit: str = "ms"
    head_t_w: float = 0.0  # the output layer's part of the last virtual stage's T_W (0: not known)
    head_m_w: float = 0.0  # and of its M_W: what its W keeps from B to W
    row_t_w: tuple[float, ...] = ()  # per virtual stage, the row-parallel layers' part of T_W (empty: not known)
    row_m_w: tuple[float, ...] = ()  # and of M_W

    def __post_init__(self):
        if self.time_unit not in TIME_UNITS:
            raise ScheduleError(f"costs: time unit {self.time_unit!r} is not one of {', '.join(TIME_UNITS)}")
        n = len(self.t_f)
        for name in ("t_b", "t_w", "m_f", "m_w"):
            if len(getattr(self, name)) != n:
                raise ScheduleError(f"costs: {name} has {len(getattr(self, name))} values, t_f has {n}")
        if min(self.t_f + self.t_b + self.t_w) < 0 or self.t_comm < 0:
            raise ScheduleError("costs: pass times and T_comm must not be negative")
        if not (0 <= self.head_t_w <= self.t_w[-1] * (1 + 1e-9) and 0 <= self.head_m_w <= self.m_w[-1] * (1 + 1e-9)):
            raise ScheduleError("costs: the output layer's T_W and M_W must be parts of the last virtual stage's")
        for name, whole in (("row_t_w", self.t_w), ("row_m_w", self.m_w)):
            part = getattr(self, name)
            if part and (len(part) != n or any(not 0 <= x <= y * (1 + 1e-9) for x, y in zip(part, whole))):
                raise ScheduleError(f"costs: {name} must give each virtual stage a part of its own")

    @property
    def rows_wgrad_known(self) -> bool:
        """Whether the row-parallel layers' W is a known, separate part of the stages'."""
        return any(x > 0 for x in self.row_t_w)

    def rows_wgrad_in_b(self) -> "Costs":
        """The same costs with the row-parallel layers' W run inside B on every virtual stage."""
        if not self.row_t_w:
            return self
        t_b = tuple(b + r for b, r in zip(self.t_b, self.row_t_w))
        t_w = tuple(max(0.0, w - r) for w, r in zip(self.t_w, self.row_t_w))
        m_w = tuple(max(0.0, w - r) for w, r in zip(self.m_w, self.row_m_w or (0.0,) * len(self.m_w)))
        return replace(self, t_b=t_b, t_w=t_w, m_w=m_w, row_t_w=(), row_m_w=())

    @property
    def head_wgrad_known(self) -> bool:
        """Whether the output layer's W is a known, separate part of the last virtual stage's."""
        return self.head_t_w > 0

    def head_wgrad_in_b(self) -> "Costs":
        """The same costs with the output layer's W run inside its B: the last virtual stage's B takes that time
        from its W, and B keeps nothing for it."""
        t_b, t_w, m_w = list(self.t_b), list(self.t_w), list(self.m_w)
        t_b[-1] += self.head_t_w
        t_w[-1] = max(0.0, t_w[-1] - self.head_t_w)
        m_w[-1] = max(0.0, m_w[-1] - self.head_m_w)
        return replace(self, t_b=tuple(t_b), t_w=tuple(t_w), m_w=tuple(m_w), head_t_w=0.0, head_m_w=0.0)

    @property
    def num_virtual_stages(self) -> int:
        return len(self.t_f)

    @classmethod
    def make(
        cls,
        num_virtual_stages: int,
        t_f: float | Sequence[float] = 1.0,
        t_b: float | Sequence[float] = 1.0,
        t_w: float | Sequence[float] = 1.0,
        t_comm: float = 0.0,
        m_f: float | Sequence[float] | None = None,
        m_w: float | Sequence[float] | None = None,
        chunks: int = 1,
        memory_unit: str = "microbatches",
        time_unit: str = "ms",
    ) -> "Costs":
        """Costs from scalars (uniform stages) or per-virtual-stage sequences.

        By default an F on one of a rank's `chunks` adds 1/chunks of a microbatch's activations, so a
        memory limit of p means p M_B whatever the layout.
        """
        n = num_virtual_stages
        m_f = _per_stage(1.0 / chunks if m_f is None else m_f, n, "m_f")
        m_w = tuple(DEFAULT_MW_RATIO * x for x in m_f) if m_w is None else _per_stage(m_w, n, "m_w")
        return cls(
            t_f=_per_stage(t_f, n, "t_f"),
            t_b=_per_stage(t_b, n, "t_b"),
            t_w=_per_stage(t_w, n, "t_w"),
            m_f=m_f,
            m_w=m_w,
            t_comm=float(t_comm),
            memory_unit=memory_unit,
            time_unit=time_unit,
        )

    @classmethod
    def from_model(
        cls,
        *,
        layers: int,
        hidden: int,
        heads: int,
        seq_length: int,
        micro_batch: int,
        vocab: int,
        num_virtual_stages: int,
        layer_counts: Sequence[int] | None = None,
        stage_layers: Sequence[str] | None = None,
        layer_options: LayerOptions | None = None,
        flops_per_second: float = 125e12,
        link_bytes_per_second: float = 25e9,
        bytes_per_element: int = 2,
        time_unit: str = "s",
    ) -> "Costs":
        """Costs from the model shape with the paper's per-layer formulas, for planning before profiling.

        Per GPT layer: F ~ sbh(24h + 4s), B ~ sbh(24h + 8s), W ~ sbh(24h) FLOPs; M_B ~ sb(34h + 5as) and
        M_W ~ 32sbh bytes (16-bit activations). The LM head (2sbhV FLOPs per pass, fp32 logits kept for
        the loss) is added to the last virtual stage. `layer_counts` gives each virtual stage's GPT layers
        (an uneven layout); by default `even_layer_counts`. `stage_layers` gives each virtual stage's layers by
        kind instead (a hybrid model: "*-" an attention and an MLP layer, see layer_costs.py, whose
        `layer_options` size them). A stage without layers (only the embedding, say) is planned as 1% of a GPT
        layer, so that no pass has zero length. The default flops_per_second reproduces the paper's profiled T_F
        of its 1.5B model on A100. Times come out in `time_unit`.
        """
        if min(layers, hidden, heads, seq_length, micro_batch, vocab, num_virtual_stages) < 1:
            raise ScheduleError("model shape: every size must be at least 1")
        if time_unit not in TIME_UNITS:
            raise ScheduleError(f"costs: time unit {time_unit!r} is not one of {', '.join(TIME_UNITS)}")
        flops_per_unit = flops_per_second * TIME_UNITS[time_unit]
        s, b, h = seq_length, micro_batch, hidden
        stage_layers = _stage_layers(layers, num_virtual_stages, layer_counts, stage_layers)
        work = partial(layer_work, seq_length=s, micro_batch=b, hidden=h, heads=heads, options=layer_options)
        empty = work(GPT_LAYER)
        sbh = s * b * h
        head_flops = 2 * sbh * vocab
        rows = partial(row_parallel_work, seq_length=s, micro_batch=b, hidden=h, heads=heads, options=layer_options)
        t_f, t_b, t_w, m_f, m_w, row_t_w, row_m_w = [], [], [], [], [], [], []
        for v, kinds in enumerate(stage_layers):
            row = sum((rows(kind) for kind in kinds), LayerWork())
            row_t_w.append(row.w / flops_per_unit)
            row_m_w.append(row.m_w)  # in the bytes of the layer model (16-bit), as stage.m_w
            head = v == num_virtual_stages - 1
            stage = sum((work(kind) for kind in kinds), LayerWork()) if kinds else _scaled(empty, _EMPTY_STAGE)
            t_f.append((stage.f + (head_flops if head else 0)) / flops_per_unit)
            t_b.append((stage.b + (head_flops if head else 0)) / flops_per_unit)
            t_w.append((stage.w + (head_flops if head else 0)) / flops_per_unit)
            m_f.append(stage.m_b + (4 * s * b * vocab + bytes_per_element * sbh if head else 0))
            m_w.append(stage.m_w + (bytes_per_element * (sbh + s * b * vocab) if head else 0))
        t_comm = bytes_per_element * sbh / link_bytes_per_second / TIME_UNITS[time_unit]
        return cls(tuple(t_f), tuple(t_b), tuple(t_w), tuple(m_f), tuple(m_w), t_comm, "bytes", time_unit,
                   head_t_w=head_flops / flops_per_unit, head_m_w=bytes_per_element * (sbh + s * b * vocab),
                   row_t_w=tuple(row_t_w), row_m_w=tuple(row_m_w))

    def rank_microbatch_memory(self, owners: Sequence[Sequence[int]]) -> list[float]:
        """Activation memory of one whole microbatch on each rank (the M_B of that rank).

        owners[r] lists the virtual stages rank r holds.
        """
        return [sum(self.m_f[v] for v in vs) for vs in owners]

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "Costs":
        fields = {k: data[k] for k in ("t_f", "t_b", "t_w", "m_f", "m_w") if k in data}
        if len(fields) != 5:
            raise ScheduleError("costs JSON needs t_f, t_b, t_w, m_f and m_w")
        return cls(
            **{k: tuple(float(x) for x in v) for k, v in fields.items()},
            t_comm=float(data.get("t_comm", 0.0)),
            memory_unit=str(data.get("memory_unit", "microbatches")),
            time_unit=str(data.get("time_unit", "ms")),
            head_t_w=float(data.get("head_t_w", 0.0)),
            head_m_w=float(data.get("head_m_w", 0.0)),
            row_t_w=tuple(float(x) for x in data.get("row_t_w", ())),
            row_m_w=tuple(float(x) for x in data.get("row_m_w", ())),
        )
