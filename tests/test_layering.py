"""The package's layers, read from the import statements (no import needed):

- schedules/ (planning) imports nothing of runtime/, patches/, training/ or tools/, and no torch;
- runtime/ imports nothing of patches/, training/ or tools/, and nothing of megatron at all: what it needs of
  megatron-core comes through the adapter (patches/megatron_adapter.py) it is handed as a constructor argument;
- training/ and tools/ import of megatron only what MEGATRON_ALLOWED lists (megatron.training's public entry
  points); everything else of megatron-core stays inside patches/;
- patches/megatron_adapter.py imports nothing of ours but the patch base and the linear split;
- advise/ (zb-schedule advise) sits above planning: no torch, nothing of runtime/; of megatron only its argument
  parser and vocabulary padding, in command_line.py alone.
"""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "megatron" / "zero_bubble"

# What training/ and tools/ may import from megatron itself: (module, name) pairs (name None: the module).
MEGATRON_ALLOWED = {
    "training": {("megatron.training", "get_args"), ("megatron.training", "get_tokenizer"),
                 ("megatron.training.arguments", "parse_and_validate_args"),
                 ("megatron.training.arguments", "parse_args"),
                 ("megatron.training.vocab_utils", "calculate_padded_vocab_size"),
                 ("megatron.core", "parallel_state"),
                 # language_model.py: what pretrain_gpt.py and pretrain_hybrid.py share (megatron's GPT datasets, its
                 # training loop and the helpers its own entry scripts use)
                 ("megatron.core.datasets.blended_megatron_dataset_builder", "BlendedMegatronDatasetBuilder"),
                 ("megatron.core.datasets.gpt_dataset", "GPTDataset"),
                 ("megatron.core.datasets.gpt_dataset", "GPTDatasetConfig"),
                 ("megatron.core.datasets.gpt_dataset", "MockGPTDataset"),
                 ("megatron.core.enums", "ModelType"), ("megatron.core.utils", "get_attr_wrapped_model"),
                 ("megatron.training", "pretrain"), ("megatron.training", "print_rank_0"),
                 ("megatron.training.argument_utils", "pretrain_cfg_container_from_args"),
                 ("megatron.training.utils", "get_blend_and_blend_per_split"),
                 ("megatron.training.utils", "is_first_or_last_pipeline_stage")},
    "tools": set(),
    "advise": set(),  # but command_line.py: ADVISE_READS_MEGATRON
    "runtime": set(),
    "schedules": set(),
}


ADVISE_READS_MEGATRON = {("megatron.training.arguments", "add_megatron_arguments"),
                         ("megatron.training.vocab_utils", "calculate_padded_vocab_size")}


def _our_imports(path: Path) -> set[str]:
    """Modules of megatron.zero_bubble that `path` imports, as paths relative to the package ("runtime.p2p")."""
    layer = path.parent.relative_to(PACKAGE).parts
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = list(layer[: len(layer) - (node.level - 1)]) + (node.module.split(".") if node.module else [])
            found.update(".".join(base + [alias.name]) for alias in node.names)  # module.name or package.module
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("megatron.zero_bubble."):
            found.update(f"{node.module[len('megatron.zero_bubble.'):]}.{alias.name}" for alias in node.names)
    return found


def _megatron_imports(path: Path) -> set[tuple[str, str | None]]:
    """(module, name) of every import of megatron itself (megatron.core, megatron.training, ...) in `path`."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and not node.level and _is_megatron(node.module or ""):
            found.update((node.module, alias.name) for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update((alias.name, None) for alias in node.names if _is_megatron(alias.name))
    return found


def _is_megatron(module: str) -> bool:
    return (module == "megatron" or module.startswith("megatron.")) and not module.startswith("megatron.zero_bubble")


def _modules(layer: str) -> list[Path]:
    return sorted((PACKAGE / layer).glob("*.py"))


def test_planning_imports_no_other_layer_and_no_torch():
    for path in _modules("schedules"):
        outside = {m for m in _our_imports(path) if not m.startswith("schedules")}
        assert not outside, f"{path.name} imports {outside}"
        assert "import torch" not in path.read_text(), path.name


def test_runtime_imports_no_layer_above_it():
    for path in _modules("runtime"):
        above = {m for m in _our_imports(path) if m.startswith(("patches", "training", "tools"))}
        assert not above, f"{path.name} imports {above} (the session hands the runtime what it needs)"


def test_megatron_is_imported_only_by_the_patches_and_the_allowed_entry_points():
    for layer, allowed in MEGATRON_ALLOWED.items():
        for path in _modules(layer):
            reads = ADVISE_READS_MEGATRON if (layer, path.name) == ("advise", "command_line.py") else set()
            extra = _megatron_imports(path) - allowed - reads
            assert not extra, f"{layer}/{path.name} imports {sorted(extra, key=str)} of megatron: go through " \
                              f"patches/megatron_adapter.py (or add a public entry point to MEGATRON_ALLOWED)"


def test_the_layering_test_sees_an_import_inside_a_function(tmp_path):
    module = tmp_path / "sample.py"
    module.write_text("def f():\n    from megatron.core.utils import get_model_config\n    import megatron.core\n")
    assert _megatron_imports(module) == {("megatron.core.utils", "get_model_config"), ("megatron.core", None)}


def test_the_adapter_imports_only_the_patch_base_the_linear_splits_and_the_optimizer_view():
    imports = _our_imports(PACKAGE / "patches" / "megatron_adapter.py")
    splits = ("patches.linear_wgrad", "patches.te_wgrad", "patches.te_fp8_state", "patches.megatron_optimizer")
    assert imports and all(m.startswith(("patches._patching.",) + splits) or m in splits for m in imports), imports


def test_advise_imports_no_torch_and_nothing_of_the_runtime():
    modules = _modules("advise")
    assert modules
    for path in modules:
        assert "import torch" not in path.read_text(), path.name
        runtime = {m for m in _our_imports(path) if m.startswith(("runtime", "tools"))}
        assert not runtime, f"advise/{path.name} imports {runtime}"


def test_the_planning_layer_holds_no_command_line():
    """argparse, the cost options and the pictures' command line live above planning (commands/, cli.py)."""
    for path in _modules("schedules"):
        assert "import argparse" not in path.read_text(), f"schedules/{path.name} parses a command line"


MAX_MODULE_LINES = 450


def test_every_module_of_the_package_fits_in_450_lines():
    """A module over that wants splitting by concern (the team's rule, checked rather than remembered)."""
    long = {str(path.relative_to(PACKAGE)): n for path in PACKAGE.rglob("*.py")
            if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long, long
