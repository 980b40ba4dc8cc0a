"""Launches for tests/megatron/test_pretrain_gpt.py (and test_pretrain_hybrid.py): many runs of an entry script
(pretrain_gpt.py, pretrain_hybrid.py) in one torchrun, and the refusals.

Parent side (imports nothing of megatron):
    start_driver(runs, work, nproc, timeout) -> Background   one torchrun of this file in driver mode
    driver_results(launch, labels, work) -> Runs               each run's combined output and whether it finished
    start_refusals(cases, work, timeout) -> Background         the start-up checks of every case in one process
    Background(name, command, work, timeout[, env])            a command read later (stdout, stderr in files)
    torchrun_command(nproc, args), launch_environment(), free_port()
Rank side, as a script:
    python -m torch.distributed.run --nproc-per-node 4 pretrain_driver.py drive PLAN.json
        imports the plan's entry script (pretrain_gpt.py by default) once and calls its `main()` per run (command line in sys.argv, megatron's global
        state destroyed in between, as its in-process restart does), each rank's output in a file per run. A run
        that raises on any rank fails on every rank (they agree after each run) and the next run starts.
    python pretrain_driver.py refusals CASES.json
        the one-line refusal of the start-up checks for each case (flags, world size), how the early parser
        declares megatron's flags against megatron's parser, the `--help` text, and how a bare assert of
        megatron's argument validation stops the start-up.
"""
from __future__ import annotations

import contextlib
import datetime
import gc
import io
import json
import os
import shutil
import subprocess
import sys
import time
import traceback
from collections.abc import Mapping

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
THREADS_LINE = "zero-bubble test driver: threads after the run: "
PEAK_THREADS_LINE = "zero-bubble test driver: most threads during the run: "
SECONDS_LINE = "zero-bubble test driver: seconds the run took: "
STATUS_LINE = "zero-bubble test driver: run "  # + "finished" | "failed on this rank" | "failed on another rank"
FINISHED = "finished"
TAIL_CHARS = 4000
TRACEBACK = "Traceback (most recent call last)"


# ---------------------------------------------------------------- parent side


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch_environment() -> dict:
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return env


def torchrun_command(nproc: int, args: list[str]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port",
            str(free_port()), *args]


# A launch read later runs under SCHED_IDLE (it and every process it starts): it takes the cores the tests in the
# foreground leave idle (ranks waiting on each other, a test on one core) instead of slowing them down, and has them
# to itself once they are done. Neither waits for the other, so the suite ends sooner (`nice -n 10` gained about half
# as much: a waking rank of the foreground still waited behind a niced one). The processes that lead sessions of
# their own (torchrun's ranks) also lower their autogroup's weight (background_site/sitecustomize.py).
IDLE_PRIORITY = ["chrt", "--idle", "0"] if shutil.which("chrt") else []
BACKGROUND_SITE = os.path.join(REPO, "tests", "background_site")


