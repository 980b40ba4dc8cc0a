"""What advise prints: what it read, a table of the schedules, and the flags for the best one that fits."""
from __future__ import annotations

from .advice import GIB, Advice, Prediction, median
from .parameters import ModelState
from .run import Run


def size(value: float) -> str:
    """Bytes as people read them: GiB from one GiB on, MiB below."""
    if value >= GIB:
        return f"{value / GIB:.1f} GiB"
    return f"{value / 2**20:.1f} MiB"


def describe_run(run: Run) -> list[str]:
    m, layout, n, k, r = run.model, run.layout, run.numerics, run.kernels, run.recompute
    ffn = f"FFN {m.ffn_hidden}" + (" (SwiGLU)" if m.swiglu else "")
    heads = f"{m.heads} heads" + (f" in {m.query_groups} query groups" if m.query_groups != m.heads else "")
    tied = "tied" if m.tied_embeddings else "untied"
    lines = [f"  model      {m.layers} layers, hidden {m.hidden}, {ffn}, {heads} of {m.kv_channels}, sequence "
             f"{m.seq_length}, vocabulary {m.vocab} (padded), {m.normalization}, {m.position_embedding} positions, "
             f"{tied} embeddings"]
    if m.moe is not None:
        shared = f", shared experts' FFN {m.moe.shared_ffn_hidden}" if m.moe.shared_ffn_hidden else ""
        lines.append(f"  experts    {m.moe.experts} in {sum(m.moe.layers)} of {m.layers} layers, top-{m.moe.topk}, FFN "
                     f"{m.moe.ffn_hidden} each{shared}")
    lines.append(f"  layout     TP {layout.tp} x PP {layout.pp} x CP {layout.cp} x DP {layout.dp} = {layout.world} "
                 f"GPUs" + (f", EP {layout.ep}" if m.moe is not None else "")
                 + (", sequence parallel" if layout.sequence_parallel else "")
                 + f"; micro batch {layout.micro_batch}, global batch {layout.global_batch}: m = "
                 f"{layout.microbatches} microbatches per pipeline")
    optimizer = n.optimizer + (f", distributed optimizer over {layout.dp * layout.cp} replicas"
                               if n.distributed_optimizer else "")
    lines.append(f"  numerics   {n.params}" + (f", fp8 {n.fp8}" if n.fp8 else "") + f"; gradients {n.grad}; "
                 f"{optimizer}")
    recompute = (r.granularity or "no") + " recompute" + (f" ({', '.join(r.modules)})" if r.modules else "")
    attention = "flash attention" if k.flash_attention else "unfused attention"
    lines.append(f"  kernels    {k.transformer_impl} on {k.device}, {attention}; {recompute}")
    return lines


def describe_state(state: ModelState) -> str:
    text = (f"weights {size(state.weights)}, gradients {size(state.gradients)}, optimizer state "
            f"{size(state.optimizer)}")
    return text + (f", buffers {size(state.buffers)}" if state.buffers else "")


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def table(advice: Advice) -> list[str]:
    """One row per schedule: its bubble, its time over the baselines', and the GPU with the highest peak: the peak,
    that GPU's model state and its activations' peak, and its pipeline rank."""
    lines = [f"{'schedule':30s} {'bubble':>7s} {'time/1F1B':>9s} {'time/interl.':>12s} {'peak/GPU':>10s} "
             f"{'= model state':>14s} {'+ activations':>14s} {'(rank)':>6s}  fits {size(advice.gpu_memory)}"]
    for p in advice.predictions:
        rank = p.peak_rank
        lines.append(f"{p.candidate.label:30s} {p.bubble_rate:7.2%} {_ratio(advice.relative(p, '1f1b')):>9s} "
                     f"{_ratio(advice.relative(p, 'interleaved-1f1b')):>12s} {size(p.peak):>10s} "
                     f"{size(p.state[rank].total):>14s} {size(p.activations[rank]):>14s} {rank:>6d}  "
                     f"{'yes' if p.peak <= advice.gpu_memory else 'no'}")
    for s in advice.skipped:
        lines.append(f"{s.candidate.label:30s} does not apply: {s.reason}")
    kept = [f"{p.candidate.label} ({', '.join(p.wgrad_in_b)})" for p in advice.predictions if p.wgrad_in_b]
    if kept:
        lines.append(f"  W kept inside B (a faster plan than deferring it) in: {', '.join(kept)}")
    return lines


def missed_aims(advice: Advice) -> list[str]:
    """One line for each row that takes more time over 1F1B's than it is meant to (Candidate.aim), and why."""
    lines = []
    for p in advice.predictions:
        ratio = advice.relative(p, "1f1b")
        if p.candidate.aim is None or ratio is None or ratio <= p.candidate.aim + 1e-9:
            continue
        aim = ("no slower than 1F1B" if p.candidate.aim == 1.0 else
               f"within {p.candidate.aim - 1:.0%} of 1F1B's time")
        lines.append(f"{p.candidate.label} misses its aim ({aim}): {ratio:.3f}x 1F1B's time; {_why(advice, p)}")
    return lines


