"""Each schedule on full-size models, as `zb-schedule advise` plans and counts it: its time against 1F1B's and its
peak bytes per GPU against 1F1B's, with the goals of plans for real models checked (met / MISSED).

The command lines are the examples' full-size ones (tests/advise_lines.py: Llama-3 8B from Megatron-LM's FP8 example,
GPT-3 175B, a Mixtral-like MoE) with the layouts the figures are quoted for: Llama-3 8B at TP2 PP4, GPT-3 175B at TP8
PP16, Mixtral-like at EP8 PP4, and a Llama-3 70B line built from the 8B one (80 layers, hidden 8192, FFN 28672, 64
heads in 8 groups) at TP8 PP8. Costs are advise's estimates (per-layer FLOP formulas, memory counted tensor by
tensor), not measurements; nothing here ran on a GPU.

    python benchmarks/real_model_plans.py [--lines llama3-8b,...]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.advise_lines import full_line  # noqa: E402

PEAK_SLACK = 1.02  # "within 2% of 1F1B's peak bytes per GPU"
V_MIN_SLACK = 1.10


def _set(words: list[str], flag: str, value: str) -> None:
    if flag in words:
        words[words.index(flag) + 1] = value
    else:
        words += [flag, value]


def lines() -> dict[str, tuple[list[str], list[str]]]:
    out = {}
    options, words = full_line("llama3-8b")
    _set(words, "--tensor-model-parallel-size", "2")
    _set(words, "--pipeline-model-parallel-size", "4")
    out["Llama-3 8B, TP2 PP4"] = (options, words)
    options, words = full_line("llama3-8b")
    for flag, value in (("--num-layers", "80"), ("--hidden-size", "8192"), ("--ffn-hidden-size", "28672"),
                        ("--num-attention-heads", "64"), ("--tensor-model-parallel-size", "8"),
                        ("--pipeline-model-parallel-size", "8")):
        _set(words, flag, value)
    out["Llama-3 70B, TP8 PP8"] = (["--world-size", "64"], words)
    out["GPT-3 175B, TP8 PP16"] = full_line("gpt3-175b")
    out["Mixtral-like, EP8 PP4"] = full_line("mixtral-8x7b")
    return out


def advise(options: list[str], words: list[str]) -> tuple[dict[str, dict], list[str]]:
    """advise's rows by label, and its lines on the rows that miss their aims."""
    done = subprocess.run([sys.executable, "-m", "megatron.zero_bubble.cli", "advise", *options, "--json", "--",
                           *words], capture_output=True, text=True, cwd=ROOT)
    if done.returncode != 0:
        raise SystemExit(done.stderr.strip() or done.stdout.strip())
    result = json.loads(done.stdout)
    return {row["label"]: row for row in result["schedules"]}, result["missed_aims"]


def goals(rows: dict[str, dict]) -> list[tuple[bool, str]]:
    base = rows["1f1b"]
    time = {label: row["makespan"] / base["makespan"] for label, row in rows.items()}
    peak = {label: row["peak_bytes"] / base["peak_bytes"] for label, row in rows.items()}
    out = []
    one_x, two_x = "zb-auto (1x 1F1B memory)", "zb-auto (2x 1F1B memory)"
    if one_x in rows:
        out.append((time[one_x] <= 1.0 + 1e-9 and peak[one_x] <= PEAK_SLACK,
                    f"zb-auto at 1x: {time[one_x]:.3f} of 1F1B's time at {peak[one_x]:.3f} of its peak"))
    if two_x in rows:
        fitting = [label for label in ("1f1b", "zb-h1", "zb-h2")
                   if label in rows and rows[label]["peak_bytes"] <= rows[two_x]["peak_bytes"]]
        fastest = min(time[label] for label in fitting)
        out.append((time[two_x] <= fastest + 1e-9,
                    f"zb-auto at 2x: {time[two_x]:.3f}, the fastest of {', '.join(fitting)} within its peak "
                    f"{fastest:.3f}"))
    for label, limit, what in (("zb-v (V-Half memory)", 1.0, "no slower than 1F1B"),
                               ("zb-v (V-Min memory)", V_MIN_SLACK, "within 10% of 1F1B")):
        if label in rows:
            out.append((time[label] <= limit + 1e-9, f"{label}: {time[label]:.3f} of 1F1B's time ({what})"))
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lines", help="comma-separated substrings of the line names (default: all four)")
    args = parser.parse_args(argv)
    chosen = {name: line for name, line in lines().items()
              if args.lines is None or any(part.lower() in name.lower() for part in args.lines.split(","))}
    for name, (options, words) in chosen.items():
        rows, missed = advise(options, words)
        base = rows["1f1b"]
        print(f"\n{name}")
        print("| schedule | time / 1F1B | peak per GPU / 1F1B's | peak per GPU |")
        print("|---|---|---|---|")
        for label, row in rows.items():
            print(f"| {label} | {row['makespan'] / base['makespan']:.3f} | {row['peak_bytes'] / base['peak_bytes']:.3f} "
                  f"| {row['peak_bytes'] / 2**30:.1f} GiB |")
        for met, line in goals(rows):
            print(f"  [{'met' if met else 'MISSED'}] {line}")
        for line in missed:
            print(f"  advise: {line}")


if __name__ == "__main__":
    main()
