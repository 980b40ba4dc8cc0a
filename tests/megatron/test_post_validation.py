"""Optimizer post-validation on megatron-core (CPU, gloo): the same parameters as the synchronous step.

One spawned group of 4 ranks runs every scenario (PP=4; PP=2 x DP=2 with DDP; TP=2 x PP=2; MoE at PP=4 and
PP=2 x EP=2): several iterations of zb-h1 with V passes and the speculative step, against megatron's own 1F1B
schedule and synchronous optimizer step. The parent compares parameters with torch.equal (or reports ulps).
"""
import collections
import contextlib
import dataclasses
import sys
from pathlib import Path

import pytest
import torch

from megatron.zero_bubble.schedules.planners import layout_of
from tests.megatron import harness, training_case
from tests.megatron.harness import Layout, ModelSpec

# The tiny model's grad norm is 0.5-0.95 over the first iterations: 1000 never clips; 0.6 clips most
# steps, some after early stages stepped on partial sums below it (rollback), some before (deferred).
NO_CLIP, CLIP = 1000.0, 0.6
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast",
               "barrier", "reduce", "all_to_all_single", "all_gather_object")


@dataclasses.dataclass(frozen=True)
class Case(training_case.Case):
    """Several iterations of zb-h1 (or `schedule`) with post-validation, or of megatron's own schedule (None) with its
    synchronous step; Adam (or SGD) with weight decay over megatron DDP."""

    microbatches: int = 8
    steps: int = 6
    optimizer: str = "adam"
    weight_decay: float = 0.01
    clip_grad: float = NO_CLIP
    exact: bool = False
    inject: tuple[int, int] | None = None  # (iteration, pipeline stage) that gets an inf gradient


def _case(label: str, layout: Layout, post_validation: bool, schedule: str = "zb-h1", **settings) -> Case:
    """With post-validation our executor runs `schedule`; without it megatron's own schedule is the synchronous
    reference where megatron has one (V schedules: ours without the V and S passes). Overlapped reduction buckets
    every stage on both sides: the distributed optimizer's shards (and its norm's sum) follow the buckets."""
    if not post_validation and layout_of(schedule) != "v":
        schedule = None
    return Case(label, layout, schedule, post_validation=post_validation,
                every_stage_buckets=settings.get("overlap", False), **settings)


@contextlib.contextmanager
def _recorded_collectives(log: list):
    """Wrap torch.distributed's collectives so that each call logs the global ranks of its group."""
    import torch.distributed as dist

    originals = {name: getattr(dist, name) for name in COLLECTIVES}
    for name, original in originals.items():
        def recorded(*args, _original=original, _name=name, **kwargs):
            group = kwargs.get("group")
            log.append((_name, tuple(dist.get_process_group_ranks(group)) if group is not None else
                        tuple(range(dist.get_world_size()))))
            return _original(*args, **kwargs)

        setattr(dist, name, recorded)
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)


# What reads a tensor on the host, or waits for the device: the tensor's methods, and torch's functions.
SYNCING = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy")
SYNCING_FUNCTIONS = ((torch, "equal"), (torch.cuda, "synchronize"), (torch.cuda.Event, "synchronize"),
                     (torch.cuda.Stream, "synchronize"))
PACKAGE = str(Path(layout_of.__code__.co_filename).parent.parent)  # megatron/zero_bubble
TORCH = str(Path(torch.__file__).parent)
# The CPU backend's stand-ins for megatron's own calls (CPU only): torch's factories, and the MoE dispatcher's
# device-to-host copy of its split sizes (megatron's read, where it reads them)
PASSING_ON = {"patches/cpu_backend_torch.py:make", "patches/cpu_backend_moe.py:maybe_move_tensor_to_cpu"}
# S and V: the optimizer step's statistics and verdict, and its undo on a rollback: once per iteration, in those
# passes (or a rollback's replay after V), never in a compute pass or between passes
STEP_DECISIONS = ("runtime/post_validation.py:", "runtime/step_statistics.py:", "runtime/optimizer_rollback.py:",
                  "runtime/step_undo.py:")
STEP_PASSES = ("S", "V", "replay")


