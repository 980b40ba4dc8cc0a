"""The held-memory model (schedules/held_memory.py): pipeline tensors each rank holds between passes, worked out by
hand on small lowered programs, and added to the activation model in bytes."""
import pytest

from megatron.zero_bubble.schedules import Costs, ScheduleError
from megatron.zero_bubble.schedules.baselines import one_f_one_b
from megatron.zero_bubble.schedules.comm import Batch, Send, Warmup
from megatron.zero_bubble.schedules.held_memory import held_memory_profile, lowered_programs, pipeline_tensors_held
from megatron.zero_bubble.schedules.memory import memory_profile
from megatron.zero_bubble.schedules.planners import PlanRequest, plan


def _program_text(program) -> str:
    words = []
    for item in program:
        if type(item) is Batch:
            words.append("[" + " ".join(f"{'+' if type(post) is Send else '-'}{post.msg.kind.value}{post.msg.mb}"
                                        for post in item.ops) + "]")
        else:
            words.append("warm" if type(item) is Warmup else str(item))
    return " ".join(words)


def test_1f1b_on_two_ranks_counts_receives_ahead_sends_in_flight_and_the_input_megatron_keeps():
    schedule = one_f_one_b(2, 3)
    programs = lowered_programs(schedule)
    # the lowering these counts were worked out on
    assert _program_text(programs[0]) == "warm F0 [+act0] F1 [+act1 -grad0] BW0 F2 [-grad1] [+act2] BW1 [-grad2] BW2"
    assert _program_text(programs[1]) == "warm [-act0] F0 [-act1] BW0 [+grad0] F1 BW1 [+grad1 -act2] F2 BW2 [+grad2]"
    # rank 0: F0's and F1's outputs until BW0 waits for their batches (it frees F0's output and takes grad0 from the
    # second), then F2's output until BW2 waits for its batch (BW1 takes grad1 from the batch before it); each
    # gradient's receive is posted after the pass before the one that needs it, so no read sees it.
    # rank 1, after BW0: the receive of act1, F0's input (kept by megatron until F1) and its gradient (sent; its
    # batch is waited for only at F2, whose receive comes after it); after F1 that gradient alone; after BW1 also
    # F1's input and gradient, which go at F2 (it waits for their batch); after BW2 F2's input and its gradient, whose
    # batch no pass waits for, until the end.
    assert pipeline_tensors_held(schedule, after_a_call=False) == [[1, 2, 0, 1, 1, 0], [0, 3, 1, 3, 0, 2]]


def test_outputs_kept_until_their_backward_without_deallocate_pipeline_outputs():
    held = pipeline_tensors_held(one_f_one_b(2, 3), after_a_call=False, outputs_freed_when_sent=False)
    assert held[0] == [1, 2, 1, 2, 1, 0]  # F1's output stays until BW1, F2's until BW2


def test_after_a_call_the_previous_calls_kept_input_and_its_gradient_go_at_the_first_forward():
    first, later = (pipeline_tensors_held(one_f_one_b(2, 3), after_a_call=after) for after in (False, True))
    assert later[0] == first[0]  # the first stage's input is the data
    assert later[1] == [n - 2 for n in first[1]]


def test_a_v_turn_holds_what_it_hands_over_on_the_same_rank():
    schedule = plan("zb-v", PlanRequest(stages=2, microbatches=2, ilp_time_limit=0))
    program = lowered_programs(schedule)[1]  # rank 1 holds virtual stages 1 and 2: the V's turn
    assert _program_text(program) == ("warm [-act0] F0 [-act1] F0.1 [+act0] F1 F1.1 [+act1 -grad0] B0.1 B0 [+grad0] "
                                      "W0.1 W0 [-grad1] B1.1 B1 [+grad1] W1.1 W1")
    # after F0: F0's output handed to F0.1; after F0.1 the receive of act1 and F0.1's output (sent; B0.1 waits for
    # its batch); after B0.1 its input gradient handed to B0 (F1.1's output went: B0.1 waited for its batch), after
    # B0 B0's gradient; from B1.1 on the last input of each chunk and its gradient stay (megatron keeps them), and
    # B1's gradient waits for the end of the call
    assert pipeline_tensors_held(schedule, after_a_call=False)[1] == [1, 2, 2, 2, 1, 1, 1, 1, 2, 4, 4, 4]


def test_held_memory_is_the_activation_profile_plus_the_tensors_in_bytes():
    schedule = plan("zb-h1", PlanRequest(stages=4, microbatches=6, ilp_time_limit=0))
    costs = Costs.make(4, m_f=1000.0, m_w=500.0, memory_unit="bytes")
    held = held_memory_profile(schedule, costs, pipeline_tensor_bytes=10.0)
    tensors = pipeline_tensors_held(schedule)
    activations = memory_profile(schedule, costs)
    for rank in range(4):
        assert held[rank] == [a + 10.0 * n for a, n in zip(activations[rank], tensors[rank])]  # no V or S passes


def test_held_memory_needs_costs_in_bytes():
    with pytest.raises(ScheduleError, match="bytes"):
        held_memory_profile(one_f_one_b(2, 2), Costs.make(2), pipeline_tensor_bytes=1.0)


@pytest.mark.parametrize("name", ["1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "zb-auto", "zb-v", "v-half", "v-min"])
def test_counted_from_a_first_call_nothing_is_ever_held_less_than_nothing(name):
    """Lifetimes that end before they begin (an input megatron let go of when the chunk's next F ran before this
    F's backward) count nothing, in every schedule."""
    schedule = plan(name, PlanRequest(stages=4, microbatches=8, ilp_time_limit=0))
    held = pipeline_tensors_held(schedule, after_a_call=False)
    assert min(min(rank) for rank in held) >= 0
    assert [len(rank) for rank in held] == [sum(1 for p in passes if p.op in ("F", "B", "W", "BW"))
                                            for passes in schedule.ranks]
