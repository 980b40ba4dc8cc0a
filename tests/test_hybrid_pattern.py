"""pretrain_hybrid.py's --hybrid-layer-pattern without megatron: how the pattern lays the layers out over the virtual
stages (megatron's rules, and the V's), the start-up refusals in one line, and the planner's first costs by layer
kind. No process launched; the launches that train these patterns are tests/megatron/test_pretrain_hybrid.py."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from megatron.zero_bubble.patches._patching import PatchError
from megatron.zero_bubble.patches.vshape_hybrid import v_segment
from megatron.zero_bubble.schedules.costs import Costs
from megatron.zero_bubble.schedules.layer_costs import LayerOptions, layer_work
from megatron.zero_bubble.schedules.planners import PlanRequest, plan
from megatron.zero_bubble.schedules.schedule import virtual_stage
from megatron.zero_bubble.schedules.simulate import simulate
from megatron.zero_bubble.training import arguments
from megatron.zero_bubble.training.checks import ZeroBubbleOptions, _virtual_stages
from megatron.zero_bubble.training.hybrid_checks import check_layers
from megatron.zero_bubble.training.hybrid_pattern import cut_evenly, pattern_chunks, stage_layers
from megatron.zero_bubble.training.setup import plan_settings

MODEL = ["--zero-bubble-cpu", "--micro-batch-size", "2", "--global-batch-size", "16"]
PP2 = ["--pipeline-model-parallel-size", "2"]


# ---------------------------------------------------------------- the layout a pattern gives


@pytest.mark.parametrize("pattern, stages, expected", [
    ("*-*|-*-*-", 2, ["*-*", "-*-*-"]),  # uneven, one chunk per rank
    ("*|-*-|*-*|-", 2, ["*", "-*-", "*-*", "-"]),  # two chunks per rank: segment i is virtual stage i
    ("*-*-*-*-", 2, ["*-*-", "*-*-"]),  # no |: megatron's even split over the ranks
    ("*-*-|*E*E/*-", 2, ["*-*-", "*E*E"]),  # the multi-token-prediction part is not a stage's
])
def test_a_patterns_segments_are_the_virtual_stages_in_order(pattern, stages, expected):
    assert stage_layers(pattern, stages) == expected
    assert pattern_chunks(pattern, stages) == (len(expected) // stages if len(expected) > stages else None)


def test_without_cuts_megatrons_first_and_last_stage_sizes_split_the_pattern():
    assert stage_layers("*-*-*-*", 3, first=1) == ["*", "-*-", "*-*"]
    assert stage_layers("*-*-*-*", 3, first=1, last=4) == ["*", "-*", "-*-*"]


def test_the_v_gives_rank_r_the_segments_r_and_2p_minus_1_minus_r_with_their_true_layer_offsets():
    segments = ["*-*", "-*-", "*", "-"]  # p = 2
    held = {(r, k): v_segment(segments, 2, r, k) for r in range(2) for k in range(2)}
    assert held == {(0, 0): ("*-*", 0), (1, 0): ("-*-", 3), (1, 1): ("*", 6), (0, 1): ("-", 7)}
    assert all(held[r, k][0] == segments[virtual_stage("v", 2, r, k)] for r, k in held)
    with pytest.raises(PatchError, match="2p = 4 pattern segments"):
        v_segment(["*-", "*-"], 2, 0, 0)


def test_a_refusal_suggests_an_even_cut_only_where_the_layers_divide():
    assert cut_evenly("*-*-|*-*-/*-", 4) == "*-|*-|*-|*-/*-"
    assert cut_evenly("*-*-*", 2) is None


# ---------------------------------------------------------------- start-up refusals, before megatron is imported


def _refusal(flags: list[str], monkeypatch, model: str = "hybrid", world_size: int = 2) -> str | None:
    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    try:
        arguments.check_early(MODEL + flags, model)
    except arguments.StartupRefusal as refusal:
        message = str(refusal)
        assert "\n" not in message
        return message
    return None


@pytest.mark.parametrize("flags, model, words", [
    (PP2 + ["--hybrid-layer-pattern", "*-|*-"], "gpt", "launch pretrain_hybrid.py"),
    (PP2 + ["--num-layers", "4"], "hybrid", "pretrain_hybrid.py builds its layers from --hybrid-layer-pattern"),
    (PP2 + ["--hybrid-layer-pattern", "*x-|*-"], "hybrid", "'x' names no layer"),
    (PP2 + ["--hybrid-layer-pattern", "*-|*-|*-"], "hybrid", "3 segments, which do not divide into"),
    (PP2 + ["--hybrid-layer-pattern", "*-*"], "hybrid", "3 layers and no |"),
    (PP2 + ["--hybrid-layer-pattern", "*-|*-", "--decoder-first-pipeline-num-layers", "1"], "hybrid",
     "--decoder-first/last-pipeline-num-layers does not work"),
    (PP2 + ["--hybrid-layer-pattern", "*-|*-|*-|*-", "--num-virtual-stages-per-pipeline-rank", "2"], "hybrid",
     "drop --num-virtual-stages-per-pipeline-rank"),
    (PP2 + ["--hybrid-layer-pattern", "*-|*-", "--allow-padding-num-layers"], "hybrid",
     "drop --allow-padding-num-layers"),
])
def test_patterns_megatron_would_stop_on_later_are_refused_in_one_line(flags, model, words, monkeypatch):
    message = _refusal(flags, monkeypatch, model)
    assert message is not None and words in message, message


@pytest.mark.parametrize("flags, words", [
    # a V follows a | layout of exactly 2p segments, in V order
    (["--hybrid-layer-pattern", "*-*-|*-*-", "--zero-bubble-v-schedule"],
     "--zero-bubble-v-schedule places 2p = 4 virtual stages in V order (rank r holds segments r and 3-r), but "
     "--hybrid-layer-pattern '*-*-|*-*-' has 2 segments; cut it into 4 segments with | (evenly: '*-|*-|*-|*-')"),
    (["--hybrid-layer-pattern", "*-*-*-", "--zero-bubble-v-schedule"], "has 1 segment; cut it into 4 segments with |"),
    (["--hybrid-layer-pattern", "*-|*-|*-|*-/*-", "--zero-bubble-v-schedule"],
     "does not place the multi-token-prediction layers after /"),
    # one chunk per rank, or two and more, as the schedule runs
    (["--hybrid-layer-pattern", "*-|*-|*-|*-", "--pipeline-schedule", "zb-h1"],
     "--pipeline-schedule zb-h1 runs one model chunk per rank, but the 4 segments of --hybrid-layer-pattern "
     "'*-|*-|*-|*-' give 2 per rank at --pipeline-model-parallel-size 2; cut it into 2 segments with | (evenly: "
     "'*-*-|*-*-')"),
    (["--hybrid-layer-pattern", "*-|*-|*-|*-", "--pipeline-schedule", "zb-h2"], "runs one model chunk per rank"),
    (["--hybrid-layer-pattern", "*-*-|*-*-", "--pipeline-schedule", "interleaved-1f1b"],
     "--pipeline-schedule interleaved-1f1b needs two or more model chunks per rank"),
])
def test_schedules_whose_layout_cannot_follow_the_patterns_cuts_are_refused_naming_the_flags(flags, words,
                                                                                            monkeypatch):
    message = _refusal(PP2 + flags, monkeypatch)
    assert message is not None and words in message, message


@pytest.mark.parametrize("flags, chunks", [
    (["--hybrid-layer-pattern", "*-*|-*-*-", "--pipeline-schedule", "zb-h1"], None),  # uneven
    (["--hybrid-layer-pattern", "*-*|-*-*-", "--pipeline-schedule", "zb-h2"], None),
    (["--hybrid-layer-pattern", "*-*-*-*-", "--enable-zero-bubble"], None),  # megatron's even split
    (["--hybrid-layer-pattern", "*|-*-|*-*|-", "--enable-zero-bubble"], 2),  # zb-auto over two chunks
    (["--hybrid-layer-pattern", "*|-*-|*-*|-", "--pipeline-schedule", "interleaved-1f1b"], 2),
    (["--hybrid-layer-pattern", "*-*|-*-|*|-", "--zero-bubble-v-schedule"], 2),  # an uneven V
    (["--hybrid-layer-pattern", "*-*-|*-*-/*-", "--enable-zero-bubble"], None),  # MTP layers on the last stage
    (["--hybrid-override-pattern", "*-|*-"], None),  # megatron's deprecated name of the flag
])
def test_layouts_the_schedules_can_follow_are_accepted(flags, chunks, monkeypatch):
    assert _refusal(PP2 + flags, monkeypatch) is None
    args, _ = arguments.early_parser().parse_known_args(MODEL + PP2 + flags)
    assert _virtual_stages(args) == chunks


def test_a_v_on_a_pattern_hands_megatron_no_chunk_count_of_its_own():
    """megatron derives the chunks from the | segments and asserts on --num-virtual-stages-per-pipeline-rank."""
    args, _ = arguments.early_parser().parse_known_args(MODEL + PP2 + ["--hybrid-layer-pattern", "*-|*-|*-|*-"])
    args.allow_padding_num_layers = False
    assert arguments.megatron_defaults(SimpleNamespace(schedule="zb-v"), args) == {}


# ---------------------------------------------------------------- layer kinds the machine cannot build


def _layers_args(pattern: str, **given) -> SimpleNamespace:
    return SimpleNamespace(**{"hybrid_layer_pattern": pattern, "transformer_impl": "local", "spec": None,
                              "num_experts": None, **given})


@pytest.mark.parametrize("pattern, cuda, given, installed, words", [
    ("*M*M|*M*M", False, {}, True, "'*M*M|*M*M': M (Mamba) layers need CUDA (megatron's layer runs mamba-ssm and "
                                   "causal-conv1d's GPU kernels); on CPU use * (attention), - (MLP) and E (MoE) "
                                   "layers, or train this pattern on GPUs"),
    ("*G|*G", False, {}, True, "G (gated delta net) layers need CUDA"),
    ("*M|*M", True, {}, True, "M (Mamba) from Transformer Engine's modules only"),
    ("+-|+-", False, {}, True, "+ (multi-latent attention) from Transformer Engine's modules only"),
    ("*-|*-/*-", False, {}, True, "/ (multi-token prediction) from Transformer Engine's modules only"),
    ("*M|*M", True, {"transformer_impl": "transformer_engine"}, False,
     "M (Mamba) layers need mamba-ssm and causal-conv1d, which is not installed; pip install mamba-ssm causal-conv1d"),
    ("*G|*G", True, {"transformer_impl": "transformer_engine"}, False, "pip install flash-linear-attention"),
    ("*E|*E", False, {}, True, "has MoE layers E; give their experts with --num-experts"),
    ("*-|*-", False, {"num_experts": 4}, True, "and '*-|*-' has none; add E layers or drop --num-experts"),
])
def test_layer_kinds_that_cannot_be_built_here_are_refused_naming_the_character_and_the_fix(pattern, cuda, given,
                                                                                             installed, words):
    with pytest.raises(arguments.StartupRefusal) as refused:
        check_layers(_layers_args(pattern, **given), cuda, installed=lambda name: installed)
    assert words in str(refused.value) and "\n" not in str(refused.value), str(refused.value)


@pytest.mark.parametrize("pattern, cuda, given", [
    ("*-*E|*-*E", False, {"num_experts": 4}),
    ("*M*G|*-*E", True, {"transformer_impl": "transformer_engine", "num_experts": 8}),
])
def test_layer_kinds_that_can_be_built_here_pass(pattern, cuda, given):
    check_layers(_layers_args(pattern, **given), cuda, installed=lambda name: True)


# ---------------------------------------------------------------- the planner's costs follow the pattern


def _validated_args(pattern: str, stages: int, chunks: int | None, **given) -> SimpleNamespace:
    """What megatron's validated args hold for a hybrid pattern (the layer count and chunks derived from it)."""
    layers = len(pattern.split("/")[0].replace("|", ""))
    return SimpleNamespace(**{
        "hybrid_layer_pattern": pattern, "num_layers": layers, "pipeline_model_parallel_size": stages,
        "virtual_pipeline_model_parallel_size": chunks, "hidden_size": 512, "num_attention_heads": 8,
        "seq_length": 4096, "micro_batch_size": 1, "padded_vocab_size": 32000, "ffn_hidden_size": 2048,
        "swiglu": False, "group_query_attention": False, "num_query_groups": None, "num_experts": 8,
        "moe_router_topk": 2, "moe_ffn_hidden_size": 1024, "moe_shared_expert_intermediate_size": None,
        "decoder_first_pipeline_num_layers": None, "decoder_last_pipeline_num_layers": None, **given})


