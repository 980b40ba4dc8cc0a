"""Llama-class and Mixtral/Qwen-class models under the zero-bubble runtime (CPU, gloo): bit-identical to megatron.

The model every current architecture shares: rotary position embeddings (megatron's unfused RoPE), RMSNorm,
SwiGLU, grouped-query attention (4 query heads in 2 groups), untied embeddings, no linear biases. One spawned group
of 4 ranks runs every case in turn; the parent compares losses, gradients and parameters with torch.equal:
- megatron's 1F1B against 1F1B through the runtime, zb-h1, zb-h2 and zb-auto at PP=4 (two Adam steps with
  clipping), zb-auto over two chunks per rank against megatron's interleaved 1F1B, and TP=2 x PP=2 (the two
  key/value groups split over the tensor-parallel ranks), with and without sequence parallelism;
- ZB-V against a single-stage run of the same model (Adam without clipping: megatron's grad norm adds one partial
  norm per pipeline rank, so a clip coefficient of PP=1 and one of PP>1 can differ in the last bit whatever the
  schedule; see test_runtime_exactness.py);
- optimizer post-validation (clipping that rolls steps back, exact rollback) against megatron's synchronous step;
- the distributed optimizer with overlapped gradient reduction and parameter gathers at DP=2 x PP=2;
- a Mixtral-style MoE (top-2 of 4 SwiGLU experts, no bias, the same attention) and a Qwen-style one (a shared
  expert beside them) at PP=4 and PP=2 x EP=2;
- the other model options the runtime keeps exact: norms on queries and keys, rotary embeddings on part of each
  head, MoE on some layers only (--moe-layer-freq), a multi-token-prediction layer (whose LM head is used twice in
  each backward) with one and two chunks per rank.
Every zero-bubble case defers the weight gradient of every linear layer to W passes (checked), so the comparisons
compare split backwards with megatron's fused one. docs/models.md has the table.
"""
import dataclasses

import pytest
import torch

from tests.megatron import harness, model_cases, training_case
from tests.megatron.harness import Layout, ModelSpec

LLAMA = ModelSpec(position_embedding_type="rope", normalization="RMSNorm", swiglu=True, num_query_groups=2,
                  ffn_hidden_size=128, add_bias_linear=False, tie_embeddings=False)
LLAMA8 = dataclasses.replace(LLAMA, num_layers=8)  # two chunks per rank at PP=4
MIXTRAL = dataclasses.replace(LLAMA, num_experts=4, moe_router_topk=2, moe_aux_loss_coeff=0.01,
                              moe_options=(("moe_ffn_hidden_size", 64),))
QWEN_MOE = dataclasses.replace(MIXTRAL, moe_options=(("moe_ffn_hidden_size", 64),
                                                     ("moe_shared_expert_intermediate_size", 64)))
OPTIONS = {  # megatron options beyond the Llama set, each kept exact (label -> spec)
    "qk-layernorm": dataclasses.replace(LLAMA, qk_layernorm=True),
    "rotary-percent-0.5": dataclasses.replace(LLAMA, rotary_percent=0.5),
    "moe-layer-freq": dataclasses.replace(MIXTRAL, moe_layer_freq=(1, 0, 0, 1)),
    "mtp": dataclasses.replace(LLAMA, mtp_num_layers=1),
    "tied-embeddings": dataclasses.replace(LLAMA, tie_embeddings=True),  # megatron's default
}
ZB_SCHEDULES = ("zb-h1", "zb-h2", "zb-auto")
PP4, PP2, PP4X2, TP2 = Layout(pp=4), Layout(pp=2), Layout(pp=4, vpp=2), Layout(tp=2, pp=2)
CLIP = 1.0  # below the Llama model's grad norm (1.1-1.3 in the first steps), above the partial norms of the early
# stages: under post-validation they step on partial sums, and those steps are rolled back and re-stepped clipped


@dataclasses.dataclass(frozen=True)
class Case(training_case.Case):
    spec: ModelSpec = LLAMA
    optimizer: str | None = "adam"
    steps: int = 2
    exact: bool = False  # post-validation's exact rollback (a copy of the step's state)


