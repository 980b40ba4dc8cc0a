"""The package's layers, read from the import statements (no import needed):

- schedules/ (planning) imports nothing of runtime/, patches/ or training/;
- runtime/ imports nothing of patches/ or training/: the patch that installs an executor or a
  post-validation controller hands it patches/megatron_private.py, and no runtime module names a megatron
  private function itself;
- patches/megatron_private.py imports nothing of ours but patches/_patching.py.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "megatron" / "zero_bubble"


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


def _modules(layer: str) -> list[Path]:
    return sorted((PACKAGE / layer).glob("*.py"))


def test_planning_imports_no_other_layer():
    for path in _modules("schedules"):
        outside = {m for m in _our_imports(path) if not m.startswith("schedules")}
        assert not outside, f"{path.name} imports {outside}"


def test_runtime_imports_no_patch_and_names_no_megatron_private():
    for path in _modules("runtime"):
        patches = {m for m in _our_imports(path) if m.startswith(("patches", "training"))}
        assert not patches, f"{path.name} imports {patches} (the patches hand the runtime what it needs)"
        privates = re.findall(r"mcore\._\w+|_build_default_pg_collection|\._copy_\w+_to_\w+\(", path.read_text())
        assert not privates, f"{path.name} calls megatron privates itself: {privates}"


def test_the_private_adapter_imports_only_the_patch_base():
    imports = _our_imports(PACKAGE / "patches" / "megatron_private.py")
    assert imports and all(m.startswith("patches._patching.") for m in imports), imports
