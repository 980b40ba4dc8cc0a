"""ZB-V layer placement on megatron-core: the right layers and ends on each chunk, and the same model.

Pure tests check the V rule. One spawned gloo group per pipeline size builds the tiny GPTModel chunks as
megatron.training would (pre_process / post_process from the patched stage functions) with PP=p, VPP=2,
runs microbatches forward and backward by hand in V order (rank 0 chunk 0 -> ... -> rank p-1 chunk
0 -> rank p-1 chunk 1 -> ... -> rank 0 chunk 1) and compares losses and gradients with a PP=1 run of
the same deterministically initialised model (torch.equal), untied and tied embeddings.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron.zero_bubble.patches import PatchError
from megatron.zero_bubble.patches.vshape_layout import v_embedding_ranks, v_layer_range
from megatron.zero_bubble.schedules.schedule import virtual_stage
from megatron.zero_bubble.training.init_weights import unwrap
from tests.megatron import harness, process_groups, rank_model

# Tied embeddings: two copies accumulate their microbatches apart and are summed once, PP=1 sums per
# microbatch; a different association (seen: 7e-9 apart with 2 microbatches), so tied runs one, exactly.
MICROBATCHES = {False: 2, True: 1}
# Every name megatron binds one of the patched functions under (checked for exact restoration).
PATCHED_NAMES = ("get_transformer_layer_offset", "get_num_layers_to_build", "is_pipeline_last_stage",
                 "default_embedding_ranks", "get_pp_last_rank", "_allreduce_word_embedding_grads",
                 "is_pp_last_stage", "get_model")


# ---------------------------------------------------------------- the V rule (no megatron)


def v_stage_roles(stages: int, rank: int, chunk: int) -> tuple[bool, bool]:
    """(first, last) virtual stage of the V, megatron's pre_process / post_process: the V's ends are both on rank 0."""
    vstage = virtual_stage("v", stages, rank, chunk)
    return vstage == 0, vstage == 2 * stages - 1


@pytest.mark.parametrize("stages", (1, 2, 3, 4))
def test_v_layer_ranges_cover_every_layer_once_in_virtual_stage_order(stages):
    num_layers = 2 * stages * 3
    by_vstage = {virtual_stage("v", stages, r, k): v_layer_range(num_layers, stages, r, k)
                 for r in range(stages) for k in (0, 1)}
    assert sorted(by_vstage) == list(range(2 * stages))
    assert [i for s in sorted(by_vstage) for i in by_vstage[s]] == list(range(num_layers))
    assert v_layer_range(num_layers, stages, 0, 0).start == 0
    assert v_layer_range(num_layers, stages, 0, 1).stop == num_layers
    # The turn of the V: rank p-1 holds the two middle stages, back to back.
    turn = [v_layer_range(num_layers, stages, stages - 1, k) for k in (0, 1)]
    assert turn[0].stop == turn[1].start


def test_v_layer_range_refuses_layer_counts_that_do_not_split_into_2p_chunks():
    with pytest.raises(PatchError, match=r"num_layers = 6 is not a multiple of 4 \(6 % 4 = 2\)"):
        v_layer_range(6, 2, 0, 0)
    with pytest.raises(PatchError, match="chunk 2"):
        v_layer_range(8, 2, 0, 2)
    with pytest.raises(PatchError, match="rank 2"):
        v_layer_range(8, 2, 2, 0)


def test_only_rank0_chunk0_is_first_and_only_rank0_chunk1_is_last():
    for stages in (2, 3, 4):
        roles = {(r, k): v_stage_roles(stages, r, k) for r in range(stages) for k in (0, 1)}
        assert [rk for rk, (first, _) in roles.items() if first] == [(0, 0)]
        assert [rk for rk, (_, last) in roles.items() if last] == [(0, 1)]


def test_embedding_group_is_the_first_pipeline_rank_only():
    assert v_embedding_ranks([4, 5, 6, 7]) == [4]
    assert v_embedding_ranks([3]) == [3]


# ---------------------------------------------------------------- rank side


def _bindings() -> dict:
    """{(module, name): object} for every megatron binding of a patched name, and Float16Module.forward."""
    import sys

    from megatron.core.transformer.module import Float16Module

    found = {("Float16Module", "forward"): Float16Module.__dict__["forward"]}
    for module_name, module in list(sys.modules.items()):
        if module_name.startswith("megatron.") and not module_name.startswith("megatron.zero_bubble"):
            for name in PATCHED_NAMES:
                if name in getattr(module, "__dict__", {}):
                    found[(module_name, name)] = module.__dict__[name]
    return found


def _build_chunks(spec, tied: bool, **config_overrides) -> list:
    """This rank's GPTModel chunks (the harness's, by global name from seed 7); each chunk's ends as megatron.training's
    get_model chooses them, through its module's bindings."""
    from megatron.core import parallel_state
    from megatron.training import training

    chunks = rank_model.build_gpt_chunks(dataclasses.replace(spec, tie_embeddings=tied), init_seed=7,
                                         **config_overrides)
    vpp = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    pp_group = parallel_state.get_pipeline_model_parallel_group()
    for vp_stage, chunk in enumerate(chunks if vpp is not None else ()):
        assert chunk.post_process == (training.is_pp_last_stage(pp_group) and training.is_vp_last_stage(vp_stage, vpp))
        assert chunk.pre_process == (training.is_pp_first_stage(pp_group) and training.is_vp_first_stage(vp_stage, vpp))
    return chunks


