"""Runtime benchmark on CPU: megatron's 1F1B vs the zero-bubble schedules through our executor (PP=2, gloo).

Prints, in one run: the median iteration time of each schedule and its ratio to megatron's 1F1B, next
to the simulator's prediction from the pass times profiled in the same run; T_B + T_W of the split
backward against the fused backward T_BW; and whole training iterations (forward-backward + Adam step,
no barrier between iterations) with megatron's synchronous step against optimizer post-validation.
    python benchmarks/runtime_cpu.py [--iterations 6] [--hidden 512] [--microbatches 8]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.megatron import harness  # noqa: E402  (spawn and the deterministic tiny GPT)

SCHEDULES = ("1f1b", "zb-h1", "zb-h2", "zb-auto")
POST_VALIDATION_SCHEDULES = ("zb-h1", "zb-h2")


def _plan(name: str, stages: int, microbatches: int, post_validation: bool = False):
    """The schedule that runs (planned for uniform costs; deterministic, so main() rebuilds the same one)."""
    from megatron.zero_bubble.schedules.planners import PlanRequest, plan

    return plan(name, PlanRequest(stages=stages, microbatches=microbatches, ilp_time_limit=0,
                                  post_validation=post_validation))


def _time_iterations(chunks, spec, m, iterations):
    import torch

    times = []
    for it in range(iterations + 1):  # the first one warms up
        for p in (p for c in chunks for p in c.parameters()):
            p.grad = None
        torch.distributed.barrier()
        start = time.perf_counter()
        harness.run_forward_backward(chunks, spec, m, it * m)
        torch.distributed.barrier()
        if it:
            times.append(time.perf_counter() - start)
    return times


def _time_training(chunks, optimizer, spec, m, iterations, flush=None) -> float:
    """Seconds per training iteration over `iterations` back-to-back ones (after one warm-up), as a loop runs them."""
    import torch

    def one(it):
        for chunk in chunks:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        harness.run_forward_backward(chunks, spec, m, it * m)
        optimizer.step()

    one(0)
    if flush is not None:
        flush()
    torch.distributed.barrier()
    start = time.perf_counter()
    for it in range(1, iterations + 1):
        one(it)
    if flush is not None:
        flush()
    torch.distributed.barrier()
    return (time.perf_counter() - start) / iterations


def training_scenario(spec, m: int, iterations: int) -> dict:
    """Per schedule: seconds per iteration with megatron's synchronous step and with post-validation."""
    from megatron.core import parallel_state
    from megatron.core.optimizer import OptimizerConfig
    from megatron.zero_bubble.patches import linear_wgrad, optimizer_step, schedule_selection
    from megatron.zero_bubble.runtime.executor import PipelineExecutor
    from megatron.zero_bubble.runtime.post_validation import PostValidation

    harness.init_parallel_state(pp=2)
    chunks = harness.wrap_in_ddp(harness.build_gpt_chunks(spec))
    config = OptimizerConfig(optimizer="adam", lr=1e-4, weight_decay=0.01, clip_grad=1000.0)
    linear_wgrad.install()
    executor = PipelineExecutor(lambda _: None)
    schedule_selection.install(executor)
    seconds = {}
    for name in POST_VALIDATION_SCHEDULES:
        for post_validation in (False, True):
            optimizer = harness.make_optimizer(chunks, config)
            schedule = _plan(name, 2, m, post_validation)
            executor.plan_for, flush = (lambda _: schedule), None
            if post_validation:
                controller = PostValidation(optimizer, pp_group=parallel_state.get_pipeline_model_parallel_group(),
                                            stage_group=parallel_state.get_tensor_model_parallel_group())
                optimizer_step.install(controller, chunks)
                executor.post_validation, flush = controller, controller.flush
            seconds[(name, post_validation)] = _time_training(chunks, optimizer, spec, m, iterations, flush)
            optimizer_step.uninstall()
            executor.post_validation = None
    schedule_selection.uninstall()
    executor.release()
    linear_wgrad.uninstall()
    return {"rank": parallel_state.get_pipeline_model_parallel_rank(), "seconds": seconds}


def _comm_time(shape) -> float:
    """One-way time of a pipeline tensor between the two ranks (the runtime's own ping-pong measurement)."""
    import torch
    from megatron.core import parallel_state
    from megatron.zero_bubble.runtime.profiling import measure_p2p_seconds

    figures = measure_p2p_seconds(parallel_state.get_pipeline_model_parallel_group(), shape, torch.float32,
                                  torch.device("cpu"), repeats=20)
    return figures[0] if figures else 0.0


