"""One command for a GPU node (`bash scripts/gpu_check.sh`): does zero bubble work here, and how well?

It reports the versions it found (torch, CUDA, NCCL, megatron-core, Transformer Engine, apex) and six parts:
(a) the split into B and W gives megatron's gradients bit for bit: one GPT layer of each of the paper's shapes, local
    and Transformer Engine layers (benchmarks/split_layer.py), and the start-up split check of every zero-bubble run
    of (b) on the whole model;
(b) zb-h1, zb-auto (one and two chunks per rank) and zb-v against a reference: the same loss at every iteration
    (pretrain_gpt.py under torchrun, a small GPT, `--iterations` iterations, deterministic kernels, clipping off).
    With two GPUs or more: PP = every GPU, against megatron's 1F1B. With one (or `--one-gpu`): two pipeline ranks
    share the GPU (--zero-bubble-share-gpus: compute, the split, the stores, the optimizer and memory on CUDA,
    messages over gloo through host memory), against megatron on one rank of the same GPU (PP=1; untied embeddings,
    whose gradient PP=1 sums in another order);
(c) the split's overhead (T_B + T_W) / T_BW on the paper's 1.5B / 6.2B / 14.6B / 28.3B layer shapes, fused and split
    interleaved, min / median / max;
(d) the executor's own time per pass with CUDA compute: the median gap before a W pass (which waits for no message)
    in the measured timeline of the zb-h1 run;
(e) each rank's peak activation memory (max allocated minus allocated after the iteration, from megatron's memory
    report) against the planner's predicted peak for the zb-auto run;
(f) the launch queue: with CUDA_DEVICE_MAX_CONNECTIONS=1 (megatron's setting with TP > 1 before Blackwell) and 32, in a
    fresh process each, does a short kernel on one stream wait behind a kernel that cannot start yet on another
    (tools/launch_queue.py)? A fact about the GPU and its driver: reported, never part of the exit status; a result
    against the rule is said in a line of its own.
Exit status 0 only when (a) and (b) hold. It prints a table to paste into a bug report and keeps every log in `--out`.
`--jobs N` runs N launches of (b) at a time (they share the GPUs: then (d) and (e) are measured beside the others).

Without CUDA it says so in one line and exits 2; `--cpu` runs every part on CPU with tiny sizes and gloo (for the
tests of this tool: (c) and (e) mean nothing there, and (f) runs a labelled stand-in that measures nothing);
`--cpu --one-gpu` rehearses the one-GPU mode.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import importlib.metadata
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from . import launch_queue
from .local_ranks import TORCHRUN_ONE_MACHINE

ROOT = Path(__file__).resolve().parents[3]
EXIT_NO_CUDA = 2
SCHEDULES = (("zb-h1", ["--pipeline-schedule", "zb-h1"]), ("zb-auto", ["--enable-zero-bubble"]),
             ("zb-auto-2chunks", ["--enable-zero-bubble", "--num-virtual-stages-per-pipeline-rank", "2"]),
             ("zb-v", ["--zero-bubble-v-schedule"]))
ILP_SCHEDULES = ("zb-auto", "zb-auto-2chunks")  # the others have no ILP and refuse --zero-bubble-ilp-time-limit
ONE_GPU_RANKS = 2  # pipeline ranks sharing the GPU in the one-GPU mode
LAUNCH_QUEUE_CONNECTIONS = (1, 32)  # megatron's setting with TP > 1 before Blackwell, and CUDA's most
LAUNCH_QUEUE_REPS = 10
LOSS = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?lm loss: ([0-9.E+-]+)")
MEMORY = re.compile(r"\[Rank (\d+)\] \(after \d+ iterations\) memory \(MB\) \| allocated: ([0-9.]+) \| "
                    r"max allocated: ([0-9.]+)")
SPLIT_CHECK = "zero-bubble: split check"


@dataclass
class Sizes:
    """The model and launch of (b): small enough for seconds per iteration, PP = the GPUs given."""

    gpus: int  # pipeline ranks (PP)
    iterations: int
    shared: bool = False  # the ranks share one GPU (on CPU: rehearse that mode); the reference is PP=1
    cpu: bool = False
    hidden: int = 512
    heads: int = 8
    seq: int = 512
    micro_batch: int = 2
    vocab: int = 4096

    @property
    def layers(self) -> int:
        return 4 * self.gpus  # a multiple of 2p (ZB-V, 2 chunks per rank), two per virtual stage

    @property
    def global_batch(self) -> int:
        return self.micro_batch * 4 * self.gpus  # m = 4p microbatches: a multiple of p, as interleaving needs

    @property
    def reference(self) -> str:
        return "pp1" if self.shared else "1f1b"


@dataclass
class Report:
    versions: dict = field(default_factory=dict)
    rows: list = field(default_factory=list)  # (part, what, result, holds: True/False/None)

    def add(self, part: str, what: str, result: str, holds: bool | None) -> None:
        self.rows.append((part, what, result, holds))

    def holds(self, part: str) -> bool:
        verdicts = [h for p, _, _, h in self.rows if p == part and h is not None]
        return bool(verdicts) and all(verdicts)

    def table(self) -> str:
        lines = ["| part | what | result | holds |", "|---|---|---|---|"]
        lines += [f"| {p} | {w} | {r} | {'-' if h is None else 'yes' if h else 'NO'} |" for p, w, r, h in self.rows]
        versions = ", ".join(f"{name} {value}" for name, value in self.versions.items())
        return f"versions: {versions}\n" + "\n".join(lines)


# -- versions ----------------------------------------------------------------------------------------------
def versions() -> dict:
    import torch

    from ..patches.te_wgrad import installed_version

    found = {"python": sys.version.split()[0], "torch": torch.__version__,
             "CUDA": torch.version.cuda or "none",
             "NCCL": ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else "none",
             "GPUs": f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}" if torch.cuda.is_available()
             else "0"}
    for label, name in (("megatron-core", "megatron-core"), ("apex", "apex"), ("megatron-zero-bubble",
                                                                                  "megatron-zero-bubble")):
        try:
            found[label] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[label] = "not installed"
    found["transformer-engine"] = installed_version() or "not installed"
    return dict(sorted(found.items(), key=lambda kv: list(found).index(kv[0])))


def transformer_engine_refusal(version: str) -> str | None:
    """Why the Transformer Engine layers are not checked (`version` as versions() gives it), None if they are: not
    installed, or a version the split refuses (then pretrain_gpt.py would stop at start-up)."""
    from ..patches.te_wgrad import version_refusal

    if version == "not installed":
        return "transformer-engine is not installed"
    return version_refusal(version, fused_accumulation=True)  # megatron's default: --gradient-accumulation-fusion


# -- parsing what the launches print -----------------------------------------------------------------------
def losses(stdout: str) -> dict[int, str]:
    """{iteration: lm loss as megatron printed it} of one pretrain_gpt.py run."""
    return {int(i): value for i, value in LOSS.findall(stdout)}


def split_check_line(output: str) -> str | None:
    return next((line.split("error: ", 1)[-1] for line in output.splitlines() if SPLIT_CHECK in line), None)


def memory_peaks(stdout: str) -> dict[int, float]:
    """{global rank: max allocated - allocated, MiB} from megatron's memory report (CUDA only)."""
    return {int(rank): float(peak) - float(now) for rank, now, peak in MEMORY.findall(stdout)}


