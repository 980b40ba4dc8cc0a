"""A GPT on megatron's default layers, Transformer Engine's (TE's own Python over the labelled CPU kernel layer),
trained through the runtime on CPU, tensor for tensor against megatron's own schedules. Run by test_te_gpt.py in a
pytest process of its own: TE's import hook must be in place before megatron is imported (and the forked ranks
inherit it), which no other pytest worker does.

The session splits TE's modules through their own deferral (patches/te_wgrad.py) while the embedding and the output
layer stay megatron's local layers. Reference: megatron's own 1F1B on the same model (TE's fused backward). Compared
with torch.equal: losses, gradients and parameters after Adam steps, with megatron DDP's overlapped reduction
(readiness through the store), the distributed optimizer, MoE experts (TE's linear layers in megatron's
SequentialMLP), ZB-V, and optimizer post-validation with rollbacks and replays. TE's gradient-accumulation fusion
(main_grad) is te_split_cases.py's, per module: on the CPU megatron's own output layer has no fused kernel for it.
"""
import dataclasses
import functools
import os
import statistics

import pytest
import torch

from megatron.zero_bubble.patches import imports

imports.install(transformer_engine=True)  # TE's Python over the CPU kernel layer, before megatron is imported
te = pytest.importorskip("transformer_engine.pytorch", reason="transformer_engine does not import here")
os.environ.setdefault("NVTE_FLASH_ATTN", "0")  # as --zero-bubble-cpu sets them: TE's unfused attention
os.environ.setdefault("NVTE_FUSED_ATTN", "0")

from tests.megatron import harness, process_groups, rank_model  # noqa: E402
from tests.megatron.harness import Layout, ModelSpec  # noqa: E402

SPEC = ModelSpec(transformer_impl="transformer_engine")
MOE = ModelSpec(num_experts=4, add_bias_linear=False, transformer_impl="transformer_engine")


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
    steps: int = 3
    post_validation: bool = False  # with clipping that rolls steps back (exact rollback)
    clip: float = 0.0
    slow_wgrad_s: float = 0.0  # > 0: every weight-gradient GEMM of TE takes this much longer; passes are timed
    fp8: str | None = None  # megatron's --fp8-recipe (with --fp8-format hybrid); None: no FP8
    check: bool = False  # the split check before the first iteration (split_check.py)
    keep_in_b: bool = False  # the plan keeps the output layer's and the row-parallel layers' W inside B


@functools.lru_cache(maxsize=None)
def _plan(name, stages, microbatches, post_validation, keep_in_b=False):
    from megatron.zero_bubble.schedules.planners import PlanRequest, plan

    where = "in-b" if keep_in_b else "auto"
    return plan(name, PlanRequest(stages=stages, microbatches=microbatches, ilp_time_limit=0,
                                  head_wgrad=where, rows_wgrad=where, post_validation=post_validation))


def _run_case(case: Case) -> dict:
    from megatron.zero_bubble.training.session import ZeroBubbleSession

    plans = None
    if case.schedule is not None:
        plans = lambda m: _plan(case.schedule, case.layout.pp, m, case.post_validation, case.keep_in_b)  # noqa: E731
    v_stages = case.layout.pp if case.schedule == "zb-v" else None
    if v_stages is not None:
        process_groups.destroy_parallel_state()
    lines = []
    with ZeroBubbleSession(schedule_for=plans, v_stages=v_stages, bucket_every_stage=case.overlap,
                           split_check=case.check, log=lines.append) as session:
        report = _train(case, session)
        check = session.executor.split_check if session.executor is not None else None
        from megatron.core import parallel_state

        kept = [store.kept_in_b for store in session.executor.stores] if session.executor is not None else []
        return {**report, "lines": lines, "checked": check.results if check is not None else None, "kept_in_b": kept,
                "pp_rank": parallel_state.get_pipeline_model_parallel_rank()}


def _train(case: Case, session) -> dict:
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig
    from megatron.zero_bubble.schedules.planners import layout_of

    process_groups.init_parallel_state(case.layout.tp, case.layout.pp, case.layout.vpp)
    if case.slow_wgrad_s:
        _slow_down_wgrad(case.slow_wgrad_s)
    fp8 = {} if case.fp8 is None else {"fp8": "hybrid", "fp8_recipe": case.fp8}
    chunks = rank_model.build_gpt_chunks(case.spec, init_seed=0, **fp8)
    te_modules = sum(isinstance(m, te.Linear | te.LayerNormLinear) for chunk in chunks for m in chunk.modules())
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
            "params": rank_model.full_params(chunks), "te_modules": te_modules, "events": list(reductions),
            "split_weights": sum(len(store.weights) for store in stores),
            "rollbacks": controller.rollbacks if controller is not None else 0}


