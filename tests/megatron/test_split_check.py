"""The split check at start-up (runtime/split_check.py) on megatron-core, CPU and gloo.

One group of 4 forked ranks runs every case. A case trains a few iterations through the executor with the check
on and the same run with it off: the check must pass, log one line on rank 0, and leave the training bit for bit
as it was (gradients, parameters, losses, MoE expert biases; dropout draws the same masks). A deliberately wrong
W (one layer's deferred gradient perturbed on one rank) must stop every rank with one line naming that layer, also
where megatron's own backward is not bit-reproducible (then split is compared within its run-to-run noise).
"""
import dataclasses
import functools
import itertools

import pytest
import torch

from tests.megatron import harness, process_groups, rank_model
from tests.megatron.harness import Layout, ModelSpec

SPEC = ModelSpec()
MOE = ModelSpec(num_experts=4, moe_router_topk=2, add_bias_linear=False, moe_options=(
    ("moe_router_load_balancing_type", ("aux_loss", "global_aux_loss")), ("moe_aux_loss_coeff", (0.01, 0.01)),
    ("moe_z_loss_coeff", 1e-3), ("moe_router_score_function", "sigmoid"), ("moe_router_enable_expert_bias", True)))
WRONG_LAYER = "decoder.layers.1.mlp.linear_fc1.weight"  # on pipeline rank 1: the model's layer 3


@dataclasses.dataclass(frozen=True)
class Case:
    label: str
    layout: Layout
    schedule: str
    check: bool
    spec: ModelSpec = SPEC
    dropout: float = 0.0
    wrong_w: bool = False  # WRONG_LAYER's deferred gradient is off by 1e-3 on pipeline rank 1
    noisy: bool = False  # the loss carries a factor 1 + 1e-6 k, k counting the loss functions called (never rewound)
    steps: int = 3


@functools.lru_cache(maxsize=None)
def _plan(name, stages, microbatches):
    from megatron.zero_bubble.schedules.planners import PlanRequest, plan

    return plan(name, PlanRequest(stages=stages, microbatches=microbatches, ilp_time_limit=0))


class _PerturbOneLayer:
    """The adapter, except that the work deferred for one weight adds 1e-3 to its gradient after running."""

    def __init__(self, adapter, weight):
        self._adapter, self._weight = adapter, weight

    def __getattr__(self, name):
        return getattr(self._adapter, name)

    def split_linear_layers(self, module, store):
        weights, undo = self._adapter.split_linear_layers(module, store)
        defer, target = store.defer, self._weight

        def wrong(work):
            if work.weight is target:
                original = work

                class Wrong:
                    nbytes, weight = original.nbytes, original.weight

                    def __call__(self):
                        original()
                        (target.main_grad if getattr(target, "main_grad", None) is not None else target.grad).add_(1e-3)

                work = Wrong()
            defer(work)

        store.defer = wrong
        return weights, undo


_CALLS = itertools.count()


def _noisy_forward_step(data_iterator, model):
    """A backward that is not bit-reproducible: each call's loss is scaled a little differently."""
    output, loss_func = rank_model.gpt_forward_step(data_iterator, model)

    def noisy(output_tensor):
        loss, report = loss_func(output_tensor)
        return loss * (1.0 + 1e-6 * (next(_CALLS) % 4)), report

    return output, noisy


def _run_case(case: Case) -> dict:
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig
    from megatron.zero_bubble.runtime.split_check import SplitCheckFailed
    from megatron.zero_bubble.training.session import ZeroBubbleSession
    lines = []
    v_stages = case.layout.pp if case.schedule == "zb-v" else None
    if v_stages is not None:
        process_groups.destroy_parallel_state()
    with ZeroBubbleSession(schedule_for=lambda m: _plan(case.schedule, case.layout.pp, m), v_stages=v_stages,
                           bucket_every_stage=True, split_check=case.check, log=lines.append) as session:
        process_groups.init_parallel_state(case.layout.tp, case.layout.pp, case.layout.vpp)
        chunks = rank_model.build_gpt_chunks(case.spec, init_seed=0, hidden_dropout=case.dropout)
        chunks = rank_model.wrap_in_ddp(chunks, DistributedDataParallelConfig(overlap_grad_reduce=True,
                                                                              bucket_size=12_000))
        if case.wrong_w and parallel_state.get_pipeline_model_parallel_rank() == 1:
            target = dict(chunks[0].module.named_parameters())[WRONG_LAYER]
            session.executor.megatron = _PerturbOneLayer(session.megatron, target)
        optimizer = rank_model.make_optimizer(chunks, OptimizerConfig(optimizer="adam", lr=1e-3, weight_decay=0.0,
                                                                      clip_grad=0.0))
        forward_step = _noisy_forward_step if case.noisy else rank_model.gpt_forward_step
        losses, m = {}, 4
        try:
            for step in range(case.steps):
                for chunk in chunks:
                    chunk.zero_grad_buffer()
                optimizer.zero_grad()
                step_losses = rank_model.run_forward_backward(chunks, case.spec, m, step * m,
                                                              forward_step_func=forward_step)
                losses.update({(step, k): v for k, v in step_losses.items()})
                grads = rank_model.full_grads(chunks)
                optimizer.step()
        except SplitCheckFailed as failed:
            return {"failed": str(failed), "lines": lines}
        check = session.executor.split_check
        return {"dp_rank": parallel_state.get_data_parallel_rank(), "losses": losses, "grads": grads,
                "params": {**rank_model.full_params(chunks), **_expert_biases(chunks)}, "lines": lines,
                "results": check.results if check is not None else None,
                "pending": sum(store.pending_count for store in session.executor.stores)}