def _why(advice: Advice, p: Prediction) -> str:
    """What holds a V back here: the memory W's deferral takes beside the activations, and what rank 0 carries with
    both ends of the model; then the idle time its memory leaves."""
    limit = p.candidate.memory_limit
    memory = f"{limit:g} microbatches" if isinstance(limit, (int, float)) else _limit_json(limit)
    m_f, m_w = p.held_per_microbatch
    reasons = []
    if m_w > m_f:
        reasons.append(f"W's deferred operands outweigh an F's activations (M_W {size(m_w)} against M_F {size(m_f)} "
                       f"per virtual stage), so the memory it is named for leaves little room to defer W")
    middle = median(p.busy[1:])
    if middle > 0:
        reasons.append(f"the V puts both ends of the model on pipeline rank 0, whose passes take "
                       f"{p.busy[0] / middle - 1:.1%} longer than the other ranks' and whose model state is "
                       f"{size(p.state[0].total - median(state.total for state in p.state[1:]))} larger")
    one_f_one_b = advice.by_planner("1f1b")
    baseline = f" (1F1B: {one_f_one_b.bubble_rate:.2%})" if one_f_one_b is not None else ""
    return "; ".join(reasons + [f"at {memory} per rank {p.bubble_rate:.2%} of each rank's span is idle{baseline}"])


def recommendation(advice: Advice) -> list[str]:
    best = advice.best
    cap = size(advice.gpu_memory)
    if best is None:
        return _none_fits(advice)
    lines = [f"best under {cap}: {best.candidate.label} (bubble {best.bubble_rate:.2%}, "
             f"{_ratio(advice.relative(best, '1f1b'))} x 1F1B's time, peak {size(best.peak)} on pipeline rank "
             f"{best.peak_rank}: {describe_state(best.state[best.peak_rank])}, activations "
             f"{size(best.activations[best.peak_rank])})"]
    if best.change.add:
        lines.append("  add:  " + " ".join(best.change.add))
    if best.change.drop:
        lines.append("  drop: " + " ".join(best.change.drop))
    if not best.change.add and not best.change.drop:
        lines.append("  the command line asks for it already: no flag to change")
    return lines


def _none_fits(advice: Advice) -> list[str]:
    if not advice.predictions:
        return ["no schedule applies to this command line (see the reasons above)"]
    least = min(advice.predictions, key=lambda p: p.peak)
    rank = least.peak_rank
    state, activations = least.state[rank], least.activations[rank]
    lines = [f"no schedule fits in {size(advice.gpu_memory)}: the least memory is {least.candidate.label}'s, "
             f"{size(least.peak)} on pipeline rank {rank} ({describe_state(state)}, activations {size(activations)})"]
    if state.total > advice.gpu_memory:
        lines.append("  the model state alone is above the cap: shard it further (--use-distributed-optimizer, more "
                     "data-parallel replicas for it, or more tensor / pipeline parallelism)")
    else:
        lines.append("  the activations do not fit beside the model state: a smaller --micro-batch-size, activation "
                     "recompute (--recompute-activations, --recompute-granularity full), or more tensor / pipeline "
                     "parallelism")
    return lines


def _limit_json(limit):
    """In-flight microbatches as a number, a multiple of 1F1B's peak as its text ("1x 1F1B's peak")."""
    return limit.describe() if hasattr(limit, "describe") else limit


def as_json(advice: Advice) -> dict:
    def row(p: Prediction) -> dict:
        return {
            "label": p.candidate.label, "planner": p.candidate.planner, "chunks": p.candidate.chunks,
            "memory_limit": _limit_json(p.candidate.memory_limit), "bubble_rate": p.bubble_rate, "makespan": p.makespan,
            "time_unit": p.time_unit, "time_vs_1f1b": advice.relative(p, "1f1b"),
            "time_vs_interleaved": advice.relative(p, "interleaved-1f1b"), "peak_bytes": p.peak,
            "peak_rank": p.peak_rank, "peak_bytes_per_rank": list(p.peak_per_rank),
            "activation_bytes_per_rank": list(p.activations),
            "model_state_per_rank": [vars(s) for s in p.state], "fits": p.peak <= advice.gpu_memory,
            "add": list(p.change.add), "drop": list(p.change.drop), "wgrad_in_b": list(p.wgrad_in_b)}

    best = advice.best
    return {"gpu_memory_bytes": advice.gpu_memory, "costs_from": advice.costs_from,
            "stages": advice.run.layout.pp, "microbatches": advice.run.layout.microbatches,
            "schedules": [row(p) for p in advice.predictions],
            "not_applicable": [{"label": s.candidate.label, "reason": s.reason} for s in advice.skipped],
            "best": None if best is None else best.candidate.label, "notes": list(advice.run.notes),
            "missed_aims": missed_aims(advice)}
