"""The model of NCCL and CUDA every lowered program is proven and timed on (schedules/nccl_model.py).

Each rule has a program that breaks only it: the program is stuck (or late) on the full model and runs as planned
with that one rule switched off, so every rule is known to bite. Every planner's programs run on the model to their
end, within 5% of the planner's own makespan. The programs the runtime used to post (receives posted early, one
operation at a time on a process group per pair of ranks, no warm-up) are stuck or slow on it. No torch, no process.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from megatron.zero_bubble.schedules import Costs, Pass, Schedule, ScheduleError
from megatron.zero_bubble.schedules.comm import Batch, Message, Recv, Send, Warmup, lower, posts
from megatron.zero_bubble.schedules.nccl_model import ALL_RULES, Rules, check_lowering, replay
from megatron.zero_bubble.schedules.planners import PlanRequest, plan
from megatron.zero_bubble.schedules.program import program_json, programs_from_json
from megatron.zero_bubble.schedules.simulate import simulate

# The paper's 1.5B costs per virtual stage (ms; T_comm as measured there): what the bubble figures mean.
PAPER_1_5B = dict(t_f=18.5, t_b=18.1, t_w=9.3, t_comm=0.6)


def _plan(name: str, p: int, m: int, chunks: int, post_validation: bool = False):
    costs = Costs.make(p * chunks, **{k: v / chunks if k != "t_comm" else v for k, v in PAPER_1_5B.items()},
                       chunks=chunks)
    schedule = plan(name, PlanRequest(stages=p, microbatches=m, chunks=chunks, costs=costs, ilp_time_limit=0,
                                      post_validation=post_validation))
    return schedule, costs, lower(schedule, costs)


# -- one program per rule: stuck or late on the full model, as planned without that rule ----------------------------

def act(mb: int, src: int = 0, dst: int = 1) -> Message:
    return Message("act", mb, src, dst, src, dst)


def grad(mb: int, src: int = 1, dst: int = 0) -> Message:
    return Message("grad", mb, src, dst, src, dst)


def batch(*items, group: str = "g") -> Batch:
    """+msg: a send, -msg: a receive (written as ("+", msg) / ("-", msg))."""
    return Batch([Send(msg) if sign == "+" else Recv(msg) for sign, msg in items], group)


def two_ranks(rank0: list, rank1: list, m: int) -> Schedule:
    return Schedule(2, 1, m, "single", [rank0, rank1])


F, BW = (lambda mb: Pass("F", mb)), (lambda mb: Pass("BW", mb))
COSTS = Costs.make(2, t_f=1.0, t_b=1.0, t_w=1.0, t_comm=0.1)


def _stuck_only_with(rule: str, schedule: Schedule, programs: list, costs: Costs = COSTS, match: str = "") -> None:
    with pytest.raises(ScheduleError, match="communication deadlock" + match):
        check_lowering(schedule, programs, costs)
    replay(schedule, programs, costs, Rules(**{rule: False}))  # runs to its end without that rule


def test_one_in_order_stream_per_communicator():
    """Rank 0 posts its receive of grad0 before its send of act0, on one group: the send waits behind the receive."""
    schedule = two_ranks([F(0), BW(0)], [F(0), BW(0)], 1)
    programs = [[F(0), batch(("-", grad(0))), batch(("+", act(0))), BW(0)],
                [batch(("-", act(0))), F(0), BW(0), batch(("+", grad(0)))]]
    _stuck_only_with("in_order_streams", schedule, programs, match=r": rank 0 stops at its batch of send of the "
                     r"activation of microbatch 0 from stage 0 to stage 1: its previous batch on group 'g'")


def test_rendezvous():
    """Both ranks send before they receive, on one group: a send completes only with its receive."""
    schedule = two_ranks([F(0), F(1), BW(0), BW(1)], [F(0), BW(0), F(1), BW(1)], 2)
    programs = [[F(0), batch(("+", act(0))), F(1), batch(("+", act(1))), batch(("-", grad(0))), BW(0),
                 batch(("-", grad(1))), BW(1)],
                [batch(("-", act(0))), F(0), BW(0), batch(("+", grad(0))), batch(("-", act(1))), F(1), BW(1),
                 batch(("+", grad(1)))]]
    _stuck_only_with("rendezvous", schedule, programs)


def test_a_batch_is_one_kernel():
    """Rank 1 receives act0 and act1 in one batch: F0 waits for act1 too, which rank 0 sends only after grad0."""
    schedule = two_ranks([F(0), BW(0), F(1), BW(1)], [F(0), BW(0), F(1), BW(1)], 2)
    programs = [[F(0), batch(("+", act(0))), batch(("-", grad(0)), group="h"), BW(0), F(1), batch(("+", act(1))),
                 batch(("-", grad(1)), group="h"), BW(1)],
                [batch(("-", act(0)), ("-", act(1))), F(0), BW(0), batch(("+", grad(0)), group="h"), F(1), BW(1),
                 batch(("+", grad(1)), group="h")]]
    _stuck_only_with("batch_is_one_kernel", schedule, programs,
                     match=r": rank 0 stops at BW of microbatch 0, waiting for its receive of the gradient")


def test_nccl_waits_for_the_compute_posted_before_it():
    """Rank 0 posts act0 only after F1: the send waits for F1, and rank 1 starts a pass later than planned."""
    schedule = Schedule(2, 1, 2, "single", [[F(0), F(1)], [F(0), F(1)]])
    costs = Costs.make(2, t_f=10.0, t_comm=0.1)
    programs = [[F(0), F(1), batch(("+", act(0)), ("+", act(1)))],
                [batch(("-", act(0)), ("-", act(1))), F(0), F(1)]]
    planned = simulate(schedule, costs).makespan
    assert replay(schedule, programs, costs).makespan >= planned + 10.0  # a whole F late
    assert replay(schedule, programs, costs, Rules(nccl_waits_for_compute=False)).makespan == pytest.approx(planned)


def _ring() -> Schedule:
    """Three ranks, two chunks each (interleaved): stage s on rank s mod 3; act s -> s+1 goes around the ring."""
    return Schedule(3, 2, 1, "interleaved", [[Pass("F", 0, 0), Pass("F", 0, 1)] for _ in range(3)])


def _ring_act(stage: int) -> Message:
    return Message("act", 0, stage, stage + 1, stage % 3, (stage + 1) % 3)


def _ring_programs(warm: bool) -> list:
    """Each rank first touches the link to the rank before it (rank 0: the ring link to rank 2, on a group of its
    own): a cycle of first uses."""
    f0, f1 = Pass("F", 0, 0), Pass("F", 0, 1)
    rank0 = [batch(("-", _ring_act(2)), group="ring"), f0, batch(("+", _ring_act(0))), f1, batch(("+", _ring_act(3)))]
    rank1 = [batch(("-", _ring_act(0))), f0, batch(("+", _ring_act(1))), batch(("-", _ring_act(3))), f1,
             batch(("+", _ring_act(4)))]
    rank2 = [batch(("-", _ring_act(1))), f0, batch(("+", _ring_act(2)), group="ring"), batch(("-", _ring_act(4))), f1]
    programs = [rank0, rank1, rank2]
    if warm:
        peers = {0: {"g": [1], "ring": [2]}, 1: {"g": [0, 2]}, 2: {"g": [1], "ring": [0]}}
        programs = [[Warmup(ps, group) for group, ps in peers[r].items()] + program for r, program in enumerate(programs)]
    return programs


def _stuck_only_with_either(rules: tuple, schedule: Schedule, programs: list, costs: Costs, match: str) -> None:
    """Stuck on the full model, and with any one of `rules` off; runs to its end with all of them off."""
    with pytest.raises(ScheduleError, match="communication deadlock" + match):
        check_lowering(schedule, programs, costs)
    for rule in rules:
        with pytest.raises(ScheduleError, match="communication deadlock"):
            replay(schedule, programs, costs, Rules(**{rule: False}))
    replay(schedule, programs, costs, Rules(**{rule: False for rule in rules}))


def test_the_first_use_of_a_link_blocks_the_host_and_a_warm_up_unblocks_it():
    """The ring's first uses form a cycle on a group of two, so each half of rule 5 alone holds it up."""
    _stuck_only_with_either(("first_use_of_a_group_blocks_host", "first_use_of_a_link_blocks_host"), _ring(),
                            _ring_programs(warm=False), Costs.make(6, t_comm=0.1),
                            match=r": rank 0's host is blocked at the first use of its links \(its batch of receive of "
                                  r"the activation of microbatch 0 from stage 2 to stage 3\) until rank 2 on group "
                                  r"'ring'")
    check_lowering(_ring(), _ring_programs(warm=True), Costs.make(6, t_comm=0.1))


