"""Runtime benchmark on CPU: megatron's 1F1B vs the zero-bubble schedules through our executor (PP=2, gloo).

    python benchmarks/runtime_cpu.py [--reps 5] [--iterations 3] [--hidden 512] [--microbatches 8]

Protocol: the variants run in turn (megatron 1f1b, our 1f1b, zb-h1, ... then again), `--reps` rounds after
a warm-up round; printed per variant: min / median / max over the rounds, the spread (max - min) / median
("noisy" above 10%), and ratios of this run's medians. Also: the simulator's prediction from the pass
times profiled in the same run, T_B + T_W of the split backward against the fused T_BW per pass, and
whole training iterations (forward-backward + Adam step, back to back) with megatron's synchronous step
against optimizer post-validation, alternated the same way.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.megatron import harness, process_groups, rank_model  # noqa: E402  (spawn and the deterministic tiny GPT)

SCHEDULES = ("1f1b", "zb-h1", "zb-h2", "zb-auto")  # through our executor
MEGATRON = "megatron 1f1b"
NOISY = 0.10  # (max - min) / median above this marks a figure noisy
POST_VALIDATION_SCHEDULES = ("zb-h1", "zb-h2")


def _plan(name: str, stages: int, microbatches: int, post_validation: bool = False):
    """The schedule that runs (planned for uniform costs; deterministic, so main() rebuilds the same one)."""
    from megatron.zero_bubble.schedules.planners import PlanRequest, plan

    return plan(name, PlanRequest(stages=stages, microbatches=microbatches, ilp_time_limit=0,
                                  post_validation=post_validation))


def _time_iterations(chunks, spec, m, iterations):
    """Seconds of each of `iterations` forward-backward calls, after one that warms up."""
    return [_time_one(chunks, spec, m, it) for it in range(iterations + 1)][1:]


def _time_training(chunks, optimizer, spec, m, iterations, flush=None) -> float:
    """Seconds per training iteration over `iterations` back-to-back ones (after one warm-up), as a loop runs them."""
    import torch

    def one(it):
        for chunk in chunks:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        rank_model.run_forward_backward(chunks, spec, m, it * m)
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


def training_scenario(spec, m: int, iterations: int, reps: int) -> dict:
    """Per schedule: seconds per iteration with megatron's synchronous step and with post-validation, each a
    list over `reps` rounds in which the variants alternate (each round: `iterations` back to back)."""
    from megatron.core import parallel_state
    from megatron.core.optimizer import OptimizerConfig
    from megatron.zero_bubble.patches import optimizer_step, schedule_selection
    from megatron.zero_bubble.patches.megatron_adapter import MegatronAdapter
    from megatron.zero_bubble.runtime.executor import PipelineExecutor
    from megatron.zero_bubble.runtime.post_validation import PostValidation

    process_groups.init_parallel_state(pp=2)
    chunks = rank_model.wrap_in_ddp(rank_model.build_gpt_chunks(spec))
    config = OptimizerConfig(optimizer="adam", lr=1e-4, weight_decay=0.01, clip_grad=1000.0)
    megatron = MegatronAdapter()
    executor = PipelineExecutor(lambda _: None, megatron)
    schedule_selection.install(executor)
    variants = [(name, pv) for name in POST_VALIDATION_SCHEDULES for pv in (False, True)]
    optimizers = {key: rank_model.make_optimizer(chunks, config) for key in variants}
    controllers = {key: PostValidation(optimizers[key], megatron,
                                       pp_group=parallel_state.get_pipeline_model_parallel_group(),
                                       stage_group=parallel_state.get_tensor_model_parallel_group())
                   for key in variants if key[1]}
    seconds = {key: [] for key in variants}
    for rep in range(reps + 1):  # the first round warms up
        for key in variants:
            schedule = _plan(key[0], 2, m, key[1])
            executor.plan_for, flush = (lambda _: schedule), None
            if key[1]:
                optimizer_step.install(controllers[key], chunks)
                executor.attach_post_validation(controllers[key])
                flush = controllers[key].flush
            per_iteration = _time_training(chunks, optimizers[key], spec, m, iterations, flush)
            optimizer_step.uninstall()
            executor.attach_post_validation(None)
            if rep:
                seconds[key].append(per_iteration)
    schedule_selection.uninstall()
    executor.release()
    return {"rank": parallel_state.get_pipeline_model_parallel_rank(), "seconds": seconds}


def _comm_time(shape) -> float:
    """One-way time of a pipeline tensor between the two ranks (the runtime's own ping-pong measurement)."""
    import torch
    from megatron.core import parallel_state
    from megatron.zero_bubble.runtime.p2p import TorchP2P
    from megatron.zero_bubble.runtime.profiling import measure_p2p_seconds

    figures = measure_p2p_seconds(parallel_state.get_pipeline_model_parallel_group(), shape, torch.float32,
                                  torch.device("cpu"), TorchP2P(), repeats=20)
    return figures[0] if figures else 0.0


def _time_one(chunks, spec, m, index) -> float:
    import torch

    for p in (p for c in chunks for p in c.parameters()):
        p.grad = None
    torch.distributed.barrier()
    start = time.perf_counter()
    rank_model.run_forward_backward(chunks, spec, m, index * m)
    torch.distributed.barrier()
    return time.perf_counter() - start


def scenario(spec, m: int, reps: int) -> dict:
    """Forward-backward seconds of megatron's 1F1B and of each schedule through our executor, one iteration
    each in turn, `reps` rounds after a warm-up round; then a profiling run per schedule for its pass times."""
    from megatron.core import parallel_state
    from megatron.zero_bubble.patches import schedule_selection
    from megatron.zero_bubble.patches.megatron_adapter import MegatronAdapter
    from megatron.zero_bubble.runtime.executor import PipelineExecutor

    process_groups.init_parallel_state(pp=2)
    chunks = rank_model.build_gpt_chunks(spec)
    result = {"rank": parallel_state.get_pipeline_model_parallel_rank(), "times": {}, "passes": {}}
    megatron = MegatronAdapter()
    executor = PipelineExecutor(lambda _: None, megatron)
    plans = {name: _plan(name, 2, m) for name in SCHEDULES}
    variants = (MEGATRON, *SCHEDULES)
    result["times"] = {name: [] for name in variants}
    for rep in range(reps + 1):  # the first round warms up
        for name in variants:
            if name == MEGATRON:
                schedule_selection.uninstall()
            else:
                schedule_selection.install(executor)
                executor.plan_for = lambda _, schedule=plans[name]: schedule
            seconds = _time_one(chunks, spec, m, rep)
            if rep:
                result["times"][name].append(seconds)
    schedule_selection.uninstall()
    executor.release()
    for name in SCHEDULES:  # a profiling run each (observed passes synchronise the device)
        passes = defaultdict(list)
        profiled = PipelineExecutor(lambda _, schedule=plans[name]: schedule, megatron,
                                    observer=lambda p, start, end: passes[p.op].append(end - start))
        schedule_selection.install(profiled)
        _time_iterations(chunks, spec, m, 1)
        result["passes"][name] = {op: statistics.median(v) for op, v in passes.items()}
        schedule_selection.uninstall()
        profiled.release()
    result["t_comm"] = _comm_time((spec.seq_length, spec.micro_batch_size, spec.hidden_size))
    return result


def _figures(values: list[float]) -> str:
    spread = (max(values) - min(values)) / statistics.median(values)
    return (f"{min(values):>9.4f}{statistics.median(values):>9.4f}{max(values):>9.4f}"
            f"{spread:>8.1%}{' noisy' if spread > NOISY else '':<6}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=5, help="rounds of alternated variants (default %(default)s)")
    parser.add_argument("--iterations", type=int, default=3,
                        help="back-to-back training iterations per round and variant (default %(default)s)")
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq-length", type=int, default=256)
    parser.add_argument("--skip-training", action="store_true", help="only the forward-backward comparisons")
    args = parser.parse_args(argv)
    spec = harness.ModelSpec(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=8,
                             seq_length=args.seq_length, vocab_size=1024, micro_batch_size=2)
    m = args.microbatches
    print(f"PP=2 on CPU (gloo, 1 thread per rank): {spec}, m={m}; {args.reps} rounds, variants alternated")
    ranks = sorted(harness.spawn(scenario, 2, spec, m, args.reps, timeout=1800), key=lambda r: r["rank"])

    from megatron.zero_bubble.schedules import Costs, simulate

    def costs_from(name):
        per_rank = [r["passes"][name] for r in ranks]
        return Costs.make(2, t_f=[p["F"] for p in per_rank], t_b=[p["B"] for p in per_rank],
                          t_w=[p["W"] for p in per_rank], t_comm=ranks[0]["t_comm"], time_unit="s")

    zb_costs = costs_from("zb-h1")
    times = ranks[0]["times"]
    reference = statistics.median(times[MEGATRON])
    predicted_1f1b = simulate(_plan("1f1b", 2, m), zb_costs).makespan
    print("\nprofiled (zb-h1 run, median s): " + ", ".join(
        f"rank {r['rank']}: T_F {r['passes']['zb-h1']['F']:.4f} T_B {r['passes']['zb-h1']['B']:.4f} "
        f"T_W {r['passes']['zb-h1']['W']:.4f}" for r in ranks) + f", T_comm {ranks[0]['t_comm']:.5f}")
    print(f"\nforward-backward, s per iteration\n{'schedule':<16}{'min':>9}{'median':>9}{'max':>9}{'spread':>8}"
          f"{'':<6}{'vs megatron':>12}{'simulated':>11}")
    print(f"{MEGATRON:<16}{_figures(times[MEGATRON])}{1.0:>12.3f}{1.0:>11.3f}")
    for name in SCHEDULES:
        measured = statistics.median(times[name])
        predicted = simulate(_plan(name, 2, m), zb_costs).makespan / predicted_1f1b
        print(f"{name:<16}{_figures(times[name])}{measured / reference:>12.3f}{predicted:>11.3f}")
    print(f"(goal: our 1f1b / megatron 1f1b <= 1.01; the ratios are of medians from this run)")
    print("\nsplit backward vs fused in the pipeline (median per pass, s; benchmarks/split_backward.py isolates it):")
    for r in ranks:
        fused = r["passes"]["1f1b"]["BW"]
        split = r["passes"]["zb-h1"]["B"] + r["passes"]["zb-h1"]["W"]
        print(f"  rank {r['rank']}: T_B + T_W = {split:.4f}  T_BW = {fused:.4f}  ratio {split / fused:.3f}")
    if args.skip_training:
        return
    loop = harness.spawn(training_scenario, 2, spec, m, args.iterations, args.reps, timeout=1800)
    seconds = loop[0]["seconds"]
    print(f"\ntraining iterations (forward-backward + Adam step, {args.iterations} back to back per round), "
          f"s per iteration")
    print(f"{'schedule':<10}{'step':<14}{'min':>9}{'median':>9}{'max':>9}{'spread':>8}{'':<6}{'gain':>8}")
    for name in POST_VALIDATION_SCHEDULES:
        sync, post = seconds[(name, False)], seconds[(name, True)]
        gain = 1 - statistics.median(post) / statistics.median(sync)
        print(f"{name:<10}{'synchronous':<14}{_figures(sync)}")
        print(f"{name:<10}{'post-valid.':<14}{_figures(post)}{gain:>8.1%}")


if __name__ == "__main__":
    main()
