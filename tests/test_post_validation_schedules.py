"""The post-validation passes V and S in the schedules layer: placement, free in time and memory, lowering
fence, the rollback drain/restart programs, every layout, and the refusals."""
from __future__ import annotations

import dataclasses

import pytest

from megatron.zero_bubble.schedules import Costs, Pass, Schedule, ScheduleError, simulate, validate
from megatron.zero_bubble.cli import main
from megatron.zero_bubble.schedules.comm import Batch, Message, Recv, Send, Warmup, consumed, lower, posts, produced
from megatron.zero_bubble.schedules.nccl_model import check_lowering
from megatron.zero_bubble.schedules.memory import memory_profile
from megatron.zero_bubble.schedules.ops import facts
from megatron.zero_bubble.schedules.planners import SCHEDULES, PlanRequest, plan
from megatron.zero_bubble.schedules.post_validation import (
    RollbackProgram,
    check_rollback,
    rollback_programs,
    with_post_validation,
)

V, S = Pass("V", 0, 0), Pass("S", 0, 0)
SINGLE_LAYOUT_PLANNERS = ("1f1b", "zb-h1", "zb-h2", "zb-auto")
EVERY_PLANNER = tuple(SCHEDULES)


def grid():
    for p in range(2, 7):
        for m in sorted({1, p - 1, p, 2 * p, 3 * p} - {0}):
            yield p, m


def cost_variants(p):
    """Uniform unit costs without T_comm, and uneven stages (heavier last stage) with T_comm > 0."""
    uneven = Costs.make(
        p, t_f=[1.0] * (p - 1) + [1.5], t_b=[1.2] * (p - 1) + [1.7], t_w=[0.7] * (p - 1) + [0.9], t_comm=0.3
    )
    return [("uniform, T_comm 0", Costs.make(p)), ("uneven, T_comm 0.3", uneven)]


def request(p, m, costs, **kw):
    return PlanRequest(p, m, costs=costs, ilp_time_limit=0, **kw)  # zb-auto: heuristic only, to stay fast


def action(rank: int, token: str):
    """Compact notation: F0 B0 W0 BW0 V S passes; +act0 / -act0 send / receive, likewise grad, valid, stats."""
    if token in ("V", "S"):
        return {"V": V, "S": S}[token]
    if token[0] in "+-":
        send, kind = token[0] == "+", token[1:].rstrip("0123456789")
        mb = int(token[1 + len(kind) :] or 0)
        if kind in ("act", "stats"):  # up the ranks
            src, dst = (rank, rank + 1) if send else (rank - 1, rank)
        else:  # grad and valid travel down the ranks
            src, dst = (rank, rank - 1) if send else (rank + 1, rank)
        msg = Message(kind, mb, src, dst, src, dst)
        return Send(msg) if send else Recv(msg)
    op = token.rstrip("0123456789")
    return Pass(op, int(token[len(op) :]))


def actions(rank: int, text: str, stages: int = 2) -> list:
    """A program in compact notation: `warm` (a warm-up of the rank's neighbours), passes, and batches of posts in
    brackets: "warm F0 [+act0 -grad1] B0"."""
    program, batch = [], None
    for token in text.replace("[", " [ ").replace("]", " ] ").split():
        if token == "warm":
            program.append(Warmup([q for q in (rank - 1, rank + 1) if 0 <= q < stages]))
        elif token == "[":
            batch = []
        elif token == "]":
            program.append(Batch(batch))
            batch = None
        elif batch is not None:
            batch.append(action(rank, token))
        else:
            program.append(action(rank, token))
    return program


def without_validation(program):
    """The program as a rollback restarts it: no warm-up, no V, no validation result."""
    out = []
    for item in program:
        if type(item) is Batch:
            kept = [post for post in item.ops if post.msg.kind != "valid"]
            out += [Batch(kept)] if kept else []
        elif type(item) is not Warmup and item != V:
            out.append(item)
    return out


def compute_only(passes):
    """The passes without the post-validation ones (V and S)."""
    return [x for x in passes if x.op not in ("V", "S")]


# -- placement, validation, lowering and rollback over every single-layout planner --------------------------


