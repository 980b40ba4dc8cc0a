"""Mixture of experts and sequence parallelism under the zero-bubble runtime (CPU, gloo): bit-identical to
megatron's own 1F1B.

One spawned group of 4 ranks runs every scenario in turn; the parent compares the reports with torch.equal.
- MoE (megatron-core's MoELayer: top-2 router with the auxiliary load-balancing loss, alltoall dispatcher,
  local experts in a SequentialMLP) at PP=4 (also 1F1B through the runtime) and at PP=2 x EP=2 (also with the allgather dispatcher), megatron
  DDP and three Adam steps: losses, gradients, parameters after the steps and the per-layer MoE metrics
  megatron's tracker collects.
- ZB-V with MoE against a single-stage run of the same model (each replica a torch Adam of its own: no
  reduction whose order depends on the layout).
- Sequence parallelism at TP=2 x PP=2 (the CPU backend's norm): zb-h1 / zb-auto against megatron's 1F1B with
  the same flags, and the same function as without sequence parallelism (within rounding).
"""
import dataclasses

import pytest
import torch

from tests.megatron import harness, rank_model, training_case
from tests.megatron.harness import Layout, ModelSpec

ZB_SCHEDULES = ("zb-h1", "zb-h2", "zb-auto")
MOE = ModelSpec(num_experts=4, moe_router_topk=2, moe_aux_loss_coeff=0.01, add_bias_linear=False)
SP = ModelSpec(sequence_parallel=True)
MOE_SP = dataclasses.replace(MOE, sequence_parallel=True)
MOE_ALLGATHER = dataclasses.replace(MOE, moe_token_dispatcher_type="allgather")
MOE_METRIC = "load_balancing_loss"


def _case(label: str, layout: Layout, schedule: str | None, spec: ModelSpec,
          optimizer: str = "adam") -> training_case.Case:
    """Three steps of 4 microbatches with megatron's Adam (DDP, clipping), each data-parallel replica on data of its
    own, or with a "local" torch Adam per rank (no DDP), every replica on the same data."""
    return training_case.Case(label, layout, schedule, spec, microbatches=4, steps=3, optimizer=optimizer,
                              shard_data=optimizer != "local")


def _run_case(case: training_case.Case) -> dict:
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

    with training_case.CaseRun(case) as run:
        tracker = get_moe_metrics_tracker()
        with rank_model.deferred_weights(run.chunks) as deferred:
            for step in range(case.steps):
                run.iteration(step)
                if step == 0:
                    first_grads = run.grads
                assert run.step()[0]
        metric = tracker.metrics.get(MOE_METRIC)
        return run.report(first_grads=first_grads, moe_metric=None if metric is None else metric.values.clone(),
                          deferred=deferred, norms=_norm_weights(run.chunks))


def _norm_weights(chunks) -> dict:
    """{global name: value} of the norm parameters this rank holds (not TP-sharded: each TP rank has a copy)."""
    return {name: p.detach().clone() for chunk in chunks for name, p in rank_model.global_param_names(chunk).items()
            if "norm" in name}


def _cases(prefix: str, layout: Layout, spec: ModelSpec, schedules=ZB_SCHEDULES, **kwargs) -> list[training_case.Case]:
    return [_case(f"{prefix}/megatron", layout, None, spec, **kwargs),
            *(_case(f"{prefix}/{s}", layout, s, spec, **kwargs) for s in schedules)]


CASES = [
    *_cases("moe/pp4", Layout(pp=4), MOE, schedules=("1f1b",) + ZB_SCHEDULES),  # 1f1b: megatron's, through the runtime
    *_cases("moe/pp2xep2", Layout(pp=2, ep=2), MOE),
    *_cases("moe-allgather/pp2xep2", Layout(pp=2, ep=2), MOE_ALLGATHER, schedules=("zb-h1",)),
    _case("moe/pp1", Layout(), None, MOE, optimizer="local"),
    _case("moe/pp2xdp2/zb-v", Layout(pp=2, vpp=2), "zb-v", MOE, optimizer="local"),
    *_cases("sp/tp2xpp2", Layout(tp=2, pp=2), SP, schedules=("zb-h1", "zb-auto")),
    _case("tp2xpp2/megatron", Layout(tp=2, pp=2), None, ModelSpec()),
    *_cases("moe-sp/tp2xpp2", Layout(tp=2, pp=2), MOE_SP, schedules=("zb-h1",)),
]


@pytest.fixture(scope="module")
def reports():
    return harness.run_cases(_run_case, CASES, 4, timeout=600)


def _expert_weights(report) -> set:
    return {name for name in report["grads"] if ".mlp.experts." in name and name.endswith("weight")}


@pytest.mark.exactness
@pytest.mark.parametrize("layout", ["pp4", "pp2xep2"])
@pytest.mark.parametrize("schedule", ZB_SCHEDULES)
def test_moe_losses_gradients_and_adam_steps_are_bit_identical_to_megatron_1f1b(reports, layout, schedule):
    harness.assert_identical(reports[f"moe/{layout}/{schedule}"], reports[f"moe/{layout}/megatron"])


@pytest.mark.exactness
def test_moe_under_1f1b_through_the_runtime_is_bit_identical_to_megatrons_own(reports):
    harness.assert_identical(reports["moe/pp4/1f1b"], reports["moe/pp4/megatron"])
    assert not any(report["deferred"] for report in reports["moe/pp4/1f1b"])  # 1F1B runs BW: nothing deferred


