"""`zb-schedule advise` in one process: reading pretrain_gpt.py command lines with megatron's parser, the byte and
FLOP arithmetic against hand-computed figures of a small GPT, the schedules it compares and the flags it prints, its
one-line errors, and its output for the four full-size example command lines (tests/advise_lines.py).

The comparison with what training measures is benchmarks/advise_memory.py (the Llama line: tests/megatron/test_advise_measured.py).
"""
from __future__ import annotations

import json

import pytest

from megatron.zero_bubble.advise import candidates as candidate_list
from megatron.zero_bubble.advise.activations import layer_saved, pipeline_tensor_bytes
from megatron.zero_bubble.advise.command_line import AdviseError, megatron_parser, read_run
from megatron.zero_bubble.advise.parameters import layer_params, model_state, rank_params
from megatron.zero_bubble.advise.stage_costs import model_costs
from megatron.zero_bubble.cli import main
from megatron.zero_bubble.te_cpu import te_python_version
from megatron.zero_bubble.schedules.costs import Costs
from tests.advise_lines import FULL, full_line

# A small fp32 GPT on CPU (megatron's local layers, unfused attention): h = 64, 4 heads of 16, FFN 256, s = 32, b = 2,
# V = 128, 4 layers on 2 pipeline stages, m = 4
SMALL = ("--zero-bubble-cpu --num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
         "--max-position-embeddings 32 --micro-batch-size 2 --global-batch-size 8 --vocab-size 128 "
         "--tokenizer-type NullTokenizer --mock-data --hidden-dropout 0 --attention-dropout 0 "
         "--pipeline-model-parallel-size 2").split()


@pytest.fixture(scope="module")
def cpu_parser():
    return megatron_parser(on_cpu=True)


@pytest.fixture(scope="module")
def gpu_parser():
    return megatron_parser(on_cpu=False)


def _run(parser, words, world=None, vocab=None):
    return read_run(parser, list(words), world, vocab)[0]


# ---------------------------------------------------------------- reading the command line


def test_megatrons_defaults_and_derived_sizes_are_read_as_megatron_derives_them(gpu_parser):
    run = _run(gpu_parser, "--num-layers 8 --hidden-size 1024 --num-attention-heads 16 --swiglu --seq-length 512 "
               "--micro-batch-size 2 --global-batch-size 64 --tokenizer-type NullTokenizer --vocab-size 1000 "
               "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --bf16".split(), world=16)
    m, layout, n, k = run.model, run.layout, run.numerics, run.kernels
    assert m.ffn_hidden == int(4 * 1024 * 2 / 3 / 64) * 64 == 2688  # megatron's SwiGLU default
    assert (m.query_groups, m.kv_channels) == (16, 64)  # no grouped-query attention: one group per head
    assert m.vocab == 1024  # padded to a multiple of 128 x TP 2 = 256
    assert (layout.dp, layout.microbatches, layout.chunks) == (4, 8, 1)
    assert not layout.sequence_parallel
    assert (n.params, n.grad, n.main_params, n.distributed_optimizer) == ("bf16", "fp32", "fp32", False)
    assert (k.device, k.transformer_impl, k.flash_attention, k.fused_activation) == ("cuda", "transformer_engine",
                                                                                    True, True)
    assert m.max_position_embeddings == 512 and m.position_embedding == "learned_absolute"


def test_grouped_queries_precision_recompute_and_the_cpu_defaults(cpu_parser):
    run = _run(cpu_parser, [*SMALL, "--group-query-attention", "--num-query-groups", "2", "--fp16",
                            "--recompute-activations", "--use-distributed-optimizer"], world=4)
    assert run.model.query_groups == 2 and run.layout.dp == 2
    assert (run.numerics.params, run.numerics.grad) == ("fp16", "fp16")  # fp16 reduces in fp16 unless asked
    assert run.recompute.granularity == "selective" and run.recompute.modules == ("core_attn",)
    # on the CPU the layers pretrain_gpt.py trains there: TE's where its Python is installed (its unfused attention)
    layers = "transformer_engine" if te_python_version() else "local"
    assert (run.kernels.device, run.kernels.transformer_impl, run.kernels.flash_attention,
            run.kernels.fused_activation) == ("cpu", layers, False, False)
    bf16 = _run(cpu_parser, [*SMALL, "--bf16", "--grad-reduce-in-bf16"])
    assert bf16.numerics.grad == "bf16"