class Background:
    """A command started now and read later, its stdout and stderr in files (a pipe left unread would block it), at
    the lowest priority (IDLE_PRIORITY)."""

    def __init__(self, name: str, command: list[str], work: str, timeout: float, env: dict | None = None):
        self.command, self.timeout, self.started = command, timeout, time.monotonic()
        self.paths = [os.path.join(work, f"{name}.{stream}") for stream in ("stdout", "stderr")]
        with open(self.paths[0], "w") as out, open(self.paths[1], "w") as err:
            environment = launch_environment() | (env or {})
            environment["PYTHONPATH"] = BACKGROUND_SITE + os.pathsep + environment["PYTHONPATH"]
            self.process = subprocess.Popen([*IDLE_PRIORITY, *command], cwd=REPO, env=environment, stdout=out,
                                            stderr=err)

    def result(self) -> subprocess.CompletedProcess:
        """The finished command; one still running at its deadline is killed (return code None)."""
        try:
            returncode = self.process.wait(timeout=max(1.0, self.started + self.timeout - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.stop()
            returncode = None
        stdout, stderr = (open(path).read() for path in self.paths)
        return subprocess.CompletedProcess(self.command, returncode, stdout, stderr)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


def start_driver(runs: dict[str, list[str]], work: str, nproc: int, timeout: float, script: str = "pretrain_gpt",
                 name: str = "driver") -> Background:
    """One torchrun of `nproc` ranks that runs the entry script `script` (pretrain_gpt, pretrain_hybrid) with each
    command line of `runs` in turn; `name` names its plan and output files in `work`."""
    plan = os.path.join(work, f"{name}.json")
    with open(plan, "w") as f:
        json.dump({"runs": runs, "out": work, "script": script}, f)
    return Background(name, torchrun_command(nproc, [os.path.abspath(__file__), "drive", plan]), work, timeout)


def start_refusals(cases: dict[str, tuple[list[str], int]], work: str, timeout: float) -> Background:
    path = os.path.join(work, "cases.json")
    with open(path, "w") as f:
        json.dump(cases, f)
    return Background("refusals", [sys.executable, os.path.abspath(__file__), "refusals", path], work, timeout)


class RunFailed(AssertionError):
    """A run of the driver that did not finish on every rank (its test fails with the run's output)."""


class Runs(Mapping):
    """label -> the combined output of every rank of a run that finished; reading a run that did not finish
    raises RunFailed with what is known of it (its own output's tail, or the driver's)."""

    def __init__(self, logs: dict[str, str], problems: dict[str, str]):
        self._logs, self._problems = logs, problems

    def __getitem__(self, label: str) -> str:
        if label in self._problems:
            raise RunFailed(f"run {label!r} {self._problems[label]}")
        return self._logs[label]

    def __iter__(self):
        return iter(self._logs)

    def __len__(self) -> int:
        return len(self._logs)

    def finished(self) -> dict[str, str]:
        return {label: log for label, log in self._logs.items() if label not in self._problems}


def driver_results(launch: Background, labels: list[str], work: str, nproc: int) -> Runs:
    """Wait for the driver; each run's output, and for each run that did not finish on every rank, why."""
    done = launch.result()
    ended = "timed out" if done.returncode is None else f"exited with {done.returncode}"
    driver_tail = f"torchrun {ended}:\n{done.stdout[-TAIL_CHARS // 2:]}\n{done.stderr[-TAIL_CHARS:]}"
    logs, problems, stopped = {}, {}, None
    for label in labels:
        paths = [os.path.join(work, log_name(label, rank)) for rank in range(nproc)]
        ranks = [open(path).read() if os.path.exists(path) else "" for path in paths]
        logs[label] = "\n".join(ranks)
        statuses = [line[len(STATUS_LINE):] for line in logs[label].splitlines() if line.startswith(STATUS_LINE)]
        if stopped is not None:
            problems[label] = f"did not run: the driver stopped during run {stopped!r}"
        elif len(statuses) < nproc:
            stopped = label
            problems[label] = f"did not finish ({len(statuses)} of {nproc} ranks ended it); {driver_tail}\n" \
                              f"its output:\n{logs[label][-TAIL_CHARS:]}"
        elif any(status != FINISHED for status in statuses):
            problems[label] = f"failed:\n{_failure_report(ranks)}"
    return Runs(logs, problems)


def _failure_report(ranks: list[str]) -> str:
    """Each rank's error (the last line of its traceback), then the first traceback in full."""
    errors = [f"rank {rank}: {_error_line(log)}" for rank, log in enumerate(ranks) if TRACEBACK in log]
    first = next(log for log in ranks if TRACEBACK in log)
    start = first.index(TRACEBACK)
    return "\n".join(errors) + "\n" + first[start:start + TAIL_CHARS]


def _error_line(log: str) -> str:
    """The exception line that ends the first traceback of `log`."""
    lines = log[log.index(TRACEBACK):].splitlines()[1:]
    return next((line for line in lines if line and not line.startswith((" ", TRACEBACK))), "?")


def log_name(label: str, rank: int) -> str:
    return f"{label.replace('/', '_')}.rank{rank}.log"


# ---------------------------------------------------------------- rank side (under torchrun)


def drive(plan_path: str) -> None:
    """Run the plan's entry script's main() once per run of the plan, each rank's output in its own file per run."""
    sys.path.insert(0, REPO)
    import importlib

    plan = json.load(open(plan_path))
    script = plan.get("script", "pretrain_gpt")
    entry = importlib.import_module(script)  # installs the import shims and the CPU backend at import
    import torch

    from tests.megatron import harness, process_groups

    with process_groups.rank_groups():  # the peak during a run counts, not only what is left after it
        # WORLD before the first run (megatron keeps an initialised one), so ranks can agree on every run's end
        torch.distributed.init_process_group(harness.rank_device().backend, timeout=datetime.timedelta(minutes=10))
        # What is alive now lives as long as the rank: out of the collector's reach, so that the collections of each
        # run (megatron's, the teardown's) scan only what runs made (a run takes half the time)
        gc.freeze()
        rank = int(os.environ["RANK"])
        for label, flags in plan["runs"].items():
            with open(os.path.join(plan["out"], log_name(label, rank)), "w") as out, \
                    contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
                _drive_one(label, flags, entry.main, f"{script}.py")
        torch.distributed.destroy_process_group()


def _drive_one(label: str, flags: list[str], main, script: str = "pretrain_gpt.py") -> None:
    """One run on this rank, its output already redirected; then the lines the parent reads."""
    import torch
    from megatron.training.training import destroy_global_state

    from tests.megatron import process_groups

    process_groups.now_running(label, reset_peak=True)
    sys.argv = [script, *flags]
    started = time.monotonic()
    finished = _run(main)
    if not finished:  # its groups go first: a peer waiting on this rank in one of them fails too
        _tear_down(destroy_global_state, process_groups)
    everywhere = _all_ranks(finished, torch)
    if finished:  # every rank has left the run: no peer is still in a collective on its groups
        _tear_down(destroy_global_state, process_groups)
    gc.freeze()  # what the run imported or cached
    print(f"{THREADS_LINE}{process_groups.thread_count()}", flush=True)
    print(f"{PEAK_THREADS_LINE}{process_groups.thread_peak()}", flush=True)
    print(f"{SECONDS_LINE}{time.monotonic() - started:.1f}", flush=True)
    outcome = FINISHED if everywhere else "failed on this rank" if not finished else "failed on another rank"
    print(f"{STATUS_LINE}{outcome}", flush=True)


def _run(main) -> bool:
    """main(); False (its traceback printed) where it raised or exited."""
    try:
        main()
        return True
    except (Exception, SystemExit):
        traceback.print_exc()
        return False


def _tear_down(destroy_global_state, process_groups) -> None:
    # megatron's destroy drops its groups without closing them: close them, or every run would leave its gloo
    # threads behind in this process
    destroy_global_state()
    process_groups.destroy_parallel_state(synchronize=False)


def _all_ranks(finished: bool, torch) -> bool:
    """Whether the run finished on every rank (one all-reduce on WORLD, made by every rank after every run)."""
    failures = torch.tensor([0 if finished else 1])
    torch.distributed.all_reduce(failures)
    return int(failures) == 0


def check_refusals(cases_path: str) -> None:
    """For each case (flags, world size): the one-line refusal of the start-up checks, or null."""
    sys.path.insert(0, REPO)
    from megatron.zero_bubble.training.setup import prepare_process

    prepare_process()
    from megatron.training.arguments import parse_args

    from megatron.zero_bubble.training import arguments

    results = {}
    for label, (flags, world_size) in json.load(open(cases_path)).items():
        sys.argv = ["pretrain_gpt.py", *flags]
        os.environ["WORLD_SIZE"] = str(world_size)
        try:
            arguments.check(parse_args(arguments.add_arguments), flags)
            results[label] = None
        except arguments.StartupRefusal as refusal:
            results[label] = str(refusal)
    print("REFUSALS " + json.dumps(results))
    # the megatron flags the early checks parse before megatron is imported, as megatron's parser declares them
    parsers = []
    sys.argv = ["pretrain_gpt.py"]
    parse_args(lambda parser: parsers.append(parser) or arguments.add_arguments(parser))
    theirs = {flag: action for action in parsers[0]._actions for flag in action.option_strings}
    ours = {flag: action for action in arguments.early_parser()._actions for flag in action.option_strings}

    def declared(action):
        return None if action is None else [type(action).__name__, action.dest, action.nargs, action.const,
                                            action.default, getattr(action.type, "__name__", action.type)]

    print("EARLY_FLAGS " + json.dumps({flag: [declared(action), declared(theirs.get(flag))]
                                       for flag, action in ours.items()}))
    # `pretrain_gpt.py --help`: megatron's parser with our flags, printed as argparse prints it, then exit 0
    sys.argv, text = ["pretrain_gpt.py", "--help"], io.StringIO()
    with contextlib.redirect_stdout(text):
        try:
            parse_args(arguments.add_arguments)
            status = None
        except SystemExit as exit_:
            status = exit_.code
    print("HELP " + json.dumps({"status": status, "text": text.getvalue()}))
    print("MEGATRON_ASSERT " + json.dumps(_megatron_assert()))


def _megatron_assert() -> dict:
    """A flag combination megatron's own validation refuses with a bare assert (--save without --save-interval),
    through the start-up's parse_and_validate on one rank: its exit status and what it printed."""
    from megatron.zero_bubble.training import arguments

    sys.argv = ["pretrain_gpt.py", *("--zero-bubble-cpu --num-layers 2 --hidden-size 8 --num-attention-heads 2 --seq-length 8 "
                                     "--max-position-embeddings 8 --micro-batch-size 1 --global-batch-size 1 "
                                     "--train-iters 1 --lr 1e-3 --tokenizer-type NullTokenizer --vocab-size 16 "
                                     "--mock-data --save /nonexistent-zb-test/ckpt").split()]
    os.environ.update(WORLD_SIZE="1", RANK="0")
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            arguments.parse_and_validate()
            status = None
        except SystemExit as exit_:
            status = exit_.code
        except BaseException:  # a traceback is what the test rules out: show it
            traceback.print_exc()
            status = "raised"
    return {"status": status, "stdout": out.getvalue(), "stderr": err.getvalue()}


if __name__ == "__mp_main__":  # megatron's checkpoint writer re-imports the main module in a spawned process
    # (its Manager, holding the queue of write results): it runs no megatron code, so the import shims are
    # enough; the whole CPU backend would import megatron.training there (seconds per rank, at the first save).
    sys.path.insert(0, REPO)
    from megatron.zero_bubble.patches import imports

    imports.install()
elif __name__ == "__main__" and len(sys.argv) > 2:
    {"drive": drive, "refusals": check_refusals}[sys.argv[1]](sys.argv[2])