def scenario(spec, m: int, iterations: int) -> dict:
    from megatron.core import parallel_state
    from megatron.zero_bubble.patches import linear_wgrad, schedule_selection
    from megatron.zero_bubble.runtime.executor import PipelineExecutor

    harness.init_parallel_state(pp=2)
    chunks = harness.build_gpt_chunks(spec)
    result = {"rank": parallel_state.get_pipeline_model_parallel_rank(), "times": {}, "passes": {}}
    result["times"]["megatron 1f1b"] = _time_iterations(chunks, spec, m, iterations)
    linear_wgrad.install()
    executor = PipelineExecutor(lambda _: None)
    schedule_selection.install(executor)
    for name in SCHEDULES:
        passes = defaultdict(list)
        schedule = _plan(name, 2, m)
        executor.plan_for, executor.pass_timer = (lambda _: schedule), None
        result["times"][name] = _time_iterations(chunks, spec, m, iterations)
        executor.pass_timer = lambda op, chunk, mb, s: passes[op].append(s)  # profiling run, synchronised
        _time_iterations(chunks, spec, m, 1)
        result["passes"][name] = {op: statistics.median(v) for op, v in passes.items()}
    schedule_selection.uninstall()
    executor.release()
    linear_wgrad.uninstall()
    result["t_comm"] = _comm_time((spec.seq_length, spec.micro_batch_size, spec.hidden_size))
    return result


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iterations", type=int, default=6)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq-length", type=int, default=256)
    parser.add_argument("--skip-training", action="store_true", help="only the forward-backward comparisons")
    args = parser.parse_args(argv)
    spec = harness.ModelSpec(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=8,
                             seq_length=args.seq_length, vocab_size=1024, micro_batch_size=2)
    m = args.microbatches
    print(f"PP=2 on CPU (gloo, 1 thread per rank): {spec}, m={m}, {args.iterations} timed iterations each")
    ranks = sorted(harness.spawn(scenario, 2, spec, m, args.iterations, timeout=1800), key=lambda r: r["rank"])

    from megatron.zero_bubble.schedules import Costs, simulate

    def costs_from(name):
        per_rank = [r["passes"][name] for r in ranks]
        return Costs.make(2, t_f=[p["F"] for p in per_rank], t_b=[p["B"] for p in per_rank],
                          t_w=[p["W"] for p in per_rank], t_comm=ranks[0]["t_comm"])

    zb_costs = costs_from("zb-h1")
    reference = statistics.median(ranks[0]["times"]["megatron 1f1b"])
    predicted_1f1b = simulate(_plan("1f1b", 2, m), zb_costs).makespan
    print(f"\nprofiled (zb-h1 run, median s): " + ", ".join(
        f"rank {r['rank']}: T_F {r['passes']['zb-h1']['F']:.4f} T_B {r['passes']['zb-h1']['B']:.4f} "
        f"T_W {r['passes']['zb-h1']['W']:.4f}" for r in ranks) + f", T_comm {ranks[0]['t_comm']:.5f}")
    print(f"\n{'schedule':<16}{'median s':>10}{'vs megatron':>13}{'predicted':>11}")
    print(f"{'megatron 1f1b':<16}{reference:>10.4f}{1.0:>13.3f}{1.0:>11.3f}")
    for name in SCHEDULES:
        measured = statistics.median(ranks[0]["times"][name])
        predicted = simulate(_plan(name, 2, m), zb_costs).makespan / predicted_1f1b
        print(f"{name:<16}{measured:>10.4f}{measured / reference:>13.3f}{predicted:>11.3f}")
    print("\nsplit backward vs fused (median per pass, s):")
    for r in ranks:
        fused = r["passes"]["1f1b"]["BW"]
        split = r["passes"]["zb-h1"]["B"] + r["passes"]["zb-h1"]["W"]
        print(f"  rank {r['rank']}: T_B + T_W = {split:.4f}  T_BW = {fused:.4f}  overhead {100 * (split / fused - 1):+.1f}%"
              f"  (goal <= +5%)")
    if args.skip_training:
        return
    loop = harness.spawn(training_scenario, 2, spec, m, args.iterations, timeout=1800)
    seconds = loop[0]["seconds"]
    print(f"\ntraining iterations (forward-backward + Adam step, back to back, s per iteration):")
    print(f"{'schedule':<16}{'synchronous':>13}{'post-valid.':>13}{'gain':>8}")
    for name in POST_VALIDATION_SCHEDULES:
        sync, post = seconds[(name, False)], seconds[(name, True)]
        print(f"{name:<16}{sync:>13.4f}{post:>13.4f}{100 * (sync / post - 1):>+7.1f}%")


if __name__ == "__main__":
    main()