def test_moe_layers_follow_moe_layer_freq(gpu_parser):
    words = ("--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --micro-batch-size 1 "
             "--tokenizer-type NullTokenizer --vocab-size 128 --num-experts 4 --moe-router-topk 2").split()
    assert _run(gpu_parser, words + ["--moe-layer-freq", "([0]+[1]*3)"]).model.moe.layers == (False, True, True, True)
    assert _run(gpu_parser, words + ["--moe-layer-freq", "2"]).model.moe.layers == (True, False, True, False)
    moe = _run(gpu_parser, words).model.moe
    assert (moe.experts, moe.topk, moe.ffn_hidden, moe.shared_ffn_hidden) == (4, 2, 256, 0)


@pytest.mark.parametrize("words, world, vocab, message", [
    (SMALL + ["--multi-latent-attention"], None, None, "--multi-latent-attention: multi-latent attention"),
    (SMALL, 3, None, "--world-size 3 is not a multiple of TP x PP x CP = 2"),
    (SMALL[:SMALL.index("--vocab-size")] + SMALL[SMALL.index("--vocab-size") + 4:]
     + ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", "x"],
     None, None, "give it to advise as --tokenizer-vocab N"),
    (SMALL + ["--global-batch-size", "6"], 4, None, "--global-batch-size 6 is not a multiple of --micro-batch-size 2"),
    (SMALL + ["--no-such-flag"], None, None, "unrecognized arguments: --no-such-flag"),
])
def test_what_advise_cannot_read_is_refused_in_one_line(cpu_parser, words, world, vocab, message):
    with pytest.raises(AdviseError, match=message.replace("(", r"\(").replace("+", r"\+")):
        read_run(cpu_parser, words, world, vocab)


# ---------------------------------------------------------------- arithmetic, by hand for SMALL


def test_parameters_and_model_state_of_the_small_gpt_by_hand(cpu_parser):
    run = _run(cpu_parser, SMALL)
    layer = 64 * 192 + 192 + 64 * 64 + 64 + 2 * 2 * 64 + 64 * 256 + 256 + 256 * 64 + 64  # = 12 h^2 + 13 h
    assert layer_params(run.model, run.layout, 0).total == layer == 49984
    first, last = 2 * layer + 128 * 64 + 32 * 64, 2 * layer + 2 * 64 + 128 * 64  # embeddings / final norm + copy
    ranks = rank_params(run, [2, 2], "single")
    assert [r.total for r in ranks] == [first, last] == [110208, 108288]
    state = model_state(run, ranks[0], first=True)
    assert (state.weights, state.gradients, state.optimizer) == (4 * first, 4 * first, 8 * first)  # fp32 Adam
    # the unfused attention's score buffer b x heads x s x s, and on the CPU the iteration's 4 input batches
    assert state.buffers == 2 * 4 * 32 * 32 * 4 + 4 * (64 * 28 + 64 * 32)


def test_the_distributed_optimizer_shards_main_weights_and_moments_over_the_replicas(cpu_parser):
    run = _run(cpu_parser, SMALL + ["--bf16", "--use-distributed-optimizer"], world=4)
    params = rank_params(run, [2, 2], "single")[0]
    state = model_state(run, params)
    assert (state.weights, state.gradients, state.optimizer) == (2 * params.total, 4 * params.total,
                                                                 12 * params.total / 2)


def test_expert_parameters_are_split_over_expert_parallelism(cpu_parser):
    run = _run(cpu_parser, SMALL + "--num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 32 --swiglu "
               "--disable-bias-linear --normalization RMSNorm --expert-model-parallel-size 2".split(), world=4)
    params = layer_params(run.model, run.layout, 0)
    assert params.dense == 64 * 192 + 64 * 64 + 2 * 64 + 4 * 64  # attention, two RMSNorms, the router
    assert params.expert == 2 * (64 * 32 * 2 + 32 * 64)  # 4 / EP 2 experts, SwiGLU fc1 and fc2
    assert run.layout.expert_dp == 1