def _describe(chunk) -> dict:
    return {"layer_numbers": [layer.layer_number for layer in chunk.decoder.layers],
            "pre_process": chunk.pre_process, "post_process": chunk.post_process,
            "embedding": hasattr(chunk, "embedding"), "output_layer": hasattr(chunk, "output_layer"),
            "final_layernorm": chunk.decoder.final_layernorm is not None,
            "names": sorted(rank_model.global_param_names(chunk))}


def _loss(output, batch):
    mask = batch["loss_mask"].view(-1)
    return torch.sum(output.view(-1).float() * mask) / mask.sum()


def _run_by_hand(chunks, spec, stages: int, rank: int, microbatches: int, backward: bool = True,
                 dtype=torch.float32) -> tuple[dict, dict]:
    """Forward (and backward) of each microbatch along the V, with explicit send/recv between ranks.
    Returns ({microbatch: loss} on the last stage, {chunk: dtype of its output})."""
    from megatron.core.utils import get_attr_wrapped_model

    steps = [(r, 0) for r in range(stages)] + [(r, 1) for r in reversed(range(stages))]
    shape = (spec.seq_length, spec.micro_batch_size, spec.hidden_size)
    losses, dtypes = {}, {}
    for mb in range(microbatches):
        batch = rank_model.mock_microbatch(mb, spec)
        inputs, outputs, handoff = {}, {}, None
        for i, (owner, chunk_id) in enumerate(steps):
            if owner != rank:
                continue
            chunk = chunks[chunk_id]
            if i > 0:  # a stage boundary, as a received activation is: a leaf that wants its gradient
                if steps[i - 1][0] == rank:
                    received = handoff
                else:
                    received = torch.empty(shape, dtype=dtype)
                    torch.distributed.recv(received, src=steps[i - 1][0])
                inputs[i] = received.detach().requires_grad_()
                get_attr_wrapped_model(chunk, "set_input_tensor")(inputs[i])
            output = chunk(batch["tokens"], batch["position_ids"], None,
                           labels=batch["labels"] if i == len(steps) - 1 else None)
            outputs[i], dtypes[chunk_id] = output, output.dtype
            if i == len(steps) - 1:
                outputs[i] = _loss(output, batch)
                losses[mb] = outputs[i].detach().clone()
            elif steps[i + 1][0] == rank:
                handoff = output
            else:
                torch.distributed.send(output.detach().contiguous(), dst=steps[i + 1][0])
        grad_handoff = None
        for i in (reversed(range(len(steps))) if backward else ()):
            if steps[i][0] != rank:
                continue
            if i == len(steps) - 1:
                grad = None
            elif steps[i + 1][0] == rank:
                grad = grad_handoff
            else:
                grad = torch.empty(shape)
                torch.distributed.recv(grad, src=steps[i + 1][0])
            torch.autograd.backward(outputs[i], grad)
            if i > 0:
                if steps[i - 1][0] == rank:
                    grad_handoff = inputs[i].grad
                else:
                    torch.distributed.send(inputs[i].grad.contiguous(), dst=steps[i - 1][0])
    return losses, dtypes


def _tied_copies(chunks) -> tuple:
    """(chunk 0's embedding weight, chunk 1's output weight) on rank 0."""
    return chunks[0].embedding.word_embeddings.weight, chunks[1].output_layer.weight


def _reference_run(spec, tied: bool) -> dict:
    """PP=1 on every rank (no communication): losses and gradients of the same model."""
    process_groups.init_parallel_state(pp=1)
    (chunk,) = _build_chunks(spec, tied)
    losses = {}
    for mb in range(MICROBATCHES[tied]):
        batch = rank_model.mock_microbatch(mb, spec)
        loss = _loss(chunk(batch["tokens"], batch["position_ids"], None, labels=batch["labels"]), batch)
        loss.backward()
        losses[mb] = loss.detach().clone()
    return {"losses": losses, "grads": rank_model.full_grads([chunk]), "names": _describe(chunk)["names"]}


