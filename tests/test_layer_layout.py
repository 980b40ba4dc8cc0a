"""How layers are laid out over virtual stages: megatron's layout strings, --allow-padding-num-layers, the V.

The runs that train on these layouts and compare with megatron's losses are in tests/megatron/test_pretrain_gpt.py.
"""
from types import SimpleNamespace

import pytest

from megatron.zero_bubble.patches._patching import PatchError
from megatron.zero_bubble.patches.vshape_layout import v_layer_range, v_stage_layer_counts
from megatron.zero_bubble.schedules.costs import Costs, even_layer_counts
from megatron.zero_bubble.schedules.schedule import virtual_stage
from megatron.zero_bubble.training.checks import _virtual_stages
from megatron.zero_bubble.training.layer_layout import (layer_counts_of, layout_stages, layout_string,
                                                        padding_layout)


@pytest.mark.parametrize("layout, stages", [
    ("Et|t|t|tt|t|t|t|L", ["Et", "t", "t", "tt", "t", "t", "t", "L"]),
    ("E|(tt|)*3,tL", ["E", "tt", "tt", "tt", "tL"]),
    ("Et*3|t*2L", ["Ettt", "ttL"]),
])
def test_layout_strings_expand_into_their_stages_as_megatron_reads_them(layout, stages):
    assert layout_stages(layout) == stages


@pytest.mark.parametrize("layers, stages, expected", [
    (6, 8, "E|t|t|t|t|t|t|L"), (6, 4, "Et|tt|tt|tL"), (9, 4, "Ett|ttt|tt|ttL"), (8, 4, None),
])
def test_padding_gives_the_middle_stages_the_layers_that_do_not_divide(layers, stages, expected):
    layout = padding_layout(layers, stages)
    assert layout == expected
    if layout is not None:
        counts = [stage.count("t") for stage in layout_stages(layout)]
        assert sum(counts) == layers and max(counts) - min(counts) == 1 and counts == even_layer_counts(layers, stages)
        assert layout == layout_string(counts)


def test_padding_refuses_to_leave_a_middle_stage_without_a_layer():
    with pytest.raises(ValueError, match="at least 6 layers"):
        padding_layout(5, 8)


def test_the_v_reads_a_layout_or_the_embedding_and_loss_accounting_in_virtual_stage_order():
    assert v_stage_layer_counts(6, 4, embedding=True, loss=True) == [0, 1, 1, 1, 1, 1, 1, 0]
    assert v_stage_layer_counts(15, 4, embedding=True) == [1, 2, 2, 2, 2, 2, 2, 2]
    counts = [1, 1, 1, 2, 1, 1, 1, 0]
    ranges = {virtual_stage("v", 4, r, k): v_layer_range(8, 4, r, k, counts) for r in range(4) for k in (0, 1)}
    assert [ranges[v] for v in range(8)] == [range(0, 1), range(1, 2), range(2, 3), range(3, 5), range(5, 6),
                                             range(6, 7), range(7, 8), range(8, 8)]
    with pytest.raises(PatchError, match="8 virtual stages holding 8 layers"):
        v_stage_layer_counts(8, 4, layout=[2, 2, 2, 2])
    with pytest.raises(PatchError, match=r"num_layers = 5 \+ 2 .embedding and loss counted as layers. is not a multiple of 8"):
        v_stage_layer_counts(5, 4, embedding=True, loss=True)


def _args(**given):
    defaults = dict(num_layers=8, pipeline_model_parallel_size=4, pipeline_model_parallel_layout=None,
                    num_virtual_stages_per_pipeline_rank=None, num_layers_per_virtual_pipeline_stage=None,
                    decoder_first_pipeline_num_layers=None, decoder_last_pipeline_num_layers=None,
                    account_for_embedding_in_pipeline_split=False, account_for_loss_in_pipeline_split=False)
    return SimpleNamespace(**{**defaults, **given})


