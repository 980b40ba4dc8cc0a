"""Work and activation memory of one layer by its kind, for the planner's model-shape costs (Costs.from_model).

Kinds are the characters of megatron's --hybrid-layer-pattern, plus `t`, a GPT transformer layer (attention then
MLP, `*` followed by `-`):

- `*` attention (also `D` DSA and `+` MLA, planned as attention): QKV and output projections, 2t h (q + h) FLOPs
  with q = h (1 + 2 g / a) the QKV width (g key/value groups of a heads), and the scores and weighted values, 4t s h;
  B does the projections' input gradients and the core twice, W the projections' weight gradients.
  M_B = t (13h + 5 a s) bytes (norm, projections, scores, softmax and dropout of 16-bit activations), M_W =
  t (6h + 2q) (the projections' inputs and output gradients).
- `-` MLP of width f (fc1 2f wide when gated): 2t h (f1 + f) FLOPs for each of F, B and W; M_B = t (5h + 2 f1 + 2f),
  M_W = t (4h + 2 f1 + 2f). With f = 4h, `*` plus `-` is the paper's layer: F = t h (24h + 4s), B = t h (24h + 8s),
  W = 24 t h^2, M_B = t (34h + 5 a s), M_W = 32 t h.
- `E` MoE: the router (2t h E, E experts), top-k copies of each token through an expert MLP and the shared experts.
- `M` Mamba-2 (inner width d = 2h, or heads x head size; N state size, G groups): in_proj (h to 2d + 2GN + heads)
  and out_proj (d to h); the scan is taken as 6 t d N FLOPs in F and twice that in B, which alone computes its
  weights' gradients (convolution, A, D, dt).
- `G` gated delta net (key width k = key heads x key size, value width v = value heads x value size): in_proj (h to
  2k + 2v + 2 value heads) and out_proj (v to h); the chunked delta rule is taken as 6 t v (key size) FLOPs in F,
  twice in B.

t = s b tokens of a microbatch; memory in bytes of 16-bit activations. These are estimates for the first plan:
measured pass times replace them once the run has profiled (runtime/replan.py).
"""
from __future__ import annotations

from dataclasses import dataclass

from .errors import ScheduleError

GPT_LAYER = "t"  # a GPT transformer layer: attention then MLP
ATTENTION_KINDS = "*D+"  # planned as attention
KINDS = GPT_LAYER + ATTENTION_KINDS + "-EMG"


@dataclass(frozen=True)
class LayerOptions:
    """What the layer kinds' costs need beyond hidden size, heads, sequence length and micro-batch size."""

    ffn_hidden: int | None = None  # MLP width (megatron's --ffn-hidden-size; None: 4 x hidden)
    gated_mlp: bool = False  # a gated linear unit (--swiglu): fc1 twice as wide
    query_groups: int | None = None  # key/value heads of grouped-query attention (None: one per head)
    experts: int = 0  # MoE layers' experts (the router's width)
    moe_topk: int = 1  # experts each token goes through
    moe_ffn_hidden: int | None = None  # an expert's width (None: ffn_hidden)
    moe_shared_ffn: int = 0  # the shared experts' width
    mamba_state: int = 128  # megatron's --mamba-state-dim (its TransformerConfig's defaults here and below)
    mamba_head_dim: int = 64
    mamba_groups: int = 8
    mamba_heads: int | None = None  # None: inner width 2h
    gdn_key_head_dim: int = 128  # megatron's --linear-key-head-dim
    gdn_value_head_dim: int = 128
    gdn_key_heads: int = 16
    gdn_value_heads: int = 32


@dataclass(frozen=True)
class LayerWork:
    """FLOPs of F, B and W, and activation bytes M_B (added by F) and M_W (kept by B for W), of one microbatch."""

    f: int = 0
    b: int = 0
    w: int = 0
    m_b: int = 0
    m_w: int = 0

    def __add__(self, other: "LayerWork") -> "LayerWork":
        return LayerWork(self.f + other.f, self.b + other.b, self.w + other.w, self.m_b + other.m_b,
                         self.m_w + other.m_w)


@dataclass(frozen=True)
class _Shape:
    s: int  # sequence length
    t: int  # tokens of a microbatch
    h: int
    a: int
    options: LayerOptions


def _attention(x: _Shape) -> LayerWork:
    t, h, s, a = x.t, x.h, x.s, x.a
    qkv = h + 2 * h * (x.options.query_groups or a) // a
    linear, core = 2 * t * h * (qkv + h), 4 * t * s * h
    return LayerWork(linear + core, linear + 2 * core, linear, t * (13 * h + 5 * a * s), t * (6 * h + 2 * qkv))


