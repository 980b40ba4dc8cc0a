"""A GPT whose transformer layers use the TE stand-in (tests/te_standin.py), trained through the runtime on CPU.

The stand-in replaces megatron's linear layers inside the transformer layers (megatron's TE wrappers' contract:
(output, bias), backward_dw gated by megatron's own config), so the session splits them through the TE path
(patches/te_wgrad.py) while embeddings and the output layer stay megatron's local layers. Reference: megatron's own
1F1B on the same model (the stand-in's undeferred backward). Compared with torch.equal: losses, gradients and
parameters after Adam steps, with megatron DDP's overlapped reduction (readiness through the store), the distributed
optimizer, main_grad fusion, MoE experts, ZB-V, and optimizer post-validation with rollbacks and replays.
"""
import dataclasses
import functools
import statistics

import pytest
import torch

from tests.megatron import harness, process_groups, rank_model
from tests.megatron.harness import Layout, ModelSpec

SPEC = ModelSpec()
MOE = ModelSpec(num_experts=4, add_bias_linear=False)
SPEC8 = ModelSpec(num_layers=8)


@dataclasses.dataclass(frozen=True)
class Case:
    label: str
    layout: Layout
    schedule: str | None  # None: megatron's own schedule
    microbatches: int = 4
    spec: ModelSpec = SPEC
    ddp: bool = True
    overlap: bool = False
    distributed: bool = False
    fuse: bool = False  # the stand-in accumulates its weight gradients into main_grad itself
    steps: int = 3
    post_validation: bool = False  # with clipping that rolls steps back (exact rollback)
    clip: float = 0.0
    slow_wgrad_s: float = 0.0  # > 0: every stand-in weight-gradient GEMM takes this much longer; passes are timed


@functools.lru_cache(maxsize=None)
def _plan(name, stages, microbatches, post_validation):
    from megatron.zero_bubble.schedules.planners import PlanRequest, plan

    return plan(name, PlanRequest(stages=stages, microbatches=microbatches, ilp_time_limit=0,
                                  post_validation=post_validation))


def _run_case(case: Case) -> dict:
    from megatron.zero_bubble.training.session import ZeroBubbleSession
    from tests import te_standin

    plans = None
    if case.schedule is not None:
        plans = lambda m: _plan(case.schedule, case.layout.pp, m, case.post_validation)  # noqa: E731
    v_stages = case.layout.pp if case.schedule == "zb-v" else None
    if v_stages is not None:
        process_groups.destroy_parallel_state()
    with ZeroBubbleSession(schedule_for=plans, v_stages=v_stages, bucket_every_stage=case.overlap,
                           te_layer_types=te_standin.KINDS) as session:
        return _train(case, session, te_standin)