def _v_case(stages: int, spec, rank: int, tied: bool) -> dict:
    """Build the V chunks, run them by hand under megatron DDP, finalize grads; PP=1 reference alongside."""
    from megatron.core import parallel_state
    from megatron.core.distributed import finalize_model_grads

    from megatron.zero_bubble.patches import vshape_layout

    process_groups.init_parallel_state(pp=stages, vpp=2)
    chunks = _build_chunks(spec, tied)
    copies = _tied_copies(chunks) if tied and rank == 0 else None
    if copies:  # megatron leaves the copy zeroed (the harness' init by name already matches it)
        copies[1].data.zero_()
    tied_copy = vshape_layout.tie_v_output_weights(chunks)  # what the patched get_model does
    chunks = rank_model.wrap_in_ddp(chunks)
    losses, _ = _run_by_hand(chunks, spec, stages, rank, MICROBATCHES[tied])
    finalize_model_grads(chunks)
    report = {
        "chunks": [_describe(unwrap(c)) for c in chunks], "losses": losses,
        "grads": rank_model.full_grads(chunks), "tied_copy": tied_copy,
        "tied_copies_equal": copies and (torch.equal(*copies), torch.equal(*(w.main_grad for w in copies))),
        "embedding_group": torch.distributed.get_process_group_ranks(parallel_state.get_embedding_group())
        if rank == 0 else None,
    }
    del chunks, copies  # the V model goes before the PP=1 one is built (and with it the V layout's groups)
    report["reference"] = _reference_run(spec, tied)
    return report


def _bf16_output_dtypes(stages: int, spec, rank: int) -> dict:
    """{chunk: output dtype} with Float16Module (bf16): only (rank 0, chunk 1) may upcast to fp32."""
    from megatron.core.transformer.module import Float16Module

    process_groups.init_parallel_state(pp=stages, vpp=2)
    bf16 = dict(bf16=True, params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16)
    chunks = [Float16Module(c.config, c) for c in _build_chunks(spec, tied=False, **bf16)]
    return _run_by_hand(chunks, spec, stages, rank, 1, backward=False, dtype=torch.bfloat16)[1]


def _v_scenario(stages: int, spec) -> dict:
    from megatron.training import training  # noqa: F401  (its bindings are part of the snapshot)

    from megatron.zero_bubble.patches import vshape_layout

    before = _bindings()
    vshape_layout.install(stages)
    vshape_layout.install(stages)  # idempotent
    replaced = sorted(f"{m}.{n}" for (m, n), value in _bindings().items() if before.get((m, n)) is not value)
    rank = torch.distributed.get_rank()
    report = {"rank": rank, "replaced": replaced}
    try:
        for tied in (False, True):
            report[tied] = _v_case(stages, spec, rank, tied)
        report["bf16_output_dtypes"] = _bf16_output_dtypes(stages, spec, rank)
        process_groups.init_parallel_state(pp=stages, vpp=2)
        try:
            _build_chunks(harness.ModelSpec(num_layers=2 * stages + 2), tied=False)
            report["indivisible"] = None
        except PatchError as error:
            report["indivisible"] = str(error)
    finally:
        vshape_layout.uninstall()
    after = _bindings()
    report["not_restored"] = sorted(f"{m}.{n}" for (m, n), value in before.items() if after[(m, n)] is not value)
    report["installed_after_uninstall"] = vshape_layout.installed()
    process_groups.init_parallel_state(pp=stages, vpp=2)  # groups made without the patch: refused on every rank
    try:
        vshape_layout.install(stages)
        report["late_install"] = None
    except PatchError as error:
        report["late_install"] = str(error)
    report["late_install_left_nothing"] = not vshape_layout.installed() and _bindings() == after
    return report


@pytest.fixture(scope="module", params=(2, 4), ids=("pp2", "pp4"))
def v_run(request):
    stages = request.param
    spec = harness.ModelSpec(num_layers=2 * stages)
    harness.preload_megatron(training=True)
    return stages, spec, harness.spawn(_v_scenario, stages, stages, spec, timeout=600, start_method="fork")


