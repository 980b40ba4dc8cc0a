"""Hybrid models (megatron-core's HybridModel, pretrain_hybrid.py's local layers) under the zero-bubble runtime (CPU,
gloo): losses, gradients and parameters after Adam steps compared with torch.equal.

Each case runs in 2 ranks of its own, forked afresh (PP=2, 8 microbatches, two Adam steps):
- attention and MLP layers cut evenly (`*-*-|*-*-`: megatron's 1F1B against 1F1B through the runtime and zb-h2) and
  unevenly (`*-*|-*-*-`: zb-h1, zb-auto), clipped steps;
- two chunks per rank (`*|-*-|*-*|-`): zb-auto against megatron's interleaved 1F1B;
- ZB-V on the pattern's 2p segments (`*-*|-*-|*|-`, uneven) against a single-stage run of the same layers (no
  clipping: megatron's grad norm adds one partial norm per pipeline rank);
- MoE layers (`*E*-|*E*-`, top-2 of 4 experts, aux loss);
- optimizer post-validation (steps rolled back, exact rollback) against megatron's synchronous step.
Every zero-bubble case defers the weight gradient of every linear layer to W passes (checked).
"""
import dataclasses

import pytest

from tests.megatron import harness, model_cases, training_case
from tests.megatron.harness import Layout, ModelSpec

EVEN = ModelSpec(hybrid_pattern="*-*-|*-*-")
UNEVEN = ModelSpec(hybrid_pattern="*-*|-*-*-")
TWO_CHUNKS = ModelSpec(hybrid_pattern="*|-*-|*-*|-")
V_UNEVEN = ModelSpec(hybrid_pattern="*-*|-*-|*|-")
WHOLE = ModelSpec(hybrid_pattern="*-*-*-*-")
MOE = ModelSpec(hybrid_pattern="*E*-|*E*-", num_experts=4, add_bias_linear=False, moe_aux_loss_coeff=0.01)
PP2, PP2X2 = Layout(pp=2), Layout(pp=2, vpp=2)
CLIP = 0.8  # below the first step's grad norm (0.95), above each stage's partial norm: post-validation steps on the
# partial norms, unclipped, and rolls that step back once the full norm arrives


@dataclasses.dataclass(frozen=True)
class Case(training_case.Case):
    optimizer: str | None = "adam"
    steps: int = 2
    exact: bool = False


def _cases(prefix: str, layout: Layout, schedules, **settings) -> list[Case]:
    return [Case(f"{prefix}/{s or 'megatron'}", layout, s, **settings) for s in (None, *schedules)]


CASES = [
    *_cases("even", PP2, ("1f1b", "zb-h2"), spec=EVEN),
    *_cases("uneven", PP2, ("zb-h1", "zb-auto"), spec=UNEVEN),
    *_cases("two-chunks", PP2X2, ("zb-auto",), spec=TWO_CHUNKS),
    Case("pp1/megatron", Layout(), None, spec=WHOLE, clip_grad=0.0),  # DP=2 there, both replicas on the same data
    Case("v/zb-v", PP2X2, "zb-v", spec=V_UNEVEN, clip_grad=0.0),
    *_cases("moe", PP2, ("zb-h1", "zb-auto"), spec=MOE),
    Case("pv/megatron", PP2, None, spec=UNEVEN, clip_grad=CLIP, steps=3),
    Case("pv/zb-auto", PP2, "zb-auto", spec=UNEVEN, clip_grad=CLIP, steps=3, post_validation=True, exact=True),
]


def _run_case(case: Case) -> dict:
    return model_cases.run_training_case(case, lambda run, named: {"layers": _layers(run.chunks)})


def _layers(chunks) -> list[tuple[int, str]]:
    """(global layer number, layer class) of every decoder layer this rank holds, chunk by chunk."""
    from megatron.zero_bubble.training.init_weights import unwrap

    return [(layer.layer_number, type(layer).__name__) for chunk in chunks for layer in unwrap(chunk).decoder.layers]


@pytest.fixture(scope="module")
def reports():
    return harness.run_cases(_run_case, CASES, 2, timeout=900)


