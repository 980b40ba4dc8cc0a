"""pretrain_gpt.py's start-up checks for the split check and for Transformer Engine layers split into B and W: one
line naming the flag or the version needed. No megatron import, no process launched."""
from __future__ import annotations

import importlib.metadata
import re
import types
from pathlib import Path

import pytest

from megatron.zero_bubble.patches import te_wgrad
from megatron.zero_bubble.training import arguments
from megatron.zero_bubble.training.checks import check_transformer_engine_split
from tests.megatron.test_te_releases import INSTALLED, RELEASES

DOCS = Path(__file__).resolve().parent.parent / "docs" / "transformer-engine.md"
MODEL = ["--zero-bubble-cpu", "--num-layers", "8", "--micro-batch-size", "2", "--global-batch-size", "16"]
PP4 = ["--pipeline-model-parallel-size", "4"]


def _refusal(flags: list[str], monkeypatch) -> str | None:
    monkeypatch.setenv("WORLD_SIZE", "4")
    try:
        arguments.check_early(MODEL + flags)
    except arguments.StartupRefusal as refusal:
        assert "\n" not in str(refusal)
        return str(refusal)
    return None


def test_the_split_check_is_on_by_default_and_its_off_switch_parses(monkeypatch):
    args, _ = arguments.early_parser().parse_known_args(MODEL + PP4 + ["--pipeline-schedule", "zb-h1"])
    assert args.zero_bubble_split_check is True
    args, _ = arguments.early_parser().parse_known_args(MODEL + PP4 + ["--no-zero-bubble-split-check"])
    assert args.zero_bubble_split_check is False
    assert _refusal(PP4 + ["--pipeline-schedule", "zb-h1", "--no-zero-bubble-split-check"], monkeypatch) is None


def test_switching_the_split_check_off_without_a_split_schedule_is_refused(monkeypatch):
    message = _refusal(PP4 + ["--no-zero-bubble-split-check"], monkeypatch)
    assert message == ("--no-zero-bubble-split-check has no effect: no zero-bubble schedule is chosen; drop "
                       "--no-zero-bubble-split-check")


def _te_args(**overrides):
    settings = dict(transformer_impl="transformer_engine", gradient_accumulation_fusion=True, tp_comm_overlap=False,
                    cuda_graph_impl="none")
    return types.SimpleNamespace(**{**settings, **overrides})


@pytest.mark.parametrize("version, fusion, needed", [
    (None, True, "Transformer Engine is not installed"),
    ("2.2.0", True, "needs transformer-engine 2.3 to 2.20"),
    ("2.7.1", False, "without --gradient-accumulation-fusion needs transformer-engine 2.8 to 2.20"),
    ("2.21.0", True, "2.21.0 is newer than the releases this split was checked against"),
    ("2.21.0.dev0+d0067d0", True, "is newer than the releases"),
    ("3.0.0", False, "is newer than the releases"),
    ("not-a-version", True, "cannot read the transformer-engine version"),
])
def test_a_transformer_engine_outside_the_versions_read_is_refused_naming_them(version, fusion, needed, monkeypatch):
    monkeypatch.setattr(te_wgrad, "installed_version", lambda: version)
    with pytest.raises(arguments.StartupRefusal) as refused:
        check_transformer_engine_split(_te_args(gradient_accumulation_fusion=fusion), "--pipeline-schedule zb-h1")
    message = str(refused.value)
    assert message.startswith("--pipeline-schedule zb-h1 with --transformer-impl transformer_engine: ")
    assert needed in message and "\n" not in message
    assert message.endswith("; install transformer-engine 2.3 to 2.20 or use --transformer-impl local")


@pytest.mark.parametrize("version, fusion", [("2.3.0", True), ("2.8.0", False), ("2.14.1", False), ("2.18.0", True),
                                             ("2.19.0", False), ("2.19.0+cu13", True), ("2.7.0.post0", True),
                                             ("2.20.2", True), ("2.20.2", False), ("2.20.0.dev0+d0067d0", True)])
def test_transformer_engine_versions_that_were_read_are_accepted(version, fusion, monkeypatch):
    monkeypatch.setattr(te_wgrad, "installed_version", lambda: version)
    check_transformer_engine_split(_te_args(gradient_accumulation_fusion=fusion), "--enable-zero-bubble")
    check_transformer_engine_split(_te_args(transformer_impl="local"), "--enable-zero-bubble")


@pytest.mark.parametrize("fusion", [True, False])
def test_the_version_pip_installs_with_megatron_core_te_passes_the_check_from_its_package_metadata(fusion, monkeypatch):
    """`pip install megatron-core[te]==0.19.2` brings transformer-engine 2.20.2 (read from the distribution's metadata,
    as at start-up)."""
    def version(name):
        if name == "transformer-engine":
            return "2.20.2"
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(te_wgrad.importlib.metadata, "version", version)
    assert te_wgrad.installed_version() == "2.20.2"
    check_transformer_engine_split(_te_args(gradient_accumulation_fusion=fusion), "--pipeline-schedule zb-h1")


