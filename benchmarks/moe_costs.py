"""What re-planning measures for a mixture-of-experts model on CPU, next to the same model without experts.

    python benchmarks/moe_costs.py [--repeats 5] [--stages 2] [--hidden 256] [--seq-length 256] [--experts 8]

Each run is `pretrain_gpt.py --enable-zero-bubble` under torchrun (gloo, one process per pipeline stage) with
a timer window; at its end the runtime gathers the measured T_F, T_B, T_W per stage and re-plans zb-auto, and
the dump of the re-planned schedule carries those costs. From them, per run:
- the W share of each stage's backward, T_W / (T_B + T_W) (each stage holds num_layers / stages transformer
  layers, plus the embedding on the first stage and the output layer and loss on the last);
- the planned bubble rate (each rank's own span, the paper's measure) and makespan of 1F1B and of the
  re-planned zb-auto, both simulated on those costs.
The variants alternate (moe, dense, moe, dense, ...), `--repeats` rounds; printed: min / median / max.

The runtime times a pass from its start, waits for its incoming tensor included: a stage's F that waits for
the previous stage's activations, and its B for the next stage's gradient, count that wait. So the figures free
of waiting are T_F of the first stage, T_B of the last, and every T_W. For the W share of one transformer layer
alone, `--layer` times one MoE layer and one dense layer (same shapes) in one process instead: F, then B with
its weight gradients deferred (the runtime's split), then W, and megatron's fused backward (BW), the variants
alternating for `--repeats` rounds of `--layer-passes` passes each (medians per round).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def model_flags(a, moe: bool) -> list[str]:
    flags = (f"--num-layers {a.layers} --hidden-size {a.hidden} --num-attention-heads {a.heads} "
             f"--seq-length {a.seq_length} --max-position-embeddings {a.seq_length} --micro-batch-size {a.micro_batch} "
             f"--global-batch-size {a.micro_batch * a.microbatches} --tokenizer-type NullTokenizer --vocab-size 1024 "
             f"--mock-data --hidden-dropout 0 --attention-dropout 0 --disable-bias-linear "
             f"--lr 1e-4 --num-workers 0 --eval-iters 0 --eval-interval 100000 --log-interval 1000").split()
    if moe:
        flags += (f"--num-experts {a.experts} --moe-router-topk {a.topk} --moe-aux-loss-coeff 0.01 "
                  f"--moe-token-dispatcher-type alltoall --moe-ffn-hidden-size {a.moe_ffn}").split()
    return flags


def measure(a, moe: bool, work: str) -> dict:
    """One run: the re-planned schedule's measured costs and what the simulator makes of them."""
    from megatron.zero_bubble.schedules import Costs
    from megatron.zero_bubble.schedules.planners import PlanRequest, plan
    from megatron.zero_bubble.schedules.schedule import Schedule
    from megatron.zero_bubble.schedules.validate import validate

    dump = tempfile.mkdtemp(prefix="moe" if moe else "dense", dir=work)
    iters = a.timer_end + 1
    from megatron.zero_bubble.tools.local_ranks import TORCHRUN_ONE_MACHINE

    command = [sys.executable, "-m", "torch.distributed.run", *TORCHRUN_ONE_MACHINE, "--nproc-per-node", str(a.stages),
               "pretrain_gpt.py", *model_flags(a, moe), "--train-iters", str(iters),
               "--pipeline-model-parallel-size", str(a.stages), "--enable-zero-bubble",
               "--zero-bubble-pipeline-timers-start-iter", str(a.timer_start),
               "--zero-bubble-pipeline-timers-end-iter", str(a.timer_end),
               "--zero-bubble-ilp-time-limit", "5", "--zero-bubble-dump-schedule", dump]
    import torch

    if not torch.cuda.is_available():
        command.append("--zero-bubble-cpu")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode:
        raise RuntimeError(f"run failed ({done.returncode}):\n{done.stderr[-3000:]}")
    path = os.path.join(dump, f"zb-auto-m{a.microbatches}-iter{a.timer_end + 1}.json")
    replanned = Schedule.from_json(open(path).read())
    costs = Costs.from_dict(replanned.info["costs"])
    baseline = plan("1f1b", PlanRequest(stages=a.stages, microbatches=a.microbatches, costs=costs))
    ours, theirs = validate(replanned, costs), validate(baseline, costs)
    return {
        "w_share": [w / (b + w) for b, w in zip(costs.t_b, costs.t_w)],
        "t_f_ms": [1e3 * t for t in costs.t_f], "t_b_ms": [1e3 * t for t in costs.t_b],
        "t_w_ms": [1e3 * t for t in costs.t_w],
        "bubble_1f1b": theirs.bubble_rate, "bubble_zb_auto": ours.bubble_rate,
        "makespan_ratio": ours.makespan / theirs.makespan,
    }