def _slow_down_wgrad(seconds: float) -> None:
    """Every weight-gradient GEMM (layout "NT") of the CPU kernel layer sleeps `seconds` first (in this forked rank
    only; TE's Python looks the kernel up on the module at each call)."""
    import sys
    import time

    tex = sys.modules["transformer_engine_torch"]
    gemm = tex.generic_gemm

    def slow(A, transa, B, transb, *args, **kwargs):
        if not transa and transb:
            time.sleep(seconds)
        return gemm(A, transa, B, transb, *args, **kwargs)

    tex.generic_gemm = slow


def _logged(function, events: list, event: tuple):
    def call(*args, **kwargs):
        events.append(event)
        return function(*args, **kwargs)

    return call


CASES = [
    Case("pp2xdp2/megatron", Layout(pp=2), None),
    *[Case(f"pp2xdp2/{s}", Layout(pp=2), s) for s in ("zb-h1", "zb-h2", "zb-auto")],
    Case("pp2xdp2/megatron/overlap", Layout(pp=2), None, overlap=True),
    # with the output layer's and the row-parallel layers' W kept inside B
    Case("pp2xdp2/zb-auto/overlap", Layout(pp=2), "zb-auto", overlap=True, keep_in_b=True),
    Case("pp2xdp2/megatron/overlap/distributed", Layout(pp=2), None, overlap=True, distributed=True),
    Case("pp2xdp2/zb-h1/overlap/distributed", Layout(pp=2), "zb-h1", overlap=True, distributed=True),
    Case("pp2xdp2/megatron/moe", Layout(pp=2), None, spec=MOE),
    Case("pp2xdp2/zb-h1/moe", Layout(pp=2), "zb-h1", spec=MOE),
    Case("pp1/megatron", Layout(), None, ddp=False, steps=1),
    Case("pp2xdp2/zb-v", Layout(pp=2, vpp=2), "zb-v", ddp=False, steps=1),
    Case("pp2xdp2/megatron/clip", Layout(pp=2), None, clip=0.6, steps=4),
    Case("pp2xdp2/zb-h1/post-validation", Layout(pp=2), "zb-h1", clip=0.6, steps=4, post_validation=True),
    Case("pp2xdp2/zb-h1/slow-wgrad", Layout(pp=2), "zb-h1", ddp=False, steps=1, slow_wgrad_s=0.02),
    # FP8 (emulated per-tensor kernels): the split, and the split check, which must leave delayed scaling's amax
    # histories and scales as 1F1B has them (every later cast depends on them)
    Case("pp2xdp2/megatron/fp8-delayed", Layout(pp=2), None, fp8="delayed"),
    Case("pp2xdp2/zb-h1/fp8-delayed", Layout(pp=2), "zb-h1", fp8="delayed"),
    Case("pp2xdp2/zb-h1/fp8-delayed/check", Layout(pp=2), "zb-h1", fp8="delayed", check=True),
    Case("pp2xdp2/megatron/fp8-tensorwise", Layout(pp=2), None, fp8="tensorwise"),
    Case("pp2xdp2/zb-auto/fp8-tensorwise/check", Layout(pp=2), "zb-auto", fp8="tensorwise", check=True),
    Case("pp2xdp2/zb-h1/check", Layout(pp=2), "zb-h1", check=True),
]


@pytest.fixture(scope="module")
def reports():
    return harness.run_cases(_run_case, CASES, world_size=4, timeout=600, transformer_engine=True)