def _caller_site(depth: int) -> str | None:
    """Whose read it is: the innermost caller outside torch (torch's helpers read for whoever called them), as
    'file:function' when that is this package's code, else None (megatron's and the model's own reads); with the item
    of the program the iteration is at ('S', 'V', 'F', ..., 'batch', 'replay', or 'outside' an iteration's run)."""
    frame = sys._getframe(depth)
    while frame is not None and frame.f_code.co_filename.startswith(TORCH):
        frame = frame.f_back
    if frame is None or not frame.f_code.co_filename.startswith(PACKAGE):
        return None
    site = f"{Path(frame.f_code.co_filename).relative_to(PACKAGE)}:{frame.f_code.co_name}"
    return None if site in PASSING_ON else f"{site} in {_program_item(frame)}"


def _program_item(frame) -> str:
    """What the iteration's run loop (runtime/iteration.py Iteration.run) is at, from the stack."""
    from megatron.zero_bubble.runtime.iteration import Iteration

    while frame is not None:
        if frame.f_code is Iteration.replay.__code__:
            return "replay"
        if frame.f_code is Iteration.settle.__code__:
            return "V"  # V's verdict, settled once its sums went on (Iteration.validate_step)
        if frame.f_code is Iteration.run.__code__:
            item = frame.f_locals.get("item")
            return getattr(getattr(item, "op", None), "value", type(item).__name__.lower())
        frame = frame.f_back
    return "outside"


@contextlib.contextmanager
def _host_syncs(sites: collections.Counter):
    """Count the host's reads of tensors and waits for the device made by this package's own code (or by torch for
    it), by file and function: on a GPU each one stops the host until the GPU gets there."""
    replaced = [(torch.Tensor, name, getattr(torch.Tensor, name)) for name in SYNCING]
    replaced += [(owner, name, getattr(owner, name)) for owner, name in SYNCING_FUNCTIONS]

    def counting(original):
        def counted(*args, **kwargs):
            site = _caller_site(2)
            if site is not None:
                sites[site] += 1
            return original(*args, **kwargs)
        return counted

    for owner, name, original in replaced:
        setattr(owner, name, counting(original))
    try:
        yield
    finally:
        for owner, name, original in replaced:
            setattr(owner, name, original)


@contextlib.contextmanager
def _inf_injected(chunks, active: bool):
    """With `active`: an inf in the first gradient once the gradients are final, before the step sees them."""
    config = chunks[0].config
    finalize = config.finalize_model_grads_func

    def finalize_then_inject_inf(*args, **kwargs):
        finalize(*args, **kwargs)
        next(p for p in chunks[0].parameters()).main_grad.view(-1)[0] = float("inf")

    if active:
        config.finalize_model_grads_func = finalize_then_inject_inf
    try:
        yield
    finally:
        config.finalize_model_grads_func = finalize


def _run_case(case: Case) -> dict:
    import torch.distributed as dist
    from megatron.core import parallel_state

    with training_case.CaseRun(case) as run:
        chunks, optimizer = run.chunks, run.optimizer
        stage = parallel_state.get_pipeline_model_parallel_rank()
        stage_of_rank = [None] * dist.get_world_size()
        dist.all_gather_object(stage_of_rank, stage)
        controller = None
        if case.post_validation:
            controller = run.session.start_post_validation(optimizer, chunks, exact=case.exact,
                                                           layout=layout_of(case.schedule), chunks=len(chunks))
        step_collectives, outcomes, grad_norms, syncs = [], [], [], []
        for it in range(case.steps):
            injected = case.inject is not None and case.inject[0] == it
            syncs.append(collections.Counter())
            with _inf_injected(chunks, injected and case.inject[1] == stage), _recorded_collectives(step_collectives), \
                    _host_syncs(syncs[-1]):
                run.iteration(it, keep_grads=False)  # the S pass takes the statistics in there
            if controller is not None and controller.last_outcome is not None and it > 0:
                outcomes.append(dataclasses.asdict(controller.last_outcome))  # the verdict on step it-1
            if injected and not case.post_validation:
                continue  # the synchronous reference skips this step
            with _recorded_collectives(step_collectives):
                grad_norms.append(run.step()[1])
        if controller is not None:
            controller.flush()
            outcomes.append(dataclasses.asdict(controller.last_outcome))
        tied = None
        if case.spec.tie_embeddings and (parallel_state.is_pipeline_first_stage()
                                         or parallel_state.is_pipeline_last_stage()):
            tied = chunks[0].module.shared_embedding_or_output_weight().detach().clone()
        return run.report(
            grads={}, tied=tied, collectives=step_collectives, stage_of_rank=stage_of_rank, outcomes=outcomes,
            grad_norms=grad_norms, rollbacks=controller.rollbacks if controller is not None else 0, host_syncs=syncs,
            statistics_groups=[block.ranks for block in controller.blocks] if controller is not None else None,
            **_moe_state(case, chunks))