def _mlp_parts(x: _Shape, width: int) -> tuple[int, int, int]:
    """(FLOPs of each of F, B, W; M_B without the norm and dropout; M_W) of one MLP of `width` per token copy."""
    t, h = x.t, x.h
    fc1 = width * (2 if x.options.gated_mlp else 1)
    return 2 * t * h * (fc1 + width), t * (2 * h + 2 * fc1 + 2 * width), t * (4 * h + 2 * fc1 + 2 * width)


def _mlp(x: _Shape) -> LayerWork:
    flops, m_b, m_w = _mlp_parts(x, x.options.ffn_hidden or 4 * x.h)
    return LayerWork(flops, flops, flops, m_b + 3 * x.t * x.h, m_w)  # + its norm's input, the dropout mask


def _moe(x: _Shape) -> LayerWork:
    o, t, h = x.options, x.t, x.h
    if o.experts < 1:
        raise ScheduleError("costs of MoE layers need the number of experts (LayerOptions.experts)")
    flops, m_b, m_w = 2 * t * h * o.experts, t * (5 * h + 2 * o.experts), t * (2 * h + 2 * o.experts)  # router
    expert = _mlp_parts(x, o.moe_ffn_hidden or o.ffn_hidden or 4 * h)
    flops, m_b, m_w = flops + o.moe_topk * expert[0], m_b + o.moe_topk * expert[1], m_w + o.moe_topk * expert[2]
    if o.moe_shared_ffn:
        shared = _mlp_parts(x, o.moe_shared_ffn)
        flops, m_b, m_w = flops + shared[0], m_b + shared[1], m_w + shared[2]
    return LayerWork(flops, flops, flops, m_b, m_w)


def _mamba(x: _Shape) -> LayerWork:
    o, t, h = x.options, x.t, x.h
    inner = o.mamba_heads * o.mamba_head_dim if o.mamba_heads else 2 * h
    conv = inner + 2 * o.mamba_groups * o.mamba_state
    in_width = inner + conv + max(1, inner // o.mamba_head_dim)
    linear, scan = 2 * t * h * in_width + 2 * t * inner * h, 6 * t * inner * o.mamba_state
    return LayerWork(linear + scan, linear + 2 * scan, linear, t * (2 * h + 2 * in_width + 2 * conv + 4 * inner),
                     t * (4 * h + 2 * in_width + 2 * inner))


def _gated_delta_net(x: _Shape) -> LayerWork:
    o, t, h = x.options, x.t, x.h
    keys, values = o.gdn_key_heads * o.gdn_key_head_dim, o.gdn_value_heads * o.gdn_value_head_dim
    in_width = 2 * keys + 2 * values + 2 * o.gdn_value_heads
    linear, rule = 2 * t * h * in_width + 2 * t * values * h, 6 * t * values * o.gdn_key_head_dim
    return LayerWork(linear + rule, linear + 2 * rule, linear,
                     t * (2 * h + 2 * in_width + 2 * (2 * keys + values) + 4 * values),
                     t * (4 * h + 2 * in_width + 2 * values))


_BY_KIND = {"*": _attention, "-": _mlp, "E": _moe, "M": _mamba, "G": _gated_delta_net}


def row_parallel_work(kind: str, seq_length: int, micro_batch: int, hidden: int, heads: int,
                      options: LayerOptions | None = None) -> LayerWork:
    """The part of one layer's W (FLOPs, and M_W bytes) that is its row-parallel layers': attention's output
    projection and a dense MLP's second layer (each keeps its input and a full-width output gradient for W)."""
    x = _Shape(seq_length, seq_length * micro_batch, hidden, heads, options or LayerOptions())
    t, h = x.t, x.h
    w, m_w = 0, 0
    if kind == GPT_LAYER or kind in ATTENTION_KINDS:
        w, m_w = w + 2 * t * h * h, m_w + t * 4 * h
    if kind in (GPT_LAYER, "-"):
        width = x.options.ffn_hidden or 4 * h
        w, m_w = w + 2 * t * h * width, m_w + t * (2 * width + 2 * h)
    return LayerWork(w=w, m_w=m_w)


def layer_work(kind: str, seq_length: int, micro_batch: int, hidden: int, heads: int,
               options: LayerOptions | None = None) -> LayerWork:
    """The work of one layer of `kind` (see KINDS) for one microbatch."""
    x = _Shape(seq_length, seq_length * micro_batch, hidden, heads, options or LayerOptions())
    if kind == GPT_LAYER:
        return _attention(x) + _mlp(x)
    if kind in ATTENTION_KINDS:
        return _attention(x)
    if kind not in _BY_KIND:
        raise ScheduleError(f"no cost model for layer kind {kind!r}; the kinds are {' '.join(KINDS)}")
    return _BY_KIND[kind](x)
