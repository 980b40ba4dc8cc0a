"""No code of this repository picks a port for another process to bind, read from the source (no import needed).

Binding a socket to port 0, closing it and handing the number on (to torchrun's --master-port, to MASTER_PORT)
leaves a window in which another process can take the port: launches that start together (the suite's workers,
gpu_check's --jobs) then fail with EADDRINUSE. What binds a port binds it itself at the kernel's choice and keeps it:
torchrun through TORCHRUN_ONE_MACHINE (--standalone), ranks started by one process through tools/local_ranks.py.
Fixed ports below the kernel's range for chosen ports (32768 and up on Linux), as the SLURM tests and the examples'
defaults use, cannot meet a chosen one.
"""
from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SOURCES = sorted(p for top in ("megatron", "tests", "benchmarks", "scripts") for p in (REPO / top).rglob("*.py"))
SOURCES += sorted(REPO.glob("*.py"))


def _calls(tree: ast.AST, method: str) -> list[ast.Call]:
    return [node for node in ast.walk(tree) if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr == method]


def _port_pickers(tree: ast.AST) -> list[str]:
    """Functions that bind a socket and read back its port: the number can only be for someone else to bind."""
    return [f"{node.name} (line {node.lineno})" for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and _calls(node, "bind") and _calls(node, "getsockname")]


def _master_ports(tree: ast.AST) -> list[str]:
    """String constants that hand a port to torchrun or to env:// (a command built here, an environment set here)."""
    names = ("--master-port", "--master_port", "MASTER_PORT")
    constants = [f"{node.value!r} (line {node.lineno})" for node in ast.walk(tree)
                 if isinstance(node, ast.Constant) and node.value in names]
    keywords = [f"{node.arg}= (line {node.value.lineno})" for node in ast.walk(tree)
                if isinstance(node, ast.keyword) and node.arg in names]  # os.environ.update(MASTER_PORT=...)
    return constants + keywords


def _offenders(scan, skip=()) -> dict[str, list[str]]:
    found = {str(path.relative_to(REPO)): scan(ast.parse(path.read_text(), str(path))) for path in SOURCES}
    return {name: where for name, where in found.items() if where and name not in skip}


def test_no_source_picks_a_free_port_for_another_process():
    assert len(SOURCES) > 100  # the whole repository is read
    assert _offenders(_port_pickers) == {}, "bind to port 0 where the port is used (tools/local_ranks.py)"


ALLOWED_MASTER_PORT = {  # file -> why it may name MASTER_PORT
    "tests/test_examples.py": "lists the examples' launch knobs (documented, default 29500), binds nothing",
    "tests/slurm/test_slurm_launcher.py": "the SLURM jobs' fixed ports 29511 and 29512, below the kernel's range",
}


def test_torchrun_commands_built_here_let_torchrun_choose_the_port():
    skip = {*ALLOWED_MASTER_PORT, str(Path(__file__).resolve().relative_to(REPO))}
    assert _offenders(_master_ports, skip) == {}, \
        "launch with tools.local_ranks.TORCHRUN_ONE_MACHINE, or start ranks with local_ranks.run_ranks"


def test_the_checks_find_a_port_picker_and_a_master_port():
    """The scans are not vacuous: the pattern this file forbids, as the code had it, is found."""
    picker = ast.parse("def free_port():\n    with socket.socket() as s:\n        s.bind(('127.0.0.1', 0))\n"
                       "        return s.getsockname()[1]\n")
    assert _port_pickers(picker) == ["free_port (line 1)"]
    command = ast.parse("cmd = ['torchrun', '--master-port', str(port)]\nos.environ.update(MASTER_PORT='1')\n")
    assert _master_ports(command) == ["'--master-port' (line 1)", "MASTER_PORT= (line 2)"]
    environ = ast.parse("os.environ['MASTER_PORT'] = str(port)\n")
    assert _master_ports(environ) == ["'MASTER_PORT' (line 1)"]