def test_the_first_use_of_a_link_waits_for_the_peers_first_use_of_it_on_a_group_every_member_has_used():
    """Every rank warms up the 'ring' group first, but not the link from rank 0 to rank 2: NCCL connects two ranks at
    their first exchange, so rank 0's receive from rank 2 blocks its host until rank 2's send, which needs rank 0."""
    line = {0: [Warmup([1], "ring")], 1: [Warmup([0, 2], "ring")], 2: [Warmup([1], "ring")]}
    programs = [line[r] + program for r, program in enumerate(_ring_programs(warm=False))]
    _stuck_only_with("first_use_of_a_link_blocks_host", _ring(), programs, Costs.make(6, t_comm=0.1),
                     match=r": rank 0's host is blocked at the first use of its links \(its batch of receive of the "
                           r"activation of microbatch 0 from stage 2 to stage 3\) until rank 2 on group 'ring'")


def test_the_first_use_of_a_group_waits_for_every_members_first_use_of_it():
    """Ranks 0 and 2 warm up their 'ring' link first; rank 1 joins the group only at its end, after its F of stage 4,
    which needs rank 0: a lazily made communicator waits for every member, so rank 0's warm-up holds rank 0 up."""
    programs = _ring_programs(warm=False)
    programs = [[Warmup([2], "ring")] + programs[0] + [Warmup([1], "ring")], programs[1] + [Warmup([0], "ring")],
                [Warmup([0], "ring")] + programs[2]]
    _stuck_only_with("first_use_of_a_group_blocks_host", _ring(), programs, Costs.make(6, t_comm=0.1),
                     match=r": rank 0's host is blocked at the first use of its links \(its warm-up of links to "
                           r"ranks 2\) until rank 1 on group 'ring'")