def _moe_state(case: Case, chunks) -> dict:
    """The routers' expert biases and megatron's MoE metrics (never reported here, so summed over every
    iteration): a replay that counted a router's tokens or losses twice would change them."""
    if case.spec.num_experts is None:
        return {}
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

    biases = {f"{k}.{name}": b.detach().clone() for k, chunk in enumerate(chunks)
              for name, b in chunk.named_buffers() if name.endswith("expert_bias")}
    metrics = {name: entry.values.clone() for name, entry in get_moe_metrics_tracker().metrics.items()}
    return {"expert_bias": biases, "moe_metrics": metrics}


PP4, PP2, TP2, PP4X2 = Layout(pp=4), Layout(pp=2), Layout(tp=2, pp=2), Layout(pp=4, vpp=2)
PP2XEP2 = Layout(pp=2, ep=2)
EIGHT_LAYERS = ModelSpec(num_layers=8)  # two per rank for two chunks per rank
# MoE with everything a router's forward accumulates: tokens per expert (expert bias, updated after each
# iteration's last backward), the global aux loss's running counts, and three metrics megatron tracks
MOE = ModelSpec(num_experts=4, moe_router_topk=2, add_bias_linear=False, moe_options=(
    ("moe_router_load_balancing_type", ("aux_loss", "global_aux_loss")), ("moe_aux_loss_coeff", (0.01, 0.01)),
    ("moe_z_loss_coeff", 1e-3), ("moe_router_score_function", "sigmoid"), ("moe_router_enable_expert_bias", True)))