@pytest.mark.parametrize("name", SINGLE_LAYOUT_PLANNERS)
def test_v_sits_before_the_first_backward_and_every_check_passes(name):
    for p, m in grid():
        for _, costs in cost_variants(p):
            plain = plan(name, request(p, m, costs))
            with_v = plan(name, request(p, m, costs, post_validation=True))
            assert with_v.ranks == with_post_validation(plain).ranks
            assert with_v.info["post_validation"] is True and with_v.name == plain.name
            for rank, passes in enumerate(with_v.ranks):
                v = passes.index(V)
                assert compute_only(passes) == plain.ranks[rank]
                assert passes.count(V) == 1 and passes.count(S) == 1 and passes[-1] == S
                assert passes[v + 1].op in ("B", "BW") and all(x.op == "F" for x in passes[:v])
            validate(with_v, costs)  # includes check_lowering and check_rollback
            programs = lower(with_v, costs)
            check_lowering(with_v, programs)
            check_rollback(with_v, programs)


@pytest.mark.parametrize("name", EVERY_PLANNER)
def test_v_changes_neither_bubble_rate_nor_peak_memory_nor_any_pass_time(name):
    """In every layout: V walks the ranks in the order of their first backward, so it never delays one."""
    for p, m in _grid_for(name):
        for label, costs in cost_variants(p):
            costs = _for_layout(name, costs)
            plain = plan(name, request(p, m, costs))
            base, timed = simulate(plain, costs), simulate(with_post_validation(plain), costs)
            assert timed.bubble_rate == base.bubble_rate, (name, p, m, label)
            assert timed.bubble_rate_from_zero == base.bubble_rate_from_zero
            assert timed.makespan == base.makespan
            assert timed.peak_memory == base.peak_memory
            for rank in range(p):
                others = [(t.op, t.start, t.end) for t in timed.ranks[rank] if t.op.op not in ("V", "S")]
                assert others == [(t.op, t.start, t.end) for t in base.ranks[rank]], (name, p, m, label, rank)


def _grid_for(name: str):
    """The grid points the planner takes (megatron's interleaving needs m >= p); V-Half and V-Min up to p = 4, as
    their planners take a while and their layout is zb-v's."""
    for p, m in grid():
        if (name == "interleaved-1f1b" and m < p) or (name in ("v-half", "v-min") and p > 4):
            continue
        yield p, m


def _for_layout(name: str, costs: Costs) -> Costs:
    """The same per-stage costs on every chunk of a two-chunk layout (each chunk half a stage)."""
    chunks = SCHEDULES[name].chunks
    if chunks == 1:
        return costs
    halve = lambda values: [v / chunks for v in values for _ in range(chunks)]  # noqa: E731
    return Costs.make(len(costs.t_f) * chunks, t_f=halve(costs.t_f), t_b=halve(costs.t_b), t_w=halve(costs.t_w),
                      t_comm=costs.t_comm, chunks=chunks)


@pytest.mark.parametrize("name", EVERY_PLANNER)
def test_every_layout_takes_post_validation_with_v_and_s_on_each_ranks_last_chunk(name):
    for p, m in _grid_for(name):
        for _, costs in cost_variants(p):
            costs = _for_layout(name, costs)
            schedule = plan(name, request(p, m, costs, post_validation=True))  # validates lowering and rollback
            last = schedule.chunks - 1
            for passes in schedule.ranks:
                assert passes.count(Pass("V", 0, last)) == 1 and passes[-1] == Pass("S", 0, last)


@pytest.mark.parametrize("name, head", [("zb-h1", "last"), ("interleaved-1f1b", "last"), ("zb-v", "first")])
def test_the_result_walks_from_the_rank_of_the_last_virtual_stage_and_the_statistics_end_there(name, head):
    p = 4
    schedule = plan(name, PlanRequest(p, 8, post_validation=True))
    last = schedule.chunks - 1
    v, s = Pass("V", 0, last), Pass("S", 0, last)
    holder = p - 1 if head == "last" else 0
    step = -1 if head == "last" else 1  # the way the result walks
    for rank in range(p):
        before, after = rank - step, rank + step
        result_in, result_out = consumed(schedule, rank, v), produced(schedule, rank, v)
        assert (result_in is None) == (rank == holder) and (result_out is None) == (rank == holder + step * (p - 1))
        if result_in is not None:
            assert (result_in.src, result_in.dst) == (before, rank)
        if result_out is not None:
            assert (result_out.src, result_out.dst) == (rank, after)
        stats_out = produced(schedule, rank, s)
        assert (stats_out is None) == (rank == holder)
        if stats_out is not None:
            assert (stats_out.src, stats_out.dst) == (rank, before) and stats_out.kind == "stats"


