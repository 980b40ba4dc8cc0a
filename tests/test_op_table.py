"""The op table (ops.TABLE): one row of facts per kind of pass, read by the simulator, the validator, the
memory model and the lowering; ops and message kinds stay str-valued for code and JSON that use strings."""
from __future__ import annotations

import json

import pytest

from megatron.zero_bubble.schedules import Costs, Op, Pass, Schedule, ScheduleError, simulate
from megatron.zero_bubble.schedules.comm import Message, consumed, produced
from megatron.zero_bubble.schedules.handcrafted import zb_h1
from megatron.zero_bubble.schedules.ops import OPS, RECEIVES, TABLE, Kind, facts, per_rank_ops
from megatron.zero_bubble.schedules.post_validation import with_post_validation
from megatron.zero_bubble.schedules.simulate import duration, provides, requires

def memory_change(p: Pass, vstage: int) -> float:
    return facts(p.op).memory_change(COSTS, vstage)


COSTS = Costs.make(3, t_f=[1.0, 2.0, 3.0], t_b=[1.5, 2.5, 3.5], t_w=[0.25, 0.5, 0.75], m_f=[4.0, 5.0, 6.0],
                   m_w=[1.0, 2.0, 3.0], t_comm=0.125)


def test_ops_are_strings_so_comparisons_dict_keys_and_json_are_unchanged():
    p = Pass("BW", 2, 1)
    assert p.op is Op.BW and p.op == "BW" and {"BW": 1}[p.op] == 1 and str(p) == "BW2.1"
    assert Pass(Op.F, 0) == Pass("F", 0) and hash(Pass(Op.F, 0)) == hash(Pass("F", 0))
    assert json.loads(zb_h1(2, 2).to_json())["ranks"][0][0] == {"op": "F", "mb": 0, "chunk": 0}
    assert tuple(OPS) == ("F", "B", "W", "BW", "V", "S")


def test_an_unknown_op_is_refused_when_the_pass_is_made():
    with pytest.raises(ScheduleError, match="unknown op 'X'; expected one of F, B, W, BW, V, S"):
        Pass("X", 0)
    text = '{"stages": 1, "chunks": 1, "microbatches": 1, "layout": "single", "ranks": [[{"op": "Z", "mb": 0}]]}'
    with pytest.raises(ScheduleError, match="unknown op 'Z'"):
        Schedule.from_json(text)


def test_every_op_has_one_row_and_receives_what_its_cross_stage_dependency_sends():
    assert set(TABLE) == set(Op)
    for op, row in TABLE.items():
        across = [n for n in row.needs if n.offset]
        assert len(across) <= 1, op  # a pass receives at most one message
        if across:
            sender = facts(across[0].op)
            assert sender.sends == (RECEIVES[op][0], -across[0].offset), op
        else:
            assert RECEIVES[op] is None


def test_the_fused_backward_is_a_b_and_a_w_in_time_memory_and_what_it_completes():
    for vs in range(3):
        bw, b, w = (Pass(op, 0) for op in ("BW", "B", "W"))
        assert duration(bw, vs, COSTS) == duration(b, vs, COSTS) + duration(w, vs, COSTS)
        assert memory_change(bw, vs) == memory_change(b, vs) + memory_change(w, vs)
        assert provides(bw, vs) == provides(b, vs) + provides(w, vs)
        assert requires(bw, vs, 3, 3) == requires(b, vs, 3, 3)


def test_rows_give_the_paper_dependencies_durations_and_memory():
    assert requires(Pass("F", 4), 0, 3, 3) == () and requires(Pass("F", 4), 2, 3, 3) == (("F", 4, 1),)
    assert requires(Pass("B", 4), 1, 3, 3) == (("F", 4, 1), ("B", 4, 2))
    assert requires(Pass("W", 4), 1, 3, 3) == (("B", 4, 1),)
    assert [duration(Pass(op, 0), 2, COSTS) for op in ("F", "B", "W")] == [3.0, 3.5, 0.75]
    assert [memory_change(Pass(op, 0), 1) for op in ("F", "B", "W", "BW")] == [5.0, -3.0, -2.0, -5.0]