def _first_costs(args, schedule: str) -> Costs:
    options = ZeroBubbleOptions(schedule=schedule, through_runtime=True, memory_limit=None, timers_start_iter=2,
                                timers_end_iter=4, dump_dir=None, ilp_time_limit=0.0)
    return plan_settings(args, options).initial_costs


def test_the_first_costs_count_each_stages_attention_mlp_and_moe_layers_where_the_pattern_puts_them():
    costs = _first_costs(_validated_args("****|----|*E*E|*-*-|**", 5, None), "zb-auto")
    attention, mlp, moe, mixed = range(4)  # the last stage also holds the LM head
    # at s = 4096 > 2h, an attention layer's scores outweigh an MLP of width 4h
    assert costs.t_f[mlp] < costs.t_f[attention] and costs.t_b[mlp] < costs.t_b[attention]
    assert costs.t_w[attention] < costs.t_w[mlp]  # W is the projections' only: attention has less of it
    assert costs.m_f[mlp] < costs.m_f[attention]  # the scores' activations
    assert costs.t_f[moe] > costs.t_f[mixed]  # two experts per token and the router
    shape = dict(seq_length=4096, micro_batch=1, hidden=512, heads=8,
                 options=LayerOptions(ffn_hidden=2048, experts=8, moe_topk=2, moe_ffn_hidden=1024))
    assert costs.t_f[mlp] * 125e12 == pytest.approx(4 * layer_work("-", **shape).f)
    assert costs.t_f[attention] * 125e12 == pytest.approx(4 * layer_work("*", **shape).f)
    assert costs.t_f[moe] * 125e12 == pytest.approx(2 * layer_work("*", **shape).f + 2 * layer_work("E", **shape).f)