def _expert_biases(chunks) -> dict:
    """The routers' expert biases and megatron's MoE metrics (never reported here, so summed over every iteration):
    a check that left what its forward passes counted would change them."""
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

    metrics = {f"moe metric {name}": entry.values.clone() for name, entry in get_moe_metrics_tracker().metrics.items()}
    return {**metrics, **{f"{k}.{name}": b.detach().clone() for k, chunk in enumerate(chunks)
                          for name, b in chunk.named_buffers() if name.endswith("expert_bias")}}


PP2 = Layout(pp=2)
CASES = [
    *[Case(f"{label}/{check}", layout, schedule, check == "check", **extra)
      for label, layout, schedule, extra in [
          ("dense", PP2, "zb-h1", {}),
          ("dropout", PP2, "zb-auto", {"dropout": 0.1}),
          ("moe", PP2, "zb-h1", {"spec": MOE}),
          ("zb-v", Layout(pp=2, vpp=2), "zb-v", {}),
      ] for check in ("check", "off")],
    Case("wrong-w", PP2, "zb-h1", True, wrong_w=True, steps=1),
    Case("noisy", PP2, "zb-h1", True, noisy=True, steps=1),
    Case("noisy/wrong-w", PP2, "zb-h1", True, noisy=True, wrong_w=True, steps=1),
]


@pytest.fixture(scope="module")
def reports():
    return harness.run_cases(_run_case, CASES, world_size=4, timeout=600)


@pytest.mark.parametrize("label", ["dense", "dropout", "moe", "zb-v"])
def test_the_split_check_passes_and_leaves_training_bit_for_bit_as_without_it(reports, label):
    checked, unchecked = reports[f"{label}/check"], reports[f"{label}/off"]
    harness.assert_identical(checked, unchecked)
    results = checked[0]["results"]
    assert len(results) == 4 and all(r.mismatch is None and r.noise is None for r in results)
    assert sum(r.deferred_layers for r in results) > 0 and all(r.compared > 0 for r in results)
    assert all(r["pending"] == 0 for r in checked)


@pytest.mark.parametrize("label", ["dense", "moe"])
def test_rank_0_logs_one_line_with_layers_ranks_and_seconds(reports, label):
    lines = reports[f"{label}/check"][0]["lines"]
    checks = [line for line in lines if line.startswith("zero-bubble: split check:")]
    assert len(checks) == 1 and "passed" in checks[0] and "bit-identical" in checks[0] and " s" in checks[0]
    layers = sum(r.deferred_layers for r in reports[f"{label}/check"][0]["results"])
    assert f"{layers} layers split into B and W on 4 ranks" in checks[0]
    assert not any(line.startswith("zero-bubble: split check") for line in reports[f"{label}/off"][0]["lines"])


def test_every_deferred_layer_of_the_model_is_checked(reports):
    # 4 transformer layers x (qkv, proj, fc1, fc2) + the output layer, twice (two data-parallel replicas)
    assert sum(r.deferred_layers for r in reports["dense/check"][0]["results"]) == 2 * (16 + 1)


@pytest.mark.parametrize("label", ["wrong-w", "noisy/wrong-w"])
def test_a_wrong_w_stops_every_rank_with_one_line_naming_the_layer(reports, label):
    messages = {r["failed"] for r in reports[label]}
    assert len(messages) == 1
    message = messages.pop()
    assert "\n" not in message and message.startswith("zero-bubble: split check failed on rank ")
    assert f"the gradient of {WRONG_LAYER} differs" in message and "by up to 0.001" in message


def test_a_backward_that_is_not_bit_reproducible_is_compared_within_its_noise(reports):
    results = reports["noisy"][0]["results"]
    assert all(r.mismatch is None for r in results) and any(r.noise for r in results)
    line = next(line for line in reports["noisy"][0]["lines"] if line.startswith("zero-bubble: split check:"))
    assert "not bit-reproducible here" in line