def _train(case: Case, session, te_standin) -> dict:
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig
    from megatron.zero_bubble.schedules.planners import layout_of

    process_groups.init_parallel_state(case.layout.tp, case.layout.pp, case.layout.vpp)
    if case.slow_wgrad_s:
        _slow_down_wgrad(te_standin, case.slow_wgrad_s)
    chunks = rank_model.build_gpt_chunks(case.spec, init_seed=0)
    swapped = sum(te_standin.swap_in_standins(chunk, case.fuse) for chunk in chunks)
    if case.ddp:
        chunks = rank_model.wrap_in_ddp(chunks, DistributedDataParallelConfig(
            overlap_grad_reduce=case.overlap, use_distributed_optimizer=case.distributed,
            overlap_param_gather=case.distributed, bucket_size=12_000 if case.overlap else None))
    optimizer = None
    if case.ddp:  # megatron's optimizer needs DDP's buffers; the runs without DDP compare one step's gradients
        optimizer = rank_model.make_optimizer(chunks, OptimizerConfig(
            optimizer="adam", lr=1e-3, weight_decay=0.0, clip_grad=case.clip, use_distributed_optimizer=case.distributed))
    controller = None
    if case.post_validation:
        controller = session.start_post_validation(optimizer, chunks, exact=True, layout=layout_of(case.schedule),
                                                   chunks=len(chunks))
    reductions = []
    if case.overlap:
        for k, chunk in enumerate(chunks):
            for group in chunk.bucket_groups + chunk.expert_parallel_bucket_groups:
                group.start_grad_sync = _logged(group.start_grad_sync, reductions, ("reduce", k))
    losses, m = {}, case.microbatches
    for step in range(case.steps):
        reductions.clear()
        for chunk in chunks:
            chunk.zero_grad_buffer() if case.ddp else chunk.zero_grad()
        if optimizer is not None:
            optimizer.zero_grad()
        observer = (lambda p, start, end: reductions.append(("pass", p.op.value))) if case.overlap else None
        if case.slow_wgrad_s:
            observer = lambda p, start, end: reductions.append(("timed", p.op.value, end - start))  # noqa: E731
        if session.executor is not None:
            session.executor.observer = observer
        step_losses = rank_model.run_forward_backward(chunks, case.spec, m, step * m)
        losses.update({(step, k): v for k, v in step_losses.items()})
        grads = rank_model.full_grads(chunks)
        if optimizer is not None:
            optimizer.step()
    if controller is not None:
        controller.flush()
    for chunk in chunks if case.distributed else ():
        chunk.start_param_sync(force_sync=True)
    stores = session.executor.stores if session.executor is not None else []
    return {"dp_rank": parallel_state.get_data_parallel_rank(), "losses": losses, "grads": grads,
            "params": rank_model.full_params(chunks), "swapped": swapped, "events": list(reductions),
            "split_weights": sum(len(store.weights) for store in stores),
            "rollbacks": controller.rollbacks if controller is not None else 0}


def _slow_down_wgrad(te_standin, seconds: float) -> None:
    """Every weight-gradient GEMM of the stand-in sleeps `seconds` first (in this forked rank only)."""
    import time

    make = te_standin._wgrad_gemm

    def slow_make(*args):
        gemm = make(*args)

        def slow(x, dy):
            time.sleep(seconds)
            return gemm(x, dy)

        return slow

    te_standin._wgrad_gemm = slow_make


def _logged(function, events: list, event: tuple):
    def call(*args, **kwargs):
        events.append(event)
        return function(*args, **kwargs)

    return call


CASES = [
    Case("pp2xdp2/megatron", Layout(pp=2), None),
    *[Case(f"pp2xdp2/{s}", Layout(pp=2), s) for s in ("zb-h1", "zb-h2", "zb-auto")],
    Case("pp2xdp2/megatron/overlap", Layout(pp=2), None, overlap=True),
    Case("pp2xdp2/zb-auto/overlap", Layout(pp=2), "zb-auto", overlap=True),
    Case("pp2xdp2/megatron/overlap/distributed", Layout(pp=2), None, overlap=True, distributed=True),
    Case("pp2xdp2/zb-h1/overlap/distributed", Layout(pp=2), "zb-h1", overlap=True, distributed=True),
    Case("pp2xdp2/megatron/fused", Layout(pp=2), None, fuse=True),
    Case("pp2xdp2/zb-h1/fused/overlap", Layout(pp=2), "zb-h1", fuse=True, overlap=True),
    Case("pp2xdp2/megatron/fused/overlap", Layout(pp=2), None, fuse=True, overlap=True),
    Case("pp2xdp2/megatron/moe", Layout(pp=2), None, spec=MOE),
    Case("pp2xdp2/zb-h1/moe", Layout(pp=2), "zb-h1", spec=MOE),
    Case("pp1/megatron", Layout(), None, ddp=False, steps=1),
    Case("pp2xdp2/zb-v", Layout(pp=2, vpp=2), "zb-v", ddp=False, steps=1),
    Case("pp2xdp2/megatron/clip", Layout(pp=2), None, clip=0.6, steps=4),
    Case("pp2xdp2/zb-h1/post-validation", Layout(pp=2), "zb-h1", clip=0.6, steps=4, post_validation=True),
    Case("pp2xdp2/zb-h1/slow-wgrad", Layout(pp=2), "zb-h1", ddp=False, steps=1, slow_wgrad_s=0.02),
]


