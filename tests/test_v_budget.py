"""The V planner under a memory budget (issue 12): valid plans over a grid, never worse with more memory,
V-Min's floor refused below, the paper's building blocks, the squeezes' memory, and the trade-off picture."""
import random

import pytest

from megatron.zero_bubble.schedules import Costs, Schedule, ScheduleError, simulate, validate
from megatron.zero_bubble.cli import main
from megatron.zero_bubble.schedules.memory import memory_profile
from megatron.zero_bubble.schedules.vblocks import Grid, Shape, block_order, build_block, free_start, paper_shape
from megatron.zero_bubble.schedules.vbudget import mem_setup_limit, plan_v, v_half, v_min, v_plans, zb_v
from megatron.zero_bubble.schedules.vcompact import left_justify, refill_weight_passes, right_justify
from megatron.zero_bubble.schedules.problem import MemoryLimit


def uneven_costs(p):
    """Unequal virtual stages (a heavier first stage, the LM head on the last), T_W below T_F, T_comm > 0."""
    n = 2 * p
    t_f = [0.55] + [0.5] * (n - 2) + [0.8]
    t_b = [0.6] + [0.55] * (n - 2) + [0.9]
    t_w = [0.3] + [0.25] * (n - 2) + [0.5]
    return Costs.make(n, t_f=t_f, t_b=t_b, t_w=t_w, t_comm=0.08, chunks=2)


def paper_costs(p):
    """The 1.5B model's profiled times per rank (ms), each chunk of the V taking half."""
    return Costs.make(2 * p, 18.5 / 2, 18.1 / 2, 9.3 / 2, 0.7, chunks=2)


def check_plans_over(p, microbatch_counts):
    low, half = mem_setup_limit("min", p), mem_setup_limit("half", p)
    budgets = {"v-min": low, "v-half": half, "between": (half + p) / 2, "zb-v": float(p)}
    for m in microbatch_counts:
        # Alternate the costs so that every planner meets equal, paper-like and uneven stages with T_comm.
        costs = [Costs.make(2 * p, chunks=2), paper_costs(p), uneven_costs(p)][(p + m) % 3]
        plans = v_plans(p, m, costs, {name: MemoryLimit(b) for name, b in budgets.items()})
        for name, schedule in plans.items():
            timeline = validate(schedule, costs, memory_limit=budgets[name])  # send/receive order included
            assert 0.0 <= timeline.bubble_rate < 1.0, (p, m, name)
            for passes in schedule.ranks:  # every chunk's F, B and W in microbatch order on its rank
                for op in "FBW":
                    for chunk in (0, 1):
                        assert [x.mb for x in passes if x.op == op and x.chunk == chunk] == list(range(m))


@pytest.mark.parametrize("p", range(2, 9))
def test_plans_for_a_sample_of_the_grid_pass_the_validator_within_their_budgets(p):
    check_plans_over(p, sorted({1, 2, p, p + 1, 3 * p}))


@pytest.mark.slow
@pytest.mark.parametrize("p", range(2, 9))
def test_every_plan_over_the_whole_grid_passes_the_validator_within_its_budget(p):
    check_plans_over(p, range(1, 3 * p + 1))


@pytest.mark.parametrize("p,m,costs", [(4, 12, uneven_costs(4)), (6, 12, paper_costs(6)), (8, 16, paper_costs(8))])
def test_the_bubble_never_rises_as_the_budget_grows_and_equals_zb_v_at_p(p, m, costs):
    low = mem_setup_limit("min", p)
    budgets = sorted({low + k * 0.25 for k in range(int((p - low) / 0.25) + 1)} | {p + 0.5, 1.5 * p, 2 * p})
    plans = v_plans(p, m, costs, {b: MemoryLimit(b) for b in budgets})
    bubbles = [simulate(plans[b], costs).bubble_rate for b in budgets]
    assert all(later <= earlier + 1e-12 for earlier, later in zip(bubbles, bubbles[1:])), bubbles
    assert bubbles[0] > bubbles[budgets.index(p)]  # memory buys something here
    at_p = simulate(zb_v(p, m, costs), costs)
    assert at_p.bubble_rate == bubbles[budgets.index(p)]
    assert max(at_p.peak_memory) <= p + 1e-9