def _version_table() -> list[tuple[str, ...]]:
    """(versions, with --gradient-accumulation-fusion, without it, what was read, whose Python ran) of
    docs/transformer-engine.md's table."""
    section = DOCS.read_text().split("## Supported versions", 1)[1].split("\n## ", 1)[0]
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in section.splitlines()
            if line.startswith("| ") and not line.startswith("| transformer-engine")]
    return [tuple(row) for row in rows]


def _versions_of(row: str) -> list[str]:
    """Versions at both ends of a table row: "2.8 to 2.19" -> 2.8.0, 2.19.0; "below 2.3" -> 2.2.0 and 1.13.0;
    "2.21 and later" -> 2.21.0 and 3.0.0; "2.20" -> 2.20.0 and 2.20.2."""
    numbers = [tuple(int(part) for part in found.split(".")) for found in re.findall(r"\d+\.\d+", row)]
    if row.startswith("below"):
        (major, minor), = numbers
        return [f"{major}.{minor - 1}.0", "1.13.0"]
    if row.endswith("and later"):
        (major, minor), = numbers
        return [f"{major}.{minor}.0", f"{major + 1}.0.0"]
    return [f"{major}.{minor}.{patch}" for major, minor in numbers for patch in (0, 2)]


def test_the_version_table_in_the_docs_is_what_the_check_does():
    rows = _version_table()
    major, minor = te_wgrad.MAX_VERSION.split(".")
    assert [row[0] for row in rows][-2:] == [te_wgrad.MAX_VERSION, f"{major}.{int(minor) + 1} and later"]
    for versions, fused, unfused, _, ran in rows:
        for version in _versions_of(versions):
            for fusion, documented in ((True, fused), (False, unfused)):
                accepted = te_wgrad.version_refusal(version, fusion) is None
                assert accepted == documented.startswith("supported"), (version, fusion, documented)
        if fused.startswith("supported"):  # the release the table names is the one the suite runs the split on
            assert ran.split()[0] == (RELEASES[versions] if RELEASES[versions] != INSTALLED else
                                      importlib.metadata.version("transformer-engine")), (versions, ran)


@pytest.mark.parametrize("overrides, flag", [
    ({"tp_comm_overlap": True}, "--tp-comm-overlap"),
    ({"cuda_graph_impl": "transformer_engine"}, "--cuda-graph-impl"),
    ({"overlap_dispatch_backward_with_experts_wgrad": True}, "--overlap-dispatch-backward-with-experts-wgrad"),
])
def test_te_features_that_cannot_defer_are_refused_with_te_layers_split(overrides, flag, monkeypatch):
    monkeypatch.setattr(te_wgrad, "installed_version", lambda: "2.20.2")
    with pytest.raises(arguments.StartupRefusal, match=f"^{flag}.*drop {flag}$"):
        check_transformer_engine_split(_te_args(**overrides), "--enable-zero-bubble")


@pytest.mark.parametrize("fp8_format", ["e4m3", "hybrid"])
@pytest.mark.parametrize("recipe", ["delayed", "tensorwise"])
def test_fp8_with_a_recipe_shown_exact_splits_te_layers(fp8_format, recipe, monkeypatch):
    monkeypatch.setattr(te_wgrad, "installed_version", lambda: "2.20.2")
    check_transformer_engine_split(_te_args(fp8=fp8_format, fp8_recipe=recipe), "--pipeline-schedule zb-h1")


@pytest.mark.parametrize("overrides, given, why", [
    ({"fp8": "hybrid", "fp8_recipe": "mxfp8"}, "--fp8-recipe mxfp8", "not emulated on the CPU"),
    ({"fp8": "e4m3", "fp8_recipe": "blockwise"}, "--fp8-recipe blockwise", "not emulated on the CPU"),
    ({"fp8": "e4m3", "fp8_recipe": "custom"}, "--fp8-recipe custom", "not emulated on the CPU"),
    ({"fp4": "e2m1"}, "--fp4-format e2m1", "FP4's kernels are not emulated"),
    ({"fp8": "e4m3", "fp8_recipe": "delayed", "fp8_param_gather": True}, "--fp8-param-gather",
     "quantized by the optimizer step"),
    ({"fp4_param_gather": True}, "--fp4-param-gather", "FP4's kernels are not emulated"),
])
def test_low_precision_not_shown_exact_is_refused_with_te_layers_split_in_one_line(overrides, given, why,
                                                                                  monkeypatch):
    monkeypatch.setattr(te_wgrad, "installed_version", lambda: "2.20.2")
    with pytest.raises(arguments.StartupRefusal) as refused:
        check_transformer_engine_split(_te_args(**overrides), "--pipeline-schedule zb-h1")
    message = str(refused.value)
    option = given.split()[0]
    assert message.startswith(f"{given} does not work with --pipeline-schedule zb-h1 on Transformer Engine layers")
    assert why in message and "(--pipeline-schedule 1f1b)" in message and "\n" not in message
    assert f"drop {option}" in message or "use --fp8-recipe delayed or tensorwise" in message
    check_transformer_engine_split(_te_args(**overrides, transformer_impl="local"), "--pipeline-schedule zb-h1")