def test_one_launch_queue():
    """Rank 1's second receive on a group waits behind its first, and holds back BW0, whose gradient rank 0 needs
    before it computes what the first receive waits for."""
    schedule = two_ranks([F(0), BW(0), F(1), F(2), BW(1), BW(2)], [F(0), BW(0), F(1), BW(1), F(2), BW(2)], 3)
    programs = [[F(0), batch(("+", act(0))), batch(("-", grad(0)), group="h"), BW(0), F(1), batch(("+", act(1))), F(2),
                 batch(("+", act(2))), batch(("-", grad(1)), group="h"), BW(1), batch(("-", grad(2)), group="h"),
                 BW(2)],
                [batch(("-", act(0))), F(0), batch(("-", act(1))), batch(("-", act(2))), BW(0),
                 batch(("+", grad(0)), group="h"), F(1), BW(1), batch(("+", grad(1)), group="h"), F(2), BW(2),
                 batch(("+", grad(2)), group="h")]]
    _stuck_only_with("one_launch_queue", schedule, programs)


def test_every_rule_has_a_test_whose_program_is_stuck_only_with_it():
    """Every switch of the model is named by a test above that shows a program it alone holds up (a switch that does
    nothing, or a rule added without such a test, fails here); all rules hold by default."""
    assert all(getattr(ALL_RULES, name) for name in Rules.__dataclass_fields__)
    source = Path(__file__).read_text()
    shown = set(re.findall(r'_stuck_only_with\("(\w+)"', source))
    assert shown == set(Rules.__dataclass_fields__) - {"nccl_waits_for_compute"}
    assert "Rules(nccl_waits_for_compute=False)" in source  # rule 4 delays a program instead of holding it up


def test_messages_match_in_posting_order_per_group_and_direction():
    schedule = Schedule(2, 1, 2, "single", [[F(0), F(1)], [F(0), F(1)]])
    good = [[F(0), F(1), batch(("+", act(0)), ("+", act(1)))], [batch(("-", act(0)), ("-", act(1))), F(0), F(1)]]
    check_lowering(schedule, good)
    swapped = [good[0], [batch(("-", act(1)), ("-", act(0))), F(0), F(1)]]
    with pytest.raises(ScheduleError, match=r"mismatched messages on group 'g': rank 0's send number 1 to rank 1 is "
                                            r"the activation of microbatch 0 .* but rank 1's receive number 1"):
        check_lowering(schedule, swapped)
    rank1_runs_f0_only = Schedule(2, 1, 2, "single", [[F(0), F(1)], [F(0)]])
    with pytest.raises(ScheduleError, match="posts the send of the activation of microbatch 1 .* which rank 1 never"):
        check_lowering(rank1_runs_f0_only, [good[0], [batch(("-", act(0))), F(0)]])


# -- every planner's programs on the model ---------------------------------------------------------------------------

PLANNERS = [("1f1b", 1), ("zb-h1", 1), ("zb-h2", 1), ("zb-auto", 1), ("interleaved-1f1b", 2), ("interleaved-1f1b", 4),
            ("zb-auto", 2), ("zb-auto", 3), ("zb-auto", 4), ("zb-v", 2), ("v-half", 2), ("v-min", 2)]
GRID = [(name, chunks, p, m, pv) for name, chunks in PLANNERS for p in (2, 3, 4, 8, 16)
        for m in ((p, 2 * p + 1) if p == 16 else (p, 2 * p + 1, 3 * p))  # p=16 plans take most of the time
        for pv in (False, True) if not (name.startswith("interleaved") and m % p)]


def _check_grid(cases) -> None:
    for name, chunks, p, m, pv in cases:
        schedule, costs, programs = _plan(name, p, m, chunks, pv)
        planned = simulate(schedule, costs).makespan
        on_model = replay(schedule, programs, costs).makespan
        assert planned <= on_model <= 1.05 * planned, (name, chunks, p, m, pv, on_model / planned)


