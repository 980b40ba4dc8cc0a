"""How well each lowered program keeps its pass order's time when the costs are not the ones it was lowered on.

A program is lowered once, on the planned costs (the receives placed where the plan says the messages land), and
replayed on the model of NCCL and CUDA (schedules/nccl_model.py) with other costs: one rank 30% slower (the first,
a middle or the last), or T_comm five times the plan's. Each figure is the replay's makespan over the same pass
order simulated on those costs with data dependencies only (schedules/simulate.py): 1.000 means the messages cost
nothing beyond their transfer. The reference row is megatron's own 1F1B exchange, as its schedule posts it: one
batch per step, each receive right before the pass that needs it (warm-up: receive, F, send; steady state:
F, send-forward-receive-backward, BW, send-backward-receive-forward; cool-down: receive, BW, send).

Costs: the paper's profiled 1.5B costs at p=8, m=24 (benchmarks/plan_quality.py's PROFILED_US), per rank, for
p = 4 and 8 with m = 3p; a chunk of a two-chunk layout gets half of a rank's times. Planning: the planners'
heuristics (no ILP), under their default memory limits.

    python benchmarks/receive_robustness.py [--p 4 8]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from megatron.zero_bubble.schedules import Costs, Pass, simulate  # noqa: E402
from megatron.zero_bubble.schedules.baselines import one_f_one_b  # noqa: E402
from megatron.zero_bubble.schedules.comm import Batch, Message, Recv, Send, Warmup, lower  # noqa: E402
from megatron.zero_bubble.schedules.nccl_model import replay  # noqa: E402
from megatron.zero_bubble.schedules.planners import PlanRequest, plan  # noqa: E402

PROFILED_MS = (18.522, 18.086, 9.337, 0.601)  # 1.5B, p=8, m=24: T_F, T_B, T_W, T_comm
PROGRAMS = (("1f1b", 1), ("zb-h1", 1), ("zb-h2", 1), ("zb-auto", 1), ("zb-auto", 2), ("interleaved-1f1b", 2),
            ("zb-v", 2))
SLOWER, COMM = 1.3, 5.0
WITHIN = 1.015  # the goal: within 1.5% of the pass order's own time


def planned_costs(p: int, chunks: int) -> Costs:
    t_f, t_b, t_w, t_comm = PROFILED_MS
    return Costs.make(p * chunks, t_f=t_f / chunks, t_b=t_b / chunks, t_w=t_w / chunks, t_comm=t_comm,
                      chunks=chunks)


def perturbations(schedule, costs: Costs) -> dict[str, Costs]:
    """name -> costs: each of the first, a middle and the last rank 30% slower (all its chunks), T_comm x5."""
    p = schedule.stages
    out = {}
    for rank in sorted({0, p // 2, p - 1}):
        slow = {schedule.virtual_stage(rank, chunk) for chunk in range(schedule.chunks)}

        def scaled(times):
            return [t * SLOWER if v in slow else t for v, t in enumerate(times)]

        out[f"rank {rank} +30%"] = Costs.make(len(costs.t_f), t_f=scaled(costs.t_f), t_b=scaled(costs.t_b),
                                              t_w=scaled(costs.t_w), t_comm=costs.t_comm, m_f=costs.m_f,
                                              m_w=costs.m_w)
    out["T_comm x5"] = Costs.make(len(costs.t_f), t_f=costs.t_f, t_b=costs.t_b, t_w=costs.t_w,
                                  t_comm=costs.t_comm * COMM, m_f=costs.m_f, m_w=costs.m_w)
    return out


def megatron_1f1b_programs(p: int, m: int) -> list[list]:
    """megatron-core's 1F1B exchange (forward_backward_pipelining_without_interleaving), one batch per step."""
    def act(mb, r):
        return Message("act", mb, r, r + 1, r, r + 1)

    def grad(mb, r):  # from stage r + 1 to stage r
        return Message("grad", mb, r + 1, r, r + 1, r)

    programs = []
    for r in range(p):
        first, last = r == 0, r == p - 1
        warm = min(p - r - 1, m)
        peers = [q for q in (r - 1, r + 1) if 0 <= q < p]
        prog = [Warmup(peers)]

        def batch(*posts):
            posts = [post for post in posts if post is not None]
            if posts:
                prog.append(Batch(posts))

        recv_f = (lambda mb: None) if first else (lambda mb: Recv(act(mb, r - 1)))
        send_f = (lambda mb: None) if last else (lambda mb: Send(act(mb, r)))
        recv_b = (lambda mb: None) if last else (lambda mb: Recv(grad(mb, r)))
        send_b = (lambda mb: None) if first else (lambda mb: Send(grad(mb, r - 1)))
        for mb in range(warm):
            batch(recv_f(mb))
            prog.append(Pass("F", mb))
            batch(send_f(mb))
        steady = m - warm
        if steady:
            batch(recv_f(warm))
        for i in range(steady):
            prog.append(Pass("F", warm + i))
            batch(send_f(warm + i), recv_b(i))
            prog.append(Pass("BW", i))
            batch(send_b(i), None if i == steady - 1 else recv_f(warm + i + 1))
        for mb in range(steady, m):
            batch(recv_b(mb))
            prog.append(Pass("BW", mb))
            batch(send_b(mb))
        programs.append(prog)
    return programs


def ratios(schedule, programs, costs: Costs) -> dict[str, float]:
    return {name: replay(schedule, programs, perturbed).makespan / simulate(schedule, perturbed).makespan
            for name, perturbed in perturbations(schedule, costs).items()}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--p", type=int, nargs="+", default=[4, 8])
    args = parser.parse_args(argv)
    print(f"replayed makespan / dependency-only makespan of the same pass order (goal: within {WITHIN - 1:.1%})")
    for p in args.p:
        m = 3 * p
        rows = [("megatron's 1F1B exchange", ratios(one_f_one_b(p, m), megatron_1f1b_programs(p, m),
                                                    planned_costs(p, 1)))]
        for name, chunks in PROGRAMS:
            costs = planned_costs(p, chunks)
            schedule = plan(name, PlanRequest(stages=p, microbatches=m, costs=costs, chunks=chunks,
                                              ilp_time_limit=0))
            label = name + (f" ({chunks} chunks)" if chunks > 1 else "")
            rows.append((label, ratios(schedule, lower(schedule, costs), costs)))
        columns = list(rows[0][1])
        print(f"\np={p}, m={m}")
        print(f"| program | {' | '.join(columns)} | worst |")
        print("|---|" + "---|" * (len(columns) + 1))
        for label, figures in rows:
            worst = max(figures.values())
            mark = "" if worst <= WITHIN else " (misses)"
            print(f"| {label} | {' | '.join(f'{figures[c]:.3f}' for c in columns)} | {worst:.3f}{mark} |")


if __name__ == "__main__":
    main()