def _cases(prefix: str, layout: Layout, schedules, reference=None, **settings) -> list[Case]:
    """Megatron's own schedule (`reference`: None) and each of `schedules` on the same layout and settings."""
    return [Case(f"{prefix}/{s or 'megatron'}", layout, s, **settings) for s in (reference, *schedules)]


CASES = [
    *_cases("pp4", PP4, ("1f1b",) + ZB_SCHEDULES),
    *_cases("pp4vpp2", PP4X2, ("zb-auto",), spec=LLAMA8),
    *_cases("tp2xpp2", TP2, ("zb-h1", "zb-auto"), microbatches=4),
    *_cases("tp2xpp2/sp", TP2, ("zb-auto",), microbatches=4, spec=dataclasses.replace(LLAMA, sequence_parallel=True)),
    # ZB-V against one stage (DP=4 there, every replica on the same data), without clipping
    Case("pp1/megatron", Layout(), None, spec=LLAMA8, clip_grad=0.0),
    Case("pp4/zb-v", PP4X2, "zb-v", spec=LLAMA8, clip_grad=0.0),
    Case("pp1/megatron/4", Layout(), None, microbatches=4, clip_grad=0.0),
    Case("pp2xdp2/zb-v", Layout(pp=2, vpp=2), "zb-v", microbatches=4, clip_grad=0.0),
    # post-validation: megatron's synchronous step against the speculative one with exact rollback
    Case("pp4/megatron/clip", PP4, None, clip_grad=CLIP, steps=4),
    *(Case(f"pp4/{s}/post-validation", PP4, s, clip_grad=CLIP, steps=4, post_validation=True, exact=True)
      for s in ("zb-h1", "zb-auto")),
    Case("pp4/zb-v/clip", PP4X2, "zb-v", spec=LLAMA8, clip_grad=CLIP, steps=4),
    Case("pp4/zb-v/post-validation", PP4X2, "zb-v", spec=LLAMA8, clip_grad=CLIP, steps=4, post_validation=True,
         exact=True),
    # the distributed optimizer, overlapped reduction and parameter gathers, every stage bucketed on both sides (the
    # shards follow the buckets), each replica on data of its own; three steps: megatron overlaps from the second
    *_cases("pp2xdp2/distributed/overlap", PP2, ZB_SCHEDULES, microbatches=4, steps=3, distributed=True, overlap=True,
            every_stage_buckets=True, shard_data=True),
    # mixture of experts
    *_cases("mixtral/pp4", PP4, ("zb-h1", "zb-auto"), spec=MIXTRAL, shard_data=True),
    *_cases("mixtral/pp2xep2", Layout(pp=2, ep=2), ("zb-h1", "zb-auto"), spec=MIXTRAL, microbatches=4,
            shard_data=True),
    *_cases("qwen-moe/pp4", PP4, ("zb-h1", "zb-auto"), spec=QWEN_MOE, shard_data=True),
    *(case for label, spec in OPTIONS.items() for case in _cases(f"{label}/pp4", PP4, ("zb-h1", "zb-auto"), spec=spec)),
    *_cases("mtp/pp4vpp2", PP4X2, ("zb-auto",), spec=dataclasses.replace(LLAMA8, mtp_num_layers=1)),
]


def _run_case(case: Case) -> dict:
    return model_cases.run_training_case(
        case, lambda run, named: {"shapes": {name: tuple(p.shape) for name, p in named.items()}})


@pytest.fixture(scope="module")
def reports():
    return harness.run_cases(_run_case, CASES, 4, timeout=900)


def _pairs(prefix: str, schedules) -> list[tuple[str, str]]:
    return [(f"{prefix}/{s}", f"{prefix}/megatron") for s in schedules]


