"""The installed package declares what it needs: `pip install .` on a fresh machine must be enough."""
from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# What megatron.training imports at run time without megatron-core declaring it (psutil: checkpoint saves).
TRAINING_LOOP_NEEDS = {"six", "regex", "pyyaml", "pydantic", "psutil"}
# Import name -> distribution name, where they differ.
DISTRIBUTION_OF = {"yaml": "pyyaml", "megatron": "megatron-core"}


def _declared() -> dict[str, str]:
    """Distribution name -> its requirement line, for the non-optional dependencies."""
    lines = importlib.metadata.requires("megatron-zero-bubble") or []
    return {re.split(r"[<>=!~; \[]", line, maxsplit=1)[0].lower(): line for line in lines if "extra ==" not in line}


def _third_party_imports() -> set[str]:
    files = [*(REPO / "megatron" / "zero_bubble").rglob("*.py"), REPO / "pretrain_gpt.py", REPO / "pretrain_hybrid.py"]
    names = set()
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    return {n for n in names if n not in sys.stdlib_module_names and n != "__future__"}


def test_every_third_party_module_the_code_imports_is_a_declared_dependency():
    declared = _declared()
    missing = {DISTRIBUTION_OF.get(n, n).lower() for n in _third_party_imports()} - declared.keys()
    assert not missing, f"imported but not declared in pyproject.toml: {sorted(missing)}"


def test_torch_megatron_core_and_the_training_loops_needs_are_declared():
    declared = _declared()
    assert TRAINING_LOOP_NEEDS <= declared.keys()
    assert "torch" in declared and "megatron-core" in declared
    # the tested release line; the wheel only exists for Python >= 3.12 (install.sh builds the sdist on 3.11)
    assert ">=0.19.2" in declared["megatron-core"] and "<0.20" in declared["megatron-core"]


def test_the_zb_schedule_command_is_an_entry_point():
    scripts = importlib.metadata.entry_points(group="console_scripts")
    assert any(e.name == "zb-schedule" and e.value.startswith("megatron.zero_bubble.cli")
               for e in scripts)
