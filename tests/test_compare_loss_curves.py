"""scripts/compare_loss_curves.py on synthetic Megatron logs: exit codes, first divergence, maxima, picture."""
from __future__ import annotations

import importlib.util
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "compare_loss_curves.py"
_spec = importlib.util.spec_from_file_location("compare_loss_curves", SCRIPT)
clc = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = clc  # dataclasses look their module up there
_spec.loader.exec_module(clc)

ITERATIONS = 12


def iteration_line(i: int, loss: float, grad_norm: float = 1.297, ms: float = 100.0, prefix: str = "") -> str:
    """Megatron 0.19's training_log line, as printed with .6E losses and .3f grad norms."""
    return (f"{prefix} [2025-01-01 10:00:00.000000] iteration {i:8d}/{ITERATIONS:8d} | consumed samples: "
            f"{16 * i:12d} | elapsed time per iteration (ms): {ms:.1f} | learning rate: 1.000000E-03 | "
            f"global batch size:    16 | lm loss: {loss:.6E} | loss scale: 1.0 | grad norm: {grad_norm:.3f} | "
            "number of skipped iterations:   0 | number of nan iterations:   0 |\n")


def loss_at(i: int) -> float:
    return 4.876812 - 0.05 * i


def write_log(path: Path, shift_from: int | None = None, shift: float = 0.0, iterations=None, prefix="",
              noise: str = "") -> Path:
    lines = [noise]
    for i in iterations or range(1, ITERATIONS + 1):
        delta = shift if shift_from is not None and i >= shift_from else 0.0
        lines.append(iteration_line(i, loss_at(i) + delta, ms=100.0 + i, prefix=prefix))
    path.write_text("".join(lines))
    return path


def run(argv, capsys):
    code = clc.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


MEGATRON_NOISE = ("using world size: 4, data-parallel size: 1\n"
                  " validation loss at iteration 10 on validation set | lm loss value: 9.9E+00 |\n"
                  "[after training is done] datetime: 2025-01-01 10:00:05\n")


def test_identical_logs_pass_and_other_megatron_lines_are_ignored(tmp_path, capsys):
    ref = write_log(tmp_path / "1f1b.log", noise=MEGATRON_NOISE)
    same = write_log(tmp_path / "zb-h1.log")
    code, out, err = run([ref, same], capsys)
    assert code == 0, err
    assert f"zb-h1: identical to the reference over {ITERATIONS} iterations" in out
    assert "OK: 1 run(s) match 1f1b (exact)" in out
    table = [line.split() for line in out.splitlines() if line.split()[:1] and line.split()[0].isdigit()]
    assert [row[0] for row in table] == [str(i) for i in range(1, ITERATIONS + 1)]
    assert all(row[1] == row[2] and row[3] == "0" for row in table)


def test_a_run_diverging_at_iteration_k_fails_and_names_k_and_the_maximum(tmp_path, capsys):
    ref = write_log(tmp_path / "ref.log")
    same = write_log(tmp_path / "same.log")
    diverging = write_log(tmp_path / "diverging.log", shift_from=7, shift=2e-6)
    code, out, _ = run([ref, same, diverging, "--labels", "1f1b,zb-h1,zb-h2"], capsys)
    assert code == 1
    assert "zb-h1: identical to the reference" in out
    summary = next(line for line in out.splitlines() if line.startswith("zb-h2:"))
    assert "DIVERGES: first difference at iteration 7" in summary
    assert "max abs diff 2.000e-06 (iteration 7)" in summary
    assert "FAIL: zb-h2 beyond tolerance (exact) of 1f1b" in out


def test_comparison_records_first_failure_and_maxima_exactly():
    reference = clc.Curve("ref", "-", values={1: 2.0, 2: 2.0, 3: 4.0, 4: 1.0})
    run = clc.Curve("run", "-", values={1: 2.0, 2: 2.001, 3: 4.5, 4: 0.0})
    result = clc.compare(reference, run, atol=0.01, rtol=0.0)
    assert (result.first_difference, result.first_failure) == (2, 3)
    assert (result.max_abs, result.max_abs_at) == (1.0, 4)
    assert (result.max_rel, result.max_rel_at) == (1.0, 4)
    assert not result.ok


def test_differences_within_atol_or_rtol_pass_but_are_reported(tmp_path, capsys):
    ref = write_log(tmp_path / "ref.log")
    close = write_log(tmp_path / "close.log", shift_from=3, shift=1e-6)
    for tolerance in (["--atol", "1.5e-6"], ["--rtol", "1e-6"]):
        code, out, _ = run([ref, close, *tolerance], capsys)
        assert code == 0, tolerance
        assert "close: within tolerance: first difference at iteration 3" in out
    code, _, _ = run([ref, close, "--atol", "5e-7"], capsys)
    assert code == 1


