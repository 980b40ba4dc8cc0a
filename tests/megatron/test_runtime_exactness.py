"""The zero-bubble executor on megatron-core (CPU, gloo): bit-identical to megatron's own 1F1B.

One spawned group of 4 ranks runs every scenario in turn (process start and megatron import are the
slow part); the parent compares the reports with torch.equal.
"""
import dataclasses
import functools
import statistics
import time

import pytest

from tests.megatron import harness, rank_model, training_case
from tests.megatron.harness import Layout, ModelSpec

SPEC = ModelSpec()
ZB_SCHEDULES = ("zb-h1", "zb-h2", "zb-auto")
V_SCHEDULES = ("zb-v", "v-half", "v-min")


# Costs (T_F, T_B, T_W per virtual stage, T_comm) that make the cost-aware planners order passes differently from
# their plans on unit costs: a slow last stage and weight gradients three times a forward.
SKEWED_COSTS = ((1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 3.0), (1.0,) * 8, (3.0,) * 8, 0.5)


@dataclasses.dataclass(frozen=True)
class Case(training_case.Case):
    """Megatron's grad norm sums each rank's partial norm, so its last bit depends on which layers (and, with the
    distributed optimizer, which shards) share a rank: runs compared across layouts step without clipping."""

    patch_only: bool = False  # megatron's schedule on layers split into stores that are never active
    slow_first_stage_s: float = 0.0  # > 0: every F on pipeline rank 0 takes this much longer; passes are timed


def _slow_on_first_stage(seconds: float, data_iterator, model):
    from megatron.core import parallel_state

    if parallel_state.get_pipeline_model_parallel_rank() == 0:
        time.sleep(seconds)
    return rank_model.gpt_forward_step(data_iterator, model)


def _recorded(function, events: list, event: tuple):
    def call(*args, **kwargs):
        events.append(event)
        return function(*args, **kwargs)

    return call


def _record_reductions(chunks: list, events: list) -> None:
    """Log ("reduce", chunk, bucket group) each time megatron DDP starts a bucket group's gradient reduction."""
    for k, chunk in enumerate(chunks):
        for i, group in enumerate(chunk.bucket_groups + chunk.expert_parallel_bucket_groups):
            def start(*args, _original=group.start_grad_sync, _key=(k, i), **kwargs):
                events.append(("reduce", *_key))
                return _original(*args, **kwargs)

            group.start_grad_sync = start


def _pass_observer(case: Case, events: list):
    """Log ("pass", op, chunk, microbatch[, seconds]) of each pass our executor runs, where the case looks at them."""
    if case.slow_first_stage_s:
        return lambda p, start, end: events.append(("pass", p.op, p.chunk, p.mb, end - start))
    if case.overlap and case.schedule is not None:
        return lambda p, start, end: events.append(("pass", p.op, p.chunk, p.mb))
    return None


def _run_case(case: Case) -> dict:
    from megatron.zero_bubble.runtime.wgrad_store import WeightGradStore

    events = []  # of the last step: passes of our executor, reductions megatron's DDP starts
    forward_step = None
    if case.slow_first_stage_s:
        forward_step = functools.partial(_slow_on_first_stage, case.slow_first_stage_s)
    with training_case.CaseRun(case, observer=_pass_observer(case, events), forward_step=forward_step) as run:
        chunks = run.chunks
        if case.patch_only:  # megatron's schedule on layers whose W goes to a store that is never active
            stores = [WeightGradStore(f"chunk {k}") for k in range(len(chunks))]
            assert all(store.attach(chunk, run.session.megatron) for store, chunk in zip(stores, chunks))
        if case.overlap and len(chunks) > 1 and case.distributed:  # as megatron.training does (align_param_gather)
            chunks[0].config.param_sync_func = [_recorded(chunk.start_param_sync, events, ("param sync", k))
                                                for k, chunk in enumerate(chunks)]
        if case.overlap:
            _record_reductions(chunks, events)
        for step in range(case.steps):
            events.clear()
            run.iteration(step)
            if run.optimizer is not None:
                assert run.step()[0]
        executor = run.session.executor
        return run.report(stats=executor.last_stats if executor is not None else None, events=list(events),
                          kept_in_b=[store.kept_in_b for store in executor.stores] if executor is not None else [],
                          bucket_groups=[len(c.bucket_groups + c.expert_parallel_bucket_groups) for c in chunks]
                          if run.ddp else [])