@pytest.mark.exactness
def test_install_replaces_every_binding_and_uninstall_restores_them_exactly(v_run):
    _, _, reports = v_run
    for report in reports:
        replaced = set(report["replaced"])
        for expected in ("megatron.core.transformer.transformer_layer.get_transformer_layer_offset",
                         "megatron.core.transformer.transformer_block.get_transformer_layer_offset",
                         "megatron.core.models.gpt.gpt_layer_specs.get_transformer_layer_offset",
                         "megatron.core.transformer.transformer_block.get_num_layers_to_build",
                         "megatron.core.models.gpt.gpt_layer_specs.get_num_layers_to_build",
                         "megatron.core.parallel_state.is_pipeline_last_stage",
                         "megatron.core.parallel_state.default_embedding_ranks",
                         "megatron.core.distributed.finalize_model_grads.get_pp_last_rank",
                         "megatron.core.distributed.finalize_model_grads._allreduce_word_embedding_grads",
                         "megatron.training.training.is_pp_last_stage",
                         "megatron.training.models.gpt.is_pp_last_stage",
                         "megatron.training.training.get_model", "megatron.training.get_model",
                         "Float16Module.forward"):
            assert expected in replaced
        # p2p keeps the physical ring: its "last stage" binding is not touched.
        assert not any("p2p_communication" in name or "pipeline_parallel.schedules" in name for name in replaced)
        assert report["not_restored"] == []
        assert report["installed_after_uninstall"] is False
        assert "install the V placement patch before initialize_model_parallel" in report["late_install"]
        assert report["late_install_left_nothing"]


@pytest.mark.exactness
@pytest.mark.parametrize("tied", (False, True), ids=("untied", "tied"))
def test_each_chunk_holds_its_v_layers_and_only_rank0_holds_the_ends(v_run, tied):
    stages, spec, reports = v_run
    for report in reports:
        rank = report["rank"]
        for chunk_id, chunk in enumerate(report[tied]["chunks"]):
            first, last = v_stage_roles(stages, rank, chunk_id)
            layers = v_layer_range(spec.num_layers, stages, rank, chunk_id)
            assert chunk["layer_numbers"] == [i + 1 for i in layers], (rank, chunk_id)
            assert (chunk["pre_process"], chunk["embedding"]) == (first, first), (rank, chunk_id)
            assert (chunk["post_process"], chunk["output_layer"], chunk["final_layernorm"]) == (last,) * 3
    assert reports[0][tied]["embedding_group"] == [0]
    assert [r[tied]["tied_copy"] for r in reports] == [tied] + [False] * (stages - 1)


@pytest.mark.exactness
def test_parameter_names_cover_the_pp1_model_exactly_once(v_run):
    _, _, reports = v_run
    names = [name for report in reports for chunk in report[False]["chunks"] for name in chunk["names"]]
    assert sorted(names) == reports[0][False]["reference"]["names"]
    # Tied: the V model adds one thing, chunk 1's copy of the embedding (the harness names it so).
    tied_names = [name for report in reports for chunk in report[True]["chunks"] for name in chunk["names"]]
    assert sorted(tied_names) == sorted(reports[0][True]["reference"]["names"] + ["embedding.word_embeddings.weight"])


@pytest.mark.exactness
@pytest.mark.parametrize("tied", (False, True), ids=("untied", "tied"))
def test_v_order_forward_backward_matches_pp1_bit_for_bit(v_run, tied):
    _, _, reports = v_run
    reference = reports[0][tied]["reference"]
    assert set(reports[0][tied]["losses"]) == set(range(MICROBATCHES[tied]))
    for mb, loss in reports[0][tied]["losses"].items():
        assert torch.equal(loss, reference["losses"][mb]), mb
    assert all(report[tied]["losses"] == {} for report in reports[1:])
    grads = {}
    for report in reports:
        assert not set(grads) & set(report[tied]["grads"])
        grads.update(report[tied]["grads"])
    # Tied: both copies on rank 0 hold the same weight and the summed gradient (compared with PP=1 below).
    assert reports[0][tied]["tied_copies_equal"] == ((True, True) if tied else None)
    assert sorted(grads) == sorted(reference["grads"])
    differing = {name: (grads[name] - reference["grads"][name]).abs().max().item()
                 for name in grads if not torch.equal(grads[name], reference["grads"][name])}
    assert differing == {}


@pytest.mark.exactness
def test_bf16_wrapper_upcasts_only_the_v_last_stage(v_run):
    stages, _, reports = v_run
    for report in reports:
        want = {k: torch.float32 if v_stage_roles(stages, report["rank"], k)[1] else torch.bfloat16 for k in (0, 1)}
        assert report["bf16_output_dtypes"] == want, report["rank"]


@pytest.mark.exactness
def test_layer_counts_that_do_not_split_into_2p_chunks_are_refused_when_building(v_run):
    stages, _, reports = v_run
    layers, chunks = 2 * stages + 2, 2 * stages
    for report in reports:
        assert f"num_layers = {layers} is not a multiple of {chunks}" in report["indivisible"]