def layer_scenario(a, passes: int, repeats: int) -> dict:
    """Rank side (one process): per variant and round, median seconds of F, B, W and fused BW of one layer."""
    import time

    import torch

    from megatron.zero_bubble.patches.megatron_adapter import MegatronAdapter
    from megatron.zero_bubble.runtime.wgrad_store import WeightGradStore
    from tests.megatron import harness, process_groups, rank_model

    process_groups.init_parallel_state()
    megatron = MegatronAdapter()
    layers, stores = {}, {}
    for variant in ("moe", "dense"):
        spec = harness.ModelSpec(num_layers=1, hidden_size=a.hidden, num_attention_heads=a.heads,
                                 seq_length=a.seq_length, micro_batch_size=a.micro_batch, add_bias_linear=False,
                                 **({"num_experts": a.experts, "moe_router_topk": a.topk, "moe_aux_loss_coeff": 0.01}
                                    if variant == "moe" else {}))
        overrides = {"moe_ffn_hidden_size": a.moe_ffn} if variant == "moe" else {}
        layers[variant] = rank_model.build_gpt_chunks(spec, **overrides)[0].decoder.layers[0]
        stores[variant] = WeightGradStore(variant)
        stores[variant].attach(layers[variant], megatron)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(a.seq_length, a.micro_batch, a.hidden, generator=generator)
    grad = torch.randn(a.seq_length, a.micro_batch, a.hidden, generator=generator)

    def one_pass(variant: str, split: bool) -> tuple[float, ...]:
        layer, store = layers[variant], stores[variant]
        inp = x.clone().requires_grad_()
        start = time.perf_counter()
        out = layer(hidden_states=inp, attention_mask=None)[0]
        forward = time.perf_counter()
        if not split:
            torch.autograd.backward(out, grad)
            return forward - start, time.perf_counter() - forward
        with store.split_backward():
            torch.autograd.backward(out, grad)
        store.close_microbatch(0)
        backward = time.perf_counter()
        store.run_next(0)
        return forward - start, backward - forward, time.perf_counter() - backward

    results = {variant: [] for variant in layers}
    for round_ in range(repeats + 1):  # the first round warms up
        for variant in layers:
            split = [one_pass(variant, True) for _ in range(passes)]
            fused = [one_pass(variant, False)[1] for _ in range(passes)]
            if round_:
                f, b, w = (statistics.median(t[i] for t in split) for i in range(3))
                results[variant].append({"t_f": f, "t_b": b, "t_w": w, "t_bw": statistics.median(fused)})
    return results


def _summary(values: list[float], scale: float = 1.0, digits: int = 3) -> str:
    values = [v * scale for v in values]
    return " / ".join(f"{v:.{digits}f}" for v in (min(values), statistics.median(values), max(values)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq-length", type=int, default=256)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--topk", type=int, default=2)
    parser.add_argument("--moe-ffn", type=int, default=512)
    parser.add_argument("--timer-start", type=int, default=2)
    parser.add_argument("--timer-end", type=int, default=6)
    parser.add_argument("--layer", action="store_true", help="time one layer in one process instead")
    parser.add_argument("--layer-passes", type=int, default=10)
    a = parser.parse_args()
    if a.layer:
        from tests.megatron import harness

        rounds = harness.spawn(layer_scenario, 1, a, a.layer_passes, a.repeats, timeout=3600)[0]
        print(f"one transformer layer (h {a.hidden}, s {a.seq_length}, b {a.micro_batch}); MoE: {a.experts} experts, "
              f"top-{a.topk}, expert ffn {a.moe_ffn}; {a.repeats} alternating rounds of {a.layer_passes} passes "
              f"(median each), min / median / max")
        for variant, runs in rounds.items():
            share = [r["t_w"] / (r["t_b"] + r["t_w"]) for r in runs]
            split = [(r["t_b"] + r["t_w"]) / r["t_bw"] for r in runs]
            times = ", ".join(f"T_{k[2:].upper()} {_summary([r[k] for r in runs], 1e3, 2)} ms"
                              for k in ("t_f", "t_b", "t_w", "t_bw"))
            print(f"{variant}: T_W/(T_B+T_W) {_summary(share)}; (T_B+T_W)/T_BW {_summary(split)}; {times}")
        return
    results = {"moe": [], "dense": []}
    with tempfile.TemporaryDirectory(prefix="zb_moe_costs_") as work:
        for round_ in range(a.repeats):
            for variant in results:
                results[variant].append(measure(a, variant == "moe", work))
                print(f"round {round_ + 1} {variant}: {json.dumps(results[variant][-1])}", file=sys.stderr, flush=True)
    print(f"p={a.stages}, m={a.microbatches}, {a.layers} layers (h {a.hidden}, s {a.seq_length}, b {a.micro_batch}); "
          f"MoE: {a.experts} experts, top-{a.topk}, expert ffn {a.moe_ffn}; {a.repeats} alternating rounds, "
          f"min / median / max")
    for variant, runs in results.items():
        print(f"{variant}:")
        for stage in range(a.stages):
            print(f"  stage {stage}: T_W/(T_B+T_W) {_summary([r['w_share'][stage] for r in runs])}; "
                  f"T_F {_summary([r['t_f_ms'][stage] for r in runs], digits=1)} ms, "
                  f"T_B {_summary([r['t_b_ms'][stage] for r in runs], digits=1)} ms, "
                  f"T_W {_summary([r['t_w_ms'][stage] for r in runs], digits=1)} ms")
        print(f"  planned bubble 1F1B {_summary([r['bubble_1f1b'] for r in runs])}, "
              f"zb-auto {_summary([r['bubble_zb_auto'] for r in runs])}; "
              f"zb-auto makespan / 1F1B {_summary([r['makespan_ratio'] for r in runs])}")


if __name__ == "__main__":
    main()