SPEC8 = ModelSpec(num_layers=8)
SPEC16 = ModelSpec(num_layers=16)
CASES = [
    Case("pp4/megatron", Layout(pp=4), None, microbatches=8),
    Case("pp4/megatron+patch", Layout(pp=4), None, microbatches=8, patch_only=True),
    Case("pp4/1f1b", Layout(pp=4), "1f1b", microbatches=8),
    *[Case(f"pp4/{s}", Layout(pp=4), s, microbatches=8) for s in ZB_SCHEDULES],
    Case("pp4/zb-h1/m3", Layout(pp=4), "zb-h1", microbatches=3),
    Case("pp4/megatron/m3", Layout(pp=4), None, microbatches=3),
    Case("pp4/megatron/eval", Layout(pp=4), None, microbatches=8, forward_only=True),
    Case("pp4/zb-h2/eval", Layout(pp=4), "zb-h2", microbatches=8, forward_only=True),
    Case("pp2xdp2/megatron", Layout(pp=2), None, microbatches=4, optimizer="adam", steps=3),
    *[Case(f"pp2xdp2/{s}", Layout(pp=2), s, microbatches=4, optimizer="adam", steps=3) for s in ZB_SCHEDULES],
    Case("tp2xpp2/megatron", Layout(tp=2, pp=2), None, microbatches=4),
    *[Case(f"tp2xpp2/{s}", Layout(tp=2, pp=2), s, microbatches=4) for s in ZB_SCHEDULES],
    Case("pp4vpp2/megatron", Layout(pp=4, vpp=2), None, microbatches=8, spec=SPEC8),
    Case("pp4vpp2/interleaved-1f1b", Layout(pp=4, vpp=2), "interleaved-1f1b", microbatches=8, spec=SPEC8),
    # zb-auto over several chunks per rank, in megatron's interleaved placement (planned on skewed costs at v=2)
    Case("pp4vpp2/zb-auto", Layout(pp=4, vpp=2), "zb-auto", microbatches=8, spec=SPEC8, costs=SKEWED_COSTS),
    Case("pp4vpp4/megatron", Layout(pp=4, vpp=4), None, microbatches=8, spec=SPEC16),
    Case("pp4vpp4/zb-auto", Layout(pp=4, vpp=4), "zb-auto", microbatches=8, spec=SPEC16),
    *[Case(f"pp2xdp2vpp2/{s or 'megatron'}/overlap", Layout(pp=2, vpp=2), s, microbatches=4, optimizer="adam",
           steps=3, overlap=True, every_stage_buckets=s is not None, spec=SPEC8) for s in (None, "zb-auto")],
    # ZB-V against a single-stage run of the same model (DP=4 replicas there, all on the same data)
    Case("pp1/megatron", Layout(), None, microbatches=4),
    Case("pp2xdp2/zb-v", Layout(pp=2, vpp=2), "zb-v", microbatches=4),
    Case("pp1/megatron/8", Layout(), None, microbatches=8, spec=SPEC8),
    *[Case(f"pp4/{s}", Layout(pp=4, vpp=2), s, microbatches=8, spec=SPEC8) for s in V_SCHEDULES],
    # megatron DDP's overlapped reduction (and, distributed, overlapped parameter gathers): three Adam steps, the
    # first of which megatron never overlaps (it learns each bucket's parameters then)
    *[Case(f"pp2xdp2/{s or 'megatron'}/overlap", Layout(pp=2), s, microbatches=4, optimizer="adam", steps=3,
           overlap=True, every_stage_buckets=s is not None) for s in (None,) + ZB_SCHEDULES],
    # the same buckets on both sides: the distributed optimizer's shards follow them
    *[Case(f"pp2xdp2/{s or 'megatron'}/overlap/distributed", Layout(pp=2), s, microbatches=4, optimizer="adam",
           steps=3, overlap=True, distributed=True, every_stage_buckets=True) for s in (None, "zb-h1", "zb-auto")],
    Case("pp1/megatron/adam", Layout(), None, microbatches=4, optimizer="adam", steps=3, clip_grad=0.0),
    Case("pp2/zb-h1/timed", Layout(pp=2), "zb-h1", microbatches=4, slow_first_stage_s=0.2),
    # against PP=1 (other layers per rank) and without the distributed optimizer (other shards): no clipping
    Case("pp2xdp2/zb-v/overlap", Layout(pp=2, vpp=2), "zb-v", microbatches=4, optimizer="adam", steps=3,
         overlap=True, every_stage_buckets=True, clip_grad=0.0),
    Case("pp2xdp2/zb-v/overlap/distributed", Layout(pp=2, vpp=2), "zb-v", microbatches=4, optimizer="adam", steps=3,
         overlap=True, distributed=True, every_stage_buckets=True, clip_grad=0.0),
    # the output layer's W kept inside B (on the last rank; in the V, on rank 0's second chunk), and in the V the
    # row-parallel layers' too (every chunk's linear_proj and linear_fc2)
    Case("pp2xdp2/zb-h1/overlap/head-in-b", Layout(pp=2), "zb-h1", microbatches=4, optimizer="adam", steps=3,
         overlap=True, every_stage_buckets=True, head_wgrad="in-b"),
    Case("pp4/zb-v/head-in-b", Layout(pp=4, vpp=2), "zb-v", microbatches=8, spec=SPEC8, head_wgrad="in-b",
         rows_wgrad="in-b"),
    # the same run planned on other costs: another pass order, the same numbers (clipping on: same layout)
    *[Case(f"pp4/{s}/adam{costs}", Layout(pp=4, vpp=2 if s == "zb-v" else None), s, microbatches=8,
           optimizer="adam", steps=2, spec=SPEC8 if s == "zb-v" else SPEC, costs=SKEWED_COSTS if costs else None)
      for s in ("zb-auto", "zb-v") for costs in ("", "/skewed")],
]


