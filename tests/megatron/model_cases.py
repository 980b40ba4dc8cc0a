"""The training case that test_llama_models.py and test_hybrid_models.py both run on each rank (in harness.run_cases):
`case.steps` iterations and optimizer steps, with post-validation where the case asks for it, and the weights whose
gradients went to a W pass recorded.

    run_training_case(case, extras) -> the rank's report
    linear_weight_names(chunks, named) -> the weights of megatron's linear layers on this rank
"""
from __future__ import annotations

from typing import Callable

from tests.megatron import rank_model, training_case


def run_training_case(case: training_case.Case, extras: Callable[[training_case.CaseRun, dict], dict]) -> dict:
    """The rank's report: CaseRun's, plus the rollbacks, the grad norms, the deferred and the linear weights' global
    names, and what `extras(run, {global name: parameter})` adds."""
    with training_case.CaseRun(case) as run:
        controller = None
        if case.post_validation:
            from megatron.zero_bubble.schedules.planners import layout_of

            controller = run.session.start_post_validation(run.optimizer, run.chunks, exact=case.exact,
                                                           layout=layout_of(case.schedule), chunks=len(run.chunks))
        grad_norms = []
        with rank_model.deferred_weights(run.chunks) as deferred:
            for step in range(case.steps):
                run.iteration(step)
                success, grad_norm, _ = run.step()
                assert success
                grad_norms.append(grad_norm)
        if controller is not None:
            controller.flush()
        named = {name: p for chunk in run.chunks for name, p in rank_model.global_param_names(chunk).items()}
        return run.report(rollbacks=controller.rollbacks if controller is not None else 0, grad_norms=grad_norms,
                          deferred=deferred, linear=linear_weight_names(run.chunks, named), **extras(run, named))


def linear_weight_names(chunks, named: dict) -> set[str]:
    """Global names of the weights of megatron's linear layers on this rank (attention, MLPs, experts, the output
    layer, MTP's projection): what a split schedule defers; not the embeddings, norms and routers."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    weights = {id(module.weight) for chunk in chunks for module in chunk.modules()
               if isinstance(module, (ColumnParallelLinear, RowParallelLinear)) and module.weight is not None}
    return {name for name, p in named.items() if id(p) in weights}