@pytest.mark.parametrize("label, reference", [
    *[(f"pp2xdp2/{s}", "pp2xdp2/megatron") for s in ("zb-h1", "zb-h2", "zb-auto")],
    ("pp2xdp2/zb-auto/overlap", "pp2xdp2/megatron/overlap"),
    ("pp2xdp2/zb-h1/overlap/distributed", "pp2xdp2/megatron/overlap/distributed"),
    ("pp2xdp2/zb-h1/moe", "pp2xdp2/megatron/moe"),
    ("pp2xdp2/zb-h1/post-validation", "pp2xdp2/megatron/clip"),
    ("pp2xdp2/zb-h1/fp8-delayed", "pp2xdp2/megatron/fp8-delayed"),
    ("pp2xdp2/zb-h1/fp8-delayed/check", "pp2xdp2/megatron/fp8-delayed"),
    ("pp2xdp2/zb-auto/fp8-tensorwise/check", "pp2xdp2/megatron/fp8-tensorwise"),
    ("pp2xdp2/zb-h1/check", "pp2xdp2/megatron"),
])
def test_te_layers_split_by_the_runtime_match_megatrons_1f1b_bit_for_bit(reports, label, reference):
    harness.assert_identical(reports[label], reports[reference])
    assert all(r["split_weights"] > 0 for r in reports[label])  # TE's weights went through W


def test_w_kept_inside_b_runs_in_b_on_te_layers_and_megatrons_output_layer(reports):
    """The case above that keeps the output layer's and the row-parallel layers' W in B (its numbers are megatron's):
    each rank's store holds its 2 layers' linear_proj and linear_fc2 (TE's queues run as each B ends), and the last
    rank's the output layer too."""
    for report in reports["pp2xdp2/zb-auto/overlap"]:
        assert report["kept_in_b"] == [4 + (report["pp_rank"] == 1)], report["kept_in_b"]


def test_zb_v_on_te_layers_matches_a_single_stage_run(reports):
    harness.assert_identical(reports["pp2xdp2/zb-v"], reports["pp1/megatron"], replicas=[0])


def test_every_te_linear_layer_was_split(reports):
    # 4 layers x (qkv, proj, fc1, fc2) over the ranks of one replica; each a weight and a bias
    assert sum(r["te_modules"] for r in reports["pp2xdp2/zb-h1"] if r["dp_rank"] == 0) == 16
    assert sum(r["split_weights"] for r in reports["pp2xdp2/zb-h1"] if r["dp_rank"] == 0) == 32 + 1  # + output layer (no bias)


@pytest.mark.parametrize("label", ["pp2xdp2/zb-auto/overlap", "pp2xdp2/zb-h1/overlap/distributed"])
def test_overlapped_reduction_starts_each_bucket_once_the_first_while_w_passes_remain(reports, label):
    for report in reports[label]:
        events = report["events"]
        starts = [i for i, e in enumerate(events) if e[0] == "reduce"]
        last_w = max(i for i, e in enumerate(events) if e == ("pass", "W"))
        assert starts and starts[0] < last_w, events


def test_post_validation_rolled_back_and_replayed_with_te_layers(reports):
    assert any(r["rollbacks"] for r in reports["pp2xdp2/zb-h1/post-validation"])


def test_the_measured_w_passes_hold_the_te_layers_weight_gradients(reports):
    """What re-planning measures as T_W (the executor's observed W passes) is where TE's deferred GEMMs run: with each
    weight-gradient GEMM 20 ms slower, every W pass takes at least its 8 GEMMs (2 layers x 4 linear layers per rank),
    and B passes, which only queue them, take less."""
    for report in reports["pp2xdp2/zb-h1/slow-wgrad"]:
        timed = [(op, seconds) for kind, op, seconds in (e for e in report["events"] if e[0] == "timed")]
        w = [seconds for op, seconds in timed if op == "W"]
        b = [seconds for op, seconds in timed if op == "B"]
        assert len(w) == 4 and min(w) >= 8 * 0.02
        assert b and statistics.median(b) < min(w)


@pytest.mark.parametrize("label", ["pp2xdp2/zb-h1/check", "pp2xdp2/zb-h1/fp8-delayed/check",
                                   "pp2xdp2/zb-auto/fp8-tensorwise/check"])
def test_the_split_check_on_te_layers_finds_them_bit_identical_in_one_line(reports, label):
    """Fused and split bit for bit on TE's layers (under FP8 too: the recipe's state is put back before each of the
    check's runs); the training after it is megatron's, tensor for tensor (the test above)."""
    report = reports[label]
    results = report[0]["checked"]
    assert len(results) == 4 and all(r.mismatch is None and r.noise is None for r in results)
    assert all(r.kinds.get("TELayerNormColumnParallelLinear") for r in results)
    lines = [line for line in report[0]["lines"] if line.startswith("zero-bubble: split check:")]
    assert len(lines) == 1 and "bit-identical" in lines[0] and "TERowParallelLinear" in lines[0]