@pytest.fixture(scope="module")
def reports():
    return harness.run_cases(_run_case, CASES, 4, timeout=600)


@pytest.mark.exactness
@pytest.mark.parametrize("schedule", ("1f1b",) + ZB_SCHEDULES)
def test_pp4_gradients_and_losses_are_bit_identical_to_megatron_1f1b(reports, schedule):
    harness.assert_identical(reports[f"pp4/{schedule}"], reports["pp4/megatron"])


@pytest.mark.exactness
def test_fewer_microbatches_than_stages_is_bit_identical(reports):
    harness.assert_identical(reports["pp4/zb-h1/m3"], reports["pp4/megatron/m3"])


@pytest.mark.exactness
@pytest.mark.parametrize("schedule", ZB_SCHEDULES)
def test_dp2_pp2_with_megatron_ddp_and_three_adam_steps_is_bit_identical(reports, schedule):
    harness.assert_identical(reports[f"pp2xdp2/{schedule}"], reports["pp2xdp2/megatron"])


@pytest.mark.exactness
@pytest.mark.parametrize("schedule", ZB_SCHEDULES)
def test_tp2_pp2_is_bit_identical(reports, schedule):
    harness.assert_identical(reports[f"tp2xpp2/{schedule}"], reports["tp2xpp2/megatron"])