@pytest.mark.exactness
def test_moe_with_the_allgather_dispatcher_is_bit_identical_to_megatron_1f1b(reports):
    harness.assert_identical(reports["moe-allgather/pp2xep2/zb-h1"], reports["moe-allgather/pp2xep2/megatron"])


@pytest.mark.exactness
def test_expert_parallel_ranks_hold_different_experts_under_global_names(reports):
    merged = harness.merge_by_dp_rank(reports["moe/pp2xep2/megatron"])
    experts = [_expert_weights(merged[dp]) for dp in (0, 1)]
    assert experts[0] and experts[1] and not experts[0] & experts[1]  # experts 0-1 on one, 2-3 on the other
    assert len(experts[0] | experts[1]) == 4 * 4 * 2  # 4 layers x 4 experts x (fc1, fc2)


@pytest.mark.exactness
@pytest.mark.parametrize("label", ["moe/pp4/zb-h1", "moe/pp2xep2/zb-auto", "moe/pp2xdp2/zb-v"])
def test_the_expert_linears_weight_gradients_are_deferred_to_w_and_the_router_stays_in_b(reports, label):
    for report in reports[label]:
        experts = _expert_weights(report)
        assert experts and experts <= report["deferred"]
        assert not any(".router." in name for name in report["deferred"])


@pytest.mark.exactness
@pytest.mark.parametrize("label", [f"moe/{layout}/{s}" for layout in ("pp4", "pp2xep2") for s in ZB_SCHEDULES])
def test_per_layer_moe_metrics_equal_those_under_megatron_1f1b(reports, label):
    reference = {(r["dp_rank"], r["pp_rank"]): r["moe_metric"] for r in reports[label.rsplit("/", 1)[0] + "/megatron"]}
    for report in reports[label]:
        expected = reference[(report["dp_rank"], report["pp_rank"])]
        assert expected is not None and expected.count_nonzero() > 0  # this rank's MoE layers recorded their loss
        assert torch.equal(report["moe_metric"], expected)


@pytest.mark.exactness
def test_moe_zb_v_is_bit_identical_to_a_single_stage_run(reports):
    harness.assert_identical(reports["moe/pp2xdp2/zb-v"], reports["moe/pp1"], replicas=[0, 1])
    metrics = {r["pp_rank"]: r["moe_metric"] for r in reports["moe/pp2xdp2/zb-v"] if r["dp_rank"] == 0}
    reference = next(r["moe_metric"] for r in reports["moe/pp1"] if r["dp_rank"] == 0)
    assert torch.equal(metrics[0] + metrics[1], reference)  # each layer's loss recorded once, on its rank


@pytest.mark.exactness
@pytest.mark.parametrize("schedule", ["zb-h1", "zb-auto"])
def test_sequence_parallel_tp2_pp2_is_bit_identical_to_megatron_1f1b(reports, schedule):
    harness.assert_identical(reports[f"sp/tp2xpp2/{schedule}"], reports["sp/tp2xpp2/megatron"])


@pytest.mark.exactness
def test_moe_with_sequence_parallel_tp2_pp2_is_bit_identical_to_megatron_1f1b(reports):
    harness.assert_identical(reports["moe-sp/tp2xpp2/zb-h1"], reports["moe-sp/tp2xpp2/megatron"])


@pytest.mark.exactness
def test_sequence_parallel_trains_the_same_model_as_without_it(reports):
    """The CPU norm under sequence parallelism: its weight and bias gradients are summed over the TP ranks
    (marked as megatron's fused norms mark them), so SP computes what TP alone computes, up to rounding (the
    norm gradients are summed in two halves), and the two TP ranks' copies of every norm stay equal. (After
    an Adam step the rounding is amplified: a gradient near zero moves its weight by +-lr either way.)"""
    labels = ("sp/tp2xpp2/megatron", "tp2xpp2/megatron")
    first = [r for r in reports[labels[0]] if r["dp_rank"] == 0], [r for r in reports[labels[1]] if r["dp_rank"] == 0]
    with_sp, without = (harness.merge_by_dp_rank([dict(r, grads=r["first_grads"]) for r in rs])[0] for rs in first)
    step0 = {key: loss for key, loss in without["losses"].items() if key[0] == 0}
    assert step0 and all(with_sp["losses"][key] == pytest.approx(loss, rel=1e-6) for key, loss in step0.items())
    assert any("norm" in name for name in without["grads"]) and with_sp["grads"].keys() == without["grads"].keys()
    for name, grad in without["grads"].items():
        torch.testing.assert_close(with_sp["grads"][name], grad, rtol=1e-5, atol=1e-7, msg=f"gradient of {name}")
    for label in ("sp/tp2xpp2/megatron", "sp/tp2xpp2/zb-auto", "moe-sp/tp2xpp2/zb-h1"):
        by_stage = {}
        for report in reports[label]:
            by_stage.setdefault(report["pp_rank"], []).append(report["norms"])
        for copies in by_stage.values():
            assert copies[0].keys() == copies[1].keys() and copies[0]
            for name in copies[0]:
                assert torch.equal(copies[0][name], copies[1][name]), f"{label}: TP copies of {name} differ"