@pytest.mark.exactness
@pytest.mark.parametrize("label", [c.label for c in CASES if c.schedule not in (None, "1f1b")])
def test_every_linear_weight_has_its_gradient_deferred_to_a_w_pass(reports, label):
    """What makes the comparisons above worth anything: the zero-bubble runs split every linear layer's backward
    (attention, SwiGLU, experts, shared experts, the output layer, a tied one's copy included, MTP's projection) into
    B and W; the embeddings, the norms and the routers keep their weight gradients in B."""
    for report in reports[label]:
        assert report["deferred"] == report["linear"] != set()
    output_layer = {"output_layer.weight", "embedding.word_embeddings.weight"}  # untied, or the tied copy
    assert any(output_layer & report["linear"] for report in reports[label])  # held by the rank that ends the model


@pytest.mark.exactness
def test_megatrons_own_schedule_defers_no_weight_gradient(reports):
    for label in (c.label for c in CASES if c.schedule is None):
        assert not any(report["deferred"] for report in reports[label]), label


@pytest.mark.parametrize("label, reference", [
    *_pairs("pp4", ("1f1b",) + ZB_SCHEDULES), *_pairs("pp4vpp2", ("zb-auto",)),
    *_pairs("tp2xpp2", ("zb-h1", "zb-auto")), *_pairs("tp2xpp2/sp", ("zb-auto",)), *_pairs("mtp/pp4vpp2", ("zb-auto",)),
])
@pytest.mark.exactness
def test_llama_losses_gradients_and_adam_steps_are_bit_identical_to_megatron(reports, label, reference):
    harness.assert_identical(reports[label], reports[reference])


@pytest.mark.parametrize("label, reference, replicas", [("pp4/zb-v", "pp1/megatron", [0]),
                                                        ("pp2xdp2/zb-v", "pp1/megatron/4", [0, 1])])
@pytest.mark.exactness
def test_llama_under_zb_v_is_bit_identical_to_a_single_stage_run(reports, label, reference, replicas):
    harness.assert_identical(reports[label], reports[reference], replicas=replicas)


@pytest.mark.parametrize("label, reference", [("pp4/zb-h1/post-validation", "pp4/megatron/clip"),
                                              ("pp4/zb-auto/post-validation", "pp4/megatron/clip"),
                                              ("pp4/zb-v/post-validation", "pp4/zb-v/clip")])
@pytest.mark.exactness
def test_llama_with_optimizer_post_validation_is_bit_identical_to_the_synchronous_step(reports, label, reference):
    harness.assert_identical(reports[label], reports[reference])
    assert sum(r["rollbacks"] for r in reports[label]) > 0  # clipped steps taken on partial sums were rolled back


@pytest.mark.exactness
@pytest.mark.parametrize("schedule", ZB_SCHEDULES)
def test_llama_with_the_distributed_optimizer_and_overlapped_reduction_and_gathers_is_bit_identical(reports, schedule):
    prefix = "pp2xdp2/distributed/overlap"
    ours, reference = harness.merge_by_dp_rank(reports[f"{prefix}/{schedule}"]), reports[f"{prefix}/megatron"]
    harness.assert_identical(reports[f"{prefix}/{schedule}"], reference)
    assert ours[0]["losses"] != ours[1]["losses"]  # the replicas trained on data of their own


@pytest.mark.parametrize("label, reference", [
    *_pairs("mixtral/pp4", ("zb-h1", "zb-auto")), *_pairs("mixtral/pp2xep2", ("zb-h1", "zb-auto")),
    *_pairs("qwen-moe/pp4", ("zb-h1", "zb-auto")),
])
@pytest.mark.exactness
def test_mixtral_and_qwen_style_moe_is_bit_identical_to_megatron(reports, label, reference):
    harness.assert_identical(reports[label], reports[reference])


@pytest.mark.exactness
@pytest.mark.parametrize("option", list(OPTIONS))
@pytest.mark.parametrize("schedule", ("zb-h1", "zb-auto"))
def test_further_model_options_are_bit_identical_to_megatron(reports, option, schedule):
    harness.assert_identical(reports[f"{option}/pp4/{schedule}"], reports[f"{option}/pp4/megatron"])