@pytest.mark.parametrize("given, chunks", [
    ({}, None), ({"num_virtual_stages_per_pipeline_rank": 2}, 2), ({"num_layers_per_virtual_pipeline_stage": 1}, 2),
    ({"pipeline_model_parallel_layout": "Et|t|t|tt|t|t|t|L"}, 2), ({"pipeline_model_parallel_layout": "Ett|tt|tt|ttL"}, 1),
    ({"num_layers": 6, "num_layers_per_virtual_pipeline_stage": 1, "account_for_embedding_in_pipeline_split": True,
      "account_for_loss_in_pipeline_split": True}, 2),
])
def test_chunks_per_rank_are_read_from_whichever_of_megatrons_virtual_pipeline_flags_is_given(given, chunks):
    assert _virtual_stages(_args(**given)) == chunks


@pytest.mark.parametrize("given, stages, chunks, counts", [
    ({}, 4, 1, [2, 2, 2, 2]),
    ({"decoder_first_pipeline_num_layers": 1, "decoder_last_pipeline_num_layers": 3}, 4, 1, [1, 2, 2, 3]),
    ({"num_layers": 6, "account_for_embedding_in_pipeline_split": True, "account_for_loss_in_pipeline_split": True},
     4, 2, [0, 1, 1, 1, 1, 1, 1, 0]),
    ({"pipeline_model_parallel_layout": "Et|t|t|tt|t|t|t|L"}, 4, 2, [1, 1, 1, 2, 1, 1, 1, 0]),
])
def test_the_planners_model_shape_costs_follow_megatrons_layout(given, stages, chunks, counts):
    args = _args(**given)
    assert layer_counts_of(args, stages, chunks) == counts
    shape = dict(layers=args.num_layers, hidden=64, heads=4, seq_length=32, micro_batch=2, vocab=128)
    costs = Costs.from_model(**shape, num_virtual_stages=stages * chunks, layer_counts=counts)
    heavier = [v for v in range(stages * chunks - 1) if counts[v] > counts[0]]
    assert all(costs.t_f[v] > costs.t_f[0] > 0 for v in heavier)  # a stage without layers is not free, but lighter


@pytest.mark.parametrize("layout, pipeline_size, rank", [
    ("Et*2|t*2|t*2|t*2,mL", 4, None),  # MTP with the loss on the last rank: megatron's usual placement
    ("Et*2|t*2|t*2,m|t*2L", 4, 2),  # on rank 2's only stage: mtp_standalone
    ("Et|t|t|t|t|t|t|t,mL", 4, None),  # two chunks: m in the last rank's last chunk (stage 7 = 1 x 4 + 3)
    ("Et|t|t|t|t|t,m|t|L", 4, 1),  # two chunks: rank 1's last chunk (stage 5 = 1 x 4 + 1)
])
def test_multi_token_prediction_off_the_last_rank_is_found_as_megatron_finds_it(layout, pipeline_size, rank):
    from megatron.zero_bubble.training.layer_layout import standalone_mtp_rank

    assert standalone_mtp_rank(layout, pipeline_size) == rank


def test_multi_token_prediction_off_the_last_rank_is_refused_with_the_runtime_in_one_line():
    import types

    from megatron.zero_bubble.training.checks import _check_runtime
    from megatron.zero_bubble.training.flags import StartupRefusal

    args = types.SimpleNamespace(pipeline_model_parallel_layout="Et*2|t*2|t*2,m|t*2L", pipeline_model_parallel_size=4)
    with pytest.raises(StartupRefusal, match=r"^--pipeline-model-parallel-layout puts the multi-token-prediction "
                                             r"layers \(m\) at the end of pipeline rank 2, not the last: .* put m in "
                                             r"the last stage$"):
        _check_runtime(args, "--pipeline-schedule zb-h1")
    args.pipeline_model_parallel_layout = "Et*2|t*2|t*2|t*2,mL"
    _check_runtime(args, "--pipeline-schedule zb-h1")