def test_zb_auto_with_its_ilp_refinement_takes_v_as_well():
    costs = cost_variants(4)[1][1]
    schedule = plan("zb-auto", PlanRequest(4, 8, costs=costs, ilp_time_limit=1.0, post_validation=True))
    plain = Schedule(4, 1, 8, "single", [compute_only(r) for r in schedule.ranks])
    assert simulate(schedule, costs).bubble_rate == simulate(plain, costs).bubble_rate


def test_v_waits_for_the_next_ranks_v_plus_t_comm_and_takes_no_time():
    costs = Costs.make(4, t_comm=0.25)
    timeline = simulate(with_post_validation(plan("zb-h1", PlanRequest(4, 8))), costs)
    v_end = {}
    for rank in reversed(range(4)):
        passes = timeline.ranks[rank]
        k = next(i for i, t in enumerate(passes) if t.op == V)
        arrival = v_end[rank + 1] + 0.25 if rank < 3 else 0.0
        assert passes[k].start == passes[k].end == max(passes[k - 1].end, arrival)
        v_end[rank] = passes[k].end


def test_v_holds_no_memory():
    costs = Costs.make(3, m_f=[2.0, 3.0, 4.0], m_w=[1.0, 1.0, 1.0])
    assert [facts(V.op).memory_change(costs, s) for s in range(3)] == [0.0, 0.0, 0.0]
    schedule = with_post_validation(plan("zb-h2", PlanRequest(3, 6)))
    for rank, profile in enumerate(memory_profile(schedule, costs)):
        v = schedule.ranks[rank].index(V)
        assert profile[v] == (profile[v - 1] if v else 0.0)


def test_v_messages_carry_the_result_down_one_rank():
    schedule = with_post_validation(plan("1f1b", PlanRequest(3, 3)))
    assert [produced(schedule, r, V) for r in range(3)] == [
        None,
        Message("valid", 0, 1, 0, 1, 0),
        Message("valid", 0, 2, 1, 2, 1),
    ]
    assert [consumed(schedule, r, V) for r in range(3)] == [
        Message("valid", 0, 1, 0, 1, 0),
        Message("valid", 0, 2, 1, 2, 1),
        None,
    ]
    assert Message("valid", 0, 2, 1, 2, 1).describe() == "the validation result from rank 2 to rank 1"
    assert V.describe() == "the post-validation pass"


@pytest.mark.parametrize("name", SINGLE_LAYOUT_PLANNERS)
def test_no_receive_for_after_v_is_posted_before_v(name):
    for p, m in grid():
        for _, costs in cost_variants(p):
            schedule = with_post_validation(plan(name, request(p, m, costs)))
            for rank, program in enumerate(lower(schedule, costs)):
                v = program.index(V)
                needed_after = {consumed(schedule, rank, x) for x in program[v + 1 :] if isinstance(x, Pass)}
                early = [x for x in posts(program[:v]) if isinstance(x, Recv) and x.msg in needed_after]
                assert early == [], (name, p, m, rank)


# -- the rollback programs, by hand ---------------------------------------------------------------------------