@pytest.mark.parametrize(
    "label", [f"pp4/{s}" for s in ("1f1b",) + ZB_SCHEDULES + V_SCHEDULES] + ["pp4/zb-h1/m3", "tp2xpp2/zb-h2", "pp2xdp2/zb-v"]
)
@pytest.mark.exactness
def test_measured_peak_activations_equal_the_planners_prediction(reports, label):
    from megatron.zero_bubble.schedules import Costs
    from megatron.zero_bubble.schedules.memory import memory_profile

    case = next(c for c in CASES if c.label == label)
    schedule = training_case.planned(case.schedule, case.layout.pp, case.microbatches)
    n = schedule.num_virtual_stages
    held_for_b = memory_profile(schedule, Costs.make(n, m_f=1.0, m_w=0.0))
    held_until_w = memory_profile(schedule, Costs.make(n, m_f=1.0, m_w=1.0))
    for report in reports[label]:
        stats, rank = report["stats"], report["pp_rank"]
        assert stats.peak_activations == max(held_for_b[rank])
        assert stats.peak_in_flight == max(held_until_w[rank])
        if case.schedule != "1f1b" and max(held_until_w[rank]) > max(held_for_b[rank]):
            assert stats.peak_wgrad_bytes > 0  # W work was actually held back


@pytest.mark.exactness
def test_linear_patch_without_a_zero_bubble_schedule_changes_nothing(reports):
    harness.assert_identical(reports["pp4/megatron+patch"], reports["pp4/megatron"])


@pytest.mark.exactness
def test_forward_only_evaluation_gives_megatrons_losses(reports):
    ours, reference = (harness.merge_by_dp_rank(reports[label]) for label in ("pp4/zb-h2/eval", "pp4/megatron/eval"))
    assert ours[0]["losses"] == reference[0]["losses"] and len(reference[0]["losses"]) == 8


@pytest.mark.exactness
def test_interleaved_1f1b_through_the_runtime_is_bit_identical_to_megatrons(reports):
    harness.assert_identical(reports["pp4vpp2/interleaved-1f1b"], reports["pp4vpp2/megatron"])


@pytest.mark.parametrize("label, reference", [("pp4vpp2/zb-auto", "pp4vpp2/megatron"),
                                              ("pp4vpp4/zb-auto", "pp4vpp4/megatron"),
                                              ("pp2xdp2vpp2/zb-auto/overlap", "pp2xdp2vpp2/megatron/overlap")])
@pytest.mark.exactness
def test_interleaved_zb_auto_is_bit_identical_to_megatrons_interleaved_1f1b(reports, label, reference):
    """Losses, gradients and (with DP=2, overlapped reduction and three Adam steps) parameters: zb-auto's plan over
    v chunks per rank splits every backward into B and W and reorders them, the numbers stay megatron's."""
    case = next(c for c in CASES if c.label == label)
    schedule = training_case.planned(case.schedule, case.layout.pp, case.microbatches, case.costs,
                                     chunks=case.layout.vpp)
    assert schedule.chunks == case.layout.vpp and any(p.op == "W" for p in schedule.ranks[0])
    harness.assert_identical(reports[label], reports[reference])


@pytest.mark.exactness
def test_zb_v_with_two_ranks_is_bit_identical_to_a_single_stage_run(reports):
    harness.assert_identical(reports["pp2xdp2/zb-v"], reports["pp1/megatron"], replicas=[0, 1])


@pytest.mark.exactness
@pytest.mark.parametrize("schedule", V_SCHEDULES)
def test_v_schedules_on_four_ranks_are_bit_identical_to_a_single_stage_run(reports, schedule):
    harness.assert_identical(reports[f"pp4/{schedule}"], reports["pp1/megatron/8"], replicas=[0])


@pytest.mark.exactness
@pytest.mark.parametrize("schedule", ("megatron",) + ZB_SCHEDULES)
def test_overlapped_gradient_reduction_is_bit_identical_to_megatrons(reports, schedule):
    harness.assert_identical(reports[f"pp2xdp2/{schedule}/overlap"], reports["pp2xdp2/megatron/overlap"])
    harness.assert_identical(reports[f"pp2xdp2/{schedule}/overlap"], reports["pp2xdp2/megatron"])  # overlap changes nothing