def test_a_sample_of_plans_runs_on_the_model_within_five_percent_of_the_plan():
    _check_grid([case for case in GRID if case[2] <= 8][::23])


@pytest.mark.slow
def test_every_planners_programs_run_on_the_model_within_five_percent_of_the_plan():
    """Planners x p in {2, 3, 4, 8, 16} x two or three m, one chunk, 2 to 4 interleaved and V, with and without
    post-validation (the paper's 1.5B costs per stage)."""
    _check_grid(GRID)


# -- what the runtime posted before: receives early, one at a time, on pair groups, no warm-up -----------------------

def early_posting(programs: list) -> list:
    """The programs the runtime used to run: each post on its own, on the group of its pair of ranks, every receive
    right after the previous post of its pair on the rank (as early as the pair's order allows), sends where they
    are; no warm-up."""
    out = []
    for rank, program in enumerate(programs):
        early: list = []
        last_of_pair: dict[frozenset, int] = {}
        for item in program:
            if type(item) is Warmup:
                continue
            if type(item) is not Batch:
                early.append(item)
                continue
            for post in item.ops:
                pair = frozenset((post.msg.src, post.msg.dst))
                single = Batch([post], "pair " + "-".join(map(str, sorted(pair))))
                at = last_of_pair.get(pair, -1) + 1 if type(post) is Recv else len(early)
                early.insert(at, single)
                last_of_pair = {k: (v + 1 if v >= at else v) for k, v in last_of_pair.items()}
                last_of_pair[pair] = at
        out.append(early)
    return out


def warmed_up(programs: list) -> list:
    """Each program with a warm-up of each of its links first, in ascending order of the pair (never a cycle)."""
    out = []
    for rank, program in enumerate(programs):
        links = sorted({(item.group, post.msg.dst if post.msg.src == rank else post.msg.src)
                        for item in program if type(item) is Batch for post in item.ops})
        out.append([Warmup([peer], group) for group, peer in links] + program)
    return out


@pytest.mark.parametrize("name, chunks", [("interleaved-1f1b", 2), ("zb-auto", 2)])
def test_the_early_posting_programs_of_interleaved_plans_are_stuck_at_the_first_use_of_the_ring_link(name, chunks):
    schedule, costs, programs = _plan(name, 4, 8, chunks)
    old = early_posting(programs)
    assert type(old[0][0]) is Batch and old[0][0].ops[0].msg.src == 3  # rank 0 starts with the ring link
    with pytest.raises(ScheduleError, match=r"communication deadlock: rank 0's host is blocked at the first use"):
        check_lowering(schedule, old, costs)


@pytest.mark.parametrize("name, chunks", [("1f1b", 1), ("zb-h1", 1), ("zb-v", 2)])
def test_the_early_posting_programs_take_far_longer_than_planned_under_one_launch_queue(name, chunks):
    """The paper's 1.5B costs, p=8, m=24: the batched programs take what the plan says; the early-posting ones, warmed
    up, run on the model at 1.5 to 2 times the plan: early receives on one stream hold back the launches behind them."""
    schedule, costs, programs = _plan(name, 8, 24, chunks)
    planned = simulate(schedule, costs).makespan
    assert replay(schedule, programs, costs).makespan == pytest.approx(planned, rel=0.01)
    warmed = warmed_up(early_posting(programs))
    assert replay(schedule, warmed, costs).makespan > 1.5 * planned


# -- the programs as JSON ------------------------------------------------------------------------------------------

def test_programs_export_as_json_with_warm_ups_and_batches_and_read_back():
    schedule, costs, programs = _plan("zb-v", 3, 6, 2, post_validation=True)
    data = json.loads(json.dumps(program_json(schedule, programs)))
    assert programs_from_json(data) == programs
    assert [rank[0] for rank in data] == [{"warmup": [{"group": "pipeline", "peer": 1}]},
                                          {"warmup": [{"group": "pipeline", "peer": 0}, {"group": "pipeline", "peer": 2}]},
                                          {"warmup": [{"group": "pipeline", "peer": 1}]}]
    batches = [entry for rank in data for entry in rank if "batch" in entry]
    assert {entry["group"] for entry in batches} == {"pipeline"}
    sends = sorted(json.dumps(post["message"]) for entry in batches for post in entry["batch"] if post["post"] == "send")
    recvs = sorted(json.dumps(post["message"]) for entry in batches for post in entry["batch"] if post["post"] == "recv")
    assert sends == recvs and len(set(sends)) == len(sends)
    first_b = next(e for e in data[0] if e.get("compute") == "B" and e["chunk"] == 0)
    assert first_b["waits_for"]["kind"] == "grad" and first_b["waits_for_send"]["kind"] == "act"