def test_missing_iteration_is_refused_with_one_line(tmp_path, capsys):
    ref = write_log(tmp_path / "ref.log")
    gap = write_log(tmp_path / "gap.log", iterations=[i for i in range(1, ITERATIONS + 1) if i != 5])
    code, out, err = run([ref, gap], capsys)
    assert code == 2 and out == ""
    assert err.count("\n") == 1
    assert "gap" in err and "lacks iterations 5;" in err and "do not line up" in err


def test_a_shorter_run_is_refused(tmp_path, capsys):
    ref = write_log(tmp_path / "ref.log")
    short = write_log(tmp_path / "short.log", iterations=range(1, 9))
    code, _, err = run([ref, short], capsys)
    assert code == 2
    assert f"lacks iterations 9-{ITERATIONS}" in err


def test_a_log_without_loss_lines_is_refused(tmp_path, capsys):
    ref = write_log(tmp_path / "ref.log")
    empty = tmp_path / "crashed.log"
    empty.write_text(MEGATRON_NOISE + "Traceback (most recent call last):\n")
    code, _, err = run([ref, empty], capsys)
    assert code == 2
    assert err.strip() == f"compare_loss_curves: {empty}: no iteration line with 'lm loss' (is this a Megatron training log?)"


def test_rank_prefixed_torchrun_lines_are_parsed(tmp_path, capsys):
    ref = write_log(tmp_path / "ref.log")
    prefixed = write_log(tmp_path / "prefixed.log", prefix="[default3]:", noise="[default0]:building GPT model ...\n")
    curve = clc.load_curve(str(prefixed), "lm loss", "prefixed")
    assert curve.values == {i: float(f"{loss_at(i):.6E}") for i in range(1, ITERATIONS + 1)}
    assert curve.elapsed_ms[4] == 104.0
    code, _, _ = run([ref, prefixed], capsys)
    assert code == 0


def test_grad_norm_metric_and_median_iteration_time(tmp_path, capsys):
    ref = write_log(tmp_path / "ref.log")
    curve = clc.load_curve(str(ref), "grad norm", "ref")
    assert set(curve.values.values()) == {1.297}
    expected_ms = statistics.median(100.0 + i for i in range(2, ITERATIONS + 1))  # the first one warms up
    assert curve.median_ms() == expected_ms
    code, out, _ = run([ref, ref, "--metric", "grad norm"], capsys)
    assert code == 0 and out.startswith("grad norm per iteration")
    assert f"median {expected_ms:.1f} ms/iteration (1.00x the reference)" in out


def test_png_is_written(tmp_path, capsys):
    ref = write_log(tmp_path / "ref.log")
    diverging = write_log(tmp_path / "diverging.log", shift_from=4, shift=1e-3)
    picture = tmp_path / "curves.png"
    code, out, _ = run([ref, diverging, "-o", picture], capsys)
    assert code == 1
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"picture: {picture}" in out


def test_bad_labels_and_single_input_are_usage_errors(tmp_path, capsys):
    ref = write_log(tmp_path / "ref.log")
    assert run([ref, ref, "--labels", "a,b,c"], capsys)[0] == 2
    code, _, err = run([ref], capsys)
    assert code == 2 and "at least two runs" in err


@pytest.mark.slow  # a process
def test_script_runs_as_a_command_and_exits_with_the_comparison_status(tmp_path):
    ref = write_log(tmp_path / "ref.log")
    diverging = write_log(tmp_path / "diverging.log", shift_from=2, shift=0.5)
    done = subprocess.run([sys.executable, str(SCRIPT), str(ref), str(diverging)], capture_output=True, text=True)
    assert done.returncode == 1
    assert "first difference at iteration 2" in done.stdout


def _tensorboard_available() -> bool:
    try:
        import tensorboard  # noqa: F401
        from torch.utils.tensorboard import SummaryWriter  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.skipif(not _tensorboard_available(), reason="tensorboard is not installed")
def test_tensorboard_events_compare_with_a_log(tmp_path, capsys):
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(log_dir=str(tmp_path / "tb"))
    for i in range(1, ITERATIONS + 1):
        writer.add_scalar("lm loss", float(f"{loss_at(i):.6E}"), i)
    writer.close()
    curve = clc.load_curve(str(tmp_path / "tb"), "lm loss", "tb")
    assert sorted(curve.values) == list(range(1, ITERATIONS + 1))
    log = write_log(tmp_path / "ref.log")
    code, out, _ = run([log, tmp_path / "tb", "--rtol", "1e-6"], capsys)  # events hold float32
    assert code == 0, out


@pytest.mark.skipif(_tensorboard_available(), reason="tensorboard is installed: events are readable")
def test_tensorboard_directory_without_tensorboard_is_refused_with_one_line(tmp_path, capsys):
    ref = write_log(tmp_path / "ref.log")
    (tmp_path / "tb").mkdir()
    code, _, err = run([ref, tmp_path / "tb"], capsys)
    assert code == 2 and err.count("\n") == 1
    assert "needs the 'tensorboard' package" in err