@pytest.mark.exactness
@pytest.mark.parametrize("schedule", ("zb-h1", "zb-auto"))
def test_overlapped_reduction_and_parameter_gathers_with_the_distributed_optimizer_are_bit_identical(reports, schedule):
    harness.assert_identical(reports[f"pp2xdp2/{schedule}/overlap/distributed"], reports["pp2xdp2/megatron/overlap/distributed"])


@pytest.mark.exactness
def test_zb_v_with_overlapped_reduction_is_bit_identical_to_a_single_stage_run(reports):
    """Three Adam steps without clipping: megatron's grad norm adds one partial norm per pipeline rank, so a clip
    coefficient of PP=2 and one of PP=1 can differ in the last bit whatever the schedule (megatron's own 1F1B
    too); which bit depends on the CPU's vector width (AVX-512 against AVX2)."""
    harness.assert_identical(reports["pp2xdp2/zb-v/overlap"], reports["pp1/megatron/adam"], replicas=[0, 1])


@pytest.mark.exactness
@pytest.mark.parametrize("schedule", ("zb-auto", "zb-v"))
def test_plans_on_other_costs_give_bit_identical_losses_gradients_and_parameters(reports, schedule):
    """Two Adam steps with clipping, once planned on unit costs and once on skewed ones: the pass orders differ,
    the numbers may not (each stage accumulates W in microbatch order whatever the plan)."""
    plans = [training_case.planned(schedule, 4, 8, costs) for costs in (None, SKEWED_COSTS)]
    assert plans[0].ranks != plans[1].ranks
    harness.assert_identical(reports[f"pp4/{schedule}/adam/skewed"], reports[f"pp4/{schedule}/adam"])


@pytest.mark.exactness
def test_zb_v_with_the_distributed_optimizer_starts_each_chunks_parameter_gathers_and_keeps_the_parameters(reports):
    """Two chunks per rank: megatron.training hands the schedule one param_sync_func per chunk (aligned gathers),
    which the executor calls as an iteration begins. Parameters and losses as without the distributed optimizer
    (a rank's gradient buffer holds reduced values only in its shards, so gradients are not compared)."""
    harness.assert_identical(reports["pp2xdp2/zb-v/overlap/distributed"], reports["pp2xdp2/zb-v/overlap"], grads=False)
    for report in reports["pp2xdp2/zb-v/overlap/distributed"]:
        assert report["events"][:2] == [("param sync", 0), ("param sync", 1)]  # before the iteration's first pass


@pytest.mark.parametrize("label", [f"pp2xdp2/{s}/overlap" for s in ZB_SCHEDULES + ("zb-v",)]
                         + [f"pp2xdp2/{s}/overlap/distributed" for s in ("zb-h1", "zb-auto")]
                         + ["pp2xdp2vpp2/zb-auto/overlap"])
@pytest.mark.exactness
def test_each_bucket_is_reduced_once_and_the_first_while_w_passes_still_run(reports, label):
    """In an iteration after the first (megatron learns each bucket's parameters in the first): every bucket
    group's reduction starts exactly once, and the first one before the rank's last W pass ended (it fails if
    every reduction starts after the passes). Every stage is bucketed (patches/ddp_bucketing.py); with several
    W passes after a chunk's last B, the first reduction starts before the last W pass begins."""
    for report in reports[label]:
        events = report["events"]
        reductions = [e[1:] for e in events if e[0] == "reduce"]
        assert sorted(reductions) == [(k, i) for k, n in enumerate(report["bucket_groups"]) for i in range(n)]
        passes = [i for i, e in enumerate(events) if e[0] == "pass"]
        last_w = max(i for i in passes if events[i][1] == "W")
        first_reduction = min(i for i, e in enumerate(events) if e[0] == "reduce")
        assert first_reduction < last_w, (report["pp_rank"], events)
        w_after_last_b = [i for i in passes if i > max(j for j in passes if events[j][1] == "B") and events[i][1] == "W"]
        assert report["bucket_groups"][0] > 2  # the first chunk is bucketed on every stage
        if len(w_after_last_b) > 1:
            before_last_w = max(i for i in passes if i < last_w)
            assert first_reduction < before_last_w, (report["pp_rank"], events)