MOE_CASES = {"moe/pp4": (PP4, False), "moe/pp2xep2": (PP2XEP2, False), "moe/pp2xep2/distributed": (PP2XEP2, True)}
CASES = [
    _case("pp4/sync", PP4, False),
    _case("pp4/pv", PP4, True),
    _case("pp4/sync/inf", PP4, False, inject=(2, 1)),
    _case("pp4/sync/inf/3", PP4, False, inject=(2, 1), steps=3),
    _case("pp4/pv/inf/3", PP4, True, inject=(2, 1), steps=3),
    _case("pp4/pv/inf/exact", PP4, True, exact=True, inject=(2, 1)),
    _case("pp4/sync/clip", PP4, False, clip_grad=CLIP, steps=10, dropout=0.1),
    _case("pp4/pv/clip", PP4, True, clip_grad=CLIP, steps=10, dropout=0.1),
    _case("pp4/pv/clip/exact", PP4, True, clip_grad=CLIP, exact=True, steps=10, dropout=0.1),
    _case("pp4/sync/clip/sgd", PP4, False, clip_grad=CLIP, steps=10, optimizer="sgd"),
    _case("pp4/pv/clip/sgd", PP4, True, clip_grad=CLIP, steps=10, optimizer="sgd"),
    _case("pp2/sync/clip", PP2, False, clip_grad=CLIP),
    _case("pp2/pv/clip/exact", PP2, True, clip_grad=CLIP, exact=True),
    _case("pp2/pv", PP2, True),
    _case("pp2/sync", PP2, False),
    _case("tp2xpp2/sync", TP2, False),
    _case("tp2xpp2/pv", TP2, True),
    _case("tp2xpp2/sync/clip", TP2, False, clip_grad=CLIP),
    _case("tp2xpp2/pv/clip/exact", TP2, True, clip_grad=CLIP, exact=True),
    _case("pp2/distributed/sync/clip", PP2, False, clip_grad=CLIP, distributed=True),
    _case("pp2/distributed/pv/clip/exact", PP2, True, clip_grad=CLIP, exact=True, distributed=True),
    _case("pp4/pv/clip/tied", PP4, True, clip_grad=CLIP, spec=ModelSpec(tie_embeddings=True)),
    _case("pp2/distributed/sync/inf", PP2, False, inject=(2, 1), distributed=True),
    _case("pp2/distributed/pv/inf", PP2, True, inject=(2, 1), exact=True, distributed=True),
    # megatron DDP's overlapped reduction and parameter gathers: a rollback must wait for the gathers a forward
    # started (they carry the speculative values) and gather the validated parameters itself
    _case("pp2/distributed/overlap/sync/clip", PP2, False, clip_grad=CLIP, distributed=True, overlap=True),
    _case("pp2/distributed/overlap/pv/clip/exact", PP2, True, clip_grad=CLIP, exact=True, distributed=True,
          overlap=True),
    _case("pp4/overlap/sync/clip", PP4, False, clip_grad=CLIP, overlap=True),
    _case("pp4/overlap/pv/clip/exact", PP4, True, clip_grad=CLIP, exact=True, overlap=True, schedule="zb-auto"),
    # Two chunks per rank: the result walks from rank 0 in a V (its last virtual stage), from rank p-1 interleaved.
    _case("pp4/zb-v/sync/clip", PP4X2, False, clip_grad=CLIP, spec=EIGHT_LAYERS, schedule="zb-v"),
    _case("pp4/zb-v/pv/clip/exact", PP4X2, True, clip_grad=CLIP, exact=True, spec=EIGHT_LAYERS, schedule="zb-v"),
    _case("pp4/v-half/sync/clip", PP4X2, False, clip_grad=CLIP, spec=EIGHT_LAYERS, schedule="v-half"),
    _case("pp4/v-half/pv/clip/exact", PP4X2, True, clip_grad=CLIP, exact=True, spec=EIGHT_LAYERS, schedule="v-half"),
    _case("pp4/interleaved/sync/clip", PP4X2, False, clip_grad=CLIP, spec=EIGHT_LAYERS, schedule="interleaved-1f1b"),
    _case("pp4/interleaved/pv/clip/exact", PP4X2, True, clip_grad=CLIP, exact=True, spec=EIGHT_LAYERS,
          schedule="interleaved-1f1b"),
    # --calculate-per-token-loss: the token count of the loss stage comes with the gradients instead of megatron's
    # broadcast from the last stage; replicas count different tokens (shard_data), summed within each stage
    *(_case(f"{label}/{kind}/per-token", layout, kind == "pv/clip/exact", clip_grad=CLIP, exact=True, per_token=True,
            shard_data=True, steps=4, spec=spec, schedule=schedule)
      for label, layout, spec, schedule in (("pp4", PP4, ModelSpec(), "zb-h1"), ("pp2", PP2, ModelSpec(), "zb-h1"),
                                            ("pp4/zb-v", PP4X2, EIGHT_LAYERS, "zb-v"))
      for kind in ("sync/clip", "pv/clip/exact")),
    # MoE with clipping: at EP=2 two statistics groups (dense: tensor x pipeline; experts: expert tensor x expert
    # x pipeline), one with the distributed optimizer; at EP=1 the experts are in the dense optimizer
    *(_case(f"{label}/{kind}", layout, kind == "pv/clip/exact", clip_grad=CLIP, exact=True, spec=MOE, steps=3,
            shard_data=True, distributed=distributed, microbatches=4)
      for label, (layout, distributed) in MOE_CASES.items() for kind in ("sync/clip", "pv/clip/exact")),
]


@pytest.fixture(scope="module")
def reports():
    return harness.run_cases(_run_case, CASES, 4, timeout=900)


_merged = harness.merge_by_dp_rank  # per data-parallel replica: losses and full parameters