def test_activations_of_the_small_gpt_by_hand(cpu_parser):
    run = _run(cpu_parser, SMALL)
    tokens = 64
    # per token, fp32: LayerNorm input and its mean and rstd (x2), the QKV input, q, k, v, a row of 32 scores per
    # head, the projection's input, fc1's input, GeLU's input and output
    per_token = 2 * (64 * 4 + 8) + 64 * 4 + 3 * 64 * 4 + 4 * 32 * 4 + 64 * 4 + 64 * 4 + 2 * 256 * 4
    assert layer_saved(run, 0).forward == per_token * tokens == 295936
    # M_W: each linear layer's input and output gradient
    assert layer_saved(run, 0).wgrad == (64 + 192 + 64 + 64 + 64 + 256 + 256 + 64) * 4 * tokens
    costs = model_costs(run, [2, 2])
    head = (64 * 4 + 8 + 64 * 4 + 128 * 4 + 17) * tokens  # final norm, output layer's input, fp32 softmax, targets
    assert costs.m_f == (2 * 295936 + 12 * tokens, 2 * 295936 + head)
    assert costs.m_w == (2 * 262144, 2 * 262144 + (64 + 128) * 4 * tokens)
    assert pipeline_tensor_bytes(run) == 32 * 2 * 64 * 4


def test_dropout_masks_are_bytes_on_cuda_and_the_activations_type_on_the_cpu(cpu_parser, gpu_parser):
    words = [w for w in SMALL if w != "--zero-bubble-cpu"]
    words = [w for i, w in enumerate(words) if not (w in ("--hidden-dropout", "--attention-dropout")
                                                    or words[i - 1] in ("--hidden-dropout", "--attention-dropout"))]
    local = ["--transformer-impl", "local", "--no-bias-gelu-fusion"]
    on_gpu = layer_saved(_run(gpu_parser, words + local), 0).forward
    on_cpu = layer_saved(_run(cpu_parser, words + ["--zero-bubble-cpu"]), 0).forward
    masks = 4 * 32 + 2 * 64  # the attention probabilities' and the two hidden dropouts' per token
    assert on_cpu - on_gpu == masks * (4 - 1) * 64


def test_estimated_times_of_a_gpt_are_the_papers_formulas(gpu_parser):
    run = _run(gpu_parser, "--num-layers 8 --hidden-size 512 --num-attention-heads 8 --seq-length 1024 "
               "--micro-batch-size 2 --tokenizer-type NullTokenizer --vocab-size 50304 "
               "--pipeline-model-parallel-size 4 --bf16".split())
    ours = model_costs(run, [2, 2, 2, 2])
    paper = Costs.from_model(layers=8, hidden=512, heads=8, seq_length=1024, micro_batch=2, vocab=50304,
                             num_virtual_stages=4, time_unit="ms")
    for name in ("t_f", "t_b", "t_w", "t_comm"):
        assert getattr(ours, name) == pytest.approx(getattr(paper, name), rel=1e-12), name


# ---------------------------------------------------------------- candidates and their flags


def test_each_candidate_gets_the_flags_training_reads(cpu_parser):
    run = _run(cpu_parser, SMALL + ["--pipeline-schedule", "zb-h1"])
    changes = {c.label: candidate_list.command_line(run, c) for c in candidate_list.candidates(run)}
    assert changes["zb-h1"].add == () and changes["zb-h1"].drop == ()
    assert changes["zb-v"].add == ("--pipeline-schedule", "zb-v") and changes["zb-v"].drop == ("--pipeline-schedule",
                                                                                             "zb-h1")
    assert changes["1f1b"].add == () and changes["1f1b"].drop == ("--pipeline-schedule", "zb-h1")
    assert changes["interleaved-1f1b (2 chunks)"].add == ("--num-virtual-stages-per-pipeline-rank", "2")
    assert changes["zb-auto (2x 1F1B memory)"].add == ("--pipeline-schedule", "zb-auto",
                                                       "--zero-bubble-max-pending-backward", "2x")
    assert changes["zb-v (V-Min memory)"].add[-2:] == ("--zero-bubble-v-schedule-mem-setup", "min")
    interleaved = _run(cpu_parser, SMALL + ["--num-virtual-stages-per-pipeline-rank=2"])
    change = candidate_list.command_line(interleaved, candidate_list.candidates(interleaved)[2])  # zb-h1
    assert change.drop == ("--num-virtual-stages-per-pipeline-rank", "2")
    for candidate in candidate_list.candidates(run):  # every command line passes training's start-up checks
        assert candidate_list.refusal(cpu_parser, run, candidate) is None, candidate.label