@pytest.mark.exactness
def test_the_overlap_test_sees_reductions_that_start_before_the_last_w_pass_begins(reports):
    """zb-auto runs two W passes after the last B on the first stage and four on the second (the layer-by-layer
    tail), so the stronger check of the test above runs on both."""
    for report in reports["pp2xdp2/zb-auto/overlap"]:
        kinds = [e[1] for e in report["events"] if e[0] == "pass"]
        assert kinds[-3:] == ["B", "W", "W"] if report["pp_rank"] == 0 else kinds[-5:] == ["B", "W", "W", "W", "W"]


@pytest.mark.exactness
def test_megatron_alone_buckets_only_the_first_stage(reports):
    """What patches/ddp_bucketing.py changes: without it (megatron's own schedule) the second stage reduces in
    one bucket."""
    buckets = {r["pp_rank"]: r["bucket_groups"][0] for r in reports["pp2xdp2/megatron/overlap"]}
    assert buckets[0] > 2 and buckets[1] == 1


@pytest.mark.exactness
def test_measured_pass_times_leave_out_the_wait_for_the_input(reports):
    """Rank 0's forwards take 0.2 s longer, so rank 1 waits about that long for each activation: the time the
    executor reports for rank 1's passes (what re-planning plans on) is its compute, not that wait. Medians of the
    four passes of each kind: a wait would lengthen them all, a loaded machine stalls one now and then."""
    for report in reports["pp2/zb-h1/timed"]:
        seconds = {op: statistics.median(e[4] for e in report["events"] if e[1] == op) for op in ("F", "B", "W")}
        if report["pp_rank"] == 0:
            assert seconds["F"] >= 0.2
        else:
            assert max(seconds.values()) < 0.1, seconds


@pytest.mark.exactness
def test_the_output_layers_w_kept_in_b_is_bit_identical_and_holds_less_for_w(reports):
    """A plan that keeps the output layer's W inside B (info["wgrad_in_b"]), and in the V the row-parallel layers'
    too: the layers' stores run it as B ends, in microbatch order, so losses, gradients and (with overlapped reduction
    and three Adam steps) parameters stay megatron's; the stage with the output layer holds less for its W passes
    than with the W deferred."""
    plan = training_case.planned("zb-h1", 2, 4, head_wgrad="in-b")
    assert plan.info["wgrad_in_b"] == ["output_layer"]
    harness.assert_identical(reports["pp2xdp2/zb-h1/overlap/head-in-b"], reports["pp2xdp2/megatron/overlap"])
    harness.assert_identical(reports["pp4/zb-v/head-in-b"], reports["pp1/megatron/8"], replicas=[0])
    for label, rank, chunk, rows in (("pp2xdp2/zb-h1/overlap/head-in-b", 1, 0, 0), ("pp4/zb-v/head-in-b", 0, 1, 2)):
        deferred = label.replace("/head-in-b", "")
        for report in reports[label]:
            kept = [rows] * len(report["kept_in_b"])  # the V's chunks hold one layer each: linear_proj, linear_fc2
            if report["pp_rank"] == rank:
                kept[chunk] += 1
            assert report["kept_in_b"] == kept, (label, report["pp_rank"])
        last = {r["dp_rank"]: r["stats"].peak_wgrad_bytes for r in reports[label] if r["pp_rank"] == rank}
        before = {r["dp_rank"]: r["stats"].peak_wgrad_bytes for r in reports[deferred] if r["pp_rank"] == rank}
        assert all(last[dp] < before[dp] for dp in last), (last, before)
