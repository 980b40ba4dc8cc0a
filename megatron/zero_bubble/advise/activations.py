"""Activation memory per microbatch and GPU: what one F leaves for its backward (M_F) and what one B leaves for its
W (M_W), per transformer layer, for the embedding and for the LM head, in bytes.

Counted tensor by tensor, as megatron-core's modules save them (per token of the GPU's share of the sequence;
d = bytes of the 16- or 32-bit activations, h/TP where tensor parallelism splits a width, the h-wide tensors in the
sequence-parallel region split by TP under --sequence-parallel):
- a norm keeps its input (Transformer Engine and megatron's local LayerNorm; torch's RMSNorm keeps an fp32 copy of
  the input and the normalised input), each linear layer its input;
- attention: q, k and v (the fused QKV output, or copies with grouped queries), and for unfused attention (the
  local implementation) the softmax output, per head a row of s scores, plus the dropout mask and output;
  flash/fused attention (Transformer Engine) keeps only its output and an fp32 log-sum-exp per head;
- the MLP: GeLU keeps its input and output; SwiGLU its two-halved input and output when fused, and in megatron's
  local unfused form also the activation, the linear half (with megatron's offset added) and the product;
- MoE: the router's scores and indices, the tokens routed to the experts (k copies per token: the experts' input),
  per expert the MLP's activations (plus the routing-probability product in the local experts), shared experts as
  an MLP;
- dropout: a mask per element (a bool on CUDA; on the CPU a mask of the activation's type);
- the LM head: the final norm, the output layer's input and the cross entropy's fp32 softmax over the vocabulary.
M_W is, per linear layer whose weight gradient waits for W, its input and its output gradient.

Activation recompute: "full" keeps each recomputed block's input only; "selective" drops what its modules
(core_attn, mlp, moe, moe_act, shared_experts, layernorm) recompute.
"""
from __future__ import annotations

from dataclasses import dataclass

from .run import Run, Tally

CE_EXTRA_BYTES = 17  # per token: the int64 target, its mask and the fp32 loss of megatron's vocabulary-parallel CE
EMBEDDING_BYTES = 12  # per token: the int64 token ids and the position ids the embedding lookups keep


@dataclass(frozen=True)
class Saved(Tally):
    """Bytes per microbatch on one GPU: `forward` (M_F, added by F) and `wgrad` (M_W, kept by B for W)."""

    forward: float = 0.0
    wgrad: float = 0.0


class _Widths:
    """Per-token sizes of one GPU's tensors for a run (elements, and bytes where the type is fixed)."""

    def __init__(self, run: Run):
        m, layout, n, k = run.model, run.layout, run.numerics, run.kernels
        self.run, self.model = run, m
        t = layout.tp
        self.d = n.activation_bytes
        # Under FP8 on TE's layers W keeps each linear layer's input as its FP8 transpose alone (1 byte) and its
        # output gradient as both FP8 copies B quantized (row-wise for the input gradient, column-wise for W: 2 bytes)
        fp8_te = n.fp8 and k.transformer_impl == "transformer_engine"
        self.linear_input_bytes = 1 if fp8_te else self.d
        self.output_grad_bytes = 2 if fp8_te else self.d
        self.tokens = m.seq_length // layout.cp * layout.micro_batch  # of the GPU's sequence share
        self.sp = t if layout.sequence_parallel else 1
        self.h, self.h_sp = m.hidden, m.hidden / self.sp
        self.heads, self.groups, self.kv = m.heads / t, m.query_groups / t, m.kv_channels
        self.mask = k.mask_bytes(self.d)
        self.local = k.transformer_impl == "local"
        self.unfused_act = not k.fused_activation  # megatron's bias-activation fusions off
        recompute = run.recompute
        self.selective = set(recompute.modules) if recompute.granularity == "selective" else set()

    def norm(self, width: float) -> float:
        """Bytes a norm keeps for one token (its output is the next linear layer's input, counted there)."""
        if self.local and self.model.normalization == "RMSNorm":
            return 2 * width * 4 + 4  # torch's RMSNorm: fp32 input and normalised input, fp32 rstd
        stats = 2 * 4 if self.model.normalization == "LayerNorm" else 4
        if self.local:
            stats = 2 * self.d  # torch's layer norm keeps mean and rstd in the input's type
        return width * self.d + stats


