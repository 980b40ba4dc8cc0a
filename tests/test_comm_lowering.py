"""The communication lowering: in-order matching per rank pair, no deadlock, receives posted early."""
import queue
import threading

import pytest

from megatron.zero_bubble.schedules import Costs, Pass, Schedule, ScheduleError
from megatron.zero_bubble.schedules.baselines import one_f_one_b
from megatron.zero_bubble.schedules.comm import Recv, Send, check_lowering, consumed, lower, produced


def wavefront(p: int, m: int, layout: str, chunks: int) -> Schedule:
    """A valid schedule of any layout: every pass at its wavefront step, each rank in step order."""
    s = Schedule(p, chunks, m, layout, [[] for _ in range(p)])
    n = s.num_virtual_stages
    steps = []
    for mb in range(m):
        for vs in range(n):
            steps.append((mb + vs, vs, Pass("F", mb, s.owner(vs)[1])))
            steps.append((mb + 2 * n - vs, vs, Pass("B", mb, s.owner(vs)[1])))
            steps.append((mb + 2 * n - vs + 1, vs, Pass("W", mb, s.owner(vs)[1])))
    for _, vs, op in sorted(steps, key=lambda x: (x[0], x[1], x[2].op)):
        s.ranks[s.owner(vs)[0]].append(op)
    return s


class FakeTransport:
    """Gloo-like transport: asynchronous sends, receives matched FIFO per (source, destination), no tags."""

    def __init__(self, p):
        self.channels = {(a, b): queue.Queue() for a in range(p) for b in range(p)}

    def run(self, schedule, programs, timeout=5.0):
        errors = []

        def rank_main(rank):
            posted = {peer: [] for peer in range(schedule.stages)}  # receives in posting order
            received = set()
            try:
                for item in programs[rank]:
                    if isinstance(item, Send):
                        self.channels[(rank, item.msg.dst)].put(item.msg)  # the payload names itself
                    elif isinstance(item, Recv):
                        posted[item.msg.src].append(item.msg)
                    else:
                        need = consumed(schedule, rank, item)
                        while need is not None and need not in received:
                            expected = posted[need.src].pop(0)
                            got = self.channels[(need.src, rank)].get(timeout=timeout)
                            if got != expected:
                                raise AssertionError(f"rank {rank} expected {expected.describe()}, got {got.describe()}")
                            received.add(got)
            except Exception as e:  # collected and re-raised in the test thread
                errors.append(e)

        threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(schedule.stages)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        assert all(c.empty() for c in self.channels.values()), "messages left undelivered"


@pytest.mark.parametrize(
    "p,m,layout,chunks",
    [(2, 4, "single", 1), (4, 6, "single", 1), (2, 4, "v", 2), (3, 5, "v", 2), (4, 8, "interleaved", 2), (2, 1, "v", 2)],
)
def test_lowered_programs_run_on_in_order_transport(p, m, layout, chunks):
    s = wavefront(p, m, layout, chunks)
    programs = lower(s, Costs.make(s.num_virtual_stages, t_comm=0.1, chunks=chunks))
    check_lowering(s, programs)
    FakeTransport(p).run(s, programs)


def test_v_layout_with_two_ranks_sends_activations_and_gradients_the_same_way():
    s = wavefront(2, 4, "v", 2)
    programs = lower(s)
    kinds = {a.msg.kind for a in programs[0] if isinstance(a, Send) and a.msg.dst == 1}
    assert kinds == {"act", "grad"}  # stage 0 -> 1 activations and stage 3 -> 2 gradients share 0 -> 1
    FakeTransport(2).run(s, programs)


def test_turn_of_the_v_stays_on_its_rank():
    s = wavefront(3, 2, "v", 2)
    last = 2  # rank p-1 holds virtual stages 2 and 3
    assert produced(s, last, Pass("F", 0, 0)) is None
    assert consumed(s, last, Pass("F", 0, 1)) is None


def test_every_message_is_sent_once_and_received_once():
    s = wavefront(4, 5, "interleaved", 2)
    programs = lower(s)
    sends = [a.msg for prog in programs for a in prog if isinstance(a, Send)]
    recvs = [a.msg for prog in programs for a in prog if isinstance(a, Recv)]
    assert sorted(sends, key=repr) == sorted(recvs, key=repr) and len(set(sends)) == len(sends)


def test_receives_are_posted_before_the_compute_that_needs_them():
    s = one_f_one_b(4, 8)
    for rank, program in enumerate(lower(s)):
        posted = set()
        for item in program:
            if isinstance(item, Recv):
                posted.add(item.msg)
            elif isinstance(item, Pass):
                need = consumed(s, rank, item)
                assert need is None or need in posted


def test_swapped_receive_order_is_caught():
    s = one_f_one_b(2, 3)
    programs = lower(s)
    recv_positions = [i for i, a in enumerate(programs[1]) if isinstance(a, Recv)]
    i, j = recv_positions[0], recv_positions[1]
    programs[1][i], programs[1][j] = programs[1][j], programs[1][i]
    with pytest.raises(ScheduleError, match="rank 1"):
        check_lowering(s, programs)
    with pytest.raises(AssertionError, match="expected the activation of microbatch 1"):
        FakeTransport(2).run(s, programs, timeout=1.0)


def test_crossing_sends_posted_before_receives_deadlock_on_a_serial_pair_stream():
    s = wavefront(2, 3, "v", 2)
    programs = lower(s)
    # Rank 1 posts each receive only just before the compute that needs it, so at some point both ranks
    # have a send to the other at the head of their pair stream.
    late = []
    for item in programs[1]:
        if isinstance(item, Pass) and consumed(s, 1, item) is not None:
            late.append(Recv(consumed(s, 1, item)))
        if not isinstance(item, Recv):
            late.append(item)
    programs[1] = late
    FakeTransport(2).run(s, programs)  # gloo's asynchronous sends tolerate this ...
    with pytest.raises(ScheduleError, match="communication deadlock"):
        check_lowering(s, programs)  # ... NCCL's serial per-pair stream does not