def test_one_f_one_b_p2_m4_rollback_by_hand():
    schedule = with_post_validation(plan("1f1b", PlanRequest(2, 4)))
    programs = lower(schedule)
    # Rank 0 gets the result before V; rank 1 receives act1 (needed by F1, after V) after V, in the batch that sends
    # the result on: act1 is exchanged at rank 1's V, which rank 0 has passed by then, so rank 0 sends it after its
    # own V. S comes last: rank 0 sends its statistics on, rank 1 (the last) receives them and holds the full sums.
    assert programs == [
        actions(0, "warm F0 [+act0] F1 [-valid] V [+act1 -grad0] BW0 F2 [-grad1] [+act2] BW1 F3 [+act3 -grad2] BW2 "
                   "[-grad3] BW3 S [+stats]"),
        actions(1, "warm [-act0] F0 V [+valid -act1] BW0 [+grad0] F1 BW1 [+grad1 -act2] F2 BW2 [-act3] [+grad2] F3 "
                   "BW3 [+grad3 -stats] S"),
    ]
    # Nothing is sent before its sender's V that its receiver takes after its own: no stale message to drain.
    # Rank 1 sends nothing before its V, so rank 0 has nothing to drain and no one to pass the result to.
    assert rollback_programs(schedule, programs) == [
        RollbackProgram(after_validation=[], restart=without_validation(programs[0])),
        RollbackProgram(after_validation=actions(1, "[+valid]"), restart=without_validation(programs[1])),
    ]


def test_zb_h2_p3_m6_rollback_by_hand():
    schedule = with_post_validation(plan("zb-h2", PlanRequest(3, 6)))
    programs = lower(schedule)
    rollbacks = rollback_programs(schedule, programs)
    # Before V, rank r runs the F of microbatches 0..2p-2-2r and sends each on; rank 1 consumes act0..act2 before
    # its V and rank 2 act0 only: the stale ones are act3 and act4 on rank 1 and act1 and act2 on rank 2, drained
    # in the batches they came in, after the result went on.
    assert [r.after_validation for r in rollbacks] == [
        [], actions(1, "[+valid -act3] [-act4]", 3), actions(2, "[+valid -act1] [-act2]", 3)]
    assert [r.restart for r in rollbacks] == [without_validation(p) for p in programs]


@pytest.mark.parametrize("name", ("1f1b", "zb-h1"))
def test_with_the_1f1b_warm_up_each_rank_drains_at_most_one_stale_activation(name):
    for p, m in grid():
        schedule = with_post_validation(plan(name, PlanRequest(p, m)))
        rollbacks = rollback_programs(schedule, lower(schedule))
        assert rollbacks[0].after_validation == []
        for r in range(1, p):
            after = list(posts(rollbacks[r].after_validation))
            assert after[0] == action(r, "+valid"), (p, m, r)
            assert all(type(post) is Recv and post.msg.kind == "act" for post in after[1:]) and len(after) <= 2


def _swapped(program: list, first: Recv, second: Recv) -> list:
    """The program with the two receives' places exchanged."""
    swap = {first: second, second: first}
    return [Batch([swap.get(post, post) for post in item.ops]) if type(item) is Batch else item for item in program]


def test_check_rollback_catches_swapped_stale_receives():
    schedule = with_post_validation(plan("zb-h2", PlanRequest(3, 6)))
    programs = lower(schedule)
    stale = actions(1, "-act3 -act4")
    assert [x for x in posts(rollback_programs(schedule, programs)[1].after_validation) if x in stale] == stale
    with pytest.raises(ScheduleError, match="after a rollback.*activation of microbatch"):
        check_rollback(schedule, [programs[0], _swapped(programs[1], *stale), programs[2]])


def test_check_rollback_catches_a_gradient_receive_posted_before_v():
    schedule = with_post_validation(plan("1f1b", PlanRequest(2, 4)))
    programs = lower(schedule)
    early = actions(0, "warm F0 [+act0] F1 [+act1] [-valid] [-grad0] V BW0 F2 [+act2 -grad1] BW1 F3 [+act3 -grad2] "
                       "BW2 [-grad3] BW3 S [+stats]")
    check_lowering(schedule, [early, programs[1]])  # fine without a rollback...
    with pytest.raises(ScheduleError, match=r"after a rollback, schedule '1f1b'.*gradient of microbatch 0"):
        check_rollback(schedule, [early, programs[1]])  # ...but the replayed grad4 meets the posted grad0


# -- refusals ----------------------------------------------------------------------------------------------


def edited(schedule: Schedule, rank: int, passes: list) -> Schedule:
    ranks = [list(r) for r in schedule.ranks]
    ranks[rank] = passes
    return dataclasses.replace(schedule, ranks=ranks)