def executor_gaps_us(trace_path: str) -> list[float]:
    """Gaps (µs) before each W pass after another pass on the same rank, in a measured Chrome trace (schedules/trace.py):
    the runtime's own time between passes, since a W waits for no message."""
    events = json.load(open(trace_path))
    events = events["traceEvents"] if isinstance(events, dict) else events
    by_rank: dict = {}
    for event in events:
        if event.get("ph") == "X":
            by_rank.setdefault(event.get("tid", event.get("pid")), []).append(event)
    gaps = []
    for passes in by_rank.values():
        passes.sort(key=lambda e: e["ts"])
        for before, after in zip(passes, passes[1:]):
            if after.get("name", "").startswith("W"):
                gaps.append(after["ts"] - (before["ts"] + before.get("dur", 0.0)))
    return gaps


# -- launches ----------------------------------------------------------------------------------------------
def _run(command: list[str], log: Path, env: dict | None = None, timeout: float = 3600) -> subprocess.CompletedProcess:
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    log.write_text(f"$ {' '.join(command)}\n--- stdout\n{done.stdout}\n--- stderr\n{done.stderr}")
    return done


def _env(cpu: bool) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    env.update(NVTE_ALLOW_NONDETERMINISTIC_ALGO="0", CUBLAS_WORKSPACE_CONFIG=":4096:8")  # (b) compares losses exactly
    if cpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def pretrain_runs(sizes: Sizes, out: Path, cpu: bool, te: bool, schedules: list[str],
                  jobs: int = 1) -> dict[str, subprocess.CompletedProcess]:
    """(b): the reference (megatron's 1F1B at PP = `sizes.gpus`, or megatron on one rank) and `schedules` (of
    SCHEDULES) through pretrain_gpt.py, `jobs` launches at a time."""
    model = (f"--num-layers {sizes.layers} --hidden-size {sizes.hidden} --num-attention-heads {sizes.heads} "
             f"--seq-length {sizes.seq} --max-position-embeddings {sizes.seq} --micro-batch-size {sizes.micro_batch} "
             f"--global-batch-size {sizes.global_batch} --vocab-size {sizes.vocab} --tokenizer-type NullTokenizer "
             f"--mock-data --num-workers 0 --train-iters {sizes.iterations} --lr 1e-4 --eval-iters 0 "
             f"--eval-interval {sizes.iterations + 1} --log-interval 1 --seed 1234 --init-weights-by-global-name "
             f"--hidden-dropout 0 --attention-dropout 0 --clip-grad 0").split()
    if cpu:  # the rehearsal of the lent GPU, which has no Transformer Engine: megatron's local layers
        model += ["--zero-bubble-cpu", "--transformer-impl", "local"]
    else:
        model += ["--bf16", "--deterministic-mode", "--transformer-impl", "transformer_engine" if te else "local"]
        if not te:  # apex's kernels, which megatron's local layers ask for by default
            model += ["--no-gradient-accumulation-fusion", "--no-persist-layer-norm", "--no-masked-softmax-fusion"]
    if sizes.shared:
        model += ["--untie-embeddings-and-output-weights"]
    pipeline = ["--pipeline-model-parallel-size", str(sizes.gpus)]
    if sizes.shared and not cpu:
        pipeline += ["--zero-bubble-share-gpus", "--distributed-backend", "gloo"]
    start = min(5, sizes.iterations // 2)  # profiled after a warm-up, re-planned (and the timeline dumped) before the end
    end = start + max(1, min(3, sizes.iterations - start - 1))
    timers = ["--zero-bubble-pipeline-timers-start-iter", str(start), "--zero-bubble-pipeline-timers-end-iter", str(end)]
    ilp = ["--zero-bubble-ilp-time-limit", "5"]
    launches = {sizes.reference: (1, model) if sizes.shared else (sizes.gpus, model + pipeline)}
    for name, flags in SCHEDULES:
        if name in schedules:
            launches[name] = (sizes.gpus, model + pipeline + flags + timers + (ilp if name in ILP_SCHEDULES else []) +
                              ["--zero-bubble-dump-schedule", str(out / f"dump-{name}")])

    def launch(name: str) -> subprocess.CompletedProcess:
        ranks, flags = launches[name]
        command = [sys.executable, "-m", "torch.distributed.run", *TORCHRUN_ONE_MACHINE, "--nproc-per-node",
                   str(ranks), "pretrain_gpt.py", *flags]
        return _run(command, out / f"pretrain-{name}.log", _env(cpu))

    with concurrent.futures.ThreadPoolExecutor(max(1, jobs)) as pool:
        return dict(zip(launches, pool.map(launch, launches)))


def split_layer_run(out: Path, cpu: bool, te: bool, reps: int) -> list[dict]:
    """(a) and (c): benchmarks/split_layer.py; [] with its log when it could not run."""
    results = out / "split_layer.json"
    command = [sys.executable, "benchmarks/split_layer.py", "--device", "cpu" if cpu else "cuda", "--reps", str(reps),
               "--impl", "local,transformer_engine" if te else "local", "--shapes", "tiny" if cpu else "paper",
               "--json", str(results)]
    _run(command, out / "split_layer.log", _env(cpu))
    return json.loads(results.read_text()) if results.exists() else []


def launch_queue_runs(out: Path, cpu: bool) -> dict[int, dict | None]:
    """(f): tools/launch_queue.py in a fresh process per CUDA_DEVICE_MAX_CONNECTIONS setting (CUDA reads it when it
    initialises), on CPU its labelled stand-in; {connections: the child's result, None when it printed none}."""
    results = {}
    for connections in LAUNCH_QUEUE_CONNECTIONS:
        env = dict(_env(cpu), **{launch_queue.CONNECTIONS_VARIABLE: str(connections)})
        command = [sys.executable, "-m", "megatron.zero_bubble.tools.launch_queue", "--reps", str(LAUNCH_QUEUE_REPS)]
        done = _run(command + (["--cpu-stand-in"] if cpu else []), out / f"launch-queue-{connections}.log", env,
                    timeout=300)
        results[connections] = launch_queue.read_result(done.stdout) if done.returncode == 0 else None
    return results


# -- the checks --------------------------------------------------------------------------------------------
def check_layers(report: Report, layers: list[dict]) -> None:
    if not layers:
        report.add("a", "one GPT layer per shape, fused vs B+W", "did not run (see split_layer.log)", False)
    for r in layers:
        same = "bit-identical" if r["bit_identical"] else f"differs first in {r['first_difference'][0]}"
        report.add("a", f"{r['impl']} layer {r['shape']} (h {r['hidden']}, micro batch {r['micro_batch']})",
                   f"{same} ({r['deferred']} weights deferred)", r["bit_identical"])
        fused, split = r["fused_ms"], r["split_ms"]
        report.add("c", f"{r['impl']} layer {r['shape']}: (T_B + T_W) / T_BW",
                   f"{r['ratio']:.3f} (T_BW {_spread_text(fused)} ms, T_B+T_W {_spread_text(split)} ms)", None)


def check_losses(report: Report, runs: dict, sizes: Sizes) -> None:
    reference = runs[sizes.reference]
    want = losses(reference.stdout)
    against = "megatron on one rank (PP=1)" if sizes.shared else "1F1B"
    if reference.returncode != 0 or len(want) < sizes.iterations:
        what = "megatron, PP=1" if sizes.shared else f"megatron 1F1B, PP={sizes.gpus}"
        report.add("b", f"{what}, {sizes.iterations} iterations",
                   f"failed (exit {reference.returncode}; see pretrain-{sizes.reference}.log)", False)
        return
    layout = f"PP={sizes.gpus}" + (" sharing one GPU" if sizes.shared and not sizes.cpu else "")
    for name, done in runs.items():
        if name == sizes.reference:
            continue
        got = losses(done.stdout)
        line = split_check_line(done.stdout + done.stderr)
        report.add("a", f"{name} start-up split check on the whole model", line or "no split check line", bool(
            line and ": passed" in line))
        if done.returncode != 0:
            report.add("b", f"{name} vs {against}", f"failed (exit {done.returncode}; see pretrain-{name}.log)", False)
            continue
        differing = [i for i in want if got.get(i) != want[i]]
        result = (f"identical losses at all {len(want)} iterations" if not differing else
                  f"differs from iteration {differing[0]} ({got.get(differing[0])} vs {want[differing[0]]})")
        report.add("b", f"{name}, {layout}, vs {against}", result, not differing)


def check_executor(report: Report, out: Path, schedule: str | None) -> None:
    if schedule is None:
        return
    traces = sorted((out / f"dump-{schedule}").glob("*measured*.trace.json"))
    gaps = executor_gaps_us(str(traces[-1])) if traces else []
    report.add("d", f"executor time before a W pass ({schedule}, measured timeline)",
               f"{_spread_text(gaps)} µs over {len(gaps)} passes" if gaps else "no measured timeline", None)


def check_memory(report: Report, runs: dict, out: Path, cpu: bool) -> None:
    if cpu or "zb-auto" not in runs:
        report.add("e", "peak activation memory vs the planner's", "not measured (needs CUDA and the zb-auto run)", None)
        return
    measured = memory_peaks(runs["zb-auto"].stdout)
    plans = sorted((out / "dump-zb-auto").glob("zb-auto-m*-initial.json"))  # the plan iterations 1-2 ran
    predicted = json.loads(plans[-1].read_text()).get("predicted", {}).get("peak_memory", []) if plans else []
    for rank, peak in sorted(measured.items()):
        plan = predicted[rank] / 2**20 if rank < len(predicted) else None
        text = f"{peak:.0f} MiB measured" + (f", {plan:.0f} MiB predicted ({peak / plan:.2f}x)" if plan else "")
        report.add("e", f"zb-auto rank {rank}", text, None)
    if not measured:
        report.add("e", "zb-auto peak activation memory", "no memory report in the log", None)


def check_launch_queue(report: Report, results: dict[int, dict | None]) -> None:
    """(f): one row per CUDA_DEVICE_MAX_CONNECTIONS setting and one with the finding; reported, not judged (a fact
    about the GPU and its driver, not about this package)."""
    for connections, result in results.items():
        what = (f"launch queue, {launch_queue.CONNECTIONS_VARIABLE}={connections}: a short kernel on stream B "
                "launched after a sleep and a second kernel on stream A")
        if result is None:
            report.add("f", what, f"did not run (see launch-queue-{connections}.log)", None)
            continue
        if result["stand_in"]:
            what += f", on a {launch_queue.STAND_IN_LABEL}"
        waits = launch_queue.waited(result)
        report.add("f", what, f"B's launch to its end {_spread_text(launch_queue.launch_to_end_ms(result), 3)} ms "
                   f"(its own start to end {_spread_text(result['b_ms'], 3)} ms; A's sleep and kernel "
                   f"{_spread_text(result['a_ms'])} ms): B waited behind A's second kernel in {sum(waits)} of "
                   f"{len(waits)}", None)
    report.add("f", "finding: does a kernel that cannot start hold back launches on other streams?",
               launch_queue_finding(results), None)


def launch_queue_finding(results: dict[int, dict | None]) -> str:
    """What (f) found, in words: the expected wait with one connection and none with 32, or what differs."""
    one, many = (results.get(connections) for connections in LAUNCH_QUEUE_CONNECTIONS)
    if one is None or many is None:
        return "not measured: a child process printed no result"
    unseen = [(c, r["connections"]) for c, r in results.items() if r["connections"] != str(c)]
    if unseen:
        asked, saw = unseen[0]
        return f"not measured: the child for {asked} connections saw {launch_queue.CONNECTIONS_VARIABLE}={saw}"
    if one["stand_in"]:
        return ("not measured: needs CUDA (the CPU stand-in ran the child processes and the reading of their results; "
                "threads have no launch queue)")
    if launch_queue_contradicts(results):
        return (f"CONTRADICTS the launch-queue rule (docs/gpu-check.md, part (f)): with {LAUNCH_QUEUE_CONNECTIONS[0]} "
                "connection B did not wait behind A's second kernel; either this driver does not honour the variable "
                "or the rule does not hold on this GPU")
    also = (f"; with {LAUNCH_QUEUE_CONNECTIONS[1]} it waited too (A and B landed in one queue: more connections make "
            "the blocking intermittent, not gone)" if _mostly(launch_queue.waited(many))
            else f", with {LAUNCH_QUEUE_CONNECTIONS[1]} it did not")
    return (f"with {LAUNCH_QUEUE_CONNECTIONS[0]} connection B waited behind A's second kernel{also}: under megatron's "
            f"{launch_queue.CONNECTIONS_VARIABLE}=1 (asserted with TP > 1 before Blackwell) a kernel that cannot start "
            "holds back every later launch on every stream")


def launch_queue_contradicts(results: dict[int, dict | None]) -> bool:
    """Did a GPU measurement find no wait with one connection, against the rule megatron's setting rests on?"""
    one = results.get(LAUNCH_QUEUE_CONNECTIONS[0])
    return bool(one) and not one["stand_in"] and one["connections"] == str(LAUNCH_QUEUE_CONNECTIONS[0]) and not \
        _mostly(launch_queue.waited(one))


def _mostly(flags: list[bool]) -> bool:
    return sum(flags) > len(flags) / 2


def _spread_text(values: list[float], digits: int = 1) -> str:
    """min / median / max."""
    if not values:
        return "-"
    return " / ".join(f"{v:.{digits}f}" for v in (min(values), statistics.median(values), max(values)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gpu_check.sh", description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpus", type=int, default=None, help="GPUs to use (default: all, at most 8)")
    parser.add_argument("--one-gpu", action="store_true",
                        help=f"{ONE_GPU_RANKS} pipeline ranks share one GPU, against PP=1 (the default with one GPU)")
    parser.add_argument("--iterations", type=int, default=20, help="iterations of (b) (default %(default)s)")
    parser.add_argument("--reps", type=int, default=5, help="repetitions of (c) (default %(default)s)")
    parser.add_argument("--schedules", default=",".join(name for name, _ in SCHEDULES),
                        help="zero-bubble schedules compared with the reference in (b) (default %(default)s)")
    parser.add_argument("--jobs", type=int, default=1, help="launches of (b) at a time (default %(default)s)")
    parser.add_argument("--out", default=None, help="directory for the logs (default: a new temporary one)")
    parser.add_argument("--cpu", action="store_true", help="run every part on CPU, tiny sizes (tests this tool)")
    args = parser.parse_args(argv)
    import torch

    if not args.cpu and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here (torch.cuda.is_available() is False); run it on a GPU node "
              "(--cpu runs its parts on CPU to test the tool)", file=sys.stderr)
        return EXIT_NO_CUDA
    out = Path(args.out or tempfile.mkdtemp(prefix="zb_gpu_check_"))
    out.mkdir(parents=True, exist_ok=True)
    queue_results = launch_queue_runs(out, args.cpu)  # (f) first: on an idle GPU, its logs written before (b) starts
    report = Report(versions())
    te_refused = transformer_engine_refusal(report.versions["transformer-engine"])
    te = not args.cpu and te_refused is None
    if not args.cpu and not te:
        report.add("a", "Transformer Engine layers", f"not checked: {te_refused}", None)
    check_layers(report, split_layer_run(out, args.cpu, te, args.reps))
    gpus = args.gpus or (2 if args.cpu else min(torch.cuda.device_count(), 8))
    shared = args.one_gpu or gpus == 1
    sizes = Sizes(ONE_GPU_RANKS if shared else gpus, args.iterations, shared=shared, cpu=args.cpu)
    if args.cpu:
        sizes = dataclasses.replace(sizes, hidden=64, heads=4, seq=32, vocab=128)
    runs = pretrain_runs(sizes, out, args.cpu, te, args.schedules.split(","), args.jobs)
    check_losses(report, runs, sizes)
    check_executor(report, out, next((name for name in runs if name != sizes.reference), None))
    check_memory(report, runs, out, args.cpu)
    check_launch_queue(report, queue_results)
    print(report.table())
    print(f"logs: {out}")
    if launch_queue_contradicts(queue_results):  # a fact about this GPU, not a failure of this package: no exit status
        print("gpu_check: (f) contradicts the launch-queue rule (one connection, and B did not wait): see its rows")
    ok = report.holds("a") and report.holds("b")
    print(f"gpu_check: {'(a) and (b) hold' if ok else 'FAILED: see the rows marked NO'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