def _shapes(reports, label) -> dict:
    return {name: shape for report in reports[label] for name, shape in report["shapes"].items()}


@pytest.mark.exactness
def test_the_llama_model_is_what_it_claims(reports):
    """No biases, RMSNorm (a scale, no bias), SwiGLU (fc1 holds the gate and the up projection), grouped-query
    attention (queries of 4 heads, keys and values of 2 groups), rotary positions (no position embedding), untied."""
    shapes = _shapes(reports, "pp4/megatron")
    assert not [name for name in shapes if name.endswith("bias")]
    assert shapes["decoder.layers.0.self_attention.linear_qkv.weight"] == ((4 + 2 * 2) * 16, 64)
    assert shapes["decoder.layers.0.mlp.linear_fc1.weight"] == (2 * 128, 64)
    assert shapes["decoder.layers.0.input_layernorm.weight"] == (64,)
    assert not [name for name in shapes if "position_embeddings" in name]
    assert shapes["output_layer.weight"] == shapes["embedding.word_embeddings.weight"] == (128, 64)
    assert len([name for name in shapes if ".layers." in name]) == 4 * 6  # two norms and four linear weights a layer
    tied = _shapes(reports, "tied-embeddings/pp4/megatron")  # the last stage's output layer is the embedding's copy
    assert "output_layer.weight" not in tied and tied.keys() == shapes.keys() - {"output_layer.weight"}


@pytest.mark.exactness
def test_the_moe_models_are_what_they_claim(reports):
    mixtral, qwen, freq = (_shapes(reports, f"{label}/pp4/megatron")
                           for label in ("mixtral", "qwen-moe", "moe-layer-freq"))
    assert mixtral["decoder.layers.0.mlp.experts.local_experts.3.linear_fc1.weight"] == (2 * 64, 64)  # SwiGLU experts
    assert not [name for name in mixtral if "shared_experts" in name or name.endswith("bias")]
    assert qwen["decoder.layers.0.mlp.shared_experts.linear_fc1.weight"] == (2 * 64, 64)
    moe_layers = sorted({int(name.split(".")[2]) for name in freq if ".router." in name})
    assert moe_layers == [0, 3]  # the pattern (1, 0, 0, 1); layers 1 and 2 dense
    assert freq["decoder.layers.1.mlp.linear_fc1.weight"] == (2 * 128, 64)


@pytest.mark.exactness
def test_the_multi_token_prediction_layer_is_on_the_last_stage_and_trains(reports):
    """Its own transformer layer and projection (eh_proj), on the last stage; its loss adds to the gradients (the grad
    norm differs from the same model's without it)."""
    by_stage = {r["pp_rank"]: r for r in reports["mtp/pp4/megatron"] if r["dp_rank"] == 0}
    mtp = [name for name in by_stage[3]["shapes"] if name.startswith("mtp.")]
    assert any(".eh_proj." in name for name in mtp) and any(".linear_fc1." in name for name in mtp)
    assert not any(name.startswith("mtp.") for stage in (0, 1, 2) for name in by_stage[stage]["shapes"])
    plain = next(r for r in reports["pp4/megatron"] if r["pp_rank"] == 3)
    assert by_stage[3]["grad_norms"] != plain["grad_norms"]


@pytest.mark.exactness
def test_queries_and_keys_are_normed_and_rope_turns_half_of_each_head(reports):
    shapes = _shapes(reports, "qk-layernorm/pp4/megatron")
    assert shapes["decoder.layers.0.self_attention.q_layernorm.weight"] == (16,)
    assert shapes["decoder.layers.0.self_attention.k_layernorm.weight"] == (16,)
    # a rotary embedding on half the head dimensions trains another model than on all of them
    ours, full = (harness.merge_by_dp_rank(reports[label])[0]["losses"] for label in ("rotary-percent-0.5/pp4/megatron",
                                                                                      "pp4/megatron"))
    assert ours.keys() == full.keys() and ours[(0, 0)] != full[(0, 0)]
