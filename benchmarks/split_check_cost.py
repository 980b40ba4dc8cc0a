"""What the split check at start-up costs, against one training iteration of the same run (CPU, gloo).

    python benchmarks/split_check_cost.py [--layers 4] [--hidden 512] [--microbatches 8] [--reps 5] [--dp 1]

PP=2 (x DP), a GPT of megatron's local layers in megatron DDP, zb-h1 through the executor. Each round times one
training iteration alone (A) and then the split check (B: its own clock, the slowest rank's, in the next call,
which also runs an iteration); rounds repeat `--reps` times after a warm-up round, so A and B alternate. Printed:
min / median / max of both and the check's median in iterations.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.megatron import harness, process_groups, rank_model  # noqa: E402  (spawn and the deterministic tiny GPT)


def scenario(spec, m: int, reps: int, pp: int) -> dict:
    import torch
    from megatron.zero_bubble.schedules.planners import PlanRequest, plan
    from megatron.zero_bubble.training.session import ZeroBubbleSession

    schedule = plan("zb-h1", PlanRequest(stages=pp, microbatches=m, ilp_time_limit=0))
    with ZeroBubbleSession(schedule_for=lambda _: schedule, split_check=True, log=lambda line: None) as session:
        process_groups.init_parallel_state(pp=pp)
        chunks = rank_model.wrap_in_ddp(rank_model.build_gpt_chunks(spec))
        check = session.executor.split_check
        iterations, checks = [], []
        for rep in range(reps + 1):
            for with_check in (False, True):
                check.done = not with_check
                for chunk in chunks:
                    chunk.zero_grad_buffer()
                torch.distributed.barrier()
                start = time.perf_counter()
                rank_model.run_forward_backward(chunks, spec, m, rep * m)
                torch.distributed.barrier()
                elapsed = time.perf_counter() - start
                if rep and with_check:
                    checks.append(max(r.seconds for r in check.results))
                elif rep:
                    iterations.append(elapsed)
        layers = sum(r.deferred_layers for r in check.results)
    return {"iteration": iterations, "check": checks, "layers": layers, "ranks": len(check.results)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--pp", type=int, default=2)
    args = parser.parse_args(argv)
    spec = harness.ModelSpec(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=8,
                             seq_length=args.seq, vocab_size=1024, micro_batch_size=2)
    harness.preload_megatron()
    results = harness.spawn(scenario, args.pp, spec, args.microbatches, args.reps, args.pp, timeout=3600,
                            start_method="fork")
    r = results[0]
    ms = lambda v: f"{min(v) * 1e3:.0f} / {statistics.median(v) * 1e3:.0f} / {max(v) * 1e3:.0f} ms"  # noqa: E731
    print(f"GPT {args.layers} layers, hidden {args.hidden}, seq {args.seq}, micro batch 2, m = {args.microbatches}, "
          f"PP={args.pp}, zb-h1, CPU (gloo), {args.reps} alternating rounds after a warm-up; min / median / max")
    print(f"one training iteration: {ms(r['iteration'])}")
    print(f"split check ({r['layers']} layers on {r['ranks']} ranks): {ms(r['check'])} "
          f"= {statistics.median(r['check']) / statistics.median(r['iteration']):.2f} iterations (ratio of medians)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
