"""The runtime's pipeline links cost no collective call at any scale: one rank of a 4096-rank job (TP8 x PP16 x DP32)
on torch's fake process-group backend, with megatron's parallel state (tests/fake_world_links.py, a process of its
own). The runtime sends on megatron's pipeline group and warms its links up with one batch of point-to-point
operations; megatron's own group making is counted the same way, to show that the counting sees group calls."""
import pytest

from tests.launching import child_result


@pytest.mark.slow
def test_building_and_warming_up_the_links_makes_no_collective_call_at_world_4096():
    result = child_result(["-m", "tests.fake_world_links", "1234"], timeout=300)
    assert result["megatron"].get("new_group", 0) > 4096  # the control: megatron's groups, each one counted
    assert result["links"] == {"batch_isend_irecv": 1}  # the warm-up, and no collective or group call
    assert result["pp_size"] == 16
    pp_rank = result["pp_rank"]
    assert result["warm"] == sorted({(pp_rank - 1) % 16, (pp_rank + 1) % 16})