def test_a_gpt_layer_is_an_attention_and_an_mlp_layer_to_the_cost_model():
    shape = dict(seq_length=1024, micro_batch=2, hidden=256, heads=4)
    gpt = Costs.from_model(layers=4, vocab=1000, num_virtual_stages=2, **shape)
    hybrid = Costs.from_model(layers=8, vocab=1000, num_virtual_stages=2, stage_layers=["*-*-", "*-*-"], **shape)
    assert gpt == hybrid


def test_a_vs_virtual_stages_get_the_costs_of_the_segments_they_hold():
    costs = _first_costs(_validated_args("*-*-|----|****|*-*-", 2, 2), "zb-v")
    assert costs.num_virtual_stages == 4
    assert costs.t_f[1] < costs.t_f[0] < costs.t_f[2]  # virtual stage i holds segment i (rank 1, then rank 1)


def test_a_plan_on_the_patterns_costs_runs_no_longer_than_one_that_counts_layers_alike():
    """The first plan of zb-auto, made on costs by layer kind, against one made on every layer costing the same,
    both timed on the costs by kind: never slower, and faster where stages differ in kind."""
    for pattern, faster in (("*-*-|*-*-|*-*-|*-*-", False), ("**|*-*-*-|-----|-", True)):
        args = _validated_args(pattern, 4, None, hidden_size=1024, num_attention_heads=16)
        by_kind = _first_costs(args, "zb-auto")
        counts = [len(stage) for stage in stage_layers(pattern, 4)]
        counted = Costs.from_model(layers=args.num_layers, hidden=1024, heads=16, seq_length=4096, micro_batch=1,
                                   vocab=32000, num_virtual_stages=4, layer_counts=counts)
        spans = [simulate(plan("zb-auto", PlanRequest(stages=4, microbatches=8, costs=costs, ilp_time_limit=0)),
                          by_kind).makespan for costs in (by_kind, counted)]
        assert spans[0] < spans[1] if faster else spans[0] <= spans[1], (pattern, spans)


def test_mamba_and_gdn_stages_are_costed_from_megatrons_sizes_of_those_layers():
    """Sizes as megatron's args name them (--mamba-num-heads, --linear-value-head-dim, ...) reach the cost model: a
    wider Mamba or GDN layer costs more, and B does their scans' and delta rules' backward (no W for them)."""
    narrow = _validated_args("MMMM|GGGG|*-*-", 3, None, mamba_num_heads=8, mamba_head_dim=64,
                             linear_num_value_heads=8, linear_value_head_dim=64)
    wide = _validated_args("MMMM|GGGG|*-*-", 3, None, mamba_num_heads=32, mamba_head_dim=64,
                           linear_num_value_heads=32, linear_value_head_dim=64)
    small, large = _first_costs(narrow, "zb-h1"), _first_costs(wide, "zb-h1")
    for stage in (0, 1):
        assert 0 < small.t_f[stage] < large.t_f[stage] and small.m_f[stage] < large.m_f[stage]
        assert large.t_w[stage] < large.t_f[stage] < large.t_b[stage]
    assert small.t_f[2] == large.t_f[2]  # the attention and MLP stage does not change