@pytest.mark.exactness
@pytest.mark.parametrize("label, reference", [
    *((f"even/{s}", "even/megatron") for s in ("1f1b", "zb-h2")),
    *((f"uneven/{s}", "uneven/megatron") for s in ("zb-h1", "zb-auto")),
    ("two-chunks/zb-auto", "two-chunks/megatron"),
    *((f"moe/{s}", "moe/megatron") for s in ("zb-h1", "zb-auto")),
])
def test_hybrid_losses_gradients_and_adam_steps_are_bit_identical_to_megatron(reports, label, reference):
    harness.assert_identical(reports[label], reports[reference])


@pytest.mark.exactness
def test_zb_v_on_the_patterns_segments_is_bit_identical_to_a_single_stage_run(reports):
    harness.assert_identical(reports["v/zb-v"], reports["pp1/megatron"], replicas=[0])


@pytest.mark.exactness
@pytest.mark.parametrize("label", ["pv/zb-auto"])
def test_hybrid_with_optimizer_post_validation_is_bit_identical_to_the_synchronous_step(reports, label):
    harness.assert_identical(reports[label], reports["pv/megatron"])
    assert sum(r["rollbacks"] for r in reports[label]) > 0


@pytest.mark.parametrize("label", [c.label for c in CASES if c.schedule not in (None, "1f1b")])
def test_every_linear_weight_has_its_gradient_deferred_to_a_w_pass(reports, label):
    for report in reports[label]:
        assert report["deferred"] == report["linear"] != set()


@pytest.mark.parametrize("label, held", [
    ("uneven/megatron", {0: [(1, "TransformerLayer"), (2, "MLPLayer"), (3, "TransformerLayer")],
                         1: [(4, "MLPLayer"), (5, "TransformerLayer"), (6, "MLPLayer"), (7, "TransformerLayer"),
                             (8, "MLPLayer")]}),
    ("two-chunks/zb-auto", {0: [(1, "TransformerLayer"), (5, "TransformerLayer"), (6, "MLPLayer"),
                                (7, "TransformerLayer")],
                            1: [(2, "MLPLayer"), (3, "TransformerLayer"), (4, "MLPLayer"), (8, "MLPLayer")]}),
    ("v/zb-v", {0: [(1, "TransformerLayer"), (2, "MLPLayer"), (3, "TransformerLayer"), (8, "MLPLayer")],
                1: [(4, "MLPLayer"), (5, "TransformerLayer"), (6, "MLPLayer"), (7, "TransformerLayer")]}),
    ("moe/megatron", {0: [(1, "TransformerLayer"), (2, "MoETransformerLayer"), (3, "TransformerLayer"),
                          (4, "MLPLayer")],
                      1: [(5, "TransformerLayer"), (6, "MoETransformerLayer"), (7, "TransformerLayer"),
                          (8, "MLPLayer")]}),
])
def test_each_rank_holds_the_layers_the_pattern_places_there_numbered_by_their_depth(reports, label, held):
    assert {r["pp_rank"]: r["layers"] for r in reports[label]} == held


def test_megatrons_mamba_and_gdn_layers_project_through_the_te_modules_the_split_defers():
    """What the GPU-only test_hybrid_gpu_layers.py relies on, read from megatron's hybrid spec here: Mamba's and GDN's
    input and output projections are megatron's TE wrappers TELayerNormColumnParallelLinear (TE's LayerNormLinear) and
    TERowParallelLinear (TE's Linear), kinds patches/te_wgrad.py splits, and neither is one it keeps in B."""
    from megatron.zero_bubble.patches import imports, te_wgrad

    imports.install()
    from megatron.core.extensions import transformer_engine as megatron_te
    from megatron.core.models.hybrid.hybrid_layer_specs import hybrid_stack_spec

    mixer = hybrid_stack_spec.submodules.mamba_layer.submodules.mixer.submodules
    gdn = hybrid_stack_spec.submodules.gdn_layer.submodules.self_attention.submodules
    for projections in (mixer, gdn):
        assert projections.in_proj is megatron_te.TELayerNormColumnParallelLinear
        assert projections.out_proj is megatron_te.TERowParallelLinear
    assert {"LayerNormLinear", "Linear"} <= set(te_wgrad.SPLIT_KINDS)
    assert not {"TELayerNormColumnParallelLinear", "TERowParallelLinear"} & set(te_wgrad.KEEP_IN_B)