@pytest.fixture(scope="module")
def reports():
    return harness.run_cases(_run_case, CASES, world_size=4, timeout=600)


@pytest.mark.slow
@pytest.mark.parametrize("label, reference", [
    *[(f"pp2xdp2/{s}", "pp2xdp2/megatron") for s in ("zb-h1", "zb-h2", "zb-auto")],
    ("pp2xdp2/zb-auto/overlap", "pp2xdp2/megatron/overlap"),
    ("pp2xdp2/zb-h1/overlap/distributed", "pp2xdp2/megatron/overlap/distributed"),
    ("pp2xdp2/zb-h1/fused/overlap", "pp2xdp2/megatron/fused"),
    ("pp2xdp2/zb-h1/moe", "pp2xdp2/megatron/moe"),
    ("pp2xdp2/zb-h1/post-validation", "pp2xdp2/megatron/clip"),
])
def test_standin_te_layers_split_by_the_runtime_match_megatrons_1f1b_bit_for_bit(reports, label, reference):
    harness.assert_identical(reports[label], reports[reference])
    assert all(r["split_weights"] > 0 for r in reports[label])  # the stand-in's weights went through W


@pytest.mark.slow
def test_zb_v_on_standin_te_layers_matches_a_single_stage_run(reports):
    harness.assert_identical(reports["pp2xdp2/zb-v"], reports["pp1/megatron"], replicas=[0])


@pytest.mark.slow
def test_every_standin_layer_was_swapped_and_split(reports):
    # 4 layers x (qkv, proj, fc1, fc2) over the ranks of one replica; each a weight and a bias
    assert sum(r["swapped"] for r in reports["pp2xdp2/zb-h1"] if r["dp_rank"] == 0) == 16
    assert sum(r["split_weights"] for r in reports["pp2xdp2/zb-h1"] if r["dp_rank"] == 0) == 32 + 1  # + output layer (no bias)


@pytest.mark.slow
@pytest.mark.parametrize("label", ["pp2xdp2/zb-auto/overlap", "pp2xdp2/zb-h1/fused/overlap"])
def test_overlapped_reduction_starts_each_bucket_once_the_first_while_w_passes_remain(reports, label):
    for report in reports[label]:
        events = report["events"]
        starts = [i for i, e in enumerate(events) if e[0] == "reduce"]
        last_w = max(i for i, e in enumerate(events) if e == ("pass", "W"))
        assert starts and starts[0] < last_w, events


@pytest.mark.slow
def test_post_validation_rolled_back_and_replayed_with_standin_te_layers(reports):
    assert any(r["rollbacks"] for r in reports["pp2xdp2/zb-h1/post-validation"])


def test_the_measured_w_passes_hold_the_standin_te_layers_weight_gradients(reports):
    """What re-planning measures as T_W (the executor's observed W passes) is where TE's deferred GEMMs run: with each
    stand-in GEMM 20 ms slower, every W pass takes at least its 8 GEMMs (2 layers x 4 linear layers per rank), and B
    passes, which only queue them, take less."""
    for report in reports["pp2xdp2/zb-h1/slow-wgrad"]:
        timed = [(op, seconds) for kind, op, seconds in (e for e in report["events"] if e[0] == "timed")]
        w = [seconds for op, seconds in timed if op == "W"]
        b = [seconds for op, seconds in timed if op == "B"]
        assert len(w) == 4 and min(w) >= 8 * 0.02
        assert b and statistics.median(b) < min(w)