@pytest.mark.parametrize("limit", [MemoryLimit(2.5), MemoryLimit(0.5), MemoryLimit(1.4, absolute=True)])
def test_a_budget_below_v_min_is_refused_in_one_line_naming_the_minimum(limit):
    with pytest.raises(ScheduleError) as refused:
        plan_v("zb-v", 8, 16, None, limit)  # V-Min's floor((8+4)/3) = 4 M_B; M_B = 1 per rank here
    message = str(refused.value)
    assert "\n" not in message and "below V-Min's floor((p+4)/3) = 4 M_B" in message


def test_mem_setup_names_the_papers_three_budgets():
    assert [mem_setup_limit(s, 8) for s in ("min", "half", "zb")] == [4, 5, 8]
    assert [mem_setup_limit(s, 16) for s in ("min", "half", "zb")] == [6, 9, 16]
    with pytest.raises(ScheduleError, match="unknown V memory setup 'tiny'"):
        mem_setup_limit("tiny", 8)


def test_the_named_planners_are_the_budgeted_planner_at_the_papers_peaks():
    p, m, costs = 8, 16, paper_costs(8)
    shared = v_plans(p, m, costs, {"v-min": MemoryLimit(4), "v-half": MemoryLimit(5), "zb-v": MemoryLimit(8)})
    for name, planner in (("v-min", v_min), ("v-half", v_half), ("zb-v", zb_v)):
        alone = planner(p, m, costs)
        assert alone.name == name and alone.ranks == shared[name].ranks
    rates = [simulate(shared[name], costs).bubble_rate for name in ("v-min", "v-half", "zb-v")]
    assert rates[0] >= rates[1] >= rates[2]


@pytest.mark.parametrize("p", range(2, 13))
def test_the_paper_blocks_are_the_papers_offsets(p):
    # V-Min: rank i runs F0, F1, B1, B0 at slots i, 2p-1-i, 2p+s+i, 4p+s-1-i (s = 2 if 3 divides p);
    # V-Half: 2i, 3p-2-i, 3p+s+2i-1, 6p+s-2-i (s = 3 for even p); arXiv 2405.15362
    for kind in ("min", "half"):
        block = build_block(p, Grid.unit(2 * p), paper_shape(p, kind))
        for i in range(p):
            u = 2 * p - 1 - i
            got = (block.f[i], block.f[u], block.b[u], block.b[i])
            if kind == "min":
                s = 2 if p % 3 == 0 else 0
                assert got == (i, 2 * p - 1 - i, 2 * p + s + i, 4 * p + s - 1 - i)
            else:
                s = 3 if p % 2 == 0 else 0
                assert got == (2 * i, 3 * p - 2 - i, 3 * p + s + 2 * i - 1, 6 * p + s - 2 - i)


def test_a_block_on_the_costs_grid_keeps_the_steady_state_tight_where_unit_slots_idle():
    # The 1.5B model's times: on a grid of T_W, F and B take two slots and W one, so ranks stay busy in the
    # steady state; the paper's V-Min block in unit slots (the reference's pattern) makes them wait.
    p, m, costs = 8, 48, paper_costs(8)

    def period(block):
        timeline = simulate(Schedule(p, 2, m, "v", block_order(block, p, m)), costs)
        starts = [t.start for t in timeline.ranks[0] if t.op.op == "F" and t.op.chunk == 0]
        return (starts[40] - starts[20]) / 20

    work = 18.5 + 18.1 + 9.3  # T_F + T_B + T_W of a rank
    assert period(build_block(p, Grid.of(costs, 9.3 / 2), Shape())) < 1.04 * work  # T_comm is off the grid
    assert period(build_block(p, Grid.unit(2 * p), paper_shape(p, "min"))) > 1.2 * work