def _attention(w: _Widths) -> float:
    """Bytes per token from the QKV linear's input to the output projection's input, dropout included."""
    m, run, d = w.model, w.run, w.d
    out = w.norm(w.h_sp) * ("layernorm" not in w.selective) + w.h_sp * w.linear_input_bytes  # norm, QKV input
    recomputed = "core_attn" in w.selective
    if run.kernels.flash_attention:
        out += (w.heads + 2 * w.groups) * w.kv * d  # the QKV output q, k and v are views of
        out += 0 if recomputed else w.heads * 4  # the fp32 log-sum-exp
    elif recomputed:  # the checkpoint keeps its inputs, views of the QKV output
        out += (w.heads + 2 * w.groups) * w.kv * d
    else:
        out += 3 * w.heads * w.kv * d  # q, k and v (with grouped queries: q and the repeated k, v as copies)
        scores = w.heads * (m.seq_length // run.layout.cp)
        softmax = 4 if run.numerics.softmax_in_fp32 and d == 2 else d
        out += scores * softmax
        if m.attention_dropout > 0:
            out += scores * (w.mask + d)  # the mask and the dropped-out probabilities
        elif softmax != d:
            out += scores * d  # the probabilities cast back for the product with v
    out += w.heads * w.kv * d  # the output projection's input (flash attention's output)
    if w.linear_input_bytes != d:
        out += w.heads * w.kv * w.linear_input_bytes  # its fp8 copy
    if m.hidden_dropout > 0:
        out += w.h_sp * w.mask
    return out


def _activation(w: _Widths, ffn: float) -> float:
    """Bytes per token an MLP's activation keeps (fc2's input included), for an fc1 output of `ffn` (per GPU)."""
    d = w.d
    if w.model.swiglu:
        return (5 if w.unfused_act else 3) * ffn * d
    return 2 * ffn * d


def _mlp(w: _Widths, ffn_hidden: int, tp: int) -> Saved:
    """A dense MLP (fc1's input counted by the caller): forward bytes and fc1/fc2's M_W per token."""
    ffn = ffn_hidden / tp
    fc1_out = ffn * (2 if w.model.swiglu else 1)
    forward = 0.0 if "mlp" in w.selective else _activation(w, ffn)
    wgrad = (w.h_sp + ffn) * w.linear_input_bytes + (fc1_out + w.h) * w.output_grad_bytes  # inputs, output grads
    return Saved(forward, wgrad)


def _moe(w: _Widths) -> Saved:
    """The router, the routed tokens and the experts (k routed copies of each token, spread evenly over the
    experts), per token of the sequence; under sequence parallelism a GPU routes its 1/TP of them. Plus the shared
    experts, an MLP."""
    routed = _routed(w).scaled(1 / w.sp)
    shared = w.model.moe.shared_ffn_hidden
    if not shared:
        return routed
    mlp = _mlp(w, shared, w.run.layout.tp)
    return routed + (Saved(0.0, mlp.wgrad) if "shared_experts" in w.selective else mlp)


def _routed(w: _Widths) -> Saved:
    moe, run, d = w.model.moe, w.run, w.d
    if "moe" in w.selective:
        return Saved(0.0, _expert_wgrad(w))
    forward = 4 * moe.experts + 20 * moe.topk  # fp32 scores; top-k probabilities and int64 indices
    routed = moe.topk  # copies of each token at the experts
    forward += routed * w.h * d  # the routed tokens: the experts' input
    ffn = moe.ffn_hidden / run.layout.etp
    if "moe_act" in w.selective:
        forward += routed * ffn * (2 if w.model.swiglu else 1) * d
    else:
        per_token = _activation(w, ffn)
        if w.local:
            per_token += ffn * d  # the local experts scale their activation by the routing probability
        forward += routed * per_token
    return Saved(forward, _expert_wgrad(w))


def _expert_wgrad(w: _Widths) -> float:
    moe = w.model.moe
    ffn = moe.ffn_hidden / w.run.layout.etp
    fc1_out = ffn * (2 if w.model.swiglu else 1)
    return moe.topk * ((w.h + ffn) * w.linear_input_bytes + (fc1_out + w.h) * w.output_grad_bytes)


def layer_saved(run: Run, layer: int, widths: _Widths | None = None) -> Saved:
    """One transformer layer, per microbatch on one GPU, before activation recompute of whole layers."""
    w = widths or _Widths(run)
    m, d = run.model, w.d
    qkv_out = (w.heads + 2 * w.groups) * w.kv
    # QKV and the projection: their inputs and output gradients
    wgrad = (w.h_sp + w.heads * w.kv) * w.linear_input_bytes + (qkv_out + w.h) * w.output_grad_bytes
    forward = _attention(w)
    forward += w.norm(w.h_sp) * ("layernorm" not in w.selective) + w.h_sp * w.linear_input_bytes  # fc1's input
    if m.is_moe_layer(layer):
        mlp = _moe(w)
    else:
        mlp = _mlp(w, m.ffn_hidden, run.layout.tp)
    if m.hidden_dropout > 0:
        forward += w.h_sp * w.mask
    return Saved(forward + mlp.forward, wgrad + mlp.wgrad).scaled(w.tokens)


def row_parallel_wgrad(run: Run, layer: int) -> float:
    """The part of a layer's M_W (bytes per microbatch) its row-parallel layers keep: attention's output projection
    and a dense MLP's second layer, each its input and a full-width output gradient (as `layer_saved` counts them)."""
    w = _Widths(run)
    kept = w.heads * w.kv * w.linear_input_bytes + w.h * w.output_grad_bytes
    if not run.model.is_moe_layer(layer):
        kept += run.model.ffn_hidden / run.layout.tp * w.linear_input_bytes + w.h * w.output_grad_bytes
    return kept * w.tokens


def embedding_saved(run: Run) -> Saved:
    w = _Widths(run)
    forward = EMBEDDING_BYTES + (w.h_sp * w.mask if run.model.hidden_dropout > 0 else 0.0)
    return Saved(forward * w.tokens, 0.0)


def head_saved(run: Run) -> Saved:
    """The final norm, the output layer and the loss, per microbatch on one GPU."""
    w = _Widths(run)
    vocab = run.model.vocab / run.layout.tp
    forward = w.norm(w.h_sp) + w.h_sp * w.linear_input_bytes + vocab * 4 + CE_EXTRA_BYTES
    wgrad = w.h_sp * w.linear_input_bytes + vocab * w.d
    return Saved(forward * w.tokens, wgrad * w.tokens)


def _recomputed_blocks(run: Run, count: int) -> list[int]:
    """Full recompute: the sizes of the blocks of a stage's `count` layers whose input alone is kept."""
    r = run.recompute
    n = r.num_layers or 1
    if r.method == "block":
        return [min(n, count)] if count else []
    return [min(n, count - start) for start in range(0, count, n)]


def stage_saved(run: Run, counts: list[int]) -> list[Saved]:
    """Per virtual stage (virtual-stage order, `counts` layers each): M_F and M_W of one microbatch."""
    w = _Widths(run)
    block_input = w.h_sp * w.d * w.tokens / (run.layout.tp if run.recompute.distribute_saved else 1)
    out, first = [], 0
    for v, count in enumerate(counts):
        layers = [layer_saved(run, layer, w) for layer in range(first, first + count)]
        saved = Saved()
        for layer in layers:
            saved += layer
        if run.recompute.granularity == "full":
            recomputed = sum(_recomputed_blocks(run, count))
            forward = sum(layer.forward for layer in layers[recomputed:])
            forward += block_input * len(_recomputed_blocks(run, count))
            saved = Saved(forward, saved.wgrad)
        if v == 0:
            saved += embedding_saved(run)
        if v == len(counts) - 1:
            saved += head_saved(run)
        out.append(saved)
        first += count
    return out


def pipeline_tensor_bytes(run: Run) -> float:
    """One activation (or its gradient) sent between pipeline stages: [s/CP (/TP with SP), b, h]."""
    w = _Widths(run)
    return w.tokens * w.h_sp * w.d
