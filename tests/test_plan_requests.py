"""The planning problem types and the registry: one MemoryLimit value for both units, defaults resolved by
the registry before any planner runs, every schedule fact in planners.SCHEDULES, and no import cycle."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from megatron.zero_bubble.schedules import Costs, MemoryLimit, ScheduleError
from megatron.zero_bubble.schedules import planners
from megatron.zero_bubble.schedules.auto import zb_auto
from megatron.zero_bubble.schedules.planners import PlanRequest, plan, resolve
from megatron.zero_bubble.schedules.vbudget import zb_v

SCHEDULES_DIR = Path(planners.__file__).parent


def test_a_memory_limit_is_in_microbatches_or_absolute_never_both():
    assert MemoryLimit.of(8) == MemoryLimit(8) and MemoryLimit.of(None, 2.5) == MemoryLimit(2.5, absolute=True)
    assert MemoryLimit.of() is None and MemoryLimit.of(MemoryLimit(3)) == MemoryLimit(3)
    with pytest.raises(ScheduleError, match="not both"):
        MemoryLimit.of(8, 2.5)


def test_per_rank_limits_scale_microbatches_by_each_ranks_activation_and_repeat_absolute_ones():
    costs = Costs.make(4, m_f=[2.0, 1.0, 1.0, 3.0], memory_unit="bytes")
    assert MemoryLimit(2).per_rank(4, 1, "single", costs) == [4.0, 2.0, 2.0, 6.0]
    assert MemoryLimit(10, absolute=True).per_rank(4, 1, "single", costs) == [10.0] * 4
    with pytest.raises(ScheduleError, match="must be positive"):
        MemoryLimit(0).per_rank(4, 1, "single", costs)


def test_plan_request_holds_its_limit_as_one_memory_limit_value():
    assert PlanRequest(4, 8, memory_limit=8).memory_limit == MemoryLimit(8)
    limit = MemoryLimit(1.5, absolute=True)
    assert PlanRequest(4, 8, memory_limit=limit).memory_limit == limit
    assert PlanRequest(4, 8).memory_limit is None


def test_the_registry_resolves_chunks_costs_and_the_default_limit_before_planning():
    r = resolve("zb-v", PlanRequest(4, 8))
    assert r.chunks == 2 and r.costs == Costs.make(8, chunks=2) and r.memory_limit == MemoryLimit(4)
    assert resolve("zb-auto", PlanRequest(4, 8)).memory_limit == MemoryLimit(8)
    assert resolve("zb-h1", PlanRequest(4, 8)).memory_limit is None  # its memory is fixed by its order
    given = resolve("zb-auto", PlanRequest(4, 8, memory_limit=5))
    assert given.memory_limit == MemoryLimit(5)


def test_every_limit_spelling_plans_the_same_schedule():
    costs = Costs.make(4, t_f=1.0, t_b=1.2, t_w=0.6, t_comm=0.1)
    by_value = plan("zb-auto", PlanRequest(4, 8, costs=costs, memory_limit=MemoryLimit(5), ilp_time_limit=0))
    assert by_value.ranks == plan("zb-auto", PlanRequest(4, 8, costs=costs, memory_limit=5, ilp_time_limit=0)).ranks
    assert by_value.ranks == zb_auto(4, 8, costs, 5, ilp_time_limit=0).ranks
    assert by_value.ranks == zb_auto(4, 8, costs, MemoryLimit(5), ilp_time_limit=0).ranks
    absolute = zb_auto(4, 8, costs, MemoryLimit(3.5, absolute=True), ilp_time_limit=0)
    assert absolute.ranks == plan("zb-auto", PlanRequest(4, 8, costs, memory_limit=MemoryLimit(3.5, absolute=True),
                                                         ilp_time_limit=0)).ranks
    assert absolute.info["planner"]["memory_limit_absolute"] == 3.5
    v_costs = Costs.make(8, chunks=2)
    assert zb_v(4, 8, v_costs).ranks == zb_v(4, 8, v_costs, MemoryLimit(4)).ranks
    assert zb_v(4, 8, v_costs).ranks == plan("zb-v", PlanRequest(4, 8)).ranks


def test_the_registry_names_the_schedules_training_offers_and_what_each_supports():
    assert planners.pipeline_schedule_names() == ("1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "zb-auto", "zb-v")
    assert planners.split_backward_schedules() == ("zb-h1", "zb-h2", "zb-auto", "zb-v")
    assert planners.conflicting_options("zb-h1") == planners.conflicting_options("1f1b") == ()
    v_options = {c.option for c in planners.conflicting_options("zb-v")}
    assert v_options == {"decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers", "mtp_num_layers"}
    assert "overlap_grad_reduce" not in v_options  # a V follows a layout string and the embedding/loss accounting


def _relative_imports(path: Path) -> tuple[set[str], bool]:
    """The sibling modules a module imports, and whether any import sits inside a function."""
    tree = ast.parse(path.read_text())
    top = {id(node) for node in tree.body}
    names, nested = set(), False
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            names |= {node.module.split(".")[0]} if node.module else {a.name for a in node.names}
            nested = nested or id(node) not in top
    return names, nested


def test_the_planning_layer_has_no_import_cycle_and_no_import_on_use():
    graph = {}
    for path in SCHEDULES_DIR.glob("*.py"):
        graph[path.stem], nested = _relative_imports(path)
        assert not nested, f"{path.name} imports a sibling inside a function"
    done, active = set(), []

    def visit(module):
        assert module not in active, f"import cycle: {' -> '.join(active + [module])}"
        if module in done:
            return
        active.append(module)
        for target in graph.get(module, ()):
            visit(target)
        active.pop()
        done.add(module)

    for module in graph:
        visit(module)


@pytest.mark.slow  # a process
def test_the_planning_layer_imports_no_torch():
    modules = [f"megatron.zero_bubble.schedules.{p.stem}" for p in SCHEDULES_DIR.glob("*.py") if p.stem != "__init__"]
    code = "import importlib, sys\n" + "".join(f"importlib.import_module({m!r})\n" for m in modules)
    code += "assert 'torch' not in sys.modules, 'torch was imported'\n"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@pytest.mark.parametrize("enabled", [True, False])
def test_planning_runs_without_the_cyclic_collector_and_leaves_it_as_it_was(enabled):
    """A plan of 16 stages allocates enough for many automatic collections; none runs while it is built (planners
    create no garbage cycles worth collecting) and the collector is on again afterwards if it was on before."""
    import gc

    while_planning = []

    def seen(phase, info):
        frame = sys._getframe()
        while frame is not None and frame.f_code is not planners._plan_with_timeline.__code__:
            frame = frame.f_back
        if phase == "start":
            while_planning.append(frame is not None)

    (gc.enable if enabled else gc.disable)()
    gc.callbacks.append(seen)
    try:
        schedule = plan("zb-v", PlanRequest(stages=16, microbatches=64))
        assert gc.isenabled() == enabled
        gc.collect()  # an explicit collection: the callback sees collections
    finally:
        gc.callbacks.remove(seen)
        gc.enable()
    assert while_planning[-1] is False and not any(while_planning)
    assert schedule.info["predicted"]["bubble_rate"] >= 0