def test_a_candidate_training_would_refuse_says_why(cpu_parser):
    run = _run(cpu_parser, [w if w != "4" else "6" for w in SMALL])  # 6 layers: not 2p = 4 V stages
    zb_v = next(c for c in candidate_list.candidates(run) if c.label == "zb-v")
    assert "--num-layers 6 is not a multiple of 4" in candidate_list.refusal(cpu_parser, run, zb_v)


# ---------------------------------------------------------------- the command


def test_advise_prints_the_table_and_the_flags_of_the_best_schedule_that_fits(capsys):
    assert main(["advise", "--", *SMALL]) == 0
    out = capsys.readouterr().out
    assert "zb-auto (2x 1F1B memory)" in out and "best under 80.0 GiB: " in out and "  add:  --pipeline-schedule" in out
    assert main(["advise", "--json", "--", *SMALL]) == 0
    result = json.loads(capsys.readouterr().out)
    rows = {row["label"]: row for row in result["schedules"]}
    assert rows["1f1b"]["time_vs_1f1b"] == 1.0
    assert set(rows) >= {"zb-h1", "zb-h2", "zb-v", "interleaved-1f1b (2 chunks)"}
    best = min((r for r in rows.values() if r["fits"]), key=lambda r: (round(r["makespan"], 9), r["peak_bytes"]))
    assert result["best"] == best["label"]
    cap = int(rows[best["label"]]["peak_bytes"]) - 1  # the best no longer fits: the fastest of those that do
    assert main(["advise", "--json", "--gpu-memory", f"{cap}B", "--", *SMALL]) == 0
    tight = json.loads(capsys.readouterr().out)
    fitting = [r for r in tight["schedules"] if r["peak_bytes"] <= cap]
    assert tight["best"] == min(fitting, key=lambda r: (round(r["makespan"], 9), r["peak_bytes"]))["label"]
    assert tight["best"] != best["label"]
    assert main(["advise", "--gpu-memory", "1MiB", "--", *SMALL]) == 0
    assert "no schedule fits in 1.0 MiB: the least memory is " in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["advise", "--gpu-memory", "80", "--", *SMALL], "--gpu-memory 80: give bytes with a unit"),
    (["advise", "--"], "give pretrain_gpt.py's arguments after --"),
    (["advise", "--world-size", "4", "--nodes", "1", "--", *SMALL], "either --world-size or --nodes"),
    (["advise", "--", *SMALL, "--num-experts", "3", "--expert-model-parallel-size", "2"], "--num-experts 3 is not"),
])
def test_bad_input_is_one_line_and_exit_status_2(capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


def test_without_pipeline_parallelism_it_says_so_and_prints_the_memory(capsys):
    words = [w for w in SMALL]
    words[words.index("--pipeline-model-parallel-size") + 1] = "1"
    assert main(["advise", "--", *words]) == 0
    out = capsys.readouterr().out
    assert "no pipeline (--pipeline-model-parallel-size 1)" in out and "peak per GPU" in out


def test_a_v_row_that_misses_its_aim_says_so_and_why_in_one_line(capsys):
    """V-Half is meant to be no slower than 1F1B and V-Min within 10% of it. A V-Min row 13% slower, whose W holds
    more than its F (M_W over M_F) and whose rank 0 carries both ends of the model, gets one line with those reasons;
    a V-Half row within its aim gets none. (advise's predictions, made by hand: on the example lines every V row now
    meets its aim, keeping the row-parallel layers' W in B where M_W outgrows M_F.) Through the command line: the
    tiny GPT's V rows, which miss."""
    from megatron.zero_bubble.advise.advice import Advice, Prediction
    from megatron.zero_bubble.advise.candidates import V_HALF_AIM, V_MIN_AIM, Candidate, Change
    from megatron.zero_bubble.advise.parameters import ModelState
    from megatron.zero_bubble.advise.report import missed_aims

    gib = 2**30
    state = (ModelState(3 * gib, 6 * gib, 9 * gib),) + (ModelState(2 * gib, 4 * gib, 6 * gib),) * 3

    def row(label, planner, makespan, aim=None, busy=(100.0, 90.0, 90.0, 90.0)):
        return Prediction(Candidate(label, planner, 2 if aim else 1, 4.0 if aim else None, (), aim=aim),
                          Change((), (), ()), bubble_rate=0.1594 if aim == V_MIN_AIM else 0.05, makespan=makespan,
                          time_unit="ms", state=state, activations=(gib,) * 4, busy=busy,
                          held_per_microbatch=(1.27 * gib, 2.15 * gib))

    advice = Advice(run=None, predictions=(row("1f1b", "1f1b", 1000.0, busy=(90.0, 90.0, 90.0, 100.0)),
                                           row("zb-v (V-Half memory)", "zb-v", 990.0, V_HALF_AIM),
                                           row("zb-v (V-Min memory)", "zb-v", 1134.0, V_MIN_AIM)),
                    skipped=(), gpu_memory=80 * gib, costs_from="by hand")
    assert missed_aims(advice) == [
        "zb-v (V-Min memory) misses its aim (within 10% of 1F1B's time): 1.134x 1F1B's time; W's deferred operands "
        "outweigh an F's activations (M_W 2.1 GiB against M_F 1.3 GiB per virtual stage), so the memory it is named "
        "for leaves little room to defer W; the V puts both ends of the model on pipeline rank 0, whose passes take "
        "11.1% longer than the other ranks' and whose model state is 6.0 GiB larger; at 4 microbatches per rank "
        "15.94% of each rank's span is idle (1F1B: 5.00%)"]
    # the tiny GPT at PP=2 with 4 microbatches: too few for the V's memory-saving rows, which say so
    assert main(["advise", "--json", "--", *SMALL]) == 0
    result = json.loads(capsys.readouterr().out)
    rows = {row["label"]: row for row in result["schedules"]}
    missed = [label for label, aim in (("zb-v (V-Half memory)", V_HALF_AIM), ("zb-v (V-Min memory)", V_MIN_AIM))
              if rows[label]["time_vs_1f1b"] > aim]
    assert missed and [line.split(" misses its aim")[0] for line in result["missed_aims"]] == missed
    assert main(["advise", "--", *SMALL]) == 0
    printed = capsys.readouterr().out
    assert all(f"  {line}\n" in printed for line in result["missed_aims"])


def test_the_automatic_limit_plans_each_rank_under_what_its_model_state_leaves_of_the_gpu(capsys):
    """The row training's --zero-bubble-max-pending-backward auto would run: every rank's activations capped at a
    share of what its model state leaves of --gpu-memory. Between 1F1B's peak and zb-auto at 2x, it fits where 2x
    does not, and is no slower than 1F1B."""
    def rows(*options):
        assert main(["advise", "--json", *options, "--", *SMALL]) == 0
        return {row["label"]: row for row in json.loads(capsys.readouterr().out)["schedules"]}

    wide = rows()
    cap = int((wide["1f1b"]["peak_bytes"] + wide["zb-auto (2x 1F1B memory)"]["peak_bytes"]) / 2)
    tight = rows("--gpu-memory", f"{cap}B")
    auto = tight["zb-auto (auto: GPU memory)"]
    assert auto["fits"] and not tight["zb-auto (2x 1F1B memory)"]["fits"]
    assert auto["makespan"] <= tight["1f1b"]["makespan"] * (1 + 1e-9)
    assert auto["add"] == ["--pipeline-schedule", "zb-auto"]  # auto is training's default limit


# GPT-3's pipeline plans 192 microbatches on 16 stages for each of ten schedules: 10-25 s
@pytest.mark.parametrize("name", [pytest.param(name, marks=pytest.mark.slow) if name == "gpt3-175b" else name
                                  for name in sorted(FULL)])
def test_the_full_size_example_command_lines_get_advice(capsys, name):
    options, words = full_line(name)
    assert main(["advise", "--json", *options, "--", *words]) == 0
    result = json.loads(capsys.readouterr().out)
    if result["stages"] == 1:  # the Llama 3 example trains without pipeline parallelism
        assert result["schedules"] == [] and result["peak_bytes"] > 0
        return
    assert result["schedules"] and result["best"] is not None
    for row in result["schedules"]:
        assert 0 <= row["bubble_rate"] < 1 and row["peak_bytes"] > 0 and row["fits"] == (row["peak_bytes"] <=
                                                                                          80 * 2**30)


# ---------------------------------------------------------------- costs from a profiled run


def _dump(directory, name: str, costs_from: str, t_f: list[float], stages: int = 2) -> None:
    """A schedule JSON as pretrain_gpt.py --zero-bubble-dump-schedule writes it (the keys advise reads)."""
    costs = {"t_f": t_f, "t_b": [4.0, 6.0], "t_w": [2.0, 3.0], "m_f": [200.0, 260.0], "m_w": [100.0, 130.0],
             "t_comm": 0.5, "memory_unit": "bytes", "time_unit": "s"}
    (directory / name).write_text(json.dumps({"stages": stages, "chunks": 1, "microbatches": 4, "layout": "single",
                                              "ranks": [], "costs": costs, "costs_from": costs_from}))


def test_a_profile_is_spread_per_layer_over_any_layout(tmp_path, cpu_parser):
    from megatron.zero_bubble.advise.stage_costs import find_profile, load_profile

    _dump(tmp_path, "zb-h1-m4-initial.json", "estimated from the model shape", [9.0, 9.0])
    _dump(tmp_path, "zb-h1-m4-iter4.json", "measured in iterations 2-3", [3.0, 5.0])
    _dump(tmp_path, "zb-h1-m4-iter14.json", "measured in iterations 12-13", [3.2, 5.0])
    path = find_profile(str(tmp_path))
    assert path.endswith("zb-h1-m4-iter14.json")  # the newest with measured costs
    profile = load_profile(_run(cpu_parser, SMALL), path)
    same = profile.costs([2, 2])  # the profiled layout comes back as measured
    assert same.t_f == (3.2, 5.0) and same.m_f == (200.0, 260.0) and same.m_w == (100.0, 130.0)
    v = profile.costs([1, 1, 1, 1])  # one layer per virtual stage, the LM head's excess on the last
    assert v.t_f == pytest.approx((1.6, 1.6, 1.6, 5.0 - 3.2 + 1.6)) and v.t_comm == 0.5
    assert v.m_f == pytest.approx((100.0, 100.0, 100.0, 160.0))


def test_advise_reads_a_profile_and_refuses_one_of_another_pipeline(tmp_path, capsys):
    _dump(tmp_path, "zb-h1-m4-iter4.json", "measured in iterations 2-3", [3.0, 5.0])
    assert main(["advise", "--profile", str(tmp_path), "--", *SMALL]) == 0
    assert f"costs      measured ({tmp_path / 'zb-h1-m4-iter4.json'})" in capsys.readouterr().out
    other = tmp_path / "other"
    other.mkdir()
    _dump(other, "zb-h1-m4-iter4.json", "measured in iterations 2-3", [3.0, 5.0], stages=4)
    assert main(["advise", "--profile", str(other), "--", *SMALL]) == 2
    assert "a run with 4 pipeline stages, the command line has --pipeline-model-parallel-size 2" in \
        capsys.readouterr().err
    assert main(["advise", "--profile", str(tmp_path / "missing"), "--", *SMALL]) == 2
    assert "no such directory" in capsys.readouterr().err