def test_v_is_a_row_once_per_rank_timeless_and_memoryless_waiting_for_the_rank_above():
    v = facts(Op.V)
    assert per_rank_ops() == (Op.V, Op.S) and not v.takes_time and not v.per_microbatch
    assert v.precedes == (Op.B, Op.BW) and v.replay_point and not v.last
    assert requires(Pass("V", 0), 0, 3, 3) == (("V", 0, 1),) and requires(Pass("V", 0), 2, 3, 3) == ()
    assert duration(Pass("V", 0), 1, COSTS) == 0.0 and memory_change(Pass("V", 0), 1) == 0.0
    assert str(Pass("V", 0)) == "V" and Pass("V", 0).describe() == "the post-validation pass"


def test_s_is_a_row_once_per_rank_that_comes_last_and_waits_for_the_rank_below():
    s = facts(Op.S)
    assert not s.takes_time and not s.per_microbatch and s.last and not s.precedes and not s.replay_point
    assert requires(Pass("S", 0), 0, 3, 3) == () and requires(Pass("S", 0), 2, 3, 3) == (("S", 0, 1),)
    assert s.sends == (Kind.STATS, +1) and RECEIVES[Op.S] == (Kind.STATS, -1)
    assert Pass("S", 0).describe() == "the step statistics pass"


@pytest.mark.parametrize("layout, chain", [("single", [2, 1, 0]), ("interleaved", [2, 1, 0]), ("v", [0, 1, 2])])
def test_once_per_rank_passes_chain_the_ranks_over_their_last_chunks_in_every_layout(layout, chain):
    """V walks from the rank of the last virtual stage; S ends there; each visits every rank once."""
    chunks = 1 if layout == "single" else 2
    n, last = 3 * chunks, chunks - 1
    stage = {r: Schedule(3, chunks, 1, layout, [[]] * 3).virtual_stage(r, last) for r in range(3)}
    for rank in range(3):
        needs = requires(Pass("V", 0, last), stage[rank], n, 3)
        before = chain[chain.index(rank) - 1] if chain.index(rank) else None
        assert needs == (() if before is None else (("V", 0, stage[before]),))
        needs = requires(Pass("S", 0, last), stage[rank], n, 3)
        after = chain[chain.index(rank) + 1] if chain.index(rank) + 1 < 3 else None
        assert needs == (() if after is None else (("S", 0, stage[after]),))


def test_message_kinds_are_an_enum_that_still_compares_with_strings():
    schedule = with_post_validation(zb_h1(3, 3))
    msg = produced(schedule, 0, Pass("F", 1))
    assert msg.kind is Kind.ACT and msg.kind == "act" and msg == Message("act", 1, 0, 1, 0, 1)
    assert consumed(schedule, 1, Pass("B", 0)).kind is Kind.GRAD
    assert consumed(schedule, 1, Pass("V", 0)) == Message(Kind.VALID, 0, 2, 1, 2, 1)
    assert Message("grad", 3, 2, 1, 2, 1).describe() == "the gradient of microbatch 3 from stage 2 to stage 1"


def test_simulated_timings_follow_the_rows():
    schedule = Schedule(2, 1, 1, "single", [[Pass("F", 0), Pass("BW", 0)], [Pass("F", 0), Pass("BW", 0)]])
    costs = Costs.make(2, t_f=1.0, t_b=2.0, t_w=0.5, t_comm=0.25)
    timeline = simulate(schedule, costs)
    # rank 1: F after rank 0's F plus T_comm; BW = T_B + T_W; rank 0's BW after rank 1's plus T_comm
    assert [(t.start, t.end) for t in timeline.ranks[1]] == [(1.25, 2.25), (2.25, 4.75)]
    assert [(t.start, t.end) for t in timeline.ranks[0]] == [(0.0, 1.0), (5.0, 7.5)]