def test_validate_refuses_v_after_a_b():
    s = with_post_validation(plan("zb-h1", PlanRequest(3, 6)))
    passes = [x for x in s.ranks[1] if x != V]
    first_b = next(i for i, x in enumerate(passes) if x.op == "B")
    with pytest.raises(ScheduleError, match="rank 1 runs B of microbatch 0 before its post-validation pass"):
        validate(edited(s, 1, passes[: first_b + 1] + [V] + passes[first_b + 1 :]))


def test_validate_refuses_two_or_no_v_on_a_rank():
    s = with_post_validation(plan("1f1b", PlanRequest(3, 6)))
    with pytest.raises(ScheduleError, match="rank 2 runs the post-validation pass 2 times"):
        validate(edited(s, 2, [V] + s.ranks[2]))
    with pytest.raises(ScheduleError, match="rank 0 runs the post-validation pass 0 times"):
        validate(edited(s, 0, [x for x in s.ranks[0] if x != V]))


def test_validate_refuses_v_with_a_microbatch():
    s = with_post_validation(plan("1f1b", PlanRequest(2, 4)))
    with pytest.raises(ScheduleError, match="post-validation pass names microbatch 1 and chunk 0"):
        validate(edited(s, 1, [Pass("V", 1, 0) if x == V else x for x in s.ranks[1]]))


def test_validate_refuses_s_before_the_last_pass_and_v_on_a_chunk_other_than_the_last():
    s = with_post_validation(plan("zb-h1", PlanRequest(3, 6)))
    passes = s.ranks[2]
    with pytest.raises(ScheduleError, match="rank 2 runs W of microbatch 5 after its step statistics pass; S must be"):
        validate(edited(s, 2, passes[:-2] + [S, passes[-2]]))
    v_shape = with_post_validation(plan("zb-v", PlanRequest(2, 4)))
    moved = [Pass("V", 0, 0) if x.op == "V" else x for x in v_shape.ranks[1]]
    with pytest.raises(ScheduleError, match="rank 1's post-validation pass names microbatch 0 and chunk 0; V is "
                                            r"always microbatch 0 on the rank's last chunk \(1\)"):
        validate(edited(v_shape, 1, moved))


def test_with_post_validation_refuses_a_schedule_that_has_v_already():
    s = with_post_validation(plan("zb-h1", PlanRequest(2, 4)))
    with pytest.raises(ScheduleError, match="schedule 'zb-h1' .* already has post-validation passes"):
        with_post_validation(s)


# -- formats and tools -------------------------------------------------------------------------------------


def test_json_round_trip_keeps_v():
    s = plan("zb-h2", PlanRequest(3, 6, post_validation=True))
    data = s.to_dict()
    assert {"op": "V", "mb": 0, "chunk": 0} in data["ranks"][0]
    back = Schedule.from_json(s.to_json())
    assert back.ranks == s.ranks and back.info["post_validation"] is True and back.has_post_validation()
    assert validate(back).bubble_rate == validate(s).bubble_rate


def test_pictures_show_v():
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from megatron.zero_bubble.schedules.draw import _draw_rows, render_text

    timeline = simulate(plan("zb-h1", PlanRequest(3, 6, post_validation=True)), Costs.make(3))
    lines = render_text(timeline, 60).splitlines()[1:]
    assert all(line.count("V") == 1 for line in lines)
    fig = Figure()
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    _draw_rows(ax, timeline, 6.0, timeline.makespan, None)
    assert "V (post-validation)" in [t.get_text() for t in ax.get_legend().get_texts()]


def test_cli_post_validation_option(capsys):
    assert main(["export", "--schedule", "zb-h1", "-p", "3", "-m", "6", "--post-validation"]) == 0
    schedule = Schedule.from_json(capsys.readouterr().out)
    assert [r.count(V) for r in schedule.ranks] == [1, 1, 1]
    assert main(["export", "--schedule", "zb-v", "-p", "3", "-m", "6", "--post-validation"]) == 0
    schedule = Schedule.from_json(capsys.readouterr().out)
    assert [(r.count(Pass("V", 0, 1)), r[-1]) for r in schedule.ranks] == [(1, Pass("S", 0, 1))] * 3