@pytest.mark.parametrize("squeeze", [left_justify, right_justify, refill_weight_passes])
def test_squeezes_keep_memory_within_the_limit_and_the_plan_valid(squeeze):
    p, m, costs = 6, 18, paper_costs(6)
    base = Schedule(p, 2, m, "v", block_order(build_block(p, Grid.unit(2 * p), paper_shape(p, "half")), p, m))
    limit = mem_setup_limit("half", p)
    squeezed = squeeze(base, costs, [limit] * p)
    validate(squeezed, costs, memory_limit=limit)
    assert max(max(x) for x in memory_profile(squeezed, costs)) <= limit + 1e-9
    assert sorted(map(str, sum(squeezed.ranks, []))) == sorted(map(str, sum(base.ranks, [])))


def test_compare_draws_the_tradeoff_picture_and_prints_the_same_table(tmp_path, capsys):
    argv = ["compare", "--schedules", "1f1b,zb-h1,v-min,v-half,zb-v", "-p", "4", "-m", "8",
            "--t-f", "2", "--t-b", "2", "--t-w", "1", "--t-comm", "0.1"]
    assert main(argv) == 0
    plain = capsys.readouterr().out
    picture = tmp_path / "tradeoff.png"
    assert main(argv + ["--tradeoff", str(picture)]) == 0
    out, err = capsys.readouterr()
    table = [line for line in plain.splitlines() if not line.endswith(" s")]  # planning times vary
    assert [line for line in out.splitlines() if not line.endswith(" s")] == table
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and picture.stat().st_size > 10_000
    assert f"wrote {picture}" in err


def test_mem_setup_sets_a_v_schedules_budget_and_is_refused_elsewhere(capsys):
    assert main(["simulate", "--schedule", "zb-v", "-p", "8", "-m", "16", "--mem-setup", "half"]) == 0
    out = capsys.readouterr().out
    assert "peak activation memory (max over ranks): " in out
    peak = float(out.split("peak activation memory (max over ranks): ")[1].split()[0])
    assert peak <= 5
    assert main(["simulate", "--schedule", "zb-h1", "-p", "8", "-m", "16", "--mem-setup", "half"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--mem-setup applies to the V schedules" in err[0]


def test_a_budget_in_bytes_holds_on_every_rank_with_the_lm_head_on_rank_0():
    p, m = 4, 8
    costs = Costs.from_model(layers=8, hidden=256, heads=4, seq_length=128, micro_batch=2, vocab=1024,
                             num_virtual_stages=2 * p, time_unit="ms")
    rank_mb = [costs.m_f[r] + costs.m_f[2 * p - 1 - r] for r in range(p)]
    assert rank_mb[0] > rank_mb[1]  # the last virtual stage (the head) lives on rank 0
    budget = 3 * max(rank_mb)  # bytes: V-Half's 3 M_B on the heaviest rank, more than that elsewhere
    schedule = zb_v(p, m, costs, MemoryLimit(budget, absolute=True))
    timeline = validate(schedule, costs, MemoryLimit(budget, absolute=True))
    assert max(timeline.peak_memory) <= budget
    with pytest.raises(ScheduleError, match="below V-Min's"):
        zb_v(p, m, costs, MemoryLimit(1.5 * max(rank_mb), absolute=True))


def test_the_block_builders_slot_search_finds_the_first_free_run_around_the_ring():
    """vblocks.free_start jumps over taken runs; it must return what trying every start in turn returns."""
    def every_start(cells, ready, length):
        period = len(cells)
        for start in range(ready, ready + period):
            if length <= period and all(not cells[(start + i) % period] for i in range(length)):
                return start
        return None

    rng = random.Random(7)
    for _ in range(3000):
        period = rng.randint(1, 24)
        cells = bytearray(rng.random() < rng.choice((0.2, 0.5, 0.9)) for _ in range(period))
        ready, length = rng.randint(0, 3 * period), rng.randint(0, period + 1)
        assert free_start(cells, ready, length) == every_start(cells, ready, length), (cells, ready, length)