def _ulps_at_scale(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest difference in ulps of the tensor's largest magnitude (raw ulps explode where values pass 0)."""
    spacing = torch.nextafter(b.abs().max(), torch.tensor(float("inf"))) - b.abs().max()
    return float((a - b).abs().max() / spacing)


def _max_ulps(ours, reference) -> float:
    ours, reference = _merged(ours), _merged(reference)
    return max(_ulps_at_scale(ours[dp]["params"][n], p) for dp in reference for n, p in reference[dp]["params"].items())


@pytest.mark.exactness
@pytest.mark.parametrize("layout", ["pp4", "pp2", "tp2xpp2"])
def test_without_inf_or_clipping_parameters_are_bit_identical_to_the_synchronous_step(reports, layout):
    harness.assert_identical(reports[f"{layout}/pv"], reports[f"{layout}/sync"])
    assert all(r["rollbacks"] == 0 for r in reports[f"{layout}/pv"])


@pytest.mark.exactness
def test_with_the_distributed_optimizer_an_injected_inf_skips_the_step_everywhere(reports):
    """The inf is on stage 1 of PP=2 x DP=2: stage 0 had stepped its shards and gathered them, undoes that
    (restore, gather again), and the parameters equal the synchronous run that skipped the step."""
    harness.assert_identical(reports["pp2/distributed/pv/inf"], reports["pp2/distributed/sync/inf"])
    assert sorted(r["rollbacks"] for r in reports["pp2/distributed/pv/inf"]) == [0, 0, 1, 1]


@pytest.mark.exactness
def test_an_injected_inf_skips_the_step_on_every_stage_with_exact_rollback(reports):
    harness.assert_identical(reports["pp4/pv/inf/exact"], reports["pp4/sync/inf"])
    by_stage = {r["pp_rank"]: r for r in reports["pp4/pv/inf/exact"]}
    assert by_stage[0]["rollbacks"] == 1  # stage 0 had stepped before the inf on stage 1 was known
    assert all(by_stage[s]["rollbacks"] == 0 for s in (1, 2, 3))
    verdicts = [o["nonfinite"] for o in by_stage[3]["outcomes"]]
    assert verdicts == [False, False, True, False, False, False]


@pytest.mark.exactness
def test_an_adam_step_undone_by_the_in_place_inverse_is_within_an_ulp(reports):
    ulps = _max_ulps(reports["pp4/pv/inf/3"], reports["pp4/sync/inf/3"])
    print(f"\npp4 inf at iteration 3 of 3, Adam step undone in place: max {ulps:.2f} ulps (at each tensor's scale)")
    assert 0 < ulps <= 2


@pytest.mark.parametrize("label, reference", [
    ("pp4/pv/clip/exact", "pp4/sync/clip"), ("pp2/pv/clip/exact", "pp2/sync/clip"),
    ("tp2xpp2/pv/clip/exact", "tp2xpp2/sync/clip"),
    ("pp2/distributed/pv/clip/exact", "pp2/distributed/sync/clip"),
    ("pp4/zb-v/pv/clip/exact", "pp4/zb-v/sync/clip"), ("pp4/v-half/pv/clip/exact", "pp4/v-half/sync/clip"),
    ("pp4/interleaved/pv/clip/exact", "pp4/interleaved/sync/clip"),
    ("pp2/distributed/overlap/pv/clip/exact", "pp2/distributed/overlap/sync/clip"),
    ("pp4/pv/clip/exact/per-token", "pp4/sync/clip/per-token"), ("pp2/pv/clip/exact/per-token", "pp2/sync/clip/per-token"),
    ("pp4/zb-v/pv/clip/exact/per-token", "pp4/zb-v/sync/clip/per-token"),
    ("pp4/overlap/pv/clip/exact", "pp4/overlap/sync/clip"),
])
@pytest.mark.exactness
def test_clipping_with_exact_rollback_is_bit_identical_including_replayed_losses(reports, label, reference):
    harness.assert_identical(reports[label], reports[reference])
    for r in reports[label]:
        outcomes = r["outcomes"]
        assert any(o["clipped"] for o in outcomes) and all(o["replay"] == o["clipped"] for o in outcomes)
        expected = [o["clipped"] and o["state"] == "stepped" for o in outcomes]
        assert [o["rolled_back"] for o in outcomes] == expected and r["rollbacks"] == sum(expected)
    assert sum(r["rollbacks"] for r in reports[label]) > 0  # on ranks that stepped on partial sums


@pytest.mark.exactness
def test_clipping_with_the_in_place_inverse_stays_within_a_few_ulps_after_ten_sgd_iterations(reports):
    ulps = _max_ulps(reports["pp4/pv/clip/sgd"], reports["pp4/sync/clip/sgd"])
    print(f"\npp4 clipped SGD steps, in-place inverse: max {ulps:.2f} ulps (at each tensor's scale) after 10 iterations")
    assert 0 < ulps <= 8  # about an ulp per undone step, see test_optimizer_rollback
    assert sum(r["rollbacks"] for r in reports["pp4/pv/clip/sgd"]) > 0


@pytest.mark.exactness
def test_clipping_with_the_in_place_inverse_under_adam_is_reported_after_ten_iterations(reports):
    """Adam amplifies last-bit differences (elements whose m crosses 0 change their update sign): the inverse's
    ulp grows in later steps as any perturbation would. Reported; the losses stay equal to 6 digits."""
    ulps = _max_ulps(reports["pp4/pv/clip"], reports["pp4/sync/clip"])
    ours, reference = _merged(reports["pp4/pv/clip"])[0]["losses"], _merged(reports["pp4/sync/clip"])[0]["losses"]
    worst = max(abs(ours[k] - v) / abs(v) for k, v in reference.items())
    print(f"\npp4 clipped Adam steps, in-place inverse: max {ulps:.1f} ulps (at each tensor's scale) after 10 "
          f"iterations; largest relative loss difference {worst:.1e}")
    assert ours.keys() == reference.keys() and worst < 1e-6


@pytest.mark.exactness
def test_no_collective_spans_more_than_one_pipeline_stage_during_the_iteration_and_the_step(reports):
    for label in ("pp4/pv", "pp4/pv/clip", "tp2xpp2/pv", "pp2/pv", "pp2/distributed/pv/clip/exact",
                  "pp4/pv/clip/exact/per-token", "pp2/pv/clip/exact/per-token", "pp4/zb-v/pv/clip/exact/per-token"):
        for r in reports[label]:
            stage_of = r["stage_of_rank"]
            spans = {(name, ranks) for name, ranks in r["collectives"] if len({stage_of[x] for x in ranks}) > 1}
            assert not spans, f"{label}: cross-stage collectives during the step: {spans}"
    assert any(name == "all_gather" for name, _ in reports["tp2xpp2/pv"][0]["collectives"])  # within the stage
    # and the check can fail: megatron's synchronous step reduces across stages, and so does its per-token loss
    # (a broadcast of the token count from the last stage) even where the reduction would not
    for sync in (reports["tp2xpp2/sync"][0], reports["pp4/sync/clip/per-token"][0]):
        assert any(len({sync["stage_of_rank"][x] for x in ranks}) > 1 for _, ranks in sync["collectives"])
    assert any(name == "broadcast" for name, _ in reports["pp4/sync/clip/per-token"][0]["collectives"])


@pytest.mark.exactness
def test_per_token_loss_under_data_parallelism_sums_replicas_that_count_different_tokens(reports):
    """The replicas see different microbatches with different token counts (the mask drops labels divisible by 5),
    so each stage's division needs the sum over the replicas; each replica's losses equal megatron's."""
    reference, ours = _merged(reports["pp2/sync/clip/per-token"]), _merged(reports["pp2/pv/clip/exact/per-token"])
    assert reference[0]["losses"] != reference[1]["losses"]  # the replicas trained on different data
    assert all(ours[dp]["losses"] == reference[dp]["losses"] for dp in (0, 1))


@pytest.mark.exactness
def test_tied_embedding_copies_stay_identical_through_in_place_rollbacks(reports):
    """Stage 0's word embedding is undone (exactly) and re-stepped; the last stage's tied copy steps once."""
    by_stage = {r["pp_rank"]: r for r in reports["pp4/pv/clip/tied"]}
    assert by_stage[0]["rollbacks"] > 0
    assert torch.equal(by_stage[0]["tied"], by_stage[3]["tied"])


@pytest.mark.exactness
@pytest.mark.parametrize("label", list(MOE_CASES))
def test_moe_with_clipping_and_exact_rollback_is_bit_identical_including_router_state(reports, label):
    """With expert parallelism megatron norms the dense and the expert gradients over different groups (dense:
    tensor x pipeline; experts: expert tensor x expert x pipeline) and combines the two norms; with the
    distributed optimizer both share one group, and at EP=1 the experts are dense parameters (one optimizer).
    The replayed passes find the routers' token counts and the MoE metrics as they were."""
    ours, reference = reports[f"{label}/pv/clip/exact"], reports[f"{label}/sync/clip"]
    harness.assert_identical(ours, reference)
    for mine, theirs in zip(ours, reference):
        groups = mine["statistics_groups"]
        assert len(groups) == (2 if label == "moe/pp2xep2" else 1) and groups[-1] == (0, 1, 2, 3)
        assert [o["grad_norm"] for o in mine["outcomes"]] == theirs["grad_norms"]  # megatron's, to the last bit
        assert mine["expert_bias"].keys() == theirs["expert_bias"].keys() and theirs["expert_bias"]
        assert all(torch.equal(mine["expert_bias"][n], b) for n, b in theirs["expert_bias"].items())
        assert sorted(theirs["moe_metrics"]) == ["global_load_balancing_loss", "load_balancing_loss", "z_loss"]
        assert all(torch.equal(mine["moe_metrics"][n], v) for n, v in theirs["moe_metrics"].items())
        assert any(o["replay"] for o in mine["outcomes"])
        stage_of = mine["stage_of_rank"]
        assert not [c for c in mine["collectives"] if len({stage_of[x] for x in c[1]}) > 1]  # none spans stages
    assert sum(r["rollbacks"] for r in ours) > 0


def test_moe_metrics_wait_for_the_printed_iterations_and_are_reported_with_each_iterations_values():
    """Under post-validation, megatron's training_log reports the MoE metrics (an all-reduce over the pipeline
    ranks) only at the iterations it prints and at the end of training: the iterations in between wait, then
    are reported in turn with their own values and arguments, as megatron would have reported them."""
    from types import SimpleNamespace

    from megatron.zero_bubble.patches.post_validation_training import IntervalMoEReports

    class Tracker:  # megatron's MoEMetricsTracker as training_log uses it
        def __init__(self):
            self.metrics, self.reported = {"loss": SimpleNamespace(values=torch.zeros(2))}, []

        def report(self, iteration):  # megatron's: all-reduce, accumulate, clear
            self.reported.append((iteration, {name: e.values.tolist() for name, e in self.metrics.items()}))
            self.clear()
            return f"line {iteration}"

        def clear(self):
            for entry in self.metrics.values():
                entry.values.zero_()

    tracker = Tracker()
    reports = IntervalMoEReports(lambda: tracker)
    for iteration, printing, reported in ((1, True, [1]), (2, False, [1]), (3, False, [1]), (4, True, [1, 2, 3, 4]),
                                          (5, False, [1, 2, 3, 4])):
        tracker.metrics["loss"].values += iteration
        if iteration == 3:  # a metric first recorded now held zeros at iteration 2
            tracker.metrics["z_loss"] = SimpleNamespace(values=torch.full((2,), 0.5))
        reports.printing = printing
        assert reports.report(iteration=iteration) == (f"line {iteration}" if printing else "")
        assert [i for i, _ in tracker.reported] == reported  # no reduction at the iterations that do not print
    reports.clear()  # what training_log does not wrap goes to megatron's tracker
    reports.catch_up()  # the end of training
    assert tracker.reported == [(1, {"loss": [1, 1]}), (2, {"loss": [2, 2], "z_loss": [0, 0]}),
                                (3, {"loss": [3, 3], "z_loss": [0.5, 0.5]}), (4, {"loss": [4, 4], "z_loss": [0, 0]}),
                                (5, {"loss": [5, 5], "z_loss": [0, 0]})]


def test_the_runtime_reads_no_tensor_on_the_host_in_its_passes_and_messages(reports):
    """On a GPU every read of a tensor on the host (.item(), bool(), ...) stops the host until the GPU gets there, and
    the Python between passes then shows as idle GPU time. Counted around every iteration of every case by wrappers of
    the tensor's reading methods (.item(), bool(), .cpu(), .numpy(), ...) and of torch.equal and the CUDA
    synchronizes, for the runtime's own calls (torch's helpers reading for it included), with the program item the
    iteration was at: the only ones are the optimizer step's decisions (post-validation: the statistics, the verdict,
    a rollback's undo) inside the S and V passes or a rollback's replay; none in a compute pass, between passes or in
    the messages, per-token loss included (its counts stay on the device). Megatron's own reads inside its
    forward_step count as megatron's."""
    for label, runs in reports.items():
        for run in runs:
            for step, sites in enumerate(run["host_syncs"]):
                elsewhere = {site: n for site, n in sites.items()
                             if not site.startswith(STEP_DECISIONS) or site.rsplit(" in ", 1)[1] not in STEP_PASSES}
                assert not elsewhere, (label, run["pp_rank"], step, sites)
